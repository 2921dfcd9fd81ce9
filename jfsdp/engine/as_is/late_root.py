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
(`root_uses`). A leaf read both before and after (a tied embedding) is gathered once at the top, as
on `Stacked`.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax.core.tracers import current_trace

from jfsdp.engine import column_embed
from jfsdp.engine.as_is import own_scan
from jfsdp.engine.layout import is_layout
from jfsdp.engine.model_tree import subtree


def _used_inputs(jaxpr, outs=slice(None)) -> list:
    """For each input of a jaxpr, whether an output (of those `outs` selects) depends on it (an equation's
    outputs depend on all its inputs: a nested jaxpr is not looked into)."""
    need = own_scan.reads(jaxpr, jaxpr.outvars[outs])
    return [v in need for v in jaxpr.invars]


class RootUses(NamedTuple):
    """What one abstract trace of the model tells of its root leaves (indices into
    `jax.tree.leaves(plan.layouts)`) and of its first unit (indices into that unit's leaves)."""
    late: tuple    # root leaves on which no unit call's inputs depend (read after the last unit, or never)
    early: tuple   # root leaves that only feed unit calls' inputs (an untied embedding)
    ahead: tuple   # the first unit's last-called top-level submodule's leaves (a Llama block's feed-forward)
    tables: tuple = ()   # root leaves looked up as an nn.Embed / nnx.Embed table (column_embed.py)


def root_uses(plan) -> RootUses:
    """`RootUses` from one abstract trace of the model, every unit call's outputs replaced by zeros (what the
    model reads around its units remains; a root leaf reaches a later unit's inputs only through an earlier
    unit's inputs, so which inputs depend on it is the same as with the units' real outputs).
    - late: the root leaves no unit call's inputs depend on. With prefetch in call order they are gathered
      while the last unit computes and reduce-scattered during its backward (call_order.py).
    - early: those some unit's inputs depend on and the model's outputs do not; reduce-scattered under the
      first unit's backward, as `Stacked`'s pipeline does with its lead (step_end.py).
    - ahead: step_end.last_called of the first unit, the first of its gradient's parts.
    - tables: the root leaves an `nn.Embed` / `nnx.Embed` looks up (column_embed.recording).
    No unit call seen (a method under nn.jit replaying a cached trace): all three empty."""
    from jfsdp.engine.step_end import last_called
    flat, treedef = jax.tree_util.tree_flatten_with_path(plan.layouts, is_leaf=is_layout)
    root = [i for i, (p, _) in enumerate(flat) if plan.unit_of[jax.tree_util.keystr(p)] is None]
    dtype = lambda l: plan.comm.param_dtype or l.dtype
    m, first, ahead = plan.model, tuple(plan.units[0]), []
    unit = lambda p: plan.unit_of[jax.tree_util.keystr(p)]
    stacked = lambda p: (plan.scanned[unit(p)],) if unit(p) in plan.scanned else ()   # the model's own scan's

    def outputs(root_leaves, batch):
        leaves = [jnp.zeros(stacked(p) + l.full_shape, dtype(l)) for p, l in flat]
        for i, x in zip(root, root_leaves):
            leaves[i] = x
        tree, seen, top = jax.tree.unflatten(treedef, leaves), [], current_trace()

        def hook(path, shards, fn, inputs):
            if current_trace() != top:   # inside the model's own scan: its input is what `scan_inputs` saw
                return fn(shards, inputs)
            if tuple(path or ()) == first and not seen:
                lays = jax.tree.unflatten(jax.tree.structure(shards), plan.leaf_layouts[first])
                ahead.extend(last_called(fn, lays, shards, inputs))
            seen.append(inputs)
            zero = lambda x: jnp.zeros_like(x) if jnp.issubdtype(x.dtype, jnp.floating) else x
            return jax.tree.map(zero, fn(shards, inputs))
        key, units = jax.random.key(0), set(plan.units)
        with own_scan.scan_inputs([jax.tree.leaves(subtree(tree, p)) for p in plan.scanned], seen), \
                column_embed.recording({id(x): i for i, x in zip(root, root_leaves)}, tables):
            if m.kind == "linen":
                out = m.apply(tree, batch, hook, units, {s: key for s in m.rng_streams})
            else:
                out = m.apply(tree, batch, hook, units, key, plan.matcher.classes)
        return seen, out

    abstract = [jax.ShapeDtypeStruct(flat[i][1].full_shape, dtype(flat[i][1])) for i in root]
    tables = set()
    jaxpr, (seen, out) = jax.make_jaxpr(outputs, return_shape=True)(abstract, plan.example_batch)
    if not seen:
        return RootUses((), (), ())
    n_in = len(jax.tree.leaves(seen))
    fed = _used_inputs(jaxpr.jaxpr, slice(0, n_in))
    read = _used_inputs(jaxpr.jaxpr, slice(n_in, n_in + len(jax.tree.leaves(out))))
    return RootUses(tuple(i for i, f in zip(root, fed) if not f),
                    tuple(i for i, f, r in zip(root, fed, read) if f and not r), tuple(ahead), tuple(sorted(tables)))


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
