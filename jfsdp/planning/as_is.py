"""The planner's view of a model given as it is (`jfsdp.engine.as_is.AsIs`): the same root + stages that
the analytic estimate and the communication formula read from a `Stacked` / `Staged` plan.

- The stages: every unit the model calls, in call order, one stage each; a unit that runs inside the
  model's own scan (`nn.scan`, `nnx.scan`) is one stage of as many units as its iterations. The root is
  every other parameter. Each unit is gathered, freed, re-gathered in the backward pass and
  reduce-scattered once, like a unit of a Stacked stage (`call_unit`), and unlike a one-unit Stacked
  stage, whose forward and backward gathers XLA merges.
- `root_use`: the root leaves read before the first unit call (the embedding's) and those read from
  it on (the head's: a leaf read between units is held throughout), from the traced step on one
  device's batch.
- `regathered`: each unit's leaves that its backward pass gathers again, those the backward reads (XLA
  drops the re-gather of one it does not read, such as a block's last bias); the formula counts those.
- The activations (`activation_estimate`'s answer): the step traced on one device's batch with every
  unit call opaque. Each unit call is measured as `call_unit` runs it: what the unit's checkpoint policy
  saves plus its inputs (an input every unit reads, such as a mask, once); the head's part is what the
  rest of the model and the loss save, and the output's cotangent, as for a Stacked model. (The shard
  copy that `call_unit` ties to a unit's inputs is not kept by XLA: measured, the compiled temporary
  memory grows by the unit's input per unit, not by its input and its shards.)
Nothing here compiles; `jfsdp.planning.memory.measure` is the compiled answer it is checked against.
"""
from __future__ import annotations

import functools
import math
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jfsdp.config.errors import ConfigError
from jfsdp.config.policy import REMAT_POLICIES, wire_dtype
from jfsdp.engine.layout import is_layout, stored_bytes
from jfsdp.engine.model_tree import subtree, without
from jfsdp.planning.activations import fused_head_buffers, residual_bytes, stop_frozen, working_bytes
from jfsdp.planning.sizes import as_shapes, nbytes, tree_bytes

UNIT_SCOPE = "jfsdp_planner_unit"   # the name scope that marks a unit call in the traced step


class AsIsView:
    """An `AsIs` plan as root + stages (see the module docstring); every other attribute is the plan's."""
    as_is = True
    moe_stages = None
    # With gradient accumulation the root's gathers run once per step: nothing ties them to a
    # micro-batch's data, and XLA hoists them out of the micro-batch loop (measured on the Linen and
    # NNX examples, grad_accum 2, 'every' and 'once'). The units' gathers wait for their inputs.
    root_gathered_once = True

    def __init__(self, plan):
        self.plan = plan
        self.traces = {}   # activation_estimate's answers, per batch shape, dtype and loss

    def __getattr__(self, name):
        return getattr(self.plan, name)

    def split(self, tree):
        """A tree in the model's layout -> (the root's part, [each unit's subtree, in call order])."""
        units = list(self.plan.units)
        return without(tree, units), [subtree(tree, u) for u in units]

    @property
    def unit_layouts(self):
        """Each unit's layouts as gathered where some go out in float8 (float8_any.mark_units); else None."""
        if self.plan.mp.float8 is None:
            return None
        return [self.plan.leaf_layouts[tuple(u)] for u in self.plan.units]

    @property
    def stage_sizes(self) -> tuple:
        return tuple(self.plan.scanned.get(tuple(u), 1) for u in self.plan.units)

    @functools.cached_property
    def _structure(self) -> dict:
        return _trace(self, lambda out, batch: jnp.zeros(()), self.plan.example_batch, None, None, units=False)

    @property
    def root_use(self) -> tuple:
        return self._structure["root_use"]

    def root_in_every_micro_batch(self, dtype) -> int:
        """Bytes of the root leaves gathered in every micro-batch, not once per step: those that prefetch in
        call order gathers during the last unit's call, tied to its inputs (engine/as_is/late_root.py)."""
        if not self.plan.prefetch:
            return 0
        leaves = jax.tree.leaves(self.plan.layouts, is_leaf=is_layout)
        return sum(stored_bytes(leaves[i], dtype) for i in self.plan.late_leaves)

    @property
    def regathered(self) -> list:
        """Each unit's leaves (layouts, as `unit_layouts` or `split` give them) that its backward pass gathers
        again: those the backward reads. XLA drops the re-gather of a leaf it does not read (a block's last
        bias: its recomputed output is dead)."""
        units = self.unit_layouts or [jax.tree.leaves(u, is_leaf=is_layout) for u in self.split(self.plan.layouts)[1]]
        return [[l for l, r in zip(u, reads) if r] for u, reads in zip(units, self._structure["reads"])]


