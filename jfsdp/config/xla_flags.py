"""The XLA flags jfsdp sets, per platform, each with why. jax-free: a process reads these before jax starts
its backend (XLA reads XLA_FLAGS once, then), which is why the command lines set them first.

- CPU (`CPU_FLAGS`, `cpu_xla_flags`, `run_hazard`): the planner and the memory benchmarks, which compile
  for XLA:CPU devices without running; train.py runs under XLA:CPU's defaults.
- GPU (`GPU_FLAGS`, `PREFETCH_GPU_FLAGS`, `CONTEXT_GPU_FLAGS`, `flags_for`, `gpu_xla_flags`): a process on real GPUs sets
  them in XLA_FLAGS; compile-only targets pass them per compilation (`jfsdp.planning.targets`).
A flag the user already gave in XLA_FLAGS always wins.
"""
from __future__ import annotations

import os
import shutil


def accelerator_present() -> bool:
    """Whether this host has an NVIDIA GPU or a TPU, found without importing jax (which would start its
    backend before the flags are set)."""
    return bool(shutil.which("nvidia-smi")) or os.path.exists("/dev/nvidia0") or os.path.exists("/dev/accel0")


def flags_in_env(existing: str | None = None) -> set:
    """The names of the flags set in XLA_FLAGS (or in `existing`)."""
    existing = os.environ.get("XLA_FLAGS", "") if existing is None else existing
    return {f.split("=")[0].lstrip("-") for f in existing.split()}


def _added(existing: str | None, flags: dict) -> str:
    existing = os.environ.get("XLA_FLAGS", "") if existing is None else existing
    have = flags_in_env(existing)
    extra = [f"--{k}={str(v).lower()}" for k, v in flags.items() if k not in have]
    return " ".join([existing.strip()] + extra).strip()


# ---- CPUs

# XLA:CPU schedules for concurrency by default (breadth-first): every buffer with nothing to wait for,
# such as the zeros that the backward scan's stacked gradient outputs start from, is created at the
# start of the step and lives through the head's backward. Its memory-minimizing scheduler creates
# them where they are needed (the figures: docs/planner.md). XLA:CPU reads this option from
# XLA_FLAGS only (per-compilation options left the buffer assignment unchanged), so a process sets
# it before jax starts its backend. GPUs have their own scheduler.
#
# For compiling only, never for running: a multi-device program compiled under it and *executed* on
# XLA:CPU (jax/jaxlib 0.10.2) read wrong buffers in its collectives (NaN losses from the first step)
# or aborted in a collective's rendezvous, on jfsdp's own Llama from 512 tokens (docs/limits.md,
# "XLA:CPU collectives"). The planner and the memory benchmarks only compile, so they keep it; train.py
# runs under XLA's default scheduler, and a train step refuses to run on several CPU devices under it
# (`run_hazard`).
CPU_FLAGS = {"xla_cpu_enable_concurrency_optimized_scheduler": "false"}


def cpu_xla_flags(existing: str | None = None) -> str:
    """XLA_FLAGS with CPU_FLAGS added (a flag already present wins): for a process that only compiles
    for CPU devices to measure memory (the planner, the memory benchmarks), set before jax initializes
    its backend. Not for a process that runs a multi-device step (`run_hazard`)."""
    return _added(existing, CPU_FLAGS)


def run_hazard(existing: str | None = None) -> str | None:
    """Why a step on several XLA:CPU devices must not run under these XLA_FLAGS (default: the
    environment's), or None. The memory-minimizing scheduler's programs, run, mix up collectives
    between devices: wrong numbers or an abort (CPU_FLAGS)."""
    existing = os.environ.get("XLA_FLAGS", "") if existing is None else existing
    for f in existing.split():
        name, _, value = f.lstrip("-").partition("=")
        if name == "xla_cpu_enable_concurrency_optimized_scheduler" and value.lower() in ("false", "0"):
            return ("XLA_FLAGS sets --xla_cpu_enable_concurrency_optimized_scheduler=false: XLA:CPU (jax 0.10) "
                    "runs such a program's collectives out of step between devices, which gives NaN losses or "
                    "aborts in a rendezvous (docs/limits.md); it is for compiling only (the planner): unset it "
                    "to run a step on several CPU devices")
    return None


