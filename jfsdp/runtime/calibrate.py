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
import jax.numpy as jnp
import numpy as np

import jfsdp
from jfsdp.config.moe_calibration import table
from jfsdp.planning import moe_calibrate
from jfsdp.runtime.config import TrainConfig
from jfsdp.runtime.console import note

STEPS = 3   # timed steps per variant, after one warm-up step


def measure(c: TrainConfig, models, model, mesh, strategy, mp, lead: bool) -> dict:
    """{(capacity, mode, chunks): seconds} of this run's adaptive stage, measured here; process 0 writes
    them to c.moe_calibrate. Every process compiles and runs every variant (their collectives span them)."""
    rows = max(1, c.batch_size // c.grad_accum)
    example = jax.ShapeDtypeStruct((rows, c.seq_len), jnp.int32)
    module, option, loss_fn = models.factory.language_model(model.config, c.loss, c.moe, c.moe_chunks,
                                                           buckets=c.moe_buckets, capacity_cap=c.moe_capacity_cap)

    def shard(moe):
        return jfsdp.fully_shard(module, mesh, example, strategy=strategy, mp_policy=mp, remat=c.remat, moe=moe)

    chunks = moe_calibrate.CHUNKS if c.moe_chunks == "auto" else (int(c.moe_chunks),)
    variants = moe_calibrate.candidates(shard(option), chunks=chunks)
    tokens = np.random.default_rng(c.seed).integers(0, model.config.vocab_size, (rows, c.seq_len + 1), dtype=np.int32)
    note(f"--moe-calibrate: timing {len(variants)} variants (capacity, mode, chunks) on this run's devices, "
         f"one compile each")
    out, t0 = [], time.perf_counter()
    for capacity, mode, k in variants:
        plan = shard(moe_calibrate.forced(option, capacity, mode, k))
        opt = jfsdp.adamw(1e-4, mask=plan.decay_mask(), clip_norm=c.clip or None)
        step = jfsdp.make_train_step(plan, opt, loss_fn)
        host = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}   # the same in every process (one seed)
        batch = {k: jax.make_array_from_callback(v.shape, plan.batch_sharding, lambda i, v=v: v[i])
                 for k, v in host.items()}
        seconds, _ = moe_calibrate.timed(step, jfsdp.init_state(plan, opt, jax.random.key(0)), batch, STEPS)
        out.append({"capacity": capacity, "mode": mode, "chunks": k, "seconds": seconds})
        note(f"  capacity {capacity} {mode} chunks {k}: {seconds * 1e3:.1f} ms per step")
    if lead:
        with open(c.moe_calibrate, "w") as f:
            json.dump({"calibration": out, "device": f"{len(mesh.devices.flat)} x {jax.devices()[0].device_kind}",
                       "mesh": c.mesh, "model": c.model, "micro_batch": [rows, c.seq_len], "precision": c.precision,
                       "remat": c.remat, "strategy": c.strategy, "date": datetime.date.today().isoformat(),
                       "command": " ".join([os.path.basename(sys.argv[0])] + sys.argv[1:])}, f, indent=1)
        note(f"--moe-calibrate: {time.perf_counter() - t0:.0f} s; wrote {c.moe_calibrate} (--moe-calibration reads it)")
    return table(out)
