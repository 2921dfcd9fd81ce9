"""A model given as it is against the same model as `jfsdp.Stacked`: memory, depth, compile time.

    python benchmarks/any_model.py --json benchmarks/results/any_model.json [--target h100] [--quick]
    python benchmarks/any_model.py --compile-time-only --json benchmarks/results/any_model_compile.json
    python benchmarks/any_model.py --model llama-1b --depths 16 --batch 8 --seq 2048 --attention auto --no-compile-time \
        --target h100 --json benchmarks/results/any_model_llama1b.json

The model is `models.llama.Llama`, the repository's Llama written the usual Flax way (an embedding, a
Python loop over `LlamaBlock`s, a head), given to `fully_shard(..., units=LlamaBlock)`; the reference
is the same parameters as `Stacked(LlamaRoot, LlamaBlock, n)`, whose units run under one `lax.scan`.
Every figure is from a compiled train step (AdamW, plain logits loss, donated state) lowered from
abstract inputs: nothing is allocated. XLA:CPU on fake CPU devices (fp32), and, with `--target h100`,
XLA:GPU compiled for an H100 on this CPU machine (bf16; needs the gpu-target extra).

1. per-device compiled bytes (argument + output + temp - alias), as-is and Stacked, FULL_SHARD, 1x8 (each
   on its default: prefetch on the GPU target, `prefetch` in the row; there also `exposed`, the bytes and
   ops of each collective kind with no matmul in flight in XLA:GPU's schedule, `hlo.overlap`), beside
   the planner's analytic estimate and communication formula for the same plan (`estimate_bytes`,
   `estimate_ratio` = estimate / compiled, `comm_formula` against `collectives`);
2. the same against depth (4 -> 16 units): FULL_SHARD must stay flat beyond the kept activations;
3. compile time against depth (8, 16, 32, 80 units): the Python loop (unrolled), the model's own
   `nn.scan` (`models.llama.ScannedLlama`, given as it is too) and `Stacked`.
"""
from __future__ import annotations

import argparse
import contextlib
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
import platform  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import jfsdp  # noqa: E402
import models  # noqa: E402
from jfsdp.planning import hlo, memory, targets  # noqa: E402
import models.factory  # noqa: E402

MiB = 2**20
BASE = models.get_config("llama-tiny")   # width 128, vocabulary 259: small enough to compile many depths


def plans(cfg, mesh, batch, strategy, remat, precision, as_is, loss="logits"):
    """as_is: True (its own Python loop), "scan" (its own nn.scan) or False (jfsdp.Stacked); loss 'fused':
    the head's features for `jfsdp.lm_loss` (models.factory.as_is_model's call=), 'logits': the logits."""
    mp = jfsdp.MixedPrecision.parse(precision)
    fused = loss == "fused"
    if as_is:   # the planner's own as-is model (python -m jfsdp.plan --as-is loop|scan)
        model, units, call, _ = models.factory.as_is_model(cfg, "scan" if as_is == "scan" else "loop",
                                                           "fused" if fused else "plain")
        return jfsdp.fully_shard(model, mesh, batch, units=units, call=call, strategy=strategy, remat=remat,
                                 mp_policy=mp, rng_streams=())
    root, unit, n = models.parts(cfg)
    stacked = jfsdp.Stacked(root, unit, n, **({"head_method": "head_features"} if fused else {}))
    return jfsdp.fully_shard(stacked, mesh, batch["inputs"], strategy=strategy, remat=remat, mp_policy=mp)


