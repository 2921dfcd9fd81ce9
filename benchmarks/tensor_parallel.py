"""Tensor parallelism compiled for an H100 target on a machine without a GPU (docs/tensor-parallel.md):
llama-8b on 8 GPUs at T = 1 (FSDP 8), 2 and 4 (FSDP 8/T x TP T), bf16, remat full, the fused
vocabulary-parallel loss. Per device: the compiled program's memory, and the bytes each device sends
per step by collective kind and mesh axes (`hlo.per_axes`), FSDP over `fsdp` (and `fsdp` x `tensor`)
and TP over `tensor`. Nothing runs: XLA:GPU compiles for the target's topology.

    python benchmarks/tensor_parallel.py --json benchmarks/results/tensor_parallel.json [--tensor 1 2 4]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("JAX_PLATFORMS", "cpu")   # the CUDA plugin compiles for the target; no GPU is looked for


def one(model: str, devices: int, tensor: int, batch: int, seq: int) -> dict:
    import jax
    import jax.numpy as jnp

    import jfsdp
    import models
    from jfsdp.planning import hlo, memory, targets
    from models import factory

    cfg = models.get_config(model)
    s = devices // tensor
    spec = f"1x{s}"
    with targets.tracing_for("h100"):
        mesh = jfsdp.make_mesh(spec, tensor=tensor, devices=targets.devices("h100", (1, devices)))
        model_, _, loss_fn = factory.language_model(cfg, "fused")
        x = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
        plan = jfsdp.fully_shard(model_, mesh, x, mp_policy=jfsdp.MixedPrecision.parse("bf16"), remat="full",
                                 tensor_plan=factory.tensor_plan(cfg) if tensor > 1 else None, prefetch=False)
        t0 = time.time()
        compiled = targets.compile_step("h100", plan, jfsdp.adamw(1e-4), loss_fn, {"inputs": x, "targets": x})
        compile_s = time.time() - t0
    per = hlo.per_axes(compiled.as_text(), tuple(mesh.shape.items()))
    return {"model": model, "devices": devices, "mesh": f"{spec}x{tensor}", "tensor": tensor, "batch": batch,
            "seq_len": seq, "precision": "bf16", "remat": "full", "loss": "fused", "compile_s": round(compile_s, 1),
            "memory": memory.measure(compiled),
            "comm": {f"{kind} {'x'.join(axes) or '-'}": v["wire_bytes"] for (kind, axes), v in sorted(per.items())}}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama-8b")
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--tensor", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--batch", type=int, default=8, help="global batch (rows)")
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--json", metavar="FILE")
    a = p.parse_args(argv)
    rows = []
    for t in a.tensor:
        r = one(a.model, a.devices, t, a.batch, a.seq_len)
        print(json.dumps(r), flush=True)
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