# ---- GPUs

# Each flag with why jfsdp wants it. On GPU hosts train.py and benchmarks/throughput.py put them in
# XLA_FLAGS before jax starts its backend (`gpu_xla_flags`); compile-only targets get them per
# compilation (`compiler_options`). A flag the user gave in XLA_FLAGS (or in `overrides`) wins.
GPU_FLAGS = {
    # FSDP's prefetch: XLA:GPU pipelines the all-gather of the scan's next iteration into the current
    # one (the next unit is gathered while this one computes); without it each unit's gather waits
    # at the top of the loop body with nothing to hide behind (only a convert between start and done).
    "xla_gpu_enable_pipelined_all_gather": True,
    # The same for the backward scan's reduce-scatter: issued in one iteration, finished in the next,
    # so a unit's gradient is reduced while the next unit's backward computes.
    "xla_gpu_enable_pipelined_reduce_scatter": True,
    # And for the all-reduce of a hybrid (RxS, R > 1) or DDP run.
    "xla_gpu_enable_pipelined_all_reduce": True,
}

# For a plan on jfsdp's own prefetch pipeline (`fully_shard(prefetch=...)`, on by default on GPUs with
# remat 'full' and a resharding strategy), which issues each unit's gather and reduce-scatter where
# it can overlap (the figures: docs/gpus.md):
PREFETCH_GPU_FLAGS = {
    # Off: XLA's collective pipeliner, applied on top of jfsdp's pipeline, peels loop iterations
    # whose gathers then run exposed.
    "xla_gpu_enable_pipelined_all_gather": False,
    "xla_gpu_enable_pipelined_reduce_scatter": False,
    "xla_gpu_enable_pipelined_all_reduce": True,
    # One all-gather and one reduce-scatter per unit, as FSDP's flat parameter: under the default
    # thresholds XLA splits a unit's collectives (llama-1b: four gathers, three feed-forward
    # matrices and the other leaves combined; 8B: four reduce-scatters), and the latency-hiding
    # scheduler, which runs few collectives at a time, leaves the last one of each unit with no
    # compute to hide behind. 2 GiB / 4 GiB cover a unit of the 70B shape in bf16 / fp32.
    "xla_gpu_all_gather_combine_threshold_bytes": 2 * 2**30,
    "xla_gpu_reduce_scatter_combine_threshold_bytes": 4 * 2**30,
    # A unit's gather and the previous unit's reduce-scatter in flight together (FSDP2 runs them on
    # two streams), not one after the other. At small batches a unit's backward is shorter than both
    # collectives in a row: llama-8b on 1x64, one 2,048-token sequence per device, remat full (H100
    # target, compiled without a GPU, 2026-11-26) left the backward's re-gather exposed in every
    # iteration, 13.76 GiB of all-gathers exposed with one in flight, 1.76 with two (+0.22 GiB of
    # memory). At torchtitan's 8B shape (16 x 8192 on 1x8, remat dots) nothing changes but +0.52
    # GiB. XLA marks the option experimental.
    "xla_gpu_experimental_parallel_collective_overlap_limit": 2,
}


# For a plan with async TP (`fully_shard(async_tp=...)`, on by default on GPUs at T > 1), whose rings
# of collective-permutes run beside the FSDP gathers and reduce-scatters:
ASYNC_TP_GPU_FLAGS = {
    # Two collectives in flight at a time instead of one. With one, each ring's hop takes the slot
    # that an FSDP gather needs while the matmuls run, and the gathers go exposed: llama-8b on
    # 1x4 --tensor 2 (8 H100s, 8 x 8192, compiled without a GPU) exposed 10.33 of 10.48 GiB of FSDP
    # all-gathers, 1.04 with two (docs/tensor-parallel.md, "Async TP"). XLA marks the option
    # experimental.
    "xla_gpu_experimental_parallel_collective_overlap_limit": 2,
}


