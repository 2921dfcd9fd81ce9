"""Prefetch for a model that scans its own units (Linen `nn.scan`, `nnx.scan` over stacked layers): the
model's scan is run as a stage of jfsdp's prefetch pipeline (pipeline.py), as `Stacked`'s are.

The loop is the model's, so nothing can be placed around one of its iterations from outside. Instead,
while the sharded forward runs the model (`running`), `jax.lax.scan` is replaced by `OwnScan.scan`,
which recognizes the model's scan over a unit's stacked parameters: the leaves of its `xs` are the very
shards the engine handed to the model (Flax passes them through untouched). That scan is traced once,
one iteration with the unit's gathered parameters in place of its slice of the shards (the unit's call
inside then computes on them directly, `OwnScan.inside`), and the iteration becomes the pipeline's unit:
unit i+1 gathered while unit i computes, unit i's reduce-scatter under unit i-1's backward, the last
unit's gathered parameters saved for its backward, the first unit's reduce-scatter in parts (step_end.py);
the root leaves read after the last scan (a final norm, an untied head) gathered while its last unit
computes. A model with several scans over units runs each as a stage. Every other scan (the pipeline's
own, one inside a unit, one over other values) runs as jax's.

What the scan may be (`OwnScan.scan`, `_trace`): forward; its per-iteration inputs the unit's parameters
and values that are not floats (random keys split per layer, read by the iteration's index); its
per-iteration outputs those parameters passed through (NNX hands the layer's state back) or values made
from the other per-iteration inputs alone (an NNX layer's random counts: computed for every iteration
apart, `_made`). Float values it reads from outside (a table computed before the scan) travel in the
pipeline's carry, unchanged by each iteration, so that they get their gradient (summed over the
iterations by the carry's VJP) and the pipeline's custom VJP closes over no differentiated value; the
backward keeps one copy per iteration of them, as it keeps each iteration's input. Float8 units run as on
`Stacked`'s pipeline (kernels gathered in float8). A scan that does not fit runs as the model wrote it
(each unit gathered in its iteration; on GPUs XLA's collective pipeliner moves the gathers and
reduce-scatters, as with prefetch=False) with a warning that says why, or, where prefetch=True was asked
for, is a ConfigError that says why.
"""
from __future__ import annotations

import contextlib
import warnings

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend.core import ClosedJaxpr, Jaxpr, Literal, jaxpr_as_fun

from jfsdp.config.errors import ConfigError
from jfsdp.engine.float8 import KERNELS
from jfsdp.engine.fsdp import unshard_tree
from jfsdp.engine.model_tree import subtree
from jfsdp.engine.pipeline import pipelined_stage

_SCAN = lax.scan   # jax's own, captured before any replacement


def _is_float(x) -> bool:
    return jnp.issubdtype(jnp.result_type(x), jnp.floating)


