"""Communication per step under tensor parallelism (T > 1, docs/tensor-parallel.md), by collective kind
and by the mesh axes it runs over, in the ring cost model of `hlo.Collective.wire_bytes`, to compare
with `hlo.per_axes` of the compiled step.

FSDP, per leaf (padding counted): gathered over its own group, `fsdp` for a tensor-parallel or
vocabulary-parallel leaf (1/T of the leaf), `fsdp` x `tensor` for the rest (norm scales); the root
once per step, each unit twice under FULL_SHARD (forward and backward) and once under SHARD_GRAD_OP;
each gradient reduce-scattered over the same group once, then all-reduced over `data` when R > 1.

Tensor parallelism, over `tensor`, for n tokens per TP group (a device's rows x the whole sequence),
hidden size D, b bytes per element: every all-gather and reduce-scatter of the residual stream sends
n·D·b·(T−1)/T per device. Per unit, 2 all-gathers (before attention, before the FFN) and 2
reduce-scatters (after wo, after w2) forward, as many backward (their transposes); a unit recomputed
in the backward pass (remat 'full') all-gathers twice more and reduce-scatters once more (after wo:
the one after w2 makes the unit's output, which the backward pass does not need). The vocabulary-parallel root adds 2 of each (the
embedding, the head), the token ids' and targets' all-gathers (4 bytes a token) and the loss's
all-reduces of floats per token: 4 for the plain loss (max, sum, target logit forward; the sum's
transpose backward), 3 for the fused loss, whose backward all-reduces one scalar (the cotangent). Written for fp32 (the
compute, reduce and parameter dtypes the same) and remat 'none' or 'full'."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jfsdp.config.errors import ConfigError
from jfsdp.config.mesh import DATA_AXIS, FSDP_AXIS, TENSOR_AXIS
from jfsdp.engine.layout import is_layout


def _axes(layout) -> tuple:
    a = layout.gather_axes
    return (a,) if isinstance(a, str) else tuple(a)


def _fsdp(plan, out: dict):
    """The FSDP gathers and reduce-scatters, and the all-reduce of the shards over `data`."""
    b = jnp.dtype(plan.mp.param_dtype or jnp.float32).itemsize
    root_l, stage_l = plan.split(plan.layouts)
    gathers = 2 if plan.strategy.reshard_after_forward else 1
    leaves = [(l, 1, 1) for l in jax.tree.leaves(root_l, is_leaf=is_layout)]
    leaves += [(l, n * gathers, n) for ls, n in zip(stage_l, plan.stage_sizes) for l in jax.tree.leaves(ls, is_leaf=is_layout)]
    r = plan.replicas
    for l, times, grads in leaves:
        g, nbytes = l.shards, math.prod(l.stored_shape) * b
        if g > 1:
            axes = _axes(l)
            add(out, "all-gather", axes, times * nbytes * (g - 1) / g)
            add(out, "reduce-scatter", axes, grads * nbytes * (g - 1) / g)
        if r > 1:
            add(out, "all-reduce", (DATA_AXIS,), grads * 2 * (nbytes / g) * (r - 1) / r)


def add(out: dict, kind: str, axes: tuple, nbytes: float):
    key = (kind, tuple(a for a in (DATA_AXIS, FSDP_AXIS, TENSOR_AXIS) if a in axes))
    out[key] = out.get(key, 0.0) + nbytes


def tensor_comm(plan, rows: int, seq_len: int, fused: bool) -> dict:
    """{(kind, axes): bytes each device sends per step} of a Stacked Llama-like plan under T > 1 with
    a global batch of `rows` x `seq_len` tokens; `fused`: the fused loss (else the plain one)."""
    t = plan.tensor
    if t == 1 or plan.mp.param_dtype not in (None, jnp.float32) or plan.remat not in ("none", "full"):
        raise ConfigError("the tensor-parallel communication formula is written for T > 1, fp32 and remat none "
                          "or full; read the compiled step's collectives (hlo.per_axes) for the rest")
    out: dict = {}
    _fsdp(plan, out)
    n = rows // (plan.n_devices // t) * seq_len           # tokens per TP group
    d = jax.tree.leaves(plan.h_shapes[-1])[0].shape[-1]  # the residual stream's width
    f = (t - 1) / t
    full = plan.remat == "full"   # the recomputed forward: both all-gathers, the reduce-scatter after wo
    units = sum(plan.stage_sizes)
    vocab = getattr(plan, "vocab_shard", None) is not None
    root = 2 if vocab else 0
    add(out, "all-gather", (TENSOR_AXIS,), (units * (4 + 2 * full) + root) * n * d * 4 * f)
    add(out, "reduce-scatter", (TENSOR_AXIS,), (units * (4 + full) + root) * n * d * 4 * f)
    if vocab:
        add(out, "all-gather", (TENSOR_AXIS,), 2 * n * 4 * f)
        add(out, "all-reduce", (TENSOR_AXIS,), ((3 * n + 1) if fused else 4 * n) * 4 * 2 * f)
    return out
