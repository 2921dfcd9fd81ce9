"""The Llama MLP over the sequence in tiles (models/llama.py's `mlp_tile`), with its own VJP.

The tiles run in while loops (forward: each tile's output written into the (B, T, d) output; backward: each
tile's SwiGLU recomputed and differentiated, its dx written into dx and its weight gradients added to sums
in the weights' dtype, as the scan's transpose summed them), and every buffer those loops write into is made from a zero tied to an input of the call
(`lax.optimization_barrier`). A `nn.scan` over the tiles builds its stacked outputs (the forward's y, the
backward's dx) from constant zeros that depend on nothing; XLA:GPU hoists those out of the loop over layers,
so one (B, T, d) buffer lived through the whole step: 1.5 GiB of llama-8b at 196,608 tokens per device
(docs/context-parallel.md). Tied, each is made where its loop runs and freed after it, as the blockwise
kernel's are (models/attention.py `tied_zeros`). The values are the untiled MLP's, tile by tile."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from models.attention import index_loop, tied_zeros


def _dense(x, w):
    """flax.linen.Dense without bias: both operands promoted to their common dtype, x's last axis contracted."""
    dt = jnp.result_type(x, w)
    return lax.dot_general(x.astype(dt), w.astype(dt), (((x.ndim - 1,), (0,)), ((), ())))


def swiglu(x, w1, w3, w2):
    return _dense(jax.nn.silu(_dense(x, w1)) * _dense(x, w3), w2)


def _tile(a, i, tile):
    return lax.dynamic_slice_in_dim(a, i * tile, tile, axis=1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def tiled_swiglu(x, w1, w3, w2, tile: int):
    """swiglu(x, ...) over x's axis 1 (tokens) in tiles of `tile` (a divisor of it). Each tile's part runs
    under jax.checkpoint (what the planner's working set counts per part: jfsdp/planning/activations.py)."""
    n = x.shape[1] // tile
    part = jax.checkpoint(swiglu, prevent_cse=False)
    out = jax.eval_shape(swiglu, jax.ShapeDtypeStruct((*x.shape[:1], tile, *x.shape[2:]), x.dtype), w1, w3, w2)
    y = tied_zeros((x.shape[0], x.shape[1], *out.shape[2:]), out.dtype, x)
    body = lambda i, y: lax.dynamic_update_slice_in_dim(y, part(_tile(x, i, tile), w1, w3, w2), i * tile, axis=1)
    return index_loop(0, n, body, y)


def _fwd(x, w1, w3, w2, tile):
    return tiled_swiglu(x, w1, w3, w2, tile), (x, w1, w3, w2)


def _bwd(tile, res, dy):
    x, *ws = res
    n = x.shape[1] // tile
    sums = tuple(tied_zeros(w.shape, w.dtype, dy) for w in ws)

    def body(i, carry):
        dx, acc = carry
        _, vjp = jax.vjp(swiglu, _tile(x, i, tile), *ws)
        dxt, *dws = vjp(_tile(dy, i, tile))
        dx = lax.dynamic_update_slice_in_dim(dx, dxt.astype(dx.dtype), i * tile, axis=1)
        return dx, tuple(a + d.astype(a.dtype) for a, d in zip(acc, dws))
    dx, acc = index_loop(0, n, body, (tied_zeros(x.shape, x.dtype, dy), sums))
    return (dx, *(a.astype(w.dtype) for a, w in zip(acc, ws)))


tiled_swiglu.defvjp(_fwd, _bwd)
