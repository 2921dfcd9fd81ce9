"""The parameters of a model given as it is: its own tree, every leaf its own row-sharded `Layout`; the
leaves of the units inside the model's own scan stacked (`split`/`join` give the `Stacked` form that the
parameter code, checkpoints and the planner share), initialization from the model's own initializers."""
from __future__ import annotations

import jax
import numpy as np

from jfsdp.config.errors import ConfigError
from jfsdp.engine.layout import is_layout, listing, paths
from jfsdp.engine.model_tree import subtree, with_subtree, without


def abstract(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), tree)


def unboxed(tree):
    import flax.linen as nn
    return nn.meta.unbox(tree)


class ParamTree:
    """`AsIs`'s parameter methods (a mixin: the model, its layouts, its scanned units are `AsIs`'s)."""

    # ---- the parameter layout: the model's own tree, every leaf its own row-sharded Layout
    def split(self, tree):
        """A tree in the model's layout -> (everything but the scanned units, [each scanned unit's stacked
        subtree]): the `Stacked` form that the parameter code, checkpoints and the planner share."""
        paths_ = list(self.scanned)
        return without(tree, paths_), [subtree(tree, p) for p in paths_]

    def join(self, root, stages):
        for p, sub in zip(self.scanned, stages):
            root = with_subtree(root, p, sub)
        return root

    def _conform(self, tree, stored: bool, what: str):
        tree = unboxed(tree)
        if self.model.kind == "nnx" and hasattr(tree, "to_pure_dict"):
            tree = tree.to_pure_dict()
        want, got = paths(self.layouts, is_layout), paths(tree)
        if set(want) != set(got):
            raise ConfigError(f"{what} do not match the model's parameters: missing {listing(set(want) - set(got)) or 'none'}; "
                              f"unexpected {listing(set(got) - set(want)) or 'none'}")
        root_l, stage_l = self.split(self.layouts)
        lead = self.join(jax.tree.map(lambda _: (), root_l, is_leaf=is_layout),
                         [jax.tree.map(lambda _: (n,), l, is_leaf=is_layout) for l, n in zip(stage_l, self.stage_sizes)])
        leads = jax.tree.leaves(lead, is_leaf=lambda x: isinstance(x, tuple))
        for (k, l), n in zip(want.items(), leads):
            shape = (*n, *(l.stored_full_shape if stored else l.full_shape))
            if np.shape(got[k]) != shape:
                raise ConfigError(f"{what}{k} has shape {np.shape(got[k])}, expected {shape}")
        return jax.tree.unflatten(jax.tree.structure(self.layouts, is_leaf=is_layout), [got[k] for k in want])

    def _init_full(self, rng, _inputs=None):
        m = self.model
        if m.kind == "linen":
            return unboxed(m.init_variables(rng, self._zeros_batch())["params"])
        if m.init_fn is None:
            raise ConfigError("an NNX model is initialized from its constructor: pass fully_shard(..., init=make) where "
                              "make(rngs) builds the model, or give init_state the weights (params=, or a concrete model)")
        from flax import nnx
        return nnx.state(m.init_fn(nnx.Rngs(rng)), nnx.Param).to_pure_dict()

    def _zeros_inputs(self):
        return None

    def init_full(self, rng):
        return jax.jit(self._init_full)(rng)

    def own_params(self):
        """An NNX model's own weights (a concrete module), for `init_state(sharded, opt)` without rng."""
        if self.model.kind != "nnx" or any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(self.model.params())):
            return None
        return self.model.params()

    def from_layers(self, root, layers):
        raise ConfigError("a model given as it is keeps its own parameter tree: pass it whole (init_state(params=...))")

    to_layers = from_layers
