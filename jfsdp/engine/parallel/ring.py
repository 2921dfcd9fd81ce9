"""Ring attention over the mesh axis `context`: context parallelism's attention (docs/context-parallel.md;
the engine's side of it: jfsdp/engine/parallel/context.py).

Each sequence is split over `context` (size C). Inside the `shard_map`, a rank keeps its queries and
passes its keys and values around the ring: at step s it attends to the K/V block of rank r - s, while the
`ppermute` of the next block is in flight (it depends on nothing computed at step s, so XLA may overlap
it). The partial outputs are merged by their log-sum-exp (the online softmax of FlashAttention, one block
per device), so no device ever holds the whole sequence's keys. Forward: C - 1 hops of the K and V blocks.
Backward: C - 1 hops of K and V; the gradient of each block travels one hop behind it (C - 2 hops: the
ranks after its owner add their shares), and one last hop brings each dK, dV home, while the diagonal
block computes last; dQ stays local (a kernel with `Into` adds each call's dQ into one accumulator of the
rank's queries, in place, in the kernel's own layout). Only this rank's block is saved for the backward
pass, which receives the others again (a data dependency on the cotangent keeps XLA from reusing the
forward's received blocks).
Both passes are pinned as a pipeline by optimization barriers: block s computes after block s - 1, and the
sends it overlaps are issued between the two, so that on GPUs every hop but each pass's first is in flight
while a block's attention computes (jfsdp.config.xla_flags.CONTEXT_GPU_FLAGS lets four sends be in flight).

Load balance ("zigzag"): with a causal mask, the rank holding the end of the sequence would do all the
work. The sequence is cut into 2C chunks and rank r holds chunks r and 2C-1-r (jfsdp/config/sequence.py;
the data loader applies it once, and the positions that RoPE needs travel with the tokens: they are the
order itself). Then at every step but the first, every rank computes exactly two (L x L) unmasked blocks, L =
T / 2C: if the K/V block comes from an earlier rank (s < r) its first chunk is seen by both local query
chunks; if from a later rank, both of its chunks are seen by the second local query chunk. The chunk
pair (second queries, first keys) is common to both cases; the other pair is chosen by a select, not a
branch, so all ranks run the same program. Without zigzag (contiguous blocks) a block from a later rank
is wholly masked and its result dropped.

The per-block attention is a caller's `Kernel` (the models' blockwise attention on CPU, for instance):
jfsdp does not import models/. It needs the log-sum-exp of each query's scores, and a backward half that
takes the merged output and log-sum-exp."""
from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jfsdp.config.errors import ConfigError
from jfsdp.config.mesh import CONTEXT_AXIS
from jfsdp.engine.unit_call import tie

_NEG = -1e30   # the log-sum-exp of an empty (wholly masked) row: exp(_NEG - l) is 0 for any finite l


class Kernel(NamedTuple):
    """The per-block attention the ring runs.
    fwd(q, k, v, causal) -> (o fp32 (B, T, H, D), lse fp32 (B, T, H));
    bwd(q, k, v, o, lse, do, causal) -> (dq, dk, dv) fp32 (dq may come in `sum_dtype`), given the merged o
    and lse of the whole row.
    `sums`: bwd takes, in o's place, the row sums rowsum(dO * O) fp32 (B, T, H), all it needs of o: the
    ring computes them once, and o (a (T/C, H, D) array) is not held through the backward's hops.
    `low_sums`: the sums across hops in bf16 for bf16 inputs (`sum_dtype`); default fp32.
    `into` (an `Into`, optional): the backward half adding dq into an accumulator, which the ring then uses
    (with zigzag) in place of a (T/C, H, D) array per call and the sums across hops.
    `workspace` (optional): (B, T, H, D) of a call's queries -> bytes its backward holds that a program
    compiled for a GPU target without a GPU does not show (cuDNN's workspace: sized only on a GPU); the
    planner adds the diagonal call's (jfsdp/planning/context_plan.py)."""
    fwd: Callable
    bwd: Callable
    sums: bool = False
    low_sums: bool = False
    into: "Into | None" = None
    workspace: "Callable | None" = None


