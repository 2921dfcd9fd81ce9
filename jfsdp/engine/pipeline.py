"""The prefetch pipeline: a stage of units as an explicit software pipeline with its own VJP.

`fully_shard(prefetch=...)` (remat 'full' with a resharding strategy; the default on GPUs) replaces the
plain scan of fsdp.py with this: unit i+1's all-gather in flight while unit i computes, unit i's
reduce-scatter while unit i-1's backward computes; two gathered units at most. The backward loop hands
each unit's reduced gradient shard to a consumer, which is how the optimizer-in-backward step
(jfsdp/train/update_in_backward.py) plugs in.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax import lax

from jfsdp.engine.fsdp import Comm, Unreduced, reduce_tree, unshard_tree
from jfsdp.engine.layout import at_row


def tie(a, b, on_cpu: bool):
    """(a, b) such that nothing computed from the returned `a` starts before every leaf of `b` exists
    (and, on GPUs, the other way round too): an optimization barrier. XLA:CPU removes barriers before
    it schedules, so there `a` gets 0 * (one element of each leaf of b) added: a data dependency no
    scheduler can hoist above `b` (a conditional's branch was turned into a select and its predicate
    folded). Semantics differ only where b holds inf or NaN, when the step's result is NaN either way."""
    if not on_cpu:
        return lax.optimization_barrier((a, b))
    # one element of every leaf of b, times 0: XLA does not fold 0 * x for floats (x may be inf or NaN)
    zero = 0 * sum(x.reshape(-1)[0].astype(jnp.float32) for x in jax.tree.leaves(b))
    return jax.tree.map(lambda t: t + zero.astype(t.dtype), a), b


def _save(hs, h, i):
    return jax.tree.map(lambda a, x: lax.dynamic_update_index_in_dim(a, x, i, 0), hs, h)


@dataclasses.dataclass(frozen=True)
class StagePasses:
    """One stage's forward and backward passes as an explicit software pipeline (remat 'full'):
    `forward(h, shards, keep) -> (h, saved inputs or None)` and
    `backward(saved, dh, acc, read, consume) -> (dh into the stage, acc)`.

    Forward: unit i+1's all-gather is issued before unit i computes and carried into the next
    iteration, so it is in flight during unit i's compute; only unit 0's gather waits. At most two
    gathered units live (this one and the prefetched one). Saved for backward: the units' inputs.
    Backward, in reverse: unit i-1's gather is issued before unit i is recomputed and differentiated
    (`jax.vjp` of the unit); unit i's gradient is carried (unreduced, param_dtype) and reduce-scattered
    in the next iteration, while unit i-1's backward computes. Only unit n-1's gather and unit 0's
    reduce-scatter have nothing to hide behind. The first and last units run outside the loop (peeled)
    so that nothing is gathered or reduced twice.

    What happens to each reduced gradient shard is the caller's: the backward loop carries `acc`, reads
    unit i's shards with `read(acc, i)` (so that a caller may carry the parameters and update them in
    place) and hands unit i's gradient shard to `consume(acc, i, shard) -> acc` (stack it as the
    gradient; or apply the optimizer to unit i then and there; or add up its squared norm), in the order
    n-1, ..., 0."""
    apply: Callable      # (unit params, h) -> h
    layouts: Any         # the unit's Layout tree
    comm: Comm
    n: int               # units in the stage
    first_stage: bool
    on_cpu: bool
    unreduced: bool = False   # hand each unit's whole gradient (reduce dtype) to the consumer, unreduced

    def gather(self, shards):
        return unshard_tree(shards, self.layouts, self.comm)

    def reduce(self, grads):
        if self.unreduced:
            return jax.tree.map(lambda g: g.astype(self.comm.reduce_dtype or g.dtype), grads)
        return reduce_tree(grads, self.layouts, self.comm)

    def unit_vjp(self, g, h, dh):
        return jax.vjp(self.apply, g, h)[1](dh)  # recompute the unit, then differentiate it

    def forward(self, h, shards, keep: bool):
        n = self.n
        hs = jax.tree.map(lambda a: jnp.zeros((n, *a.shape), a.dtype), h) if keep else None
        first = at_row(shards, 0)
        if not self.first_stage:
            # a later stage's unit 0 is gathered when its input is ready, not hoisted to the top of
            # the step (where XLA would combine it with the root's and keep it through the earlier
            # stages). The first stage's goes with the root's: nothing runs before them, and tied to h
            # it was combined with the head's gather instead, exposing that.
            first, h = tie(first, h, self.on_cpu)
        if n == 1:
            return self.apply(self.gather(first), h), (_save(hs, h, 0) if keep else None)

        def body(carry, i):
            h, g, hs = carry
            nxt = self.gather(at_row(shards, i + 1))  # prefetch: in flight while unit i computes
            if keep:
                hs = _save(hs, h, i)
            return (self.apply(g, h), nxt, hs), None
        (h, g, hs), _ = lax.scan(body, (h, self.gather(first), hs), jnp.arange(n - 1))
        if keep:
            hs = _save(hs, h, n - 1)
        return self.apply(g, h), hs

    def backward(self, hs, dh, acc, read, consume):
        n, on_cpu = self.n, self.on_cpu
        # The barriers order what XLA would otherwise combine into one collective at the top of the
        # step: unit n-1's gather waits for dh (not hoisted into the forward pass), unit n-2's for
        # unit n-1's (so it is in flight during unit n-1's backward, not before it).
        last, dh = tie(read(acc, n - 1), dh, on_cpu)
        g = self.gather(last)
        if n == 1:
            dg, dh = self.unit_vjp(g, at_row(hs, 0), dh)
            return dh, consume(acc, 0, self.reduce(dg))
        prev, g = tie(read(acc, n - 2), g, on_cpu)
        nxt = self.gather(prev)
        pend, dh = self.unit_vjp(g, at_row(hs, n - 1), dh)

        def body(carry, i):  # units n-2 .. 1
            dh, g, pend, acc = carry
            acc = consume(acc, i + 1, self.reduce(pend))  # unit i+1's reduce-scatter, during unit i's backward
            nxt = self.gather(read(acc, i - 1))  # prefetch, during unit i's backward
            dg, dh = self.unit_vjp(g, at_row(hs, i), dh)
            return (dh, nxt, dg, acc), None
        (dh, g, pend, acc), _ = lax.scan(body, (dh, nxt, pend, acc), jnp.arange(n - 2, 0, -1))
        one = self.reduce(pend)  # unit 1's reduce-scatter, during unit 0's backward ...
        dg, dh = self.unit_vjp(g, at_row(hs, 0), dh)
        dg, one = lax.optimization_barrier((dg, one))  # ... finished before unit 0's, not combined with it
        return dh, consume(consume(acc, 1, one), 0, self.reduce(dg))


