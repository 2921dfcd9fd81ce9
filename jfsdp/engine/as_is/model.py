"""`AsIs`: construction (tracing the model once for its parameters and units), the sharded forward that
hands each unit call to the engine, and the batch contract (the package's docstring, as_is/__init__.py,
says how they fit together)."""
from __future__ import annotations

import contextlib
import functools
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from jfsdp.config.errors import ConfigError
from jfsdp.config.mesh import AXES, mesh_shape
from jfsdp.engine import call_order, column_embed, step_metrics
from jfsdp.engine.fsdp import any_unreduced, is_unreduced, unshard_tree
from jfsdp.engine.flax_models import Found, UnitMatcher, adapt
from jfsdp.engine.float8_any import gathered_compute, mark_units, unit_compute
from jfsdp.engine.as_is import late_root, own_scan
from jfsdp.engine.as_is.own_scan import OwnScan, stacked_units
from jfsdp.engine.as_is.params import ParamTree, abstract, unboxed
from jfsdp.engine.layout import is_layout, paths
from jfsdp.engine.model_tree import path_text, scanned_units, subtree
from jfsdp.engine.parallel.as_is_tensor import TensorAsIs
from jfsdp.engine.parallel.logical import linen_names, nnx_names
from jfsdp.engine.sharded import FSDP
from jfsdp.engine.unit_call import call_unit

RNG_ROWS = "jfsdp_rng"   # the batch key that carries (step, row) to the devices when the model draws random numbers


def _where(error) -> str:
    """' at file:line' of the innermost frame of the failure outside jax, flax and jfsdp (the user's code)."""
    import os
    import traceback
    frames = [f for f in traceback.extract_tb(error.__traceback__)
              if not any(f"{os.sep}{pkg}{os.sep}" in f.filename for pkg in ("jax", "flax", "jfsdp", "jaxlib"))]
    return f" at {frames[-1].filename}:{frames[-1].lineno} ({frames[-1].name})" if frames else ""