def view(plan):
    """The planner's view of `plan`: an `AsIsView` for a model given as it is (made once per plan, so
    that what it traced is kept), the plan itself otherwise."""
    if not getattr(plan, "as_is", False) or isinstance(plan, AsIsView):
        return plan
    if plan.tensor > 1:
        raise ConfigError("the planner does not model a model given as it is with tensor parallelism (T > 1) yet: "
                          "XLA chooses its collectives over 'tensor' (docs/limits.md); compile the step and read "
                          "jfsdp.planning.memory.measure / comm_measured instead")
    if not isinstance(plan.__dict__.get("planner_view"), AsIsView):
        plan.planner_view = AsIsView(plan)
    return plan.planner_view


def scan_gradient_points(v: AsIsView, points: dict, g, grad_shards, once: bool) -> dict:
    """The estimate's peak candidates (`estimate._peak_points`, after `_accumulation_points`) with what a
    model's own scan adds under a resharding strategy, from the units' backward on (the 'units' and
    'embed' points); measured on `ScannedLlama` at width 64, 1x8, FULL_SHARD, 2026-11-26:
    - its backward scan writes the scanned units' gradient shards into a stacked buffer of its own: they
      are held twice (the compiled step exceeds the same model as `Stacked` by them plus 392 bytes, at 4
      and at 8 units; under SHARD_GRAD_OP the two are equal);
    - with `grad_sync='once'` (`once`) its transpose builds each micro-batch's whole stacked gradient apart
      from the sum: two more whole gradients of the scanned units in the reduce dtype (2.1 of them measured
      at 3 units, grad_accum 2; 2.01 in benchmarks/grad_sync.py, docs/any-model.md).
    On jfsdp's prefetch pipeline (plan.prefetch, engine/as_is/own_scan.py; not under `once`, which runs the
    model's scan) the stage's backward stacks the shards as `Stacked`'s does: nothing added.
    `grad_shards`: bytes per device of [(layouts, units)]' gradient shards; `g`: the trainable leaves."""
    scanned = [(l, n) for (l, n), u in zip(g.stages, v.plan.units) if tuple(u) in v.plan.scanned]
    if not scanned or v.shards == 1 or not v.strategy.reshard_after_forward or (v.plan.prefetch and not once):
        return points
    rdt = v.mp.reduce_dtype or v.mp.param_dtype or jnp.float32
    shards = 0 if once else grad_shards(v, scanned)
    whole = 2 * sum(n * stored_bytes(l, rdt) for l, n in scanned) if once else 0
    return {k: ((p[0] + shards, p[1], p[2] + whole, *p[3:]) if k in ("units", "embed") else p)
            for k, p in points.items()}


