"""The FSDP step: gather a unit, compute, free it; reduce-scatter its gradient.

Parameters live as shards: every leaf is padded along its first dimension to a multiple of S and
split over the `fsdp` mesh axis (FSDP2's per-parameter Shard(0)). Inside `shard_map`, `unshard`
casts a shard to the compute dtype and all-gathers it; its custom VJP is the gradient path:
reduce-scatter over `fsdp` in the reduce dtype, then a sum over the replica axes. The repeated units
run under `lax.scan` over their stacked shards, each body wrapped in `jax.checkpoint` with a policy
that decides whether the gathered unit is kept for the backward pass (ZeRO-2) or gathered again
(ZeRO-3). A scan, not a Python loop: XLA cannot merge the gathers of different iterations, so only
one unit is ever unsharded, however deep the model. With `prefetch` (remat 'full', resharding
strategies; the default on GPUs) a stage is instead an explicit software pipeline with its own VJP
(`FSDP._pipelined_stage`): the next unit's gather in flight while this unit computes, a unit's
reduce-scatter while the previous unit's backward computes; two gathered units at most.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

from jfsdp.engine import moe as _moe
from jfsdp.config.mesh import AXES, DATA_AXIS, FSDP_AXIS, mesh_shape, platform
from jfsdp.config.errors import ConfigError
from jfsdp.engine.layout import (ROOT, STAGES, UNITS, Layout, Stacked, Stage, Staged, at_row, is_layout, listing,
                                 paths, tree_shapes, stack_units, unstack_units, zeros_like_tree)
from jfsdp.config.policy import REMAT, MixedPrecision, Strategy, resolve_prefetch

@dataclasses.dataclass(frozen=True)
class Comm:
    """How gradients come back: reduce-scatter over `fsdp` when S > 1, then a sum over
    `reduce_axes`, then `scale` (1/N: the loss is the mean over all N devices' batches)."""
    reduce_axes: tuple
    scale: float
    param_dtype: Any
    reduce_dtype: Any


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def unshard(shard, layout: Layout, comm: Comm):
    """Shard (rows/S, ...) in the master dtype -> the whole parameter in param_dtype."""
    x = shard.astype(comm.param_dtype or shard.dtype)
    if layout.shards > 1:
        x = lax.all_gather(x, FSDP_AXIS, axis=0, tiled=True)
    return layout.unpad(x)


def _unshard_fwd(shard, layout, comm):
    return unshard(shard, layout, comm), None


def _unshard_bwd(layout, comm, _, g):
    g = layout.pad(g.astype(comm.reduce_dtype or g.dtype))
    if layout.shards > 1:
        g = lax.psum_scatter(g, FSDP_AXIS, scatter_dimension=0, tiled=True)
    if comm.reduce_axes:
        g = lax.psum(g, comm.reduce_axes)
    return (g.astype(layout.dtype) * comm.scale,)


unshard.defvjp(_unshard_fwd, _unshard_bwd)


def _is_unshard(prim, params) -> bool:
    """Whether a primitive seen by a checkpoint policy is `unshard` (a custom_vjp call whose
    backward is ours)."""
    return prim.name == "custom_vjp_call" and getattr(params.get("bwd"), "f", None) is _unshard_bwd


@functools.cache
def _policy_sees_unshard() -> bool:
    """Self-check, once per process: does a checkpoint policy recognize `unshard` in this jax
    version? `_is_unshard` reads a jax-internal attribute; if that ever changes, ZeRO-2/ZeRO-3
    would silently swap memory behaviour, so fully_shard refuses to run instead."""
    seen = []

    def probe(prim, *_, **params):
        seen.append(_is_unshard(prim, params))
        return False

    layout, comm = Layout((2,), jnp.dtype(jnp.float32), 1), Comm((), 1.0, None, None)
    f = jax.checkpoint(lambda x: jnp.sum(unshard(x, layout, comm) ** 2), policy=probe)
    jax.eval_shape(jax.grad(f), jax.ShapeDtypeStruct((2,), jnp.float32))
    return any(seen)


def checkpoint_policy(remat: str, reshard_after_forward: bool):
    """What the backward pass of a unit may reuse from its forward pass.

    remat: 'none' saves every activation, 'full' saves only the unit's input, 'dots' saves matmul
    outputs and recomputes the elementwise work. On top of that, a gathered parameter (the output of
    `unshard`) is never saved when resharding after forward (ZeRO-3: the backward pass gathers it
    again) and always saved when not (ZeRO-2). The decision is made on `unshard` itself: naming its
    output would not do, because remat then saves the nearest saveable producer, which is the same
    gathered array."""
    if remat not in REMAT:
        raise ConfigError(f"unknown remat '{remat}'; choose from {', '.join(REMAT)}")
    if not _policy_sees_unshard():
        raise RuntimeError(f"jfsdp cannot identify its all-gather inside jax.checkpoint on jax {jax.__version__}; "
                           "reshard_after_forward cannot be honoured (please report this)")
    cp = jax.checkpoint_policies
    base = {"none": cp.everything_saveable, "full": cp.nothing_saveable, "dots": cp.dots_saveable}[remat]
    keep_unsharded = not reshard_after_forward

    def policy(prim, *avals, **params):
        if _is_unshard(prim, params):
            return keep_unsharded
        return base(prim, *avals, **params)
    return policy


def tie(a, b, on_cpu: bool):
    """(a, b) such that nothing computed from the returned `a` starts before every leaf of `b` exists
    (and, on GPUs, the other way round too): an optimization barrier. XLA:CPU removes barriers before
    it schedules, so there `a` gets 0 * (one element of each leaf of b) added: a data dependency no
    scheduler can hoist above `b` (a conditional's branch was turned into a select and its predicate
    folded; measured). Semantics differ only where b holds inf or NaN, when the step's result is
    NaN either way."""
    if not on_cpu:
        return lax.optimization_barrier((a, b))
    # one element of every leaf of b, times 0: XLA does not fold 0 * x for floats (x may be inf or NaN)
    zero = 0 * sum(x.reshape(-1)[0].astype(jnp.float32) for x in jax.tree.leaves(b))
    return jax.tree.map(lambda t: t + zero.astype(t.dtype), a), b


class FSDP:
    """A model placed on a mesh with a strategy. Build it with `fully_shard`.

    Parameter layout (`init`, `shard`, `gather`, `layouts`, `decay_mask`, gradients):
    `Stacked`: {'root': tree, 'units': tree, every leaf stacked on axis 0 (n_units rows)};
    `Staged`: {'root': tree, 'stages': [one such stacked tree per stage]}. `split`/`join` convert
    any tree in this layout to and from (root, [stacked tree per stage])."""

    def __init__(self, model, mesh, example_inputs, strategy, mp_policy, remat, prefetch=None, moe=None):
        self.model, self.mesh, self.strategy, self.mp, self.remat = model, mesh, strategy, mp_policy, remat
        self._one = isinstance(model, Stacked)
        self.stage_sizes = tuple(s.n_units for s in model.stages)
        r, s = mesh_shape(mesh)
        self.replicas, self.shards, self.n_devices = r, (s if strategy.sharded else 1), r * s
        if strategy.sharded:
            reduce_axes = (DATA_AXIS,) if r > 1 else ()
        else:
            reduce_axes = tuple(a for a in AXES if mesh.shape[a] > 1)
        self.comm = Comm(reduce_axes, 1.0 / self.n_devices, mp_policy.param_dtype, mp_policy.reduce_dtype)
        # With one shard (NO_SHARD, or any strategy on an Rx1 mesh) unshard is at most a cast:
        # redoing it in the backward pass is free, while saving it would stack a second copy of
        # every unit's parameters (measured: DDP's peak held the weights twice).
        self.policy = checkpoint_policy(remat, strategy.reshard_after_forward or self.shards == 1)
        self.prefetch = resolve_prefetch(prefetch, strategy, remat, self.shards, on_gpu=platform(mesh) == "gpu")
        self.example_inputs = jax.ShapeDtypeStruct(example_inputs.shape, example_inputs.dtype)
        self.h_shapes = self._trace_shapes()
        full = jax.eval_shape(self._init_full, jax.random.key(0), self.example_inputs)
        root, stages = self.split(full)
        per_unit = lambda t: jax.tree.map(lambda x: Layout(tuple(x.shape[1:]), jnp.dtype(x.dtype), self.shards), t)
        self.layouts = self.join(jax.tree.map(lambda x: Layout(tuple(x.shape), jnp.dtype(x.dtype), self.shards), root),
                                 [per_unit(u) for u in stages])
        row = FSDP_AXIS if strategy.sharded else None
        root_l, stage_l = self.split(self.layouts)
        self.param_specs = self.join(jax.tree.map(lambda _: P(row), root_l, is_leaf=is_layout),
                                     [jax.tree.map(lambda _: P(None, row), l, is_leaf=is_layout) for l in stage_l])
        self.param_shardings = jax.tree.map(lambda p: NamedSharding(mesh, p), self.param_specs)
        self.batch_sharding = NamedSharding(mesh, P(AXES))
        # MoE stages (jfsdp/moe.py): per stage None (dense, or gathered like any unit) or its mode
        self.moe, self.moe_stages = moe, _moe.resolve(self, moe)

    # ---- the layout
    def split(self, tree):
        """A tree in the parameter layout -> (root part, [stacked tree of each stage])."""
        return (tree[ROOT], [tree[UNITS]]) if self._one else (tree[ROOT], list(tree[STAGES]))

    def join(self, root, stages):
        """(root part, [stacked tree of each stage]) -> a tree in the parameter layout."""
        return {ROOT: root, UNITS: stages[0]} if self._one else {ROOT: root, STAGES: list(stages)}

    def _layout_text(self) -> str:
        if self._one:
            return f"{{'root': ..., 'units': <one tree, leaves stacked on axis 0, {self.stage_sizes[0]} rows>}}"
        return ("{'root': ..., 'stages': [" + ", ".join(f"<tree stacked on axis 0, {n} rows>" for n in self.stage_sizes)
                + "]}")

    def _trace_shapes(self):
        """Shapes of h: the embedding's output and each stage's output (traced, nothing computed).
        A stage of several units must keep h's shape (it runs under a scan). h may be a pytree of
        arrays (e.g. hidden states and per-row statistics that a model carries to its head)."""
        m, x = self.model, self.example_inputs
        k = jax.random.key(0)
        emb = jax.eval_shape(lambda k, x: m.root.init(k, x, method=m.embed_method)["params"], k, x)
        h = jax.eval_shape(lambda p, x: m.root.apply({"params": p}, x, method=m.embed_method), emb, x)
        shapes = [h]
        for i, st in enumerate(m.stages):
            p = jax.eval_shape(lambda k: st.unit.init(k, zeros_like_tree(h))["params"], k)
            out = jax.eval_shape(lambda p, h: st.unit.apply({"params": p}, h), p, h)
            if tree_shapes(out) != tree_shapes(h) and st.n_units > 1:
                raise ConfigError(f"stage {i}: its unit maps h of shape {tree_shapes(h)} to {tree_shapes(out)}, but a unit repeated "
                                  f"{st.n_units} times must keep the shape of h; put the change of width in a "
                                  "stage of its own with one unit")
            h = out
            shapes.append(h)
        return shapes

    # ---- parameters: the full layout <-> shards
    def _init_full(self, rng, inputs):
        """Keys: root from split(rng)[0]; with `Stacked`, unit i from split(split(rng)[1], n)[i]; with
        `Staged`, stage j's keys are split(split(split(rng)[1], n_stages)[j], n_j)."""
        m = self.model
        root_key, unit_key = jax.random.split(rng)
        h_last = zeros_like_tree(self.h_shapes[-1])
        both = lambda mod, x, h: (getattr(mod, m.embed_method)(x), getattr(mod, m.head_method)(h))
        root = m.root.init(root_key, inputs, h_last, method=both)["params"]
        stage_keys = [unit_key] if self._one else jax.random.split(unit_key, len(m.stages))
        stages = []
        for st, key, h in zip(m.stages, stage_keys, self.h_shapes):
            h = zeros_like_tree(h)
            stages.append(jax.vmap(lambda k: st.unit.init(k, h)["params"])(jax.random.split(key, st.n_units)))
        return self.join(root, stages)

    def _pad(self, full, xp=jnp):
        root_l, stage_l = self.split(self.layouts)
        root_x, stage_x = self.split(full)
        root = jax.tree.map(lambda l, x: l.pad(x, xp), root_l, root_x, is_leaf=is_layout)
        stages = [jax.tree.map(lambda l, x: xp.stack([l.pad(u, xp) for u in x]) if xp is np else jax.vmap(l.pad)(x),
                               ls, xs, is_leaf=is_layout) for ls, xs in zip(stage_l, stage_x)]
        return self.join(root, stages)

    def init(self, rng):
        """Deferred initialization: one jitted program whose outputs are the shards, computed where
        they live (the random bits are partitionable), so no device ever holds the full model.
        Values equal `init_full(rng)` of the unsharded model."""
        init = jax.jit(lambda k: self._pad(self._init_full(k, self._zeros_inputs())),
                       out_shardings=self.param_shardings)
        return init(rng)

    def _zeros_inputs(self):
        # only the shapes matter to init; a constant inside the traced function costs nothing
        return jnp.zeros(self.example_inputs.shape, self.example_inputs.dtype)

    def abstract_params(self):
        """The shards as ShapeDtypeStructs carrying their shardings: lower and compile without
        allocating anything."""
        shapes = jax.eval_shape(self.init, jax.random.key(0))
        return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), shapes,
                            self.param_shardings)

    def init_full(self, rng):
        """The unsharded initial parameters (one device): the reference for `init`."""
        return jax.jit(lambda k: self._init_full(k, self._zeros_inputs()))(rng)

    def _conform(self, tree, stored: bool, what: str):
        """Check a tree against the layout and rebuild it in the layout's exact structure. `stored`:
        padded, stacked shapes (shards as placed) rather than the unpadded full shapes. Raises a
        ConfigError that names the expected layout and the offending parameters."""
        want_keys = set(self.layouts)
        if not isinstance(tree, Mapping) or set(tree) != want_keys:
            got = sorted(map(str, tree)) if isinstance(tree, Mapping) else type(tree).__name__
            hint = ""
            if isinstance(tree, Mapping) and STAGES in tree and self._one:
                hint = "; this model is a jfsdp.Stacked (one stage): its units go under 'units'"
            elif isinstance(tree, Mapping) and UNITS in tree and not self._one:
                hint = "; this model is a jfsdp.Staged: its units go under 'stages', one stacked tree per stage"
            raise ConfigError(f"{what} must be a dict {self._layout_text()}, got {got}{hint} "
                              "(plan.from_layers(root, layers) builds it from per-layer trees)")
        root_l, stage_l = self.split(self.layouts)
        root_x = tree[ROOT]
        if self._one:
            stage_x = [tree[UNITS]]
        else:
            stage_x = tree[STAGES]
            if not isinstance(stage_x, (list, tuple)) or len(stage_x) != len(stage_l):
                raise ConfigError(f"{what}['stages'] must be a list of {len(stage_l)} trees, one per stage, each stacked "
                                  f"on axis 0, got {type(stage_x).__name__}"
                                  + (f" of {len(stage_x)}" if isinstance(stage_x, (list, tuple)) else ""))
        names = [f"{what}['{UNITS}']"] if self._one else [f"{what}['{STAGES}'][{j}]" for j in range(len(stage_l))]
        out_root = self._conform_part(root_x, root_l, f"{what}['{ROOT}']", stored, None)
        out_stages = []
        for j, (x, l, name, n) in enumerate(zip(stage_x, stage_l, names, self.stage_sizes)):
            if isinstance(x, (list, tuple)):
                raise ConfigError(f"{name} must be one tree with every leaf stacked on axis 0 ({n} rows), got a "
                                  f"{type(x).__name__} of {len(x)} per-unit trees: stack them with "
                                  "jfsdp.stack_units(...) or build the whole layout with plan.from_layers(root, layers)")
            out_stages.append(self._conform_part(x, l, name, stored, n))
        return self.join(out_root, out_stages)

    def _conform_part(self, tree, layouts, name, stored, n):
        want, got = paths(layouts, is_layout), paths(tree)
        if set(want) != set(got):
            raise ConfigError(f"{name} does not match the model's parameters: missing {listing(set(want) - set(got)) or 'none'}; "
                              f"unexpected {listing(set(got) - set(want)) or 'none'}")
        for k, l in want.items():
            shape = l.stored_shape if stored else l.shape
            shape = shape if n is None else (n, *shape)
            if np.shape(got[k]) != shape:
                why = (f"; stack the {n} units on axis 0 (jfsdp.stack_units)" if n is not None
                       and np.shape(got[k]) == (l.stored_shape if stored else l.shape) else "")
                raise ConfigError(f"{name}{k} has shape {np.shape(got[k])}, expected {shape}{why}")
        leaves = [got[k] for k in want]
        return jax.tree.unflatten(jax.tree.structure(layouts, is_leaf=is_layout), leaves)

    def shard(self, full):
        """Place full parameters (host or device arrays, unpadded, in the layout of `layouts`) as
        shards; each device receives its slice. Leaves are cast to the master dtype."""
        full = self._conform(full, stored=False, what="parameters")
        host = jax.tree.map(lambda l, x: np.asarray(x, l.dtype), self.layouts, full, is_leaf=is_layout)
        return jax.device_put(self._pad(host, np), self.param_shardings)

    def is_placed(self, params) -> bool:
        """Whether `params` are already this plan's shards (jax arrays, padded shapes, its shardings)."""
        try:
            params = self._conform(params, stored=True, what="parameters")
        except ConfigError:
            return False
        return all(isinstance(x, jax.Array) and x.sharding.is_equivalent_to(s, x.ndim)
                   for x, s in zip(jax.tree.leaves(params), jax.tree.leaves(self.param_shardings)))

    def place(self, params):
        """Parameters for a new train state, never aliasing the caller's arrays (the train step
        donates its state): this plan's shards are copied, full parameters are sharded."""
        if self.is_placed(params):
            params = self._conform(params, stored=True, what="parameters")
            return jax.jit(lambda t: jax.tree.map(jnp.copy, t), out_shardings=self.param_shardings)(params)
        return self.shard(params)

    def gather(self, params):
        """Shards -> full parameters as host numpy arrays (for export and comparison)."""
        host = jax.device_get(params)
        root_l, stage_l = self.split(self.layouts)
        root_x, stage_x = self.split(host)
        root = jax.tree.map(lambda l, x: l.unpad(x), root_l, root_x, is_leaf=is_layout)
        stages = [jax.tree.map(lambda l, x: np.stack([l.unpad(u) for u in x]), ls, xs, is_leaf=is_layout)
                  for ls, xs in zip(stage_l, stage_x)]
        return self.join(root, stages)

    def from_layers(self, root, layers):
        """Per-layer parameter trees -> the full layout (for `shard`/`init_state(params=...)`).
        `Stacked`: `layers` is the list of the n_units unit trees; `Staged`: a list, per stage, of
        the lists of its unit trees."""
        groups = [layers] if self._one else layers
        if not isinstance(groups, (list, tuple)) or len(groups) != len(self.stage_sizes):
            raise ConfigError(f"layers must be {'a list of unit trees' if self._one else f'a list of {len(self.stage_sizes)} lists (one per stage) of unit trees'}")
        for j, (g, n) in enumerate(zip(groups, self.stage_sizes)):
            if not isinstance(g, (list, tuple)) or len(g) != n:
                where = "" if self._one else f"stage {j}: "
                raise ConfigError(f"{where}expected a list of {n} per-unit parameter trees, got "
                                  + (f"{len(g)}" if isinstance(g, (list, tuple)) else type(g).__name__))
        return self.join(root, [stack_units(list(g)) for g in groups])

    def to_layers(self, full):
        """The inverse of `from_layers`: full parameters (e.g. `gather`'s) -> (root, layers)."""
        root, stages = self.split(full)
        layers = [unstack_units(s) for s in stages]
        return root, (layers[0] if self._one else layers)

    def decay_mask(self):
        """Weight decay on matrices, not on norms, biases or scalars (by unsharded per-unit shape)."""
        return jax.tree.map(lambda l: len(l.shape) >= 2, self.layouts, is_leaf=is_layout)

    # ---- the sharded forward: runs inside shard_map on local shards
    def _unshard(self, shards, layouts):
        return jax.tree.map(lambda l, x: unshard(x, l, self.comm), layouts, shards, is_leaf=is_layout)

    def _stage(self, j, h, shards, layouts):
        """Stage j: its units under a scan, each gathered, computed, freed (or kept: policy)."""
        unit, moe = self.model.stages[j].unit, self.moe_stages[j]
        if self.prefetch and self.stage_sizes[j] > 1 and (moe is None or moe.mode != "ep"):
            # (an expert-parallel stage keeps the plain scan: its experts are not gathered)
            return self._pipelined_stage(j, layouts)(h, shards)

        def body(h, shards):
            if moe is not None and moe.mode == "ep":   # experts stay local; tokens go to them
                unshard_one = lambda x, l: unshard(x, l, self.comm)
                params = _moe.place_params(unshard_one, shards, layouts, moe.site, self.comm)
                with nn.intercept_methods(_moe.interceptor(moe, self.moe, self.shards)):
                    return unit.apply({"params": params}, h)
            return unit.apply({"params": self._unshard(shards, layouts)}, h)
        body = jax.checkpoint(body, policy=self.policy, prevent_cse=False)
        if tree_shapes(self.h_shapes[j]) == tree_shapes(self.h_shapes[j + 1]):
            return lax.scan(lambda c, p: (body(c, p), None), h, shards)[0]
        # one unit that changes the width: still a scan (of one), so that its gathered parameters
        # live in the loop's own scope like every other unit's
        return lax.scan(lambda c, p: (c, body(h, p)), None, shards)[1][0]

    def _pipelined_stage(self, j, layouts):
        """Stage j as an explicit software pipeline (prefetch; remat 'full', resharding strategies):
        (h, stacked shards) -> h, with its own VJP (`_stage_passes`)."""
        forward, backward = self._stage_passes(j, layouts)

        def read(acc, i):
            return at_row(acc[0], i)

        def put(acc, i, shard):
            shards, grads = acc
            return shards, jax.tree.map(lambda a, x: lax.dynamic_update_index_in_dim(a, x, i, 0), grads, shard)

        @jax.custom_vjp
        def stage(h, shards):
            return forward(h, shards, False)[0]

        def stage_fwd(h, shards):
            out, hs = forward(h, shards, True)
            return out, (hs, shards)

        def stage_bwd(res, dh):
            hs, shards = res
            dh, (_, grads) = backward(hs, dh, (shards, jax.tree.map(jnp.zeros_like, shards)), read, put)
            return dh, grads
        stage.defvjp(stage_fwd, stage_bwd)
        return stage

    def _stage_passes(self, j, layouts):
        """Stage j's forward and backward passes as an explicit software pipeline (remat 'full'):
        `forward(h, shards, keep) -> (h, saved inputs or None)` and
        `backward(saved, dh, acc, read, consume) -> (dh into the stage, acc)`.

        Forward: unit i+1's all-gather is issued before unit i computes and carried into the next
        iteration, so it is in flight during unit i's compute; only unit 0's gather waits. At most two
        gathered units live (this one and the prefetched one). Saved for backward: the units' inputs.
        Backward, in reverse: unit i-1's gather is issued before unit i is recomputed and
        differentiated (`jax.vjp` of the unit); unit i's gradient is carried (unreduced, param_dtype)
        and reduce-scattered in the next iteration, while unit i-1's backward computes. Only unit
        n-1's gather and unit 0's reduce-scatter have nothing to hide behind. The first and last
        units run outside the loop (peeled) so that nothing is gathered or reduced twice.

        What happens to each reduced gradient shard is the caller's: the backward loop carries `acc`,
        reads unit i's shards with `read(acc, i)` (so that a caller may carry the parameters and
        update them in place) and hands unit i's gradient shard to `consume(acc, i, shard) -> acc`
        (stack it as the gradient; or apply the optimizer to unit i then and there; or add up its
        squared norm), in the order n-1, ..., 0."""
        unit, n = self.model.stages[j].unit, self.stage_sizes[j]
        on_cpu = self.mesh.devices.flat[0].platform == "cpu"

        def apply(params, h):
            return unit.apply({"params": params}, h)

        def gather(shards, i):
            return self._unshard(at_row(shards, i), layouts)

        def reduce(dg):
            # unshard's backward: reduce dtype, reduce-scatter over fsdp, sum over replicas, scale
            return jax.tree.map(lambda l, g: _unshard_bwd(l, self.comm, None, g)[0], layouts, dg, is_leaf=is_layout)

        def save(hs, h, i):
            return jax.tree.map(lambda a, x: lax.dynamic_update_index_in_dim(a, x, i, 0), hs, h)

        def forward(h, shards, keep):
            hs = jax.tree.map(lambda a: jnp.zeros((n, *a.shape), a.dtype), h) if keep else None
            first = at_row(shards, 0)
            if j > 0:
                # a later stage's unit 0 is gathered when its input is ready, not hoisted to the top
                # of the step (where XLA would combine it with the root's and keep it through the
                # earlier stages). The first stage's goes with the root's: nothing runs before them,
                # and tied to h it was combined with the head's gather instead, exposing that
                # (measured on the 8B: 0.86 GiB more exposed per step).
                first, h = tie(first, h, on_cpu)
            if n == 1:
                return apply(self._unshard(first, layouts), h), (save(hs, h, 0) if keep else None)

            def body(carry, i):
                h, g, hs = carry
                nxt = gather(shards, i + 1)  # prefetch: in flight while unit i computes
                if keep:
                    hs = save(hs, h, i)
                return (apply(g, h), nxt, hs), None
            (h, g, hs), _ = lax.scan(body, (h, self._unshard(first, layouts), hs), jnp.arange(n - 1))
            if keep:
                hs = save(hs, h, n - 1)
            return apply(g, h), hs

        def unit_vjp(g, h, dh):
            return jax.vjp(apply, g, h)[1](dh)  # recompute the unit, then differentiate it

        def backward(hs, dh, acc, read, consume):
            # The barriers order what XLA would otherwise combine into one collective at the top of
            # the step: unit n-1's gather waits for dh (not hoisted into the forward pass), unit
            # n-2's for unit n-1's (so it is in flight during unit n-1's backward, not before it).
            last, dh = tie(read(acc, n - 1), dh, on_cpu)
            g = self._unshard(last, layouts)
            if n == 1:
                dg, dh = unit_vjp(g, at_row(hs, 0), dh)
                return dh, consume(acc, 0, reduce(dg))
            prev, g = tie(read(acc, n - 2), g, on_cpu)
            nxt = self._unshard(prev, layouts)
            pend, dh = unit_vjp(g, at_row(hs, n - 1), dh)

            def body(carry, i):  # units n-2 .. 1
                dh, g, pend, acc = carry
                acc = consume(acc, i + 1, reduce(pend))  # unit i+1's reduce-scatter, during unit i's backward
                nxt = self._unshard(read(acc, i - 1), layouts)  # prefetch, during unit i's backward
                dg, dh = unit_vjp(g, at_row(hs, i), dh)
                return (dh, nxt, dg, acc), None
            (dh, g, pend, acc), _ = lax.scan(body, (dh, nxt, pend, acc), jnp.arange(n - 2, 0, -1))
            one = reduce(pend)  # unit 1's reduce-scatter, during unit 0's backward ...
            dg, dh = unit_vjp(g, at_row(hs, 0), dh)
            dg, one = lax.optimization_barrier((dg, one))  # ... finished before unit 0's, not combined with it
            return dh, consume(consume(acc, 1, one), 0, reduce(dg))
        return forward, backward

    @functools.cached_property
    def root_use(self) -> tuple:
        """(indices of the root's leaves that `embed` reads, those that `head` reads), in the order
        of jax.tree.leaves(root layouts); read from the traced methods."""
        m = self.model
        layouts, treedef = jax.tree.flatten(self.split(self.layouts)[0], is_leaf=is_layout)
        abstract = [jax.ShapeDtypeStruct(l.shape, l.dtype) for l in layouts]

        def reads(method, arg):
            f = lambda leaves, a: m.root.apply({"params": jax.tree.unflatten(treedef, leaves)}, a, method=method)
            jaxpr = jax.make_jaxpr(f)(abstract, arg).jaxpr
            refs = {id(v) for e in jaxpr.eqns for v in e.invars} | {id(v) for v in jaxpr.outvars}
            return frozenset(i for i, v in enumerate(jaxpr.invars[:len(layouts)]) if id(v) in refs)
        return reads(m.embed_method, self.example_inputs), reads(m.head_method, self.h_shapes[-1])

    def _forward(self, params, inputs):
        m = self.model
        # The root is gathered where it is used: a leaf that only the embedding reads (an untied
        # embedding table) when the step starts, for the lookup alone (its backward pass needs no
        # weights); a leaf that only the head reads after the last unit, kept for the head's
        # backward. A leaf both read (a tied embedding) is, as FSDP does with a shared parameter,
        # gathered once for both uses and kept from the embedding to the head's backward, with one
        # gradient reduced for it.
        root_l, stage_l = self.split(self.layouts)
        root_p, stage_p = self.split(params)
        layouts, treedef = jax.tree.flatten(root_l, is_leaf=is_layout)
        shards = treedef.flatten_up_to(root_p)
        embed_reads, head_reads = self.root_use
        gathered = {}

        def root(reads):   # leaves this method does not read are placeholders that XLA drops
            for i in sorted(reads - set(gathered)):
                gathered[i] = unshard(shards[i], layouts[i], self.comm)
            return jax.tree.unflatten(treedef, [gathered[i] if i in reads else
                                                jnp.zeros(l.shape, self.comm.param_dtype or l.dtype)
                                                for i, l in enumerate(layouts)])
        h = m.root.apply({"params": root(embed_reads)}, inputs, method=m.embed_method)
        for j, (shards_j, layouts_j) in enumerate(zip(stage_p, stage_l)):
            h = self._stage(j, h, shards_j, layouts_j)
        late = sorted(head_reads - set(gathered))
        if late:   # gathered once h exists, not hoisted to the start of the step by XLA's scheduler
            h, held = lax.optimization_barrier((h, [shards[i] for i in late]))
            shards = list(shards)
            for i, x in zip(late, held):
                shards[i] = x
        return self._head(root(head_reads), h)

    def _head(self, root, h):
        out = self.model.root.apply({"params": root}, h, method=self.model.head_method)
        # output_dtype applies to a head that returns an array (logits); a head that returns a
        # pytree (e.g. hidden states and a weight for a fused loss) hands its precision to the loss
        if self.mp.output_dtype and isinstance(out, jax.Array):
            return out.astype(self.mp.output_dtype)
        return out

    def _check_rows(self, tree, grad_accum=1):
        for x in jax.tree.leaves(tree):
            if not np.ndim(x):
                raise ConfigError(f"every batch leaf needs a leading batch axis, got a scalar ({x!r})")
            b = np.shape(x)[0]
            if b % self.n_devices:
                raise ConfigError(f"batch size {b} does not divide over the {self.n_devices} devices of the mesh")
            if (b // self.n_devices) % grad_accum:
                raise ConfigError(f"per-device batch {b // self.n_devices} does not divide into "
                                  f"{grad_accum} gradient-accumulation micro-batches")

    def check_batch(self, batch, grad_accum: int = 1):
        """The batch contract: a dict whose 'inputs' is fed to the root's embed method (all of it is
        passed to the loss); every leaf's first axis is the batch and divides over all devices (and
        then into grad_accum micro-batches). ConfigError otherwise."""
        if not isinstance(batch, Mapping) or "inputs" not in batch:
            got = f"keys {sorted(map(str, batch))}" if isinstance(batch, Mapping) else type(batch).__name__
            raise ConfigError(f"a batch must be a dict with key 'inputs' (fed to root.{self.model.embed_method}; the "
                              f"whole dict, e.g. with 'targets', goes to loss_fn(outputs, batch)), got {got}")
        self._check_rows(batch, grad_accum)

    def put_batch(self, batch, grad_accum: int = 1):
        """Check a (global, host) batch with `check_batch` and split it over all devices. One process;
        with several, build the global array from each process's rows (jfsdp.io.data.process_rows)."""
        self.check_batch(batch, grad_accum)
        return jax.device_put(batch, self.batch_sharding)

    def _shard_map(self, f, in_specs, out_specs):
        return jax.shard_map(f, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)

    def _loss(self, loss_fn, params, batch):
        return self._scalar_loss(loss_fn(self._forward(params, batch["inputs"]), batch))

    @staticmethod
    def _scalar_loss(loss):
        if jnp.shape(loss) != ():
            raise ConfigError(f"loss_fn must return a scalar (the mean loss over its batch), got shape {jnp.shape(loss)}")
        return loss.astype(jnp.float32)

    def loss_and_grad(self, loss_fn: Callable, grad_accum: int = 1):
        """(params, batch) -> (mean loss, gradients as shards).

        The loss contract: `loss_fn(outputs, batch)` gets the head's outputs for the batch rows on
        one device (one micro-batch with grad_accum) and that same slice of the batch dict, and returns
        the mean loss over those rows, a scalar. jfsdp averages it over devices and micro-batches, which
        is the global mean because every device holds as many rows (a loss that averages over a
        varying count, such as unmasked tokens, becomes a mean of means). `batch['inputs']` feeds
        `embed`. With grad_accum = k, every device runs k micro-batches, each with its own gathers
        and reduce-scatters."""
        if not isinstance(grad_accum, int) or grad_accum < 1:
            raise ConfigError(f"grad_accum must be an integer of at least 1, got {grad_accum}")

        def local(params, batch):
            vg = jax.value_and_grad(functools.partial(self._loss, loss_fn))
            if grad_accum == 1:
                loss, grads = vg(params, batch)
            else:
                mbs = jax.tree.map(lambda x: x.reshape(grad_accum, -1, *x.shape[1:]), batch)

                def acc(carry, mb):
                    return jax.tree.map(jnp.add, carry, vg(params, mb)), None

                zero = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, params))
                (loss, grads), _ = lax.scan(acc, zero, mbs)
                loss, grads = loss / grad_accum, jax.tree.map(lambda g: g / grad_accum, grads)
            return lax.psum(loss, AXES) / self.n_devices, grads

        sharded = self._shard_map(local, (self.param_specs, P(AXES)), (P(), self.param_specs))

        def fn(params, batch):
            self.check_batch(batch, grad_accum)
            return sharded(params, batch)
        return fn

    def loss(self, loss_fn: Callable):
        """(params, batch) -> mean loss, forward only (evaluation). Same contract as `loss_and_grad`."""
        def local(params, batch):
            return lax.psum(self._loss(loss_fn, params, batch), AXES) / self.n_devices
        sharded = self._shard_map(local, (self.param_specs, P(AXES)), P())

        def fn(params, batch):
            self.check_batch(batch)
            return sharded(params, batch)
        return fn

    def apply(self, params, inputs):
        """Model outputs for a batch of inputs split over all devices (call under jit)."""
        self._check_rows(inputs)
        return self._shard_map(self._forward, (self.param_specs, P(AXES)), P(AXES))(params, inputs)


