"""Prefetch in call order, for a model given as it is: unit i+1 gathered while unit i computes, unit i-1
re-gathered while unit i's backward computes, unit i's reduce-scatter during unit i-1's backward.

The model's own Python loop calls its units one by one (as_is/model.py intercepts each call), so there is no
loop to pipeline as pipeline.py does for `Stacked`. Instead each unit call is one custom VJP that hands
values to its neighbours through extra arguments and outputs; the order is the one the model called
its units in when fully_shard traced it (`AsIs.units`), checked at every trace:

- forward: call k takes unit k's gathered parameters from call k-1 (the first gathers its own), and
  gathers unit k+1's shards, tied to unit k's gathered parameters so that the gather is issued when
  unit k starts and is neither hoisted to the top of the step nor combined with another; it returns
  them to call k+1. Two gathered units alive at most.
- backward: call k+1's backward returns unit k's re-gathered parameters as the cotangent of a `slot`,
  an output of call k that is zeros in the forward pass (never materialized: nothing reads it) and a
  carrier of data in the backward. So unit k-1's gather is issued when unit k's backward starts. The
  last unit's gathered parameters are saved by its forward (its backward comes right after the head's:
  a re-gather there would have nothing to hide behind), as `Stacked`'s last stage does. The
  gradient of unit k+1's gathered parameters (the cotangent of what call k handed on) is
  reduce-scattered inside call k's backward, in flight while unit k's backward computes, and unit k's
  own gradient waits for it, which keeps XLA from deferring or combining the reduce-scatters. What
  unit k's backward recomputes waits for unit k+1's weight gradients too (its re-gathered parameters
  are tied to them), so that XLA does not recompute several units ahead of their weight gradients.
- the root's leaves that the model reads after its last unit (`late`: an untied head, the final norm;
  as_is/late_root.py) are tied to the last call's inputs and gathered there, in flight while the last
  unit computes, and bound into the model's parameters when it returns. The transpose of that tie (a
  barrier on the cotangents, on GPUs) holds the gradients leaving the last unit's backward until the
  head's reduce-scatter is done: issued when the head's backward ends, it is in flight during the last
  unit's backward, not combined with the embedding's and unit 0's at the end of the step. As
  `Stacked`'s pipeline does with `extra`/`dextra` (pipeline.py).
- the step's last reduce-scatter, the first unit's, in parts (`CallOrder._end`, as step_end.py on the
  pipeline): its last-called submodule's (a Llama block's feed-forward) after unit 1's, under the rest of
  its backward; then the root leaves that only the units' inputs read (`lead`: an untied embedding;
  as_is/late_root.root_uses), whose backward waits for those and whose reduce-scatter runs under the
  first unit's remaining weight gradients: the rest of the first unit's gradient leaves its call
  unreduced, as the cotangent of zeros that `_lead` links to the embedding's shards, and is
  reduce-scattered after the embedding's; last (or, without a lead, after the feed-forward's) the rest's,
  the one exposed. Each waits for the one before: XLA would combine them at the end of the step.

The ties are optimization barriers on GPUs and 0 * x data dependencies on CPU (pipeline.py's `tie`).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax.core.tracers import current_trace
from jax import lax

from jfsdp.config.errors import ConfigError
from jfsdp.config.policy import resolve_prefetch
from jfsdp.engine.fsdp import reduce_tree, unshard_tree
from jfsdp.engine.layout import is_layout
from jfsdp.engine.model_tree import path_text
from jfsdp.engine.unit_call import tie as add_zero


def _anchor(tree):
    """One element of the largest float leaf (None if none): a handle on the moment it exists. One leaf,
    not all, and a matrix: a leaf the unit's backward does not read (a block's last bias) is then not
    gathered for it."""
    leaves = [x for x in jax.tree.leaves(tree) if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating) and x.size]
    return max(leaves, key=lambda x: x.size).reshape(-1)[0].astype(jnp.float32) if leaves else None


def ordered(a, b, on_cpu: bool):
    """(a, b) with nothing computed from the returned `a` starting before `b` exists."""
    if not on_cpu:
        return lax.optimization_barrier((a, b))
    return add_zero(a, _anchor(b)), b


class CallOrder:
    """One forward trace's unit calls in the recorded order: `call(path, fn, inputs)` runs unit `path`
    (`fn(gathered params, inputs) -> outputs`) as the next unit of `order`."""

    def __init__(self, order, shards, layouts, comm, policy, on_cpu: bool, keep_gathered: bool, late=None, ahead=()):
        self.top = current_trace()   # every unit call must be made in it: gathered parameters cross calls
        self.order, self.shards, self.layouts = tuple(order), shards, layouts
        self.comm, self.policy, self.on_cpu, self.keep = comm, policy, on_cpu, keep_gathered
        self.k, self.pre, self.slot = 0, None, None
        self.late, self.late_gathered = late, None   # (shards, gather) of the root read after the last unit
        self.ahead, self.sink = tuple(ahead), None   # the first unit's leaves reduced first; `lead`'s zeros

    def lead(self, xs):
        """`xs` (the shards of the root leaves that only the units' inputs read: an untied embedding), to be
        gathered by the caller, linked to the first unit's leaves outside `ahead`: the first call's backward
        hands their gradients out unreduced (the cotangent of `self.sink`) and they are reduce-scattered
        once the gradient of `xs` is (`_lead`), so the lead's reduce-scatter runs under the rest of the
        first unit's weight gradients instead of combined with its own at the end of the step."""
        u = self.order[0]
        leaves, lays = jax.tree.leaves(self.shards[u]), jax.tree.leaves(self.layouts[u], is_leaf=is_layout)
        rest = [i for i in range(len(leaves)) if i not in self.ahead]
        xs, self.sink = _lead([leaves[i] for i in rest], xs, [lays[i] for i in rest], self.comm, self.on_cpu)
        return xs

    def call(self, path, fn, inputs):
        n, k = len(self.order), self.k
        if path is None or current_trace() != self.top:
            raise ConfigError(f"prefetch in call order: unit {path_text(path) if path else '(in an NNX transform)'} "
                              "was called inside a transform of the model's own (lax.cond, jax.checkpoint, ...), which "
                              "the gathered parameters handed between unit calls cannot cross; pass prefetch=False")
        if k >= n or tuple(path) != tuple(self.order[k]):
            want = path_text(self.order[k]) if k < n else "none (all were called)"
            raise ConfigError(f"prefetch in call order: the model called unit {path_text(path)} where the order recorded "
                              f"when fully_shard traced it has {want}: a model that calls its units in an order that "
                              "depends on its data, or skips one, cannot prefetch; pass prefetch=False")
        first, last = k == 0, k == n - 1
        nxt = None if last else self.shards[self.order[k + 1]]
        prev = None if first or self.keep else self.shards[self.order[k - 1]]
        own = self.shards[self.order[k]] if first else None
        run = self._run(fn, k)
        pre = self.pre
        if last and self.late:   # the head's gather issued when the last unit starts (its transpose: the head's
            # reduce-scatter finished before the gradients of the last unit go on to unit n-2's backward)
            late, (pre, inputs) = ordered(self.late[0], (pre, inputs), self.on_cpu)
            self.late_gathered = self.late[1](late)
        out, self.pre, self.slot = run(own, pre, nxt, prev, None if self.keep else self.slot,
                                       self.sink if first else None, inputs)
        self.k += 1
        return out

    def _run(self, fn, k):
        n, L, comm, on_cpu, keep = len(self.order), self.layouts, self.comm, self.on_cpu, self.keep
        lay = lambda j: L[self.order[j]]
        first, last = k == 0, k == n - 1
        body = jax.checkpoint(fn, policy=self.policy or jax.checkpoint_policies.nothing_saveable, prevent_cse=True)
        how, lead = {}, first and self.sink is not None

        def gathered(own, pre, nxt, inputs):
            if first:   # tied to its inputs: not hoisted out of a micro-batch loop (held through it)
                own, inputs = ordered(own, inputs, on_cpu)
            g = unshard_tree(own, lay(k), comm) if first else pre
            if last:
                return g, inputs, None
            # unit k+1's gather issued when unit k starts (its parameters and inputs exist): tied to the
            # parameters alone, every gather of the forward pass was issued at once at the top of the step
            nxt, (g, inputs) = ordered(nxt, (g, inputs), on_cpu)
            return g, inputs, unshard_tree(nxt, lay(k + 1), comm)

        def slot(g):
            return None if keep or last else jax.tree.map(jnp.zeros_like, g)

        @jax.custom_vjp
        def run(own, pre, nxt, prev, prev_slot, sink, inputs):
            g, inputs, ahead = gathered(own, pre, nxt, inputs)
            return body(g, inputs), ahead, slot(g)

        def run_fwd(own, pre, nxt, prev, prev_slot, sink, inputs):
            g, inputs, ahead = gathered(own, pre, nxt, inputs)
            out, vjp = jax.vjp(body, g, inputs)
            leaves, how["tdef"] = jax.tree.flatten(vjp)
            params = [] if keep or last else jax.tree.leaves(g)   # the last unit's saved: its backward comes next
            how["src"] = tuple(next((i for i, p in enumerate(params) if p is x), -1) for x in leaves)
            stored = [x for x, s in zip(leaves, how["src"]) if s < 0]
            return (out, ahead, slot(g)), (stored, own, prev)

        def run_bwd(res, cts):
            stored, own, prev = res
            dout, dahead, dslot = cts
            g = None if keep or last else dslot   # call k+1's backward re-gathered it; the last unit's were saved
            dprev = None
            if not first and not keep:   # unit k-1's re-gather, in flight during this unit's backward
                prev, (g, dout) = ordered(prev, (g, dout), on_cpu)   # (when this backward starts)
                dprev = unshard_tree(prev, lay(k - 1), comm)
            if not last:   # what this unit recomputes waits for unit k+1's weight gradients: else XLA:GPU ran
                # the input-gradient chain of several units first and kept each one's recomputed activations
                # for the weight gradients it deferred (docs/any-model.md)
                g, dahead = ordered(g, dahead, on_cpu)
            rs = None if last else reduce_tree(dahead, lay(k + 1), comm)   # unit k+1's, during this backward
            it, gl = iter(stored), jax.tree.leaves(g)
            vjp = jax.tree.unflatten(how["tdef"], [next(it) if s < 0 else gl[s] for s in how["src"]])
            dg, dinputs = vjp(dout)
            d_own = d_sink = None
            if first:   # the step's last reduce-scatters
                d_own, dinputs, rs, d_sink = self._end(own, dg, dinputs, rs, lead)
            elif rs is not None:   # finished before unit k-1's backward takes unit k's gradient
                dg, rs = ordered(dg, rs, on_cpu)
            d_pre = None if first else dg
            d_prev = None if prev is None else jax.tree.map(jnp.zeros_like, prev)
            return d_own, d_pre, rs, d_prev, dprev, d_sink, dinputs

        run.defvjp(run_fwd, run_bwd)
        return run

    def _end(self, own, dg, dinputs, rs, lead):
        """The first unit's gradient reduced in parts, as step_end.py does on `Stacked`'s pipeline: its
        last-called submodule's (`ahead`) after unit 1's reduce-scatter (`rs`), under the rest of its
        backward; then, where there is a lead (`lead`), the lead's backward and reduce-scatter (`dinputs`
        held until those are done) and the rest's after it, outside (`_lead`: returned unreduced, d_sink);
        else the rest's after those. Each after the one before: XLA would combine them at the end.
        (d_own, dinputs, rs, d_sink)"""
        tdef, on_cpu, comm = jax.tree.structure(self.layouts[self.order[0]], is_leaf=is_layout), self.on_cpu, self.comm
        lays, grads, shards = (tdef.flatten_up_to(t) for t in (self.layouts[self.order[0]], dg, own))
        rest = [i for i in range(len(grads)) if i not in self.ahead]
        done = {}
        if self.ahead:
            part, rs = ordered([grads[i] for i in self.ahead], rs, on_cpu)
            done = dict(zip(self.ahead, reduce_tree(part, [lays[i] for i in self.ahead], comm)))
        held, part = (rs, [done[i] for i in self.ahead]), [grads[i] for i in rest]
        if lead:
            floats = [i for i, x in enumerate(jax.tree.leaves(dinputs)) if jnp.issubdtype(x.dtype, jnp.floating)]
            got, (rs, red) = ordered([jax.tree.leaves(dinputs)[i] for i in floats], held, on_cpu)
            dinputs = jax.tree.unflatten(jax.tree.structure(dinputs), [
                got[floats.index(i)] if i in floats else x for i, x in enumerate(jax.tree.leaves(dinputs))])
            done = dict(zip(self.ahead, red)) | {i: jnp.zeros_like(shards[i]) for i in rest}
            return jax.tree.unflatten(tdef, [done[i] for i in range(len(grads))]), dinputs, rs, part
        part, (rs, red) = ordered(part, held, on_cpu)   # (the barrier's outputs used: XLA drops an unused one's operand)
        done = dict(zip(self.ahead, red)) | dict(zip(rest, reduce_tree(part, [lays[i] for i in rest], comm)))
        return jax.tree.unflatten(tdef, [done[i] for i in range(len(grads))]), dinputs, rs, None


def _lead(rest, xs, lays, comm, on_cpu: bool):
    """(xs, zeros shaped as the gathered `rest`): values unchanged; in the backward the zeros' cotangent (the
    first unit's gradient of those leaves, unreduced) is reduce-scattered into `rest`'s once the gradient
    of `xs` (reduced: the caller's gather's transpose) exists."""
    zeros = lambda: [jnp.zeros(l.full_shape, comm.param_dtype or l.dtype) for l in lays]

    @jax.custom_vjp
    def link(rest, xs):
        return xs, zeros()

    def bwd(_, cts):
        dxs, dsink = cts
        dsink, dxs = ordered(dsink, dxs, on_cpu)
        return reduce_tree(dsink, lays, comm), dxs
    link.defvjp(lambda rest, xs: (link(rest, xs), None), bwd)
    return link(rest, xs)


def resolve(plan, prefetch) -> bool:
    """`fully_shard(prefetch=...)` for a model given as it is: as for `Stacked` (config/policy.py), where
    its units run from its own Python loop; a ConfigError for prefetch=True where they cannot."""
    mixed = plan.scanned and set(plan.units) - set(plan.scanned)   # (own scans alone: as_is/own_scan.py)
    why = ("units run both inside the model's own scan and from its own Python loop" if mixed else
           f"unit {path_text(plan.nested[0])} called inside a transform of the model's own (nn.remat, lax.cond, ...: "
           "fully_shard's remat= replaces nn.remat)" if plan.nested else
           "float8 units" if plan.mp.float8 is not None and not plan.scanned else
           "a tensor axis (T > 1)" if plan.tensor > 1 else None)
    if why and prefetch:
        raise ConfigError(f"prefetch=True is not supported for a model given as it is with {why}; "
                          "pass prefetch=None or False")
    return False if why else resolve_prefetch(prefetch, plan.strategy, plan.remat, plan.shards, on_gpu=not plan.on_cpu)