def activation_estimate(v: AsIsView, loss_fn: Callable, local_batch, backend: str | None = None,
                        widen: bool = True, trainable=None) -> dict:
    """`jfsdp.planning.activations.activation_estimate`'s answer for a model given as it is: per stage
    {'per_unit', 'unit_working'} and 'head' (see the module docstring)."""
    pdt = jnp.dtype(v.mp.param_dtype or jnp.float32)
    pdt = wire_dtype(pdt, backend or jax.default_backend()) if widen else pdt
    # the fit check asks again for other batch sizes and plans: a trace is kept per batch shape and dtype
    # (keyed by the loss's identity, which the entry keeps alive: a loss object need not be hashable)
    key = (str(jax.tree.map(lambda a: (a.shape, a.dtype), local_batch)), str(pdt), id(loss_fn))
    if trainable is not None:
        return _answer(_trace(v, loss_fn, local_batch, pdt, trainable))
    if key not in v.traces:
        v.traces[key] = (loss_fn, _answer(_trace(v, loss_fn, local_batch, pdt, None)))
    return v.traces[key][1]


def _answer(t: dict) -> dict:
    return {**t["stages"][0], "head": t["head"], "stages": t["stages"]}


def _trace(v: AsIsView, loss_fn, local_batch, pdt, trainable, units: bool = True) -> dict:
    """The step on one device's batch, units opaque: {'stages', 'head', 'root_use'} (`units=False`:
    'root_use' alone)."""
    plan = v.plan
    root_l, unit_l = v.split(plan.layouts)
    root_t, unit_t = v.split(trainable) if trainable is not None else (None, [None] * len(unit_l))
    policy = getattr(jax.checkpoint_policies, REMAT_POLICIES[plan.remat])
    calls = {}   # unit index -> (per_unit, unit_working)
    reads = {}   # unit index -> [whether its backward reads each leaf]
    seen = set()   # ids of the unit inputs counted
    shapes = [[l.shape for l in jax.tree.leaves(u, is_leaf=is_layout)] for u in unit_l]

    def which(path, params):
        if path is not None:
            return plan.units.index(tuple(path))
        got = [tuple(x.shape) for x in jax.tree.leaves(params)]
        return next(j for j, (u, s) in enumerate(zip(plan.units, shapes)) if u in plan.scanned and s == got)

    def hook(path, params, fn, inputs):
        j = which(path, params)
        params = stop_frozen(params, unit_t[j])
        if j not in reads:
            reads[j] = _backward_reads(jax.checkpoint(fn, policy=policy), params, inputs)
        if units and j not in calls:
            sds = lambda tree: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)
            p, i = sds(params), sds(inputs)
            # the inputs call_unit saves; one that every unit reads (a mask) is one array, counted once
            new = [x for x in jax.tree.leaves(inputs) if jnp.issubdtype(x.dtype, jnp.floating) and id(x) not in seen]
            seen.update(id(x) for x in new)
            kept = sum(nbytes(x) for x in new)
            calls[j] = (residual_bytes(jax.checkpoint(fn, policy=policy), p, i) + kept, working_bytes(fn, p, i) + kept)
        with jax.named_scope(UNIT_SCOPE):
            return _opaque(fn, params, inputs)

    m = plan.model

    def step(root, units, batch):
        tree = v_join(v, stop_frozen(root, root_t), units)
        if m.kind == "linen":
            out = m.apply(tree, batch, hook, set(plan.units), {s: jax.random.key(0) for s in m.rng_streams})
        else:
            out = m.apply(tree, batch, hook, set(plan.units), jax.random.key(0), plan.matcher.classes)
        return loss_fn(plan.mp.cast_output(out), batch), out   # out: as the model's head writes it

    # a unit the model scans itself has its stacked parameters: one more leading axis, the iterations
    stacked = lambda u, n: jax.tree.map(lambda l: jax.ShapeDtypeStruct((n, *l.shape), pdt or l.dtype), u,
                                        is_leaf=is_layout)
    root_p = as_shapes(root_l, pdt)
    unit_p = [stacked(u, n) if tuple(p) in plan.scanned else as_shapes(u, pdt)
              for u, n, p in zip(unit_l, v.stage_sizes, plan.units)]
    closed, (_, out) = jax.make_jaxpr(step, return_shape=True)(root_p, unit_p, local_batch)
    root_use = _root_use(closed.jaxpr, len(jax.tree.leaves(root_p)))
    if not units:
        return {"root_use": root_use, "reads": [reads[j] for j in range(len(unit_l))]}
    head = residual_bytes(lambda r, u, b: step(r, u, b)[0], root_p, unit_p, local_batch)
    # + the output's cotangent in fp32, as `_head_activations` counts it; a fused head's buffers
    tokens = math.prod(local_batch["inputs"].shape) if "inputs" in local_batch else 0
    head += (2 * nbytes(out) if isinstance(out, jax.ShapeDtypeStruct) else
             fused_head_buffers(v, loss_fn, out, tokens, root_t))
    stages = [{"per_unit": calls[j][0], "unit_working": calls[j][1]} for j in range(len(unit_l))]
    return {"stages": stages, "head": head, "root_use": root_use}


