"""`train.py --model moe-test --mesh 2x4 --moe adaptive` against `--moe auto` (static capacity factor 1.25):
the validation losses, and what makes them differ.

    python benchmarks/moe_adaptive_val.py --part step0 --json benchmarks/results/moe_adaptive_val.json
    python benchmarks/moe_adaptive_val.py --part runs --json benchmarks/results/moe_adaptive_val.json \\
        benchmarks/results/moe_adaptive_val/*.jsonl
    python benchmarks/moe_adaptive_val.py --part nodrop --json benchmarks/results/moe_adaptive_val.json CKPT_DIR

Each part replaces its own entry of the JSON file (or the entry --key names).

step0: the initial parameters of each seed (train.py's init: `jfsdp.init_state(plan, adamw, key(seed))`), on
  train.py's validation batches (4 x 16 x 256 tokens of the default corpus, `Loader.val_batches`), evaluated
  as train.py's evaluation does (the training plan's forward, `forward_metrics`) under four plans: static
  capacity 80 (`--moe auto`: ceil(1.25 x 256 x 2 / 8)), adaptive (buckets 64, 128, 256), static capacity 256
  (= T: drops nothing) and adaptive with the one bucket 80. The parameters are equal under every plan
  (asserted), so only the forward differs: if drops alone explain the step-0 gap, static 256 equals adaptive
  and adaptive (80) equals static 80, up to reassociation.
runs: the metrics files of train.py runs (`--metrics-out`, one file per run, named MODE_sSEED.jsonl): each
  run's last validation record (val_loss, and the language-model loss, aux loss and dropped share that
  train.py's evaluation logs for MoE models) and its last logged training step's dropped share; per mode
  the mean and the sample standard deviation over seeds, and per seed the difference adaptive - static.
nodrop: a static run's last checkpoint (train.py --moe auto --ckpt-dir DIR) evaluated as above at its own
  capacity 80 and at capacity 256, which drops nothing.
train: runs the train.py pairs the other parts read, one process at a time, into DIR (MODE_sSEED.jsonl and
  .log; a file already there is kept): `--moe adaptive` and `--moe auto` for each of --seeds, 150 steps
  (warm-up 30, cosine), logged every 25 and evaluated every 50; with --stop-after N, logged and evaluated
  every --every steps and stopped once step N's evaluation is written (the learning-rate schedule stays
  the 150-step one); --train-args adds train.py arguments (`--grad-accum 2`: the same run rounded
  differently, below). Writes no JSON.
early: per evaluation step of such runs (stopped ones; or whole ones, `--key steps300` for the default 300
  steps), per seed, adaptive's validation loss minus the static run's: how many seeds have it at or below
  zero, the mean and the sample standard deviation.
floor: the same runs twice, the second time rounded differently: two folders of MODE_sSEED.jsonl, the second
  made with --train-args="--grad-accum 2" (two micro-batches of 8 sequences instead of one of 16; routing
  groups, capacities, the loss and the load-balancing term are per sequence, so this is the same step
  with its sums in another order, and a seed's losses agree to a bit or two at first). On this machine
  --xla_cpu_max_isa=AVX2 changes nothing (bitwise the same validation losses at step 150, seeds 5-7,
  2026-11-27), nor does the mesh 1x8 for 2x4 (the same gradient norm at step 25, seed 5). Per mode and
  seed, the difference of the last validation loss: its spread is what two runs that differ in nothing
  but rounding come apart by, the floor under any comparison of two training runs' final losses at this
  length.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import glob
import json
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

DEVICE = f"CPU, {os.cpu_count()}-core {platform.machine()}, 8 fake XLA devices"   # what every part ran on
SEEDS = (0, 1, 2)


def bad(message: str):
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def step0_part():
    import jax
    import numpy as np

    import jfsdp
    from jfsdp.io import data as jdata
    from jfsdp.runtime import build
    from jfsdp.runtime import metrics as jm
    from jfsdp.runtime.config import TrainConfig

    c = TrainConfig(model="moe-test", mesh="2x4")
    models = build.load_models()
    model = build.choose_model(c, models)
    mesh = jfsdp.make_mesh(c.mesh, jax.devices()[:8])
    corpus = jdata.load_tokens(None, model.config.vocab_size)
    loader = jdata.Loader(corpus, c.batch_size, c.seq_len)
    strategy, mp = jfsdp.Strategy.parse(c.strategy), jfsdp.MixedPrecision.parse(c.precision)
    T, k, E = c.seq_len, model.config.top_k, model.config.n_experts
    whole = dataclasses.replace(model, config=dataclasses.replace(model.config, capacity_factor=E / k))   # C = T
    plans = {"static 80 (auto)": (c, model), "adaptive (64, 128, 256)": (dataclasses.replace(c, moe="adaptive"), model),
             f"static {T}": (c, whole), "adaptive (80)": (dataclasses.replace(c, moe="adaptive", moe_buckets="80"), model)}
    out = {"plans": list(plans), "seeds": []}
    built = {}
    for name, (cc, mm) in plans.items():
        sharded, _, loss_fn = build.shard_model(cc, models, mm, mesh, strategy, mp)
        fns = {"loss": loss_fn, **build.eval_metrics(models, mm, loss_fn), "capacity": models.moe.capacity_used}
        built[name] = (sharded, jax.jit(jm.forward_metrics(sharded, fns)))
    first = next(iter(built.values()))[0]
    val = [first.put_batch(b) for b in loader.val_batches(c.eval_iters)]
    opt = build.make_optimizer(c, first)[1]
    for seed in SEEDS:
        row = {"seed": seed}
        ref = None
        for name, (sharded, fn) in built.items():
            params = jfsdp.init_state(sharded, opt, jax.random.key(seed)).params
            full = jax.device_get(sharded.gather(params))
            if ref is None:
                ref = full
            same = jax.tree.all(jax.tree.map(lambda a, b: bool(np.array_equal(a, b)), ref, full))
            assert same, f"{name}: the initial parameters differ from the first plan's"
            got = jax.device_get([fn(params, b) for b in val])
            row[name] = {m: float(np.mean([float(g[m]) for g in got])) for m in got[0]}
            print(seed, name, row[name], flush=True)
        out["seeds"].append(row)
    out["note"] = "initial parameters equal (bitwise) under every plan, for every seed"
    return {"device": DEVICE, "model": "moe-test",
            "mesh": c.mesh, "batch": f"{c.eval_iters} x {c.batch_size} x {c.seq_len} validation tokens", **out}


def nodrop_part(ckpt_dir):
    """The last checkpoint of a static (`--moe auto`) train.py run on train.py's validation batches, under its
    own capacity (80) and under capacity T = 256 (drops nothing): whether its validation loss owes anything to
    the choices its evaluation drops."""
    import jax
    import numpy as np

    import jfsdp
    from jfsdp.io import checkpoint as jckpt
    from jfsdp.io import data as jdata
    from jfsdp.runtime import build
    from jfsdp.runtime import metrics as jm
    from jfsdp.runtime.config import TrainConfig

    c = TrainConfig(model="moe-test", mesh="2x4")
    models = build.load_models()
    model = build.choose_model(c, models)
    mesh = jfsdp.make_mesh(c.mesh, jax.devices()[:8])
    loader = jdata.Loader(jdata.load_tokens(None, model.config.vocab_size), c.batch_size, c.seq_len)
    strategy, mp = jfsdp.Strategy.parse(c.strategy), jfsdp.MixedPrecision.parse(c.precision)
    E, k = model.config.n_experts, model.config.top_k
    whole = dataclasses.replace(model, config=dataclasses.replace(model.config, capacity_factor=E / k))
    ckpt = jckpt.Checkpointer(ckpt_dir)
    step = ckpt.latest_step()
    out = {"checkpoint": f"{ckpt_dir} step {step}"}
    for name, mm in (("capacity 80 (its own)", model), (f"capacity {c.seq_len} (drops nothing)", whole)):
        sharded, _, loss_fn = build.shard_model(c, models, mm, mesh, strategy, mp)
        opt = build.make_optimizer(c, sharded)[1]
        state = ckpt.restore(step, jfsdp.abstract_state(sharded, opt), plan=sharded)
        fn = jax.jit(jm.forward_metrics(sharded, {"loss": loss_fn, **build.eval_metrics(models, mm, loss_fn)}))
        got = jax.device_get([fn(state.params, sharded.put_batch(b)) for b in loader.val_batches(c.eval_iters)])
        out[name] = {m: float(np.mean([float(g[m]) for g in got])) for m in got[0]}
        print(name, out[name], flush=True)
    ckpt.close()
    return {"device": DEVICE, **out}


def records(f):
    """The records of a metrics file (train.py's --metrics-out: one JSON object a line)."""
    with open(f) as lines:
        return [json.loads(line) for line in lines if line.strip()]


def mode_and_seed(f, modes=("adaptive", "auto")):
    """(mode, seed) from a metrics file's name, MODE_sSEED.jsonl; anything else is an error."""
    m = re.match(rf"({'|'.join(modes)})_s(\d+)\.jsonl$", os.path.basename(f))
    if not m:
        bad(f"{f}: name a metrics file MODE_sSEED.jsonl, MODE one of {', '.join(modes)} (e.g. adaptive_s0.jsonl)")
    return m.group(1), int(m.group(2))


def runs_part(files):
    runs = []
    for f in sorted(files):
        mode, seed = mode_and_seed(f, ("adaptive", "auto", "gather", "ep"))
        recs = records(f)
        val = [r for r in recs if "val_loss" in r]
        train = [r for r in recs if "loss" in r and "val_loss" not in r]
        last = val[-1]
        runs.append({"mode": mode, "seed": seed, "file": f, "step": last["step"],
                     "val_loss": last["val_loss"], "val_lm_loss": last.get("val_lm_loss"),
                     "val_moe_aux_loss": last.get("val_moe_aux_loss"), "val_moe_dropped": last.get("val_moe_dropped"),
                     "val0_loss": val[0]["val_loss"], "train_dropped": train[-1].get("moe_dropped"),
                     "train_capacity": train[-1].get("moe_capacity"), "time_s": train[-1].get("time_s")})
    summary = {}
    for mode in sorted({r["mode"] for r in runs}):
        rs = [r for r in runs if r["mode"] == mode]
        summary[mode] = {}
        for key in ("val_loss", "val_lm_loss", "val_moe_dropped", "train_dropped"):
            xs = [r[key] for r in rs if r[key] is not None]
            if xs:
                summary[mode][key] = {"mean": statistics.mean(xs), "sd": statistics.stdev(xs) if len(xs) > 1 else None,
                                      "n": len(xs)}
    by_seed = {}
    for r in runs:
        by_seed.setdefault(r["seed"], {})[r["mode"]] = r
    diffs = [{"seed": s, **{k: d["adaptive"][k] - d["auto"][k] for k in ("val_loss", "val_lm_loss")
                            if d["adaptive"][k] is not None and d["auto"][k] is not None}}
             for s, d in sorted(by_seed.items()) if "adaptive" in d and "auto" in d]
    return {"device": DEVICE, "runs": runs,
            "summary": summary, "adaptive_minus_static": diffs}


def read_runs(files):
    """{seed: {mode: [metrics records]}} from files named MODE_sSEED.jsonl (adaptive or auto)."""
    out = {}
    for f in sorted(files):
        mode, seed = mode_and_seed(f)
        out.setdefault(seed, {})[mode] = records(f)
    return out


def spread(xs):
    return {"n": len(xs), "mean": statistics.mean(xs), "sd": statistics.stdev(xs) if len(xs) > 1 else None,
            "at_or_below_zero": sum(x <= 0 for x in xs)}


def early_part(files):
    runs = read_runs(files)
    steps = sorted({r["step"] for d in runs.values() for rs in d.values() for r in rs if "val_loss" in r})
    out = []
    for step in steps:
        diffs = []
        for seed, d in sorted(runs.items()):
            v = {m: next((r["val_loss"] for r in d.get(m, []) if "val_loss" in r and r["step"] == step), None)
                 for m in ("adaptive", "auto")}
            if None not in v.values():
                diffs.append({"seed": seed, "adaptive": v["adaptive"], "auto": v["auto"],
                              "difference": v["adaptive"] - v["auto"]})
        if diffs:
            out.append({"step": step, **spread([x["difference"] for x in diffs]), "seeds": diffs})
    return {"device": DEVICE, "by_step": out}


def floor_part(first_dir, second_dir):
    a = read_runs(glob.glob(os.path.join(first_dir, "*_s*.jsonl")))
    b = read_runs(glob.glob(os.path.join(second_dir, "*_s*.jsonl")))
    last = lambda rs: [r for r in rs if "val_loss" in r][-1]   # noqa: E731
    out = {"first": first_dir, "second": second_dir, "modes": {}}
    for mode in ("adaptive", "auto"):
        rows = [{"seed": s, "step": last(b[s][mode])["step"], "first": last(a[s][mode])["val_loss"],
                 "second": last(b[s][mode])["val_loss"]} for s in sorted(b) if mode in b[s] and mode in a.get(s, {})]
        for r in rows:
            r["difference"] = r["second"] - r["first"]
        if rows:
            out["modes"][mode] = {**spread([r["difference"] for r in rows]), "runs": rows}
    if not out["modes"]:
        bad(f"no run of the same mode and seed in both {first_dir} and {second_dir}")
    return {"device": DEVICE, **out}


def train_runs(out_dir, seeds, stop_after, every, train_args):
    """train.py's pairs (module docstring, `train`), one process at a time."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    os.makedirs(out_dir, exist_ok=True)
    log, ev = ("25", "50") if stop_after is None else (str(every), str(every))
    for seed in seeds:
        for mode in ("adaptive", "auto"):
            f = os.path.join(out_dir, f"{mode}_s{seed}.jsonl")
            if os.path.exists(f):
                continue
            env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
            cmd = [sys.executable, os.path.join(root, "train.py"), "--model", "moe-test", "--mesh", "2x4", "--moe", mode,
                   "--steps", "150", "--log-every", log, "--eval-every", ev, "--cpu-devices", "8", "--seed", str(seed),
                   "--no-fit-check", "--metrics-out", f + ".part", *shlex.split(train_args)]
            if stop_after is not None:
                cmd += ["--gen-tokens", "0"]
            t = time.time()
            with open(os.path.join(out_dir, f"{mode}_s{seed}.log"), "w") as logf:
                p = subprocess.Popen(cmd, env=env, stdout=logf, stderr=subprocess.STDOUT)
                mark, stopped = f'"step": {stop_after}, "val_loss"', False
                while p.poll() is None:
                    if stop_after is not None and os.path.exists(f + ".part") and mark in open(f + ".part").read():
                        p.kill()
                        p.wait()
                        stopped = True
                        break
                    time.sleep(0.5)
            if p.returncode != 0 and not stopped:
                bad(f"train.py {mode} seed {seed} failed (exit {p.returncode}): see {logf.name}")
            os.replace(f + ".part", f)
            png = f + ".png"   # train.py's loss plot beside its metrics file: not a result here
            if os.path.exists(png):
                os.remove(png)
            print(f"{mode} seed {seed}: {time.time() - t:.0f} s", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="the results file (every part but train)")
    ap.add_argument("--part", choices=("step0", "runs", "nodrop", "train", "early", "floor"), required=True)
    ap.add_argument("files", nargs="*", help="--part runs / early: the runs' metrics files, MODE_sSEED.jsonl; --part "
                    "nodrop: the --ckpt-dir of a static run; --part train: the folder to write; --part floor: two "
                    "folders of runs, the second rounded differently")
    ap.add_argument("--seeds", default="0-4", help="--part train: seeds, A-B or a comma list")
    ap.add_argument("--stop-after", type=int, help="--part train: stop each run after this step's evaluation")
    ap.add_argument("--every", type=int, default=5, help="--part train with --stop-after: log and evaluate every N steps")
    ap.add_argument("--train-args", default="", help="--part train: more train.py arguments, e.g. \"--grad-accum 2\"")
    ap.add_argument("--key", help="the JSON entry to write (default: the part's name); e.g. --part early --key "
                    "steps300 summarises the 300-step runs per evaluation step beside the stopped runs' entry")
    a = ap.parse_args()
    need = {"runs": (1, None), "early": (1, None), "nodrop": (1, 1), "train": (1, 1), "floor": (2, 2), "step0": (0, 0)}
    lo, hi = need[a.part]
    if len(a.files) < lo or hi is not None and len(a.files) > hi:
        bad(f"--part {a.part} takes {lo if lo == hi else f'at least {lo}'} file or folder argument(s), got {len(a.files)}")
    if a.part == "train":
        try:
            lo_s, _, hi_s = a.seeds.partition("-")
            seeds = range(int(lo_s), int(hi_s) + 1) if hi_s else [int(x) for x in a.seeds.split(",")]
        except ValueError:
            bad(f"--seeds must be A-B or a comma list of integers, got {a.seeds!r}")
        train_runs(a.files[0], seeds, a.stop_after, a.every, a.train_args)
        return
    if not a.json:
        bad(f"--part {a.part} needs --json FILE")
    out = json.load(open(a.json)) if os.path.exists(a.json) else {}
    res = (step0_part() if a.part == "step0" else runs_part(a.files) if a.part == "runs" else
           early_part(a.files) if a.part == "early" else floor_part(*a.files) if a.part == "floor" else
           nodrop_part(a.files[0]))
    import jax
    key = a.key or a.part
    out[key] = {**res, "date": datetime.date.today().isoformat(), "jax": jax.__version__,
                   "command": " ".join(["python", "benchmarks/moe_adaptive_val.py", *sys.argv[1:]])}
    with open(a.json, "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps(out[key], indent=1)[:6000])


if __name__ == "__main__":
    main()
