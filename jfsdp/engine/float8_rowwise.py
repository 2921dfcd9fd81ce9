"""Rowwise float8 scaling, the second float8 recipe beside tensorwise (jfsdp/engine/float8.py).

Every operand of every float8 matmul gets one fp32 scale per slice along the contracted dimension:
  forward   y  = x  @ W    x: a scale per row (over K)      W: a scale per column (over K)
  backward  dX = g  @ Wᵀ   g: a scale per row (over N)      W: a scale per row (over N)
            dW = xᵀ @ g    x: a scale per column (over M)   g: a scale per column (over M)
A scale that is constant along the contracted dimension factors out of the sum, so the fp32 accumulator
is corrected exactly by the outer product of the two scale vectors. Each scale is fmax / amax of its
slice rounded down to a power of two, so applying and undoing it are exact. All operands are
`float8_e4m3fn`, gradients included: a scale per row only has to cover the range inside one row, so
e5m2's extra binades buy less than e4m3's extra mantissa bit (docs/float8.md measures both).

The weights are all-gathered in param_dtype (bf16), not in float8: the forward pass needs W scaled per
column and dX needs it scaled per row, two different roundings of the same weight. A float8 gather of
one of them cannot give the other without rounding already rounded values, so the gathered bf16
weight is cast twice, once for each. For the same reason x is kept for the backward pass in its own
dtype, not as float8 bytes: dW casts it again, per column. `RowwiseLayout` marks the selected kernels;
its gather is the plain `unshard` (2 bytes per parameter on the wire under bf16, as the planner
counts), whose result is wrapped in a `RowwiseWeight` for the Dense interceptor to find."""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from jfsdp.config.errors import ConfigError
from jfsdp.engine.fsdp import Comm, reduce_gradient, treat_as_dot, unshard
from jfsdp.engine.layout import Layout

E4M3 = jnp.float8_e4m3fn
EPS = 1e-12   # amax floor: an all-zero slice gets a finite scale
DOT_OUT = "jfsdp_float8_rowwise_dot"


def pow2_scale(amax, dtype=E4M3):
    """fmax / amax rounded down to a power of two (fp32): the slice's largest element lands in the
    format's top binade without saturating, and multiplying or dividing by the scale is exact."""
    s = float(jnp.finfo(dtype).max) / jnp.maximum(amax.astype(jnp.float32), EPS)
    _, e = jnp.frexp(s)                        # s = m * 2**e with m in [0.5, 1)
    return jnp.ldexp(jnp.ones_like(s), e - 1)


def cast_along(x, axis, dtype=E4M3):
    """(x in float8, its scales): one scale per slice of x along `axis` (the amax over that axis,
    kept as a dimension of size 1), values saturated to the format's finite range."""
    s = pow2_scale(jnp.max(jnp.abs(x.astype(jnp.float32)), axis=axis, keepdims=True), dtype)
    m = float(jnp.finfo(dtype).max)
    return jnp.clip(x.astype(jnp.float32) * s, -m, m).astype(dtype), s


def _dot(a, b, ca, cb):
    return lax.dot_general(a, b, (((ca,), (cb,)), ((), ())), preferred_element_type=jnp.float32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def rowwise_dot(x, w, out_dtype):
    """x (..., K) @ w (K, N) in float8 with rowwise scales (module docstring), fp32 accumulation, the
    result in `out_dtype`."""
    return _fwd(x, w, out_dtype)[0]


def _fwd(x, w, out_dtype):
    x8, sx = cast_along(x, -1)          # (..., 1): one scale per row of x
    w8, sw = cast_along(w, 0)           # (1, N): one per column of w
    y = _dot(x8, w8, x.ndim - 1, 0) * (1.0 / sx) * (1.0 / sw)
    y = checkpoint_name(y.astype(out_dtype), DOT_OUT)   # what remat 'dots' keeps (fsdp.treat_as_dot)
    # x and w in their own dtypes: the backward pass casts them again along other axes. Whether w is
    # kept is the gather's decision (the checkpoint policy on `unshard`), as for any gathered weight.
    return y, (x, w)


def _bwd(out_dtype, res, g):
    x, w = res
    k, n = w.shape
    g8, sg = cast_along(g, -1)          # (..., 1): per row of g, over N
    wr8, swr = cast_along(w, 1)         # (K, 1): per row of w, over N
    dx = _dot(g8, wr8, g.ndim - 1, 1) * (1.0 / sg) * (1.0 / swr.reshape(1, k))
    # dW contracts over the rows (tokens): x and g are cast per column, over this device's rows only
    xc8, sxc = cast_along(x.reshape(-1, k), 0)    # (1, K)
    gc8, sgc = cast_along(g.reshape(-1, n), 0)    # (1, N)
    dw = _dot(xc8, gc8, 0, 0) * (1.0 / sxc.reshape(k, 1)) * (1.0 / sgc)
    return dx.astype(x.dtype), dw.astype(w.dtype)   # dW in the compute dtype, as the bf16 policy's


rowwise_dot.defvjp(_fwd, _bwd)
treat_as_dot(DOT_OUT)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class RowwiseWeight(nn.meta.AxisMetadata):
    """A gathered unit weight (param_dtype) marked for the rowwise float8 matmul. Flax unboxes it to the
    weight itself when a module other than an intercepted Dense reads it."""
    data: Any

    def dot(self, x, out_dtype):
        """x (..., K) @ this weight seen as (K, N)."""
        return rowwise_dot(x, self.data.reshape(x.shape[-1], -1), out_dtype)

    def unbox(self):
        return self.data

    def replace_boxed(self, val):
        raise ConfigError("a float8 weight cannot be replaced inside the unit")

    def add_axis(self, index, params):
        return self

    def remove_axis(self, index, params):
        return self


@dataclasses.dataclass(frozen=True)
class RowwiseLayout(Layout):
    """A unit kernel that runs the rowwise float8 matmul: gathered by the plain `unshard` (param_dtype on
    the wire; no `wire_itemsize`, so the planner counts param_dtype's bytes) and marked `RowwiseWeight`."""

    def unshard(self, shard, comm: Comm):
        return RowwiseWeight(unshard(shard, self, comm))

    def reduce(self, g, comm: Comm):
        return reduce_gradient(g.data if isinstance(g, RowwiseWeight) else g, self, comm)
