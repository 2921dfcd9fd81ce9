"""Float8 training: the units' dense matmuls in float8 with dynamic tensorwise scaling, and the unit
weights all-gathered in float8 (one byte per parameter on the wire), as FSDP2 does with float8 linears
(docs/float8.md has the why of each choice).

Scaling: one fp32 scale per tensor, `scale = fmax / amax`, from the tensor itself every step. Forward
operands are `float8_e4m3fn`; the gradient flowing into a matmul is `float8_e5m2` (wider range for
heavy-tailed gradients). Products accumulate in fp32; outputs come back in the activations' dtype.

The float8 all-gather (`unshard_float8`): each device's amax of its shard of the master weight is
`pmax`ed (over `fsdp`, and `tensor` at T > 1), so the gathered float8 weight is bit for bit the cast of
the whole weight; its VJP is the plain path's `reduce_gradient`, and a checkpoint policy sees it as `unshard`.

The matmuls are reached without model code: the unit runs under `nn.intercept_methods(interceptor)`; a
Dense whose kernel arrives as a `Float8Weight` runs `float8_dot` (at T > 1 parallel/tensor.py's `dense`
does). Which kernels: one traced call of each unit (`dense_kernels`), filtered by `Float8`.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from jfsdp.config.errors import ConfigError
from jfsdp.config.policy import Float8
from jfsdp.config.mesh import FSDP_AXIS, TENSOR_AXIS
from jfsdp.engine.fsdp import Comm, Unreduced, reduce_gradient, treat_as_unshard, treat_as_dot
from jfsdp.engine.layout import Layout, is_layout, paths
from jfsdp.engine.float8_rowwise import RowwiseLayout, RowwiseWeight

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
EPS = 1e-12   # amax floor: an all-zero tensor gets a finite scale
DOT_OUT = "jfsdp_float8_dot"


def scale_for(amax, dtype):
    """The tensorwise scale that maps `amax` onto `dtype`'s largest finite value (fp32)."""
    return (float(jnp.finfo(dtype).max) / jnp.maximum(amax.astype(jnp.float32), EPS)).astype(jnp.float32)


def quantize(x, scale, dtype):
    """x * scale, saturated to dtype's finite range, cast to the float8 dtype."""
    m = float(jnp.finfo(dtype).max)
    return jnp.clip(x.astype(jnp.float32) * scale, -m, m).astype(dtype)


def dynamic(x, dtype, axis=None):
    """(x in float8, its scale) with the scale from x's own amax (`pmax`ed over mesh `axis` where given)."""
    amax = jnp.max(jnp.abs(x))
    s = scale_for(amax if axis is None else lax.pmax(amax, axis), dtype)
    return quantize(x, s, dtype), s


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Float8Weight(nn.meta.AxisMetadata):
    """A gathered unit weight in float8: `data` (the whole weight times `scale`, e4m3 values held in
    bf16, an exact widening after the gather: a float8 array could not carry the bf16 gradient through
    jax's transposes, which cast cotangents to the primal's dtype) and its fp32 scale. Flax unboxes it (`unbox`) to the bf16 weight it stands for when a module other than an
    intercepted Dense reads it; an intercepted Dense multiplies with `data` directly."""
    data: Any
    scale: Any

    def dot(self, x, out_dtype):
        """x (..., K) @ this weight seen as (K, N): `float8_dot`."""
        return float8_dot(x, self.data.reshape(x.shape[-1], -1), self.scale, out_dtype)

    def unbox(self):
        return dequantize(self.data, self.scale)

    def replace_boxed(self, val):
        raise ConfigError("a float8 weight cannot be replaced inside the unit")

    def add_axis(self, index, params):
        return self

    def remove_axis(self, index, params):
        return self


KERNELS = (Float8Weight, RowwiseWeight)   # gathered kernels that the interceptor runs in float8 (`.dot`)


