"""The order of a sequence's tokens under context parallelism (docs/context-parallel.md), jax-free: the data
loader applies it once per batch, the engine's ring attention relies on it.

"Zigzag" (head-tail) load balance: a causal mask gives the rank holding the end of the sequence all the
work, so the sequence is cut into 2C chunks of T/2C tokens and rank r of the C context ranks holds chunks
r and 2C-1-r: one early and one late chunk each, the same count of unmasked (query, key) pairs on every
rank. The permutation is the tokens' positions in the order the ranks hold them, which are also the
positions RoPE must use."""
from __future__ import annotations

import numpy as np

from jfsdp.config.errors import ConfigError


def zigzag_order(seq_len: int, context: int) -> np.ndarray:
    """The sequence's positions in the order the ranks hold them: rank after rank, chunk r then chunk 2C-1-r."""
    if seq_len % (2 * context):
        raise ConfigError(f"a sequence of {seq_len} tokens cannot be split over context {context}: context "
                          f"parallelism cuts it into 2*C = {2 * context} equal chunks")
    n = seq_len // (2 * context)
    chunks = np.arange(seq_len).reshape(2 * context, n)
    return np.concatenate([np.concatenate([chunks[r], chunks[2 * context - 1 - r]]) for r in range(context)])


def zigzag(x, context: int, axis: int = 1):
    """Tokens in sequence order -> the order the ranks hold them (numpy or jax arrays)."""
    return x.take(zigzag_order(x.shape[axis], context), axis=axis)


def unzigzag(x, context: int, axis: int = 1):
    """The inverse of `zigzag`."""
    return x.take(np.argsort(zigzag_order(x.shape[axis], context)), axis=axis)