class OwnScan:
    """The model's scans over the units in `stacked` ({unit path: (stacked shards, Layout tree)}) run as
    pipeline stages of `plan` (an AsIs: its strategy, policy, communication); `strict` (prefetch=True asked
    for) turns a scan that does not fit into a ConfigError."""

    def __init__(self, plan, stacked: dict, strict: bool, late=None):
        self.plan, self.stacked, self.strict = plan, stacked, strict
        self.late = late   # (shards, bind(shards) -> None) of the root read after the scan, or None
        self.inside = 0   # > 0 while an iteration is traced with gathered parameters
        self.runs = 0     # the scans over units run so far in this forward

    def scan(self, f, init=None, xs=None, length=None, reverse=False, unroll=1, **kw):
        """`jax.lax.scan`'s signature: the model's scan over a unit's stacked shards as a pipeline stage,
        any other scan as jax runs it."""
        keep = lambda: _SCAN(f, init, xs, length=length, reverse=reverse, unroll=unroll, **kw)
        if self.inside:
            return keep()
        leaves, xtree = jax.tree.flatten(xs)
        found = self._match(leaves)
        if found is None:
            return keep()
        path, where = found
        rest = [i for i in range(len(leaves)) if i not in where]   # per-iteration random keys: read by index
        why = ("it runs in reverse" if reverse else "it asks for a split transpose" if kw.get("_split_transpose")
               else "its carry has values that are not floats" if not all(_is_float(x) for x in jax.tree.leaves(init))
               else "it scans float values besides the unit's parameters" if any(_is_float(leaves[i]) for i in rest)
               else None)
        traced = None if why else self._trace(f, init, leaves, xtree, path, where, rest)
        why = why or traced[0]
        if why:
            what = f"the model's own scan over unit {'/'.join(map(str, path))}"
            if self.strict:
                raise ConfigError(f"prefetch=True: {what} cannot run on jfsdp's pipeline: {why}; pass prefetch=None "
                                  "or False")
            warnings.warn(f"jfsdp: {what} runs as the model wrote it (each unit gathered in its iteration, XLA's "
                          f"pipeliner on GPUs), not on jfsdp's prefetch pipeline: {why}", stacklevel=2)
            return keep()
        _, closed, outs, ytree = traced
        return self._run(path, init, closed, outs, ytree, [leaves[i] for i in rest])

    def _match(self, leaves):
        """(unit path, {position in xs: index of the unit's leaf}) of the unit whose stacked shards `xs`
        holds, or None (`unit_in`)."""
        return unit_in(leaves, {path: jax.tree.leaves(shards) for path, (shards, _) in self.stacked.items()})

    def _trace(self, f, init, leaves, xtree, path, where, rest):
        """One iteration, traced with the unit's gathered parameters: (why it does not fit or None,
        the closed jaxpr of (gathered leaves, carry leaves, the other per-iteration leaves) -> (carry,
        per-iteration outputs), for each per-iteration output the unit's leaf it passes through, the
        outputs' tree)."""
        shards, layouts = self.stacked[path]
        row = lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype)
        box = lambda x: isinstance(x, KERNELS)   # a float8 kernel, gathered: one value of several arrays
        gathered = jax.tree.leaves(jax.eval_shape(lambda s: unshard_tree(s, layouts, self.plan.comm),
                                                  jax.tree.map(row, shards)), is_leaf=box)
        ytree = []

        def one(g, c, r):
            x = list(leaves)
            for pos, k in where.items():
                x[pos] = g[k]
            for pos, v in zip(rest, r):
                x[pos] = v
            c, ys = f(c, jax.tree.unflatten(xtree, x))
            ytree.append(jax.tree.structure(ys, is_leaf=box))
            return c, [jax.tree.leaves(y)[0] for y in jax.tree.leaves(ys, is_leaf=box)]
        self.inside += 1
        try:
            closed = jax.make_jaxpr(one)(gathered, init, [row(leaves[i]) for i in rest])
        finally:
            self.inside -= 1
        jaxpr, n_c = closed.jaxpr, len(jax.tree.leaves(init))
        owner = [k for k, g in enumerate(gathered) for _ in jax.tree.leaves(g)]   # unit leaf of each input
        outs = []   # (a gathered float8 kernel by the first of its arrays)
        for v in jaxpr.outvars[n_c:]:
            outs.append(next((owner[j] for j, a in enumerate(jaxpr.invars[:len(owner)]) if a is v), None))
        # other per-iteration outputs (an NNX layer's random counts) only from the other per-iteration inputs
        made = [v for v, k in zip(jaxpr.outvars[n_c:], outs) if k is None]
        floats = {v for v, x in zip(jaxpr.constvars, closed.consts) if _is_float(x)}
        if made and reads(jaxpr, made) & (set(jaxpr.invars[:len(owner) + n_c]) | floats):
            return "its body returns per-iteration outputs computed from its parameters or its carry", None, None, None
        return None, closed, outs, ytree[0]

    def _run(self, path, init, closed, outs, ytree, rest):
        """The scan as a pipeline stage. Its carry: the model's, the float values the body reads from
        outside, and, where the scan has other per-iteration leaves `rest` (random keys, never
        differentiated, read by the iteration's index), the index as a float."""
        shards, layouts = self.stacked[path]
        consts = list(closed.consts)
        floats = [i for i, x in enumerate(consts) if _is_float(x)]   # carried: they get their gradient
        n_c = len(jax.tree.leaves(init))
        ctree = jax.tree.structure(init)

        def apply(g, h):
            c, carried, *i = h
            values = list(consts)
            for k, x in zip(floats, carried):
                values[k] = x
            rows = [lax.dynamic_index_in_dim(x, i[0].astype(jnp.int32), keepdims=False) for x in rest]
            out = jaxpr_as_fun(ClosedJaxpr(closed.jaxpr, values))(*jax.tree.leaves(g), *jax.tree.leaves(c), *rows)
            return (jax.tree.unflatten(ctree, out[:n_c]), carried, *(k + 1 for k in i))
        n, k = jax.tree.leaves(shards)[0].shape[0], self.runs
        self.runs += 1   # the k-th of the model's scans over units: the pipeline's first and last stages
        stage = pipelined_stage(self.plan.passes_of(apply, layouts, n, k == 0, k == len(self.stacked) - 1))
        late = self.late if k == len(self.stacked) - 1 else None   # the last scan: the model's last unit is in it
        h = (init, [consts[k] for k in floats], *([jnp.zeros((), jnp.float32)] if rest else []))
        (c, *_), extra = stage(h, shards, late[0] if late else [], None)
        if late:   # gathered while the last unit computes, reduce-scattered while its backward does
            late[1](extra)
        own, made = jax.tree.leaves(shards), iter(self._made(closed, outs, n_c, rest))
        return c, jax.tree.unflatten(ytree, [own[k] if k is not None else next(made) for k in outs])

    @staticmethod
    def _made(closed, outs, n_c, rest) -> list:
        """The per-iteration outputs that are not the unit's parameters, for every iteration: the equations
        that make them (`_trace` checked that they read only the other per-iteration inputs and values
        that are not floats) mapped over `rest`."""
        jaxpr = closed.jaxpr
        made = [v for v, k in zip(jaxpr.outvars[n_c:], outs) if k is None]
        if not made:
            return []
        need = reads(jaxpr, made)
        part = Jaxpr(jaxpr.constvars, jaxpr.invars, made, [e for e in jaxpr.eqns if any(v in need for v in e.outvars)
                                                            or not e.outvars])
        run = jaxpr_as_fun(ClosedJaxpr(part, closed.consts))
        n_in = len(jaxpr.invars) - len(rest)
        fill = [jnp.zeros(v.aval.shape, v.aval.dtype) for v in jaxpr.invars[:n_in]]   # read by none of them
        return list(jax.vmap(lambda *r: run(*fill, *r))(*rest))


