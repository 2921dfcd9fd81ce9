"""Megatron tensor parallelism with sequence parallelism, by hand, inside the engine's `shard_map`.

Between units the residual stream h is sharded on its sequence axis over `tensor`: norms, residual adds,
the embedding and the head run on 1/T of the tokens. Inside a unit:
- the input of a module that holds colwise layers (Llama's `attention`, `feed_forward`) is all-gathered
  over `tensor` on the sequence, once for all of its colwise layers;
- a colwise Dense multiplies the whole sequence by its kernel slice (out/T features: its share of the
  heads, or of the FFN width); what follows (rotary, attention, SwiGLU) runs on those features alone;
- a rowwise Dense multiplies its feature slice and reduce-scatters the partial sums over `tensor` on the
  sequence, back to the residual stream's layout.
Forward: 2 all-gathers and 2 reduce-scatters over `tensor` per Llama block. Backward: their transposes
(jax's: the transpose of a tiled all-gather is a reduce-scatter and vice versa), the same count.
The calls are intercepted (`nn.intercept_methods`); the model's code stays as written, as long as it
derives the head count of its reshapes from the matmul's output (-1), not from its config.

Async TP (`collective_matmul=True`, the default on GPUs): each of those collectives is decomposed into T
steps of a ring of `ppermute`s, and each matmul into one matmul per sequence block, so that the transfer
of one block overlaps the matmul of the one before (a collective matmul). The gather: the T blocks of h
arrive one hop at a time, and every colwise layer multiplies each block as it arrives. The
reduce-scatter: each step multiplies one block of the rowwise input and adds it to the partial sum
that arrived from the previous rank, which is passed on; after T steps a rank holds the sum of its own
block. The same bytes cross the links as with the one-shot collectives: (T-1) blocks each way. The
backward pass is the transpose of the ring, again one hop per matmul.

Float8 (tensorwise, docs/float8.md): a kernel slice gathered as a `Float8Weight` (scaled by the whole
weight's amax) runs `float8.float8_dot` in `dense`; a feature-sliced operand (a rowwise input, a colwise
gradient) has its amax `pmax`ed over `tensor`, so every cast is the single-device one. A ring's blocks
run `float8_blocks`: one scale for all of them, as the one-shot matmul of the whole sequence has."""
from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from jfsdp.config.errors import ConfigError
from jfsdp.config.mesh import TENSOR_AXIS
from jfsdp.engine import float8
from jfsdp.engine.parallel import moe_rows
from jfsdp.engine.parallel.plan import ROWWISE
from jfsdp.engine.parallel.support import chain


def gather_sequence(x, dim: int):
    """h sharded on the sequence over `tensor` -> the whole sequence (its transpose: a reduce-scatter)."""
    return lax.all_gather(x, TENSOR_AXIS, axis=dim, tiled=True)


def scatter_sequence(y, dim: int):
    """Partial sums over `tensor` of the whole sequence -> their sum, sharded on the sequence."""
    return lax.psum_scatter(y, TENSOR_AXIS, scatter_dimension=dim, tiled=True)


def dense(mod, x, out_dtype=None, axes=(None, None)):
    """nn.Dense's matmul on the kernel slice this rank holds (Flax's own call would refuse its shape):
    (the product in `out_dtype`, None: the compute dtype; the compute dtype). A kernel gathered in float8
    runs `float8.float8_dot`, with x's and the gradient's amax `pmax`ed over `axes` where they are slices."""
    if not isinstance(mod, nn.Dense) or mod.dot_general is not None or mod.dot_general_cls is not None:
        raise ConfigError(f"layer {'/'.join(mod.path)} ({type(mod).__name__}) is tensor-parallel, but only a plain "
                          "nn.Dense (no custom dot_general) can be")
    kernel = float8.kernel_of(mod)
    if isinstance(kernel, float8.Float8Weight):
        dtype = mod.dtype or x.dtype
        return float8.float8_dot(x, kernel.data, kernel.scale, out_dtype or dtype, axes), dtype
    kernel = nn.meta.unbox(kernel)
    x, kernel = mod.promote_dtype(x, kernel, dtype=mod.dtype)
    y = lax.dot_general(x, kernel, (((x.ndim - 1,), (0,)), ((), ())), precision=mod.precision,
                        preferred_element_type=out_dtype)
    return y, x.dtype


def compute_dtype(mod, x):
    """The dtype `dense` computes in (and returns as its second value)."""
    kernel = float8.kernel_of(mod)
    if isinstance(kernel, float8.Float8Weight):
        return mod.dtype or x.dtype
    return mod.promote_dtype(x, nn.meta.unbox(kernel), dtype=mod.dtype)[0].dtype


