"""The planner's report for a named model (`python -m jfsdp.plan`): the plan built from abstract inputs
(nothing allocated), its memory per device estimated for the target and measured from the compiled
train step, its communication per step (formula and compiled HLO), whether it fits, and the largest
global batch that fits. The command line (`jfsdp.plan`) parses the arguments, sets up the devices
before jax starts and prints the report.

The model names come from the repository's `models` package, imported here inside `build` only
(`jfsdp.config.zoo.repo_models`): the rest of the library does not depend on it."""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import time

from jfsdp.config.args import async_tp_option
from jfsdp.config.errors import ConfigError
from jfsdp.config.mesh import CONTEXT_AXIS
from jfsdp.config.policy import schedule
from jfsdp.planning import hlo, memory, sizes, targets, tensor_comm
from jfsdp.train import frozen

DEFAULT_MEMORY = 80 * 2**30   # per device, where neither --device-memory nor a named GPU says


def build(model_name, mesh_spec, strategy, precision, remat, batch_size, seq_len, devices=None, attention=None,
          loss="fused", moe="auto", moe_chunks="auto", backend=None, prefetch=None, tensor=1, async_tp=None, context=1,
          overrides=None, mlp_tile=0, as_is=None, moe_buckets=None, moe_calibration=None, ring_sums="fp32",
          ring_attention="auto"):
    """(cfg, plan, optimizer, loss_fn, batch shapes) for a named model; nothing allocated. `mlp_tile`: the
    Llama MLP's tile in tokens (models/llama.py; 0: off).
    `devices`: the mesh's devices (default: all local ones); `attention`: override the config's;
    `prefetch`, `async_tp`: fully_shard's; `tensor`: T, with the model's tensor plan (models/factory.py) when T > 1;
    `moe_buckets`, `moe_calibration`: adaptive MoE's (models.factory.language_model's buckets, calibration);
    `context`: C, with the model's ring kernel (models.factory.context_kernel) when C > 1, `ring_attention` its
    per-block attention (auto, cudnn, blockwise: models.factory.ring_attention_impl); `overrides`: fields of
    the model's config to replace ({'name': value}; an unknown field is a ConfigError); `as_is`: 'loop' or
    'scan', the Llama given as it is instead of as `Stacked` (models.factory.as_is_model)."""
    import jax
    import jax.numpy as jnp

    import jfsdp
    from jfsdp.config.zoo import repo_models
    models = repo_models("python -m jfsdp.plan")
    try:
        cfg = models.get_config(model_name)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if not isinstance(cfg, (models.LlamaConfig, models.MoEConfig)):
        raise ConfigError(f"model '{model_name}' is not a language model; the planner takes the llama-* and MoE "
                          "configs")
    if attention:
        cfg = dataclasses.replace(cfg, attention=attention)
    if overrides:
        unknown = sorted(set(overrides) - {f.name for f in dataclasses.fields(cfg)})
        if unknown:
            raise ConfigError(f"model '{model_name}' has no config field {', '.join(unknown)}")
        cfg = dataclasses.replace(cfg, **overrides)
    if mlp_tile:
        if not isinstance(cfg, models.LlamaConfig):
            raise ConfigError("--mlp-tile applies to the Llama models (their dense MLP), not to MoE models")
        cfg = dataclasses.replace(cfg, mlp_tile=mlp_tile)
    mesh = jfsdp.make_mesh(mesh_spec, devices, tensor=tensor, context=context)
    n = mesh.size // context   # the devices that hold rows
    batch_size = n if batch_size is None else batch_size
    if batch_size < 1 or seq_len < 1:
        raise ConfigError("batch size and sequence length must be at least 1")
    x = jax.ShapeDtypeStruct((batch_size, seq_len), jnp.int32)
    if batch_size % n:
        raise ConfigError(f"batch size {batch_size} does not divide over the {n} devices of the mesh")
    mp = jfsdp.MixedPrecision.parse(precision)
    if as_is:   # the model's own loop or scan, its units intercepted (jfsdp/engine/as_is/)
        model, units, call, loss_fn = models.factory.as_is_model(cfg, as_is, loss)
        batch = {"inputs": x, "targets": x}
        plan = jfsdp.fully_shard(model, mesh, batch, units=units, call=call, strategy=strategy, mp_policy=mp,
                                 remat=remat, prefetch=prefetch, rng_streams=())
        return cfg, plan, jfsdp.adamw(1e-4), loss_fn, batch
    model, moe_opt, loss_fn = models.factory.language_model(cfg, loss, moe, moe_chunks, backend, buckets=moe_buckets,
                                                            calibration=moe_calibration)
    tensor_plan = models.factory.tensor_plan(cfg) if tensor > 1 else None
    plan = jfsdp.fully_shard(model, mesh, x, strategy=strategy, mp_policy=mp,
                             remat=remat, moe=moe_opt, prefetch=prefetch, tensor_plan=tensor_plan,
                             async_tp=async_tp if tensor > 1 else None,
                             context_attention=models.factory.context_kernel(
                                 ring_sums=ring_sums, attention=models.factory.ring_attention_impl(cfg, mp, ring_attention))
                             if context > 1 else None)
    return cfg, plan, jfsdp.adamw(1e-4), loss_fn, {"inputs": x, "targets": x}


