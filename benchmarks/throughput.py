"""Training throughput of jfsdp's real train step: tokens/s, TFLOP/s per device, MFU, step time and
peak memory, over a window of steps after warm-up, for named models and strategies.

    python benchmarks/throughput.py --json benchmarks/results/throughput_cpu.json          # CPU, fake devices
    python benchmarks/throughput.py --models llama-1b,llama-8b --mesh 1x8 --precision bf16 --remat full \\
        --batch-size 16 --seq-len 4096 --json throughput_h100.json                        # 8 GPUs

FLOPs are analytic, never read from the compiled program (so remat's recomputation does not count):
`flops_per_token` is jfsdp's count (jfsdp.runtime.metrics.llama_flops_per_token: 6 x matmul parameters, head
included, plus causal attention's half square) and `flops_per_token_torchtitan` torchtitan's (6 x
parameters without the embedding, plus 12·L·H·Q·T: full, not causal, attention). TFLOP/s per device
and MFU use jfsdp's count; MFU is against the device's dense peak (bf16 or TF32), null on CPU.
Peak memory is the allocator's peak on GPUs/TPUs and, on CPU devices (no allocator statistics), the
compiled step's buffer assignment.

On GPUs jfsdp's XLA flags are set before jax starts, as train.py sets them (a flag already in
XLA_FLAGS wins): the prefetch pipeline's (jfsdp.config.xla_flags.PREFETCH_GPU_FLAGS) when the plans will run
jfsdp's prefetch pipeline (jfsdp.config.policy.prefetch_by_default: remat full with full_shard/hybrid_shard
on more than one shard, or JFSDP_PREFETCH), or the step is --update-in-backward 1 (which runs it
too), else the plain scan's (GPU_FLAGS). XLA reads XLA_FLAGS once per process and one invocation
runs every requested strategy (and update-in-backward mode), so the pipeline's flags are set only
when every one of those runs prefetches; a mix gets GPU_FLAGS, says so on stderr, and each JSON row
records `prefetch` (its plan's) and `gpu_flags` (the set in force: "prefetch", "plain", or null off
GPUs). Run the prefetching strategies in an invocation of their own for their flags.
"""
from __future__ import annotations

import argparse
import os
import re
import sys

# `models` is the repository's own package, imported from the repository root (pip installs only jfsdp)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="llama-test,llama-tiny", help="comma-separated names from models.CONFIGS")
    p.add_argument("--strategies", default="full_shard,shard_grad_op,no_shard")
    p.add_argument("--mesh", default="1x8")
    p.add_argument("--precision", default="fp32", help="fp32, bf16, fp8 (float8 unit matmuls and unit gathers) or "
                   "fp8-rowwise (float8 unit matmuls with rowwise scales, bf16 gathers)")
    p.add_argument("--remat", default="none")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--warmup", type=int, default=2, help="steps run before the timed window")
    p.add_argument("--steps", type=int, default=5, help="timed steps")
    p.add_argument("--clip", type=float, default=1.0, help="AdamW's global-norm clip (0: none)")
    p.add_argument("--update-in-backward", default="0", choices=("0", "1", "both"),
                   help="make_train_step(update_in_backward=...): 1 = the optimizer inside the backward pass "
                        "(needs --remat full), both = one row each way")
    p.add_argument("--json", default=None)
    return p.parse_args(argv)


def _ib_modes(a) -> list[bool]:
    return {"0": [False], "1": [True], "both": [False, True]}[a.update_in_backward]


def gpu_prefetch(a) -> tuple[bool, list[str]]:
    """(whether every run of this invocation runs jfsdp's prefetch pipeline on GPUs, the runs that
    do while others do not). A run prefetches when its plan will (jfsdp.config.policy.prefetch_by_default, as
    train.py decides) or its step updates in the backward pass. Bad input counts as not prefetching
    (reported when the run starts). Imports jax, but starts no backend."""
    from jfsdp.config.policy import prefetch_by_default
    from jfsdp.config.errors import ConfigError
    from jfsdp.config.policy import Strategy

    shards = int(a.mesh.lower().partition("x")[2])
    runs = {}
    for strategy in a.strategies.split(","):
        try:
            plan = prefetch_by_default(Strategy.parse(strategy.strip()), a.remat, shards, on_gpu=True)
        except (ConfigError, ValueError):
            plan = False
        for ib in _ib_modes(a):
            runs[strategy.strip() + (" (update in backward)" if ib else "")] = plan or ib
    every = all(runs.values())
    return every, [] if every else [k for k, v in runs.items() if v]


def _setup_devices(a, n: int) -> str | None:
    """Before jax starts: fake n CPU devices where there is no accelerator; on GPUs, jfsdp's flags
    (`gpu_prefetch`). Returns the GPU flag set put in XLA_FLAGS ("prefetch" / "plain"; None off GPUs)."""
    from jfsdp.config.xla_flags import accelerator_present, gpu_xla_flags   # jax-free
    if os.environ.get("JAX_PLATFORMS", "").startswith("cpu") or not accelerator_present():
        flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "", os.environ.get("XLA_FLAGS", ""))
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        return None
    prefetch, left_out = gpu_prefetch(a)
    if left_out:
        print(f"note: XLA_FLAGS are per process and not every run here prefetches: {', '.join(left_out)} run(s) "
              "jfsdp's prefetch pipeline under the plain scan's flags (jfsdp.config.xla_flags.GPU_FLAGS); run them on "
              "their own for jfsdp.config.xla_flags.PREFETCH_GPU_FLAGS", file=sys.stderr)
    os.environ["XLA_FLAGS"] = gpu_xla_flags(prefetch=prefetch)
    return "prefetch" if prefetch else "plain"


