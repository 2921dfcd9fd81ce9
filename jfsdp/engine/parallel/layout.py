"""Where every parameter lies on a (data, fsdp[, context], tensor) mesh: the placement rule.

The rule (shared/DESIGN.md, "More axes"): every parameter is sharded over, or has its gradient summed
over, every axis but `data`, each axis exactly once.
- A tensor-parallel leaf (colwise / rowwise, plan.py) puts its TP dimension on `tensor`: rank t keeps
  slice t of it (a `TensorLayout`, whose `shape` is that slice), and FSDP shards the slice over `fsdp`
  (and `context`, with context parallelism: each context rank holds other tokens, so the reduce-scatter
  over it is the sum its gradient needs). Its gradient is whole on each tensor rank (the sequence was
  gathered before the matmul), so it is reduce-scattered over `fsdp` (and `context`) alone.
- Every other leaf (norm scales, biases, the embedding) is FSDP-sharded over (`fsdp`[, `context`],
  `tensor`) together: each tensor rank sees 1/T of the tokens, and the reduce-scatter over all of them is
  the one sum over `tensor` (and `context`) its gradient needs.
`placement(kind)` is the one function that decides both, and `check_placement` refuses any placement
that would shard or sum over an axis twice or not at all."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jfsdp.config.errors import ConfigError
from jfsdp.config.mesh import CONTEXT_AXIS, DATA_AXIS, FSDP_AXIS, TENSOR_AXIS
from jfsdp.engine.layout import Layout, is_layout
from jfsdp.engine.parallel.plan import COLWISE, ROWWISE

MODEL_AXES = (FSDP_AXIS, TENSOR_AXIS)   # every mesh axis but `data`, each covered exactly once


def model_axes(context: int = 1) -> tuple:
    """The mesh axes but `data`: (fsdp, tensor), with `context` between them when C > 1."""
    return (FSDP_AXIS, CONTEXT_AXIS, TENSOR_AXIS) if context > 1 else MODEL_AXES


def placement(kind: str, context: int = 1) -> tuple:
    """(the axis the TP dimension lies on or None, the axes FSDP shards and reduce-scatters over); at C > 1
    the FSDP axes take `context` after `fsdp`, as they do without tensor parallelism."""
    fsdp = (FSDP_AXIS, CONTEXT_AXIS) if context > 1 else (FSDP_AXIS,)
    if kind in (COLWISE, ROWWISE):
        return TENSOR_AXIS, fsdp
    return None, (*fsdp, TENSOR_AXIS)


def check_placement(tp_axis, fsdp_axes, mesh_axes=(DATA_AXIS,) + MODEL_AXES):
    """RuntimeError unless the TP axis and the FSDP axes together cover every mesh axis but `data`, each
    once: a gradient summed twice over `tensor`, or never, cannot be laid out."""
    covered = ([tp_axis] if tp_axis else []) + list(fsdp_axes)
    want = [a for a in mesh_axes if a != DATA_AXIS]
    if sorted(covered) != sorted(want) or DATA_AXIS in covered:
        raise RuntimeError(f"placement {tp_axis!r} + {fsdp_axes!r} breaks the placement rule: every axis of "
                           f"{want} must be sharded over or summed over exactly once")


@dataclasses.dataclass(frozen=True)
class TensorLayout(Layout):
    """A tensor-parallel leaf: `shape` is one tensor rank's slice (dimension `dim` of the whole parameter
    divided by `tensor`), laid out for S shards over `fsdp` like any leaf. The stored array holds the T
    slices' stored forms one after the other on axis 0, sharded over (`tensor`, `fsdp`)."""
    tensor: int = 1
    dim: int = 0
    tp: str = COLWISE
    full: int = 0   # the whole parameter's size on `dim` when T does not divide it (a vocabulary): the
                    # last slice is padded with zero rows (the head masks their logits); 0: shape[dim] x T

    @property
    def full_shape(self) -> tuple:
        s = list(self.shape)
        s[self.dim] = self.full or s[self.dim] * self.tensor
        return tuple(s)

    @property
    def stored_full_shape(self) -> tuple:
        return (self.tensor * self.padded_rows, *self.row_shape)

    def pad_full(self, x, xp=jnp):
        if self.full:
            widths = [(0, self.shape[self.dim] * self.tensor - self.full if i == self.dim else 0) for i in range(x.ndim)]
            x = xp.pad(x, widths)
        return xp.concatenate([self.pad(p, xp) for p in xp.split(x, self.tensor, axis=self.dim)], axis=0)

    def unpad_full(self, x):
        parts = x.reshape(self.tensor, self.padded_rows, *self.row_shape)
        xp = np if isinstance(x, np.ndarray) else jnp
        x = xp.concatenate([self.unpad(p) for p in parts], axis=self.dim)
        return x[(slice(None),) * self.dim + (slice(0, self.full or None),)]


