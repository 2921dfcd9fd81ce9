"""The optimizer applied inside the backward pass, one unit at a time (`make_train_step(...,
update_in_backward=True)`).

The usual step holds every gradient shard until the backward pass ends and then updates: at its peak
a device keeps parameters, optimizer state and a whole gradient (four copies of the model's shard
with Adam). Here each unit's update runs as soon as its gradient shard is reduced, inside the
backward loop (`FSDP.stage_passes`, jfsdp/engine/pipeline.py: the stacked parameters and moments are the loop's carry,
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

from jfsdp.config.errors import ConfigError
from jfsdp.config.mesh import DATA_AXIS
from jfsdp.engine.layout import at_row, is_layout
from jfsdp.engine.parallel import vocab
from jfsdp.engine.barriers import tie
from jfsdp.engine.sharded import FSDP
from jfsdp.train.optim import Clipped, check_elementwise


def unsupported(sharded: FSDP, grad_accum: int) -> str | None:
    """Why `update_in_backward` cannot run this model (None: it can)."""
    if getattr(sharded, "as_is", False):
        return ("a model given as it is runs its units in its own loop, and the in-backward step needs them as "
                "stacked stages (jfsdp.Stacked / Staged)")
    if grad_accum != 1:
        return (f"it applies each unit's update as soon as its gradient is reduced, so it cannot accumulate "
                f"{grad_accum} micro-batches (use grad_accum=1)")
    if any(m is not None and m.mode in ("ep", "adaptive") for m in sharded.moe_stages):
        return "an expert-parallel MoE stage keeps its experts local (use jfsdp.MoE('gather'))"
    return None


class _Param:
    """An optimizer-state leaf that mirrors parameter leaf k."""
    def __init__(self, k):
        self.k = k


_OTHER = object()


def _empty(x):
    # a zero-size stand-in with the leaf's rank: the optimizer (and a mask that reads ranks) sees
    # the tree it knows, and the leaves that are not being updated cost nothing
    return jnp.zeros((0, *x.shape[1:]), x.dtype)


def _sq(tree):
    return sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(tree))


def _scaled(x, scale):
    return x if scale is None else x * scale.astype(x.dtype)


class _Optimizer:
    """The optimizer run on a few parameter leaves at a time: which state leaves mirror which parameter
    (`tags[m]` = k, or None for state such as step counts), and `update` on the leaves given."""

    def __init__(self, optimizer, abstract):
        self.optimizer = optimizer
        self.clip = optimizer.clip_norm if isinstance(optimizer, Clipped) else None
        self.elementwise = optimizer.inner if isinstance(optimizer, Clipped) else optimizer
        self.p_def = jax.tree.structure(abstract)
        marks = jax.tree.unflatten(self.p_def, [_Param(k) for k in range(self.p_def.num_leaves)])
        state0 = jax.eval_shape(optimizer.init, abstract)
        self.s_def = jax.tree.structure(state0)
        tags = jax.tree.leaves(optax.tree_map_params(optimizer, lambda _, m: m, state0,
                                                     marks, transform_non_params=lambda _: _OTHER),
                               is_leaf=lambda x: isinstance(x, _Param) or x is _OTHER)
        self.tags = [t.k if isinstance(t, _Param) else None for t in tags]
        check_elementwise(self.elementwise.update, abstract, state0[1] if self.clip is not None else state0, abstract)
        if len(self.tags) != self.s_def.num_leaves:
            raise ConfigError("update_in_backward could not tell which optimizer-state leaves mirror which parameter "
                              f"({len(self.tags)} tags for {self.s_def.num_leaves} leaves)")
        self.mirrors = {}   # param leaf k -> the state leaves m that mirror it
        for m, k in enumerate(self.tags):
            if k is not None:
                self.mirrors.setdefault(k, []).append(m)

    def update(self, p_leaves, s_leaves, pieces, grads, s_pieces):
        """Run the optimizer on the parameter leaves in `pieces` (k -> array) only: every other
        parameter, gradient and mirrored state leaf is a zero-size stand-in. -> (new params {k},
        new mirrored state {m}, new state leaves that mirror no parameter)."""
        tags = self.tags
        g = jax.tree.unflatten(self.p_def, [grads[k] if k in grads else _empty(x) for k, x in enumerate(p_leaves)])
        p = jax.tree.unflatten(self.p_def, [pieces[k] if k in pieces else _empty(x) for k, x in enumerate(p_leaves)])
        s = [s_pieces[m] if m in s_pieces else (_empty(x) if tags[m] is not None else x) for m, x in enumerate(s_leaves)]
        s = jax.tree.unflatten(self.s_def, s)
        if self.clip is not None:
            u, inner = self.elementwise.update(g, s[1], p)
            new_s = (s[0], inner)
        else:
            u, new_s = self.optimizer.update(g, s, p)
        u, new_s = jax.tree.leaves(u), jax.tree.leaves(new_s)
        new_p = {k: (pieces[k] + u[k]).astype(pieces[k].dtype) for k in pieces}
        return new_p, {m: new_s[m] for m in s_pieces}, [x for m, x in enumerate(new_s) if tags[m] is None]


class _InBackward:
    """The step's pieces, built once per `make_step`; `local` runs inside shard_map."""

    def __init__(self, sharded: FSDP, optimizer, loss_fn: Callable):
        self.sharded, self.loss_fn, self.on_cpu = sharded, loss_fn, sharded.on_cpu
        self.opt = _Optimizer(optimizer, sharded.abstract_params())
        root_k, stage_k = sharded.split(jax.tree.unflatten(self.opt.p_def, range(self.opt.p_def.num_leaves)))
        self.root_k, self.stage_k = jax.tree.leaves(root_k), [jax.tree.leaves(t) for t in stage_k]
        self.r_def = jax.tree.structure(sharded.split(sharded.layouts)[0], is_leaf=is_layout)
        self.passes = [sharded.stage_passes(j) for j in range(len(sharded.stage_sizes))]

    def forward(self, r_shards, stage_p, batch):
        """Forward and the head's backward: (loss, embedding's vjp, saved unit inputs, head's root
        gradient, dh into the last unit)."""
        sh = self.sharded
        embed_reads, head_reads = sh.root_use
        # the embedding (its vjp needs no weights), then each stage saving its units' inputs
        embed = lambda shards: vocab.embed(sh, sh.root_tree(shards, embed_reads), batch["inputs"])
        h, embed_vjp = jax.vjp(embed, r_shards)
        saved = []
        for passes, shards in zip(self.passes, stage_p):
            h, hs = passes.forward(h, shards, True)
            saved.append(hs)
        # the head's weights gathered once h exists (not hoisted to the start of the step)
        head_shards, h = tie(r_shards, h, self.on_cpu)
        head_loss = lambda shards, h: FSDP.scalar_loss(vocab.loss(sh, self.loss_fn,
                                                                  sh.head(sh.root_tree(shards, head_reads), h), batch))
        loss, head_vjp = jax.vjp(head_loss, head_shards, h)
        d_head, dh_top = head_vjp(jnp.ones((), jnp.float32))
        # the units' backward waits for the head's gradient to be reduced: otherwise XLA starts the
        # last unit's recomputation (which needs no dh) while the gathered head weight and its full
        # gradient are still live
        dh_top, d_head = tie(dh_top, d_head, self.on_cpu)
        return loss, embed_vjp, saved, d_head, dh_top

    def rows_update(self, leaves, pieces, grads, s_pieces, norm_sq):
        """One leaf's new parameter and state rows (of one unit), all computed before any is written back.
        Otherwise XLA fuses each write with the update math, duplicated: the fusion that writes the
        parameter row reads the old moments while the one that writes the moments runs in no set order
        with it, and to keep the old moments readable XLA copies every stacked leaf. On XLA:GPU an
        optimization barrier keeps the rows apart; XLA:CPU drops barriers before fusing, so there the
        update runs as a conditional's branch (a buffer boundary no fusion crosses) whose predicate,
        `not norm_sq < 0`, is always true (NaN included) but not a constant XLA could fold."""
        f = lambda a: self.opt.update(*leaves, *a)[:2]
        if self.on_cpu:
            return lax.cond(jnp.logical_not(norm_sq < 0), f, lambda a: (a[0], a[2]), (pieces, grads, s_pieces))
        return lax.optimization_barrier(f((pieces, grads, s_pieces)))

    def update_consumer(self, j, scale, leaves):
        """Stage j's consumer for the backward loop: apply the optimizer to unit i's rows, leaf by leaf."""
        keys, mirrors = self.stage_k[j], self.opt.mirrors

        def consume(acc, i, g):
            stacked, mirrored, total = acc
            g_leaves = jax.tree.leaves(g)
            norm_sq = _sq(g_leaves)
            total = total + norm_sq
            row = lambda x: lax.dynamic_slice_in_dim(x, i, 1, 0)
            put = lambda a, x: lax.dynamic_update_slice_in_dim(a, x, i, 0)
            stacked, mirrored = list(stacked), dict(mirrored)
            for n, (k, x) in enumerate(zip(keys, g_leaves)):
                # Leaf by leaf, and each leaf's reads after every write before them (one element of
                # each stacked buffer as it now is): one leaf's rows in flight (XLA:CPU read every
                # leaf's rows first), and no read of a buffer that XLA could schedule after an in-place
                # write to it (unit 0's rows, read after unit 1's update outside the loop, made XLA:CPU
                # copy every stacked leaf).
                grads = {k: _scaled(x, scale)[None]}
                pieces = ({k: row(stacked[n])}, {m: row(mirrored[m]) for m in mirrors.get(k, [])})
                marks = [a.reshape(-1)[:1] for a in [*stacked, *mirrored.values()]]
                pieces, _ = tie(pieces, marks, self.on_cpu)
                new_p, new_s = self.rows_update(leaves, pieces[0], grads, pieces[1], norm_sq)
                stacked[n] = put(stacked[n], new_p[k])
                for m, v in new_s.items():
                    mirrored[m] = put(mirrored[m], v)
            return stacked, mirrored, total
        return consume

    def run_updates(self, saved, dh, scale, leaves, stage_p):
        """The units' backward, each unit updated as its gradient is reduced -> (dh into the stages,
        per stage (stacked params, mirrored state, squared norm))."""
        p_leaves, s_leaves = leaves
        new = [None] * len(self.passes)
        for j in reversed(range(len(self.passes))):
            keys = self.stage_k[j]
            acc = ([p_leaves[k] for k in keys], {m: s_leaves[m] for k in keys for m in self.opt.mirrors.get(k, [])},
                   jnp.zeros((), jnp.float32))
            tree_def = jax.tree.structure(stage_p[j])
            read = lambda acc, i, tree_def=tree_def: jax.tree.unflatten(tree_def, at_row(acc[0], i))
            dh, new[j] = self.passes[j].backward(saved[j], dh, acc, read, self.update_consumer(j, scale, leaves))
        return dh, new

    def norm_pass(self, saved, dh, stage_p):
        """The units' backward for the gradient norm alone (clipped optimizer): nothing is kept."""
        total = jnp.zeros((), jnp.float32)
        consume = lambda acc, i, g: (acc[0], acc[1] + _sq(g))
        for j in reversed(range(len(self.passes))):
            dh, acc = self.passes[j].backward(saved[j], dh, (stage_p[j], total), lambda acc, i: at_row(acc[0], i),
                                              consume)
            total = acc[1]
        return dh, total

    def root_update(self, d_root, scale, leaves):
        p_leaves, s_leaves = leaves
        grads = {k: _scaled(x, scale) for k, x in zip(self.root_k, d_root)}   # d_root: root shards, as r_def lists
        pieces = {k: p_leaves[k] for k in self.root_k}
        s_pieces = {m: s_leaves[m] for k in self.root_k for m in self.opt.mirrors.get(k, [])}
        return self.opt.update(p_leaves, s_leaves, pieces, grads, s_pieces)

    def embed_backward(self, embed_vjp, dh, loss, r_shards):
        """The embedding's gradient, as a conditional's branch (predicate always true, as in
        `rows_update`). A lookup's gradient is a scatter-add into zeros of the table's size, and the
        fused loss's head gradient starts from the same zeros: XLA merged the two (CSE), so a
        table-sized buffer of zeros lived from the head's backward to the step's end. A branch is its
        own computation, which CSE does not reach into."""
        if self.sharded.shards == 1:   # nothing gathered: no second table of zeros (and the branch's copy costs)
            return embed_vjp(dh)[0]
        witness = jnp.square(loss)   # >= 0 or NaN: `not witness < 0` holds
        return lax.cond(jnp.logical_not(witness < 0), lambda d: embed_vjp(d)[0],
                        lambda d: jax.tree.map(jnp.zeros_like, r_shards), dh)

    def local(self, params, opt_state, batch):
        sh, opt = self.sharded, self.opt
        leaves = (opt.p_def.flatten_up_to(params), opt.s_def.flatten_up_to(opt_state))
        root_p, stage_p = sh.split(params)
        r_shards = self.r_def.flatten_up_to(root_p)
        loss, embed_vjp, saved, d_head, dh_top = self.forward(r_shards, stage_p, batch)
        # every leaf's shards are disjoint over the mesh's axes but `data` (fsdp; with T > 1 tensor too: a TP
        # leaf's slices, the others' rows), replicated over `data`
        model_axes = tuple(a for a in sh.loss_axes if a != DATA_AXIS)
        reduce_norm = (lambda x: lax.psum(x, model_axes)) if sh.strategy.sharded else (lambda x: x)
        add = lambda a, b: jax.tree.map(jnp.add, a, b)
        if opt.clip is not None:
            dh, total = self.norm_pass(saved, dh_top, stage_p)
            d_root = add(d_head, self.embed_backward(embed_vjp, dh, loss, r_shards))
            norm = jnp.sqrt(reduce_norm(total + _sq(d_root)))
            scale = jnp.where(norm < opt.clip, 1.0, opt.clip / norm)
            root_new = self.root_update(d_root, scale, leaves)
            _, new = self.run_updates(saved, dh_top, scale, leaves, stage_p)
        else:
            dh, new = self.run_updates(saved, dh_top, None, leaves, stage_p)
            total = jnp.zeros((), jnp.float32)
            for acc in reversed(new):
                total = total + acc[2]
            d_root = add(d_head, self.embed_backward(embed_vjp, dh, loss, r_shards))
            norm = jnp.sqrt(reduce_norm(total + _sq(d_root)))
            root_new = self.root_update(d_root, None, leaves)
        params, opt_state = self.assemble(leaves, root_new, new)
        return params, opt_state, lax.psum(loss, sh.loss_axes) / sh.n_devices, norm

    def assemble(self, leaves, root_new, new):
        """The new parameter and optimizer-state trees from the root's and the stages' updated leaves."""
        root_p_new, root_s_new, others = root_new
        out_p, out_s = list(leaves[0]), list(leaves[1])
        for k, x in root_p_new.items():
            out_p[k] = x
        s_updates = dict(root_s_new)
        for j, (stacked, mirrored, _) in enumerate(new):
            for n, k in enumerate(self.stage_k[j]):
                out_p[k] = stacked[n]
            s_updates.update(mirrored)
        it = iter(others)
        for m in range(len(out_s)):
            out_s[m] = s_updates[m] if self.opt.tags[m] is not None else next(it)
        return jax.tree.unflatten(self.opt.p_def, out_p), jax.tree.unflatten(self.opt.s_def, out_s)


def make_step(sharded: FSDP, optimizer: optax.GradientTransformation, loss_fn: Callable, opt_specs) -> Callable:
    """(params, opt_state, batch) -> (params, opt_state, loss, grad_norm), to be jitted: forward,
    head backward, then the units' backward with each unit's update in the loop, then the root's."""
    step = _InBackward(sharded, optimizer, loss_fn)
    return sharded.shard_map(step.local, (sharded.param_specs, opt_specs, sharded.batch_spec),
                             (sharded.param_specs, opt_specs, P(), P()))