def torchtitan_flops_per_token(cfg, seq_len: int) -> float:
    """torchtitan's count for Llama: 6 x (parameters - embedding) + 12 x layers x heads x head_dim x T."""
    return 6.0 * (cfg.num_params() - cfg.vocab_size * cfg.dim) + 12.0 * cfg.n_layers * cfg.dim * seq_len


def run_one(model: str, strategy: str, a, update_in_backward: bool = False) -> dict:
    import time

    import jax
    import jax.numpy as jnp
    import numpy as np

    import jfsdp



    import jfsdp.runtime.metrics
    import jfsdp.planning.targets
    import jfsdp.engine.sharded
    import models
    from jfsdp.runtime import metrics as jm
    from models.factory import language_model

    cfg = models.get_config(model)
    r, s = jfsdp.parse_mesh(a.mesh)
    devices = jax.devices()[: r * s]
    mesh = jfsdp.make_mesh(a.mesh, devices)
    x = jax.ShapeDtypeStruct((a.batch_size, a.seq_len), jnp.int32)
    # the plain head (logits, then cross-entropy), as the figures in benchmarks/results were measured
    lm, _, loss_fn = language_model(cfg, "plain")
    plan = jfsdp.fully_shard(lm, mesh, x, strategy=strategy, remat=a.remat,
                             mp_policy=jfsdp.MixedPrecision.parse(a.precision))
    opt = jfsdp.adamw(1e-4, mask=plan.decay_mask(), clip_norm=a.clip or None)
    state = jfsdp.init_state(plan, opt, jax.random.key(0))
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (a.batch_size, a.seq_len + 1), dtype=np.int32)
    batch = jax.device_put({"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}, plan.batch_sharding)
    step = jfsdp.make_train_step(plan, opt, loss_fn, update_in_backward=update_in_backward)
    t = time.perf_counter()
    compiled = step.lower(state, batch).compile()
    compile_s = time.perf_counter() - t
    for _ in range(a.warmup):
        state, m = compiled(state, batch)
    jax.block_until_ready(state)   # --warmup 0 runs none
    times = []
    for _ in range(a.steps):
        t = time.perf_counter()
        state, m = compiled(state, batch)
        jax.block_until_ready(m)
        times.append(time.perf_counter() - t)
    step_s = float(np.mean(times))
    tps = a.batch_size * a.seq_len / step_s
    fpt = jm.llama_flops_per_token(cfg, a.seq_len)
    tflops = tps * fpt / (r * s) / 1e12
    peak = jm.peak_flops(devices[0], a.precision)
    mem, mem_src = jm.device_memory(devices, compiled)
    from jfsdp.planning.hlo import memory as compiled_memory
    compiled_mem = compiled_memory(compiled)["total"]   # XLA's buffer assignment, beside the allocator's peak
    return {"model": model, "params": cfg.num_params(), "strategy": plan.strategy.value, "mesh": a.mesh,
            "devices": r * s, "device_kind": getattr(devices[0], "device_kind", devices[0].platform),
            "precision": a.precision, "remat": a.remat, "batch_size": a.batch_size, "seq_len": a.seq_len,
            "warmup_steps": a.warmup, "timed_steps": a.steps, "compile_s": round(compile_s, 2),
            "step_s": step_s, "step_s_min": float(np.min(times)), "tokens_per_sec": tps,
            "flops_per_token": fpt, "flops_per_token_torchtitan": torchtitan_flops_per_token(cfg, a.seq_len),
            "tflops_per_device": tflops, "mfu": tflops * 1e12 / peak if peak else None,
            "peak_memory_bytes": mem, "memory_source": mem_src, "compiled_memory_bytes": compiled_mem, "loss": float(m["loss"]),
            "update_in_backward": update_in_backward, "clip": a.clip, "prefetch": plan.prefetch, "gpu_flags": getattr(a, "gpu_flags", None)}


def main(argv=None) -> int:
    a = _args(argv)
    m = re.fullmatch(r"(\d+)x(\d+)", a.mesh)
    if not m or a.steps < 1 or a.warmup < 0:
        print(f"error: bad --mesh '{a.mesh}' or step counts", file=sys.stderr)
        return 2
    a.gpu_flags = _setup_devices(a, int(m.group(1)) * int(m.group(2)))
    import datetime
    import json

    import jax

    import jfsdp
    rows = []
    try:
        for model in a.models.split(","):
            for strategy in a.strategies.split(","):
                for ib in _ib_modes(a):
                    rows.append(run_one(model.strip(), strategy.strip(), a, ib))
                    r = rows[-1]
                    mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "n/a"
                    print(f"{r['model']:12} {r['strategy']:14}{' ib' if ib else '   '} {r['tokens_per_sec']:>10,.0f} tok/s  "
                          f"{r['step_s'] * 1e3:8.1f} ms/step  {r['tflops_per_device']:.4f} TFLOP/s/dev  MFU {mfu:>6}  "
                          f"{r['peak_memory_bytes'] / 2**20:8.1f} MiB/dev ({r['memory_source']})", flush=True)
    except (jfsdp.ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = {"date": datetime.date.today().isoformat(), "backend": jax.default_backend(),
           "jax": jax.__version__, "command": "python benchmarks/throughput.py " + " ".join(argv or sys.argv[1:]),
           "rows": rows}
    if a.json:
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        with open(a.json, "w") as fh:
            json.dump(out, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