def largest_batch(fits, start: int = 1, limit: int = 1 << 20, guess: int | None = None) -> int:
    """Largest b >= 1 with fits(b) (fits monotone decreasing in b), 0 if none: doubling then bisection,
    or, given a `guess`, galloping from it (a good guess costs two calls of `fits`)."""
    if guess is not None:
        return _gallop(fits, start, limit, min(max(guess, start), limit))
    if not fits(start):
        return 0
    lo, hi = start, start * 2
    while hi <= limit and fits(hi):
        lo, hi = hi, hi * 2
    return _bisect(fits, lo, min(hi, limit + 1))   # past the limit counts as not fitting


def _bisect(fits, lo: int, hi: int) -> int:
    """The largest b in [lo, hi) with fits(b), given fits(lo) and not fits(hi)."""
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def _gallop(fits, start: int, limit: int, guess: int) -> int:
    """largest_batch by steps of 1, 2, 4, ... away from `guess` (start <= guess <= limit), then bisection."""
    ok = lambda b: start <= b <= limit and fits(b)
    step = 1
    if ok(guess):
        lo = guess
        while ok(lo + step):
            lo, step = lo + step, step * 2
        return _bisect(ok, lo, min(lo + step, limit + 1))
    hi = guess
    while hi - step >= start and not ok(hi - step):
        hi, step = hi - step, step * 2
    lo = max(hi - step, start)
    return _bisect(ok, lo, hi) if ok(lo) else 0


def xla_option(text: str) -> tuple:
    """'NAME=VALUE' (--xla-option) -> (name, value): true/false/none as True/False/None, integers as int."""
    k, _, v = text.partition("=")
    if not k or not v:
        raise ConfigError(f"--xla-option '{text}' is not NAME=VALUE")
    low = v.strip().lower()
    val = {"true": True, "false": False, "none": None}.get(low, v)
    if isinstance(val, str):
        try:
            val = int(val)
        except ValueError:
            pass
    return k.strip().lstrip("-"), val


@dataclasses.dataclass
class _Case:
    """One plan under study, and the backends it is estimated and compiled for."""
    plan: object
    optimizer: object
    loss_fn: object
    batch: dict
    gpu: bool          # a named GPU target: compiled by XLA:GPU for it
    backend: str       # whose estimate decides (fits, largest batch): 'gpu', 'tpu' or 'cpu'
    here: str          # what the step is compiled for: the named GPU, else this process's backend
    trainable: object = None   # --freeze: make_train_step's predicate (None: everything trains)
    frozen: tuple = ()         # the frozen parameters' paths


