"""Tensor parallelism for a Flax model given as it is, read from the logical axis names it already carries.

A Linen kernel made with `nn.with_logical_partitioning(init, ('embed', 'mlp'))`, or an NNX parameter with
`out_sharding=('embed', 'mlp')` metadata (`nnx.with_partitioning`), names each of its dimensions. The
rules (`logical_rules=`, default `DEFAULT_RULES`: mlp, heads, kv, vocab -> tensor) map names to the mesh
axis `tensor` or to None, as Flax's own logical rules do: a dimension takes the first rule of its name
whose axis this parameter does not use yet, so a kernel ('embed', 'heads', 'kv') puts `heads` on
`tensor` and leaves `kv` whole.

The model's modules are not modified: they reshape to their full head counts, so no hand-written
collective can run inside them. The step's `shard_map` is manual over `data` and `fsdp` only, and
`tensor` is left to XLA's SPMD partitioner (partial-auto): inside, every value has its whole size on
`tensor`, and XLA splits the work and inserts the collectives over `tensor` where the shardings meet.
The activations between units are (batch, sequence, ...): a rule ('sequence', 'tensor') splits them on
`tensor` along the sequence (sequence parallelism), at every unit call's boundary.
The placement:
- a tensor-parallel leaf (`LogicalTensorLayout`) is stored as its T slices on the named dimension, axis 0
  of the stored array on `tensor`, each slice FSDP-sharded over `fsdp` like any leaf; its gather over
  `fsdp` moves 1/T of the leaf, and the whole leaf it assembles carries a sharding constraint that keeps
  it split on `tensor`;
- every other leaf is FSDP-sharded over `fsdp` and replicated over `tensor`.
Every gradient is right over `tensor` by construction: `tensor` is not a manual axis, so each value (the
loss, every gradient) is the whole one, and XLA's partitioner does the one sum over `tensor` that a
parameter used on sequence-split tokens needs. Nothing can sum it twice or not at all.
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

from jfsdp.config.errors import ConfigError
from jfsdp.config.mesh import FSDP_AXIS, TENSOR_AXIS
from jfsdp.engine.fsdp import treat_as_unshard
from jfsdp.engine.layout import Layout, is_layout
from jfsdp.engine.parallel.layout import TensorLayout

DEFAULT_RULES = (("mlp", TENSOR_AXIS), ("heads", TENSOR_AXIS), ("kv", TENSOR_AXIS), ("vocab", TENSOR_AXIS))
SEQUENCE = "sequence"   # the logical name of axis 1 of the activations between units: ('sequence', 'tensor') turns
                        # sequence parallelism on (`sequence_split`)


def check_rules(rules, mesh) -> tuple:
    """`logical_rules=` (None: `DEFAULT_RULES`; a dict or (name, axis) pairs) as pairs; ConfigError for a
    rule whose axis the mesh lacks, or that names an axis other than `tensor` (FSDP places the rest)."""
    rules = DEFAULT_RULES if rules is None else rules
    rules = tuple(rules.items()) if isinstance(rules, Mapping) else rules
    try:
        rules = tuple((name, axis) for name, axis in rules)
    except (TypeError, ValueError):
        raise ConfigError(f"logical_rules must be (logical name, mesh axis or None) pairs, got {rules!r}") from None
    for name, axis in rules:
        if not isinstance(name, str) or not (axis is None or isinstance(axis, str)):
            raise ConfigError(f"logical rule {(name, axis)!r}: expected (a logical name, a mesh axis name or None)")
        if axis is not None and axis not in mesh.axis_names:
            raise ConfigError(f"logical rule {name!r} -> {axis!r}: the mesh has no axis {axis!r} (its axes: "
                              f"{', '.join(mesh.axis_names)}; make_mesh(spec, tensor=T) adds 'tensor')")
        if axis not in (None, TENSOR_AXIS):
            raise ConfigError(f"logical rule {name!r} -> {axis!r}: a rule maps a name to 'tensor' or None; jfsdp "
                              f"places every parameter over '{FSDP_AXIS}' itself")
    return rules


def tensor_dim(names, rules):
    """The dimension of a parameter with logical `names` that lies on `tensor` (None: none), Flax's way:
    each dimension takes the first rule of its name whose axis is not taken yet."""
    taken = None
    for i, name in enumerate(names or ()):
        for rule_name, axis in rules:
            if rule_name != name or (axis is not None and taken is not None):
                continue
            if axis is not None:
                taken = i
            break
    return taken


def linen_names(boxed) -> dict:
    """{parameter path: its logical names} of a Linen variables tree as `init` gives it (boxed)."""
    import flax.linen as nn
    box = lambda x: isinstance(x, nn.Partitioned)
    flat = jax.tree_util.tree_flatten_with_path(boxed, is_leaf=box)[0]
    return {jax.tree_util.keystr(p): tuple(x.names) for p, x in flat if box(x)}


def nnx_names(state) -> dict:
    """{parameter path: its logical names} of an NNX parameter state (`out_sharding` metadata)."""
    from flax import nnx
    var = lambda x: isinstance(x, nnx.Variable)
    out = {}
    for p, v in jax.tree_util.tree_flatten_with_path(state, is_leaf=var)[0]:
        meta = v.get_metadata() if var(v) else {}
        names = meta.get("out_sharding") or meta.get("sharding_names") or meta.get("sharding")
        if names:
            out[jax.tree_util.keystr(p)] = tuple(names)
    return out


@dataclasses.dataclass(frozen=True)
class LogicalTensorLayout(TensorLayout):
    """A tensor-parallel leaf of a model given as it is: `shape` is one slice (dimension `dim` of the whole
    parameter divided by T), laid out for S shards like any leaf; the stored array is (T, the slice's
    padded rows, ...), axis 0 on `tensor` and axis 1 on `fsdp`. Checkpoints turn it into the whole
    parameter like any `TensorLayout` (io/tensor_rows.py)."""

    @property
    def stored_full_shape(self) -> tuple:
        return (self.tensor, self.padded_rows, *self.row_shape)

    def pad_full(self, x, xp=jnp):
        return xp.stack([self.pad(p, xp) for p in xp.split(x, self.tensor, axis=self.dim)])

    def unpad_full(self, x):
        xp = np if isinstance(x, np.ndarray) else jnp
        return xp.concatenate([self.unpad(x[t]) for t in range(self.tensor)], axis=self.dim)

    @property
    def spec(self) -> P:
        """The whole parameter's placement inside the step: `dim` on `tensor`."""
        return P(*[TENSOR_AXIS if i == self.dim else None for i in range(len(self.shape))])

    def assemble(self, x):
        """(T, padded rows, ...) gathered over `fsdp` -> the whole parameter, kept split on `tensor`."""
        x = jnp.moveaxis(jax.vmap(self.unpad)(x), 0, self.dim)
        return lax.with_sharding_constraint(x.reshape(self.full_shape), self.spec)

    def disassemble(self, g):
        """`assemble`'s inverse on a whole gradient: (T, padded rows, ...)."""
        g = lax.with_sharding_constraint(g, self.spec)
        s = self.shape
        g = g.reshape(*s[:self.dim], self.tensor, s[self.dim], *s[self.dim + 1:])
        return jax.vmap(self.pad)(jnp.moveaxis(g, self.dim, 0))

    def unshard(self, x, comm):
        return _gather(x, self, comm)

    def reduce(self, g, comm):
        return _reduce(g, self, comm)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _gather(x, layout: LogicalTensorLayout, comm):
    x = x.astype(comm.param_dtype or x.dtype)
    if layout.shards > 1:
        x = _per_slice(lambda s: lax.all_gather(s, FSDP_AXIS, axis=1, tiled=True), x)
    return layout.assemble(x)


