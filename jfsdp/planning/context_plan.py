"""The planner's context-parallel parts (C > 1, docs/context-parallel.md): what differs from C = 1 is how
many tokens a device holds and what the ring adds.

- Tokens: a batch's rows lie on data x fsdp (R·S devices) and each row's sequence on `context`, so a device
  holds T/C tokens of its rows (`local_shape`). The units' kept inputs, the unit's working set and the
  head's activations are traced on those tokens, as at C = 1: they fall as 1/C.
- Communication (`ring_bytes`): per unit and pass, the forward ring sends 2(C - 1) K/V blocks (K and V,
  C - 1 hops), and the backward ring 2(C - 1) K/V blocks and 2(C - 1) gradient blocks (dK and dV travel one
  hop behind them, and one last hop takes them home; the diagonal block's stay home): 6C - 6 blocks, the
  gradient blocks in the dtype of the ring's sums (fp32; bf16 with `--ring-sums bf16`). With remat (full or
  dots) the backward recomputes the unit's forward, ring included: another 2(C - 1) K/V blocks.
- Memory (`ring_buffers`): what the ring holds besides what the unit holds at C = 1, at the units'
  backward peak (the recomputed ring's hops): the running sums and one hop's share (up to two
  (B, T/C, H, D) buffers in the sums' dtype beyond the output on XLA:CPU; on XLA:GPU two and 1.25 in fp32,
  whatever C, less the hidden state's fp32 copies that the traced working set counts and XLA:GPU fuses away,
  fitted on llama-8b's compiled step at C = 8: `GPU_SUMS`), and where a hop's (L x L) chunk pair is one
  tile of the per-block kernel (L = T/2C at most its block), XLA schedules the hops' independent kernels
  together: four score tiles (scores and exponentials of the hop's two kernel calls) per hop, 4(C - 1) in
  all (measured on XLA:CPU: docs/planner.md). Where the kernel loops over several tiles per hop, the
  tiles are one iteration's, as at C = 1. On a GPU, plus the kernel's `workspace` for its diagonal call
  (T/C queries), where it declares one: cuDNN's backward workspace, which a compile for a GPU target made
  without a GPU does not show (models/attention_cudnn.py `backward_workspace`).
Nothing is compiled; `jfsdp.planning.estimate` and `jfsdp.planning.memory.comm_formula` call these where
`plan.context` > 1."""
from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from jfsdp.config.policy import wire_dtype
from jfsdp.planning.activations import saved_residuals
from jfsdp.planning.sizes import as_shapes, stages


