"""How jfsdp sees a model and its parameters: the model as FSDP units (`Stacked`, `Staged`, `Stage`), one
parameter's sharded layout (`Layout`: split on its first dimension when S divides it, else flattened and
padded by fewer than S elements, so that every device keeps 1/S of every leaf), and the tree helpers shared by the engine, the
training step, checkpoints and the planner."""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jfsdp.config.errors import ConfigError
from jfsdp.config.mesh import FSDP_AXIS

# the keys of the parameter tree: {'root': ..., 'units': stacked} (Stacked) or {'root', 'stages': [...]}
ROOT, UNITS, STAGES = "root", "units", "stages"


@dataclasses.dataclass(frozen=True)
class Stage:
    """`n_units` copies of one unit module (h -> h, same shape in and out), each with its own
    parameters: stacked on axis 0 and run under one `lax.scan`. A stage of one unit may change the
    shape of h (a projection between stages of different widths)."""
    unit: nn.Module
    n_units: int


@dataclasses.dataclass(frozen=True)
class Stacked:
    """A model as FSDP units: `root` holds the non-repeated parameters and has two methods,
    `embed(inputs) -> h` and `head(h) -> outputs`; `unit` (h -> h) is repeated `n_units` times with
    its own parameters each. Tied weights live in the root and are used by both methods.
    Parameters: {'root': tree, 'units': tree with every leaf stacked on axis 0 (n_units rows)}."""
    root: nn.Module
    unit: nn.Module
    n_units: int
    embed_method: str = "embed"
    head_method: str = "head"

    @property
    def stages(self) -> tuple:
        return (Stage(self.unit, self.n_units),)


@dataclasses.dataclass(frozen=True)
class Staged:
    """A model whose repeated blocks are not all alike: `root` as in `Stacked`, then a sequence of
    stages run in order, each `n` copies of its own unit module (different block types, widths,
    depths). `stages` takes `Stage`s or `(unit, n)` pairs. Every unit of every stage is an FSDP unit:
    gathered just before it computes, freed after. Blocks that alternate (A, B, A, B...) are best one
    unit holding both, repeated: one stage, one scan.
    Parameters: {'root': tree, 'stages': [tree per stage, leaves stacked on axis 0 (its n rows)]}."""
    root: nn.Module
    stages: tuple
    embed_method: str = "embed"
    head_method: str = "head"

    def __post_init__(self):
        if isinstance(self.stages, (Stage, nn.Module)) or not isinstance(self.stages, (list, tuple)):
            raise ConfigError("Staged(root, stages): stages must be a list of jfsdp.Stage(unit, n_units) "
                              f"or (unit, n_units) pairs, got {type(self.stages).__name__}")
        stages = []
        for i, s in enumerate(self.stages):
            if isinstance(s, (tuple, list)) and len(s) == 2:
                s = Stage(*s)
            if not isinstance(s, Stage):
                raise ConfigError(f"stage {i} must be a jfsdp.Stage(unit, n_units) or a (unit, n_units) pair, "
                                  f"got {type(s).__name__}")
            stages.append(s)
        if not stages:
            raise ConfigError("Staged needs at least one stage")
        object.__setattr__(self, "stages", tuple(stages))

    @property
    def n_units(self) -> int:
        return sum(s.n_units for s in self.stages)


