"""Tensor parallelism compiled for an H100 target on a machine without a GPU (docs/tensor-parallel.md):
llama-8b on 8 GPUs at T = 1 (FSDP 8), 2 and 4 (FSDP 8/T x TP T), bf16, remat full, the fused
vocabulary-parallel loss, the prefetch pipeline (the GPU default; `--no-prefetch`: the plain scan),
with async TP off and on (`--async-tp`). Per device: the compiled program's
memory, the bytes each device sends per step by collective kind and mesh axes (`hlo.per_axes`), FSDP
over `fsdp` (and `fsdp` x `tensor`) and TP over `tensor`, and how many of them are in flight while no
matmul runs on XLA's schedule (`hlo.overlap`: exposed). Nothing runs: XLA:GPU compiles for the
target's topology.

    python benchmarks/tensor_parallel.py --json benchmarks/results/tensor_parallel.json [--tensor 1 2 4]
    python benchmarks/tensor_parallel.py --model llama-70b --devices 256 --tensor 8 --batch 512 \
        --json benchmarks/results/tensor_parallel_70b.json     # torchtitan's 2D setting
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("JAX_PLATFORMS", "cpu")   # the CUDA plugin compiles for the target; no GPU is looked for


def one(model: str, devices: int, tensor: int, batch: int, seq: int, async_tp: bool = False,
        prefetch: bool | None = None) -> dict:
    import jax
    import jax.numpy as jnp

    import jfsdp
    import models
    from jfsdp.planning import hlo, memory, targets
    from models import factory

    # cuDNN's fused attention, as the planner compiles for a named GPU (bf16, head_dim 128)
    cfg = dataclasses.replace(models.get_config(model), attention="cudnn")
    s = devices // tensor
    spec = f"1x{s}"
    with targets.tracing_for("h100"):
        mesh = jfsdp.make_mesh(spec, tensor=tensor, devices=targets.devices("h100", (1, devices)))
        model_, _, loss_fn = factory.language_model(cfg, "fused")
        x = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
        plan = jfsdp.fully_shard(model_, mesh, x, mp_policy=jfsdp.MixedPrecision.parse("bf16"), remat="full",
                                 tensor_plan=factory.tensor_plan(cfg) if tensor > 1 else None, prefetch=prefetch,
                                 async_tp=async_tp if tensor > 1 else None)
        t0 = time.time()
        compiled = targets.compile_step("h100", plan, jfsdp.adamw(1e-4), loss_fn, {"inputs": x, "targets": x})
        compile_s = time.time() - t0
    text, axes = compiled.as_text(), tuple(mesh.shape.items())
    per = hlo.per_axes(text, axes)
    ov = hlo.overlap_summary(hlo.overlap(text, devices, axes), by_axes=True)
    tp = [v for k, v in ov.items() if k.endswith(" over tensor")]
    tp_bytes = sum(v["hidden_bytes"] + v["exposed_bytes"] for v in tp)
    return {"model": model, "devices": devices, "mesh": f"{spec}x{tensor}", "tensor": tensor, "batch": batch,
            "seq_len": seq, "precision": "bf16", "remat": "full", "loss": "fused", "async_tp": async_tp,
            "prefetch": bool(plan.prefetch),
            "compile_s": round(compile_s, 1), "memory": memory.measure(compiled),
            "comm": {f"{kind} {'x'.join(axes) or '-'}": v["wire_bytes"] for (kind, axes), v in sorted(per.items())},
            "overlap": ov,
            "tp_exposed_fraction": round(sum(v["exposed_bytes"] for v in tp) / tp_bytes, 4) if tp_bytes else None}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama-8b")
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--tensor", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--batch", type=int, default=8, help="global batch (rows)")
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--async-tp", nargs="+", default=["off", "on"], choices=("off", "on"),
                   help="async TP settings to compile at each T > 1")
    p.add_argument("--no-prefetch", action="store_true", help="the plain scan of the units (default: the GPU "
                   "default, the prefetch pipeline under remat full)")
    p.add_argument("--json", metavar="FILE")
    a = p.parse_args(argv)
    rows = []
    for t in a.tensor:
        for on in ([False] if t == 1 else [x == "on" for x in a.async_tp]):
            r = one(a.model, a.devices, t, a.batch, a.seq_len, on, False if a.no_prefetch else None)
            print(json.dumps({k: v for k, v in r.items() if k != "overlap"}), flush=True)
            rows.append(r)
    out = {"what": "compiled for an H100 target on a CPU machine", "date": time.strftime("%Y-%m-%d"),
           "command": "python benchmarks/tensor_parallel.py " + " ".join(sys.argv[1:] if argv is None else argv),
           "jax": __import__("jax").__version__, "rows": rows}
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
