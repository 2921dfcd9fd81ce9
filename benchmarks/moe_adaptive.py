"""Adaptive MoE capacity (jfsdp/engine/moe_adaptive.py) against static capacities, on CPU fake devices.

    python benchmarks/moe_adaptive.py --json benchmarks/results/moe_adaptive.json

moe-test (1 dense + 2 MoE layers, 8 experts, top-2) as train.py runs it: mesh 2x4, 16 x 256 tokens, fp32,
FULL_SHARD, fused loss, AdamW. Programs: a static capacity c for each bucket c (the model's capacity set
to c, in the mode the adaptive plan gives c) and the adaptive program with all the buckets. For each:
compile seconds and XLA's per-device memory (buffer assignment: temp, total); then on a load trace of
two batches, one whose rows each repeat one token (every token of a sequence picks the same two
experts: the load T) and one of random tokens with the embeddings scaled 10x (the router follows the
token: a spread load), the median step time of 5 steps, the capacity run and the fraction of routed
choices dropped (one forward pass with the same parameters).

XLA:CPU times on a shared 2-core VM are noisy and CPU collectives are synchronous: read the time
column as "same order or not", the memory and drop columns as exact.
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
from jfsdp.planning import memory  # noqa: E402
from jfsdp.runtime import metrics as jm  # noqa: E402
from models import moe  # noqa: E402

MESH, ROWS, SEQ, STEPS = "2x4", 16, 256, 5
BUCKETS = (64, 128, 256)
MiB = 2**20


def batches(cfg):
    rng = np.random.default_rng(0)
    skew = np.repeat((np.arange(ROWS) * 7 % cfg.vocab_size)[:, None], SEQ + 1, axis=1)
    spread = rng.integers(0, cfg.vocab_size, (ROWS, SEQ + 1))
    return {name: {"inputs": jnp.asarray(t[:, :-1], jnp.int32), "targets": jnp.asarray(t[:, 1:], jnp.int32)}
            for name, t in (("skewed", skew), ("spread", spread))}


def program(cfg, mesh, mode, buckets=None):
    module, option, loss_fn = models.factory.language_model(cfg, "fused", mode, "auto", buckets=buckets)
    plan = jfsdp.fully_shard(module, mesh, jax.ShapeDtypeStruct((ROWS, SEQ), jnp.int32), moe=option)
    return plan, loss_fn


def run(name, plan, loss_fn, params, data, opt):
    x = jax.ShapeDtypeStruct((ROWS, SEQ), jnp.int32)
    t = time.perf_counter()
    compiled = memory.compile_step(plan, opt, loss_fn, {"inputs": x, "targets": x})
    compile_s = time.perf_counter() - t
    mem = memory.measure(compiled)
    step = jfsdp.make_train_step(plan, opt, loss_fn)
    fwd = jax.jit(jm.forward_metrics(plan, {"capacity": moe.capacity_used, "dropped": moe.dropped_fraction}))
    row = {"program": name, "compile_s": round(compile_s, 2), "temp_mib": mem["temp"] / MiB, "total_mib": mem["total"] / MiB,
           "trace": {}}
    for bname, b in data.items():
        b = plan.put_batch(b)
        got = {k: float(v) for k, v in fwd(plan.shard(params), b).items()}
        state = jfsdp.init_state(plan, opt, params=params)
        state, m = step(state, b)
        jax.block_until_ready(m)
        times = []
        for _ in range(STEPS):
            t = time.perf_counter()
            state, m = step(state, b)
            jax.block_until_ready(m)
            times.append(time.perf_counter() - t)
        row["trace"][bname] = {"step_s": statistics.median(times), **got}
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", required=True)
    a = ap.parse_args()
    cfg = models.get_config("moe-test")
    mesh = jfsdp.make_mesh(MESH, jax.devices()[:8])
    opt = jfsdp.adamw(1e-3)
    data = batches(cfg)
    adaptive, loss_fn = program(cfg, mesh, "adaptive", BUCKETS)
    params = jax.device_get(adaptive.gather(adaptive.init(jax.random.key(0))))
    emb = params["root"]["lm"]["tok_embeddings"]
    emb["embedding"] = emb["embedding"] * 10
    variants = adaptive.moe_stages[-1].variants
    rows = []
    for v in variants:   # the model's capacity forced to c: capacity_factor (c - 1/2) E / (T k), ceil -> c
        static = dataclasses.replace(cfg, capacity_factor=(v.capacity - 0.5) * cfg.n_experts / (SEQ * cfg.top_k))
        plan, lf = program(static, mesh, v.mode)
        rows.append(run(f"static c={v.capacity} ({v.mode})", plan, lf, params, data, opt))
        print(rows[-1], flush=True)
    rows.append(run(f"adaptive {BUCKETS}", adaptive, loss_fn, params, data, opt))
    print(rows[-1], flush=True)
    out = {"command": "python benchmarks/moe_adaptive.py --json " + a.json,
           "device": f"CPU, {os.cpu_count()}-core {platform.machine()}, {jax.device_count()} fake XLA devices",
           "date": datetime.date.today().isoformat(), "jax": jax.__version__, "model": "moe-test", "mesh": MESH,
           "batch": [ROWS, SEQ], "buckets": BUCKETS, "variants": [dataclasses.asdict(v) for v in variants],
           "rows": rows}
    print(f"{'program':28s} {'compile s':>9s} {'temp MiB':>9s} {'total MiB':>9s} | " +
          " | ".join(f"{b}: step s, capacity, dropped" for b in data))
    for r in rows:
        print(f"{r['program']:28s} {r['compile_s']:9.1f} {r['temp_mib']:9.2f} {r['total_mib']:9.2f} | " +
              " | ".join(f"{t['step_s']:.3f} {t['capacity']:.0f} {t['dropped']:.3f}" for t in r["trace"].values()))
    with open(a.json, "w") as f:
        json.dump(out, f, indent=1, default=str)


if __name__ == "__main__":
    main()