class Into(NamedTuple):
    """A kernel's dq added into one accumulator of all of a rank's queries, in the kernel's own layout: each
    call writes its query blocks' sums into it in place, so that the ring holds the accumulator and no
    full-size dq per call, and no transposes between them (docs/context-parallel.md).
    zeros(q, piece, after) -> a zero accumulator for the queries q (B, T, H, D) in `sum_dtype`, filled by calls
    on `piece` tokens at a time, made after `after` exists; None where the kernel cannot (the ring then
    sums the calls' dq as without `into`);
    bwd(q, k, v, o, lse, do, causal, acc, at) -> (acc, dk, dv): as Kernel.bwd, with q the tokens from `at` (may
    be traced) of acc's queries and the dq added into acc;
    out(acc, q) -> dq (B, T, H, D) in acc's dtype."""
    zeros: Callable
    bwd: Callable
    out: Callable


def ring_attention(q, k, v, kernel: Kernel, *, zigzag: bool = True, axis: str = CONTEXT_AXIS):
    """Causal attention of this rank's queries over the whole sequence's keys, inside a `shard_map` whose
    `axis` splits the sequence. q (B, T/C, H, D); k, v (B, T/C, K, D), K dividing H (grouped-query
    attention). `zigzag`: the sequence was permuted by `zigzag_order` (else each rank holds a contiguous
    block, rank order = sequence order). Returns (B, T/C, H, D) in q's dtype."""
    if zigzag and q.shape[1] % 2:
        raise ConfigError(f"zigzag ring attention needs an even number of local tokens, got {q.shape[1]}")
    return _ring(kernel, zigzag, axis, q, k, v)


def _ring_send(axis: str, context: int):
    return functools.partial(lax.ppermute, axis_name=axis, perm=[(i, (i + 1) % context) for i in range(context)])


def _merge(a, b):
    """Two partial attentions of the same queries over disjoint key sets -> over their union."""
    (oa, la), (ob, lb) = a, b
    lse = jnp.logaddexp(la, lb)
    return oa * jnp.exp(la - lse)[..., None] + ob * jnp.exp(lb - lse)[..., None], lse


def _halves(x):
    n = x.shape[1] // 2
    return x[:, :n], x[:, n:]


def _masked(lse, keep):
    return jnp.where(keep, lse, _NEG)


def _pieces(x, zigzag):
    """This rank's tokens as the ring accumulates them: its two zigzag chunks, or one contiguous block."""
    return _halves(x) if zigzag else (x,)


def _hop_fwd(kernel, zigzag, q, k, v, earlier, acc):
    """`acc` (per piece of the local queries, their running (o, lse)) merged with their attention over one
    K/V block that came from another rank; `earlier`: from a rank before this one (traced). Each piece
    is merged where it lies, so that no hop makes a (T/C, H, D) fp32 output of its own."""
    if not zigzag:
        o, lse = kernel.fwd(q, k, v, False)
        return (_merge(acc[0], (o, _masked(lse, earlier))),)
    (q1, q2), (k1, k2), (v1, v2) = _halves(q), _halves(k), _halves(v)
    oc, lc = kernel.fwd(q2, k1, v1, False)                 # seen in both cases
    pick = lambda a, b: jnp.where(earlier, a, b)
    ox, lx = kernel.fwd(pick(q1, q2), pick(k1, k2), pick(v1, v2), False)
    return (_merge(acc[0], (ox, _masked(lx, earlier))),
            _merge(acc[1], _merge((oc, lc), (ox, _masked(lx, ~earlier)))))


def _hop_bwd(kernel, zigzag, local, kv, earlier, dq):
    """(`dq`, per piece of the local queries, the running gradient in `sum_dtype` (None before the first
    hop), with this hop's share added; dk, dv fp32 of the K/V block `kv` (k, v) from another rank), for this
    rank's `local` (q, o, lse, do). With zigzag the two kernel calls run one after the other, the first's dq
    added before the second starts (an optimization barrier), so that one call's fp32 dq is live at a time
    beside the running sums, not two."""
    add = lambda acc, g: (g if acc is None else acc + g).astype(sum_dtype(local[0], kernel.low_sums))
    if not zigzag:
        keep = lambda g: jnp.where(earlier, g, 0.0)
        q, o, lse, do = _arrived(local, kv)
        dqh, dk, dv = map(keep, kernel.bwd(q, *kv, o, lse, do, False))
        return (add(dq and dq[0], dqh),), dk, dv
    dqc, dkc, dvc = kernel.bwd(*_common_pair(local, kv), False)
    dq1, dq2 = dq or (None, None)
    dq2 = add(dq2, dqc)
    (dq1, dq2, dkc, dvc), kv = lax.optimization_barrier(((dq1, dq2, dkc, dvc), kv))
    dqx, dkx, dvx = kernel.bwd(*_x_pair(earlier, local, kv, dkc), False)
    zero, pick = jnp.zeros_like, lambda a, b: jnp.where(earlier, a, b)
    return (add(dq1, pick(dqx, zero(dqx))), add(dq2, pick(zero(dqx), dqx))), *_zigzag_dkv(earlier, dkc, dvc, dkx, dvx)