def v_join(v: AsIsView, root, units):
    """The model's tree from the root's part and each unit's subtree (`AsIsView.split`'s inverse)."""
    from jfsdp.engine.model_tree import with_subtree
    tree = root
    for u, sub in zip(v.plan.units, units):
        tree = with_subtree(tree, u, sub)
    return tree


def _opaque(fn, params, inputs):
    """fn(params, inputs) as one call whose forward saves nothing for the outer backward: the unit's own
    residuals are counted per unit (`calls`), not twice. Its backward (never traced here) gives zeros."""
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), (params, inputs))

    @jax.custom_vjp
    def run(params, inputs):
        return fn(params, inputs)

    def fwd(params, inputs):
        return fn(params, inputs), None

    def bwd(_, g):
        zero = lambda s: (jnp.zeros(s.shape, s.dtype) if jnp.issubdtype(s.dtype, jnp.inexact)
                          else np.zeros(s.shape, jax.dtypes.float0))
        return jax.tree.map(zero, shapes)
    run.defvjp(fwd, bwd)
    return run(params, inputs)


def _backward_reads(f, params, inputs) -> list:
    """[whether f's backward pass reads it] for each leaf of `params`: a leaf JAX keeps for the backward
    (by identity among the pullback's residuals) that the backward's jaxpr uses once dead code is gone."""
    from jax._src.interpreters import partial_eval as pe
    out, pull = jax.vjp(f, params, inputs)
    res, tree = jax.tree.flatten(pull)
    closed = jax.make_jaxpr(lambda r, ct: jax.tree.unflatten(tree, r)(ct))(res, out)
    _, used = pe.dce_jaxpr(closed.jaxpr, [True] * len(closed.jaxpr.outvars))
    used_res = used[:len(res)]
    return [any(u and r is x for r, u in zip(res, used_res)) for x in jax.tree.leaves(params)]


def _has_unit(eqn) -> bool:
    if UNIT_SCOPE in str(eqn.source_info.name_stack):
        return True
    for p in eqn.params.values():
        for j in (p if isinstance(p, (list, tuple)) else [p]):
            inner = getattr(j, "jaxpr", j)
            if hasattr(inner, "eqns") and any(_has_unit(e) for e in inner.eqns):
                return True
    return False


def _root_use(jaxpr, n_root: int) -> tuple:
    """(root leaves read before the first unit call, root leaves read after it began: the head's), as
    indices into the flat root. A leaf read between units counts as the head's (held throughout)."""
    marks = [i for i, e in enumerate(jaxpr.eqns) if _has_unit(e)]
    first = marks[0] if marks else len(jaxpr.eqns)
    ids = {id(v): i for i, v in enumerate(jaxpr.invars[:n_root])}
    embed, head = set(), set()
    for k, e in enumerate(jaxpr.eqns):
        for x in e.invars:
            if id(x) in ids:
                (embed if k < first else head).add(ids[id(x)])
    head |= {ids[id(x)] for x in jaxpr.outvars if id(x) in ids}
    return frozenset(embed), frozenset(head)