class AsIs(ParamTree, TensorAsIs, FSDP):
    """A Flax model as it is, placed on a mesh with a strategy. Build it with `fully_shard(model, mesh,
    example_batch, units=...)`."""
    as_is = True   # the planner sees it as root + stages through jfsdp.planning.as_is.AsIsView

    def __init__(self, model, mesh, example_batch, units, call, strategy, mp_policy, remat, seed=0,
                 rng_streams=("dropout",), init=None, logical_rules=None, prefetch=None):
        self.model, self.mesh = adapt(model, call, rng_streams, init), mesh
        self.shards = mesh_shape(mesh)[1] if strategy.sharded else 1
        self.set_strategy(strategy, mp_policy, remat)
        self.set_tensor(logical_rules, strategy, mp_policy)   # T > 1: parallel/as_is_tensor.py
        self.prefetch, self.moe, self.moe_stages = False, None, ()
        self.seed = seed
        self.example_batch = abstract(example_batch if isinstance(example_batch, Mapping)
                                      else {"inputs": example_batch})
        self.matcher = UnitMatcher(units)
        self.lay_out(self._discover(), strategy.sharded)
        # each leaf's unit (None: the root), and each unit's leaf layouts in the order of its tree
        self.unit_of = {k: self._unit_containing(p) for p, k in self._leaf_paths()}
        self.leaf_layouts = {}
        for (_, k), l in zip(self._leaf_paths(), jax.tree.leaves(self.layouts, is_leaf=is_layout)):
            if self.unit_of[k] is not None:
                self.leaf_layouts.setdefault(self.unit_of[k], []).append(l)
        if self.mp.float8 is not None:   # the selected unit kernels gathered and multiplied in float8
            self.leaf_layouts = mark_units(self)
        self.prefetch_asked = prefetch
        self.prefetch = call_order.resolve(self, prefetch)   # in call order, or its own scan on the pipeline

    @property
    def saves_last_unit(self) -> bool:
        """Prefetch in call order saves the last unit's gathered parameters for its backward
        (call_order.py): under ZeRO-3 it is gathered once a step, not twice (the planner's comm formula)."""
        return bool(self.prefetch) and self.shards > 1 and self.strategy.reshard_after_forward

    # ---- what the model is made of
    def _discover(self, retried=False):
        """Trace the model once (nothing computed): its parameters, its units, and the checks. A method
        under `nn.jit` replays a trace that jax cached before (an earlier fully_shard of the same model):
        the units' calls are then unseen, so the caches are cleared and the model traced once more."""
        found = Found()
        m = self.model
        try:
            if m.kind == "linen":
                variables = jax.eval_shape(lambda k: m.init_variables(k, self._zeros_batch(), self.matcher, found),
                                           jax.random.key(0))
                others = sorted(set(variables) - {"params"})
                if others:
                    raise ConfigError(f"the model has variable collections {', '.join(others)} besides 'params' (e.g. "
                                      "batch statistics it writes during training): not supported, only 'params'")
                params = unboxed(variables.get("params", {}))
                self.names = linen_names(variables.get("params", {}))   # logical axis names, for T > 1
            else:
                params, self.names = abstract(m.params()), nnx_names(m.params_state)
                jax.eval_shape(lambda b: m.trace_units(b, self.matcher, found), self.example_batch)
        except ConfigError:
            raise
        except Exception as e:
            msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
            raise ConfigError(f"call(model, batch) failed on the example batch{_where(e)}: {type(e).__name__}: {msg}") from e
        if not found.unit_calls and not retried:
            jax.clear_caches()
            return self._discover(retried=True)
        if not found.unit_calls:
            classes = sorted(set(found.modules.values()))
            raise ConfigError(f"units= matched no submodule that the model calls; the modules found are: "
                              f"{', '.join(classes) or 'none'} (traced twice, jax's caches cleared in between)")
        self.scanned = scanned_units(params, found)   # units inside the model's own scan: {path: iterations}
        self.nested = [p for p in found.nested if p not in self.scanned]   # in its nn.remat, lax.cond...: no prefetch
        self.stage_sizes = tuple(self.scanned.values())
        twice = sorted({p for p in found.unit_calls if found.unit_calls.count(p) > 1 and p not in self.scanned})
        if twice:
            raise ConfigError(f"unit {path_text(twice[0])} is called {found.unit_calls.count(twice[0])} times in one "
                              "step: a unit shared between calls is gathered once per call here; make it part of the "
                              "root (not a unit) so its weights are gathered once for all uses")
        self.units = tuple(dict.fromkeys(found.unit_calls))
        for path, leaf in paths(params).items():
            if not jnp.issubdtype(leaf.dtype, jnp.floating):
                raise ConfigError(f"parameter {path} has dtype {leaf.dtype}: FSDP shards and reduces float parameters only")
        return params

    def _zeros_batch(self):
        return jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), self.example_batch)

    def _leaf_paths(self):
        flat = jax.tree_util.tree_flatten_with_path(self.layouts, is_leaf=is_layout)[0]
        return [(tuple(getattr(k, "key", getattr(k, "idx", k)) for k in p), jax.tree_util.keystr(p)) for p, _ in flat]

    def _unit_containing(self, path):
        for u in self.units:
            if path[:len(u)] == tuple(u):
                return u
        return None

    # ---- the sharded forward
    def forward(self, params, batch, rows=None):
        """The model's outputs for one device's batch, from shards (inside shard_map)."""
        flat, treedef = jax.tree_util.tree_flatten_with_path(params, is_leaf=is_unreduced)
        lay = jax.tree.leaves(self.layouts, is_leaf=is_layout)
        keys = [self.unit_of[jax.tree_util.keystr(p)] for p, _ in flat]
        leaves = [x for _, x in flat]
        prefetch = self.prefetch and not any_unreduced(params)
        own = None   # the model's own scan on the pipeline (own_scan.py); else its own loop in call order
        late = self._late_root(leaves, lay) if prefetch else None
        if prefetch and self.scanned:
            bind = late and (late[0], lambda xs: late_root.rebind(self.model, tree, late[2], late[1](xs)))
            own = OwnScan(self, stacked_units(self, jax.tree.unflatten(treedef, leaves)), self.prefetch_asked is True,
                          bind)
        order = self._call_order(jax.tree.unflatten(treedef, leaves), late) if prefetch and not own else None
        if order is not None and self.early[0]:   # an untied embedding: the first unit call's lead (call_order.py)
            for i, x in zip(self.early[0], order.lead([leaves[i] for i in self.early[0]])):
                leaves[i] = x
        # the root is gathered once per step (an untied nn.Embed table looked up by columns: column_embed.py);
        # a unit's leaves stay shards until the unit is called
        cols = self.column_tables if prefetch else ()
        tree = jax.tree.unflatten(treedef, [x if u is not None or i in cols else self.gather_root(x, l)
                                            for i, (x, l, u) in enumerate(zip(leaves, lay, keys))])

        def hook(path, shards, fn, inputs):
            if own is not None and own.inside:   # an iteration of the model's scan on the pipeline: gathered
                return gathered_compute(fn, self.mp.float8 is not None)(shards, inputs)
            if order is not None:
                out = order.call(path, fn, inputs)
                if order.late_gathered is not None:   # the last unit's call: the root read after it, bound anew
                    late_root.rebind(self.model, tree, late[2], order.late_gathered)
                    order.late_gathered = None
                return out
            ls = jax.tree.unflatten(jax.tree.structure(shards, is_leaf=is_unreduced), self._unit_layouts(path, shards))
            tied = self.on_cpu or (path is not None and tuple(path) not in self.scanned)   # GPUs: own scan pipelined
            if self.mp.float8 is not None:
                return call_unit(unit_compute(fn, ls, self.comm), shards, inputs, self.policy, tied)
            inputs = self.sequence_split(inputs)   # T > 1: the residual stream split on its sequence
            return self.sequence_split(call_unit(lambda s, i: fn(unshard_tree(s, ls, self.comm), i), shards, inputs,
                                                 self.policy, tied))
        key = self._step_key(rows)
        units = set(self.units)
        with own_scan.running(own) if own is not None else contextlib.nullcontext(), \
                column_embed.scope(self.model.kind, {id(leaves[i]): (lay[i], self.comm) for i in cols}):
            if self.model.kind == "linen":
                rngs = {s: jax.random.fold_in(key, i) for i, s in enumerate(self.model.rng_streams)}
                out = self.model.apply(tree, batch, hook, units, rngs)
            else:
                out = self.model.apply(tree, batch, hook, units, key, self.matcher.classes)
        return self.mp.cast_output(out)

    def _late_root(self, leaves, lay):
        """(shards, gather, key paths) of the root leaves read after the last unit (`late_leaves`), or None:
        gathered during the last unit (call_order.py, own_scan.py) and bound anew when it returns
        (late_root.rebind)."""
        late = self.late_leaves
        if not late:
            return None
        gather = lambda xs: [self.gather_root(x, lay[i]) for x, i in zip(xs, late)]
        return [leaves[i] for i in late], gather, [self._leaf_paths()[i][0] for i in late]

    def _call_order(self, tree, late):
        shards = {u: subtree(tree, u) for u in self.units}
        lays = {u: jax.tree.unflatten(jax.tree.structure(shards[u]), self.leaf_layouts[u]) for u in self.units}
        return call_order.CallOrder(self.units, shards, lays, self.comm, self.policy, self.on_cpu,
                                    self.shards > 1 and not self.strategy.reshard_after_forward,
                                    late[:2] if late else None, self.early[1])

    @functools.cached_property
    def root_uses(self) -> late_root.RootUses:
        """The root leaves read only after the last unit or only by the units' inputs, and the first unit's
        leaves reduced first: late_root.py, from one abstract trace of the model when a step is first traced."""
        return late_root.root_uses(self)

    @property
    def late_leaves(self) -> tuple:
        """The root leaves the model reads only after its last unit (indices into the flat parameters)."""
        return self.root_uses.late

    @property
    def early(self) -> tuple:
        """(the root leaves only the units' inputs read, the first unit's leaves reduced first)."""
        return self.root_uses.early, self.root_uses.ahead

    @property
    def column_tables(self) -> tuple:
        """The untied embedding tables (`early` root leaves an nn.Embed / nnx.Embed looks up) that the prefetch
        paths look up by columns where the tokens allow it (column_embed.py)."""
        lay = jax.tree.leaves(self.layouts, is_leaf=is_layout)
        return tuple(i for i in self.root_uses.tables if i in self.early[0] and column_embed.eligible(lay[i]))

    def column_lookups(self, grad_sync: str = "every") -> list:
        """The planner's: the layouts of `column_tables` where a step looks them up by columns."""
        lay = jax.tree.leaves(self.layouts, is_leaf=is_layout)
        on = self.prefetch and grad_sync != "once"
        return [lay[i] for i in self.column_tables] if on else []

    def _unit_layouts(self, path, shards):
        """The layouts of a unit's leaves; for a unit made inside the model's own NNX scan (path None),
        those of the scanned unit whose per-layer shards have the shapes of `shards` (units alike have
        the same layouts, so any match is right)."""
        if path is not None:
            return self.leaf_layouts[tuple(path)]
        shapes = [np.shape(x.shard if is_unreduced(x) else x) for x in jax.tree.leaves(shards, is_leaf=is_unreduced)]
        for p in self.scanned:
            ls = self.leaf_layouts[p]
            if [l.shard_shape for l in ls] == shapes:
                return ls
        raise ConfigError("a unit called inside an NNX transform matches no unit the model scans")

    def _step_key(self, rows):
        """This device's (micro-)batch key: the seed, then the step and the global index of its first
        row (`step_batch`); without those (evaluation), the seed and the device index."""
        k = jax.random.key(self.seed)
        if rows is None:
            return jax.random.fold_in(k, lax.axis_index(AXES))
        return jax.random.fold_in(jax.random.fold_in(k, rows[0, 0]), rows[0, 1])

    def batch_loss(self, loss_fn, params, batch, metrics=None):
        batch = dict(batch)
        rows = batch.pop(RNG_ROWS, None)
        outputs = self.forward(params, batch, rows)
        loss = self.scalar_loss(loss_fn(outputs, batch)) * self.loss_weight
        return loss if metrics is None else (loss, step_metrics.local(metrics, outputs, batch))

    def step_batch(self, batch, step):
        """The batch with the rows that carry each step's random numbers to the devices (step, row)."""
        b = np.shape(jax.tree.leaves(batch)[0])[0]
        rows = jnp.stack([jnp.broadcast_to(jnp.asarray(step, jnp.uint32), (b,)), jnp.arange(b, dtype=jnp.uint32)], 1)
        return {**batch, RNG_ROWS: rows}

    def check_batch(self, batch, grad_accum: int = 1):
        """A batch is a dict of arrays whose first axis is the batch (rows dividing over all devices and
        into grad_accum micro-batches), with the keys of the example batch."""
        if not isinstance(batch, Mapping):
            raise ConfigError(f"a batch must be a dict like the example batch (keys {sorted(self.example_batch)}), "
                              f"got {type(batch).__name__}")
        missing = set(self.example_batch) - set(batch)
        if missing:
            raise ConfigError(f"the batch lacks {sorted(missing)} (the example batch had {sorted(self.example_batch)})")
        self._check_rows(batch, grad_accum)

    def apply(self, params, batch):
        """Model outputs for a batch split over all devices (call under jit)."""
        batch = batch if isinstance(batch, Mapping) else {"inputs": batch}
        self._check_rows(batch)
        return self.shard_map(lambda p, b: self.forward(p, b), (self.param_specs, P(AXES)), P(AXES))(params, batch)

    def describe(self) -> str:
        return (f"{self.model.kind} model as it is: {len(self.units)} units "
                f"({', '.join(path_text(u) for u in self.units[:3])}{', ...' if len(self.units) > 3 else ''})")