def report(a, budget: int | None = None) -> dict:
    """The report for `a` (the command line's arguments) as a dict. `budget`: bytes per device
    (default: the named GPU's memory, else DEFAULT_MEMORY)."""
    import jax

    gpu = a.target in targets.TARGETS
    if a.xla_option and not gpu:
        raise ConfigError("--xla-option applies to a named GPU target (--target h100, ...)")
    if getattr(a, "ring_attention", "auto") == "cudnn" and not (gpu or jax.default_backend() == "gpu"):
        raise ConfigError("--ring-attention cudnn needs a GPU to compile for: a named GPU target (--target h100, "
                          "...) or this machine's own")
    # a named GPU: its devices, and cuDNN's fused attention where it applies (bf16 compute, head_dim a
    # multiple of 8 up to 128)
    tensor = getattr(a, "tensor", 1)
    context = getattr(a, "context", 1)
    devices, attention = (targets.devices(a.target, a.mesh, tensor, context), "cudnn") if gpu else (None, None)
    backend = "gpu" if gpu else a.target
    with targets.tracing_for(a.target) if gpu else contextlib.nullcontext():
        if budget is None:
            budget = targets.get(a.target).memory_bytes if gpu else DEFAULT_MEMORY
        built = lambda tile: build(a.model, a.mesh, a.strategy, a.precision, a.remat, a.batch_size, a.seq_len, devices,
                                   attention, a.loss, a.moe, a.moe_chunks, backend, tensor=tensor,
                                   async_tp=async_tp_option(getattr(a, "async_tp", "auto"), tensor), mlp_tile=tile,
                                   context=context, as_is=getattr(a, "as_is", None),
                                   moe_buckets=getattr(a, "moe_buckets", None),
                                   moe_calibration=getattr(a, "moe_calibration", None),
                                   ring_sums=getattr(a, "ring_sums", "fp32"),
                                   ring_attention=getattr(a, "ring_attention", "auto"))
        tile = getattr(a, "mlp_tile", 0)
        if tile == "auto":   # the largest tile whose estimate fits; off where the untiled plan fits
            from jfsdp.planning import tiling
            tile = tiling.choose(lambda t: _tile_total(a, built(t), gpu, backend), a.seq_len // context,
                                 budget, built(0)[0], tensor)
        cfg, plan, opt, loss_fn, batch = built(tile)
        trainable, hit = frozen.freeze(plan, getattr(a, "freeze", None))
        case = _Case(plan, opt, loss_fn, batch, gpu, backend, a.target if gpu else jax.default_backend(),
                     trainable, tuple(hit))
        if a.update_in_backward:
            from jfsdp.train import update_in_backward
            if trainable is not None:
                raise ConfigError("--freeze cannot combine with --update-in-backward")
            why = update_in_backward.unsupported(plan, a.grad_accum)
            if why:
                raise ConfigError(f"--update-in-backward: {why}")
        _check_accumulation(a, plan, batch)
        rep = _estimates(a, cfg, case, budget)
        if not a.no_compile:
            rep.update(_compiled(a, case))
        rep["fits"] = rep["estimate"]["total"] <= budget
        rep["largest_global_batch"] = _largest_global_batch(a, case, budget)
    return rep


def _tile_total(a, built, gpu: bool, backend: str) -> int:
    """The estimate's total for `build`'s answer `built` (--mlp-tile auto tries tiles with it)."""
    _, plan, opt, loss_fn, batch = built
    trainable, _ = frozen.freeze(plan, getattr(a, "freeze", None))
    case = _Case(plan, opt, loss_fn, batch, gpu, backend, backend, trainable)
    return _estimate(a, case, batch, backend, a.prefetch or gpu).total


def _check_accumulation(a, plan, batch) -> None:
    """--grad-accum / --grad-sync: the batch divides into the micro-batches; 'once' is possible."""
    from jfsdp.engine import accumulate
    accumulate.check_grad_sync(a.grad_sync)
    if a.grad_accum < 1:
        raise ConfigError(f"--grad-accum must be at least 1, got {a.grad_accum}")
    plan.check_batch(batch, a.grad_accum)
    if a.grad_sync == "once" and a.update_in_backward:
        raise ConfigError("--grad-sync once cannot combine with --update-in-backward")
    why = accumulate.unsupported(plan) if a.grad_sync == "once" and a.grad_accum > 1 else None
    if why:
        raise ConfigError(f"--grad-sync once: {why}")


