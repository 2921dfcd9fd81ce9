"""The end of a step's backward on the prefetch pipeline: unit 0 of the first stage, whose reduce-scatter
is the step's last collective, with nothing after it to hide behind.

`finish` reduces unit 0's gradient in two parts. The parameters of the unit's last-called top-level
submodule (`last_called`: a Llama block's feed-forward, 81% of its bytes) get their gradients first in
the backward; their reduce-scatter runs while the rest of unit 0's backward computes, after unit 1's and
combined with neither. Then the lead's backward (the embedding's, pipeline.pipelined_stage) on unit 0's
dh, its reduce-scatter under the remaining weight-gradient matmuls; last the other parameters' (a Llama
block's attention and norms), the one exposed. Each waits for the one before (barriers.tie): XLA would
otherwise combine them into one collective at the end. A unit with one top-level group keeps one
reduce-scatter, after the lead's. Values are unchanged: the same reductions of the same gradients."""
from __future__ import annotations

import jax
from jax import lax

from jfsdp.engine.barriers import tie
from jfsdp.engine.fsdp import reduce_tree
from jfsdp.engine.layout import is_layout


def last_called(apply, layouts, g, h) -> list:
    """Indices into the leaves of `layouts` (a unit's Layout tree) of the unit's last-called top-level
    submodule: the group (the first key of a leaf's path) whose first use in the traced forward
    `apply(g, h)` comes last (sub-computations followed where their inputs map one to one). [] where
    the unit has one group, or the last use ties."""
    paths, tdef = jax.tree_util.tree_flatten_with_path(layouts, is_leaf=is_layout)
    spec = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)
    jaxpr = jax.make_jaxpr(apply)(jax.tree.map(spec, g), jax.tree.map(spec, h)).jaxpr
    owner, k = {}, 0   # id of a jaxpr input -> the index of the layout leaf it belongs to
    for i, part in enumerate(tdef.flatten_up_to(g)):
        for _ in jax.tree.leaves(part):
            owner[id(jaxpr.invars[k])], k = i, k + 1
    first, count = {}, [0]

    def walk(jaxpr, alias):
        for e in jaxpr.eqns:
            subs = [getattr(p, "jaxpr", p) for p in e.params.values() if hasattr(getattr(p, "jaxpr", p), "eqns")]
            inner = next((s for s in subs if len(s.invars) == len(e.invars)), None)
            if inner is not None:
                walk(inner, {id(a): alias[id(b)] for a, b in zip(inner.invars, e.invars) if id(b) in alias})
            for v in e.invars if inner is None else ():
                if id(v) in alias:
                    first.setdefault(alias[id(v)], count[0])
            count[0] += 1
    walk(jaxpr, owner)
    groups = {}
    for i, (path, _) in enumerate(paths):
        groups.setdefault(str(path[0]) if path else "", []).append(i)
    if len(groups) < 2 or any(i not in first for i in range(len(paths))):
        return []
    when = sorted((min(first[i] for i in ix), key) for key, ix in groups.items())
    return [] if when[-1][0] == when[-2][0] else groups[when[-1][1]]


def finish(passes, g, dg, dh, one, lead):
    """(dh, or the lead's gradient where `lead` maps dh to it; unit 0's reduced gradient; unit 1's, `one`,
    waited for): unit 0's and the lead's reductions in the order above. `g`: unit 0's gathered parameters
    (None where the backward gathers none: one reduce-scatter, after the lead's)."""
    ltd, on_cpu = jax.tree.structure(passes.layouts, is_leaf=is_layout), passes.on_cpu
    layouts, grads = ltd.flatten_up_to(passes.layouts), ltd.flatten_up_to(dg)
    ahead = [] if g is None else last_called(passes.apply, passes.layouts, g, dh)   # (dh: shaped as the input)
    reduced = []
    if ahead:   # after unit 1's reduce-scatter
        part, one = tie([grads[i] for i in ahead], one, on_cpu)
        reduced = reduce_tree(part, [layouts[i] for i in ahead], passes.comm)
    if lead is not None:   # after those
        dh, (one, reduced) = tie(dh, (one, reduced), on_cpu)
        dh = lead(dh)
    rest = [i for i in range(len(grads)) if i not in ahead]
    held = (one, reduced, dh) if lead is not None else (one, reduced)
    part, held = lax.optimization_barrier(([grads[i] for i in rest], held))   # the last, after them all
    one, reduced = held[:2]
    done = dict(zip(ahead, reduced)) | dict(zip(rest, reduce_tree(part, [layouts[i] for i in rest], passes.comm)))
    return (held[2] if lead is not None else dh), jax.tree.unflatten(ltd, [done[i] for i in range(len(grads))]), one
