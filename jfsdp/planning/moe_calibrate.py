"""Calibrating an adaptive MoE stage's choice by what is measured (`jfsdp.MoE(calibration=...)`).

The byte model of moe.py chooses gather or ep per capacity from the bytes each mode sends; it knows
nothing of what the schedule hides, of chunks, or of compute. A calibration replaces it by measured
seconds per step, per (capacity, mode, chunks): each bucket then runs the fastest one measured.

What is measured, in order of preference (the issue's list):
- step times on a real accelerator, or on XLA:CPU when nothing else is available (`timed`): the
  median of a few steps of the variant's own program;
- on a compile-only GPU target, the compiled program (`modelled`): compute at the target's dense
  peak, plus the wire bytes of every collective that XLA's schedule leaves exposed (no matmul or loop
  in flight while it runs: hlo.overlap) at the target's link bandwidth. Hidden collectives cost
  nothing there, exposed ones their full transfer: a model of the schedule, not a GPU's clock.

Each variant is measured as its own program (`forced`): the adaptive stage with one bucket, in that
mode and chunk count. lax.switch with one branch is the branch itself, so that program is exactly what
the adaptive program runs when it takes this branch, and it drops above its capacity as a static run
at that capacity does.
"""
from __future__ import annotations

import dataclasses
import statistics
import time

import jax

from jfsdp.planning import hlo

# Dense bf16 peak FLOP/s and one device's NVLink bandwidth per direction (bytes/s), per compile target:
# H100/H200 SXM 989 TFLOP/s and NVLink 4 at 900 GB/s both ways; A100 SXM 312 TFLOP/s and NVLink 3 at
# 600 GB/s; B200 2.25 PFLOP/s and NVLink 5 at 1.8 TB/s (NVIDIA's datasheets).
TARGET_RATES = {"h100": (989e12, 450e9), "h200": (989e12, 450e9), "a100": (312e12, 300e9), "b200": (2250e12, 900e9)}
CHUNKS = (1, 2, 4, 8, 16)


def candidates(plan, stage: int | None = None, chunks=CHUNKS) -> list:
    """(capacity, mode, chunks) of every variant the adaptive stage could run at each of its buckets:
    gather, and ep with each chunk count up to the slots per device where S divides E."""
    stages = [s for s in plan.moe_stages if s is not None and s.mode == "adaptive"]
    st = stages[-1] if stage is None else plan.moe_stages[stage]
    S = plan.shards * getattr(plan, "tensor", 1)
    ep_ok = plan.strategy.sharded and st.site.n_experts % S == 0
    out = []
    for v in st.variants:
        out.append((v.capacity, "gather", 1))
        slots = v.costs["tokens"] // (v.costs["units"] * st.site.n_experts * st.site.buckets[2])   # per device
        out += [(v.capacity, "ep", k) for k in chunks if ep_ok and k <= slots]
    return out


def forced(option, capacity: int, mode: str, chunks: int):
    """The MoE option of one variant's own program: one bucket, its mode and chunks."""
    return dataclasses.replace(option, mode="adaptive", buckets=(capacity,), run=mode, chunks=chunks,
                               capacity_factor=None, calibration=None)


def modelled(compiled, n_devices: int, flops_per_device: float, target: str) -> dict:
    """Seconds per step of a program compiled for `target`: flops / peak + exposed wire bytes / link."""
    peak, link = TARGET_RATES[target]
    summ = hlo.overlap_summary(hlo.overlap(compiled.as_text(), n_devices))
    exposed = {k: v["exposed_bytes"] for k, v in summ.items()}
    hidden = {k: v["hidden_bytes"] for k, v in summ.items()}
    compute, comm = flops_per_device / peak, sum(exposed.values()) / link
    return {"seconds": compute + comm, "compute_s": compute, "exposed_comm_s": comm,
            "exposed_bytes": exposed, "hidden_bytes": hidden}


def step_times(step, state, batch, steps: int = 3) -> tuple:
    """([seconds of each of `steps` steps after one warm-up step], the state after them)."""
    state, m = step(state, batch)
    jax.block_until_ready(m)
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        state, m = step(state, batch)
        jax.block_until_ready(m)
        times.append(time.perf_counter() - t)
    return times, state


def timed(step, state, batch, steps: int = 3) -> tuple:
    """(median seconds of `steps` steps after one warm-up step, the state after them)."""
    times, state = step_times(step, state, batch, steps)
    return statistics.median(times), state
