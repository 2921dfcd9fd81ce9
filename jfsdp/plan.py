"""Will it fit? `python -m jfsdp.plan --model llama-70b --mesh 8x8 --device-memory 80GiB`

Prints the per-device memory of one train step, estimated analytically and measured from the
compiled program (lowered from abstract inputs on fake CPU devices: nothing is allocated), the
communication per step, whether it fits and the largest global batch that fits.

`--target` says what the plan is for:
- `gpu` (default), `tpu`, `cpu`: the estimate is for that backend, and the train step is compiled on
  fake CPU devices. XLA's CPU backend widens bf16 to f32 (see `memory._wire_dtype`), so a bf16 plan
  compiled here is bigger than the same plan on a GPU: beside the compiled CPU measurement the
  report shows the estimate for CPU, which is what validates the estimate against XLA. XLA:CPU
  compiles with the flags train.py sets on CPU (`jfsdp.config.xla_flags.CPU_FLAGS`).
- a named GPU (`h100`, `h200`, `a100`, `b200`; see `jfsdp.targets`): the train step is compiled by
  XLA:GPU for that GPU and topology without one (compile-only devices; needs jax's CUDA plugin), with
  the XLA options jfsdp sets on GPUs. The report shows XLA:GPU's memory and collectives beside the
  GPU estimate, and the overlap of every async collective with compute in the scheduled program.
  The device memory defaults to the GPU's; bf16 attention is cuDNN's fused attention; the estimate
  counts two gathered units (jfsdp's flags pipeline the all-gathers: FSDP's prefetch).

The model names come from the repository's `models` package, imported inside `main` only: the
library itself (everything else in `jfsdp/`) does not depend on it.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


class _Error(Exception):
    pass


def parse_bytes(text: str) -> int:
    """'80GiB' -> 85899345920, '80GB' -> 80e9, '1024' -> 1024."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS or float(m.group(1)) <= 0:
        raise _Error(f"device memory '{text}' does not parse: expected a size such as 80GiB, 40GB or 1024MiB")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line and status 2, like every other bad input
        print(f"error: {message}", file=sys.stderr)
        sys.exit(2)


def _mesh_devices(spec: str) -> int:
    """R*S of an 'RxS' mesh, parsed without importing jax (the device count must be set first);
    jfsdp.make_mesh validates it again with its own message."""
    m = re.fullmatch(r"\s*(\d+)\s*[xX]\s*(\d+)\s*", spec)
    if not m or int(m.group(1)) < 1 or int(m.group(2)) < 1:
        raise _Error(f"mesh '{spec}' is malformed: expected RxS with positive integers, e.g. 2x8")
    return int(m.group(1)) * int(m.group(2))


def _args(argv):
    p = _Parser(prog="python -m jfsdp.plan", description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="a name from models.CONFIGS, e.g. llama-8b, llama-70b")
    p.add_argument("--mesh", required=True, help="RxS: R replicas (data) x S shards (fsdp)")
    p.add_argument("--strategy", default="full_shard")
    p.add_argument("--precision", default="bf16", help="fp32 or bf16 (fp32 master, bf16 compute, fp32 reduce)")
    p.add_argument("--remat", default="full", help="none, full or dots (activation checkpointing per unit)")
    p.add_argument("--loss", default="fused", choices=("fused", "plain"),
                   help="fused (train.py's default): head and cross-entropy in chunks, no full logits; plain: logits")
    p.add_argument("--batch-size", type=int, default=None, help="global batch (default: one sequence per device)")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--device-memory", default=None, help="per device, e.g. 80GiB (default: the named "
                   "GPU's memory, else 80GiB)")
    p.add_argument("--target", default="gpu", help="gpu, tpu or cpu: the backend the estimate is for "
                   "(fits / largest batch use it), compiled on fake CPU devices; or a named GPU (h100, h200, "
                   "a100, b200): compiled by XLA:GPU for it, without one")
    p.add_argument("--xla-option", action="append", default=[], metavar="NAME=VALUE",
                   help="with a named GPU: override one of jfsdp's XLA:GPU options (VALUE none drops it)")
    p.add_argument("--moe", default="auto", choices=("auto", "gather", "ep"),
                   help="MoE models: gather the experts' weights, send tokens to them (ep), or let the cost model "
                   "choose per stage (auto; see jfsdp/moe.py)")
    p.add_argument("--moe-chunks", default="auto", help="MoE expert-parallel stages: chunks k (or auto)")
    p.add_argument("--prefetch", action="store_true", help="count two gathered units (prefetching the next)")
    p.add_argument("--update-in-backward", action="store_true",
                   help="plan train.py --update-in-backward: the optimizer applied to each unit inside the backward "
                        "pass (no whole gradient held; needs remat full, full_shard/hybrid_shard)")
    p.add_argument("--no-compile", action="store_true", help="estimate only (skip the compiled measurement)")
    p.add_argument("--json", default=None, help="also write the report as JSON to this file")
    return p.parse_args(argv)


