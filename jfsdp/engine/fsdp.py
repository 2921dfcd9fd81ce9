"""The FSDP engine's plain path: gather a unit, compute, free it; reduce-scatter its gradient.

Inside `shard_map` every device holds one row-shard of each parameter (`jfsdp.engine.layout.Layout`).
`unshard` casts a shard to the compute dtype and all-gathers it over the `fsdp` axis; its custom VJP is
the gradient path: reduce-scatter over `fsdp` in the reduce dtype, a sum over the replica axes, the 1/N
of the mean. A stage's units run under one `lax.scan` over their stacked shards (`scan_stage`), each
body under `jax.checkpoint` with a policy (`checkpoint_policy`) that decides whether the gathered unit is
kept for the backward pass (ZeRO-2) or gathered again (ZeRO-3). A scan, not a Python loop: XLA cannot
merge the gathers of different iterations, so one unit at a time is unsharded, however deep the model.
The prefetch pipeline (pipeline.py) and expert parallelism (moe.py) replace `scan_stage` where they apply.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jfsdp.config.policy import REMAT_POLICIES, check_remat
from jfsdp.engine.layout import Layout, is_layout


@dataclasses.dataclass(frozen=True)
class Comm:
    """How parameters go out and gradients come back: gathered in `param_dtype`; reduce-scattered over
    each leaf's axes (`Layout.gather_axes`: `fsdp`, and `tensor` too for a leaf that is not
    tensor-parallel) in `reduce_dtype` when S > 1, then summed over `reduce_axes`, then times `scale`
    (1/N: the loss is the mean over all N devices' batches)."""
    reduce_axes: tuple
    scale: float
    param_dtype: Any
    reduce_dtype: Any

    def finish(self, g, dtype):
        """A gradient shard reduced over the shards -> the step's: summed over `reduce_axes`, cast to `dtype`
        (the master's), times `scale`."""
        if self.reduce_axes:
            g = lax.psum(g, self.reduce_axes)
        return g.astype(dtype) * self.scale


class Unreduced(NamedTuple):
    """A shard and a slot for its whole gradient: `unshard` gathers `shard` as usual, and its backward
    leaves the gradient unreduced and adds it to the slot (the parameter's unpadded shape, reduce
    dtype): the slot carries the running sum, and its cotangent is the new sum. Gradient accumulation
    with one reduce-scatter per step differentiates with respect to the slots
    (jfsdp/engine/accumulate.py)."""
    shard: Any
    slot: Any


def is_unreduced(x) -> bool:
    """A shard paired with its gradient slot (`Unreduced`): one parameter, not two leaves."""
    return isinstance(x, Unreduced)


def any_unreduced(tree) -> bool:
    """Whether a tree of shards comes paired with gradient slots (grad_sync='once')."""
    return any(map(is_unreduced, jax.tree.leaves(tree, is_leaf=is_unreduced)))


def unshard(shard, layout: Layout, comm: Comm):
    """Shard (rows/S, ...) in the master dtype -> the whole parameter in param_dtype. Its gradient is
    reduced (`reduce_gradient`) into the shard's, or, for an `Unreduced` pair, left whole in the slot's."""
    if isinstance(shard, Unreduced):
        return _unshard_unreduced(shard.shard, shard.slot, layout, comm)
    return _unshard(shard, layout, comm)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _unshard(shard, layout: Layout, comm: Comm):
    x = shard.astype(comm.param_dtype or shard.dtype)
    if layout.shards > 1:
        x = lax.all_gather(x, layout.gather_axes, axis=0, tiled=True)
    return layout.unpad(x)


def reduce_gradient(g, layout: Layout, comm: Comm):
    """A whole parameter's gradient -> its reduced shard: reduce dtype, reduce-scatter over `fsdp`, sum
    over the replica axes, scale, master dtype. `unshard`'s backward."""
    g = layout.pad(g.astype(comm.reduce_dtype or g.dtype))
    if layout.shards > 1:
        g = lax.psum_scatter(g, layout.gather_axes, scatter_dimension=0, tiled=True)
    return comm.finish(g, layout.dtype)


def _unshard_fwd(shard, layout, comm):
    return unshard(shard, layout, comm), None


def _unshard_bwd(layout, comm, _, g):
    return (reduce_gradient(g, layout, comm),)


_unshard.defvjp(_unshard_fwd, _unshard_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _unshard_unreduced(shard, slot, layout: Layout, comm: Comm):
    return _unshard(shard, layout, comm)


def _unreduced_fwd(shard, slot, layout, comm):
    return _unshard(shard, layout, comm), slot


def _unreduced_bwd(layout, comm, slot, g):
    # no gradient for the shard; for the slot, the sum it carries plus the whole gradient: the old sum
    # dies here, so no second whole gradient of the parameter waits beside it
    return None, slot + g.astype(slot.dtype)


_unshard_unreduced.defvjp(_unreduced_fwd, _unreduced_bwd)


def unshard_tree(shards, layouts, comm: Comm, amaxes=None):
    """`unshard` on every leaf of a unit's (or the root's) tree of shards; a layout with its own
    `unshard` (float8.Float8Layout: gathered in float8) gathers its leaf itself, with its amax from
    `amaxes` (a tree like `layouts`, float8.unit_amaxes) where given."""
    def one(l, x, a=None):
        if not hasattr(l, "unshard"):
            return unshard(x, l, comm)
        return l.unshard(x, comm) if a is None else l.unshard(x, comm, a)
    if amaxes is None:
        return jax.tree.map(one, layouts, shards, is_leaf=is_layout)
    return jax.tree.map(one, layouts, shards, amaxes, is_leaf=is_layout)


def reduce_tree(grads, layouts, comm: Comm):
    """`reduce_gradient` on every leaf of a tree of whole gradients (a layout's own `reduce` first)."""
    def one(l, g):
        return l.reduce(g, comm) if hasattr(l, "reduce") else reduce_gradient(g, l, comm)
    return jax.tree.map(one, layouts, grads, is_leaf=is_layout)


# Custom-VJP calls that checkpoint policies treat as `unshard` (saved only when not resharding), by
# their backward function; and names (`checkpoint_name`) of values that stand for a matmul's output.
_GATHERS, _DOT_NAMES = [_unshard_bwd, _unreduced_bwd], set()


def treat_as_unshard(bwd):
    """Checkpoint policies treat custom_vjp calls with this backward as `unshard` (a float8 gather)."""
    _GATHERS.append(bwd)


def treat_as_dot(name: str):
    """Checkpoint policies treat a value named `name` (jax.ad_checkpoint.checkpoint_name) as a matmul's
    output, and the low-precision dot_general that computes it as an intermediate: remat 'dots' then
    keeps the float8 matmul's bf16 output, not its fp32 accumulator (twice the bytes)."""
    _DOT_NAMES.add(name)


def _is_low_precision_dot(prim, avals) -> bool:
    return prim is lax.dot_general_p and any(jnp.dtype(a.dtype).itemsize == 1 for a in avals)


def _bwd_of(prim, params):
    return getattr(params.get("bwd"), "f", None) if prim.name == "custom_vjp_call" else None


def _is_unshard(prim, params) -> bool:
    """Whether a primitive seen by a checkpoint policy is `unshard` (a custom_vjp call whose
    backward is ours)."""
    return any(_bwd_of(prim, params) is b for b in _GATHERS)


@functools.cache
def _policy_sees_unshard() -> bool:
    """Self-check, once per process: does a checkpoint policy recognize `unshard` in this jax
    version? `_is_unshard` reads a jax-internal attribute; if that ever changes, ZeRO-2/ZeRO-3
    would silently swap memory behaviour, so fully_shard refuses to run instead."""
    seen = []

    def probe(prim, *_, **params):
        seen.append(_is_unshard(prim, params))
        return False

    layout, comm = Layout((2,), jnp.dtype(jnp.float32), 1), Comm((), 1.0, None, None)
    f = jax.checkpoint(lambda x: jnp.sum(unshard(x, layout, comm) ** 2), policy=probe)
    jax.eval_shape(jax.grad(f), jax.ShapeDtypeStruct((2,), jnp.float32))
    return any(seen)


def checkpoint_policy(remat: str, reshard_after_forward: bool):
    """What the backward pass of a unit may reuse from its forward pass.

    remat: 'none' saves every activation, 'full' saves only the unit's input, 'dots' saves matmul
    outputs and recomputes the elementwise work (`jfsdp.config.policy.REMAT_POLICIES`). On top of that,
    a gathered parameter (the output of `unshard`) is never saved when resharding after forward (ZeRO-3:
    the backward pass gathers it again) and always saved when not (ZeRO-2). The decision is made on
    `unshard` itself: naming its output would not do, because remat then saves the nearest saveable
    producer, which is the same gathered array."""
    base = getattr(jax.checkpoint_policies, REMAT_POLICIES[check_remat(remat)])
    if not _policy_sees_unshard():
        raise RuntimeError(f"jfsdp cannot identify its all-gather inside jax.checkpoint on jax {jax.__version__}; "
                           "reshard_after_forward cannot be honoured (please report this)")
    keep_unsharded = not reshard_after_forward

    def policy(prim, *avals, **params):
        if _is_unshard(prim, params):
            return keep_unsharded
        if prim.name == "name" and params.get("name") in _DOT_NAMES:
            return base(lax.dot_general_p, *avals)
        if _is_low_precision_dot(prim, avals):
            return False
        return base(prim, *avals, **params)
    return policy


def scan_stage(compute: Callable, h, shards, policy, keeps_shape: bool = True):
    """A stage's units under one `lax.scan` over their stacked shards: `compute(h, unit_shards) -> h`
    gathers one unit (`unshard_tree`), applies it and lets the gathered copy die; `policy`
    (`checkpoint_policy`) says what its backward pass recomputes."""
    body = jax.checkpoint(compute, policy=policy, prevent_cse=False)
    if keeps_shape:
        return lax.scan(lambda c, p: (body(c, p), None), h, shards)[0]
    # one unit that changes the width: still a scan (of one), so that its gathered parameters
    # live in the loop's own scope like every other unit's
    return lax.scan(lambda c, p: (c, body(h, p)), None, shards)[1][0]
