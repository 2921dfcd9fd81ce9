"""Adaptive MoE (jfsdp/engine/moe_adaptive.py) against every static (mode, chunks, capacity) choice, over a
load trace that shifts from skewed to balanced.

    python benchmarks/moe_adaptive.py --part cpu --json benchmarks/results/moe_adaptive.json
    python benchmarks/moe_adaptive.py --part h100 --json benchmarks/results/moe_adaptive.json

Each part replaces its own entry of the JSON file. Each part's "calibration" rows are what train.py's and
jfsdp.plan's `--moe-calibration FILE:PART` read (jfsdp.config.moe_calibration.read).

cpu: moe-test (1 dense + 2 MoE layers, 8 experts, top-2) as train.py runs it, 8 fake CPU devices, mesh 2x4,
  16 x 256 tokens, fp32, FULL_SHARD, remat none, fused loss, AdamW, embeddings scaled 10x (the router then
  follows the token). The trace: in every row a share q of the tokens is one token of its own (q = 1: the
  whole sequence on two experts, the load T), the rest random; q from 1 down to 0. Every static program
  (the model's capacity set to c; gather, or ep with 1 or 2 chunks) is compiled first, with its capacity
  and the share of routed choices dropped at every point (one forward pass). Timing is interleaved: in
  each round, at each point, every program in a fresh random order runs from a fresh state one warm-up
  step and 3 timed ones; a program's time at a point is the median of its timed steps over the rounds,
  so a slow spell of the machine falls on every program alike. Two such rounds of the static programs
  calibrate the adaptive plan (moe_calibrate's table; each static program's median over the trace, as
  its time does not depend on the load): each bucket runs the fastest. Then 4 rounds time every static
  program, the adaptive one and the adaptive plan with its largest bucket alone (one branch, so no
  conditional: what the switch itself costs against the static program of that capacity).
  (Chunks: 1 only; XLA:CPU's collectives are synchronous, so chunks overlap nothing here.)
  Read the time columns on an idle machine only; the drop columns are exact.
h100: mixtral-8x7b's layer shapes (dim 4096, 8 experts of 14336, top-2, 32 heads, 8 KV heads) with 8 of
  its 32 layers, so that training on 1x8 fits an 80 GB H100 (all 32 layers hold 65 GiB of fp32 state and
  Adam per device at S = 8, and XLA's scheduler then serializes everything), one 4,096-token sequence per
  device, bf16, remat full, compiled for the H100 target (no GPU). Every static (mode, chunks, capacity)
  program compiled once; its time per step modelled by moe_calibrate.modelled (compute at the dense
  bf16 peak + the collectives XLA's schedule leaves exposed at NVLink's 450 GB/s). Those times are the
  calibration. The trace is scripted: per routing group, expert e gets T*k*((1-a)/E + a*[e<2]/2) of the
  choices, a from 1 (two experts take every token) to 0 (balanced); a static capacity c drops the
  choices above c, the adaptive stage runs the smallest bucket that holds the largest load. The
  adaptive program's time at a point is its taken branch's: checked by compiling that branch as its
  own one-bucket adaptive program against the static program (same exposed bytes expected), and the
  whole adaptive program compiled once for its memory.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import dataclasses  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jfsdp  # noqa: E402
import models  # noqa: E402
import models.factory  # noqa: E402
from jfsdp.config import moe_calibration  # noqa: E402
from jfsdp.planning import memory, moe_calibrate, targets  # noqa: E402
from jfsdp.runtime import metrics as jm  # noqa: E402
from models import moe  # noqa: E402

MiB, GiB = 2**20, 2**30
CPU = {"mesh": "2x4", "rows": 16, "seq": 256, "buckets": (64, 128, 256), "chunks": (1,), "steps": 3,
       "calibration_rounds": 2, "rounds": 4, "q": (1.0, 0.75, 0.5, 0.25, 0.0)}
H100 = {"mesh": "1x8", "rows": 8, "seq": 4096, "layers": 8, "buckets": (1024, 2048, 4096), "chunks": (1, 2, 4),
        "a": (1.0, 0.75, 0.5, 0.25, 0.1, 0.0)}


def forced_capacity(cfg, c, seq):
    """The model with its static capacity set to c (ceil of the factor x T x k / E lands on c)."""
    return dataclasses.replace(cfg, capacity_factor=(c - 0.5) * cfg.n_experts / (seq * cfg.top_k))


def trace_batches(cfg, rows, seq, shares):
    rng = np.random.default_rng(0)
    out = []
    for q in shares:
        tok = rng.integers(0, cfg.vocab_size, (rows, seq + 1))
        own = rng.random((rows, seq + 1)) < q
        tok = np.where(own, (np.arange(rows) * 7 % cfg.vocab_size)[:, None], tok)
        out.append({"inputs": jnp.asarray(tok[:, :-1], jnp.int32), "targets": jnp.asarray(tok[:, 1:], jnp.int32)})
    return out


def cpu_part():
    p = CPU
    cfg = models.get_config("moe-test")
    mesh = jfsdp.make_mesh(p["mesh"], jax.devices()[:8])
    opt = jfsdp.adamw(1e-3)
    x = jax.ShapeDtypeStruct((p["rows"], p["seq"]), jnp.int32)
    data = trace_batches(cfg, p["rows"], p["seq"], p["q"])

    def build(c, option):
        module, _, loss_fn = models.factory.language_model(c, "fused", "auto")
        return jfsdp.fully_shard(module, mesh, x, moe=option), loss_fn

    module, base, loss_fn = models.factory.language_model(cfg, "fused", "adaptive", buckets=p["buckets"])
    adaptive = jfsdp.fully_shard(module, mesh, x, moe=base)
    params = jax.device_get(adaptive.gather(adaptive.init(jax.random.key(0))))
    emb = params["root"]["lm"]["tok_embeddings"]
    emb["embedding"] = emb["embedding"] * 10
    fns = {"capacity": moe.capacity_used, "dropped": moe.dropped_fraction}

    def prepare(name, plan, lf, **extra):
        """Compile the program (make_train_step's, donated state: what the rounds run), measure its memory, and read
        each point's capacity and drops (one forward)."""
        t = time.perf_counter()
        compiled = memory.compile_step(plan, opt, lf, {"inputs": x, "targets": x})
        row = {"program": name, **extra, "compile_s": round(time.perf_counter() - t, 1),
               "total_mib": memory.measure(compiled)["total"] / MiB}
        fwd = jax.jit(jm.forward_metrics(plan, fns))
        batches = [plan.put_batch(b) for b in data]
        row["trace"] = [{k: float(v) for k, v in fwd(plan.shard(params), b).items()} for b in batches]
        return row, (plan, compiled, batches)   # the timed steps run the executable measured above: one compile

    def rounds(programs, n):
        """n rounds; in each, every point, and at each point every program in a fresh random order: a fresh
        state from the same parameters, one warm-up step and p["steps"] timed ones. A program's time at a
        point is the median of its n * p["steps"] timed steps, so a slow spell of the machine falls on
        every program alike instead of on whichever ran then."""
        rng = np.random.default_rng(1)
        times = {(i, j): [] for i in range(len(programs)) for j in range(len(data))}
        for _ in range(n):
            for j in range(len(data)):
                for i in rng.permutation(len(programs)):
                    plan, step, batches = programs[i]
                    ts, _ = moe_calibrate.step_times(step, jfsdp.init_state(plan, opt, params=params), batches[j],
                                                     p["steps"])
                    times[i, j] += ts
        return [[statistics.median(times[i, j]) for j in range(len(data))] for i in range(len(programs))]

    statics, progs = [], []
    for c, mode, k in moe_calibrate.candidates(adaptive, chunks=p["chunks"]):
        plan, lf = build(forced_capacity(cfg, c, p["seq"]), jfsdp.MoE(mode=mode, chunks=k))
        row, prog = prepare(f"static {mode} k={k} c={c}", plan, lf, capacity=c, mode=mode, chunks=k)
        statics.append(row)
        progs.append(prog)
        print(row["program"], row["compile_s"], flush=True)
    # calibration: each static program's XLA:CPU step time (median over the trace; the time of a static
    # program does not depend on the load), from rounds of their own before the adaptive program exists
    calib = [{"capacity": r["capacity"], "mode": r["mode"], "chunks": r["chunks"], "seconds": statistics.median(ts)}
             for r, ts in zip(statics, rounds(progs, p["calibration_rounds"]))]
    print("calibration", calib, flush=True)
    option = dataclasses.replace(base, calibration=moe_calibration.table(calib))
    plan = jfsdp.fully_shard(module, mesh, x, moe=option)
    variants = [dataclasses.asdict(v) for v in plan.moe_stages[-1].variants]
    row, prog = prepare(f"adaptive {p['buckets']}", plan, loss_fn)
    # the switch's own cost: the largest bucket alone (one branch, no conditional: the load, its all-reduce
    # and the taken branch's forward again in the backward pass) against the same static program
    top = next(v for v in variants if v["capacity"] == p["buckets"][-1])
    one = dataclasses.replace(option, buckets=(top["capacity"],))
    one_row, one_prog = prepare(f"adaptive ({top['capacity']},) {top['mode']}", jfsdp.fully_shard(module, mesh, x, moe=one),
                                loss_fn, capacity=top["capacity"], mode=top["mode"], chunks=top["chunks"])
    timed = rounds(progs + [prog, one_prog], p["rounds"])
    for r, ts in zip(statics + [row, one_row], timed):
        for t, s in zip(r["trace"], ts):
            t["step_s"] = s
    return {"device": f"CPU, {os.cpu_count()}-core {platform.machine()}, 8 fake XLA devices", "model": "moe-test",
            **p, "calibration": calib, "variants": variants, "static": statics, "adaptive": row,
            "adaptive_one_bucket": one_row}


def h100_flops(cfg, c, seq):
    """Matmul FLOPs per device per step, remat full (forward, recompute, backward = 4 forwards in the
    layers; the head 3): projections and router per token, causal attention scores 2*T*d per token, and
    the experts on all E*c slots of the sequence, empty or not (what a capacity c computes)."""
    d, L = cfg.dim, cfg.n_layers
    kv = cfg.n_kv_heads * (d // cfg.n_heads)
    per_token = 2 * (2 * d * d + 2 * d * kv + d * cfg.n_experts) + 2 * seq * d
    experts = 2 * 3 * d * cfg.expert_dim * cfg.n_experts * c
    return 4 * L * (per_token * seq + experts) + 6 * d * cfg.vocab_size * seq


def h100_part():
    p = H100
    cfg = dataclasses.replace(models.get_config("mixtral-8x7b"), n_layers=p["layers"], attention="cudnn")
    mesh = jfsdp.make_mesh(p["mesh"], targets.devices("h100", p["mesh"]))
    x = jax.ShapeDtypeStruct((p["rows"], p["seq"]), jnp.int32)
    opt, bf16 = jfsdp.adamw(1e-4), jfsdp.MixedPrecision.parse("bf16")

    def compile_one(c, option):
        module, _, lf = models.factory.language_model(c, "fused", "auto", backend="gpu")
        with targets.tracing_for("h100"):
            plan = jfsdp.fully_shard(module, mesh, x, remat="full", mp_policy=bf16, moe=option)
            t = time.perf_counter()
            compiled = targets.compile_step("h100", plan, opt, lf, {"inputs": x, "targets": x})
        return plan, compiled, round(time.perf_counter() - t, 1)

    module, base, lf = models.factory.language_model(cfg, "fused", "adaptive", backend="gpu", buckets=p["buckets"])
    with targets.tracing_for("h100"):
        plan = jfsdp.fully_shard(module, mesh, x, remat="full", mp_policy=bf16, moe=base)
    statics = []
    for c, mode, k in moe_calibrate.candidates(plan, chunks=p["chunks"]):
        _, compiled, cs = compile_one(forced_capacity(cfg, c, p["seq"]), jfsdp.MoE(mode=mode, chunks=k, backend="gpu"))
        statics.append({"capacity": c, "mode": mode, "chunks": k, "compile_s": cs,
                        "total_gib": memory.measure(compiled)["total"] / GiB,
                        **moe_calibrate.modelled(compiled, 8, h100_flops(cfg, c, p["seq"]), "h100")})
        print({k: v for k, v in statics[-1].items() if k not in ("exposed_bytes", "hidden_bytes")}, flush=True)
    option = dataclasses.replace(base, calibration=moe_calibration.table(statics))
    aplan, compiled, cs = compile_one(cfg, option)
    variants = [dataclasses.asdict(v) for v in aplan.moe_stages[-1].variants]
    whole = {"compile_s": cs, "total_gib": memory.measure(compiled)["total"] / GiB}
    mid = variants[len(variants) // 2]   # the branch as its own program, against the static one
    _, compiled, cs = compile_one(cfg, moe_calibrate.forced(base, mid["capacity"], mid["mode"], mid["chunks"]))
    branch = {"capacity": mid["capacity"], "mode": mid["mode"], "chunks": mid["chunks"], "compile_s": cs,
              "total_gib": memory.measure(compiled)["total"] / GiB,
              **moe_calibrate.modelled(compiled, 8, h100_flops(cfg, mid["capacity"], p["seq"]), "h100")}
    E, k, T = cfg.n_experts, cfg.top_k, p["seq"]
    trace = []
    for a in p["a"]:
        load = T * k * ((1 - a) / E + a * (np.arange(E) < 2) / 2)
        pick = next((v for v in variants if v["capacity"] >= load.max()), variants[-1])
        trace.append({"a": a, "max_load": float(load.max()), "adaptive": {
            "capacity": pick["capacity"], "mode": pick["mode"], "chunks": pick["chunks"], "seconds": pick["seconds"],
            "dropped": float(np.maximum(load - pick["capacity"], 0).sum() / (T * k))},
            "static_dropped": {f"{s['mode']} k={s['chunks']} c={s['capacity']}":
                               float(np.maximum(load - s["capacity"], 0).sum() / (T * k)) for s in statics}})
    calib = [{k: s[k] for k in ("capacity", "mode", "chunks", "seconds")} for s in statics]
    return {"device": "H100 SXM 80GB compile-only target (XLA:GPU, no GPU), 8 devices", "model":
            f"mixtral-8x7b shapes, {p['layers']} of 32 layers", **p, "static": statics, "calibration": calib,
            "variants": variants,
            "adaptive_program": whole, "branch_program": branch, "trace": trace}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", required=True)
    ap.add_argument("--part", choices=("cpu", "h100"), required=True)
    ap.add_argument("--key", help="the JSON entry to write (default: the part's name); e.g. cpu_repeat keeps a "
                    "second cpu run beside the first (each entry whose name starts with cpu gets its own section)")
    a = ap.parse_args()
    key = a.key or a.part
    if not key.startswith(a.part):
        ap.error(f"--key must start with the part's name, {a.part}")
    out = json.load(open(a.json)) if os.path.exists(a.json) else {}
    out = {k: v for k, v in out.items() if k.startswith(("cpu", "h100"))}
    out[key] = {**(cpu_part() if a.part == "cpu" else h100_part()), "date": datetime.date.today().isoformat(),
                "jax": jax.__version__, "command": " ".join(["python", "benchmarks/moe_adaptive.py", *sys.argv[1:]])}
    with open(a.json, "w") as f:
        json.dump(out, f, indent=1, default=str)
    print(json.dumps(out[key], indent=1, default=str)[:4000])


if __name__ == "__main__":
    main()