def local_shape(a, n_devices: int, context: int = 1):
    """One device's share of a global batch leaf: its rows over the n_devices / context devices that hold
    rows (data x fsdp x tensor), and at C > 1 its sequence (axis 1) over `context`."""
    if context == 1:
        return jax.ShapeDtypeStruct((a.shape[0] // n_devices, *a.shape[1:]), a.dtype)
    return jax.ShapeDtypeStruct((a.shape[0] * context // n_devices, a.shape[1] // context, *a.shape[2:]), a.dtype)


def attention_shapes(plan, local_batch, dtype) -> list:
    """[(q, k) shapes of the unit's `attend(q, k, v)` call, units] per stage, traced on one device's tokens
    (`local_batch`) with the parameters in `dtype`, without the ring (the shapes are the same)."""
    m = plan.model
    root_layouts, stage_layouts = plan.split(plan.layouts)
    h = jax.eval_shape(lambda r, x: m.root.apply({"params": r}, x, method=m.embed_method),
                       as_shapes(root_layouts, dtype), local_batch["inputs"])
    out = []
    for st, layouts, (_, n) in zip(m.stages, stage_layouts, stages(plan)):
        seen = []

        def spy(next_fun, args, kwargs, ctx, seen=seen):
            if ctx.method_name == "attend":
                seen.append((args[0], args[1]))
            return next_fun(*args, **kwargs)

        def unit_fn(x, p, unit=st.unit):
            with nn.intercept_methods(spy):
                return unit.apply({"params": p}, x)
        h = jax.eval_shape(unit_fn, h, as_shapes(layouts, dtype))
        out.append(([(jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct(k.shape, k.dtype))
                     for q, k in seen], n))
    return out


def ring_bytes(plan, batch, backend: str | None = None) -> float:
    """Bytes each device sends per step in the ring's collective-permutes (module docstring), for the global
    `batch`; 0 at C = 1."""
    C = getattr(plan, "context", 1)
    if C == 1:
        return 0.0
    backend = backend or jax.default_backend()
    dt = wire_dtype(plan.mp.param_dtype or jnp.float32, backend)
    local = jax.tree.map(lambda a: local_shape(a, plan.n_devices, C), batch)
    forward_passes = 1 if plan.remat == "none" else 2
    sums = _sum_bytes(dt, plan.context_attention)
    total = 0.0
    for calls, n in attention_shapes(plan, local, dt):
        for _, k in calls:
            block = math.prod(k.shape)
            total += n * (forward_passes * 2 * (C - 1) * block * jnp.dtype(dt).itemsize   # K, V forward
                          + 2 * (C - 1) * block * jnp.dtype(dt).itemsize                 # K, V backward
                          + 2 * (C - 1) * block * sums)                                   # dK, dV
    return total


def _sum_bytes(dt, kernel) -> int:
    """Bytes per element of the ring's sums across hops for inputs of dtype `dt` (the ring's `sum_dtype`)."""
    from jfsdp.engine.parallel.context import sum_dtype
    return jnp.dtype(sum_dtype(dt, getattr(kernel, "low_sums", False))).itemsize


def _largest_intermediate(jaxpr) -> int:
    """Bytes of the largest value any equation of `jaxpr` (sub-jaxprs included) makes."""
    best = 0
    for eqn in jaxpr.eqns:
        for v in eqn.outvars:
            aval = getattr(v, "aval", None)
            if hasattr(aval, "shape"):
                best = max(best, math.prod(aval.shape) * jnp.dtype(aval.dtype).itemsize)
        for p in eqn.params.values():
            for sub in (p if isinstance(p, (list, tuple)) else [p]):
                inner = getattr(sub, "jaxpr", None)
                if inner is not None:
                    best = max(best, _largest_intermediate(getattr(inner, "jaxpr", inner)))
    return best


# XLA:GPU at C > 1: the ring's buffers at the units' backward peak, counted as (B, T/C, H, D) buffers: GPU_SUMS in
# the sums' dtype (the running dQ accumulator; the dK, dV that travel the ring, sent and received) and GPU_FP32
# in fp32 (a call's fp32 dK, dV; the x pair's inputs in the kernel's layout; the next K/V in flight). Fitted,
# with `widened_bytes`, on llama-8b's compiled step at C = 8, tiles of 4,096, fp32 and bf16 sums (H100 target,
# 2026-11-26; docs/results/context-long.md), erring high at the fit's edge: 1,572,864 tokens compile to 80.83
# and 78.76 GiB (estimated 82.34 and 79.34), 1,605,632 to 80.07 with bf16 sums (80.64); 0.95 at 262,144 tokens.
# Not refitted since wo's weight gradient moved before the ring's backward (79.36 GiB at 1,572,864, fp32 sums).
GPU_SUMS, GPU_FP32 = 2, 1.25


def widened_bytes(plan, local_batch, dt) -> int:
    """Bytes of the fp32 copies of a unit's hidden state (its input's shape) among the residuals that the traced
    working set of a unit counts (`jfsdp.planning.activations.working_bytes`), where the hidden state is in a
    narrower dtype `dt`: the norms' widened inputs and products, which XLA:GPU computes inside the fusions that
    use them and never holds (llama-8b: four per unit, 12 GiB at 196,608 tokens per device). The largest stage's."""
    if jnp.dtype(dt).itemsize >= 4:
        return 0
    m = plan.model
    root_layouts, stage_layouts = plan.split(plan.layouts)
    h = jax.eval_shape(lambda r, x: m.root.apply({"params": r}, x, method=m.embed_method),
                       as_shapes(root_layouts, dt), local_batch["inputs"])
    best = 0
    for st, layouts in zip(m.stages, stage_layouts):
        unit_fn = lambda x, p, unit=st.unit: unit.apply({"params": p}, x)
        res = saved_residuals(unit_fn, (h, as_shapes(layouts, dt)))
        best = max(best, sum(math.prod(a.shape) * 4 for a, _ in res
                             if a.dtype == jnp.float32 and tuple(a.shape) == tuple(h.shape)))
        h = jax.eval_shape(unit_fn, h, as_shapes(layouts, dt))
    return best


def ring_buffers(plan, local_batch, backend: str | None = None) -> int:
    """Bytes the ring holds at the units' backward peak beyond the unit's working set at C = 1 (module
    docstring), for one device's batch `local_batch`; 0 at C = 1."""
    C = getattr(plan, "context", 1)
    if C == 1:
        return 0
    backend = backend or jax.default_backend()
    dt = wire_dtype(plan.mp.param_dtype or jnp.float32, backend)
    kernel = plan.context_attention
    best = None   # (negative on XLA:GPU where the widened copies outweigh the ring's buffers)
    for calls, _ in attention_shapes(plan, local_batch, dt):
        for q, k in calls:
            b, t, h, d = q.shape
            half = lambda s: jax.ShapeDtypeStruct((s.shape[0], s.shape[1] // 2, *s.shape[2:]), s.dtype)
            jaxpr = jax.make_jaxpr(lambda q, k, v: kernel.fwd(q, k, v, False))(half(q), half(k), half(k)).jaxpr
            tile = _largest_intermediate(jaxpr)
            whole = b * h * (t // 2) ** 2 * 4       # the hop's (L x L) scores in fp32
            o32 = b * t * h * d * _sum_bytes(dt, kernel)   # in the sums' dtype
            tiles = 4 * (C - 1) * tile if tile >= whole else 0
            # XLA:GPU: GPU_SUMS (B, T/C, H, D) buffers in the sums' dtype and GPU_FP32 in fp32 for the whole ring,
            # whatever C, less the hidden state's fp32 copies that the trace counts and XLA:GPU never holds
            # (`widened_bytes`). It held
            # about one buffer per hop (C - 1) while each hop's values derived from the local q, o, dO alone
            # were computed for all hops ahead of the ring, and the kernel's static-bound loops, split by JAX's
            # partial evaluation under the unit's checkpoint, stacked a copy of every call's K/V blocks
            # (jfsdp/engine/parallel/ring.py `_arrived`, models/attention.py `index_loop`;
            # docs/context-parallel.md). XLA:CPU keeps at most two in all
            gpu = GPU_SUMS * o32 + int(GPU_FP32 * b * t * h * d * 4) - widened_bytes(plan, local_batch, dt)
            held = tiles + (gpu if backend == "gpu" else min(C - 1, 2) * o32)
            if backend == "gpu" and getattr(kernel, "workspace", None):   # the diagonal call's, unseen off a GPU
                held += kernel.workspace(b, t, h, d)
            best = held if best is None else max(best, held)
    return best or 0