# ---- the matmul: e4m3 x e4m3 forward, e5m2 gradients, fp32 accumulation, bf16 out
@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def float8_dot(x, w, w_scale, out_dtype, axes=(None, None)):
    """x (..., K) @ W (K, N) where W = w / w_scale and w holds e4m3 values (in any wider dtype: the cast
    to e4m3 is exact); x is cast to e4m3 with its own dynamic scale. `axes`: the mesh axes over which
    x's and the gradient's amax are `pmax`ed (a tensor-parallel slice scaled as the whole tensor)."""
    return _dot_fwd(x, w, w_scale, out_dtype, axes)[0]


def f32_dot(a, b, ca, cb):   # a · b on a's axis ca and b's axis cb, accumulated in fp32
    return lax.dot_general(a, b, (((ca,), (cb,)), ((), ())), preferred_element_type=jnp.float32)


def _dot_fwd(x, w, w_scale, out_dtype, axes=(None, None)):
    x8, xs = dynamic(x, E4M3, axes[0])
    y = f32_dot(x8, w.astype(E4M3), x.ndim - 1, 0) * (1.0 / (xs * w_scale))
    y = checkpoint_name(y.astype(out_dtype), DOT_OUT)   # what remat 'dots' keeps (fsdp.treat_as_dot)
    # w itself is the residual, not its e4m3 cast: whether it is kept is the gather's decision (the
    # checkpoint policy on unshard_float8), as for any matmul on a gathered weight
    # x8 is saved as its bytes: remat re-rounds float residuals with reduce_precision, which reads e4m3fn's
    # top binade (256..448) as infinity (measured: NaN gradients with remat none)
    x8_bytes = lax.bitcast_convert_type(x8, jnp.uint8)
    return y, (x8_bytes, xs, w, w_scale, jnp.zeros((0,), x.dtype))  # (0,): x's dtype


def _dot_bwd(out_dtype, axes, res, g):
    x8_bytes, xs, w, ws, like_x = res
    x8, w8 = lax.bitcast_convert_type(x8_bytes, E4M3), w.astype(E4M3)
    g8, gs = dynamic(g, E5M2, axes[1])
    dx = (f32_dot(g8, w8, g.ndim - 1, 1) * (1.0 / (gs * ws))).astype(like_x.dtype)
    k, n = w8.shape
    # the weight's gradient, by the convention of Float8Weight: with respect to the weight it stands for
    dw = f32_dot(x8.reshape(-1, k), g8.reshape(-1, n), 0, 0) * (1.0 / (xs * gs))
    return dx, dw.astype(w.dtype), jnp.zeros_like(ws)


float8_dot.defvjp(_dot_fwd, _dot_bwd)


@jax.custom_vjp
def dequantize(w, scale):
    """The bf16 weight a Float8Weight stands for (a module reading it as an array); cotangent to `data`."""
    return (w.astype(jnp.float32) / scale).astype(w.dtype)


dequantize.defvjp(lambda w8, s: (dequantize(w8, s), s), lambda s, g: (g, jnp.zeros_like(s)))


# ---- the float8 all-gather
def unshard_float8(shard, layout: Layout, comm: Comm, amax=None):
    """A weight's row-shard (master dtype) -> Float8Weight of the whole weight. The amax is `pmax`ed
    over `fsdp` first (padding rows are zeros), so the scale is the whole tensor's on every device;
    `amax` passes that value in where the caller has it already (`unit_amaxes`)."""
    if amax is None:
        amax = jnp.max(jnp.abs(lax.stop_gradient(shard))).astype(jnp.float32)   # the scale is not differentiated
        ax = getattr(layout, "amax_axes", (FSDP_AXIS,))   # a plain Layout: fsdp
        amax = lax.pmax(amax, ax) if layout.shards > 1 or ax != (FSDP_AXIS,) else amax
    return _unshard_float8(shard, amax, layout, comm)


