"""The memory estimate's tensor-parallel parts (T > 1, docs/tensor-parallel.md): what differs from T = 1
is where each leaf lies and what a device computes on.

- State: a tensor-parallel leaf (`TensorLayout`: its `shape` is one tensor rank's slice) is split over
  its `fsdp` group of S; every other leaf over `fsdp` x `tensor`, S·T. So each leaf's bytes per device
  are its own stored bytes over its own group (`Layout.shards`), not over the plan's S: about 1/(S·T)
  of the model in all.
- Gathered copies: one gathered leaf is its stored shape, the TP slice for a TP leaf (1/T of it) and
  the whole leaf for the rest: `stored_bytes` already counts what one device holds.
- Activations: the units, the root and the loss traced as each device runs them, with the tensor
  collectives of Megatron-SP (`FSDP.unit_apply`, the vocabulary-parallel root's `vocab.scope`,
  `vocab.gather_features`, `vocab.loss`) traced as one device runs them (an axis `tensor` of size T bound): the residual
  stream between units is 1/T of the sequence (the kept unit inputs shrink by T), inside a unit the
  TP group's whole sequence meets 1/T of the heads and of the FFN width, and the head's logits hold
  1/T of the vocabulary. What JAX saves for the backward pass is then one device's.
Nothing is compiled; `jfsdp.planning.estimate` calls these where `plan.tensor` > 1."""
from __future__ import annotations

import math
from typing import Callable

import jax
import jax.numpy as jnp

from jfsdp.config.mesh import TENSOR_AXIS
from jfsdp.config.policy import REMAT_POLICIES, wire_dtype
from jfsdp.engine.layout import is_layout
from jfsdp.engine.parallel import vocab
from jfsdp.planning.activations import fused_head_buffers, residual_bytes, stop_frozen
from jfsdp.planning.sizes import as_shapes, nbytes, tree_bytes


# ---------------------------------------------------------------- state: each leaf over its own group

def leaves(layouts, mult: int = 1) -> list:
    """[(layout, how many units)] of a layouts tree."""
    return [(l, mult) for l in jax.tree.leaves(layouts, is_leaf=is_layout) if l is not None]


