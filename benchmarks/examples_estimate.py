"""The planner's memory estimate for the Flax examples given as they are, against their compiled steps.

    python benchmarks/examples_estimate.py --json benchmarks/results/examples_estimate.json [--target h100]

examples/linen_decoder.py (`units=DecoderBlock`) and examples/nnx_decoder.py (`units=(LocalBlock,
GlobalBlock)`) on 1x8, FULL_SHARD, remat full, AdamW, each at the shapes of `--shapes` (width, MLP
width, heads, units, batch, tokens): the compiled step's bytes per device beside
`jfsdp.planning.memory.estimate` for the same plan. XLA:CPU on fake CPU devices in fp32 under the
planner's CPU flags; with `--target h100`, XLA:GPU compiled for an H100 on this CPU machine, in bf16.
`--count-fused`: the estimate as it was before `activations.fused_bytes` (the values XLA:CPU
recomputes inside its fusions counted as kept).
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import sys

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "examples")]
from jfsdp.config.xla_flags import cpu_xla_flags  # noqa: E402

os.environ["XLA_FLAGS"] = cpu_xla_flags()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

import jfsdp  # noqa: E402
import linen_decoder  # noqa: E402
import nnx_decoder  # noqa: E402
from jfsdp.planning import activations, memory, targets  # noqa: E402

SHAPES = "48:96:4:4:16:32,256:1024:4:2:16:64,512:2048:8:4:16:128"


def plan_for(example: str, width, mlp, heads, layers, batch, seq, mesh, mp):
    x = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
    b = {"inputs": x, "targets": x}
    shape = dict(vocab=256, width=width, heads=heads, mlp=mlp, layers=layers)
    if example == "linen":
        model = linen_decoder.Decoder(linen_decoder.Config(**shape, max_len=seq))
        return jfsdp.fully_shard(model, mesh, b, units=linen_decoder.DecoderBlock, remat="full", mp_policy=mp), \
            linen_decoder.loss_fn, b
    model = nnx_decoder.Decoder(nnx_decoder.Config(**shape, window=min(seq, 64)), nnx.Rngs(params=0, dropout=1))
    model.training = False
    units = (nnx_decoder.LocalBlock, nnx_decoder.GlobalBlock)
    return jfsdp.fully_shard(model, mesh, b, units=units, remat="full", mp_policy=mp), nnx_decoder.loss_fn, b


def case(example: str, shape: tuple, target: str | None) -> dict:
    devices = targets.devices(target, "1x8") if target else jax.devices()[:8]
    mesh = jfsdp.make_mesh("1x8", devices)
    mp = jfsdp.MixedPrecision.parse("bf16" if target else "fp32")
    opt = jfsdp.adamw(1e-4)
    with targets.tracing_for(target) if target else contextlib.nullcontext():
        plan, loss, b = plan_for(example, *shape, mesh, mp)
        compiled = targets.compile_step(target, plan, opt, loss, b) if target else memory.compile_step(plan, opt, loss, b)
        est = memory.estimate(plan, opt, loss, b, prefetch=plan.prefetch, backend="gpu" if target else "cpu")
    got = memory.measure(compiled)["total"]
    keys = ("width", "mlp", "heads", "units", "batch", "seq")
    return {"example": example, **dict(zip(keys, shape)), "target": target or "cpu", "compiled_bytes": got,
            "estimate_bytes": est.total, "estimate_ratio": round(est.total / got, 3),
            "activations_bytes": est.as_dict()["activations"]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", default=None)
    p.add_argument("--target", default=None, help="compile for this GPU target (h100) instead of XLA:CPU")
    p.add_argument("--shapes", default=SHAPES, help="comma-separated width:mlp:heads:units:batch:tokens")
    p.add_argument("--count-fused", action="store_true", help="the estimate before activations.fused_bytes")
    a = p.parse_args(argv)
    if a.count_fused:
        activations.fused_bytes = lambda *args, **kw: 0
    rows = []
    for s in a.shapes.split(","):
        shape = tuple(int(v) for v in s.split(":"))
        for example in ("linen", "nnx"):
            rows.append(case(example, shape, a.target))
            print(json.dumps(rows[-1]), flush=True)
    out = {"date": datetime.date.today().isoformat(), "machine": f"{platform.machine()} {os.cpu_count()} cores",
           "jax": jax.__version__, "count_fused": a.count_fused, "command": " ".join(sys.argv), "rows": rows}
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