@dataclasses.dataclass(frozen=True)
class Layout:
    """One parameter: its unsharded shape (per unit) and how it is stored as S even shards.

    The rule (each device keeps 1/S of every leaf, padding < S elements):
    - `rows` (dimension 0) split over the S shards when S divides it: FSDP2's Shard(0), no padding;
    - otherwise the leaf flattened to one dimension of prod(shape) elements, padded to a multiple of S
      (`flat`): fewer than S elements of padding, whatever the shape ((2, d, f), (heads, d, h), (E, d, f)
      with E < S). Row-major flattening keeps each gathered leaf one contiguous buffer that is the
      parameter's bytes in order: unpadding is a prefix and a reshape, never a transpose.
    Leaves of one dimension (and scalars, as (1,)) are padded on dimension 0, the same either way.
    `flat` forces the flat (True) or the row (False) form: checkpoints convert between them.
    `axes`: the mesh axes the S shards lie on and are gathered over (None: `fsdp`; with tensor
    parallelism a leaf that is not tensor-parallel lies on (`fsdp`, `tensor`), jfsdp/engine/parallel)."""
    shape: tuple
    dtype: Any
    shards: int
    flat: bool | None = None
    axes: tuple | None = None

    @property
    def gather_axes(self):
        """The mesh axis (or axes) that `unshard` gathers over and the gradient is reduce-scattered over."""
        return FSDP_AXIS if self.axes is None else self.axes

    @property
    def is_flat(self) -> bool:
        if self.flat is not None:
            return self.flat and len(self.shape) >= 2
        return len(self.shape) >= 2 and self.shape[0] % self.shards != 0

    @property
    def rows(self) -> int:
        """Length of the stored axis 0 before padding (elements when flat)."""
        if self.is_flat:
            return math.prod(self.shape)
        return self.shape[0] if self.shape else 1

    @property
    def row_shape(self) -> tuple:
        """What one row of the stored array is: shape[1:], or ones when flat (a flat leaf keeps its number
        of dimensions, (elements, 1, ...), so that masks by ndim, as the default weight decay's, hold)."""
        return (1,) * (len(self.shape) - 1) if self.is_flat else tuple(self.shape[1:])

    @property
    def padded_rows(self) -> int:
        return -(-self.rows // self.shards) * self.shards

    @property
    def stored_shape(self) -> tuple:
        return (self.padded_rows, *self.row_shape)

    @property
    def shard_shape(self) -> tuple:
        """One device's shard (sharded over `shards`)."""
        return (self.padded_rows // self.shards, *self.row_shape)

    @property
    def kind(self) -> str:
        """How the leaf is sharded, for reports: 'dim0' or 'flat'."""
        return "flat" if self.is_flat else "dim0"

    @property
    def padding(self) -> int:
        """Elements of padding per unit."""
        return (self.padded_rows - self.rows) * math.prod(self.row_shape)

    def pad(self, x, xp=jnp):
        x = x.reshape(self.rows, *self.row_shape)
        return xp.pad(x, [(0, self.padded_rows - self.rows)] + [(0, 0)] * (x.ndim - 1))

    def unpad(self, x):
        return x[: self.rows].reshape(self.shape)

    # The whole parameter and its stored (global) array. Here the same as `shape`, `stored_shape`, `pad`
    # and `unpad`; a tensor-parallel leaf (parallel/layout.py) stores its T slices one after the other.
    @property
    def full_shape(self) -> tuple:
        return self.shape

    @property
    def stored_full_shape(self) -> tuple:
        return self.stored_shape

    def pad_full(self, x, xp=jnp):
        return self.pad(x, xp)

    def unpad_full(self, x):
        return self.unpad(x)


def at_row(stacked, i):
    """Row i of every leaf of a stacked tree (a traced index)."""
    return jax.tree.map(lambda x: lax.dynamic_index_in_dim(x, i, keepdims=False), stacked)


def is_layout(x):
    return isinstance(x, Layout)


def stored_bytes(layouts, dtype=None) -> int:
    """Bytes of one unsharded (gathered, padded) copy of these layouts, in `dtype` (default: their own)."""
    return sum(math.prod(l.stored_shape) * jnp.dtype(dtype or l.dtype).itemsize
               for l in jax.tree.leaves(layouts, is_leaf=is_layout))


def tree_shapes(h):
    """The shape of h, or the tree of its leaves' shapes when h is a pytree."""
    return h.shape if hasattr(h, "shape") else jax.tree.map(lambda a: tuple(a.shape), h)


def zeros_like_tree(h):
    return jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), h)


