"""MoE layers under tensor and sequence parallelism (docs/moe.md, "Tensor parallelism").

Between units the residual stream is split on the sequence over `tensor`. An MoE layer routes each
sequence as one group (its capacity is per sequence), so it cannot run on 1/T of a sequence. Around
the model's MoE layer (`MoE.layer`, by class name) the TP group trades the split: an all-to-all over
`tensor` turns (rows, n/T, d) into (rows/T, n, d), each tensor rank runs the layer on whole sequences
of its own rows, and the reverse all-to-all turns the outputs back. Per-row outputs (an aux loss, drop
counts: no sequence axis) are all-gathered over `tensor` instead, so every rank carries every row's.
- Nothing is computed twice: a tensor rank routes, dispatches and computes the experts for 1/T of
  the TP group's rows. The experts are not split over `tensor` the Megatron way; they are FSDP
  (gather mode) or expert-parallel ('ep') over `fsdp` x `tensor` together, as every parameter that
  is not tensor-parallel lies (parallel/layout.py): gathered over both axes, or E/(S·T) experts
  on each device with the all-to-all over both axes.
- Gradients: the transpose of each all-to-all is the reverse all-to-all, and of the rows' all-gather
  a reduce-scatter over `tensor`: each row's cotangent arrives, summed once, on the rank that
  computed it. A parameter of the layer sees 1/T of the group's tokens on each tensor rank, so its
  gradient is summed over `tensor` by the reduce-scatter over (`fsdp`, `tensor`) (gather mode) or
  lies whole with the expert that saw every token routed to it ('ep'): once either way.
The local rows must divide by T (ConfigError otherwise)."""
from __future__ import annotations

import jax
from jax import lax

from jfsdp.config.errors import ConfigError
from jfsdp.config.mesh import TENSOR_AXIS


def to_rows(x, dim: int, tensor: int):
    """(rows, n/T, ...) split on the sequence -> (rows/T, n, ...): whole sequences of 1/T of the rows."""
    if x.shape[0] % tensor:
        raise ConfigError(f"an MoE layer at tensor {tensor} runs whole sequences of 1/T of each device's rows: "
                          f"{x.shape[0]} rows per device do not divide by {tensor} (raise the batch size)")
    return lax.all_to_all(x, TENSOR_AXIS, 0, dim, tiled=True)


def from_rows(y, dim: int, n: int):
    """The layer's outputs back: a leaf with the whole sequence (length `n`) on `dim` is split on it again
    (the reverse all-to-all); a per-row leaf is all-gathered on its rows."""
    if y.ndim > dim and y.shape[dim] == n:
        return lax.all_to_all(y, TENSOR_AXIS, dim, 0, tiled=True)
    return lax.all_gather(y, TENSOR_AXIS, axis=0, tiled=True)


def interceptor(selector, dim: int, tensor: int):
    """A Linen method interceptor: the MoE layer (`selector.layer`) called on whole sequences of 1/T of
    the rows (`to_rows`), its outputs returned to the residual stream's split (`from_rows`)."""
    def intercept(next_fun, args, kwargs, context):
        if context.method_name != "__call__" or not selector.matches(context.module, selector.layer):
            return next_fun(*args, **kwargs)
        x = to_rows(args[0], dim, tensor)
        return jax.tree.map(lambda y: from_rows(y, dim, x.shape[dim]), next_fun(x, *args[1:], **kwargs))
    return intercept

