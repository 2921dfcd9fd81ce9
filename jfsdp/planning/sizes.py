"""Bytes of the things the planner counts: arrays, trees of them, and the parameter layouts of a plan
(`jfsdp.engine.layout.Layout`: shape, dtype, padding, the stored shape that shards evenly)."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jfsdp.engine.layout import is_layout

GiB = 1 << 30


def nbytes(x) -> int:
    """Bytes of one array or shape (anything with .shape and .dtype)."""
    return int(math.prod(x.shape)) * jnp.dtype(x.dtype).itemsize


def tree_bytes(tree) -> int:
    return sum(nbytes(x) for x in jax.tree.leaves(tree))


def as_shapes(layouts, dtype=None):
    """The layouts' (real, unpadded) shapes as ShapeDtypeStructs in `dtype` (default: own)."""
    return jax.tree.map(lambda l: jax.ShapeDtypeStruct(l.shape, dtype or l.dtype), layouts, is_leaf=is_layout)


def stages(plan) -> list:
    """[(layouts of one unit, number of units)] for every stage of the plan."""
    return list(zip(plan.split(plan.layouts)[1], plan.stage_sizes))


def elements(plan) -> tuple[int, int]:
    """(real elements, padding elements) of all parameters, whole model (each stage's unit counted
    n times)."""
    real = pad = 0
    for layouts, mult in [(plan.split(plan.layouts)[0], 1)] + stages(plan):
        for l in jax.tree.leaves(layouts, is_leaf=is_layout):
            real += mult * math.prod(l.shape)
            pad += mult * l.padding
    return real, pad


def gathered_bytes(layouts, dtype) -> int:
    """Bytes one gather of these layouts puts on the wire (padded): `dtype` per element, or a layout's
    own `wire_itemsize` (a float8-gathered weight: 1 byte, jfsdp.engine.float8.Float8Layout)."""
    return sum(math.prod(l.stored_shape) * getattr(l, "wire_itemsize", jnp.dtype(dtype).itemsize)
               for l in jax.tree.leaves(layouts, is_leaf=is_layout))


def float8_leaves(layouts) -> int:
    """How many leaves of these layouts are gathered in float8 (each with one amax all-reduce)."""
    return sum(hasattr(l, "wire_itemsize") for l in jax.tree.leaves(layouts, is_leaf=is_layout))


def leaf_layouts(plan) -> dict:
    """{parameter path: how it is sharded}: 'dim0 ROWSxREST' (split on dimension 0) or 'flat N' (flattened,
    N elements with the padding), per unit; and a 'summary' line (leaves of each kind, padding)."""
    out, kinds, pad = {}, {"dim0": 0, "flat": 0}, 0
    parts = [("root", plan.split(plan.layouts)[0], 1)] + [(f"stage {j}", *s) for j, s in enumerate(stages(plan))]
    for name, layouts, mult in parts:
        for p, l in jax.tree_util.tree_flatten_with_path(layouts, is_leaf=is_layout)[0]:
            out[name + jax.tree_util.keystr(p)] = f"{l.kind} {'x'.join(map(str, l.stored_shape))}"
            kinds[l.kind] += mult
            pad += mult * l.padding
    out["summary"] = (f"{kinds['dim0']} leaves split on dimension 0, {kinds['flat']} flattened; "
                      f"{pad} elements of padding in all (fewer than S = {plan.shards} per leaf"
                      + (f", S·T = {plan.shards * plan.tensor} for a leaf not tensor-parallel)" if plan.tensor > 1 else ")"))
    return out
