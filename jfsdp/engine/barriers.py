"""Barriers that order XLA's work without changing a value: `tie` (both ways, or a data dependency on
XLA:CPU, which drops barriers) and `after` (the forward pass only). The prefetch pipeline (pipeline.py),
the root (root.py) and the optimizer-in-backward step (jfsdp/train/update_in_backward.py) order their
collectives with them."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


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


@jax.custom_vjp
def after(a, b):
    """(a, b), with nothing computed from the returned `b` starting before `a` exists: an optimization
    barrier in the forward pass only. The transpose of a plain barrier is a barrier on the cotangents,
    which made the head's gradient reduce-scatter finish before the units' backward could start
    (exposed in full on XLA:GPU's schedule); here the cotangents pass through untouched."""
    return lax.optimization_barrier((a, b))


after.defvjp(lambda a, b: (lax.optimization_barrier((a, b)), None), lambda _, ct: ct)