def _per_slice(f, x):
    """`f` on each tensor rank's own slice (axis 0 of x on `tensor`), manual over `tensor` too: XLA's
    partitioner, given a collective over `fsdp` on an array split over `tensor`, gathered it over `tensor`
    first (measured: every FSDP all-gather at its T = 1 size, beside an all-gather over `tensor`)."""
    return jax.shard_map(f, in_specs=P(TENSOR_AXIS), out_specs=P(TENSOR_AXIS), axis_names={TENSOR_AXIS},
                         check_vma=False)(x)


def _reduce(g, layout: LogicalTensorLayout, comm):
    """The whole gradient -> this device's shard: as `fsdp.reduce_gradient`, on the slices' stored form."""
    g = layout.disassemble(g.astype(comm.reduce_dtype or g.dtype))
    if layout.shards > 1:
        g = _per_slice(lambda s: lax.psum_scatter(s, FSDP_AXIS, scatter_dimension=1, tiled=True), g)
    return comm.finish(g, layout.dtype)


def _gather_fwd(x, layout, comm):
    return _gather(x, layout, comm), None


def _gather_bwd(layout, comm, _, g):
    return (_reduce(g, layout, comm),)


_gather.defvjp(_gather_fwd, _gather_bwd)
treat_as_unshard(_gather_bwd)   # checkpoint policies keep or drop it as they do FSDP's gather


