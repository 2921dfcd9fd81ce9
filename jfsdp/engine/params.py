"""The parameter layout of a model given as units, apart from the engine that computes with it.

Every leaf is split over the `fsdp` axis along its first dimension when S divides it, else flattened
and padded by fewer than S elements (`jfsdp.engine.layout.Layout`); the units of a stage are stacked on a new axis 0. The tree:
`Stacked`: {'root': tree, 'units': tree, every leaf stacked on axis 0 (n_units rows)};
`Staged`: {'root': tree, 'stages': [one such stacked tree per stage]}. `split`/`join` convert any tree
in this layout to and from (root, [stacked tree per stage]). This class initializes parameters where they
live, places full parameters as shards, gathers shards back, and converts to and from per-layer trees."""
from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from jfsdp.config.errors import ConfigError
from jfsdp.config.mesh import CONTEXT_AXIS, FSDP_AXIS, context_size, tensor_size
from jfsdp.engine.layout import (ROOT, STAGES, UNITS, Layout, Stacked, is_layout, listing, paths, stack_units,
                                 tree_shapes, unstack_units, zeros_like_tree)
from jfsdp.engine.parallel import layout as tp_layout


class ParamLayout:
    """The parameters of `model` (Stacked or Staged) as shards over `shards` row-shards of `mesh`
    (`sharded`: split over the `fsdp` axis; else replicated). `example_inputs` fixes the shapes."""

    def __init__(self, model, mesh, example_inputs, shards: int, sharded: bool, tensor_plan=None):
        self.model, self.mesh, self.shards, self.tensor_plan = model, mesh, shards, tensor_plan
        self._one = isinstance(model, Stacked)
        self.stage_sizes = tuple(s.n_units for s in model.stages)
        self.example_inputs = jax.ShapeDtypeStruct(example_inputs.shape, example_inputs.dtype)
        self.h_shapes = self._trace_shapes()
        self.lay_out(jax.eval_shape(self._init_full, jax.random.key(0), self.example_inputs), sharded)

    def lay_out(self, full, sharded: bool):
        """`layouts`, `param_specs` and `param_shardings` from the full parameters' shapes (`split` into the
        root and the stages, whose leaves are stacked on axis 0): every leaf laid out for `self.shards`
        shards (`Layout`: rows, or flat), split over the `fsdp` axis when `sharded` (a stage's leaves within each unit), else replicated."""
        root, stages = self.split(full)
        if tensor_size(self.mesh) > 1:   # tensor parallelism: the placement rule of parallel/layout.py
            names = [UNITS] if self._one else [f"{STAGES}/{j}" for j in range(len(stages))]
            root_l, stage_l = tp_layout.lay_out(self.tensor_plan, root, stages, names, self.shards,
                                                tensor_size(self.mesh), context_size(self.mesh))
            self.layouts = self.join(root_l, stage_l)
            self.param_specs = self.join(*tp_layout.specs(root_l, stage_l))
            self.param_shardings = jax.tree.map(lambda p: NamedSharding(self.mesh, p), self.param_specs)
            return
        # with context parallelism every leaf lies on (`fsdp`, `context`) together (S*C shards, self.shards)
        axes = (FSDP_AXIS, CONTEXT_AXIS) if context_size(self.mesh) > 1 else None
        layout = lambda shape, x: Layout(tuple(shape), jnp.dtype(x.dtype), self.shards, axes=axes)
        per_unit = lambda t: jax.tree.map(lambda x: layout(x.shape[1:], x), t)
        self.layouts = self.join(jax.tree.map(lambda x: layout(x.shape, x), root), [per_unit(u) for u in stages])
        row = (axes or FSDP_AXIS) if sharded else None
        root_l, stage_l = self.split(self.layouts)
        self.param_specs = self.join(jax.tree.map(lambda _: P(row), root_l, is_leaf=is_layout),
                                     [jax.tree.map(lambda _: P(None, row), l, is_leaf=is_layout) for l in stage_l])
        self.param_shardings = jax.tree.map(lambda p: NamedSharding(self.mesh, p), self.param_specs)

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
        # init_with_output: the output's shapes from the initializing pass itself (one trace, not init and apply)
        h = jax.eval_shape(lambda k, x: m.root.init_with_output(k, x, method=m.embed_method)[0], k, x)
        shapes = [h]
        for i, st in enumerate(m.stages):
            out = jax.eval_shape(lambda k: st.unit.init_with_output(k, zeros_like_tree(h))[0], k)
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
        root = jax.tree.map(lambda l, x: l.pad_full(x, xp), root_l, root_x, is_leaf=is_layout)
        stages = [jax.tree.map(lambda l, x: xp.stack([l.pad_full(u, xp) for u in x]) if xp is np else jax.vmap(l.pad_full)(x),
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
        """The shards as ShapeDtypeStructs carrying their shardings, read from the layouts (each leaf's
        stored shape, a stage's leaves stacked on axis 0: what `init` returns, with nothing traced): lower
        and compile without allocating anything."""
        root_l, stage_l = self.split(self.layouts)
        root_s, stage_s = self.split(self.param_shardings)
        sds = lambda lead: lambda l, s: jax.ShapeDtypeStruct((*lead, *l.stored_full_shape), l.dtype, sharding=s)
        return self.join(jax.tree.map(sds(()), root_l, root_s, is_leaf=is_layout),
                         [jax.tree.map(sds((n,)), l, s, is_leaf=is_layout)
                          for l, s, n in zip(stage_l, stage_s, self.stage_sizes)])

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
            shape = l.stored_full_shape if stored else l.full_shape
            shape = shape if n is None else (n, *shape)
            if np.shape(got[k]) != shape:
                why = (f"; stack the {n} units on axis 0 (jfsdp.stack_units)" if n is not None
                       and np.shape(got[k]) == (l.stored_full_shape if stored else l.full_shape) else "")
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
        root = jax.tree.map(lambda l, x: l.unpad_full(x), root_l, root_x, is_leaf=is_layout)
        stages = [jax.tree.map(lambda l, x: np.stack([l.unpad_full(u) for u in x]), ls, xs, is_leaf=is_layout)
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
