"""Context parallelism at C > 1 in the engine (jfsdp.engine.sharded): what it supports, where the batch lies,
and the unit's attention run as a ring (docs/context-parallel.md). The ring itself, its per-block `Kernel` and
its load balance (zigzag): jfsdp/engine/parallel/ring.py, whose public names are importable from here too."""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from jfsdp.config.errors import ConfigError
from jfsdp.config.mesh import CONTEXT_AXIS, TENSOR_AXIS, context_size
from jfsdp.config.sequence import unzigzag, zigzag, zigzag_order  # noqa: F401 (the data loader's order, here too)
from jfsdp.engine.layout import Stacked
from jfsdp.engine.parallel.ring import Into, Kernel, ring_attention, sum_dtype  # noqa: F401 (the ring's, here too)

LATER = "is not supported with context parallelism yet (docs/context-parallel.md)"
HOOKS = ("positions", "attend")


def check(model, mesh, strategy, mp_policy, prefetch, moe, kernel):
    """(`kernel`, fully_shard's context_attention; the prefetch option, as given: the pipeline's units run
    their attention as a ring like the plain scan's); ConfigError for what C > 1 does not support yet."""
    c = context_size(mesh)
    if c == 1:
        if kernel is not None:
            raise ConfigError("context_attention= needs a mesh with a context axis of size > 1 "
                              "(make_mesh(spec, context=C))")
        return None, prefetch
    if not isinstance(kernel, Kernel):
        raise ConfigError(f"a mesh with context {c} needs context_attention=jfsdp.engine.parallel.context.Kernel(fwd, "
                          "bwd): the per-block attention of the ring (models/factory.py's context_kernel for Llama)")
    for what, bad in (("a jfsdp.Staged model", not isinstance(model, Stacked)),
                      (f"strategy {strategy.value}", not strategy.sharded), ("moe=", moe is not None),
                      ("float8", mp_policy.float8 is not None)):
        if bad:
            raise ConfigError(f"{what} {LATER}")
    return kernel, prefetch


def placement(batch_spec, loss_axes, context: int):
    """(the batch's PartitionSpec, the axes the loss is averaged over): at C > 1 the sequence (dimension 1)
    lies on `context`, in the zigzag order the data loader gave it (`zigzag`), and with sequence parallelism
    (`batch_spec` puts it on `tensor`) further on `tensor` inside each context rank's share: context rank c,
    tensor rank t holds the t-th of the T pieces of c's two zigzag chunks, so that the gather over `tensor`
    before attention gives the context rank its tokens in their order."""
    if context == 1:
        return batch_spec, loss_axes
    if len(batch_spec) > 1 and batch_spec[1] != TENSOR_AXIS:
        raise ConfigError(f"context parallelism with axis {batch_spec[1]!r} on the sequence {LATER}")
    seq = (CONTEXT_AXIS, TENSOR_AXIS) if len(batch_spec) > 1 else CONTEXT_AXIS
    return P(batch_spec[0], seq), (*loss_axes, CONTEXT_AXIS)


def batch_rows(tree, n_devices: int, tensor: int, context: int) -> tuple:
    """(the devices a batch's rows lie on, the count its batch size must divide): R*S, and all N devices as
    before when C = 1 (tensor parallelism keeps its rule). At C > 1 a ConfigError unless every leaf's
    sequence (dimension 1) is a multiple of 2C (2C*T with T > 1), the zigzag's chunks split over `tensor`."""
    rows = n_devices // (tensor * context)
    if context == 1:
        return rows, n_devices
    for x in jax.tree.leaves(tree):
        if np.ndim(x) >= 2 and np.shape(x)[1] % (2 * context * tensor):
            raise ConfigError(f"a batch's sequence of {np.shape(x)[1]} tokens does not split over context {context}"
                              + (f" and tensor {tensor}" if tensor > 1 else "")
                              + f": context parallelism cuts it into 2*C = {2 * context} equal chunks"
                              + (f", each split over T = {tensor}" if tensor > 1 else ""))
    return rows, rows


@jax.custom_vjp
def _weight_grad_first(x, kernel):
    """x @ kernel, whose backward hands on x's cotangent only once the kernel's exists (a barrier over both)."""
    return _matmul(x, kernel)


def _matmul(x, kernel):
    return lax.dot_general(x, kernel, (((x.ndim - 1,), (0,)), ((), ())))


def _wgf_fwd(x, kernel):
    return _matmul(x, kernel), (x, kernel)


def _wgf_bwd(res, dy):
    return lax.optimization_barrier(jax.vjp(_matmul, *res)[1](dy))   # the same products as autodiff's


_weight_grad_first.defvjp(_wgf_fwd, _wgf_bwd)


def _projection(mod, x):
    """The plain nn.Dense that follows the ring in the module that called `attend` (its output projection, wo),
    as `_weight_grad_first`: XLA otherwise computed wo's weight gradient after the ring's backward, and the
    ring's output (the attention output, wo's input: 1.5 GiB at 8B, 1.5M tokens, C = 8) lived through it."""
    x, w = mod.promote_dtype(x, nn.meta.unbox(mod.get_variable("params", "kernel")), dtype=mod.dtype)
    return _weight_grad_first(x, w)


def with_ring(apply, kernel: Kernel, context: int, tensor: int = 1):
    """A unit's (params, h) -> h with its attention run as a ring over `context` on zigzag-ordered tokens:
    the unit's modules' `positions(t)` give this rank's tokens' positions, and `attend(q, k, v)` runs
    `ring_attention`. A unit that calls neither is refused: its attention would see this rank's tokens only.
    At `tensor` 1, the module's next plain nn.Dense after `attend` runs as `_projection`. At C = 1, `apply`."""
    if context == 1:
        return apply
    def intercept(next_fun, args, kwargs, ctx):
        mod = ctx.module
        if (ctx.method_name == "__call__" and after and mod.parent is after[-1] and type(mod) is nn.Dense
                and not mod.use_bias and mod.precision is None and mod.dot_general is None
                and mod.dot_general_cls is None):
            after.pop()
            return _projection(mod, *args)
        if ctx.method_name not in HOOKS:
            return next_fun(*args, **kwargs)
        seen.add(ctx.method_name)
        if ctx.method_name == "attend":
            after[:] = [mod] if tensor == 1 else []
            return ring_attention(*args, kernel, **kwargs)
        t, c = args[0], lax.axis_size(CONTEXT_AXIS)
        order = jnp.asarray(zigzag_order(t * c, c), jnp.float32).reshape(c, t)
        return order[lax.axis_index(CONTEXT_AXIS)]

    seen, after = set(), []

    def run(params, h):
        with nn.intercept_methods(intercept):
            out = apply(params, h)
        if seen != set(HOOKS):
            raise ConfigError("context parallelism needs the unit's attention reachable: a module method "
                              "positions(t) giving the tokens' positions (RoPE) and attend(q, k, v) doing causal "
                              f"attention, as models/llama.py's Attention has; this unit called {sorted(seen) or 'neither'}")
        return out
    return run