def _estimate(a, case: _Case, batch, backend: str, prefetch: bool):
    return memory.estimate(case.plan, case.optimizer, case.loss_fn, batch, prefetch=prefetch, backend=backend,
                           update_in_backward=a.update_in_backward, grad_accum=a.grad_accum, grad_sync=a.grad_sync,
                           trainable=case.trainable)


def _estimates(a, cfg, case: _Case, budget: int) -> dict:
    """The report's header, the estimates (for the target, and for the compiling backend where it is
    another), the communication formula and the MoE stages' modes."""
    import jax.numpy as jnp

    from jfsdp.engine import moe

    plan, here = case.plan, case.here
    est = _estimate(a, case, case.batch, case.backend, a.prefetch or case.gpu)
    rep = {"model": a.model, "params": cfg.num_params(), "mesh": a.mesh, "tensor": plan.tensor,
           "context": getattr(plan, "context", 1), "devices": plan.n_devices,
           "strategy": plan.strategy.value, "precision": a.precision, "remat": a.remat,
           "update_in_backward": a.update_in_backward, "grad_accum": a.grad_accum, "grad_sync": a.grad_sync,
           "batch_size": case.batch["inputs"].shape[0], "seq_len": a.seq_len, "device_memory": budget,
           "target": a.target, "mlp_tile": getattr(cfg, "mlp_tile", 0), "as_is": getattr(a, "as_is", None),
           "estimate": est.as_dict()}
    if case.frozen:
        rep["freeze"], rep["frozen"] = a.freeze, list(case.frozen)
    if case.gpu:
        import models.llama
        rep["attention"] = models.llama.attention_impl(cfg.llama() if hasattr(cfg, "llama") else cfg,
                                                       plan.mp.param_dtype or jnp.float32, a.seq_len)
        rep["xla_options"] = targets.compiler_options(dict(xla_option(o) for o in a.xla_option),
                                                      plan.prefetch or a.update_in_backward, getattr(plan, "async_tp", False),
                                                      own_scan=targets.own_scan_unit(plan))
        rep["prefetch"] = plan.prefetch
        rep["schedule"] = (_as_is_schedule(plan) if getattr(plan, "as_is", False) else
                           schedule(plan.strategy, plan.remat, plan.shards, plan.prefetch))
    if here != a.target:
        rep[f"estimate_{here}"] = _estimate(a, case, case.batch, here, a.prefetch).as_dict()
    if plan.tensor > 1:
        rep["async_tp"] = plan.async_tp
    rep.update(_formula(a, case, case.backend))
    if any(plan.moe_stages):
        rep["moe"] = moe.describe(plan)
    rep["layouts"] = sizes.leaf_layouts(plan)
    rep["embedding_lookup"] = memory.lookup_kind(plan, case.batch, a.grad_accum, a.grad_sync)
    return rep


def _as_is_schedule(plan) -> str:
    """The overlap report's line for a model given as it is: how its units run (docs/any-model.md)."""
    if plan.scanned and plan.prefetch:
        return ("the model's own scan run as a stage of jfsdp's prefetch pipeline (engine/as_is/own_scan.py; one "
                "that cannot be is run as written, with a warning)")
    if plan.scanned:
        return ("the model's own scan run as written (prefetch off): XLA's pipeliner on GPUs, the units called "
                "untied from their inputs, one unit per combined collective")
    if plan.prefetch:
        return "prefetch in call order (the next unit's gather in flight while one computes; engine/call_order.py)"
    return "each unit gathered when the model calls it (prefetch off)"