def _force_devices(n: int):
    """Ask for n fake CPU devices, before jax starts its backend. A count already forced in XLA_FLAGS
    wins (the mesh must then fit it). XLA:CPU gets the flags train.py gives it (jfsdp.config.xla_flags.CPU_FLAGS:
    the memory-minimizing scheduler; XLA reads it from XLA_FLAGS only), so that the compiled CPU figure
    is the step train.py runs: with XLA:CPU's default scheduler the units' stacked gradient buffers and
    the embedding's gradient are made at the start of the step (llama-70b on 1x64: 35.64 GiB compiled
    against 26.98 GiB with CPU_FLAGS, measured 2026-11-22)."""
    from jfsdp.config.xla_flags import cpu_xla_flags   # imports jax; its backend (which reads XLA_FLAGS) starts later
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        flags = f"{flags} --xla_force_host_platform_device_count={n}".strip()
    os.environ["XLA_FLAGS"] = cpu_xla_flags(flags)


def largest_batch(fits, start: int = 1, limit: int = 1 << 20) -> int:
    """Largest b >= 1 with fits(b) (fits monotone decreasing in b), 0 if none: doubling then bisection."""
    if not fits(start):
        return 0
    lo, hi = start, start * 2
    while hi <= limit and fits(hi):
        lo, hi = hi, hi * 2
    if hi > limit:
        return lo
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def build(model_name, mesh_spec, strategy, precision, remat, batch_size, seq_len, devices=None, attention=None,
          loss="fused", moe="auto", moe_chunks="auto", backend=None):
    """(cfg, plan, optimizer, loss_fn, batch shapes) for a named model; nothing allocated.
    `devices`: the mesh's devices (default: all local ones); `attention`: override the config's."""
    import dataclasses

    import jax
    import jax.numpy as jnp

    import jfsdp
    from jfsdp.config.zoo import repo_models
    try:
        models = repo_models("python -m jfsdp.plan")
    except jfsdp.ConfigError as e:
        raise _Error(str(e)) from None

    try:
        cfg = models.get_config(model_name)
    except ValueError as e:
        raise _Error(str(e)) from None
    is_moe = isinstance(cfg, models.MoEConfig)
    if not isinstance(cfg, models.LlamaConfig) and not is_moe:
        raise _Error(f"model '{model_name}' is not a language model; the planner takes the llama-* and MoE configs")
    if attention:
        cfg = dataclasses.replace(cfg, attention=attention)
    mesh = jfsdp.make_mesh(mesh_spec, devices)
    n = mesh.size
    batch_size = n if batch_size is None else batch_size
    if batch_size < 1 or seq_len < 1:
        raise _Error("batch size and sequence length must be at least 1")
    x = jax.ShapeDtypeStruct((batch_size, seq_len), jnp.int32)
    if batch_size % n:
        raise _Error(f"batch size {batch_size} does not divide over the {n} devices of the mesh")
    try:
        model, moe_opt, loss_fn = models.factory.language_model(cfg, loss, moe, moe_chunks, backend)
    except jfsdp.ConfigError as e:
        raise _Error(str(e)) from None
    plan = jfsdp.fully_shard(model, mesh, x, strategy=strategy, mp_policy=jfsdp.MixedPrecision.parse(precision),
                             remat=remat, moe=moe_opt)
    return cfg, plan, jfsdp.adamw(1e-4), loss_fn, {"inputs": x, "targets": x}


def _option(text: str):
    k, _, v = text.partition("=")
    if not k or not v:
        raise _Error(f"--xla-option '{text}' is not NAME=VALUE")
    low = v.strip().lower()
    val = {"true": True, "false": False, "none": None}.get(low, v)
    if isinstance(val, str):
        try:
            val = int(val)
        except ValueError:
            pass
    return k.strip().lstrip("-"), val


