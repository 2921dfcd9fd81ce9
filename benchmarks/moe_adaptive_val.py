"""`train.py --model moe-test --mesh 2x4 --moe adaptive` against `--moe auto` (static capacity factor 1.25):
the validation losses, and what makes them differ.

    python benchmarks/moe_adaptive_val.py --part step0 --json benchmarks/results/moe_adaptive_val.json
    python benchmarks/moe_adaptive_val.py --part runs --json benchmarks/results/moe_adaptive_val.json \\
        benchmarks/results/moe_adaptive_val/*.jsonl
    python benchmarks/moe_adaptive_val.py --part nodrop --json benchmarks/results/moe_adaptive_val.json CKPT_DIR

Each part replaces its own entry of the JSON file.

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
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import re
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

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
    return {"device": f"CPU, {os.cpu_count()}-core {platform.machine()}, 8 fake XLA devices", "model": "moe-test",
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
    return {"device": f"CPU, {os.cpu_count()}-core {platform.machine()}, 8 fake XLA devices", **out}


def runs_part(files):
    runs = []
    for f in sorted(files):
        m = re.match(r"(adaptive|auto|gather|ep)_s(\d+)", os.path.basename(f))
        if not m:
            bad(f"{f}: name a metrics file MODE_sSEED.jsonl (e.g. adaptive_s0.jsonl)")
        recs = [json.loads(line) for line in open(f) if line.strip()]
        val = [r for r in recs if "val_loss" in r]
        train = [r for r in recs if "loss" in r and "val_loss" not in r]
        last = val[-1]
        runs.append({"mode": m.group(1), "seed": int(m.group(2)), "file": f, "step": last["step"],
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
    return {"device": f"CPU, {os.cpu_count()}-core {platform.machine()}, 8 fake XLA devices", "runs": runs,
            "summary": summary, "adaptive_minus_static": diffs}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", required=True)
    ap.add_argument("--part", choices=("step0", "runs", "nodrop"), required=True)
    ap.add_argument("files", nargs="*", help="--part runs: the runs' metrics files, MODE_sSEED.jsonl; --part nodrop: "
                    "the --ckpt-dir of a static run")
    a = ap.parse_args()
    if a.part == "runs" and not a.files:
        bad("--part runs needs the runs' metrics files")
    out = json.load(open(a.json)) if os.path.exists(a.json) else {}
    if a.part == "nodrop" and len(a.files) != 1:
        bad("--part nodrop needs one checkpoint folder")
    res = step0_part() if a.part == "step0" else runs_part(a.files) if a.part == "runs" else nodrop_part(a.files[0])
    import jax
    out[a.part] = {**res, "date": datetime.date.today().isoformat(), "jax": jax.__version__,
                   "command": " ".join(["python", "benchmarks/moe_adaptive_val.py", *sys.argv[1:]])}
    with open(a.json, "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps(out[a.part], indent=1)[:6000])


if __name__ == "__main__":
    main()