def lay_out(params, names: dict, rules, shards: int, tensor: int, mesh):
    """(layouts, in-specs of the step's shard_map, shardings of the stored arrays) of the model's whole
    parameters `params` (shapes), from their logical `names` ({path: names}) under `rules`."""
    seen_names, tp = set(), 0

    def one(path, x):
        nonlocal tp
        key, shape = jax.tree_util.keystr(path), tuple(np.shape(x))
        n = names.get(key)
        if n is not None and len(n) != len(shape):
            raise ConfigError(f"parameter {key} has shape {shape} but {len(n)} logical names {n}")
        seen_names.update(n or ())
        dim = tensor_dim(n, rules)
        if dim is None:
            return Layout(shape, jnp.dtype(x.dtype), shards)
        if shape[dim] % tensor:
            raise ConfigError(f"tensor {tensor} does not divide dimension {dim} ('{n[dim]}', {shape[dim]}) of "
                              f"parameter {key} {shape}: give it another logical name or another size")
        tp += 1
        local = tuple(s // tensor if i == dim else s for i, s in enumerate(shape))
        return LogicalTensorLayout(local, jnp.dtype(x.dtype), shards, tensor=tensor, dim=dim)
    layouts = jax.tree_util.tree_map_with_path(one, params)
    if not tp:
        raise ConfigError(f"logical_rules {[r for r in rules if r[1]]} put no parameter on 'tensor': the model's "
                          f"logical axis names are {sorted(seen_names) or 'none (annotate its kernels with '}"
                          f"{'' if seen_names else 'nn.with_logical_partitioning / nnx.with_partitioning)'}")
    tp_leaf = lambda l: isinstance(l, LogicalTensorLayout)
    in_specs = jax.tree.map(lambda l: P(None, FSDP_AXIS) if tp_leaf(l) else P(FSDP_AXIS), layouts, is_leaf=is_layout)
    shardings = jax.tree.map(lambda l: NamedSharding(mesh, P(TENSOR_AXIS, FSDP_AXIS) if tp_leaf(l) else P(FSDP_AXIS)),
                             layouts, is_leaf=is_layout)
    return layouts, in_specs, shardings


def sequence_split(x, tensor: int, dim: int = 1):
    """Sequence parallelism between units: a float activation (batch, sequence, ...) whose sequence T
    divides is constrained to lie split on `tensor` along it; anything else is left as it is."""
    if (hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating) and np.ndim(x) >= 3
            and np.shape(x)[dim] % tensor == 0):
        return lax.with_sharding_constraint(x, P(*[TENSOR_AXIS if i == dim else None for i in range(np.ndim(x))]))
    return x
