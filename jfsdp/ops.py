"""Memory-lean operations any model can use: a fused, chunked output head + cross-entropy.
(The O(T)-memory attention lives with the models, `models/attention.py`, as pure JAX.)

The output head of a language model is where a training step peaks: for 2048 tokens of a 128k
vocabulary, one fp32 copy of the logits is 1 GiB, and the plain `log_softmax` path keeps several
(logits, their exponentials, the gradient of the logits, a transposed copy for the weight gradient).
`linear_cross_entropy` never forms the logits of all tokens: it walks over chunks of tokens, and for
each chunk computes the logits, their log-sum-exp and the loss; the backward pass recomputes each
chunk's logits and turns them at once into the gradients of the hidden states and of the head
weight. Only one chunk's logits and the per-token log-sum-exp (4 bytes a token) are ever live.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax


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
    h, w, (targets, weights), lse = res
    hc, tc, wc, n = _prepare(h, targets, weights, chunk)
    vocab = w.shape[0] if vocab_major else w.shape[1]

    def body(dw, xs):
        hi, ti, wi, li = xs
        logits = _logits(hi, w, vocab_major)
        # d(lse - logit[t]) / d logits = softmax - onehot, per token scaled by its weight and g
        dlogits = (jnp.exp(logits - li[:, None]) - jax.nn.one_hot(ti, vocab, dtype=jnp.float32)) * (wi * g)[:, None]
        dl = dlogits.astype(h.dtype)
        if vocab_major:   # w (V, d): dh = dl @ w, dw = dl^T @ h
            dh = lax.dot_general(dl, w, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
            dwi = lax.dot_general(dl, hi, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)
        else:             # w (d, V): dh = dl @ w^T, dw = h^T @ dl
            dh = lax.dot_general(dl, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
            dwi = lax.dot_general(hi, dl, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)
        return dw + dwi, dh.astype(h.dtype)

    dw, dh = lax.scan(body, jnp.zeros(w.shape, jnp.float32), (hc, tc, wc, lse))
    dh = dh.reshape(-1, h.shape[-1])[:n].reshape(h.shape)
    zeros = jax.tree.map(lambda x: jnp.zeros(x.shape, jax.dtypes.float0) if jnp.issubdtype(x.dtype, jnp.integer)
                         else jnp.zeros_like(x), (targets, weights))
    return dh, dw.astype(w.dtype), zeros


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
        return linear_cross_entropy(h, w, batch["targets"], chunk=chunk, vocab_major=vocab_major)
    loss_fn.chunk, loss_fn.vocab_major = chunk, vocab_major   # for the planner's estimate (jfsdp.memory)
    return loss_fn