def stacked_units(plan, tree) -> dict:
    """{unit path: (its stacked shards in `tree`, its Layout tree)} of the units the model scans itself."""
    out = {}
    for p in plan.scanned:
        sub = subtree(tree, p)
        out[p] = (sub, jax.tree.unflatten(jax.tree.structure(sub), plan.leaf_layouts[p]))
    return out


def reads(jaxpr, outvars) -> set:
    """The variables (inputs, constants, intermediates) that `outvars` of `jaxpr` are computed from."""
    need = {v for v in outvars if not isinstance(v, Literal)}
    for e in reversed(jaxpr.eqns):
        if any(v in need for v in e.outvars):
            need.update(v for v in e.invars if not isinstance(v, Literal))
    return need


def unit_in(leaves, stacked: dict):
    """(key, {position in `leaves`: index of that unit's leaf}) of the first of `stacked` ({key: a unit's
    stacked leaves}) whose every leaf is among `leaves`, by identity (the arrays the engine handed the
    model, which Flax passes through to its scan); else None."""
    ids = {id(x): i for i, x in enumerate(leaves)}
    for key, own in stacked.items():
        where = {ids[id(x)]: k for k, x in enumerate(own) if id(x) in ids}
        if own and len(where) == len(own):
            return key, where
    return None


@contextlib.contextmanager
def _scan_is(scan):
    """While active, `jax.lax.scan` (which Flax's scans call) is `scan`."""
    previous = lax.scan
    lax.scan = scan
    try:
        yield
    finally:
        lax.scan = previous


def scan_inputs(stacked: list, seen: list):
    """While active, a scan over one of `stacked` (each a unit's stacked leaves) appends its carry's initial
    value to `seen` (the unit's input, for late_root.root_uses) and returns zeros for its carry, as that
    trace's units return zeros."""
    def scan(f, init=None, xs=None, *args, **kw):
        if unit_in(jax.tree.leaves(xs), dict(enumerate(stacked))) is None:
            return _SCAN(f, init, xs, *args, **kw)
        seen.append(init)
        c, ys = _SCAN(f, init, xs, *args, **kw)
        return jax.tree.map(lambda x: jnp.zeros_like(x) if _is_float(x) else x, c), ys
    return _scan_is(scan)


def running(own: OwnScan):
    """While active, `jax.lax.scan` is `own.scan`: the model's scans over units run as pipeline stages."""
    return _scan_is(own.scan)
