"""Checkpoints of a tensor-parallel plan (T > 1) in the form every other checkpoint has: whole parameters.

In memory a tensor-parallel leaf (`TensorLayout`, jfsdp/engine/parallel/layout.py) is its T slices one
after the other on axis 0, each padded for S shards over `fsdp`, split over (`tensor`, `fsdp`). No row
range of that array is a row range of the whole parameter (a colwise kernel is split on its columns),
and its shape depends on T and S. On disk it is the whole parameter, as a T = 1 run writes it, so a
checkpoint saved under one T resumes under another T and another S, and exports like any other:
- save (`to_logical`): each TP leaf of the state (the parameter, and Adam's moments shaped like it) is
  turned on the devices into the whole parameter in the row form for S·T shards over (`fsdp`, `tensor`)
  (`logical_layout`), which orbax writes cut to its logical rows, as it writes every other leaf;
- restore (`logical_targets`, then `from_logical`): each TP leaf of the target is read in that row form
  for the target's S·T (rows past the stored ones read as zeros), then turned into the target's TP form.
Each turn is one jitted program (XLA's collectives) per TP layout and direction, which a parameter's
moments reuse: while it runs a device may hold one whole leaf, its units stacked, besides its shards.
Hugging Face import (io/hf.py) takes the restore's way: it streams each TP leaf's whole parameter into
`read_form`'s row form, then turns it.
"""
from __future__ import annotations

import functools

import jax
from jax.sharding import NamedSharding, PartitionSpec as P

from jfsdp.config.mesh import FSDP_AXIS, TENSOR_AXIS
from jfsdp.engine.layout import Layout, is_layout
from jfsdp.engine.parallel.layout import TensorLayout
from jfsdp.io.relayout import param_like, path_name

ROW_AXES = (FSDP_AXIS, TENSOR_AXIS)


def logical_layout(l: TensorLayout) -> Layout:
    """The whole parameter of a TP leaf in the row form for S·T shards over (fsdp, tensor)."""
    return Layout(l.full_shape, l.dtype, l.shards * l.tensor, flat=False, axes=ROW_AXES)


def save_layouts(plan):
    """The plan's layouts with every TP leaf's replaced by its `logical_layout`: what the saved arrays are."""
    return jax.tree.map(lambda l: logical_layout(l) if isinstance(l, TensorLayout) else l, plan.layouts,
                        is_leaf=is_layout)


def _sharding(mesh, lead: int):
    return NamedSharding(mesh, P(*([None] * lead), ROW_AXES))


@functools.lru_cache(maxsize=None)
def _turner(l: TensorLayout, lead: int, sharding, whole: bool):
    """One compiled turn per (layout, stacking, placement, direction): a parameter and its moments share it.
    `whole`: TP form -> whole parameter's row form; else back."""
    w = logical_layout(l)
    f = (lambda u: w.pad(l.unpad_full(u))) if whole else (lambda u: l.pad_full(w.unpad(u)))
    return jax.jit(jax.vmap(f) if lead else f, out_shardings=sharding)


def read_form(l, sharding, lead: int):
    """(layout, placement, turn): how to build a leaf of layout `l` and placement `sharding` from its whole
    parameter. A TP leaf is read as its whole parameter's row form, then turned into `l`'s form on the
    devices; any other leaf is read as it lies (the turn is the identity)."""
    if not isinstance(l, TensorLayout):
        return l, sharding, lambda x: x
    return logical_layout(l), _sharding(sharding.mesh, lead), _turner(l, lead, sharding, False)


def _tp_leaves(plan, state) -> dict:
    """{leaf key path: (lead, TensorLayout)} of the leaves of `state` laid out like a TP parameter."""
    return {k: (a, l) for k, (a, l) in param_like(plan, state).items() if isinstance(l, TensorLayout)}


def to_logical(plan, state):
    """`state` (shards of `plan`) with every TP leaf turned into its whole parameter's row form."""
    tp = _tp_leaves(plan, state)

    def one(path, x):
        if jax.tree_util.keystr(path) not in tp:
            return x
        lead, l = tp[jax.tree_util.keystr(path)]
        return _turner(l, lead, _sharding(x.sharding.mesh, lead), True)(x)
    return jax.tree_util.tree_map_with_path(one, state) if tp else state


def logical_targets(plan, target):
    """(the target for orbax, with every TP leaf read in its whole parameter's row form; what
    `from_logical` needs to turn those into the target's TP form)."""
    tp, later = _tp_leaves(plan, target), {}

    def one(path, t):
        k = jax.tree_util.keystr(path)
        if k not in tp:
            return t
        lead, l = tp[k]
        later[path_name(path)] = (lead, l, t.sharding)   # by name: orbax may hand back other containers
        return jax.ShapeDtypeStruct(tuple(t.shape[:lead]) + logical_layout(l).stored_shape, t.dtype,
                                    sharding=_sharding(t.sharding.mesh, lead))
    return jax.tree_util.tree_map_with_path(one, target), later


def from_logical(state, later: dict):
    """The TP leaves read by `logical_targets`' target turned into the target's TP form and placement."""
    def one(path, x):
        k = path_name(path)
        if k not in later:
            return x
        lead, l, sharding = later[k]
        return _turner(l, lead, sharding, False)(x)
    return jax.tree_util.tree_map_with_path(one, state) if later else state