def report(a) -> dict:
    import contextlib

    import jax
    import jax.numpy as jnp

    from jfsdp.planning import hlo, memory, targets

    gpu = a.target in targets.TARGETS
    devices, attention = None, None
    if gpu:
        devices = targets.devices(a.target, a.mesh)
        attention = "cudnn"  # where it applies: bf16 compute, head_dim a multiple of 8 up to 128
    elif a.xla_option:
        raise _Error("--xla-option applies to a named GPU target (--target h100, ...)")
    est_backend = "gpu" if gpu else a.target
    ctx = targets.tracing_for(a.target) if gpu else contextlib.nullcontext()
    with ctx:
        cfg, plan, opt, loss_fn, batch = build(a.model, a.mesh, a.strategy, a.precision, a.remat, a.batch_size,
                                               a.seq_len, devices, attention, a.loss, a.moe, a.moe_chunks,
                                               est_backend)
        if gpu:
            import models.llama
            attention = models.llama.attention_impl(cfg.llama() if hasattr(cfg, "llama") else cfg,
                                                    plan.mp.param_dtype or jnp.float32, a.seq_len)
        budget = parse_bytes(a.device_memory) if a.device_memory else (
            targets.get(a.target).memory_bytes if gpu else parse_bytes("80GiB"))
        here = a.target if gpu else jax.default_backend()
        ib = a.update_in_backward
        if ib:
            from jfsdp.train import update_in_backward as backward_update
            why = backward_update.unsupported(plan, 1)
            if why:
                raise _Error(f"--update-in-backward: {why}")
        est_target = memory.estimate(plan, opt, loss_fn, batch, prefetch=a.prefetch or gpu, backend=est_backend,
                                     update_in_backward=ib)
        rep = {"model": a.model, "params": cfg.num_params(), "mesh": a.mesh, "devices": plan.n_devices,
               "strategy": plan.strategy.value, "precision": a.precision, "remat": a.remat,
               "update_in_backward": ib,
               "batch_size": batch["inputs"].shape[0], "seq_len": a.seq_len, "device_memory": budget,
               "target": a.target, "estimate": est_target.as_dict()}
        if gpu:
            rep["attention"] = attention
            rep["xla_options"] = targets.compiler_options(dict(_option(o) for o in a.xla_option), plan.prefetch or ib)
            rep["prefetch"] = plan.prefetch
        if here != a.target:
            rep[f"estimate_{here}"] = memory.estimate(plan, opt, loss_fn, batch, prefetch=a.prefetch,
                                                      backend=here, update_in_backward=ib).as_dict()
        rep["comm_formula"] = memory.comm_formula(plan, backend=est_backend)
        from jfsdp.engine import moe
        if any(plan.moe_stages):
            rep["moe"] = moe.describe(plan)
        if not a.no_compile:
            t = time.time()
            if gpu:
                compiled = targets.compile_step(a.target, plan, opt, loss_fn, batch,
                                                overrides=dict(_option(o) for o in a.xla_option),
                                                update_in_backward=ib)
            else:
                compiled = memory.compile_step(plan, opt, loss_fn, batch, update_in_backward=ib)
            rep["compile_s"] = round(time.time() - t, 1)
            rep["compiled"] = {"backend": here, **memory.measure(compiled)}
            rep["comm_compiled"] = {"backend": here, **memory.comm_measured(compiled, plan.n_devices)}
            if here != a.target:
                rep[f"comm_formula_{here}"] = memory.comm_formula(plan, backend=here)
            if gpu:
                text = compiled.as_text()
                ov = hlo.overlap(text, plan.n_devices)
                rep["overlap"] = hlo.overlap_summary(ov)
                rep["overlap_table"] = hlo.render_overlap(ov)
                rep["collective_dtypes"] = sorted({(c.kind, d) for c in hlo.collectives(text, plan.n_devices)
                                                   for d in c.dtypes})
        rep["fits"] = est_target.total <= budget
        n = plan.n_devices
        seq = a.seq_len

        def fits(per_device):
            shape = jax.ShapeDtypeStruct((per_device * n, seq), jnp.int32)
            b = {"inputs": shape, "targets": shape}
            return memory.estimate(plan, opt, loss_fn, b, prefetch=a.prefetch or gpu,
                                   backend=est_backend, update_in_backward=ib).total <= budget

        rep["largest_global_batch"] = largest_batch(fits) * n
    return rep


def _gib(x):
    return f"{x / 2**30:9.2f} GiB"


