"""The optimizer applied inside the backward pass, one unit at a time (`make_train_step(...,
update_in_backward=True)`).

The usual step holds every gradient shard until the backward pass ends and then updates: at its peak
a device keeps parameters, optimizer state and a whole gradient (four copies of the model's shard
with Adam). Here each unit's update runs as soon as its gradient shard is reduced, inside the
backward loop (`FSDP._stage_passes`: the stacked parameters and moments are the loop's carry,
updated in place row by row), and the gradient shard dies with it: one unit's gradient at a time,
plus the root's (held from the head's backward to the embedding's).

Exactness with global-norm clipping: the scale needs the norm of the whole gradient before the first
update. With a clipped optimizer (`jfsdp.adamw(clip_norm=c)`) the backward loop runs twice: first
for the norm alone (each unit's gradient squared, summed, dropped), then for the updates with the
scale known; the forward pass, the head's backward and the root's gradient are computed once (the
second loop starts from the saved unit inputs and the head's input gradient). Cost: one more
backward pass through the units (recompute and differentiate each unit). Without clipping, one pass.

The optimizer must be elementwise: each parameter's update reads only its own gradient and state
plus shared scalars (step counts, schedules). optax's adam/adamw/sgd/momentum/lion with masks are;
a transformation that reduces over the tree (a global clip inside an optax chain, gradient
statistics) is not, and would see one unit at a time: give clipping as `jfsdp.adamw(clip_norm=...)`.
The optimizer state keeps the usual layout, so checkpoints move between the two kinds of step.
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import PartitionSpec as P

from jfsdp.engine.layout import at_row, is_layout
from jfsdp.engine.sharded import FSDP, tie, unshard
from jfsdp.config.mesh import AXES, FSDP_AXIS
from jfsdp.config.errors import ConfigError


class Clipped(optax.GradientTransformationExtraArgs):
    """`optax.chain(clip_by_global_norm(clip_norm), inner)` that remembers its parts (`clip_norm`,
    `inner`), so that a step applying the update unit by unit can clip by the global norm first.
    Its state is the chain's: (clip's empty state, inner's state)."""


def clipped(clip, inner: optax.GradientTransformation, clip_norm: float) -> Clipped:
    chain = optax.chain(clip, inner)
    out = Clipped(chain.init, chain.update)
    out.clip_norm, out.inner = clip_norm, inner
    return out


def unsupported(plan: FSDP, grad_accum: int) -> str | None:
    """Why `update_in_backward` cannot run this plan (None: it can)."""
    if grad_accum != 1:
        return (f"it applies each unit's update as soon as its gradient is reduced, so it cannot accumulate "
                f"{grad_accum} micro-batches (use grad_accum=1)")
    if plan.remat != "full":
        return f"its backward loop recomputes each unit from the unit's input (remat 'full'), got remat '{plan.remat}'"
    if plan.shards > 1 and not plan.strategy.reshard_after_forward:
        return (f"{plan.strategy.value} keeps gathered units from forward to backward; use full_shard or "
                f"hybrid_shard (units are gathered again in the backward loop)")
    if any(m is not None and m.mode == "ep" for m in plan.moe_stages):
        return "an expert-parallel MoE stage keeps its experts local (use jfsdp.MoE('gather'))"
    return None


# primitives that map elements to elements (and compare/select them): an update made of these, plus
# scalars that depend on no array (step counts, schedules), can run on any slice of the tree
_ELEMENTWISE = frozenset("""abs add and atan2 broadcast_in_dim ceil clamp convert_element_type copy copy_p cos div eq
    erf exp exp2 expm1 floor ge gt integer_pow is_finite le log log1p logistic lt max min mul ne neg nextafter not or
    pow rem round rsqrt select_n sign sin sqrt square stop_gradient sub tan tanh xor""".split())
_CALLS = ("jit", "pjit", "closed_call", "core_call", "custom_jvp_call", "custom_vjp_call", "remat", "checkpoint")


def _across(jaxpr, tainted_in) -> tuple[str | None, list]:
    """Follow values derived from the array inputs (`tainted_in`) through a jaxpr: the name of the
    first primitive that is not elementwise on them (None if there is none), and which outputs derive
    from them."""
    tainted = {v for v, t in zip(jaxpr.invars, tainted_in) if t}
    is_var = lambda v: type(v).__name__ != "Literal"
    for e in jaxpr.eqns:
        ins = [is_var(v) and v in tainted for v in e.invars]
        if not any(ins):
            continue
        name = e.primitive.name
        sub = e.params.get("jaxpr", e.params.get("call_jaxpr"))
        if name in _CALLS and sub is not None:
            why, out = _across(getattr(sub, "jaxpr", sub), ins)
            if why:
                return why, []
            tainted.update(v for v, t in zip(e.outvars, out) if t)
        elif name in _ELEMENTWISE:
            tainted.update(e.outvars)
        else:
            return name, []
    return None, [is_var(v) and v in tainted for v in jaxpr.outvars]


