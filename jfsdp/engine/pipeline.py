"""The prefetch pipeline: a stage of units as an explicit software pipeline with its own VJP.

`fully_shard(prefetch=...)` (every remat policy and sharded strategy; the default on GPUs) replaces the
plain scan of fsdp.py with this: unit i+1's all-gather in flight while unit i computes, unit i's
reduce-scatter while unit i-1's backward computes; two gathered units at most. What the forward pass
saves for the backward is what the checkpoint policy saves (the residuals of each unit's VJP), the
gathered parameters only where the strategy keeps them (ZeRO-2). The backward loop hands each unit's
reduced gradient shard to a consumer, which is how the optimizer-in-backward step
(jfsdp/train/update_in_backward.py) and gradient accumulation with one reduction (accumulate.py) plug in.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax import lax

from jfsdp.engine import step_end
from jfsdp.engine.barriers import tie
from jfsdp.engine.float8 import KERNELS, unit_amaxes
from jfsdp.engine.fsdp import Comm, Unreduced, any_unreduced, is_unreduced, reduce_tree, unshard_tree
from jfsdp.engine.layout import at_row, is_layout


def _with(x, extra):
    return x if extra is None else (x, extra)


@dataclasses.dataclass(frozen=True)
class Saved:
    """What a stage's forward pass keeps for its backward: each unit's VJP residuals (what the checkpoint
    policy saves, the unit's input included), less the gathered parameters where the backward gathers
    them again. `stacked`: units 0..len-1 stacked on axis 0; `last`: unit n-1's, apart, when the
    forward loop peeled it. `how`/`how_last` rebuild a VJP from them: (its tree structure, for each of
    its leaves -1 where stored, else the index of the gathered parameter leaf it is). `amax`: the float8
    leaves' amaxes of every unit (float8.unit_amaxes), for the backward's gathers; None without float8."""
    stacked: Any
    last: Any
    how: Any
    how_last: Any
    amax: Any = None

    def pullback(self, i, g):
        """Unit i's VJP (a function of its output's cotangent), with `g` its gathered parameters (None
        where they were saved)."""
        peeled = self.last is not None and isinstance(i, int) and i == self.n_stacked
        stored, (tdef, src) = (self.last, self.how_last) if peeled else (at_row(self.stacked, i), self.how)
        it, gathered = iter(stored), jax.tree.leaves(g)
        return jax.tree.unflatten(tdef, [next(it) if s < 0 else gathered[s] for s in src])

    @property
    def n_stacked(self) -> int:
        return jax.tree.leaves(self.stacked)[0].shape[0] if jax.tree.leaves(self.stacked) else 0


jax.tree_util.register_dataclass(Saved, data_fields=["stacked", "last", "amax"], meta_fields=["how", "how_last"])


@dataclasses.dataclass(frozen=True)
class StagePasses:
    """One stage's forward and backward passes as an explicit software pipeline:
    `forward(h, shards, keep[, extra]) -> (h or (h, extra), Saved or None)` and
    `backward(saved, dh, acc, read, consume[, dextra, lead]) -> (dh or (dh, dextra) into the stage, acc)`;
    `lead`, where given, maps unit 0's dh to what the backward returns as dh (the embedding's reduced
    gradient, when the stage runs the embedding: `pipelined_stage`).
    `extra`: what the caller gathers next (the head's shards), tied to the last unit's gathered
    parameters so that its gather is in flight while the last unit computes; `dextra`, its reduced
    gradient, is waited for after the last unit's backward, which hides its reduce-scatter (and keeps
    it from being combined with unit 0's at the end of the step).

    Forward: unit i+1's all-gather is issued before unit i computes and carried into the next
    iteration, so it is in flight during unit i's compute; only unit 0's gather waits. At most two
    gathered units live (this one and the prefetched one). Each unit runs under `jax.vjp` of the unit
    checkpointed with `policy`; its residuals are saved, except the gathered parameters when the backward
    gathers them again (`keep_gathered` False: ZeRO-3; remat 'full' then saves only the unit's input).
    Backward, in reverse: unit i-1's gather is issued before unit i's VJP runs (ZeRO-2 has none to
    issue); unit i's gradient is carried (unreduced, param_dtype) and reduce-scattered in the next
    iteration, while unit i-1's backward computes. Only unit n-1's gather and unit 0's reduce-scatter
    have nothing to hide behind (in the last stage unit n-1's gathered parameters are saved by the
    forward instead; in the first stage unit 0's reduce-scatter runs in parts, most of it under unit 0's
    own backward: step_end.py). The first and last units run outside the loop (peeled) so that nothing
    is gathered or reduced twice. With `prefetch` False the same passes run one unit per iteration
    with nothing in flight (the plain scan's schedule), for the consumers below.

    What happens to each reduced gradient shard is the caller's: the backward loop carries `acc`, reads
    unit i's shards with `read(acc, i)` (so that a caller may carry the parameters and update them in
    place) and hands unit i's gradient shard to `consume(acc, i, shard) -> acc` (stack it as the
    gradient; or apply the optimizer to unit i then and there; or add it to a running sum), in the order
    n-1, ..., 0."""
    apply: Callable      # (unit params, h) -> h
    layouts: Any         # the unit's Layout tree
    comm: Comm
    n: int               # units in the stage
    first_stage: bool
    on_cpu: bool
    unreduced: bool = False       # hand each unit's whole gradient (reduce dtype) to the consumer, unreduced
    policy: Any = None            # what the unit's backward reuses (fsdp.checkpoint_policy); None: its input only
    keep_gathered: bool = False   # ZeRO-2: the gathered units are saved, the backward gathers nothing
    prefetch: bool = True
    last_stage: bool = False      # its last unit's backward comes right after the head's: its gathered
    # parameters are saved by the forward, not gathered again (no gather exposed at the backward's start)

    def gather(self, shards, amax=None):
        return unshard_tree(shards, self.layouts, self.comm, amax)

    def reduce(self, grads):
        if self.unreduced:   # whole, in the reduce dtype (a float8 kernel's gradient comes boxed: its data)
            whole = lambda g: g.data if isinstance(g, KERNELS) else g
            return jax.tree.map(lambda l, g: whole(g).astype(self.comm.reduce_dtype or whole(g).dtype), self.layouts,
                                grads, is_leaf=is_layout)
        return reduce_tree(grads, self.layouts, self.comm)

    def unit(self, g, h, keep_params=False):
        """Unit forward, keeping its VJP: (output, the residuals to save, how to rebuild the VJP); the
        gathered parameters among the residuals where the strategy keeps them or `keep_params`."""
        policy = self.policy or jax.checkpoint_policies.nothing_saveable
        out, vjp = jax.vjp(jax.checkpoint(self.apply, policy=policy), g, h)
        leaves, tdef = jax.tree.flatten(vjp)
        params = [] if self.keep_gathered or keep_params else jax.tree.leaves(g)
        src = tuple(next((k for k, p in enumerate(params) if p is x), -1) for x in leaves)
        return out, [x for x, s in zip(leaves, src) if s < 0], (tdef, src)

    def forward(self, h, shards, keep: bool, extra=None):
        # every float8 leaf's amax, all units at once: one all-reduce per pass, none inside the loop
        amax = unit_amaxes(shards, self.layouts)
        unit_shards = lambda i: (at_row(shards, i), at_row(amax, i))   # (a None amax stays None)
        first = unit_shards(0)
        if not self.first_stage:
            # a later stage's unit 0 is gathered when its input is ready, not hoisted to the top of
            # the step (where XLA would combine it with the root's and keep it through the earlier
            # stages). The first stage's goes with the root's: nothing runs before them, and tied to h
            # it was combined with the head's gather instead, exposing that.
            first, h = tie(first, h, self.on_cpu)
        run = self.unit if keep else lambda g, h: (self.apply(g, h), [], None)
        hows = []

        def step(g, h):
            out, stored, how = run(g, h)
            hows.append(how)
            return out, stored
        if not self.prefetch:
            h, stacked = lax.scan(lambda h, i: step(self.gather(*unit_shards(i)), h), h, jnp.arange(self.n))
            return _with(h, extra), (Saved(stacked, None, hows[-1], None, amax) if keep else None)
        if self.n == 1:
            h, last = step(self.gather(*first), h)
            return _with(h, extra), (Saved([], last, None, hows[-1], amax) if keep else None)

        def body(carry, i):
            h, g = carry
            nxt = self.gather(*unit_shards(i + 1))  # prefetch: in flight while unit i computes
            out, stored = step(g, h)
            return (out, nxt), stored
        (h, g), stacked = lax.scan(body, (h, self.gather(*first)), jnp.arange(self.n - 1))
        if extra:   # the caller's next gather (the head's) in flight while the last unit computes
            extra, g = tie(extra, g, self.on_cpu)
        if keep and self.last_stage:   # the last unit's gathered parameters saved for its backward
            run = lambda g, h: self.unit(g, h, keep_params=True)
        h, last = step(g, h)
        return _with(h, extra), (Saved(stacked, last, hows[0], hows[-1], amax) if keep else None)

    def regather(self, acc, read, i, amax):
        if self.keep_gathered:
            return None
        return self.gather(read(acc, i), at_row(amax, i))

    def backward(self, saved: Saved, dh, acc, read, consume, dextra=None, lead=None):
        n, on_cpu = self.n, self.on_cpu
        if not self.prefetch:
            def plain(carry, i):
                dh, acc = carry
                dg, dh = saved.pullback(i, self.regather(acc, read, i, saved.amax))(dh)
                return (dh, consume(acc, i, self.reduce(dg))), None
            dh, acc = lax.scan(plain, (dh, acc), jnp.arange(n - 1, -1, -1))[0]
            return _with(dh, dextra), acc
        # The barriers order what XLA would otherwise combine into one collective at the top of the
        # step: unit n-1's gather waits for dh (not hoisted into the forward pass), unit n-2's for
        # unit n-1's (so it is in flight during unit n-1's backward, not before it); in the last stage,
        # which saved unit n-1's gathered parameters, unit n-2's waits for dh.
        g, kept = None, self.last_stage and n > 1   # kept: unit n-1's gathered parameters saved (forward)
        if not self.keep_gathered and not kept:
            last, dh = tie(read(acc, n - 1), dh, on_cpu)
            g = self.gather(last, at_row(saved.amax, n - 1))
        if n == 1:
            dg, dh = saved.pullback(0, g)(dh)
            if lead is not None:   # the lead's reduce-scatter, then the unit's (as below)
                dg, dh = lax.optimization_barrier((dg, lead(dh)))
            return _with(dh, dextra), consume(acc, 0, self.reduce(dg))
        nxt = None
        if not self.keep_gathered and kept:
            prev, dh = tie(read(acc, n - 2), dh, on_cpu)
            nxt = self.gather(prev, at_row(saved.amax, n - 2))
        elif not self.keep_gathered:
            prev, g = tie(read(acc, n - 2), g, on_cpu)
            nxt = self.gather(prev, at_row(saved.amax, n - 2))
        pend, dh = saved.pullback(n - 1, g)(dh)
        if dextra:   # the caller's reduce-scatter (the head's) finished during the last unit's backward
            pend, dextra = tie(pend, dextra, on_cpu)

        def body(carry, i):  # units n-2 .. 1
            dh, g, pend, acc = carry
            acc = consume(acc, i + 1, self.reduce(pend))  # unit i+1's reduce-scatter, during unit i's backward
            nxt = self.regather(acc, read, i - 1, saved.amax)  # prefetch, during unit i's backward
            dg, dh = saved.pullback(i, g)(dh)
            return (dh, nxt, dg, acc), None
        (dh, g, pend, acc), _ = lax.scan(body, (dh, nxt, pend, acc), jnp.arange(n - 2, 0, -1))
        one = self.reduce(pend)  # unit 1's reduce-scatter, during unit 0's backward ...
        # unit 0's residuals read at an index computed from the loop's dh (0, never folded: XLA keeps 0 * x for
        # floats), not at a constant 0: XLA copied a constant-index row out of the stacked residuals before
        # the loop (the stack passes through it), and the copy lived through it: one unit input, 1.5 GiB of
        # llama-8b at 196,608 tokens per device (docs/context-parallel.md)
        zero = (0 * jax.tree.leaves(dh)[0].reshape(-1)[0]).astype(jnp.int32)
        dg, dh = saved.pullback(zero, g)(dh)
        if self.first_stage and not self.unreduced:   # the step's last reduce-scatter, in parts, the lead's between
            dh, reduced, one = step_end.finish(self, g, dg, dh, one, lead)
            return _with(dh, dextra), consume(consume(acc, 1, one), 0, reduced)
        dg, one = lax.optimization_barrier((dg, one))  # ... finished before unit 0's, not combined with it
        return _with(dh, dextra), consume(consume(acc, 1, one), 0, self.reduce(dg))


def _unreduced_bwd(passes: StagePasses, hs, dh, shards):
    """The stage's backward for grad_sync='once' (jfsdp/engine/accumulate.py): each unit's whole gradient
    is added in place to the sum its slot carries, and the slot's cotangent is the new sum (slot +
    gradient): one unsharded gradient held, not the sum and a stacked micro-batch gradient beside it.
    A frozen leaf (a plain shard) gets zeros."""
    def add(acc, i, whole):
        shards, sums = acc
        step = lambda u, a, x: (lax.dynamic_update_index_in_dim(a, lax.dynamic_index_in_dim(a, i, keepdims=False) + x,
                                                                i, 0) if is_unreduced(u) else a)
        return shards, jax.tree.map(step, shards, sums, whole, is_leaf=is_unreduced)

    sums = jax.tree.map(lambda u: u.slot if is_unreduced(u) else jnp.zeros((0,)), shards, is_leaf=is_unreduced)
    read = lambda acc, i: at_row(acc[0], i)
    dh, (_, sums) = dataclasses.replace(passes, unreduced=True).backward(hs, dh, (shards, sums), read, add)
    grads = jax.tree.map(lambda u, a: Unreduced(jnp.zeros_like(u.shard), a) if is_unreduced(u) else jnp.zeros_like(u),
                         shards, sums, is_leaf=is_unreduced)
    return dh, grads


def pipelined_stage(passes: StagePasses, lead: Callable | None = None):
    """(h, stacked shards, extra, lead params) -> (h, extra) with its own VJP: `passes.forward`, then
    `passes.backward` whose consumer stacks each unit's reduced gradient shard into the stage's gradient.
    `extra` (a list of arrays, maybe empty) comes out unchanged, tied to the last unit: the caller's gather
    of it runs while that unit computes, and the reduce-scatter of its gradient while that unit's backward
    does. `lead(lead params, x) -> h`: what computes the stage's input (the embedding, its gather
    included), run inside the stage on its input x (not differentiated), so that its backward, reduce-scatter
    included, runs as soon as unit 0's dh exists, under unit 0's weight gradients (None: the input is h)."""
    def read(acc, i):
        return at_row(acc[0], i)

    def put(acc, i, shard):
        shards, grads = acc
        return shards, jax.tree.map(lambda a, x: lax.dynamic_update_index_in_dim(a, x, i, 0), grads, shard)

    @jax.custom_vjp
    def stage(h, shards, extra, lead_p):
        return passes.forward(h if lead is None else lead(lead_p, h), shards, False, extra)[0]

    def stage_fwd(h, shards, extra, lead_p):
        lead_vjp = None
        if lead is not None:
            h, lead_vjp = jax.vjp(lambda p: lead(p, h), lead_p)
        out, hs = passes.forward(h, shards, True, extra)
        return out, (hs, shards, lead_vjp)

    def stage_bwd(res, dout):
        hs, shards, lead_vjp = res
        dh, dextra = dout
        if any_unreduced(shards):
            assert lead is None, "grad_sync='once' takes no lead"
            return (*_unreduced_bwd(passes, hs, dh, shards), dextra, None)
        (dh, dextra), (_, grads) = passes.backward(hs, dh, (shards, jax.tree.map(jnp.zeros_like, shards)), read, put,
                                                   dextra, None if lead is None else (lambda dh: lead_vjp(dh)[0]))
        return (None, grads, dextra, dh) if lead is not None else (dh, grads, dextra, None)
    stage.defvjp(stage_fwd, stage_bwd)
    return stage