def spec_axes(layout) -> tuple:
    """The mesh axes a leaf's stored axis 0 is split over: (tensor, fsdp[, context]) for a TP leaf, its FSDP
    axes else."""
    if not isinstance(layout, TensorLayout):
        return layout.gather_axes
    g = layout.gather_axes
    return (TENSOR_AXIS, *((g,) if isinstance(g, str) else g))


def leaf_layout(path: str, shape, dtype, kind: str, shards: int, tensor: int, pad: bool = False, context: int = 1):
    """One parameter's layout under the placement rule (`placement`), for S = `shards` (S*C at C > 1: the
    fsdp x context shards), T = `tensor`. `pad`: a root parameter (a vocabulary-parallel embedding or head)
    whose TP dimension T does not divide is padded to a multiple of T (`TensorLayout.full`) instead of refused."""
    tp_axis, fsdp_axes = placement(kind, context)
    check_placement(tp_axis, fsdp_axes, (DATA_AXIS,) + model_axes(context))
    if tp_axis is None:
        return Layout(tuple(shape), jnp.dtype(dtype), shards * tensor, axes=fsdp_axes)
    if len(shape) != 2:
        raise ConfigError(f"{path} is named {kind} but has shape {tuple(shape)}: tensor parallelism splits Dense "
                          "kernels (in, out), colwise on out, rowwise on in")
    dim = 1 if kind == COLWISE else 0
    if shape[dim] % tensor and not pad:
        raise ConfigError(f"tensor {tensor} does not divide dimension {dim} ({shape[dim]}) of {path} ({kind})")
    local = tuple(-(-n // tensor) if i == dim else n for i, n in enumerate(shape))
    full = shape[dim] if shape[dim] % tensor else 0
    return TensorLayout(local, jnp.dtype(dtype), shards, axes=fsdp_axes if context > 1 else None, tensor=tensor,
                        dim=dim, tp=kind, full=full)


def path_text(path) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def lay_out(plan, root, stages, stage_names, shards: int, tensor: int, context: int = 1):
    """(root layouts, [stage layouts]) of the whole parameters `root` and `stages` (leaves stacked on
    axis 0) under `plan` for S = `shards` (S*C with C = `context` > 1), T = `tensor`. `stage_names`: each
    stage's path prefix ('units', 'stages/0')."""
    plan.check_sizes(tensor)
    seen = []

    def layouts(tree, prefix, stacked):
        def one(p, x):
            name = f"{prefix}/{path_text(p)}"
            seen.append(name)
            kind = plan.kind(name)
            return leaf_layout(name, x.shape[1:] if stacked else x.shape, x.dtype, kind, shards, tensor, not stacked,
                               context)
        return jax.tree_util.tree_map_with_path(one, tree)
    root_l = layouts(root, "root", False)
    stage_l = [layouts(s, name, True) for s, name in zip(stages, stage_names)]
    plan.check_rules(seen)
    for l in stage_l:
        check_biases(l)
    return root_l, stage_l


def check_biases(layouts):
    """ConfigError for a colwise kernel beside a bias: the bias would have to be split with the output
    features (not supported yet); a rowwise layer's bias is added after the reduce-scatter, replicated."""
    for path, l in jax.tree_util.tree_flatten_with_path(layouts, is_leaf=is_layout)[0]:
        if isinstance(l, TensorLayout) and l.tp == COLWISE:
            parent = layouts
            for k in path[:-1]:
                parent = parent[k.key]
            if "bias" in parent:
                raise ConfigError(f"{path_text(path)} is colwise and its layer has a bias: a colwise bias is not "
                                  "supported yet (use_bias=False, or name the layer 'replicate')")


def specs(root_l, stage_l):
    """The PartitionSpecs of the stored arrays: axis 0 of a root leaf, axis 1 of a stacked stage leaf."""
    root = jax.tree.map(lambda l: P(spec_axes(l)), root_l, is_leaf=is_layout)
    return root, [jax.tree.map(lambda l: P(None, spec_axes(l)), s, is_leaf=is_layout) for s in stage_l]


def tp_modules(stage_l) -> dict:
    """{module path (tuple of names, in the unit): 'colwise' / 'rowwise'} of every TP kernel of the stages'
    units; ConfigError for a TP leaf that is not a kernel, or a path two stages name differently."""
    out = {}
    for l in stage_l:
        for path, x in jax.tree_util.tree_flatten_with_path(l, is_leaf=is_layout)[0]:
            if not isinstance(x, TensorLayout):
                continue
            names = tuple(path_text([k]) for k in path)
            if names[-1] != "kernel" or len(names) < 2:
                raise ConfigError(f"{'/'.join(names)} is {x.tp}, but only a Dense layer's 'kernel' can be")
            if out.setdefault(names[:-1], x.tp) != x.tp:
                raise ConfigError(f"layer {'/'.join(names[:-1])} is colwise in one stage and rowwise in another")
    return out
