"""What gradient accumulation costs in memory with one reduction per step (`grad_sync='once'`) against a
reduction in every micro-batch (`'every'`): compiled peaks per device, and one unsharded gradient of the
model for scale.

    python benchmarks/grad_sync.py --json benchmarks/results/grad_sync_cpu.json

Llama at width 256 (llama-test's shape), 4 units, K=4 micro-batches of 8 x 16 tokens per device, fp32,
AdamW, remat full, XLA:CPU on 8 fake devices under train.py's XLA:CPU flags (the memory-minimizing
scheduler). Rows: `Stacked` on 1x8 full_shard, 2x4 hybrid_shard and 8x1 no_shard (every stage run by the
stage passes, whose backward adds each unit's gradient to the running sum in place), and the same model
given as it is with its own Python loop and with its own `nn.scan` (jfsdp/engine/as_is/). Nothing is
allocated: each step is compiled from abstract inputs.
"""
from __future__ import annotations

import argparse
import os
import sys

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from jfsdp.config.xla_flags import cpu_xla_flags  # noqa: E402

os.environ["XLA_FLAGS"] = cpu_xla_flags()

import dataclasses  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jfsdp  # noqa: E402
import models  # noqa: E402
from jfsdp.planning import memory  # noqa: E402
from models.llama import Llama, LlamaBlock, ScannedLlama  # noqa: E402

MiB = 2**20
K = 4
CFG = dataclasses.replace(models.get_config("llama-test"), dim=256, ffn_dim=688, n_layers=4, attention="xla")
CASES = [("stacked", "1x8", "full_shard"), ("stacked", "2x4", "hybrid_shard"), ("stacked", "8x1", "no_shard"),
         ("as-is loop", "1x8", "full_shard"), ("as-is nn.scan", "1x8", "full_shard")]


def plan_for(kind, mesh_spec, strategy, x):
    r, s = jfsdp.parse_mesh(mesh_spec)
    mesh = jfsdp.make_mesh(mesh_spec, devices=jax.devices()[: r * s])
    if kind == "stacked":
        root, unit, n = models.parts(CFG)
        return jfsdp.fully_shard(jfsdp.Stacked(root, unit, n), mesh, x, strategy=strategy, remat="full")
    model = ScannedLlama(CFG) if kind == "as-is nn.scan" else Llama(CFG)
    return jfsdp.fully_shard(model, mesh, {"inputs": x, "targets": x}, units=LlamaBlock, strategy=strategy,
                             remat="full", rng_streams=())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    x = jax.ShapeDtypeStruct((8 * 8 * K, 16), jnp.int32)
    b = {"inputs": x, "targets": x}
    whole, rows = one_gradient(), []
    for kind, mesh_spec, strategy in CASES:
        plan = plan_for(kind, mesh_spec, strategy, x)
        peak = {s: memory.measure(memory.compile_step(plan, jfsdp.adamw(1e-3), models.loss_fn(CFG), b, grad_accum=K,
                                                      grad_sync=s))["total"] for s in ("every", "once")}
        row = {"model": kind, "mesh": mesh_spec, "strategy": strategy, "every_mib": peak["every"] / MiB,
               "once_mib": peak["once"] / MiB, "gradient_mib": whole / MiB,
               "extra_gradients": (peak["once"] - peak["every"]) / whole}
        rows.append(row)
        print(f"{kind:14} {mesh_spec} {strategy:13} every {row['every_mib']:7.2f} MiB  once {row['once_mib']:7.2f} MiB"
              f"  once - every = {row['extra_gradients']:5.2f} x the {row['gradient_mib']:.2f} MiB gradient", flush=True)
    out = {"date": datetime.date.today().isoformat(), "jax": jax.__version__, "device": "XLA:CPU, 8 fake devices",
           "k": K, "rows": rows}
    if a.json:
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        with open(a.json, "w") as fh:
            json.dump(out, fh, indent=2)
    return 0


def one_gradient() -> int:
    """One unsharded fp32 gradient of the model (every row's model has these parameters): bytes."""
    root, unit, n = models.parts(CFG)
    mesh = jfsdp.make_mesh("1x1", devices=jax.devices()[:1])
    plan = jfsdp.fully_shard(jfsdp.Stacked(root, unit, n), mesh, jax.ShapeDtypeStruct((1, 16), jnp.int32))
    return sum(int(np.prod(x.shape)) * 4 for x in jax.tree.leaves(jax.eval_shape(plan.init_full, jax.random.key(0))))


if __name__ == "__main__":
    sys.exit(main())
