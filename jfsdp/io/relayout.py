"""Checkpoints in one form whatever the layout: every array on disk in its logical (row) shape.

In memory a leaf whose first dimension S does not divide is flat (`jfsdp.engine.layout.Layout`): one
dimension of prod(shape) elements padded to a multiple of S. On disk every leaf keeps its logical shape
(what checkpoints of every earlier version hold, and what any reader of another mesh expects), so:
- save: each flat leaf of the state (parameters and the optimizer subtrees shaped like them) is turned
  into the row form for the same S on the devices (`to_rows`) before orbax writes it cut to its
  logical rows;
- restore: a target leaf that is flat is read in the row form for the target's shard count, then turned
  into the flat form on the devices (`from_rows`).
The turn (`relayout`) runs per unit inside `shard_map`: each device gathers one unit's leaf, takes
its own range of the other form and lets the gathered copy die, so a device holds at most one
unit's leaf beyond its shards (plus the converted copy of the state's flat leaves while saving).
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding

from jfsdp.engine.layout import is_layout


def param_like(sharded, state, layouts=None) -> dict:
    """{leaf key path: (lead, layout)} for every leaf of `state` laid out like a parameter (the
    parameters and each subtree shaped like them: Adam's moments, found by tree structure as
    optax.tree_map_params does, or with holes where a parameter is frozen), when the leaf has the
    stored shape of `layouts` (default: the plan's). `lead` is 1 for a stage's stacked leaves, else 0."""
    layouts = sharded.layouts if layouts is None else layouts
    root_l, stage_l = sharded.split(layouts)
    axes = sharded.join(jax.tree.map(lambda _: 0, root_l, is_leaf=is_layout),
                        [jax.tree.map(lambda _: 1, u, is_leaf=is_layout) for u in stage_l])
    flat = list(zip(jax.tree.leaves(axes), jax.tree.leaves(layouts, is_leaf=is_layout)))
    pdef = jax.tree.structure(layouts, is_leaf=is_layout)
    like_params = lambda x: x is not state and jax.tree.structure(x) == pdef   # noqa: E731
    out = {}
    for path, sub in jax.tree_util.tree_flatten_with_path(state, is_leaf=like_params)[0]:
        if not like_params(sub):
            continue
        for (sub_path, x), (axis, l) in zip(jax.tree_util.tree_flatten_with_path(sub)[0], flat):
            want = (x.shape[0],) + l.stored_full_shape if axis else l.stored_full_shape
            if tuple(x.shape) == want:
                out[jax.tree_util.keystr(path + sub_path)] = (axis, l)
    # subtrees shaped like the parameters but with holes (optax.MaskedNode where a parameter is frozen:
    # jfsdp/train/frozen.py): a leaf whose key path ends with a parameter's and has its stored shape
    params = {jax.tree_util.keystr(p): a for p, a in jax.tree_util.tree_flatten_with_path(layouts, is_leaf=is_layout)[0]}
    leaves = jax.tree_util.tree_flatten_with_path(state)[0]
    for (key, l), axis in zip(params.items(), jax.tree.leaves(axes)):
        for path, x in leaves:
            k = jax.tree_util.keystr(path)
            want = (x.shape[0],) + l.stored_full_shape if axis and x.ndim else l.stored_full_shape
            if k not in out and k.endswith(key) and tuple(x.shape) == want:
                out[k] = (axis, l)
    return out


def path_name(path) -> str:
    """A leaf's key path as checkpoints name it: 'params/root/...', whatever the containers."""
    return "/".join(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path)


def _row_axes(sharding, dim):
    """The mesh axes that split dimension `dim` of an array with this NamedSharding (() if none)."""
    spec = tuple(sharding.spec) + (None,) * (dim + 1)
    a = spec[dim]
    return () if a is None else ((a,) if isinstance(a, str) else tuple(a))


def relayout(x, lead: int, shape: tuple, sharding):
    """A leaf stored along dimension `lead` (rows or flat elements, zeros past the real ones), split over
    the mesh axes that `sharding` names there -> the same data in `shape` (x.shape[:lead] + rows + rest,
    the other form), with the same sharding: each unit's leaf gathered, re-cut and sliced per device."""
    axes = _row_axes(sharding, lead)
    n = math.prod(sharding.mesh.shape[a] for a in axes)
    rows, rest = shape[lead], tuple(shape[lead + 1:])

    def one(u):
        full = lax.all_gather(u, axes, axis=0, tiled=True) if n > 1 else u
        flat, m = full.reshape(-1), rows * math.prod(rest)
        flat = flat[:m] if flat.size >= m else jnp.pad(flat, (0, m - flat.size))
        y = flat.reshape(rows, *rest)
        if n > 1:
            y = lax.dynamic_slice_in_dim(y, lax.axis_index(axes) * (rows // n), rows // n, 0)
        return y

    def local(xl):
        return lax.map(one, xl) if lead else one(xl)
    spec = sharding.spec
    f = jax.shard_map(local, mesh=sharding.mesh, in_specs=spec, out_specs=spec, check_vma=False)
    return jax.jit(f, out_shardings=NamedSharding(sharding.mesh, spec))(x)


def to_rows(sharded, state, layouts=None):
    """(state with every flat leaf in the row form for the same shard count, the row-form layouts).
    `layouts`: the state's parameter layouts, default the plan's."""
    layouts = sharded.layouts if layouts is None else layouts
    row = lambda l: dataclasses.replace(l, flat=False) if l.is_flat else l   # noqa: E731
    rows = jax.tree.map(row, layouts, is_leaf=is_layout)
    turn = {k: (a, l) for k, (a, l) in param_like(sharded, state, layouts).items() if l.is_flat}
    if not turn:
        return state, layouts

    def one(path, x):
        if jax.tree_util.keystr(path) not in turn:
            return x
        lead, l = turn[jax.tree_util.keystr(path)]
        return relayout(x, lead, x.shape[:lead] + row(l).stored_shape, x.sharding)
    return jax.tree_util.tree_map_with_path(one, state), rows


def read_targets(stored: dict, target):
    """(the target for orbax, {path_name: final leaf}) when some leaves of `target` are flat and the
    checkpoint (`stored`: {path_name: stored shape}) holds them in rows: those are read in the row form
    for the target's shard count (the stored rows rounded up to it; orbax fills zeros past them)."""
    later = {}

    def one(path, t):
        k = path_name(path)
        d = stored.get(k)
        if d is None or len(d) != len(t.shape) or not isinstance(getattr(t, "sharding", None), NamedSharding):
            return t
        # flat in the target (elements, 1, ...) after `lead` stack axes, rows on disk
        lead = next((i for i in (0, 1) if tuple(d[:i]) == tuple(t.shape[:i]) and len(t.shape) > i + 1
                     and all(n == 1 for n in t.shape[i + 1:]) and any(n != 1 for n in d[i + 1:])), None)
        if lead is None:
            return t
        n = t.shape[lead] // t.sharding.shard_shape(t.shape)[lead]
        shape = (*d[:lead], -(-d[lead] // n) * n, *d[lead + 1:])
        later[k] = t
        return jax.ShapeDtypeStruct(shape, t.dtype, sharding=t.sharding)
    return jax.tree_util.tree_map_with_path(one, target), later


def _flat_lead(shape) -> int:
    """The stack axes before a flat leaf's (elements, 1, ...): 0 or 1."""
    return 0 if all(n == 1 for n in shape[1:]) else 1


def from_rows(state, later: dict):
    """The leaves read in rows (`read_targets`) turned into the target's flat form."""
    def one(path, x):
        t = later.get(path_name(path))
        return x if t is None else relayout(x, _flat_lead(t.shape), t.shape, t.sharding)
    return jax.tree_util.tree_map_with_path(one, state)