def _common_pair(local, kv):
    """The inputs (q, k, v, o, lse, do) of a zigzag hop's first call: this rank's second queries and the K/V
    block's first keys (`local` made to depend on the block: `_arrived`)."""
    q, o, lse, do = (_halves(a)[1] for a in _arrived(local, kv))
    return q, *(_halves(a)[0] for a in kv), o, lse, do


def _x_pair(earlier, local, kv, after):
    """The inputs (q, k, v, o, lse, do) of a zigzag hop's second call, its x pair: first queries and first keys
    if the K/V block is from an earlier rank, else second queries and second keys. `local` (q, o, lse, do) made
    to depend on `after` (the first call's dk, through the optimization barrier between the calls), so that
    these selected copies are made after the first call, not ahead of it beside its own inputs."""
    pick = lambda a, b: jnp.where(earlier, a, b)
    q, o, lse, do = tie(local, after.reshape(-1)[0])
    return tuple(pick(*_halves(a)) for a in (q, *kv, o, lse, do))


def _zigzag_dkv(earlier, dkc, dvc, dkx, dvx):
    """A zigzag hop's dK, dV of the K/V block, from its two calls': the common pair's (first keys) and the x
    pair's (first keys if the block is from an earlier rank, else second)."""
    zero, pick = jnp.zeros_like, lambda a, b: jnp.where(earlier, a, b)
    first = lambda g: jnp.concatenate([pick(g, zero(g)), pick(zero(g), g)], 1)   # x pair: first or second half
    return first(dkx) + jnp.concatenate([dkc, zero(dkc)], 1), first(dvx) + jnp.concatenate([dvc, zero(dvc)], 1)


def _hop_bwd_into(into, local, kv, earlier, acc):
    """`_hop_bwd` with zigzag for a kernel with `Into`: both calls add their dq into `acc`, the rank's running
    dQ (the common pair's at the second chunk, the x pair's at the first or the second), one call after the
    other (an optimization barrier), in place. (acc, dk, dv)."""
    half = local[0].shape[1] // 2
    acc, dkc, dvc = into.bwd(*_common_pair(local, kv), False, acc, half)
    (acc, dkc, dvc), kv = lax.optimization_barrier(((acc, dkc, dvc), kv))
    acc, dkx, dvx = into.bwd(*_x_pair(earlier, local, kv, dkc), False, acc, jnp.where(earlier, 0, half))
    return acc, *_zigzag_dkv(earlier, dkc, dvc, dkx, dvx)


def sum_dtype(x, low: bool = False):
    """The dtype of the ring's sums across hops (dQ, the dK/dV that travel the ring) for x (array or dtype):
    fp32, or with `low` bfloat16's own for bf16 inputs (each hop's fp32 share rounded as it is added: half the
    memory and bytes, dK up to 1.9x one device's error at C = 8: docs/context-parallel.md)."""
    return jnp.promote_types(getattr(x, "dtype", x), jnp.bfloat16 if low else jnp.float32)


def _arrived(local, kv):
    """This rank's `local` arrays (its queries; in the backward also o, lse, dO), made to depend on the K/V
    block `kv` that a hop has just received (`tie`: + 0 * one of its elements). What a hop derives from them
    alone (the zigzag's select of a query half, the blocked queries, the backward's dO·O sums) depends on
    nothing but the rank and the hop, so XLA computed it for all hops at once ahead of the ring, shared
    the forward's with the backward's, and kept all C - 1 of them live (docs/context-parallel.md). Tied,
    each is made inside its hop and freed with it."""
    return tie(local, kv[0].reshape(-1)[0])


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _ring(kernel, zigzag, axis, q, k, v):
    return _ring_fwd(kernel, zigzag, axis, q, k, v)[0]


