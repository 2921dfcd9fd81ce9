"""Gradient accumulation with one gradient reduction per step (`grad_sync='once'`).

With `grad_accum=k` the usual step (`FSDP.loss_and_grad`, `grad_sync='every'`) reduce-scatters every
unit's gradient in each of the k micro-batches: k reduce-scatters per step, and only gradient shards
are held. Here, as FSDP2's `set_requires_gradient_sync(False)` on all but the last micro-batch (DDP's
`no_sync`), each device adds up its own whole gradients over the k micro-batches and reduces them once
after the last: 1/k of the reduce-scatter (or all-reduce) traffic, for one unsharded gradient of the model per
device, in the reduce dtype. The all-gathers do not change: every micro-batch gathers the units
it computes with.

How: every parameter's shard is paired with a slot for its whole gradient (`fsdp.Unreduced`);
`unshard`'s backward then returns the unreduced gradient as the slot's cotangent and nothing for the
shard. The accumulation scan carries the sums in the slots and differentiates with respect to them;
`reduce_gradient` (the same reduce-scatter, replica sum and 1/N as `unshard`'s backward) runs once,
after the scan. A stage of a `Stacked`/`Staged` model then runs the stage passes of
jfsdp/engine/pipeline.py (prefetching where the plan prefetches, one unit per iteration where not),
whose backward adds each unit's gradient to the sum in place and hands back slot + gradient: one
unsharded gradient held. (Differentiating the plain scan would build the micro-batch's gradients in a
stacked buffer of their own and add it to the sum afterwards: two.) A model given as it is (as_is/)
holds one with its own loop (each unit's slot gets slot + gradient) and two when it scans its units.
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from jfsdp.config.errors import ConfigError
from jfsdp.engine import step_metrics
from jfsdp.engine.fsdp import Unreduced, is_unreduced, reduce_gradient
from jfsdp.engine.layout import is_layout

GRAD_SYNC = ("every", "once")


def check_grad_sync(grad_sync) -> str:
    if grad_sync not in GRAD_SYNC:
        raise ConfigError(f"grad_sync must be one of {', '.join(GRAD_SYNC)}, got {grad_sync!r}")
    return grad_sync


def unsupported(plan) -> str | None:
    """Why `plan` cannot accumulate unreduced gradients (None: it can)."""
    if any(m is not None and m.mode in ("ep", "adaptive") for m in plan.moe_stages):
        return ("an expert-parallel MoE stage keeps its experts local and reduces their gradients inside its own "
                "all-to-all step (use jfsdp.MoE('gather'), or grad_sync='every')")
    return None


def _reduce_dtype(plan, layout):
    return jnp.dtype(plan.comm.reduce_dtype or plan.comm.param_dtype or layout.dtype)


def slots(plan):
    """Zero slots for every parameter's whole gradient (unpadded, reduce dtype; a stage's stacked on
    axis 0). Their values are never read: they only give the gradients a place."""
    root_l, stage_l = plan.split(plan.layouts)
    zeros = lambda lead: lambda l: jnp.zeros((*lead, *l.shape), _reduce_dtype(plan, l))
    return plan.join(jax.tree.map(zeros(()), root_l, is_leaf=is_layout),
                     [jax.tree.map(zeros((n,)), sl, is_leaf=is_layout) for sl, n in zip(stage_l, plan.stage_sizes)])


def reduce_whole(plan, whole, trainable=None):
    """The accumulated whole gradients -> gradient shards: `reduce_gradient` per leaf (per unit of a
    stage: one reduce-scatter of the stacked gradients); a frozen leaf's is none (zeros)."""
    if trainable is not None:
        whole = jax.tree.map(lambda t, g: g if t else None, trainable, whole)
    root_l, stage_l = plan.split(plan.layouts)
    root_g, stage_g = plan.split(whole)
    red = lambda l, g: None if g is None else reduce_gradient(g, l, plan.comm)
    stacked = lambda l, g: None if g is None else jax.vmap(lambda x: reduce_gradient(x, l, plan.comm))(g)
    return plan.join(jax.tree.map(red, root_l, root_g, is_leaf=is_layout),
                     [jax.tree.map(stacked, l, g, is_leaf=is_layout) for l, g in zip(stage_l, stage_g)])


def stop_frozen(params, trainable):
    """`params` with `lax.stop_gradient` on the leaves `trainable` (a tree of booleans) marks frozen."""
    if trainable is None:
        return params
    return jax.tree.map(lambda t, p: p if t else lax.stop_gradient(p), trainable, params)


def loss_and_grad_once(plan, loss_fn: Callable, grad_accum: int, trainable=None, metrics=None):
    """(params, batch) -> (mean loss, gradient shards), with the k micro-batches' gradients added up
    unreduced on each device and reduced once. Same contract and result as `FSDP.loss_and_grad`, and the
    same `metrics` (step_metrics.check's, or None): then (loss, gradient shards, {name: value})."""
    why = unsupported(plan)
    if why:
        raise ConfigError(f"grad_sync='once': {why}")

    def local(params, batch):
        def loss(slot_tree, mb):
            paired = jax.tree.map(lambda l, p, s: Unreduced(p, s), plan.layouts, params, slot_tree, is_leaf=is_layout)
            if trainable is not None:   # a frozen leaf: no slot, no gradient (jfsdp/train/frozen.py)
                paired = jax.tree.map(lambda t, u: u if t else lax.stop_gradient(u.shard), trainable, paired,
                                      is_leaf=is_unreduced)
            return plan.batch_loss(loss_fn, paired, mb, metrics)

        vg = jax.value_and_grad(loss, has_aux=metrics is not None)
        mbs = jax.tree.map(lambda x: x.reshape(grad_accum, -1, *x.shape[1:]), batch)

        def acc(carry, mb):
            r = vg(carry[1], mb)   # the slots carry the sums (read only by the pipeline's backward)
            (l, *aux), g = ((r[0],), r[1]) if metrics is None else r
            return (carry[0] + l, g), aux   # each slot's cotangent is its new sum

        (total, whole), aux = lax.scan(acc, (jnp.zeros((), jnp.float32), slots(plan)), mbs)
        grads = reduce_whole(plan, whole, trainable)
        if trainable is not None:
            grads = jax.tree.map(lambda t, g, p: g if t else jnp.zeros_like(p), trainable, grads, params)
        grads = jax.tree.map(lambda g: g / grad_accum, grads)
        aux = [step_metrics.over_devices(metrics, step_metrics.over_micro_batches(metrics, a), plan) for a in aux]
        return (lax.psum(total / grad_accum, plan.loss_axes) / plan.n_devices, grads, *aux)

    out_specs = (P(), plan.param_specs) + (() if metrics is None else ({k: P() for k in metrics},))
    sharded = plan.shard_map(local, (plan.param_specs, plan.batch_spec), out_specs)

    def fn(params, batch):
        plan.check_batch(batch, grad_accum)
        return sharded(params, batch)
    return fn
