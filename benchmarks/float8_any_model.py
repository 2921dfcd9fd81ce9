"""Float8 for a model given as it is, compiled for an H100 target on this CPU machine (nothing runs).

    python benchmarks/float8_any_model.py --json benchmarks/results/float8_any_model_h100.json

The repository's Llama written as one Linen module, given as it is (`units=LlamaBlock`) with its own
Python loop (`Llama`) and with its own `nn.scan` (`ScannedLlama`), and the same parameters as
`jfsdp.Stacked`, each in bf16 and fp8: FULL_SHARD, remat full, 1x8, 4 units of width 256 (the shape of
tests/test_gpu_target.py), batch 8 x 128. Per row: all-gather and reduce-scatter bytes per step and
device, the dtypes the all-gathers carry, the gemms of the units and of the root by operand dtypes
(`jfsdp.planning.hlo.gemms` on the scheduled program) and the per-device compiled bytes. XLA does not
autotune without a GPU, so the gemms are Triton fusions: XLA's plan, not a measurement of a GPU.
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import datetime
import json
import os
import platform
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import jfsdp  # noqa: E402
import models  # noqa: E402
from jfsdp.planning import hlo, hlo_text, memory, targets  # noqa: E402
from models.llama import Llama, LlamaBlock, ScannedLlama  # noqa: E402

S = 8
CFG = dataclasses.replace(models.get_config("llama-test"), dim=256, ffn_dim=688, attention="cudnn", n_layers=4)


def gathered(text) -> dict:
    """{dtype: operands} over every all-gather of the program."""
    out = collections.Counter()
    for comp in hlo_text.parse(text).comps.values():
        for ins in comp:
            if ins.opcode in ("all-gather", "all-gather-start"):
                parts = hlo_text.tuple_elements(ins.shape) if ins.opcode.endswith("start") else None
                out.update(d for d, _ in hlo_text.array_types(parts[1] if parts else ins.shape))
    return dict(out)


def case(form: str, precision: str) -> dict:
    x = jax.ShapeDtypeStruct((8, 128), jnp.int32)
    b = {"inputs": x, "targets": x}
    mesh = jfsdp.make_mesh(f"1x{S}", targets.devices("h100", f"1x{S}"))
    mp = jfsdp.MixedPrecision.parse(precision)
    with targets.tracing_for("h100"):
        if form == "stacked":
            root, unit, n = models.parts(CFG)
            plan = jfsdp.fully_shard(jfsdp.Stacked(root, unit, n), mesh, x, remat="full", mp_policy=mp, prefetch=False)
        else:
            model = Llama(CFG) if form == "as-is loop" else ScannedLlama(CFG)
            plan = jfsdp.fully_shard(model, mesh, b, units=LlamaBlock, remat="full", mp_policy=mp, rng_streams=())
        compiled = targets.compile_step("h100", plan, jfsdp.adamw(1e-3), models.loss_fn(CFG), b)
    text = compiled.as_text()
    unit, root = collections.Counter(), collections.Counter()
    for g in hlo.gemms(text):
        if not g.dtypes:
            continue
        where = unit if "Block" in g.op_name else root
        where[" x ".join(g.dtypes)] += 1
    comm = memory.comm_measured(compiled, S)
    return {"form": form, "precision": precision, "all_gather_bytes": comm["all-gather"],
            "reduce_scatter_bytes": comm["reduce-scatter"], "gathered_dtypes": gathered(text),
            "unit_gemms": dict(unit), "root_gemms": dict(root), "total_bytes": memory.measure(compiled)["total"]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    rows = []
    for form in ("as-is loop", "as-is nn.scan", "stacked"):
        for precision in ("bf16", "fp8"):
            rows.append(case(form, precision))
            print(json.dumps(rows[-1]), flush=True)
    out = {"date": datetime.date.today().isoformat(), "machine": f"{platform.machine()} {os.cpu_count()} cores",
           "jax": jax.__version__, "target": "h100 (compiled on a CPU machine)", "mesh": f"1x{S}",
           "model": dataclasses.asdict(CFG), "batch": [8, 128], "remat": "full", "strategy": "full_shard", "rows": rows}
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
