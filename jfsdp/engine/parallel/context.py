"""Context parallelism: ring attention over the mesh axis `context` (docs/context-parallel.md).

Each sequence is split over `context` (size C). Inside the `shard_map`, a rank keeps its queries and
passes its keys and values around the ring: at step s it attends to the K/V block of rank r - s, while the
`ppermute` of the next block is in flight (it depends on nothing computed at step s, so XLA may overlap
it). The partial outputs are merged by their log-sum-exp (the online softmax of FlashAttention, one block
per device), so no device ever holds the whole sequence's keys. Forward: C - 1 hops of the K and V blocks.
Backward: C - 1 hops of K and V; the gradient of each block travels one hop behind it (C - 2 hops: the
ranks after its owner add their shares), and one last hop brings each dK, dV home, while the diagonal
block computes last; dQ stays local. Only this rank's block is saved for the backward pass, which receives
the others again (a data dependency on the cotangent keeps XLA from reusing the forward's received blocks).
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

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from jfsdp.config.errors import ConfigError
from jfsdp.config.mesh import CONTEXT_AXIS, TENSOR_AXIS, context_size
from jfsdp.config.sequence import unzigzag, zigzag, zigzag_order  # noqa: F401 (the data loader's order, here too)
from jfsdp.engine.layout import Stacked
from jfsdp.engine.unit_call import tie

_NEG = -1e30   # the log-sum-exp of an empty (wholly masked) row: exp(_NEG - l) is 0 for any finite l


class Kernel(NamedTuple):
    """The per-block attention the ring runs.
    fwd(q, k, v, causal) -> (o fp32 (B, T, H, D), lse fp32 (B, T, H));
    bwd(q, k, v, o, lse, do, causal) -> (dq, dk, dv) fp32 (dq may come in `sum_dtype`), given the merged o
    and lse of the whole row.
    `sums`: bwd takes, in o's place, the row sums rowsum(dO * O) fp32 (B, T, H), all it needs of o: the
    ring computes them once, and o (a (T/C, H, D) array) is not held through the backward's hops.
    `low_sums`: the sums across hops in bf16 for bf16 inputs (`sum_dtype`); default fp32."""
    fwd: Callable
    bwd: Callable
    sums: bool = False
    low_sums: bool = False


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


def _hop_bwd(kernel, zigzag, q, k, v, o, lse, do, earlier, dq):
    """(`dq`, per piece of the local queries, the running gradient in `sum_dtype` (None before the first
    hop), with this hop's share added; dk, dv fp32 of the K/V block from another rank). With zigzag the
    two kernel calls run one after the other, the first's dq added before the second starts (an optimization
    barrier), so that one call's fp32 dq is live at a time beside the running sums, not two."""
    add = lambda acc, g: (g if acc is None else acc + g).astype(sum_dtype(q, kernel.low_sums))
    if not zigzag:
        keep = lambda g: jnp.where(earlier, g, 0.0)
        dqh, dk, dv = map(keep, kernel.bwd(q, k, v, o, lse, do, False))
        return (add(dq and dq[0], dqh),), dk, dv
    (q1, q2), (k1, k2), (v1, v2) = _halves(q), _halves(k), _halves(v)
    (o1, o2), (l1, l2), (do1, do2) = _halves(o), _halves(lse), _halves(do)
    dqc, dkc, dvc = kernel.bwd(q2, k1, v1, o2, l2, do2, False)
    dq1, dq2 = dq or (None, None)
    dq2 = add(dq2, dqc)
    pick = lambda a, b: jnp.where(earlier, a, b)
    (dq1, dq2, dkc, dvc), x = lax.optimization_barrier(
        ((dq1, dq2, dkc, dvc), (pick(q1, q2), pick(k1, k2), pick(v1, v2), pick(o1, o2), pick(l1, l2), pick(do1, do2))))
    dqx, dkx, dvx = kernel.bwd(*x, False)
    zero = jnp.zeros_like
    first = lambda g: jnp.concatenate([pick(g, zero(g)), pick(zero(g), g)], 1)   # x pair: first or second half
    dk = first(dkx) + jnp.concatenate([dkc, zero(dkc)], 1)
    dv = first(dvx) + jnp.concatenate([dvc, zero(dvc)], 1)
    return (add(dq1, pick(dqx, zero(dqx))), add(dq2, pick(zero(dqx), dqx))), dk, dv


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
    for s in range(1, context):
        # pinned as in the forward: block s after block s - 1, and hop s + 1 issued between them (from K and
        # V both received: else XLA combined hop 2's K with hop 1's V into one send, which then waited too)
        kv, dq, dkv = lax.optimization_barrier((nxt, dq, dkv))   # K, V of rank r - s
        if s + 1 < context:
            nxt = send(kv)
        # the gradient of block r - s from ranks r - s + 1 .. r - 1, in flight while this block computes
        back = send(dkv) if s > 1 else None
        dq, *g = _hop_bwd(kernel, zigzag, *_arrived((q,), kv), *kv, *_arrived((o, lse, do), kv),
                          (rank - s) % context < rank, dq)
        dkv = tuple((x if b is None else b + x).astype(sum_dtype(k, kernel.low_sums)) for b, x in zip(back or (None, None), g))
    # the diagonal block last, while the gradients of rank r + 1's block go home
    (q, k, v, o, lse, do), dq, dkv = lax.optimization_barrier(((q, k, v, o, lse, do), dq, dkv))
    home = send(dkv)
    dqd, dkd, dvd = kernel.bwd(q, k, v, o, lse, do, True)
    dq = jnp.concatenate(dq, 1) if len(dq) > 1 else dq[0]
    return (dq + dqd).astype(q.dtype), (home[0] + dkd).astype(k.dtype), (home[1] + dvd).astype(v.dtype)