def unit_amaxes(stacked, layouts):
    """The amax of every float8 leaf of every unit of a stage (`Float8Layout`; a `fsdp.Unreduced` pair's
    shard), `pmax`ed in one all-reduce: a tree like `layouts` of (units,) arrays (None: no float8 leaf),
    taken once per pass (pipeline.py): no all-reduce between a prefetched gather and what hides it."""
    ls, tdef = jax.tree.flatten(layouts, is_leaf=is_layout)
    xs = [lax.stop_gradient(x.shard if isinstance(x, Unreduced) else x) for x in tdef.flatten_up_to(stacked)]
    picks = [i for i, l in enumerate(ls) if isinstance(l, Float8Layout)]
    if not picks:
        return None
    local = jnp.stack([jnp.max(jnp.abs(xs[i].reshape(xs[i].shape[0], -1)), axis=1).astype(jnp.float32)
                       for i in picks])
    ax, shards = ls[picks[0]].amax_axes, ls[picks[0]].shards
    local = lax.pmax(local, ax) if shards > 1 or ax != (FSDP_AXIS,) else local
    row = dict(zip(picks, local))
    return tdef.unflatten([row.get(i) for i in range(len(ls))])


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _unshard_float8(shard, amax, layout: Layout, comm: Comm):
    scale = scale_for(amax, E4M3)
    w8 = quantize(shard, scale, E4M3)
    if layout.shards > 1:
        w8 = lax.all_gather(w8, FSDP_AXIS, axis=0, tiled=True)
    return Float8Weight(layout.unpad(w8).astype(comm.param_dtype or shard.dtype), scale)


def _unshard_float8_fwd(shard, amax, layout, comm):
    return _unshard_float8(shard, amax, layout, comm), None


def _unshard_float8_bwd(layout, comm, _, g):
    return reduce_gradient(g.data, layout, comm), None


_unshard_float8.defvjp(_unshard_float8_fwd, _unshard_float8_bwd)
treat_as_unshard(_unshard_float8_bwd)
treat_as_dot(DOT_OUT)


def kernel_of(module):
    """The raw kernel variable a Dense module will read (boxes other than the float8 KERNELS opened)."""
    k = module.get_variable("params", "kernel")
    while isinstance(k, nn.meta.AxisMetadata) and not isinstance(k, KERNELS):
        k = k.unbox()
    return k


def _dense_call(mod, x, w: Float8Weight):
    """nn.Dense / nn.DenseGeneral (no batch_dims) on a float8 kernel: contracted axes moved last and
    flattened, one float8_dot, reshaped back; bias added in the output dtype."""
    axes = getattr(mod, "axis", -1)
    axes = tuple(a % x.ndim for a in ((axes,) if isinstance(axes, int) else axes))
    rest = [a for a in range(x.ndim) if a not in axes]
    xt = jnp.transpose(x, rest + list(axes)) if rest + list(axes) != list(range(x.ndim)) else x
    k = math.prod(x.shape[a] for a in axes)
    feats = w.data.shape[len(axes):]
    out_dtype = mod.dtype or x.dtype
    y = w.dot(xt.reshape(*xt.shape[:len(rest)], k), out_dtype)   # Float8Weight or RowwiseWeight
    y = y.reshape(*xt.shape[:len(rest)], *feats)
    if mod.use_bias:
        y = y + jnp.asarray(nn.meta.unbox(mod.get_variable("params", "bias"))).astype(out_dtype)
    return y


def handles(mod) -> bool:
    """Whether the interceptor can run this module's matmul in float8."""
    return isinstance(mod, nn.Dense) or (isinstance(mod, nn.DenseGeneral) and not mod.batch_dims)


def interceptor(next_fun, args, kwargs, context):
    """flax method interceptor: a Dense whose kernel is a Float8Weight runs `float8_dot`."""
    mod = context.module
    if context.method_name != "__call__" or not handles(mod) or not mod.has_variable("params", "kernel"):
        return next_fun(*args, **kwargs)
    w = kernel_of(mod)
    if not isinstance(w, KERNELS):
        return next_fun(*args, **kwargs)
    return _dense_call(mod, *args, w)