def _check_model(model):
    if not isinstance(model, (Stacked, Staged)):
        raise ConfigError("fully_shard expects jfsdp.Stacked(root, unit, n_units) or, for units that are not all "
                          f"alike, jfsdp.Staged(root, [(unit_a, n_a), (unit_b, n_b), ...]); got {type(model).__name__}")
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


def fully_shard(model, mesh, example_inputs, *, strategy="full_shard", mp_policy=None,
                remat="none", reshard_after_forward=None, prefetch=None, moe=None) -> FSDP:
    """Apply FSDP to a model (`Stacked` or `Staged`) from outside. `example_inputs` (an array or
    ShapeDtypeStruct of the inputs' shape) fixes the parameter shapes. `reshard_after_forward=False`
    turns FULL_SHARD into SHARD_GRAD_OP, as in FSDP2; a value that contradicts `strategy` is an error.

    `prefetch`: run each stage as an explicit software pipeline (`FSDP._pipelined_stage`): unit i+1's
    all-gather in flight while unit i computes, unit i's reduce-scatter while unit i-1's backward
    computes, at the cost of one more gathered unit. Supported with FULL_SHARD / HYBRID_SHARD and
    remat 'full' (True elsewhere is a ConfigError); None (default) turns it on there when the mesh is
    made of GPUs (or JFSDP_PREFETCH=1); other combinations use the plain scan (with XLA's own
    pipelining flags on GPU, `jfsdp.config.xla_flags.GPU_FLAGS`). An expert-parallel MoE stage always uses
    the plain scan.

    `moe=jfsdp.MoE(mode, chunks)`: how units that call an experts module run (jfsdp/moe.py: gather
    the experts' weights, or send the tokens to them, per stage by a cost model or as set)."""
    strategy = Strategy.parse(strategy)
    if reshard_after_forward is not None:
        if not strategy.sharded:
            raise ConfigError("reshard_after_forward applies to sharded strategies, not no_shard")
        if strategy is Strategy.FULL_SHARD and not reshard_after_forward:
            strategy = Strategy.SHARD_GRAD_OP
        elif strategy is Strategy.HYBRID_SHARD and not reshard_after_forward:
            strategy = Strategy.HYBRID_SHARD_ZERO2
        elif strategy.reshard_after_forward != reshard_after_forward:
            raise ConfigError(f"strategy {strategy.value} contradicts reshard_after_forward={reshard_after_forward}")
    _check_model(model)
    if not hasattr(example_inputs, "shape") or not hasattr(example_inputs, "dtype"):
        raise ConfigError("example_inputs must be an array or jax.ShapeDtypeStruct of the inputs (batch['inputs']), "
                          f"got {type(example_inputs).__name__}")
    return FSDP(model, mesh, example_inputs, strategy, mp_policy or MixedPrecision(), remat, prefetch, moe)