_ring.defvjp(_ring_fwd, _ring_bwd)


# ---- the engine at C > 1 (jfsdp.engine.sharded): what it supports, and the unit's attention as a ring

LATER = "is not supported with context parallelism yet (docs/context-parallel.md)"
HOOKS = ("positions", "attend")


def check(model, mesh, strategy, mp_policy, prefetch, moe, kernel):
    """(`kernel`, fully_shard's context_attention; the prefetch option, as given: the pipeline's units run
    their attention as a ring like the plain scan's); ConfigError for what C > 1 does not support yet."""
    c = context_size(mesh)
    if c == 1:
        if kernel is not None:
            raise ConfigError("context_attention= needs a mesh with a context axis of size > 1 "
                              "(make_mesh(spec, context=C))")
        return None, prefetch
    if not isinstance(kernel, Kernel):
        raise ConfigError(f"a mesh with context {c} needs context_attention=jfsdp.engine.parallel.context.Kernel(fwd, "
                          "bwd): the per-block attention of the ring (models/factory.py's context_kernel for Llama)")
    for what, bad in (("a jfsdp.Staged model", not isinstance(model, Stacked)),
                      (f"strategy {strategy.value}", not strategy.sharded), ("moe=", moe is not None),
                      ("float8", mp_policy.float8 is not None)):
        if bad:
            raise ConfigError(f"{what} {LATER}")
    return kernel, prefetch


def placement(batch_spec, loss_axes, context: int):
    """(the batch's PartitionSpec, the axes the loss is averaged over): at C > 1 the sequence (dimension 1)
    lies on `context`, in the zigzag order the data loader gave it (`zigzag`), and with sequence parallelism
    (`batch_spec` puts it on `tensor`) further on `tensor` inside each context rank's share: context rank c,
    tensor rank t holds the t-th of the T pieces of c's two zigzag chunks, so that the gather over `tensor`
    before attention gives the context rank its tokens in their order."""
    if context == 1:
        return batch_spec, loss_axes
    if len(batch_spec) > 1 and batch_spec[1] != TENSOR_AXIS:
        raise ConfigError(f"context parallelism with axis {batch_spec[1]!r} on the sequence {LATER}")
    seq = (CONTEXT_AXIS, TENSOR_AXIS) if len(batch_spec) > 1 else CONTEXT_AXIS
    return P(batch_spec[0], seq), (*loss_axes, CONTEXT_AXIS)


def batch_rows(tree, n_devices: int, tensor: int, context: int) -> tuple:
    """(the devices a batch's rows lie on, the count its batch size must divide): R*S, and all N devices as
    before when C = 1 (tensor parallelism keeps its rule). At C > 1 a ConfigError unless every leaf's
    sequence (dimension 1) is a multiple of 2C (2C*T with T > 1), the zigzag's chunks split over `tensor`."""
    rows = n_devices // (tensor * context)
    if context == 1:
        return rows, n_devices
    for x in jax.tree.leaves(tree):
        if np.ndim(x) >= 2 and np.shape(x)[1] % (2 * context * tensor):
            raise ConfigError(f"a batch's sequence of {np.shape(x)[1]} tokens does not split over context {context}"
                              + (f" and tensor {tensor}" if tensor > 1 else "")
                              + f": context parallelism cuts it into 2*C = {2 * context} equal chunks"
                              + (f", each split over T = {tensor}" if tensor > 1 else ""))
    return rows, rows


def with_ring(apply, kernel: Kernel, context: int):
    """A unit's (params, h) -> h with its attention run as a ring over `context` on zigzag-ordered tokens:
    the unit's modules' `positions(t)` give this rank's tokens' positions, and `attend(q, k, v)` runs
    `ring_attention`. A unit that calls neither is refused: its attention would see this rank's tokens only.
    At C = 1, `apply` itself."""
    if context == 1:
        return apply
    def intercept(next_fun, args, kwargs, ctx):
        if ctx.method_name not in HOOKS:
            return next_fun(*args, **kwargs)
        seen.add(ctx.method_name)
        if ctx.method_name == "attend":
            return ring_attention(*args, kernel, **kwargs)
        t, c = args[0], lax.axis_size(CONTEXT_AXIS)
        order = jnp.asarray(zigzag_order(t * c, c), jnp.float32).reshape(c, t)
        return order[lax.axis_index(CONTEXT_AXIS)]

    seen = set()

    def run(params, h):
        with nn.intercept_methods(intercept):
            out = apply(params, h)
        if seen != set(HOOKS):
            raise ConfigError("context parallelism needs the unit's attention reachable: a module method "
                              "positions(t) giving the tokens' positions (RoPE) and attend(q, k, v) doing causal "
                              f"attention, as models/llama.py's Attention has; this unit called {sorted(seen) or 'neither'}")
        return out
    return run