def _is_unreduced(x) -> bool:
    return isinstance(x, Unreduced)


def _unreduced_bwd(passes: StagePasses, hs, dh, shards):
    """The stage's backward for grad_sync='once' (jfsdp/engine/accumulate.py): each unit's whole gradient
    is added in place to the sum its slot carries, and the slot's cotangent is the new sum (slot +
    gradient): one unsharded gradient held, not the sum and a stacked micro-batch gradient beside it.
    A frozen leaf (a plain shard) gets zeros."""
    def add(acc, i, whole):
        shards, sums = acc
        step = lambda u, a, x: (lax.dynamic_update_index_in_dim(a, lax.dynamic_index_in_dim(a, i, keepdims=False) + x,
                                                                i, 0) if _is_unreduced(u) else a)
        return shards, jax.tree.map(step, shards, sums, whole, is_leaf=_is_unreduced)

    sums = jax.tree.map(lambda u: u.slot if _is_unreduced(u) else jnp.zeros((0,)), shards, is_leaf=_is_unreduced)
    read = lambda acc, i: at_row(acc[0], i)
    dh, (_, sums) = dataclasses.replace(passes, unreduced=True).backward(hs, dh, (shards, sums), read, add)
    grads = jax.tree.map(lambda u, a: Unreduced(jnp.zeros_like(u.shard), a) if _is_unreduced(u) else jnp.zeros_like(u),
                         shards, sums, is_leaf=_is_unreduced)
    return dh, grads


def pipelined_stage(passes: StagePasses):
    """(h, stacked shards) -> h with its own VJP: `passes.forward`, then `passes.backward` whose consumer
    stacks each unit's reduced gradient shard into the stage's gradient."""
    def read(acc, i):
        return at_row(acc[0], i)

    def put(acc, i, shard):
        shards, grads = acc
        return shards, jax.tree.map(lambda a, x: lax.dynamic_update_index_in_dim(a, x, i, 0), grads, shard)

    @jax.custom_vjp
    def stage(h, shards):
        return passes.forward(h, shards, False)[0]

    def stage_fwd(h, shards):
        out, hs = passes.forward(h, shards, True)
        return out, (hs, shards)

    def stage_bwd(res, dh):
        hs, shards = res
        if any(map(_is_unreduced, jax.tree.leaves(shards, is_leaf=_is_unreduced))):
            return _unreduced_bwd(passes, hs, dh, shards)
        dh, (_, grads) = passes.backward(hs, dh, (shards, jax.tree.map(jnp.zeros_like, shards)), read, put)
        return dh, grads
    stage.defvjp(stage_fwd, stage_bwd)
    return stage