def _compiled(a, case: _Case) -> dict:
    """The compiled train step's memory and communication, and on a named GPU the overlap of its
    collectives with compute and the dtypes they carry."""
    plan, here = case.plan, case.here
    t = time.time()
    if case.gpu:
        compiled = targets.compile_step(a.target, plan, case.optimizer, case.loss_fn, case.batch, a.grad_accum,
                                        overrides=dict(xla_option(o) for o in a.xla_option),
                                        update_in_backward=a.update_in_backward, grad_sync=a.grad_sync,
                                        trainable=case.trainable)
    else:
        compiled = memory.compile_step(plan, case.optimizer, case.loss_fn, case.batch, a.grad_accum,
                                       update_in_backward=a.update_in_backward, grad_sync=a.grad_sync,
                                       trainable=case.trainable)
    rep = {"compile_s": round(time.time() - t, 1), "compiled": {"backend": here, **memory.measure(compiled)},
           "comm_compiled": {"backend": here, **memory.comm_measured(compiled, plan.n_devices)}}
    if plan.tensor > 1:   # by mesh axes, beside the formula's (tensor_comm)
        axes = hlo.per_axes(compiled.as_text(), tuple(plan.mesh.shape.items()))
        rep["comm_compiled_axes"] = tensor_comm.axes_table({k: v["wire_bytes"] for k, v in axes.items()})
    if getattr(plan, "context", 1) > 1:   # the ring's permutes, told apart by the axis their cycles span
        rep["ring_compiled"] = ring_compiled(compiled.as_text(), plan)
    if here != a.target:
        rep.update({f"{k}_{here}": v for k, v in _formula(a, case, here).items()})
    if case.gpu:
        text = compiled.as_text()
        ov = hlo.overlap(text, plan.n_devices, tuple(plan.mesh.shape.items()))
        rep["overlap"] = hlo.overlap_summary(ov)
        if plan.tensor > 1:   # the TP collectives (over `tensor`) apart from FSDP's
            rep["overlap_axes"] = hlo.overlap_summary(ov, by_axes=True)
        rep["overlap_table"] = hlo.render_overlap(ov)
        rep["collective_dtypes"] = sorted({(c.kind, d) for c in hlo.collectives(text, plan.n_devices)
                                           for d in c.dtypes})
    return rep


def ring_compiled(hlo_text: str, plan) -> float:
    """Bytes each device sends per step in collective-permutes over `context` alone (the ring attention's
    blocks), read from the compiled HLO (hlo.per_axes), beside context_plan.ring_bytes' formula."""
    axes = hlo.per_axes(hlo_text, tuple(plan.mesh.shape.items()))
    return axes.get(("collective-permute", (CONTEXT_AXIS,)), {}).get("wire_bytes", 0.0)


def _formula(a, case: _Case, backend: str) -> dict:
    """{'comm_formula': {kind: bytes, 'total', 'contract'}} for `backend`; with T > 1 also
    'comm_formula_axes': {'kind over axes': bytes} (jfsdp.planning.tensor_comm)."""
    kw = dict(grad_accum=a.grad_accum, grad_sync=a.grad_sync, trainable=case.trainable)
    if case.plan.tensor == 1:
        return {"comm_formula": memory.comm_formula(case.plan, backend=backend, batch=case.batch, **kw)}
    axes = tensor_comm.tensor_comm(case.plan, case.batch["inputs"].shape[0], a.seq_len, a.loss == "fused",
                                   backend=backend, **kw)
    return {"comm_formula": tensor_comm.by_kind(axes), "comm_formula_axes": tensor_comm.axes_table(axes)}


def _largest_global_batch(a, case: _Case, budget: int) -> int:
    """The largest global batch (a multiple of the device count) whose estimate fits in `budget`."""
    import jax
    import jax.numpy as jnp

    n = case.plan.n_devices // getattr(case.plan, "context", 1) * a.grad_accum   # the devices that hold rows

    @functools.cache
    def total(per_device):
        shape = jax.ShapeDtypeStruct((per_device * n, a.seq_len), jnp.int32)
        b = {"inputs": shape, "targets": shape}
        return _estimate(a, case, b, case.backend, a.prefetch or case.gpu).total

    # Each estimate traces the model (about a second for a small one); it grows about linearly in the
    # batch, so the line through 1 and 2 sequences per device guesses the answer, and the search
    # starts there (4 estimates instead of about 28 for llama-small under 80 GiB; the same answer).
    slope = total(2) - total(1)
    guess = 1 + int((budget - total(1)) // slope) if slope > 0 else None
    return largest_batch(lambda b: total(b) <= budget, guess=guess) * n
