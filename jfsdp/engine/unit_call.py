"""One FSDP unit called from a model's own code: gather, compute, free; re-gather in the backward pass.

The engine's plain path runs units under a `lax.scan` (fsdp.py), which keeps XLA from merging the
gathers of different iterations. A model given as it is calls its units from its own Python loop,
which XLA sees unrolled: with the units under `jax.checkpoint` alone, XLA was free to merge a unit's
forward and backward all-gathers (common subexpressions) and to start every backward gather early,
keeping every unit gathered (shared/DESIGN.md, "traps"). `call_unit` enforces the contract by data
dependencies instead of a loop:

- the forward gather of a unit waits for the unit's inputs, so it cannot be hoisted to the start of the
  step;
- the backward pass is a custom VJP whose residuals are tied to the incoming cotangent, so the
  re-gather (and everything the checkpoint policy recomputes) happens only once the unit's output
  gradient exists, and cannot be merged with the forward gather;
- the gradient it passes to the previous unit is tied to its own reduced gradient, so each unit's
  weight gradients are computed and reduce-scattered before the previous unit's backward begins.

The ties are data dependencies (`tie`), not optimization barriers, which XLA turns into control
dependencies before it merges common subexpressions.

What is saved between the passes is decided by the unit's checkpoint policy exactly as on the plain
path (`checkpoint_policy`: remat none/dots/full, ZeRO-2 keeps the gathered unit, ZeRO-3 does not);
the gradient of the shards is `unshard`'s VJP: reduce-scatter, sum over replicas, scale.
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax


def _is_dynamic(x) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, np.generic)) or hasattr(x, "aval")


def split_arguments(args, kwargs):
    """(args, kwargs) -> (array leaves, rebuild(leaves) -> (args, kwargs)). Arrays are the unit's traced
    inputs; everything else (flags such as `deterministic`, None, strings, modules) stays static."""
    leaves, treedef = jax.tree.flatten((args, kwargs))
    dynamic = [i for i, x in enumerate(leaves) if _is_dynamic(x)]
    static = list(leaves)

    def rebuild(values):
        full = list(static)
        for i, v in zip(dynamic, values):
            full[i] = v
        return jax.tree.unflatten(treedef, full)
    return [leaves[i] for i in dynamic], rebuild


def _first_scalar(tree):
    """A scalar computed from two elements of each float leaf of `tree` (None if it has none): a cheap
    handle on the moment every leaf exists. It is a reduction, which XLA materializes instead of fusing
    into its consumers: as an elementwise expression, XLA recomputed it inside every consumer from the
    values it was taken from, reaching back along the residual stream's chain of adds and keeping every
    unit's backward buffers alive (measured: +3 MB of temporary memory per Llama unit of width 128)."""
    firsts = [x.reshape(-1)[:2].astype(jnp.float32) for x in jax.tree.leaves(tree)
              if jnp.issubdtype(x.dtype, jnp.floating) and x.size]
    return jnp.sum(jnp.concatenate(firsts)) if firsts else None


def _is_float(x) -> bool:
    return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating)


def tie(shards, anchor):
    """`shards` made to depend on `anchor` (a scalar), values unchanged: + 0 * anchor. XLA does not fold
    `0 * x` for floats (x may be inf or nan), so a gather of the result can neither start before `anchor`
    exists nor be merged with a gather of the same shards elsewhere. Optimization barriers do not do
    this: XLA:CPU and XLA:GPU lower them to control dependencies before common-subexpression
    elimination, which then merged a unit's forward and backward gathers (measured: 4 gathers instead of
    8 for 4 units, every unit kept gathered through the step). Cost: one add per shard element."""
    if anchor is None:
        return shards
    zero = lax.stop_gradient(anchor) * 0
    return jax.tree.map(lambda s: s + zero.astype(s.dtype) if _is_float(s) else s, shards)


def call_unit(compute: Callable, shards, inputs, policy, ordered: bool = True):
    """`compute(shards, inputs) -> outputs` (it gathers the shards with `unshard_tree` and applies the
    unit) as one FSDP unit, ordered by data dependencies (see the module docstring). `inputs` is a
    list of arrays; outputs may be any pytree of arrays. `ordered=False`: no data dependencies, for a unit
    inside a loop on a GPU, whose gather XLA's collective pipeliner issues one iteration ahead and whose
    reduce-scatter one iteration behind (GPU_FLAGS), which a gather tied to the unit's input forbids.
    There the checkpoint does not prevent CSE either, as `fsdp.scan_stage`'s does not: its optimization
    barrier stood between the backward loop's slice of the stacked shards and the re-gather, which the
    pipeliner then left at the top of each iteration with nothing to hide behind (llama-1b: 15 x 17.5
    MiB exposed). A loop body needs no barrier: the forward and backward passes are two loops, whose
    gathers XLA cannot merge."""
    if not ordered:
        return jax.checkpoint(compute, policy=policy, prevent_cse=False)(shards, inputs)
    body = jax.checkpoint(compute, policy=policy, prevent_cse=True)

    @jax.custom_vjp
    def run(shards, inputs):
        return body(tie(shards, _first_scalar(inputs)), inputs)

    def run_fwd(shards, inputs):
        return jax.vjp(body, tie(shards, _first_scalar(inputs)), inputs)

    def run_bwd(pullback, cotangent):
        # the pullback recomputes what the policy did not save (the gather, under ZeRO-3) from the shards
        # it holds; tying them to the cotangent puts that recomputation after the unit's output gradient
        anchor = _first_scalar(cotangent)
        pullback = tie(pullback, anchor)
        shard_grads, input_grads = pullback(cotangent)
        # the gradient handed to the previous unit waits for this unit's reduced gradient: the unit's
        # weight gradients are computed and reduce-scattered before the previous unit's backward starts,
        # not left for the end of the step (XLA:CPU's memory-minimizing scheduler deferred them, keeping
        # every unit's backward activations alive)
        return shard_grads, tie(input_grads, _first_scalar(shard_grads))

    run.defvjp(run_fwd, run_bwd)
    return run(shards, inputs)


