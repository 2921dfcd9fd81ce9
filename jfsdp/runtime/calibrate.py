"""`train.py --moe adaptive --moe-calibrate FILE`: the adaptive MoE stage calibrated on this run's own devices.

Before training, every variant the adaptive stage could run (`jfsdp.planning.moe_calibrate.candidates`: each
capacity bucket in gather mode and in expert-parallel mode with each chunk count) is compiled as its own
program (`forced`: one bucket, one mode, one chunk count) with this run's mesh, strategy, precision, remat and
micro-batch shape, and timed on the devices (`timed`: the median of a few steps after a warm-up step, on
random tokens: a forced program's time does not depend on the router's load, its capacity is fixed). The
rows are written to FILE in `--moe-calibration`'s format, so a later run can read them instead of measuring
again, and the run starts with them: each bucket runs its fastest measured (mode, chunks).

This is the issue's first source of calibration, step times on the accelerator the run uses. It costs one
compile and a few steps per variant before the first training step.
"""
from __future__ import annotations

import datetime
import json
import os
import sys
import time

import jax
import numpy as np

import jfsdp
from jfsdp.config.moe_calibration import table
from jfsdp.planning import moe_calibrate
from jfsdp.runtime.config import TrainConfig
from jfsdp.runtime.console import note

STEPS = 3   # timed steps per variant, after one warm-up step


def measure(c: TrainConfig, base, shard, vocab: int, lead: bool) -> dict:
    """{(capacity, mode, chunks): seconds} of this run's adaptive stage, measured here; process 0 writes
    them to c.moe_calibrate. `base`: the run's sharded model as the byte model chose (its variants are listed);
    `shard(moe_variant)`: jfsdp.runtime.build.shard_model's (sharded, logits model, loss_fn) for this run with
    its MoE option replaced. Every process compiles and runs every variant (their collectives span them)."""
    chunks = moe_calibrate.CHUNKS if c.moe_chunks == "auto" else (int(c.moe_chunks),)
    variants = moe_calibrate.candidates(base, chunks=chunks)
    rows = max(1, c.batch_size // c.grad_accum)   # one micro-batch, the same in every process (one seed)
    tokens = np.random.default_rng(c.seed).integers(0, vocab, (rows, c.seq_len + 1), dtype=np.int32)
    batch = {k: jax.make_array_from_callback(v.shape, base.batch_sharding, lambda i, v=v: v[i])
             for k, v in {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}.items()}
    note(f"--moe-calibrate: timing {len(variants)} variants (capacity, mode, chunks) on this run's devices, "
         f"one compile each")
    out, t0 = [], time.perf_counter()
    for capacity, mode, k in variants:
        plan, _, loss_fn = shard(lambda option: moe_calibrate.forced(option, capacity, mode, k))
        opt = jfsdp.adamw(1e-4, mask=plan.decay_mask(), clip_norm=c.clip or None)
        step = jfsdp.make_train_step(plan, opt, loss_fn)
        seconds, _ = moe_calibrate.timed(step, jfsdp.init_state(plan, opt, jax.random.key(0)), batch, STEPS)
        out.append({"capacity": capacity, "mode": mode, "chunks": k, "seconds": seconds})
        note(f"  capacity {capacity} {mode} chunks {k}: {seconds * 1e3:.1f} ms per step")
    if lead:
        with open(c.moe_calibrate, "w") as f:
            json.dump({"calibration": out, "device": f"{base.mesh.size} x {jax.devices()[0].device_kind}",
                       "mesh": c.mesh, "model": c.model, "micro_batch": [rows, c.seq_len], "precision": c.precision,
                       "remat": c.remat, "strategy": c.strategy, "date": datetime.date.today().isoformat(),
                       "command": " ".join([os.path.basename(sys.argv[0])] + sys.argv[1:])}, f, indent=1)
        note(f"--moe-calibrate: {time.perf_counter() - t0:.0f} s; wrote {c.moe_calibrate} (--moe-calibration reads it)")
    return table(out)