def dense_blocks(mod, blocks: list, out_dtype=None, axes=(None, None), own=None) -> list:
    """`dense` of each block of a ring: in float8 one scale for all the blocks' x (their amax `pmax`ed
    over axes[0]) and one for all their gradients (axes[1]), as `dense` of the whole sequence scales.
    A ring's gathered blocks give this rank's `own` block: its amax `pmax`ed over `tensor` is theirs,
    known before the ring, so no dot waits for the last block."""
    kernel = float8.kernel_of(mod)
    if not isinstance(kernel, float8.Float8Weight):
        return [dense(mod, b, out_dtype)[0] for b in blocks]
    x_amax = _amax([lax.stop_gradient(b) for b in blocks], axes[0]) if own is None else \
        _amax([lax.stop_gradient(own)], TENSOR_AXIS)
    out_dtype = out_dtype or mod.dtype or blocks[0].dtype
    return list(float8_blocks(tuple(blocks), x_amax, kernel.data, kernel.scale, out_dtype, axes))


def _amax(parts, axis):
    m = functools.reduce(jnp.maximum, [jnp.max(jnp.abs(p)).astype(jnp.float32) for p in parts])
    return m if axis is None else lax.pmax(m, axis)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def float8_blocks(xs: tuple, x_amax, w, w_scale, out_dtype, axes):
    """`float8.float8_dot` of each block x of `xs` by W = w / w_scale, with one scale for all of x (from
    `x_amax`) and one for all of the gradients (the whole sequence's, as one matmul would have)."""
    return _blocks_fwd(xs, x_amax, w, w_scale, out_dtype, axes)[0]


def _blocks_fwd(xs, x_amax, w, w_scale, out_dtype, axes):
    s = float8.scale_for(x_amax, float8.E4M3)
    x8 = [float8.quantize(x, s, float8.E4M3) for x in xs]
    w8 = w.astype(float8.E4M3)
    ys = tuple(checkpoint_name((float8.f32_dot(x, w8, x.ndim - 1, 0) / (s * w_scale)).astype(out_dtype), float8.DOT_OUT)
               for x in x8)
    # the float8 x saved as its bytes, as float8_dot does (remat re-rounds float residuals)
    return ys, (tuple(lax.bitcast_convert_type(x, jnp.uint8) for x in x8), s, w, w_scale, jnp.zeros((0,), xs[0].dtype),
                x_amax)


def _blocks_bwd(out_dtype, axes, res, gs):
    x8_bytes, s, w, ws, like, x_amax = res
    # axes[2:] == ('last',): the last block's gradient is this rank's own block of the whole (the rowwise
    # ring's): its amax pmaxed over axes[1] is all blocks', known before the backward ring runs
    gamax = _amax(gs[-1:] if axes[2:] == ("last",) else gs, axes[1])
    w8, gscale = w.astype(float8.E4M3), float8.scale_for(gamax, float8.E5M2)
    g8 = [float8.quantize(g, gscale, float8.E5M2) for g in gs]
    dxs = tuple((float8.f32_dot(g, w8, g.ndim - 1, 1) / (gscale * ws)).astype(like.dtype) for g in g8)
    k, n = w8.shape
    dw = sum(float8.f32_dot(lax.bitcast_convert_type(x, float8.E4M3).reshape(-1, k), g.reshape(-1, n), 0, 0)
             for x, g in zip(x8_bytes, g8)) / (s * gscale)
    return dxs, jnp.zeros_like(x_amax), dw.astype(w.dtype), jnp.zeros_like(ws)


float8_blocks.defvjp(_blocks_fwd, _blocks_bwd)


def _next_rank(tensor: int) -> list:
    return [(i, (i + 1) % tensor) for i in range(tensor)]


def ring_blocks(x, tensor: int) -> list:
    """This rank's block of the sequence -> every rank's block, in ring order: block k (k hops away)
    is the one of rank (t - k) mod T, t this rank."""
    blocks = [x]
    for _ in range(tensor - 1):
        blocks.append(lax.ppermute(blocks[-1], TENSOR_AXIS, _next_rank(tensor)))
    return blocks


