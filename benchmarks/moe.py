"""Mixture of Experts: gather mode against expert parallelism, and the mode jfsdp's cost model picks.

    python benchmarks/moe.py --json benchmarks/results/moe.json [--no-gpu]

1. CPU grid (fake devices, 1x8, fp32, FULL_SHARD, remat full, AdamW): for token counts per device x
   expert sizes, the per-step communication (bytes sent per device: the cost model's figure for the
   MoE stage, and the whole step's collectives read from the compiled HLO) and compiled memory
   (XLA's buffer assignment) of both modes, and the mode `MoE(mode='auto')` chooses.
2. H100 compile-only target (jfsdp.planning.targets; needs jax's CUDA plugin, no GPU): an expert-parallel
   model in bf16, all-to-all bytes per step left exposed (no matmul or loop scheduled while in
   flight: jfsdp.planning.hlo.overlap) with k = 1 against the k the cost model chooses ('auto'), and every
   k in 1, 2, 4, 8, 16, on three shapes (model width = expert width, tokens per device).
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import dataclasses  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import jfsdp  # noqa: E402
from jfsdp.planning import hlo  # noqa: E402
from jfsdp.planning import memory  # noqa: E402
from jfsdp.planning import targets  # noqa: E402
from models import moe  # noqa: E402
from models.llama import lm_loss  # noqa: E402

MiB = 2**20
BASE = moe.MoEConfig(vocab_size=512, dim=128, n_layers=2, n_dense_layers=0, n_heads=4, n_kv_heads=2,
                     expert_dim=128, n_experts=8, top_k=2, capacity_factor=1.25)
TOKENS = (64, 512)          # tokens per device (one sequence each)
EXPERT_DIMS = (64, 1024)    # each expert's hidden width
GPU_SHAPES = ((256, 512), (512, 2048), (1024, 4096))   # (width, tokens per device) on the H100 target


def cpu_case(tokens, expert_dim, mode):
    cfg = dataclasses.replace(BASE, expert_dim=expert_dim)
    x = jax.ShapeDtypeStruct((8, tokens), jnp.int32)
    root, stages = moe.parts(cfg)
    plan = jfsdp.fully_shard(jfsdp.Staged(root, stages), jfsdp.make_mesh("1x8", jax.devices()[:8]), x, remat="full",
                             moe=jfsdp.MoE(mode=mode, chunks=1 if mode != "auto" else "auto"))
    st = plan.moe_stages[0]
    if mode == "auto":
        return {"chosen": st.mode, "chunks": st.chunks, "why": st.why}
    t = time.time()
    c = memory.compile_step(plan, jfsdp.adamw(1e-3), moe.loss(lm_loss, cfg.aux_coef), {"inputs": x, "targets": x})
    comm = memory.comm_measured(c, 8)
    return {"model_mib": st.costs[mode] / MiB, "compiled_comm_mib": {k: v / MiB for k, v in comm.items()},
            "formula_comm_mib": {k: v / MiB for k, v in memory.comm_formula(plan).items()},
            "compiled_memory_mib": {k: v / MiB for k, v in memory.measure(c).items()},
            "compile_s": round(time.time() - t, 1)}


def gpu_case(target, chunks, cfg, tokens):
    x = jax.ShapeDtypeStruct((8, tokens), jnp.int32)
    root, stages = moe.parts(dataclasses.replace(cfg, attention="cudnn"))
    mesh = jfsdp.make_mesh("1x8", targets.devices(target, "1x8"))
    with targets.tracing_for(target):
        plan = jfsdp.fully_shard(jfsdp.Staged(root, stages), mesh, x, remat="full",
                                 mp_policy=jfsdp.MixedPrecision.parse("bf16"),
                                 moe=jfsdp.MoE(mode="ep", chunks=chunks, backend="gpu"))
        t = time.time()
        c = targets.compile_step(target, plan, jfsdp.adamw(1e-4), moe.loss(lm_loss, cfg.aux_coef),
                                 {"inputs": x, "targets": x})
    ov = hlo.overlap(c.as_text(), 8)
    a2a = [o for o in ov if o.collective.kind == "all-to-all"]
    summ = hlo.overlap_summary(a2a).get("all-to-all", {})
    return {"chunks": plan.moe_stages[0].chunks, "a2a_ops_per_step": sum(o.per_step for o in a2a),
            "a2a_mib": sum(o.wire_bytes_per_step for o in a2a) / MiB,
            "exposed_a2a_mib": summ.get("exposed_bytes", 0.0) / MiB, "hidden_a2a_mib": summ.get("hidden_bytes", 0.0) / MiB,
            "compiled_memory_mib": memory.measure(c)["total"] / MiB, "compile_s": round(time.time() - t, 1)}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", required=True)
    p.add_argument("--target", default="h100")
    p.add_argument("--no-gpu", action="store_true", help="skip the compile-only GPU table")
    a = p.parse_args(argv)
    out = {"date": datetime.date.today().isoformat(), "device": "CPU, 2-core x86 VM, 8 fake XLA devices",
           "command": "python benchmarks/moe.py " + " ".join(sys.argv[1:]), "config": dataclasses.asdict(BASE),
           "mesh": "1x8", "grid": []}
    print(f"{'tokens/dev':>10}{'expert f':>9}  {'gather: model / HLO MiB, mem MiB':>34}  {'ep: model / HLO MiB, mem MiB':>30}"
          "  chosen")
    for tokens in TOKENS:
        for f in EXPERT_DIMS:
            row = {"tokens_per_device": tokens, "expert_dim": f}
            for mode in ("gather", "ep", "auto"):
                row[mode] = cpu_case(tokens, f, mode)
            out["grid"].append(row)
            g, e = row["gather"], row["ep"]
            cheaper = "gather" if g["compiled_comm_mib"]["total"] <= e["compiled_comm_mib"]["total"] else "ep"
            row["cheaper_compiled"] = cheaper
            print(f"{tokens:>10}{f:>9}  {g['model_mib']:>9.2f} / {g['compiled_comm_mib']['total']:6.2f}, "
                  f"{g['compiled_memory_mib']['total']:7.2f}      {e['model_mib']:>9.2f} / "
                  f"{e['compiled_comm_mib']['total']:6.2f}, {e['compiled_memory_mib']['total']:7.2f}  "
                  f"{row['auto']['chosen']} (cheaper compiled: {cheaper})", flush=True)
    if not a.no_gpu:
        if not targets.plugin_available():
            out["gpu"] = {"skipped": "jax CUDA plugin not installed"}
        else:
            out["gpu"] = {"target": a.target, "note": "compiled by XLA:GPU for the target on this CPU machine (no GPU)",
                          "shapes": []}
            for dim, tokens in GPU_SHAPES:
                cfg = dataclasses.replace(BASE, dim=dim, n_heads=8, n_kv_heads=8, expert_dim=dim, vocab_size=4096)
                auto = gpu_case(a.target, "auto", cfg, tokens)
                sweep = {k: gpu_case(a.target, k, cfg, tokens) for k in (1, 2, 4, 8, 16)}
                out["gpu"]["shapes"].append({"config": dataclasses.asdict(cfg), "tokens_per_device": tokens,
                                             "chosen": auto, "by_k": sweep})
                print(f"{a.target} dim {dim}, {tokens} tokens/device: all-to-all {auto['a2a_mib']:.2f} MiB/step; exposed "
                      + ", ".join(f"k={k} {r['exposed_a2a_mib']:.2f}" for k, r in sweep.items())
                      + f" MiB; auto picks k={auto['chunks']}", flush=True)
    with open(a.json, "w") as fh:
        json.dump(out, fh, indent=2)


if __name__ == "__main__":
    main()
