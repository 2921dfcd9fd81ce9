"""Softmax attention in O(T) memory: blockwise, with an online softmax and a hand-written VJP.

Pure JAX (no meshes, no jfsdp): any model can call `blockwise_attention(q, k, v)` where it would
call `jax.nn.dot_product_attention`. Queries and keys are cut into blocks; for each query block a
loop over key blocks keeps only a running max, a running sum and the output accumulator (the
FlashAttention algorithm), so no (T, T) score matrix is ever formed, in the forward pass or the
backward one, which saves only the output and the per-query log-sum-exp and recomputes each block's
scores. With a causal mask the key loop stops at the diagonal. Grouped-query attention is native:
queries are viewed as (kv heads, group) and K/V are never repeated.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax


def _chunks(n: int, chunk: int) -> int:
    return -(-n // chunk)


_NEG = -1e30   # finite "minus infinity": a fully masked row stays NaN-free


def _blocks(x, n, block):
    """(B, T, ...) -> (n, B, block, ...), zero-padded to n * block rows."""
    pad = n * block - x.shape[1]
    x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2)) if pad else x
    return jnp.moveaxis(x.reshape(x.shape[0], n, block, *x.shape[2:]), 1, 0)


def _unblock(x, t):
    """(n, B, block, ...) -> (B, t, ...)."""
    x = jnp.moveaxis(x, 0, 1)
    return x.reshape(x.shape[0], -1, *x.shape[3:])[:, :t]


def _where_valid(i, j, block, t, causal, x, fill):
    """x where key j * block + p may be seen by query i * block + q (in the sequence, and not after the query
    when `causal`), else `fill`. Without a mask to apply (not causal, no padding) x itself: a mask that depends
    on the key block only was precomputed for all blocks at once under differentiation (a (n, B, K, G, block,
    block) boolean per call, 256 MiB at llama-8b's heads and 16,384 tokens)."""
    if not causal and t % block == 0:
        return x
    return jnp.where(_mask(i, j, block, t, causal), x, fill)


def _mask(i, j, block, t, causal):
    qpos = i * block + jnp.arange(block)
    kpos = j * block + jnp.arange(block)
    valid = kpos[None, :] < t
    if causal:
        valid = valid & (kpos[None, :] <= qpos[:, None])
    return valid   # (block_q, block_k)


def _map(f, n: int, tie):
    """`lax.map(f, jnp.arange(n))`, with the stacked outputs' buffers made from a zero that depends on `tie` (an
    input of this call). lax.map's buffers start as constant zeros that depend on nothing; XLA:GPU hoists those
    out of the enclosing loop over layers and fuses them into one op, so that every call's buffers in a unit
    (the ring's hops: 2 per hop) were allocated at once and stayed live through the whole step: 16.0 of the
    35.3 GiB of llama-8b's widths with 2 layers at 32,768 tokens per device, C = 8 (docs/context-parallel.md). Tied to this
    call's input, each buffer is made where the call runs and freed after it. The values are lax.map's."""
    shapes = jax.eval_shape(f, jax.ShapeDtypeStruct((), jnp.int32))
    zero = tied_zeros((), jnp.float32, tie)
    init = jax.tree.map(lambda s: jnp.broadcast_to(zero.astype(s.dtype), (n, *s.shape)), shapes)
    put = lambda i, ys: jax.tree.map(lambda y, x: lax.dynamic_update_index_in_dim(y, x, i, 0), ys, f(i))
    return index_loop(0, n, put, init)


def _map_into(f, n: int, ys, at):
    """`ys` (stacked blocks) with blocks at + i, i < n, replaced by f(i, that block): the loop writes into `ys`
    in place (a while loop whose carry is `ys`; `at` may be traced)."""
    def put(i, ys):
        at_i = at + i
        return lax.dynamic_update_index_in_dim(ys, f(i, lax.dynamic_index_in_dim(ys, at_i, 0, keepdims=False)), at_i, 0)
    return index_loop(0, n, put, ys)


def tied_zeros(shape, dtype, tie):
    """Zeros of `shape` made from a zero that depends on `tie` (`lax.optimization_barrier`): a buffer XLA cannot
    hoist out of an enclosing loop (`_map`'s stacks here, models/tiled_mlp.py's outputs and sums)."""
    return jnp.broadcast_to(lax.optimization_barrier((jnp.zeros((), jnp.float32), tie))[0].astype(dtype), shape)


def index_loop(lo, hi, body, init):
    """`lax.fori_loop(lo, hi, body, init)` as a while loop whatever its bounds. With static bounds fori_loop
    is a scan, and under the unit's checkpoint JAX's partial evaluation split each of the kernel's scans in
    two: a scan that stacks every iteration's key and value block (`kb[j]`, a copy of K and V per call) for
    the other, which recomputes the rest. XLA:GPU then made the stacks' buffers from constant zeros, hoisted
    out of the loop over layers and fused into one op, so all of them lived through the step: 84 blocked
    K/V copies, 15.75 GiB of llama-8b's 1.5M tokens at C = 8, the largest part of what the planner called
    the ring's per-hop partials (docs/context-parallel.md). A while loop is never split (it runs wholly
    in the forward or wholly in the recompute); the kernel has its own VJP, so nothing differentiates
    through it."""
    return lax.while_loop(lambda c: c[0] < hi, lambda c: (c[0] + 1, body(c[0], c[1])), (jnp.asarray(lo, jnp.int32), init))[1]


def _scores(qi, kj, scale):
    # qi (B, bq, K, G, D), kj (B, bk, K, D) -> (B, K, G, bq, bk) in fp32
    return jnp.einsum("bqkgd,bpkd->bkgqp", qi, kj, preferred_element_type=jnp.float32) * scale


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _flash(q, k, v, causal, block, scale):
    return _flash_fwd(q, k, v, causal, block, scale)[0]


def _forward_f32(q, k, v, causal, block, scale):
    """(o fp32 (B, T, H, D), lse fp32 blocked (n, B, K, G, block))."""
    b, t, h, d = q.shape
    kh = k.shape[2]
    n = _chunks(t, block)
    qb = _blocks(q.reshape(b, t, kh, h // kh, d), n, block)
    kb, vb = _blocks(k, n, block), _blocks(v, n, block)

    def q_block(i):
        qi = qb[i]

        def body(j, carry):
            m, l, acc = carry
            s = _where_valid(i, j, block, t, causal, _scores(qi, kb[j], scale), _NEG)
            m_new = jnp.maximum(m, s.max(-1))
            p = jnp.exp(s - m_new[..., None])
            corr = jnp.exp(m - m_new)
            pv = jnp.einsum("bkgqp,bpkd->bkgqd", p.astype(v.dtype), vb[j], preferred_element_type=jnp.float32)
            return m_new, l * corr + p.sum(-1), acc * corr[..., None] + pv

        shape = (b, kh, h // kh, block)
        m, l, acc = index_loop(0, i + 1 if causal else n, body,
                                  (jnp.full(shape, _NEG, jnp.float32), jnp.zeros(shape, jnp.float32),
                                   jnp.zeros((*shape, d), jnp.float32)))
        return acc / l[..., None], m + jnp.log(l)     # (B, K, G, bq, D), (B, K, G, bq)

    o, lse = _map(q_block, n, k)
    # (n, B, K, G, bq, D) -> (B, T, H, D)
    o = jnp.moveaxis(o, 4, 2).reshape(n, b, block, h, d)
    return _unblock(o, t), lse


def _flash_fwd(q, k, v, causal, block, scale):
    o, lse = _forward_f32(q, k, v, causal, block, scale)
    o = o.astype(q.dtype)
    return o, (q, k, v, o, lse)


def _flash_bwd(causal, block, scale, res, do):
    q, k, v = res[:3]
    dq, dk, dv = _grads_f32(causal, block, scale, res, do)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


def _grads_f32(causal, block, scale, res, do, dq_dtype=jnp.float32, dq_into=None, dq_at=0):
    """(dq, dk, dv) in fp32 from the output o and the per-query log-sum-exp lse, blocked as
    `_forward_f32` returns it: (n, B, K, G, block). `dq_into` (blockwise_attention_bwd's): dq is
    `dq_into` with this call's query blocks added at blocks dq_at, dq_at + 1, ..."""
    q, k, v, o, lse = res
    b, t, h, d = q.shape
    kh, g = k.shape[2], h // k.shape[2]
    n = _chunks(t, block)
    qb = _blocks(q.reshape(b, t, kh, g, d), n, block)
    dob = _blocks(do.reshape(b, t, kh, g, d), n, block)
    kb, vb = _blocks(k, n, block), _blocks(v, n, block)
    # D_i = rowsum(dO * O) per query, laid out like lse: (n, B, K, G, bq)
    dsum = o if o.ndim == 3 else jnp.sum(do.astype(jnp.float32) * o.astype(jnp.float32), -1)
    dsum = dsum.reshape(b, t, kh, g)
    dsum = jnp.moveaxis(_blocks(dsum, n, block), 2, -1)

    def probs(i, j):
        s = _scores(qb[i], kb[j], scale)
        return _where_valid(i, j, block, t, causal, jnp.exp(s - lse[i][..., None]), 0.0)

    def dscores(i, j, p):
        dp = jnp.einsum("bqkgd,bpkd->bkgqp", dob[i], vb[j], preferred_element_type=jnp.float32)
        return p * (dp - dsum[i][..., None])

    def dq_block(i, acc=None):
        def body(j, dq):
            ds = dscores(i, j, probs(i, j))
            return dq + jnp.einsum("bkgqp,bpkd->bkgqd", ds.astype(k.dtype), kb[j], preferred_element_type=jnp.float32)
        dq = (index_loop(0, i + 1 if causal else n, body, jnp.zeros((b, kh, g, block, d), jnp.float32)) * scale).astype(dq_dtype)
        return dq if acc is None else acc + dq

    def dkv_block(j):
        def body(i, carry):
            dk, dv = carry
            p = probs(i, j)
            dv = dv + jnp.einsum("bkgqp,bqkgd->bpkd", p.astype(do.dtype), dob[i], preferred_element_type=jnp.float32)
            ds = dscores(i, j, p)
            dk = dk + jnp.einsum("bkgqp,bqkgd->bpkd", ds.astype(q.dtype), qb[i], preferred_element_type=jnp.float32)
            return dk, dv
        zero = jnp.zeros((b, block, kh, d), jnp.float32)
        dk, dv = index_loop(j if causal else 0, n, body, (zero, zero))
        return dk * scale, dv

    if dq_into is None:   # (n, B, K, G, block, D) -> (B, T, H, D)
        dq = _unblock(jnp.moveaxis(_map(dq_block, n, k), 4, 2), t).reshape(b, t, h, d)
    else:
        acc = dq_into.reshape(dq_into.shape[0], b, kh, g, block, d)
        dq = _map_into(dq_block, n, acc, dq_at // block).reshape(dq_into.shape)
    dk, dv = _map(dkv_block, n, k)
    return dq, _unblock(dk, t), _unblock(dv, t)


_flash.defvjp(_flash_fwd, _flash_bwd)


def blockwise_attention(q, k, v, *, causal: bool = True, block: int = 512, scale: float | None = None):
    """Softmax attention in O(T) memory, exact (fp32 softmax statistics, fp32 accumulation).

    q: (B, T, H, D); k, v: (B, T, K, D) with K dividing H (grouped-query attention: each group of
    H/K query heads shares a K/V head, which is never repeated in memory). Returns (B, T, H, D) in
    q's dtype. `block`: query and key block length; the score tile is (B, H, block, block) fp32."""
    block, scale = _check(q, k, v, block, scale)
    return _flash(q, k, v, causal, block, scale)


def _check(q, k, v, block, scale):
    b, t, h, d = q.shape
    if k.shape != v.shape or k.shape[0] != b or k.shape[1] != t or k.shape[3] != d or h % k.shape[2]:
        raise ValueError(f"blockwise_attention: q {q.shape}, k {k.shape}, v {v.shape}: expected k = v = (B, T, K, D) "
                         "with K dividing q's heads")
    if block < 1:
        raise ValueError(f"block must be positive, got {block}")
    return min(block, t), float(scale if scale is not None else d ** -0.5)


# The two halves of the computation, for a caller that splits the keys into several sets and merges the
# partial outputs itself by their log-sum-exp (ring attention, whose key blocks live on other devices).
# The backward half takes the merged output and log-sum-exp, so that what it returns for one key set
# is that set's exact share of the gradients of the whole attention.

def blockwise_attention_fwd(q, k, v, *, causal: bool = True, block: int = 512, scale: float | None = None):
    """(o, lse): the fp32 output (B, T, H, D) and the fp32 log-sum-exp of each query's scores (B, T, H)."""
    block, scale = _check(q, k, v, block, scale)
    b, t, h, _ = q.shape
    o, lse = _forward_f32(q, k, v, causal, block, scale)
    return o, _unblock(jnp.moveaxis(lse, -1, 2).reshape(-1, b, block, h), t)


def blockwise_attention_bwd(q, k, v, o, lse, do, *, causal: bool = True, block: int = 512,
                            scale: float | None = None, dq_dtype=jnp.float32, dq_into=None, dq_at=0):
    """(dq, dk, dv) in fp32, for the attention whose output (all key sets merged) is o and whose
    log-sum-exp is lse (B, T, H): the gradients through this key set's part of it. `o` may instead be
    the row sums rowsum(dO * O) fp32 (B, T, H), all the gradients need of it. `dq_dtype`: dq's, each
    query block's fp32 sum rounded to it (context parallelism's ring sums the hops' dq in bf16 for bf16
    inputs: jfsdp/engine/parallel/ring.py `sum_dtype`).
    `dq_into`: an accumulator (`blockwise_dq_zeros`) of the dq of a longer run of queries, of which q are the
    tokens from `dq_at` on (a multiple of the accumulator's block, which this call uses in `block`'s place;
    may be traced): the dq returned is the accumulator with this call's dq added, block by block in place,
    each block's fp32 sum rounded to dq_dtype first as without it (the ring of context parallelism sums its
    hops' dq so, with no full-size array of its own per hop: jfsdp/engine/parallel/ring.py)."""
    if dq_into is not None:
        block = dq_into.shape[3]
        if q.shape[1] % block:
            raise ValueError(f"blockwise_attention_bwd: {q.shape[1]} queries are not whole blocks of dq_into's {block}")
    block, scale = _check(q, k, v, block, scale)
    b, t, h, _ = q.shape
    kh = k.shape[2]
    lse = jnp.moveaxis(_blocks(lse.reshape(b, t, kh, h // kh), _chunks(t, block), block), 2, -1)
    return _grads_f32(causal, block, scale, (q, k, v, o, lse), do, dq_dtype, dq_into, dq_at)


def blockwise_dq_zeros(q, piece: int, *, block: int = 512, dtype=jnp.float32, after=None):
    """A zero dq accumulator for `blockwise_attention_bwd(..., dq_into=)`: for the queries q (B, T, H, D), to be
    filled by calls on `piece` tokens at a time (T a multiple of it), in blocks of b = min(block, piece):
    (T / b, B, H, b, D) in `dtype`, the layout the kernel writes its query blocks in. Made from a zero tied to
    `after` (`tied_zeros`: made where it is needed, not hoisted). None where `piece` is not whole blocks."""
    b_, t, h, d = q.shape
    block = min(block, piece)
    if piece % block or t % block:
        return None
    return tied_zeros((t // block, b_, h, block, d), dtype, q if after is None else after)


def blockwise_dq_out(acc, q_shape):
    """A `blockwise_dq_zeros` accumulator (n, B, H, block, D) as dq (B, T, H, D) of queries of shape `q_shape`."""
    n, b, h, block, d = acc.shape
    return jnp.moveaxis(acc, 2, 3).swapaxes(0, 1).reshape(b, n * block, h, d)[:, :q_shape[1]]

