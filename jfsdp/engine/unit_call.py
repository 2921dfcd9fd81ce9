"""One FSDP unit called from a model's own code: gather, compute, free; re-gather in the backward pass.

The engine's plain path runs units under a `lax.scan` (fsdp.py), which keeps XLA from merging the
gathers of different iterations. A model given as it is calls its units from its own Python loop,
which XLA sees unrolled: with the units under `jax.checkpoint` alone, XLA was free to merge a unit's
forward and backward all-gathers (common subexpressions) and to start every backward gather early,
keeping every unit gathered (shared/DESIGN.md, "traps"). `call_unit` enforces the contract by data
dependencies instead of a loop:

- the forward gather of a unit waits for the unit's inputs (an optimization barrier over the shards
  and the inputs), so it cannot be hoisted to the start of the step;
- the backward pass is a custom VJP whose residuals pass through an optimization barrier together with
  the incoming cotangent, so the re-gather (and everything the checkpoint policy recomputes) happens
  only once the unit's output gradient exists, and cannot be merged with the forward gather.

What is saved between the passes is decided by the unit's checkpoint policy exactly as on the plain
path (`checkpoint_policy`: remat none/dots/full, ZeRO-2 keeps the gathered unit, ZeRO-3 does not);
the gradient of the shards is `unshard`'s VJP: reduce-scatter, sum over replicas, scale.
"""
from __future__ import annotations

from typing import Callable

import jax
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


def call_unit(compute: Callable, shards, inputs, policy):
    """`compute(shards, inputs) -> outputs` (it gathers the shards with `unshard_tree` and applies the
    unit) as one FSDP unit, ordered by data dependencies (see the module docstring). `inputs` is a
    list of arrays; outputs may be any pytree of arrays."""
    body = jax.checkpoint(compute, policy=policy, prevent_cse=True)

    @jax.custom_vjp
    def run(shards, inputs):
        return body(*lax.optimization_barrier((shards, inputs)))

    def run_fwd(shards, inputs):
        outputs, pullback = jax.vjp(body, *lax.optimization_barrier((shards, inputs)))
        return outputs, pullback

    def run_bwd(pullback, cotangent):
        pullback, cotangent = lax.optimization_barrier((pullback, cotangent))
        return pullback(cotangent)

    run.defvjp(run_fwd, run_bwd)
    return run(shards, inputs)
