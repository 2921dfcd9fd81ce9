"""Memory-lean operations any model can use: a fused, chunked output head + cross-entropy.
(The O(T)-memory attention lives with the models, `models/attention.py`, as pure JAX.)

The output head of a language model is where a training step peaks: for 2048 tokens of a 128k
vocabulary, one fp32 copy of the logits is 1 GiB, and the plain `log_softmax` path keeps several
(logits, their exponentials, the gradient of the logits, a transposed copy for the weight gradient).
`linear_cross_entropy` never forms the logits of all tokens: it walks over chunks of tokens, and for
each chunk computes the logits, their log-sum-exp and the loss; the backward pass recomputes each
block of the vocabulary's logits for all tokens and turns them at once into that block's rows of the
head weight's gradient and a contribution to the hidden states' gradient. Only one chunk's (or
block's) logits and the per-token log-sum-exp (4 bytes a token) are ever live, and the weight
gradient is one weight-sized buffer written block by block.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from jfsdp.engine.parallel import vocab
from jfsdp.train import loss_parallel


def _chunks(n: int, chunk: int) -> int:
    return -(-n // chunk)


def _logits(h, w, vocab_major: bool):
    """h (c, d) times the head weight: w is (d, V), or (V, d) for a tied embedding (no transpose is
    materialised: the contraction names the axis). Accumulated in fp32."""
    dims = (((1,), (1,)), ((), ())) if vocab_major else (((1,), (0,)), ((), ()))
    return lax.dot_general(h, w, dims, preferred_element_type=jnp.float32)


def _prepare(h, targets, weights, chunk):
    d = h.shape[-1]
    h, targets = h.reshape(-1, d), targets.reshape(-1)
    weights = jnp.ones(targets.shape, jnp.float32) if weights is None else weights.reshape(-1).astype(jnp.float32)
    n = targets.shape[0]
    k = _chunks(n, chunk)
    pad = k * chunk - n
    if pad:   # padded rows get weight 0: they add nothing to the loss or the gradients
        h = jnp.pad(h, ((0, pad), (0, 0)))
        targets = jnp.pad(targets, (0, pad))
        weights = jnp.pad(weights, (0, pad))
    return h.reshape(k, chunk, d), targets.reshape(k, chunk), weights.reshape(k, chunk), n


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _lce(h, w, targets_weights, chunk, vocab_major):
    return _lce_fwd(h, w, targets_weights, chunk, vocab_major)[0]


def _lce_fwd(h, w, targets_weights, chunk, vocab_major):
    targets, weights = targets_weights
    hc, tc, wc, _ = _prepare(h, targets, weights, chunk)

    def body(total, xs):
        hi, ti, wi = xs
        logits = _logits(hi, w, vocab_major)
        lse = jax.nn.logsumexp(logits, axis=-1)
        picked = jnp.take_along_axis(logits, ti[:, None], axis=-1)[:, 0]
        return total + jnp.sum((lse - picked) * wi), lse

    total, lse = lax.scan(body, jnp.zeros((), jnp.float32), (hc, tc, wc))
    return total, (h, w, targets_weights, lse)


def _lce_bwd(chunk, vocab_major, res, g):
    """The backward pass walks over blocks of the vocabulary, not chunks of tokens: block j's
    logits for all tokens (recomputed, then turned into softmax - onehot with the saved lse) give
    that block's rows of the weight gradient complete, written in place into one weight-sized
    buffer, and a contribution to dh (tokens x d, small). A token-chunked backward instead adds a
    whole weight-sized partial product per chunk, and XLA:CPU held three weight-sized buffers for it
    (accumulator, partial product, sum: three head-sized buffers).
    The last block is shifted back to end at the vocabulary's end (no padded copy of the weight);
    the columns it shares with the block before are rewritten with the same values in the weight
    gradient and masked out of dh."""
    h, w, (targets, weights), lse = res
    d = h.shape[-1]
    hf, t = h.reshape(-1, d), targets.reshape(-1)
    n = t.shape[0]
    wt = jnp.ones((n,), jnp.float32) if weights is None else weights.reshape(-1).astype(jnp.float32)
    scale = (wt * g)[:, None]
    lse = lse.reshape(-1)[:n, None]
    vocab = w.shape[0] if vocab_major else w.shape[1]
    vb = loss_parallel.vocab_block(chunk, n, vocab)
    axis = 0 if vocab_major else 1

    def body(carry, j):
        start = jnp.minimum(j * vb, vocab - vb)
        wj = lax.dynamic_slice_in_dim(w, start, vb, axis)
        cols = start + jnp.arange(vb)
        logits = _logits(hf, wj, vocab_major)                       # (n, vb) fp32
        dl = ((jnp.exp(logits - lse) - (t[:, None] == cols[None, :])) * scale).astype(h.dtype)
        return loss_parallel.add_block(carry, dl, hf, wj, start, cols, j * vb, axis, vocab_major), None

    init = (jnp.zeros((n, d), jnp.float32), jnp.zeros(w.shape, w.dtype))
    (dh, dw), _ = lax.scan(body, init, jnp.arange(-(-vocab // vb)))
    return dh.astype(h.dtype).reshape(h.shape), dw, loss_parallel.no_cotangents((targets, weights))


_lce.defvjp(_lce_fwd, _lce_bwd)


def linear_cross_entropy(h, w, targets, *, weights=None, chunk: int = 256, vocab_major: bool = False,
                         reduction: str = "mean"):
    """Cross-entropy of `softmax(h @ w)` against integer `targets`, without the full logits.

    h: (..., d) hidden states (bf16 or fp32; matmuls accumulate in fp32, softmax runs in fp32).
    w: the head weight, (d, V), or (V, d) with `vocab_major=True` (a tied embedding table).
    targets: (...) int token ids. weights: optional (...) per-token weights (0 drops a token).
    chunk: tokens per chunk; peak extra memory is about chunk x V x 4 bytes.
    reduction: 'mean' (over the weights' sum, or the token count), or 'sum'.
    Gradients flow to h and w (not to targets or weights)."""
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    if chunk < 1:
        raise ValueError(f"chunk must be positive, got {chunk}")
    n = targets.size
    chunk = min(chunk, max(n, 1))
    total = _lce(h, w, (targets, weights), chunk, vocab_major)
    if reduction == "sum":
        return total
    denom = jnp.float32(n) if weights is None else jnp.sum(weights.astype(jnp.float32))
    return total / denom


def lm_loss(*, vocab_major: bool, chunk: int = 256):
    """A `loss_fn(outputs, batch)` for jfsdp whose model head returns `(hidden, head_weight)` instead
    of logits (e.g. `Stacked(root, unit, n, head_method="head_features")` for models/llama.py): the
    mean next-token cross-entropy against `batch["targets"]` through `linear_cross_entropy`, so the
    logits of the batch never exist. `vocab_major`: the weight is (V, d), a tied embedding table."""
    def loss_fn(outputs, batch):
        h, w = outputs
        shard = vocab.current()
        if shard is not None:   # w holds this tensor rank's share of the vocabulary (engine/parallel/vocab.py)
            targets = batch["targets"]
            c = min(chunk, max(targets.size, 1))
            hc, tc, wc, n = _prepare(h, targets, None, c)
            total = loss_parallel.linear_cross_entropy(hc.reshape(-1, h.shape[-1]), w, (tc.reshape(-1), wc.reshape(-1)),
                                                       c, vocab_major, shard)
            return total / jnp.float32(n)
        return linear_cross_entropy(h, w, batch["targets"], chunk=chunk, vocab_major=vocab_major)
    loss_fn.chunk, loss_fn.vocab_major = chunk, vocab_major   # for the planner's estimate (jfsdp.planning.estimate)
    loss_fn.vocab_parallel = True   # reduces over `tensor` under a vocabulary-parallel root
    return loss_fn


def logits_loss():
    """A `loss_fn(logits, batch)` for a head that returns logits: the mean next-token cross-entropy against
    `batch["targets"]` (log-softmax in fp32). Under a vocabulary-parallel root (the logits hold 1/T of the
    vocabulary) it reduces over `tensor` (train/loss_parallel.py); otherwise it is the plain computation."""
    def loss_fn(logits, batch):
        shard = vocab.current()
        if shard is not None:
            return jnp.mean(loss_parallel.cross_entropy(logits, batch["targets"], shard))
        logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        nll = -jnp.take_along_axis(logp, batch["targets"][..., None], axis=-1)[..., 0]
        return jnp.mean(nll)
    loss_fn.vocab_parallel = True
    return loss_fn
