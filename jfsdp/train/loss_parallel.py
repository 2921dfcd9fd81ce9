"""Cross-entropy over a vocabulary split over `tensor` (torchtitan's `loss_parallel`), for a vocabulary-parallel
root (jfsdp/engine/parallel/vocab.py): each tensor rank holds `shard.local` columns of the logits (or rows
of the head weight), from `shard.offset()`. Per token, the max and the sum of exponentials are reduced over
`tensor` (a pmax and a psum of one float a token), and the target's logit is taken on the rank that holds
it (a psum of one float a token). Every rank ends with the same loss over its tokens; the logits of the
whole vocabulary never exist anywhere.

`cross_entropy` works on logits (the plain head) and is differentiated by jax, whose transpose of psum
(a psum) sums the T ranks' contributions. `linear_cross_entropy` is the fused, chunked head of
losses.py with the same reductions: chunks of tokens forward, blocks of this rank's vocabulary backward,
and the cotangent psum-ed over `tensor` (every rank's copy of the loss depends on this rank's logits)."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax


def cross_entropy(logits, targets, shard):
    """Per-token -log softmax(logits)[target] for logits (..., local) holding `shard`'s columns."""
    x = logits.astype(jnp.float32)
    m = lax.pmax(lax.stop_gradient(jnp.max(x, axis=-1)), shard.axis)
    lse = m + jnp.log(lax.psum(jnp.sum(jnp.exp(x - m[..., None]), axis=-1), shard.axis))
    local, ok = shard.local_ids(targets)
    picked = jnp.where(ok, jnp.take_along_axis(x, local[..., None], axis=-1)[..., 0], 0.0)
    return lse - lax.psum(picked, shard.axis)


def _logits(h, w, vocab_major, shard):
    dims = (((1,), (1,)), ((), ())) if vocab_major else (((1,), (0,)), ((), ()))
    return shard.mask(lax.dot_general(h, w, dims, preferred_element_type=jnp.float32))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def linear_cross_entropy(h, w, targets_weights, chunk, vocab_major, shard):
    """sum over tokens of weight x -log softmax(h @ w)[target], w this rank's share of the head weight;
    h (n, d), targets and weights (n,), n a multiple of `chunk`."""
    return _fwd(h, w, targets_weights, chunk, vocab_major, shard)[0]


def _fwd(h, w, targets_weights, chunk, vocab_major, shard):
    targets, weights = targets_weights
    n, d = h.shape
    hc, tc = h.reshape(-1, chunk, d), targets.reshape(-1, chunk)

    def body(_, xs):
        hi, ti = xs
        logits = _logits(hi, w, vocab_major, shard)
        m = jnp.max(logits, axis=-1)
        local, ok = shard.local_ids(ti)
        picked = jnp.where(ok, jnp.take_along_axis(logits, local[:, None], axis=-1)[:, 0], 0.0)
        return None, (m, jnp.sum(jnp.exp(logits - m[:, None]), axis=-1), picked)

    _, (m, s, picked) = lax.scan(body, None, (hc, tc))
    m, s, picked = m.reshape(n), s.reshape(n), picked.reshape(n)
    top = lax.pmax(m, shard.axis)
    s, picked = lax.psum(jnp.stack([s * jnp.exp(m - top), picked]), shard.axis)
    lse = top + jnp.log(s)
    return jnp.sum((lse - picked) * weights), (h, w, targets_weights, lse)


def _bwd(chunk, vocab_major, shard, res, g):
    """Blocks of this rank's vocabulary (losses.py's backward, on `shard.local` columns): its rows of the
    weight gradient, and its share of dh (the engine's all-gather of h before the head sums the shares)."""
    h, w, (targets, weights), lse = res
    n, d = h.shape
    scale = (weights * lax.psum(g, shard.axis))[:, None]
    vb = vocab_block(chunk, n, shard.local)
    axis = 0 if vocab_major else 1

    def body(carry, j):
        start = jnp.minimum(j * vb, shard.local - vb)
        wj = lax.dynamic_slice_in_dim(w, start, vb, axis)
        cols = start + jnp.arange(vb)
        logits = lax.dot_general(h, wj, (((1,), (1,)), ((), ())) if vocab_major else (((1,), (0,)), ((), ())),
                                 preferred_element_type=jnp.float32)
        if shard.local * shard.tensor != shard.vocab:
            logits = jnp.where(shard.offset() + cols < shard.vocab, logits, -jnp.inf)
        hit = targets[:, None] == shard.offset() + cols[None, :]
        dl = ((jnp.exp(logits - lse[:, None]) - hit) * scale).astype(h.dtype)
        return add_block(carry, dl, h, wj, start, cols, j * vb, axis, vocab_major), None

    init = (jnp.zeros((n, d), jnp.float32), jnp.zeros(w.shape, w.dtype))
    (dh, dw), _ = lax.scan(body, init, jnp.arange(-(-shard.local // vb)))
    return dh.astype(h.dtype), dw, no_cotangents((targets, weights))


def vocab_block(chunk: int, tokens: int, vocab: int) -> int:
    """Vocabulary entries per block of the fused loss's backward (here and in losses.py): as many logits
    (tokens x block) as a forward chunk holds (chunk x vocab)."""
    return max(1, min(vocab, (chunk * vocab) // max(tokens, 1)))


def add_block(carry, dl, h, wj, start, cols, first, axis, vocab_major):
    """One vocabulary block of the fused loss's backward (here and in losses.py): `dl` (tokens, block) is
    softmax - onehot times the cotangent, `wj` the block's slice of the head weight, `cols` its columns
    from `start`. Writes the block's rows of the weight gradient into dw, and adds to dh the columns from
    `first` on (those before were the block before's, when the last block is shifted back)."""
    dh, dw = carry
    if vocab_major:   # wj (vb, d): dw_j = dl^T @ h, dh += dl @ wj
        dwj = lax.dot_general(dl, h, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)
        w_dims = (((1,), (0,)), ((), ()))
    else:             # wj (d, vb): dw_j = h^T @ dl, dh += dl @ wj^T
        dwj = lax.dot_general(h, dl, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)
        w_dims = (((1,), (1,)), ((), ()))
    dw = lax.dynamic_update_slice_in_dim(dw, dwj.astype(dw.dtype), start, axis)
    fresh = jnp.where((cols >= first)[None, :], dl, jnp.zeros((), dl.dtype))
    return dh + lax.dot_general(fresh, wj, w_dims, preferred_element_type=jnp.float32), dw


def no_cotangents(tree):
    """Zero cotangents for the targets and weights: float0 for integer leaves."""
    return jax.tree.map(lambda x: jnp.zeros(x.shape, jax.dtypes.float0) if jnp.issubdtype(x.dtype, jnp.integer)
                        else jnp.zeros_like(x), tree)


linear_cross_entropy.defvjp(_fwd, _bwd)