def _ring_fwd(kernel, zigzag, axis, q, k, v):
    context, rank = lax.axis_size(axis), lax.axis_index(axis)
    send = _ring_send(axis, context)
    kv = (k, v)
    nxt = send(kv) if context > 1 else None   # hop 1 in flight while the diagonal block computes
    o, lse = kernel.fwd(q, k, v, True)       # the diagonal block: causal within this rank's tokens
    acc = tuple(zip(_pieces(o, zigzag), _pieces(lse, zigzag))) if context > 1 else ((o, lse),)
    for s in range(1, context):
        # pinned: block s computes once block s - 1 has and its K/V are here, and hop s + 1 is issued from
        # there, so that it is in flight during block s (XLA's scheduler otherwise ran the diagonal last,
        # after the hops, and their sends had nothing to hide behind)
        kv, acc = lax.optimization_barrier((nxt, acc))   # now the block of rank r - s
        if s + 1 < context:
            nxt = send(kv)
        acc = _hop_fwd(kernel, zigzag, _arrived(q, kv), *kv, (rank - s) % context < rank, acc)
    o, lse = (jnp.concatenate(x, 1) if len(x) > 1 else x[0] for x in zip(*acc))
    o = o.astype(q.dtype)
    return o, (q, k, v, o, lse)


def _ring_bwd(kernel, zigzag, axis, res, do):
    q, k, v, o, lse = res
    context, rank = lax.axis_size(axis), lax.axis_index(axis)
    if context == 1:
        dq, dk, dv = kernel.bwd(q, k, v, o, lse, do, True)
        return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)
    if kernel.sums:
        o = jnp.sum(do.astype(jnp.float32) * o.astype(jnp.float32), -1)
    send = _ring_send(axis, context)
    # the backward ring sends K and V again, after the cotangent exists: otherwise XLA merges its hops
    # with the forward's, and keeps all C - 1 blocks received in the forward pass alive until here
    nxt = send(tie((k, v), do.reshape(-1)[0]))   # hop 1: the pass's first, with nothing yet to hide behind
    dq = dkv = None
    into = kernel.into if zigzag else None
    if into is not None:   # the running dQ: one accumulator, or None where the kernel cannot make one
        dq = into.zeros(q, q.shape[1] // 2, do)
        into = into if dq is not None else None
    for s in range(1, context):
        # pinned as in the forward: block s after block s - 1, and hop s + 1 issued between them (from K and
        # V both received: else XLA combined hop 2's K with hop 1's V into one send, which then waited too)
        kv, dq, dkv = lax.optimization_barrier((nxt, dq, dkv))   # K, V of rank r - s
        if s + 1 < context:
            nxt = send(kv)
        # the gradient of block r - s from ranks r - s + 1 .. r - 1, in flight while this block computes
        back = send(dkv) if s > 1 else None
        earlier = (rank - s) % context < rank
        if into is not None:
            dq, *g = _hop_bwd_into(into, (q, o, lse, do), kv, earlier, dq)
        else:
            dq, *g = _hop_bwd(kernel, zigzag, (q, o, lse, do), kv, earlier, dq)
        dkv = tuple((x if b is None else b + x).astype(sum_dtype(k, kernel.low_sums)) for b, x in zip(back or (None, None), g))
    # the diagonal block last, while the gradients of rank r + 1's block go home
    (q, k, v, o, lse, do), dq, dkv = lax.optimization_barrier(((q, k, v, o, lse, do), dq, dkv))
    home = send(dkv)
    if into is not None:
        dq, dkd, dvd = into.bwd(q, k, v, o, lse, do, True, dq, 0)
        dq = into.out(dq, q)
    else:
        dqd, dkd, dvd = kernel.bwd(q, k, v, o, lse, do, True)
        dq = (jnp.concatenate(dq, 1) if len(dq) > 1 else dq[0]) + dqd
    return dq.astype(q.dtype), (home[0] + dkd).astype(k.dtype), (home[1] + dvd).astype(v.dtype)


_ring.defvjp(_ring_fwd, _ring_bwd)