def per_device(items, value) -> int:
    """Sum over [(layout, units)] of units x value(layout) / the layout's group (`Layout.shards`), summed
    per group size and divided once per group (so that one group, as at T = 1, gives `sum // S`)."""
    groups: dict = {}
    for l, n in items:
        groups[l.shards] = groups.get(l.shards, 0) + n * value(l)
    return sum(int(round(v)) // s for s, v in groups.items())


def state(plan, optimizer_bytes: int, g) -> tuple[int, int, int, int]:
    """(parameters, optimizer state, padding of both, padding of the gradients) of one device, as
    `estimate._state` for T = 1: each leaf over its own group. `optimizer_bytes`: the optimizer's state
    for the whole (stored) trainable parameters; `g`: estimate's `_Grads`."""
    root_l, stage_l = plan.split(plan.layouts)
    all_leaves = leaves(root_l) + [x for l, n in zip(stage_l, plan.stage_sizes) for x in leaves(l, n)]
    grad_leaves = leaves(g.root_tree) + [x for l, n in g.stages for x in leaves(l, n)]
    itemsize = lambda l: jnp.dtype(l.dtype).itemsize
    # per byte of the stored (padded, all T slices) parameters; AdamW: 2.0 (two fp32 moments)
    optimizer_per_byte = optimizer_bytes / sum(n * math.prod(l.stored_full_shape) * itemsize(l) for l, n in grad_leaves)
    real = lambda l: math.prod(l.shape) * itemsize(l)
    pad = lambda l: l.padding * itemsize(l)
    params = per_device(all_leaves, real)
    optimizer_b = per_device(grad_leaves, lambda l: real(l) * optimizer_per_byte)
    pad_state = per_device(all_leaves, pad) + per_device(grad_leaves, lambda l: pad(l) * optimizer_per_byte)
    return params, optimizer_b, pad_state, per_device(grad_leaves, pad)


def grad_shards(layouts_and_units, dtype=None) -> int:
    """Bytes per device of the gradient shards of [(layouts, units)] (stored, padded), in `dtype`
    (default: the leaves' own)."""
    items = [x for l, n in layouts_and_units for x in leaves(l, n)]
    return per_device(items, lambda l: math.prod(l.stored_shape) * jnp.dtype(dtype or l.dtype).itemsize)


def real_grad_shards(g) -> int:
    """Bytes per device of the real elements of the trainable leaves' gradient shards."""
    items = leaves(g.root_tree) + [x for l, n in g.stages for x in leaves(l, n)]
    return per_device(items, lambda l: math.prod(l.shape) * jnp.dtype(l.dtype).itemsize)


# ---------------------------------------------------------------- activations: traced per tensor rank

def device_batch(plan, micro):
    """One device's (micro-)batch under sequence parallelism, from `estimate`'s rows-over-all-devices
    shapes: T times the rows (a TP group shares its rows) and 1/T of the sequence."""
    t, dim = plan.tensor, plan.tensor_plan.sequence_dim

    def one(a):
        shape = list(a.shape)
        shape[0] *= t
        shape[dim] //= t
        return jax.ShapeDtypeStruct(tuple(shape), a.dtype)
    return jax.tree.map(one, micro)


def _saved(f, t: int, *args) -> int:
    """Bytes one device saves for f's backward, f traced as one device of the `tensor` axis runs it."""
    return residual_bytes(f, *args, axis_env=[(TENSOR_AXIS, t)])


def _out(f, t: int, *args):
    """One device's output shape of f (its collectives over the `tensor` axis of size t)."""
    return jax.make_jaxpr(f, axis_env=[(TENSOR_AXIS, t)], return_shape=True)(*args)[1]


def transients(h, t: int, ring: bool = False) -> int:
    """What a unit's backward holds besides the residuals, beyond what T = 1 holds: three arrays of
    the TP group's whole sequence (n x D) where T = 1 has one device's tokens (n/T x D): the incoming
    cotangent all-gathered over `tensor` (the transpose of the rowwise reduce-scatter), the rowwise
    matmul's recomputed partial sums before their reduce-scatter, and the cotangent of the colwise
    layers' gathered input before its reduce-scatter. `h`: one device's residual stream (n/T x D).
    (Fitted by count, not by XLA's buffers: at T = 4 on XLA:CPU the compiled step held 2.3-3.3 n x D
    more than these residuals, at T = 2 about as much as T = 1's estimate over-counts: docs/planner.md.)
    `ring`: async TP (parallel/tensor.py), whose rings make those arrays one block at a time: one
    whole-sequence array is left (measured: llama-70b at FSDP 32 x TP 8 on the H100 target compiled
    3.5 GiB smaller with rings, 1.75 such arrays of 2 GiB; docs/tensor-parallel.md).)"""
    return (1 if ring else 3) * tree_bytes(h) * (t - 1)


def activation_estimate(plan, loss_fn: Callable, micro, backend: str | None = None, widen: bool = True,
                        trainable=None) -> dict:
    """`jfsdp.planning.activations.activation_estimate` of a T > 1 plan: {'per_unit', 'unit_working',
    'head', 'stages'} per device, for `micro` in `estimate`'s shapes (rows over all devices)."""
    m, t = plan.model, plan.tensor
    pdt = jnp.dtype(plan.mp.param_dtype or jnp.float32)
    pdt = wire_dtype(pdt, backend or jax.default_backend()) if widen else pdt
    batch = device_batch(plan, micro)
    root_l, stage_l = plan.split(plan.layouts)
    root_p = as_shapes(root_l, pdt)   # a TP leaf's shape is its slice
    root_t, stage_t = plan.split(trainable) if trainable is not None else (None, [None] * len(stage_l))

    h = _out(lambda r, x: vocab.embed(plan, r, x), t, root_p, batch["inputs"])
    policy = getattr(jax.checkpoint_policies, REMAT_POLICIES[plan.remat])
    stages = []
    for st, layouts, tr in zip(m.stages, stage_l, stage_t):
        apply = plan.unit_apply(st.unit)
        unit_fn = lambda x, p, apply=apply, tr=tr: apply(stop_frozen(p, tr), x)
        unit_p = as_shapes(layouts, pdt)
        stages.append({"per_unit": _saved(jax.checkpoint(unit_fn, policy=policy), t, h, unit_p) + tree_bytes(h),
                       "unit_working": _saved(unit_fn, t, h, unit_p) + tree_bytes(h)
                       + transients(h, t, getattr(plan, "async_tp", False))})
        h = _out(unit_fn, t, h, unit_p)
    head = _head(plan, loss_fn, batch, root_p, h, root_t)
    return {**stages[0], "head": head, "stages": stages}


def _head(plan, loss_fn: Callable, batch, root_p, h, root_trainable) -> int:
    """What the vocabulary-parallel head and loss keep for their backward on one device, and the
    buffers their backward makes (as `activations._head_activations`, on the TP group's whole sequence
    and this rank's share of the vocabulary)."""
    t = plan.tensor

    def head(x, r):
        return plan.head(stop_frozen(r, root_trainable), x)
    out = _out(head, t, h, root_p)
    total = _saved(lambda x, r, b: vocab.loss(plan, loss_fn, head(x, r), b), t, h, root_p, batch)
    if isinstance(out, jax.ShapeDtypeStruct):   # logits (the group's tokens, V/T): + their fp32 cotangent
        return total + 2 * nbytes(out)
    tokens = math.prod(batch["inputs"].shape) * t   # the loss runs on the TP group's whole sequence
    return total + fused_head_buffers(plan, loss_fn, out, tokens, root_trainable)