def render(r: dict) -> str:
    e, tgt = r["estimate"], r["target"]
    here = r.get("compiled", {}).get("backend")
    e_here = r.get(f"estimate_{here}", e if here == tgt else None) if here else None
    lines = [f"{r['model']} ({r['params'] / 1e9:.2f}B parameters) on mesh {r['mesh']} ({r['devices']} devices), "
             f"{r['strategy']}, {r['precision']}, remat {r['remat']}, batch {r['batch_size']} x {r['seq_len']} tokens"
             + (", optimizer inside the backward pass" if r.get("update_in_backward") else ""),
             "", "memory per device"]
    same = here == tgt  # a named GPU: the estimate for it is beside its own compilation
    cols = [f"estimate ({tgt})"] + (([] if same else [f"estimate ({here})"]) + [f"compiled ({here})"] if here else [])
    lines.append(f"  {'':26}" + "".join(f"{c:>20}" for c in cols))
    rows = [("parameters (fp32 shard)", "params"), ("gradients (shard)", "grads"), ("optimizer state", "optimizer"),
            ("padding", "padding"), ("gathered (root + units)", "gathered"), ("gradient buffers", "grad_buffers"),
            ("activations", "activations"), ("batch", "batch")]
    for label, k in rows:
        vals = [e[k]] + ([e_here[k]] if here and not same else [])
        lines.append(f"  {label:26}" + "".join(f"{_gib(v):>20}" for v in vals))
    c = r.get("compiled")
    mid = (lambda v: "") if same else (lambda v: f"{_gib(v):>20}")
    lines.append(f"  {'state between steps':26}{_gib(e['persistent']):>20}"
                 + (f"{mid(e_here['persistent'])}{_gib(c['argument']):>20}  (arguments)" if c else ""))
    lines.append(f"  {'peak of the step':26}{_gib(e['total']):>20}"
                 + (f"{mid(e_here['total'])}{_gib(c['total']):>20}  (arg+temp+out-alias)" if c else ""))
    if c:
        lines.append(f"  estimate / compiled on {here}: {e_here['total'] / c['total']:.3f}; compiled in {r['compile_s']} s")
    lines += ["", f"communication per step, bytes sent per device ({tgt} formula"
              + ((" and compiled HLO" if same else f"; {here} formula and compiled HLO") if c else "") + ")"]
    f, fh, m = r["comm_formula"], r.get(f"comm_formula_{here}", r["comm_formula"]), r.get("comm_compiled")
    for k in ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "total"):
        if k == "all-to-all" and not f.get(k) and not (m or {}).get(k):
            continue
        lines.append(f"  {k:26}{_gib(f[k]):>20}" + (f"{mid(fh[k])}{_gib(m[k]):>20}" if m else ""))
    lines.append(f"  contract (3Ψ·b·(S−1)/S or 2Ψ·b·(N−1)/N){_gib(f['contract']):>14}")
    if r.get("moe"):
        lines += ["", "MoE stages (mode per stage; gather = all-gather + reduce-scatter of the experts' weights, "
                  "ep = all-to-all of the tokens; jfsdp/moe.py)"] + [f"  {x}" for x in r["moe"]]
    if r.get("overlap"):
        lines += ["", f"overlap in the scheduled {here} program (per step; hidden = a matmul or loop runs while "
                  "it is in flight)", r["overlap_table"]]
        for k, o in r["overlap"].items():
            lines.append(f"  {k:26}hidden {_gib(o['hidden_bytes'])}   exposed {_gib(o['exposed_bytes'])}")
        lines.append("  dtypes on the wire: " + ", ".join(f"{k} {d}" for k, d in r["collective_dtypes"]))
        lines.append("  XLA options: " + " ".join(f"{k}={v}" for k, v in r["xla_options"].items()))
    verdict = "fits" if r["fits"] else "does NOT fit"
    lines += ["", f"{verdict} in {_gib(r['device_memory']).strip()} per device "
              f"({100 * e['total'] / r['device_memory']:.0f}% of it, {tgt} estimate)",
              f"largest global batch that fits: {r['largest_global_batch']} sequences of {r['seq_len']} tokens"]
    return "\n".join(lines)


def main(argv=None) -> int:
    a = _args(argv)
    try:
        n = _mesh_devices(a.mesh)
        if a.device_memory:
            parse_bytes(a.device_memory)
        _force_devices(n)
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        from jfsdp.config.errors import ConfigError  # imports jax: only now that the device count is set
        import jax
        if not jax.config.jax_platforms:  # `python -m jfsdp.plan` imported jax before main ran
            jax.config.update("jax_platforms", os.environ["JAX_PLATFORMS"])
        from jfsdp.planning.targets import TARGETS
        if a.target not in ("gpu", "tpu", "cpu", *TARGETS):
            raise _Error(f"unknown target '{a.target}'; choose from gpu, tpu, cpu, {', '.join(TARGETS)}")
        t = time.time()
        try:
            rep = report(a)
        except (ConfigError, ValueError) as e:
            raise _Error(str(e)) from None
        rep["wall_s"] = round(time.time() - t, 1)
    except _Error as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(render(rep))
    print(f"(planned in {rep['wall_s']} s)")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(rep, fh, indent=2, default=float)
    return 0


if __name__ == "__main__":
    sys.exit(main())