def place_blocks(parts: list, dim: int):
    """`ring_blocks`' order -> the whole sequence: part k goes to block (t - k) mod T of `dim`."""
    tensor, n, t = len(parts), parts[0].shape[dim], lax.axis_index(TENSOR_AXIS)
    # every block is overwritten; starting from copies of part 0 rather than zeros keeps the whole
    # function linear in the parts, so that JAX saves no zero buffer for the backward pass
    out = jnp.concatenate([parts[0]] * tensor, axis=dim)
    for k, part in enumerate(parts):
        out = lax.dynamic_update_slice_in_dim(out, part, ((t - k) % tensor) * n, axis=dim)
    return out


def ring_scatter_dense(mod, x, dim: int, tensor: int, out_dtype=None):
    """`scatter_sequence(dense(mod, x, out_dtype))` as a collective matmul: at step k this rank multiplies
    block (t - 1 - k) mod T of the sequence and adds the partial sum its left neighbour passed on, so
    that at the last step the sum that arrives is its own block's. (The summed block, the compute dtype.)"""
    n, t = x.shape[dim] // tensor, lax.axis_index(TENSOR_AXIS)
    parts = [lax.dynamic_slice_in_dim(x, ((t - 1 - k) % tensor) * n, n, axis=dim) for k in range(tensor)]
    acc = None   # float8: x is a feature slice (its amax pmaxed over `tensor`)
    for y in dense_blocks(mod, parts, out_dtype, (TENSOR_AXIS, TENSOR_AXIS, "last")):
        acc = y if acc is None else lax.ppermute(acc, TENSOR_AXIS, _next_rank(tensor)) + y
    return acc, compute_dtype(mod, x)


def interceptor(modules: dict, sequence_dim: int, reduce_dtype=None, tensor: int = 1, collective_matmul=False, moe=None):
    """A Linen method interceptor for a unit: `modules` is {module path: 'colwise' / 'rowwise'}
    (layout.tp_modules); the parent of every colwise layer gets its input gathered over the sequence.
    A rowwise layer's partial sums leave the matmul in `reduce_dtype` (the precision policy's, fp32 under
    bf16; None: the compute dtype), are reduce-scattered in it and cast back: the sum of the T partials
    is rounded once, as the single-device matmul rounds its accumulator once. (Rounding each partial
    to bf16 first, as Megatron does, put llama-test's outputs 5.2e-3 in L2 from the single-device bf16
    model's, nearly as far as fp32's, 6.1e-3: docs/tensor-parallel.md.) `moe`: an MoE model's jfsdp.MoE,
    whose layer runs inside this interceptor on whole sequences of 1/T of the rows (moe_rows.py)."""
    gathers = {path[:-1] for path, kind in modules.items() if kind != ROWWISE}
    rings = {}   # collective matmul: {a gathering module's path: (the input it was given, its ring's blocks)}
    if () in gathers:
        raise ConfigError("a colwise layer sits at the unit's top level: its input would be the residual stream "
                          "itself; tensor parallelism gathers the input of the module that holds colwise layers")

    def intercept(next_fun, args, kwargs, context):
        mod = context.module
        if context.method_name != "__call__":
            return next_fun(*args, **kwargs)
        path = tuple(mod.path)
        if path in gathers and collective_matmul:
            blocks = ring_blocks(args[0], tensor)
            whole = place_blocks(blocks, sequence_dim)   # for any other use of the input; else dead code
            rings[path] = (whole, blocks)
            try:
                return next_fun(whole, *args[1:], **kwargs)
            finally:
                del rings[path]
        if path in gathers:
            return next_fun(gather_sequence(args[0], sequence_dim), *args[1:], **kwargs)
        kind = modules.get(path)
        if kind is None:
            return next_fun(*args, **kwargs)
        ring = rings.get(path[:-1])
        if kind != ROWWISE and ring is not None and args[0] is ring[0]:
            return place_blocks(dense_blocks(mod, ring[1], axes=(None, TENSOR_AXIS), own=ring[1][0]), sequence_dim)
        if kind != ROWWISE:   # float8: its gradient is a slice of the features, scaled as the whole
            return dense(mod, args[0], axes=(None, TENSOR_AXIS))[0]
        if collective_matmul:
            y, dtype = ring_scatter_dense(mod, args[0], sequence_dim, tensor, reduce_dtype)
        else:
            y, dtype = dense(mod, args[0], reduce_dtype, (TENSOR_AXIS, None))   # float8: x is a feature slice
            y = scatter_sequence(y, sequence_dim)
        y = y.astype(dtype)
        if mod.use_bias:   # replicated over `tensor`: added once, after the sum
            y = y + nn.meta.unbox(mod.get_variable("params", "bias")).astype(y.dtype)
        return y
    return intercept if moe is None else chain([intercept, moe_rows.interceptor(moe, sequence_dim, tensor)])