def compile_case(cfg, *, as_is, mesh_spec="1x8", strategy="full_shard", remat="full", batch=8, seq=256,
                 target=None, attention="xla", planner=True, loss="logits") -> dict:
    """One compiled train step: per-device bytes, collectives per step, compile time; `planner`: with the
    planner's estimate and formula beside them."""
    precision = "bf16" if target else "fp32"
    cfg = dataclasses.replace(cfg, attention=attention)
    devices = targets.devices(target, mesh_spec) if target else jax.devices()[:8]
    mesh = jfsdp.make_mesh(mesh_spec, devices)
    x = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
    b = {"inputs": x, "targets": x}
    loss_name, (opt, loss) = loss, (jfsdp.adamw(1e-4), models.loss_fn(cfg) if loss == "logits" else
                                    jfsdp.lm_loss(vocab_major=cfg.tie_embeddings))
    t = time.time()
    if target:
        with targets.tracing_for(target):
            plan = plans(cfg, mesh, b, strategy, remat, precision, as_is, loss_name)
            compiled = targets.compile_step(target, plan, opt, loss, b)
    else:
        plan = plans(cfg, mesh, b, strategy, remat, precision, as_is, loss_name)
        compiled = memory.compile_step(plan, opt, loss, b)
    seconds = time.time() - t
    m = memory.measure(compiled)
    comm = hlo.per_step(compiled.as_text(), plan.n_devices)
    row = {"as_is": as_is, "n_layers": cfg.n_layers, "mesh": mesh_spec, "strategy": strategy, "remat": remat,
           "loss": loss_name,
           "target": target or "cpu", "total_bytes": m["total"], "temp_bytes": m["temp"],
           "argument_bytes": m["argument"], "collectives": comm, "compile_s": round(seconds, 2),
           "prefetch": bool(plan.prefetch)}
    if target:   # what XLA:GPU's schedule leaves exposed (no compute between a collective's start and done)
        ov = hlo.overlap_summary(hlo.overlap(compiled.as_text(), plan.n_devices))
        row["exposed"] = {k: {f: ov.get(k, {}).get(f, 0) for f in ("exposed_bytes", "exposed_ops", "hidden_ops")}
                          for k in ("all-gather", "reduce-scatter", "all-to-all")}
    if planner:   # the planner's analytic answers for the same plan (as-is plans too: jfsdp/planning/as_is.py)
        backend = "gpu" if target else "cpu"
        with targets.tracing_for(target) if target else contextlib.nullcontext():
            est = memory.estimate(plan, opt, loss, b, prefetch=plan.prefetch, backend=backend)
        formula = memory.comm_formula(plan, backend=backend)
        row.update(estimate_bytes=est.total, estimate_ratio=round(est.total / m["total"], 3),
                   comm_formula={k: formula[k] for k in ("all-gather", "reduce-scatter", "all-reduce", "all-to-all")})
    return row


def depth(n, base=None):
    return dataclasses.replace(base or BASE, n_layers=n)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", default=None)
    p.add_argument("--target", default=None, help="also compile for this GPU target (h100)")
    p.add_argument("--quick", action="store_true", help="depths 4 and 8 only")
    p.add_argument("--model", default="llama-tiny", help="a model of models/ (its width; depth varies)")
    p.add_argument("--depths", default=None, help="comma-separated unit counts (default 4,8,16)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--no-compile-time", action="store_true", help="skip the compile-time rows")
    p.add_argument("--own-scan", action="store_true", help="with --target: also the model's own nn.scan "
                   "(models.llama.ScannedLlama) given as it is")
    p.add_argument("--compile-time-only", action="store_true", help="only the compile-time rows")
    p.add_argument("--loss", default="logits", choices=("logits", "fused"),
                   help="'fused': the head's features and jfsdp.lm_loss, as the planner runs its models")
    p.add_argument("--attention", default="xla", help="the model's attention (models.llama.ATTENTION); 'auto' is "
                   "blockwise from 1024 tokens on CPU")
    a = p.parse_args(argv)
    base = models.get_config(a.model)
    rows = []
    depths = tuple(int(d) for d in a.depths.split(",")) if a.depths else (4, 8) if a.quick else (4, 8, 16)
    if a.compile_time_only:
        depths, a.target = (), None
    shape = dict(batch=a.batch, seq=a.seq, attention=a.attention, loss=a.loss)
    strategies = ("full_shard",) if a.depths else ("full_shard", "shard_grad_op")
    for n in depths:
        for as_is in (True, False):
            for strategy in strategies:
                rows.append(compile_case(depth(n, base), as_is=as_is, strategy=strategy, **shape))
                print(json.dumps({k: v for k, v in rows[-1].items() if k != "collectives"}), flush=True)
    if a.target:
        for n in depths:
            for as_is in (True, "scan", False) if a.own_scan else (True, False):
                rows.append(compile_case(depth(n, base), as_is=as_is, target=a.target, **shape))
                print(json.dumps({k: v for k, v in rows[-1].items() if k != "collectives"}), flush=True)
    timing = []
    for n in () if a.no_compile_time else ((8, 16) if a.quick else (8, 16, 32, 80)):
        for as_is in (True, "scan", False):
            r = compile_case(depth(n), as_is=as_is, planner=False)
            timing.append({"n_layers": n, "as_is": as_is, "compile_s": r["compile_s"]})
            print(json.dumps(timing[-1]), flush=True)
    out = {"date": datetime.date.today().isoformat(), "machine": f"{platform.machine()} {os.cpu_count()} cores",
           "jax": jax.__version__, "model": dataclasses.asdict(base), "batch": a.batch, "seq": a.seq, "attention": a.attention, "loss": a.loss, "rows": rows, "compile_time": timing}
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
