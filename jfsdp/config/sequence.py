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


def check_mlp_tile(tile: int, seq_len: int, context: int = 1, tensor: int = 1) -> None:
    """ConfigError unless `tile` (tokens; 0 = off) divides the tokens each device's units see: seq_len / C.
    The MLP runs over those tokens tile by tile (models/llama.py's `mlp_tile`; docs/context-parallel.md)."""
    if tile < 0:
        raise ConfigError(f"--mlp-tile must not be negative, got {tile} (0: no tiling)")
    if tile and tensor > 1:
        raise ConfigError(f"--mlp-tile with --tensor {tensor} is not supported yet: tensor parallelism splits the "
                          "MLP's sequence over `tensor` (docs/context-parallel.md)")
    local = seq_len // context
    if tile and local % tile:
        where = f"the {local} tokens per device (--seq-len {seq_len} / --context {context})" if context > 1 else \
            f"--seq-len {seq_len}"
        raise ConfigError(f"--mlp-tile {tile} does not divide {where}: the MLP runs over the sequence in equal tiles")