def paths(tree, is_leaf=None) -> dict:
    """{'['a']['b']': leaf} of a tree: how a message names a parameter."""
    return {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)[0]}


def listing(names, limit=4) -> str:
    names = sorted(names)
    return ", ".join(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")


def stack_units(units) -> Any:
    """Per-unit parameter trees (a list, one per layer, all of the same structure and shapes) ->
    one tree whose leaves are stacked on a new axis 0: jfsdp's layout of a stage (host arrays)."""
    if isinstance(units, Mapping) or not isinstance(units, (list, tuple)) or not units:
        raise ConfigError(f"stack_units takes a non-empty list of per-unit parameter trees, got {type(units).__name__}")
    first = paths(units[0])
    for i, u in enumerate(units[1:], 1):
        got = paths(u)
        if set(got) != set(first):
            raise ConfigError(f"unit {i} has other parameters than unit 0: missing {listing(set(first) - set(got)) or 'none'}, "
                              f"unexpected {listing(set(got) - set(first)) or 'none'}")
        for k, x in got.items():
            if np.shape(x) != np.shape(first[k]):
                raise ConfigError(f"unit {i}{k} has shape {np.shape(x)}, unit 0 has {np.shape(first[k])}: "
                                  "units stacked together must be alike (put different ones in different stages)")
    treedef = jax.tree.structure(units[0])
    leaves = [np.stack([np.asarray(x) for x in xs]) for xs in zip(*(treedef.flatten_up_to(u) for u in units))]
    return jax.tree.unflatten(treedef, leaves)


def unstack_units(stacked) -> list:
    """The inverse of `stack_units`: a tree stacked on axis 0 -> a list of per-unit trees."""
    leaves, treedef = jax.tree.flatten(stacked)
    n = {np.shape(x)[0] if np.ndim(x) else None for x in leaves}
    if len(n) != 1 or None in n:
        raise ConfigError(f"unstack_units needs every leaf stacked on axis 0 with one length, got lengths {sorted(map(str, n))}")
    return [jax.tree.unflatten(treedef, [np.asarray(x[i]) for x in leaves]) for i in range(n.pop())]


def check_model(model):
    """ConfigError unless `model` is a well-formed Stacked or Staged of flax modules."""
    if not isinstance(model, (Stacked, Staged)):
        raise ConfigError("fully_shard expects a Flax model as it is (a Linen or NNX module, with units=), "
                          "jfsdp.Stacked(root, unit, n_units) or jfsdp.Staged(root, [(unit_a, n_a), ...]); "
                          f"got {type(model).__name__}")
    if isinstance(model, Stacked) and not isinstance(model.unit, nn.Module):
        raise ConfigError(f"Stacked's unit must be one flax Module repeated n_units times, got {type(model.unit).__name__}; "
                          "for units that are not all alike use jfsdp.Staged(root, [(unit_a, n_a), (unit_b, n_b), ...])")
    if not isinstance(model.root, nn.Module):
        raise ConfigError(f"the root must be a flax Module, got {type(model.root).__name__}")
    for meth in (model.embed_method, model.head_method):
        if not callable(getattr(model.root, meth, None)):
            raise ConfigError(f"the root module {type(model.root).__name__} has no method '{meth}': a root needs "
                              "embed(inputs) -> h and head(h) -> outputs")
    for i, st in enumerate(model.stages):
        if not isinstance(st.unit, nn.Module):
            raise ConfigError(f"stage {i}: the unit must be a flax Module, got {type(st.unit).__name__}")
        if not isinstance(st.n_units, (int, np.integer)) or isinstance(st.n_units, bool) or st.n_units < 1:
            what = "n_units" if isinstance(model, Stacked) else f"stage {i}: n_units"
            raise ConfigError(f"{what} must be an integer of at least 1, got {st.n_units!r}")
