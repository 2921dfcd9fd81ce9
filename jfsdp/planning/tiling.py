"""`python -m jfsdp.plan --mlp-tile auto`: which tile of the sequence the Llama MLP runs in (models/llama.py's
`mlp_tile`; docs/context-parallel.md).

The rule: no tiling where the untiled plan fits (a tile costs a loop and smaller matmuls); otherwise the
largest tile, halving the tokens per device, whose estimate fits the device memory. The working set it
saves is linear in the tile (tile x ffn intermediates), so halving further buys less and less; the search
stops at the model's width in tokens, Arctic Long Sequence Training's TiledMLP choice (ceil(T / d) tiles),
where a tile's tile x ffn intermediates are about one MLP weight matrix, small beside the units' saved
inputs. If even that tile does not fit, it is chosen all the same: the report then says it does not fit."""
from __future__ import annotations

from typing import Callable


def candidates(tokens: int, width: int) -> list[int]:
    """The tiles tried, largest first: tokens / 2, tokens / 4, ... while they divide the tokens and stay at
    or above `width` (at least one, the first halving, where tokens >= 2)."""
    out, t = [], tokens
    while t % 2 == 0 and t // 2 >= 1 and (not out or t // 2 >= width):
        t //= 2
        out.append(t)
    return out


def choose(total: Callable[[int], int], tokens: int, budget: int, cfg, tensor: int = 1) -> int:
    """The tile (0: off) for a plan whose estimated total bytes per device under tile t is `total(t)`,
    `tokens` per device, `budget` bytes per device, model config `cfg` (its `dim`). Bisection over the
    candidates: the total falls as the tile does."""
    if tensor > 1 or not hasattr(cfg, "mlp_tile") or total(0) <= budget:
        return 0
    tiles = candidates(tokens, getattr(cfg, "dim", 1))
    if not tiles:
        return 0
    lo, hi = -1, len(tiles) - 1          # tiles[hi] is the answer if nothing larger fits
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if total(tiles[mid]) <= budget:
            hi = mid
        else:
            lo = mid
    return tiles[hi]
