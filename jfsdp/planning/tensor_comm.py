"""Communication per step under tensor parallelism (T > 1, docs/tensor-parallel.md), by collective kind
and by the mesh axes it runs over, in the ring cost model of `hlo.Collective.wire_bytes`, to compare
with `hlo.per_axes` of the compiled step.

FSDP, per leaf (padding counted): gathered over its own group, `fsdp` for a tensor-parallel or
vocabulary-parallel leaf (1/T of the leaf), `fsdp` x `tensor` for the rest (norm scales); the root
once per step, each unit twice under FULL_SHARD (forward and backward) and once under SHARD_GRAD_OP
(a unit's 1-D leaves once under remat 'none' too: the compiled step keeps them from the forward pass);
each gradient reduce-scattered over the same group once, then all-reduced over `data` when R > 1.
Gathers in the parameter dtype, reductions in the reduce dtype, each as the backend carries it
(`wire_dtype`: XLA:CPU widens bf16 to f32).

Tensor parallelism, over `tensor`, for n tokens per TP group (a device's rows x the whole sequence),
hidden size D: every all-gather and reduce-scatter of the residual stream sends n·D·b·(T−1)/T per
device. Per unit, 2 all-gathers (before attention, before the FFN) and 2 reduce-scatters (after wo,
after w2) forward, as many backward (their transposes). A unit recomputed in the backward pass (remat
'full' or 'dots': neither saves a gathered input) all-gathers twice more and reduce-scatters once more
(after wo); XLA drops the recomputed reduce-scatter after w2, which makes the unit's output that the
backward pass does not need, except in XLA:GPU's plain scan (no prefetch pipeline) under remat 'full'.
Dtypes (read from the compiled programs): the all-gathers and the backward's reduce-scatters in the
compute dtype, the rowwise reduce-scatters of the forward (and its recomputation) in the reduce dtype.
With async TP (`plan.async_tp`, parallel/tensor.py) each of the units' all-gathers and reduce-scatters is
a ring of T − 1 collective-permutes of n·D·b/T each, the same bytes; the recomputed reduce-scatter after
w2 is dropped in every program (its ring's result is dead code). The root's stay one-shot collectives.
The vocabulary-parallel root adds 2 of each in the compute dtype (the embedding, the head), the token
ids' and targets' all-gathers (4 bytes a token) and the loss's all-reduces of fp32 per token: 4 for the
plain loss (max, sum, target logit forward; the sum's transpose backward), 3 for the fused loss, whose
backward all-reduces one scalar (the cotangent; one per step, whatever the micro-batches).
With k micro-batches the units are gathered k times, and so are the root's leaves that only the head
reads (gathered after the units, behind an optimization barrier); those the embedding reads once (XLA
hoists their gather out of the micro-batches' loop). The gradients are reduced k times
(`grad_sync='every'`) or once."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jfsdp.config.errors import ConfigError
from jfsdp.config.mesh import DATA_AXIS, FSDP_AXIS, TENSOR_AXIS
from jfsdp.config.policy import wire_dtype
from jfsdp.engine.layout import is_layout
from jfsdp.train import frozen


def _axes(layout) -> tuple:
    a = layout.gather_axes
    return (a,) if isinstance(a, str) else tuple(a)


def add(out: dict, kind: str, axes: tuple, nbytes: float):
    key = (kind, tuple(a for a in (DATA_AXIS, FSDP_AXIS, TENSOR_AXIS) if a in axes))
    out[key] = out.get(key, 0.0) + nbytes


def _fsdp(plan, out: dict, pb: int, rb: int, gathers_k: int, reduce_k: int, mask=None):
    """The FSDP gathers (`pb` bytes an element, `gathers_k` micro-batches) and reduce-scatters (`rb`,
    `reduce_k` times), and the all-reduce of the shards over `data`; `mask`: frozen.mask's tree (None:
    everything trains), a frozen leaf is gathered but never reduced."""
    root_l, stage_l = plan.split(plan.layouts)
    stage_l = getattr(plan, "unit_layouts", None) or stage_l   # float8 kernels marked
    root_m, stage_m = plan.split(mask) if mask is not None else (None, [None] * len(stage_l))
    gathers = 2 if plan.strategy.reshard_after_forward else 1
    flat = lambda tree: jax.tree.leaves(tree, is_leaf=is_layout)
    flags = lambda m, tree: jax.tree.leaves(m) if m is not None else [True] * len(flat(tree))
    embed_reads = plan.root_use[0]   # gathered once per step; a leaf only the head reads, in every micro-batch
    leaves = [(l, 1 / gathers_k if i in embed_reads else 1, 1, t)
              for i, (l, t) in enumerate(zip(flat(root_l), flags(root_m, root_l)))]
    saved = len(stage_l) - 1 if plan.saves_last_unit else None   # its last unit gathered once (saved for the backward)
    for j, (ls, n, m) in enumerate(zip(stage_l, plan.stage_sizes, stage_m)):
        for l, t in zip(flat(ls), flags(m, ls)):
            once = gathers == 2 and plan.remat == "none" and len(l.shape) == 1
            leaves.append((l, n * (1 if once else gathers) - (j == saved and not once), n, t))
    r = plan.replicas
    for l, times, grads, trains in leaves:
        g, elements = l.shards, math.prod(l.stored_shape)
        grads = grads * reduce_k if trains else 0
        if g > 1:
            wire = getattr(l, "wire_itemsize", pb)   # a float8 kernel: 1 byte
            add(out, "all-gather", _axes(l), gathers_k * times * elements * wire * (g - 1) / g)
            add(out, "reduce-scatter", _axes(l), grads * elements * rb * (g - 1) / g)
        if r > 1 and grads:
            add(out, "all-reduce", (DATA_AXIS,), grads * 2 * (elements * rb / g) * (r - 1) / r)


def tensor_comm(plan, rows: int, seq_len: int, fused: bool, backend: str | None = None, grad_accum: int = 1,
                grad_sync: str = "every", trainable=None) -> dict:
    """{(kind, axes): bytes each device sends per step} of a Stacked Llama-like plan under T > 1 with
    a global batch of `rows` x `seq_len` tokens; `fused`: the fused loss (else the plain one);
    `backend`: whose wire dtypes and program ('cpu', 'gpu'; default jax's); `grad_accum` micro-batches
    reduced in every one or `grad_sync='once'`; `trainable`: make_train_step's (frozen leaves)."""
    t = plan.tensor
    if t == 1 or plan.remat not in ("none", "full", "dots"):
        raise ConfigError("the tensor-parallel communication formula is written for T > 1 and remat none, full or "
                          "dots; read the compiled step's collectives (hlo.per_axes) for the rest")
    if any(getattr(plan, "moe_stages", None) or ()):
        raise ConfigError("the planner's communication formula at tensor > 1 covers dense Llama units, not MoE ones (their "
                          "all-to-alls over tensor, experts over fsdp x tensor); an MoE model trains at --tensor > 1 "
                          "(train.py's fit check reads the memory estimate) but jfsdp.plan does not plan it yet")
    if len({tuple(jax.tree.leaves(h)[0].shape[2:]) for h in plan.h_shapes}) > 1:
        raise ConfigError("the tensor-parallel communication formula takes one residual width for every stage; "
                          "this model's stages change it: read the compiled step's collectives (hlo.per_axes)")
    backend = backend or jax.default_backend()
    pdt = plan.mp.param_dtype or jnp.float32
    cb = jnp.dtype(wire_dtype(pdt, backend)).itemsize                            # compute (and gather) dtype
    rb = jnp.dtype(wire_dtype(plan.mp.reduce_dtype or pdt, backend)).itemsize   # reduce dtype
    out: dict = {}
    _fsdp(plan, out, cb, rb, grad_accum, grad_accum if grad_sync == "every" else 1, frozen.mask(plan, trainable))
    n = rows // (plan.n_devices // t) * seq_len           # tokens per TP group, all micro-batches
    d = jax.tree.leaves(plan.h_shapes[-1])[0].shape[-1]  # the residual stream's width
    f = (t - 1) / t
    again = plan.remat != "none"   # the recomputed forward: both all-gathers, the reduce-scatter after wo
    units = sum(plan.stage_sizes)
    vocab = getattr(plan, "vocab_shard", None) is not None
    root = 2 if vocab else 0
    ring = getattr(plan, "async_tp", False)   # the units' collectives as rings of collective-permutes
    kept = backend == "gpu" and not plan.prefetch and plan.remat == "full" and not ring   # recomputed after w2
    rowwise = units * (2 + again * (2 if kept else 1))
    gathers, scatters = units * (4 + 2 * again) * cb, rowwise * rb + units * 2 * cb
    if ring:
        add(out, "collective-permute", (TENSOR_AXIS,), (gathers + scatters) * n * d * f)
        gathers = scatters = 0
    add(out, "all-gather", (TENSOR_AXIS,), (gathers + root * cb) * n * d * f)
    add(out, "reduce-scatter", (TENSOR_AXIS,), (scatters + root * cb) * n * d * f)
    if vocab:
        add(out, "all-gather", (TENSOR_AXIS,), 2 * n * 4 * f)
        add(out, "all-reduce", (TENSOR_AXIS,), ((3 * n + 1) if fused else 4 * n) * 4 * 2 * f)
    return out


def by_kind(per_axes: dict) -> dict:
    """{(kind, axes): bytes} -> the report's {kind: bytes} with 'total', and 'contract': the FSDP part
    (every collective but those over `tensor` alone), the T = 1 contract's counterpart."""
    out = {k: 0.0 for k in ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")}
    for (kind, _), v in per_axes.items():
        out[kind] = out.get(kind, 0.0) + v
    out["total"] = sum(out.values())
    out["contract"] = sum(v for (_, axes), v in per_axes.items() if axes != (TENSOR_AXIS,))
    return out


def axes_table(per_axes: dict) -> dict:
    """{'kind over axes': bytes} (JSON keys) of a {(kind, axes): bytes} dict."""
    return {f"{kind} over {' x '.join(axes) or 'none'}": v for (kind, axes), v in sorted(per_axes.items())}
