"""jfsdp compiled for an H100 (or another named GPU) on a machine without one: XLA:GPU's memory,
communication and overlap of the real train step, beside the analytic estimate.

    python benchmarks/gpu_target.py --json benchmarks/results/gpu_target_h100.json [--target h100]

Tables (every figure from `compiled.memory_analysis()` / `compiled.as_text()` of XLA:GPU; bf16 mixed
precision, AdamW, remat full unless said, jfsdp's XLA:GPU options, cuDNN attention):
1. llama-1b on 1x8, 8 x 2048 tokens, per strategy: compiled total and state, estimate, comm;
2. FULL_SHARD memory against depth (llama-1b width, 2..32 units): flat beyond the kept activations;
3. overlap, llama-1b 1x8: exposed / hidden collective bytes per step with jfsdp's prefetch pipeline
   (the GPU default for remat full), the plain scan with jfsdp's XLA flags, and XLA's defaults (and
   the memory prefetch costs);
4. the torchtitan Llama 3.1 8B configuration (8 GPUs, local batch 2, seq 8192) with remat dots
   (torchtitan's selective checkpointing) and full, each on the prefetch pipeline and the plain scan.
"""
from __future__ import annotations

import argparse
import os
import sys

# `models` is the repository's own package, imported from the repository root (pip installs only jfsdp)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import dataclasses  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import jfsdp  # noqa: E402
import models  # noqa: E402
from jfsdp.config.xla_flags import GPU_FLAGS  # noqa: E402
from jfsdp.planning import hlo  # noqa: E402
from jfsdp.planning import memory  # noqa: E402
from jfsdp.planning import targets  # noqa: E402

GiB = 2**30


def compile_case(target, cfg, mesh_spec, strategy, remat, batch, seq, overrides=None, prefetch=None):
    cfg = dataclasses.replace(cfg, attention="cudnn")
    mesh = jfsdp.make_mesh(mesh_spec, targets.devices(target, mesh_spec))
    x = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
    root, unit, n = models.parts(cfg)
    with targets.tracing_for(target):
        plan = jfsdp.fully_shard(jfsdp.Stacked(root, unit, n), mesh, x, strategy=strategy, remat=remat,
                                 mp_policy=jfsdp.MixedPrecision.parse("bf16"), prefetch=prefetch)
        opt, b, loss = jfsdp.adamw(1e-4), {"inputs": x, "targets": x}, models.loss_fn(cfg)
        t = time.time()
        compiled = targets.compile_step(target, plan, opt, loss, b, overrides=overrides)
        compile_s = time.time() - t
        est = memory.estimate(plan, opt, loss, b, prefetch=True, backend="gpu")
    m = memory.measure(compiled)
    text = compiled.as_text()
    ov = hlo.overlap_summary(hlo.overlap(text, plan.n_devices))
    comm = memory.comm_measured(compiled, plan.n_devices)
    return {"params": cfg.num_params(), "n_layers": cfg.n_layers, "mesh": mesh_spec, "strategy": strategy,
            "remat": remat, "prefetch": plan.prefetch, "batch": batch, "seq": seq, "compiled_gib": m["total"] / GiB,
            "state_gib": m["argument"] / GiB, "temp_gib": m["temp"] / GiB, "estimate_gib": est.total / GiB,
            "comm_gib": comm["total"] / GiB, "contract_gib": memory.comm_formula(plan, "gpu")["contract"] / GiB,
            "exposed_gib": sum(v["exposed_bytes"] for v in ov.values()) / GiB,
            "hidden_gib": sum(v["hidden_bytes"] for v in ov.values()) / GiB,
            "overlap": ov, "remat_collectives": sum(".remat" in c.name for c in hlo.collectives(text)),
            "compile_s": round(compile_s, 1)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target", default="h100")
    p.add_argument("--json", default=None)
    p.add_argument("--skip-8b", action="store_true")
    a = p.parse_args(argv)
    t0 = time.time()
    one_b = models.get_config("llama-1b")
    out = {"date": datetime.date.today().isoformat(), "target": a.target, "jax": jax.__version__,
           "device": f"compiled for {a.target} (jfsdp.planning.targets) on a CPU machine, no GPU",
           "xla_options": targets.compiler_options(), "xla_options_prefetch": targets.compiler_options(prefetch=True)}

    def show(title, rows, cols):
        print(f"\n{title}")
        print("  " + "".join(f"{c:>14}" for c in cols))
        for r in rows:
            print("  " + "".join(f"{r[c]:>14.2f}" if isinstance(r[c], float) else f"{r[c]!s:>14}" for c in cols))

    rows = [compile_case(a.target, one_b, m, s, "full", 8, 2048)
            for s, m in (("full_shard", "1x8"), ("shard_grad_op", "1x8"), ("no_shard", "8x1"))]
    out["strategies"] = rows
    show("llama-1b, 8 devices, 8 x 2048 tokens, bf16, remat full", rows,
         ["strategy", "mesh", "compiled_gib", "state_gib", "estimate_gib", "comm_gib", "contract_gib"])

    rows = [compile_case(a.target, dataclasses.replace(one_b, n_layers=n), "1x8", "full_shard", "full", 8, 2048)
            for n in (2, 4, 8, 16, 32)]
    out["depth"] = rows
    show("FULL_SHARD against depth (llama-1b width), 1x8", rows,
         ["n_layers", "compiled_gib", "temp_gib", "state_gib", "estimate_gib"])

    off = {k: None for k in GPU_FLAGS}
    rows = [dict(compile_case(a.target, one_b, "1x8", "full_shard", "full", 8, 2048), options="prefetch pipeline"),
            dict(compile_case(a.target, one_b, "1x8", "full_shard", "full", 8, 2048, prefetch=False),
                 options="plain scan + flags"),
            dict(compile_case(a.target, one_b, "1x8", "full_shard", "full", 8, 2048, off, prefetch=False),
                 options="XLA defaults")]
    out["overlap"] = rows
    show("overlap per step, llama-1b 1x8 full_shard", rows,
         ["options", "prefetch", "exposed_gib", "hidden_gib", "compiled_gib", "temp_gib"])

    if not a.skip_8b:
        eight_b = models.get_config("llama-8b")
        rows = [compile_case(a.target, eight_b, "1x8", "full_shard", r, 16, 8192, prefetch=p)
                for r, p in (("dots", None), ("dots", False), ("full", None), ("full", False))]
        out["torchtitan_8b"] = rows
        show("torchtitan Llama 3.1 8B: 8 GPUs, local batch 2, seq 8192 (FSDP2: 82.4 GiB, 77.0 with torch.compile)",
             rows, ["remat", "prefetch", "compiled_gib", "estimate_gib", "exposed_gib", "hidden_gib",
                    "remat_collectives", "compile_s"])
    out["wall_s"] = round(time.time() - t0, 1)
    print(f"\n(wall {out['wall_s']} s)")
    if a.json:
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        with open(a.json, "w") as fh:
            json.dump(out, fh, indent=2, default=float)
    return 0


if __name__ == "__main__":
    sys.exit(main())