# For a plan with context parallelism (C > 1), whose ring attention (jfsdp/engine/parallel/ring.py) has,
# while one block's attention computes, the next hop's K and V and the previous hop's dK and dV in flight:
CONTEXT_GPU_FLAGS = {
    # Four collectives in flight instead of one (two with the pipeline or async TP). With one, the ring's
    # K and V sends of a hop run one after the other, and the second had no attention left to hide
    # behind; with two, the backward's dK/dV sends took the slots of the next K/V. Ring attention at
    # llama-8b's shape (32 query and 8 K/V heads of 128, bf16), compiled for H100s without one
    # (2026-11-26, benchmarks/context_ring.py --h100): at C = 4, 65,536 tokens, 3 of 18 permutes exposed
    # with four (the first hop of each pass), 5 with two, 11 with one. XLA combines sends of up to 30 MiB
    # into one op, which hides the difference at smaller blocks. XLA marks the option experimental.
    "xla_gpu_experimental_parallel_collective_overlap_limit": 4,
}


def own_scan_flags(unit: tuple | None) -> dict:
    """For a model given as it is that runs its units in its own scan (`nn.scan`, `nnx.scan`), whose
    gathers and reduce-scatters XLA's collective pipeliner moves (GPU_FLAGS): combine thresholds of one
    unit, `unit` = (the largest such unit's gathered bytes, its reduced shard's bytes; what the
    all-gather and reduce-scatter combiners measure), or {} for None. The pipeliner peels iterations
    out of both loops (the forward's first, the backward's first and last); their gathers have no
    inputs but the parameters, and under the default thresholds XLA merged those of three units into
    one op at the top of the step, with nothing to hide behind, and left two units' reduce-scatters
    exposed at its end instead of one (tests/test_gpu_target.py's own-scan case, 4 units of width 256,
    H100 target, the thresholds dropped through compile_step's overrides: 3.74 MiB of all-gathers exposed
    against 1.32 with these thresholds, 5.07 MiB of reduce-scatters against 2.64, `Stacked`'s
    2.53 and 2.64). One unit per collective is also FSDP's flat parameter; at llama-1b the default
    split a unit's gather into four (docs/any-model.md, "The model's own scan"). The reduced bytes
    also hold the root's leaves no larger than a unit's smallest (`own_scan_unit`): at llama-8b XLA combined the
    final norm's reduce-scatter with the backward loop's last pipelined unit, one unit's threshold then
    split that unit in two, and the larger part ran exposed (reduce-scatters 1.27x `Stacked`'s)."""
    if not unit:
        return {}
    gathered, reduced = unit
    return {"xla_gpu_all_gather_combine_threshold_bytes": int(gathered),
            "xla_gpu_reduce_scatter_combine_threshold_bytes": int(reduced)}


def flags_for(prefetch: bool = False, async_tp: bool = False, context: bool = False,
              own_scan: tuple | None = None) -> dict:
    """The XLA:GPU flags jfsdp wants for a plan with (True) or without its prefetch pipeline, with or
    without async TP, with or without context parallelism, and, for a model that scans its own units,
    with `own_scan_flags(own_scan)`."""
    return {**(PREFETCH_GPU_FLAGS if prefetch else GPU_FLAGS), **own_scan_flags(own_scan),
            **(ASYNC_TP_GPU_FLAGS if async_tp else {}), **(CONTEXT_GPU_FLAGS if context else {})}


def gpu_xla_flags(existing: str | None = None, prefetch: bool = False, async_tp: bool = False,
                  context: bool = False, own_scan: tuple | None = None) -> str:
    """XLA_FLAGS with jfsdp's GPU flags added (those already present win): for a process that runs
    on real GPUs (train.py), to be set before jax initializes its backend. `prefetch`, `async_tp`,
    `context`: whether the plan will run jfsdp's prefetch pipeline, async TP and a ring over C > 1;
    `own_scan`: a model's own scan's unit bytes (`flags_for`; `jfsdp.planning.targets.own_scan_unit`
    gives them for a plan)."""
    return _added(existing, flags_for(prefetch, async_tp, context, own_scan))
