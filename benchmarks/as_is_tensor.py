"""Tensor parallelism for a model given as it is: what XLA's partitioner chooses over `tensor`.

    python benchmarks/as_is_tensor.py --json benchmarks/results/as_is_tensor.json [--width 256] [--seq 256]
    python benchmarks/as_is_tensor.py --target h100 --json benchmarks/results/as_is_tensor_h100.json

The Linen decoder of examples/linen_decoder.py, as it is (its kernels' logical names: heads, kv, mlp,
vocab), compiled (not run) for a train step on fake CPU devices, fp32, FULL_SHARD, remat none, S = 2
shards and T = 1, 2, 4 (2, 4, 8 devices), each (data, fsdp) device the same rows. For T > 1 with the
default rules, and with ('sequence', 'tensor') added (`sp`: the activations between units split on the
sequence). Per device and step, from the compiled HLO by mesh axes (`jfsdp.planning.hlo.per_axes`):
the FSDP all-gather and reduce-scatter bytes (over `fsdp`), every collective over `tensor` (XLA's), the
compiled memory (argument, temporaries) and the compile time. `--target h100`: XLA:GPU compiled for an
H100 on this CPU machine, bf16, T = 1 and 2."""
from __future__ import annotations

import argparse
import contextlib
import os
import sys

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import datetime  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import jfsdp  # noqa: E402
from jfsdp.engine.parallel import logical  # noqa: E402
from jfsdp.planning import hlo, targets  # noqa: E402


def example():
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "linen_decoder.py")
    spec = importlib.util.spec_from_file_location("linen_decoder", path)
    module = sys.modules["linen_decoder"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def measure(ex, cfg, t, sp, rows, seq, shards=2, target=None):
    rules = logical.DEFAULT_RULES + (((logical.SEQUENCE, "tensor"),) if sp else ())
    spec = f"1x{shards}"
    devices = targets.devices(target, spec, tensor=t) if target else jax.devices()[: shards * t]
    mesh = jfsdp.make_mesh(spec, devices=devices, tensor=t)
    batch = {k: jax.ShapeDtypeStruct((rows * shards, seq), jnp.int32) for k in ("inputs", "targets")}
    opt = jfsdp.adamw(1e-3)
    t0 = time.time()
    with targets.tracing_for(target) if target else contextlib.nullcontext():
        mp = jfsdp.MixedPrecision.parse("bf16") if target else None
        sharded = jfsdp.fully_shard(ex.Decoder(cfg), mesh, batch, units=ex.DecoderBlock, mp_policy=mp,
                                    logical_rules=rules if t > 1 else None)
        if target:
            compiled = targets.compile_step(target, sharded, opt, ex.loss_fn, batch)
        else:
            step = jfsdp.make_train_step(sharded, opt, ex.loss_fn)
            compiled = step.lower(jfsdp.abstract_state(sharded, opt), batch).compile()
    seconds = time.time() - t0
    axes = hlo.per_axes(compiled.as_text(), tuple(mesh.shape.items()))
    mem = hlo.memory(compiled)
    return {"target": target or "cpu", "tensor": t, "sp": sp, "compile_s": round(seconds, 1),
            "fsdp_all_gather": axes.get(("all-gather", ("fsdp",)), {}).get("wire_bytes", 0),
            "fsdp_reduce_scatter": axes.get(("reduce-scatter", ("fsdp",)), {}).get("wire_bytes", 0),
            "over_tensor": {k[0]: v for k, v in sorted(axes.items()) if k[1] == ("tensor",)},
            "argument": mem.get("argument"), "temp": mem.get("temp")}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", required=True)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--rows", type=int, default=2, help="batch rows per (data, fsdp) device")
    p.add_argument("--target", default=None, help="compile for this GPU target instead (h100; bf16; needs the "
                   "gpu-target extra)")
    a = p.parse_args()
    ex = example()
    cfg = ex.Config(vocab=512, width=a.width, heads=8, mlp=4 * a.width, layers=2, max_len=a.seq)
    out = []
    cases = [(1, False), (2, True), (2, False)] + ([] if a.target else [(4, True), (4, False)])
    for t, sp in cases:
        out.append(measure(ex, cfg, t, sp, a.rows, a.seq, target=a.target))
        print(json.dumps(out[-1]), flush=True)
    report = {"model": f"examples/linen_decoder.py width {a.width}, heads 8, mlp {4 * a.width}, 2 blocks, vocab 512",
              "batch": f"{a.rows} rows x {a.seq} tokens per (data, fsdp) device", "mesh": "1 x 2 x T",
              "device": (f"XLA:GPU compiled for {a.target} on a CPU machine, bf16" if a.target else
                         f"XLA:CPU, fake devices, {platform.processor() or platform.machine()}, fp32"),
              "jax": jax.__version__, "date": datetime.date.today().isoformat(), "rows": out}
    with open(a.json, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
