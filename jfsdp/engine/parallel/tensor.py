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
derives the head count of its reshapes from the matmul's output (-1), not from its config."""
from __future__ import annotations

import flax.linen as nn
from jax import lax

from jfsdp.config.errors import ConfigError
from jfsdp.config.mesh import TENSOR_AXIS
from jfsdp.engine.parallel.plan import ROWWISE


def gather_sequence(x, dim: int):
    """h sharded on the sequence over `tensor` -> the whole sequence (its transpose: a reduce-scatter)."""
    return lax.all_gather(x, TENSOR_AXIS, axis=dim, tiled=True)


def scatter_sequence(y, dim: int):
    """Partial sums over `tensor` of the whole sequence -> their sum, sharded on the sequence."""
    return lax.psum_scatter(y, TENSOR_AXIS, scatter_dimension=dim, tiled=True)


def dense(mod, x, out_dtype=None):
    """nn.Dense's matmul on the kernel slice this rank holds (Flax's own call would refuse its shape):
    (the product in `out_dtype`, None: the compute dtype; the compute dtype)."""
    if not isinstance(mod, nn.Dense) or mod.dot_general is not None or mod.dot_general_cls is not None:
        raise ConfigError(f"layer {'/'.join(mod.path)} ({type(mod).__name__}) is tensor-parallel, but only a plain "
                          "nn.Dense (no custom dot_general) can be")
    kernel = nn.meta.unbox(mod.get_variable("params", "kernel"))
    x, kernel = mod.promote_dtype(x, kernel, dtype=mod.dtype)
    y = lax.dot_general(x, kernel, (((x.ndim - 1,), (0,)), ((), ())), precision=mod.precision,
                        preferred_element_type=out_dtype)
    return y, x.dtype


def interceptor(modules: dict, sequence_dim: int, reduce_dtype=None):
    """A Linen method interceptor for a unit: `modules` is {module path: 'colwise' / 'rowwise'}
    (layout.tp_modules); the parent of every colwise layer gets its input gathered over the sequence.
    A rowwise layer's partial sums leave the matmul in `reduce_dtype` (the precision policy's, fp32 under
    bf16; None: the compute dtype), are reduce-scattered in it and cast back: the sum of the T partials
    is rounded once, as the single-device matmul rounds its accumulator once. (Rounding each partial
    to bf16 first, as Megatron does, put llama-test's outputs 5.2e-3 in L2 from the single-device bf16
    model's, nearly as far as fp32's, 6.1e-3: docs/tensor-parallel.md.)"""
    gathers = {path[:-1] for path, kind in modules.items() if kind != ROWWISE}
    if () in gathers:
        raise ConfigError("a colwise layer sits at the unit's top level: its input would be the residual stream "
                          "itself; tensor parallelism gathers the input of the module that holds colwise layers")

    def intercept(next_fun, args, kwargs, context):
        mod = context.module
        if context.method_name != "__call__":
            return next_fun(*args, **kwargs)
        path = tuple(mod.path)
        if path in gathers:
            return next_fun(gather_sequence(args[0], sequence_dim), *args[1:], **kwargs)
        kind = modules.get(path)
        if kind is None:
            return next_fun(*args, **kwargs)
        if kind != ROWWISE:
            return dense(mod, args[0])[0]
        y, dtype = dense(mod, args[0], reduce_dtype)
        y = scatter_sequence(y, sequence_dim).astype(dtype)
        if mod.use_bias:   # replicated over `tensor`: added once, after the sum
            y = y + nn.meta.unbox(mod.get_variable("params", "bias")).astype(y.dtype)
        return y
    return intercept
