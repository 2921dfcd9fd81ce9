"""The root's leaves that a model given as it is reads only after its last unit (its final norm, an untied
head): with prefetch in call order they are gathered while the last unit computes and their gradient is
reduce-scattered while the last unit's backward does, as `Stacked`'s pipeline does with its head
(pipeline.py, `extra`).

The model's parameters are bound before its code runs, so such a leaf is bound twice: gathered at the
top of the step like the rest of the root, then, once the last unit call returns, gathered again from
shards tied to that call's inputs (call_order.py), and written into the tree the model reads from (a
Linen module reads its parameters from the dict it was applied with when it runs; an NNX model's
`Param`s are set). The first gather then has no reader and XLA drops it; a model that read a leaf
before (a Linen `setup` reading `self.param`) keeps the first, with the same values either way.

Which leaves: those on which no unit call's inputs depend, from one abstract trace of the model
(`late_leaves`). A leaf read both before and after (a tied embedding) is gathered once at the top, as
on `Stacked`.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.extend.core import Literal

from jfsdp.engine.layout import is_layout


def _used_inputs(jaxpr, outs=slice(None)) -> list:
    """For each input of a jaxpr, whether an output (of those `outs` selects) depends on it (an equation's
    outputs depend on all its inputs: a nested jaxpr is not looked into)."""
    need = {v for v in jaxpr.outvars[outs] if not isinstance(v, Literal)}
    for e in reversed(jaxpr.eqns):
        if any(v in need for v in e.outvars):
            need.update(v for v in e.invars if not isinstance(v, Literal))
    return [v in need for v in jaxpr.invars]


def late_leaves(plan) -> tuple:
    """Indices into `jax.tree.leaves(plan.layouts)` of the root leaves on which no unit call's inputs
    depend (those the model reads after its last unit, or never)."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(plan.layouts, is_leaf=is_layout)
    root = [i for i, (p, _) in enumerate(flat) if plan.unit_of[jax.tree_util.keystr(p)] is None]
    dtype = lambda l: plan.comm.param_dtype or l.dtype
    m = plan.model

    def unit_inputs(root_leaves, batch):
        leaves = [jnp.zeros(l.full_shape, dtype(l)) for _, l in flat]
        for i, x in zip(root, root_leaves):
            leaves[i] = x
        tree, seen = jax.tree.unflatten(treedef, leaves), []

        def hook(path, shards, fn, inputs):
            seen.append(inputs)
            return fn(shards, inputs)
        key, units = jax.random.key(0), set(plan.units)
        if m.kind == "linen":
            m.apply(tree, batch, hook, units, {s: key for s in m.rng_streams})
        else:
            m.apply(tree, batch, hook, units, key, plan.matcher.classes)
        return seen

    abstract = [jax.ShapeDtypeStruct(flat[i][1].full_shape, dtype(flat[i][1])) for i in root]
    traced = jax.make_jaxpr(unit_inputs, return_shape=True)(abstract, plan.example_batch)
    if not traced[1]:   # no unit call seen (a method under nn.jit replaying a cached trace): none late
        return ()
    used = _used_inputs(traced[0].jaxpr)
    return tuple(i for i, u in zip(root, used) if not u)


def early_leaves(plan) -> tuple:
    """(indices into `jax.tree.leaves(plan.layouts)` of the root leaves that only feed unit calls' inputs (an
    untied embedding: some unit's inputs depend on it, the model's outputs do not once every unit's output
    is replaced by zeros), indices into the first unit's leaves of its last-called top-level submodule
    (step_end.last_called: a Llama block's feed-forward)), from one abstract trace of the model. With
    prefetch in call order the first are reduce-scattered under the first unit's backward and the second
    first of its parts (call_order.py), as `Stacked`'s pipeline does with its lead (step_end.py)."""
    from jfsdp.engine.step_end import last_called
    flat, treedef = jax.tree_util.tree_flatten_with_path(plan.layouts, is_leaf=is_layout)
    root = [i for i, (p, _) in enumerate(flat) if plan.unit_of[jax.tree_util.keystr(p)] is None]
    dtype = lambda l: plan.comm.param_dtype or l.dtype
    m, first, ahead = plan.model, tuple(plan.units[0]), []

    def outputs(root_leaves, batch):
        leaves = [jnp.zeros(l.full_shape, dtype(l)) for _, l in flat]
        for i, x in zip(root, root_leaves):
            leaves[i] = x
        tree, seen = jax.tree.unflatten(treedef, leaves), []

        def hook(path, shards, fn, inputs):
            if tuple(path or ()) == first and not seen:
                lays = jax.tree.unflatten(jax.tree.structure(shards), plan.leaf_layouts[first])
                ahead.extend(last_called(fn, lays, shards, inputs))
            seen.append(inputs)   # the unit's outputs as zeros: what the model reads around its units remains
            zero = lambda x: jnp.zeros_like(x) if jnp.issubdtype(x.dtype, jnp.floating) else x
            return jax.tree.map(zero, fn(shards, inputs))
        key, units = jax.random.key(0), set(plan.units)
        if m.kind == "linen":
            out = m.apply(tree, batch, hook, units, {s: key for s in m.rng_streams})
        else:
            out = m.apply(tree, batch, hook, units, key, plan.matcher.classes)
        return seen, out

    abstract = [jax.ShapeDtypeStruct(flat[i][1].full_shape, dtype(flat[i][1])) for i in root]
    jaxpr, (seen, out) = jax.make_jaxpr(outputs, return_shape=True)(abstract, plan.example_batch)
    n_in = len(jax.tree.leaves(seen))
    if not seen:
        return (), ()
    fed = _used_inputs(jaxpr.jaxpr, slice(0, n_in))
    read = _used_inputs(jaxpr.jaxpr, slice(n_in, n_in + len(jax.tree.leaves(out))))
    return tuple(i for i, f, r in zip(root, fed, read) if f and not r), tuple(ahead)


def rebind(model, tree, paths, values):
    """Write `values` at `paths` (key tuples) into the parameters the model runs with: the dict tree a
    Linen model was applied with, or the NNX model's `Param`s (`model.live`, the module being run)."""
    if model.kind == "linen":
        for path, v in zip(paths, values):
            node = tree
            for k in path[:-1]:
                node = node[k]
            node[path[-1]] = v
        return
    from flax import nnx
    want = dict(zip(paths, values))
    for p, var in nnx.iter_graph(model.live):
        if isinstance(var, nnx.Param) and tuple(p) in want:
            var.set_value(want[tuple(p)]) if hasattr(var, "set_value") else setattr(var, "value", want[tuple(p)])