def check_elementwise(update, grads, state, params):
    """ConfigError unless `update(grads, state, params)` is elementwise in every array it reads."""
    leaves = jax.tree.leaves((grads, state, params))
    jaxpr = jax.make_jaxpr(lambda *xs: update(*jax.tree.unflatten(jax.tree.structure((grads, state, params)), xs)))(*leaves)
    why, _ = _across(jaxpr.jaxpr, [len(x.shape) > 0 for x in leaves])
    if why:
        raise ConfigError(f"update_in_backward needs an elementwise optimizer (each parameter's update from its own "
                          f"gradient and state), but this one combines elements ('{why}' in its update: a global "
                          f"clip or norm inside the optax chain?); give clipping as jfsdp.adamw(clip_norm=...)")


class _Param:
    """An optimizer-state leaf that mirrors parameter leaf k."""
    def __init__(self, k):
        self.k = k


_OTHER = object()


def _empty(x):
    # a zero-size stand-in with the leaf's rank: the optimizer (and a mask that reads ranks) sees
    # the tree it knows, and the leaves that are not being updated cost nothing
    return jnp.zeros((0, *x.shape[1:]), x.dtype)


def make_step(plan: FSDP, optimizer: optax.GradientTransformation, loss_fn: Callable, opt_specs) -> Callable:
    """(params, opt_state, batch) -> (params, opt_state, loss, grad_norm), to be jitted: forward,
    head backward, then the units' backward with each unit's update in the loop, then the root's."""
    clip = optimizer.clip_norm if isinstance(optimizer, Clipped) else None
    abstract = plan.abstract_params()
    p_def = jax.tree.structure(abstract)
    n_p = p_def.num_leaves
    marks = jax.tree.unflatten(p_def, [_Param(k) for k in range(n_p)])
    state0 = jax.eval_shape(optimizer.init, abstract)
    s_def = jax.tree.structure(state0)
    tags = jax.tree.leaves(optax.tree_map_params(optimizer, lambda _, m: m, state0,
                                                 marks, transform_non_params=lambda _: _OTHER),
                           is_leaf=lambda x: isinstance(x, _Param) or x is _OTHER)
    tags = [t.k if isinstance(t, _Param) else None for t in tags]
    elementwise = optimizer.inner if isinstance(optimizer, Clipped) else optimizer
    check_elementwise(elementwise.update, abstract, state0[1] if isinstance(optimizer, Clipped) else state0, abstract)
    if len(tags) != s_def.num_leaves:
        raise ConfigError("update_in_backward could not tell which optimizer-state leaves mirror which parameter "
                          f"({len(tags)} tags for {s_def.num_leaves} leaves)")
    root_k, stage_k = plan.split(jax.tree.unflatten(p_def, range(n_p)))
    root_k = jax.tree.leaves(root_k)
    stage_k = [jax.tree.leaves(t) for t in stage_k]
    root_l, stage_l = plan.split(plan.layouts)
    r_layouts, r_def = jax.tree.flatten(root_l, is_leaf=is_layout)
    passes = [plan._stage_passes(j, l) for j, l in enumerate(stage_l)]
    embed_reads, head_reads = plan.root_use
    comm, model = plan.comm, plan.model
    on_cpu = plan.mesh.devices.flat[0].platform == "cpu"

    def opt_update(p_leaves, s_leaves, pieces, grads, s_pieces):
        """Run the optimizer on the parameter leaves in `pieces` (k -> array) only: every other
        parameter, gradient and mirrored state leaf is a zero-size stand-in. -> (new params {k},
        new mirrored state {m}, new state leaves that mirror no parameter)."""
        g = jax.tree.unflatten(p_def, [grads[k] if k in grads else _empty(x) for k, x in enumerate(p_leaves)])
        p = jax.tree.unflatten(p_def, [pieces[k] if k in pieces else _empty(x) for k, x in enumerate(p_leaves)])
        s = [s_pieces[m] if m in s_pieces else (_empty(x) if tags[m] is not None else x) for m, x in enumerate(s_leaves)]
        s = jax.tree.unflatten(s_def, s)
        if isinstance(optimizer, Clipped):
            u, inner = elementwise.update(g, s[1], p)
            new_s = (s[0], inner)
        else:
            u, new_s = optimizer.update(g, s, p)
        u, new_s = jax.tree.leaves(u), jax.tree.leaves(new_s)
        new_p = {k: (pieces[k] + u[k]).astype(pieces[k].dtype) for k in pieces}
        return new_p, {m: new_s[m] for m in s_pieces}, [x for m, x in enumerate(new_s) if tags[m] is None]

    def local(params, opt_state, batch):
        p_leaves = p_def.flatten_up_to(params)
        s_leaves = s_def.flatten_up_to(opt_state)
        mirrors = {}   # param leaf k -> the state leaves m that mirror it
        for m, k in enumerate(tags):
            if k is not None:
                mirrors.setdefault(k, []).append(m)
        root_p, stage_p = plan.split(params)
        r_shards = r_def.flatten_up_to(root_p)

        def root_tree(shards, reads):
            return jax.tree.unflatten(r_def, [unshard(shards[i], l, comm) if i in reads else
                                              jnp.zeros(l.shape, comm.param_dtype or l.dtype)
                                              for i, l in enumerate(r_layouts)])

        # forward: the embedding (its vjp needs no weights), each stage saving its units' inputs
        embed = lambda shards: model.root.apply({"params": root_tree(shards, embed_reads)}, batch["inputs"],
                                                method=model.embed_method)
        h, embed_vjp = jax.vjp(embed, r_shards)
        saved = []
        for j, (forward, _) in enumerate(passes):
            h, hs = forward(h, stage_p[j], True)
            saved.append(hs)
        # the head's weights gathered once h exists (not hoisted to the start of the step)
        head_shards, h = tie(r_shards, h, on_cpu)
        head_loss = lambda shards, h: FSDP._scalar_loss(loss_fn(plan._head(root_tree(shards, head_reads), h), batch))
        loss, head_vjp = jax.vjp(head_loss, head_shards, h)
        d_head, dh_top = head_vjp(jnp.ones((), jnp.float32))
        # the units' backward waits for the head's gradient to be reduced: otherwise XLA starts the
        # last unit's recomputation (which needs no dh) while the gathered head weight and its full
        # gradient are still live (measured: +0.5 GB at the peak, llama-1b on 8 CPU devices)
        dh_top, d_head = tie(dh_top, d_head, on_cpu)

        sq = lambda tree: sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(tree))

        # pass for the norm (clipped optimizer only): nothing is updated or kept
        norm_consume = lambda acc, i, g: (acc[0], acc[1] + sq(g))
        read_first = lambda acc, i: at_row(acc[0], i)
        scaled = lambda x, scale: x if scale is None else x * scale.astype(x.dtype)

        def update_consume(j, scale):
            keys = stage_k[j]

            def consume(acc, i, g):
                stacked, mirrored, total = acc
                g_leaves = jax.tree.leaves(g)
                norm_sq = sq(g_leaves)
                total = total + norm_sq
                row = lambda x: lax.dynamic_slice_in_dim(x, i, 1, 0)
                put = lambda a, x: lax.dynamic_update_slice_in_dim(a, x, i, 0)
                stacked, mirrored = list(stacked), dict(mirrored)
                for n, (k, x) in enumerate(zip(keys, g_leaves)):
                    # Leaf by leaf, and each leaf's reads after every write before them (one element
                    # of each stacked buffer as it now is): one leaf's rows in flight (XLA:CPU read
                    # every leaf's rows first: measured), and no read of a buffer that XLA could
                    # schedule after an in-place write to it (unit 0's rows, read after unit 1's
                    # update outside the loop, made XLA:CPU copy every stacked leaf: measured).
                    grads = {k: scaled(x, scale)[None]}
                    pieces = ({k: row(stacked[n])}, {m: row(mirrored[m]) for m in mirrors.get(k, [])})
                    marks = [a.reshape(-1)[:1] for a in [*stacked, *mirrored.values()]]
                    pieces, _ = tie(pieces, marks, on_cpu)
                    new_p, new_s = rows_update(pieces[0], grads, pieces[1], norm_sq)
                    stacked[n] = put(stacked[n], new_p[k])
                    for m, v in new_s.items():
                        mirrored[m] = put(mirrored[m], v)
                return stacked, mirrored, total
            return consume

        def rows_update(pieces, grads, s_pieces, norm_sq):
            """One leaf's new parameter and state rows (of one unit), all computed before any is written back.
            Otherwise XLA fuses each write with the update math, duplicated: the fusion that writes
            the parameter row reads the old moments while the one that writes the moments runs in no
            set order with it, and to keep the old moments readable XLA copies every stacked leaf
            (measured on XLA:CPU: the peak above the usual step's). On XLA:GPU an optimization barrier
            keeps the rows apart; XLA:CPU drops barriers before fusing, so there the update runs as a
            conditional's branch (a buffer boundary no fusion crosses) whose predicate, `not norm_sq < 0`,
            is always true (NaN included) but not a constant XLA could fold."""
            f = lambda a: opt_update(p_leaves, s_leaves, *a)[:2]
            if on_cpu:
                return lax.cond(jnp.logical_not(norm_sq < 0), f, lambda a: (a[0], a[2]), (pieces, grads, s_pieces))
            return lax.optimization_barrier(f((pieces, grads, s_pieces)))

        def stage_acc(j):
            keys = stage_k[j]
            return ([p_leaves[k] for k in keys], {m: s_leaves[m] for k in keys for m in mirrors.get(k, [])},
                    jnp.zeros((), jnp.float32))
        def stage_read(j):
            tree_def = jax.tree.structure(stage_p[j])
            return lambda acc, i: jax.tree.unflatten(tree_def, read_first(acc, i))

        def run_updates(scale):
            dh, total = dh_top, jnp.zeros((), jnp.float32)
            new = [None] * len(passes)
            for j in reversed(range(len(passes))):
                dh, acc = passes[j][1](saved[j], dh, stage_acc(j), stage_read(j), update_consume(j, scale))
                new[j], total = acc, total + acc[2]
            return dh, new, total

        def root_update(d_root, scale):
            g_leaves = list(d_root)   # the root shards, as listed by r_def
            grads = {k: scaled(x, scale) for k, x in zip(root_k, g_leaves)}
            pieces = {k: p_leaves[k] for k in root_k}
            s_pieces = {m: s_leaves[m] for k in root_k for m in mirrors.get(k, [])}
            return opt_update(p_leaves, s_leaves, pieces, grads, s_pieces)

        def embed_backward(dh):
            """The embedding's gradient, as a conditional's branch (predicate always true, as in
            `rows_update`). A lookup's gradient is a scatter-add into zeros of the table's size, and
            the fused loss's head gradient starts from the same zeros: XLA merged the two (CSE), so
            a table-sized buffer of zeros lived from the head's backward to the step's end (measured:
            llama-1b on 8 CPU devices, 1.05 GB at the peak). A branch is its own computation, which
            CSE does not reach into."""
            if plan.shards == 1:   # nothing gathered: no second table of zeros (and the branch's copy costs)
                return embed_vjp(dh)[0]
            witness = jnp.square(loss)   # >= 0 or NaN: `not witness < 0` holds
            return lax.cond(jnp.logical_not(witness < 0), lambda d: embed_vjp(d)[0],
                            lambda d: jax.tree.map(jnp.zeros_like, r_shards), dh)

        reduce_norm = (lambda x: lax.psum(x, FSDP_AXIS)) if plan.strategy.sharded else (lambda x: x)
        add = lambda a, b: jax.tree.map(jnp.add, a, b)
        if clip is not None:
            dh = dh_top
            total = jnp.zeros((), jnp.float32)
            for j in reversed(range(len(passes))):
                dh, acc = passes[j][1](saved[j], dh, (stage_p[j], total), read_first, norm_consume)
                total = acc[1]
            d_root = add(d_head, embed_backward(dh))
            norm = jnp.sqrt(reduce_norm(total + sq(d_root)))
            scale = jnp.where(norm < clip, 1.0, clip / norm)
            root_p_new, root_s_new, others = root_update(d_root, scale)
            _, new, _ = run_updates(scale)
        else:
            dh, new, total = run_updates(None)
            d_root = add(d_head, embed_backward(dh))
            norm = jnp.sqrt(reduce_norm(total + sq(d_root)))
            root_p_new, root_s_new, others = root_update(d_root, None)

        out_p = list(p_leaves)
        out_s = list(s_leaves)
        for k, x in root_p_new.items():
            out_p[k] = x
        out_s_updates = dict(root_s_new)
        for j, (stacked, mirrored, _) in enumerate(new):
            for n, k in enumerate(stage_k[j]):
                out_p[k] = stacked[n]
            out_s_updates.update(mirrored)
        it = iter(others)
        for m in range(len(out_s)):
            out_s[m] = out_s_updates[m] if tags[m] is not None else next(it)
        loss = lax.psum(loss, AXES) / plan.n_devices
        return (jax.tree.unflatten(p_def, out_p), jax.tree.unflatten(s_def, out_s), loss, norm)

    return plan._shard_map(local, (plan.param_specs, opt_specs, P(AXES)), (plan.param_specs, opt_specs, P(), P()))