def dense_kernels(unit, params, h) -> dict:
    """{path of a kernel in the unit's parameter tree (keystr): its shape} for every Dense the interceptor
    can run in float8, from a traced (abstract) call of the unit."""
    found = {}

    def spy(next_fun, args, kwargs, context):
        mod = context.module
        if context.method_name == "__call__" and handles(mod) and mod.has_variable("params", "kernel"):
            path = "".join(f"[{p!r}]" for p in (*mod.path, "kernel"))
            found[path] = tuple(jnp.shape(nn.meta.unbox(mod.get_variable("params", "kernel"))))
        return next_fun(*args, **kwargs)

    def run(p, x):
        with nn.intercept_methods(spy):
            return unit.apply({"params": p}, x)
    jax.eval_shape(run, params, h)
    return found


def mark_stages(model, h_shapes, stage_layouts, spec: Float8, param_dtype) -> list:
    """Each stage's unit layout tree with the kernels that `spec` selects marked `Float8Layout` (found by
    tracing each unit once, abstractly). ConfigError when the filter selects no matmul at all."""
    out, found = [], {}
    for j, (st, layouts) in enumerate(zip(model.stages, stage_layouts)):   # traced with whole kernels,
        params = jax.tree.map(lambda l: jax.ShapeDtypeStruct(l.full_shape, param_dtype or l.dtype), layouts,
                              is_leaf=is_layout)   # selected by the slice a tensor rank multiplies
        slices = paths(layouts, is_layout)
        kernels = {p: slices[p].shape for p in dense_kernels(st.unit, params, h_shapes[j])}
        found.update({f"stage {j}{p}": s for p, s in kernels.items()})
        out.append(mark(layouts, spec.select(kernels), spec.recipe))
    marked = (Float8Layout, RowwiseLayout)
    if not any(isinstance(l, marked) for t in out for l in jax.tree.leaves(t, is_leaf=is_layout)):
        raise ConfigError(f"float8: the filter selects no unit matmul ({len(found)} Dense kernels in the units; "
                          f"skip={list(spec.skip)}, min_size={spec.min_size}; dimensions must be multiples of 16)")
    return out


def mark(layouts, selected, recipe="tensorwise") -> Any:
    """The unit's layout tree with the selected kernels' leaves as `Float8Layout`s (`RowwiseLayout`s for
    the rowwise recipe, jfsdp/engine/float8_rowwise.py)."""
    flat = paths(layouts, is_layout)
    missing = set(selected) - set(flat)
    if missing:
        raise ConfigError(f"float8: kernels {sorted(missing)} are not parameters of the unit")
    leaves, treedef = jax.tree_util.tree_flatten_with_path(layouts, is_leaf=is_layout)
    return jax.tree_util.tree_unflatten(treedef, [
        as_float8(l, recipe) if jax.tree_util.keystr(p) in selected else l for p, l in leaves])


def as_float8(l: Layout, recipe):
    """A leaf's layout gathered for float8. At T > 1 the amax spans `tensor` too: a kernel slice (or a
    leaf sharded over (fsdp, tensor)) is scaled as the whole weight, as the single-device cast is."""
    if recipe == "rowwise":
        return RowwiseLayout(l.shape, l.dtype, l.shards)
    tp = getattr(l, "tensor", 1) > 1 or TENSOR_AXIS in (l.axes or ())
    return Float8Layout(l.shape, l.dtype, l.shards, l.flat, l.axes, (FSDP_AXIS, TENSOR_AXIS) if tp else (FSDP_AXIS,))


@dataclasses.dataclass(frozen=True)
class Float8Layout(Layout):
    """A unit weight gathered in float8 (`unshard_tree` / `reduce_tree` call these; `wire_itemsize`: the planner's)."""
    wire_itemsize: ClassVar[int] = 1
    amax_axes: tuple = (FSDP_AXIS,)   # its amax is pmaxed over these: every axis the whole weight lies on

    def unshard(self, shard, comm: Comm, amax=None):
        # an Unreduced pair (grad_sync='once') reaches this only from the stage passes (pipeline.py),
        # which take the unit's gradient from its VJP, never through this gather
        return unshard_float8(shard.shard if isinstance(shard, Unreduced) else shard, self, comm, amax)

    def reduce(self, g, comm: Comm):
        return reduce_gradient(g.data if isinstance(g, Float8Weight) else g, self, comm)
