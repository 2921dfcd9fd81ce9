"""Activation bytes per device, read from the traced model (so it works for any model handed to
`fully_shard`): what each unit's checkpoint policy saves, what one unit's backward needs at once,
and what the embedding, head and loss keep for the backward pass. Nothing is compiled."""
from __future__ import annotations

import math
from typing import Callable

import jax
import jax.extend
import jax.numpy as jnp

from jfsdp.config.policy import REMAT_POLICIES, wire_dtype
from jfsdp.engine.layout import is_layout
from jfsdp.engine.sharded import FSDP
from jfsdp.planning.sizes import as_shapes, nbytes, tree_bytes


def residual_bytes(f, *args, skip_args=True, axis_env=None) -> int:
    """Bytes of the values JAX saves from f's forward for its backward (its checkpoint policy
    applied). Arguments are skipped: the caller accounts for them. `axis_env`: [(axis name, size)]
    that f's collectives run over (traced as one device runs them, as inside shard_map)."""
    total = 0
    for aval, where in saved_residuals(f, args, axis_env):
        if skip_args and where.startswith("from the argument"):
            continue
        if skip_args and where.startswith("output of stop_gradient") and __file__ in where:
            continue   # a frozen parameter (stop_frozen): an argument too
        total += int(math.prod(aval.shape)) * jnp.dtype(aval.dtype).itemsize
    return total


def working_bytes(f, *args, axis_env=None) -> int:
    """Bytes one backward pass of f needs at once besides its arguments, with nothing recomputed away:
    what f saves (`residual_bytes`, no checkpoint policy around f), plus, where f runs parts of itself
    under a checkpoint of their own (a loop over the tiles of a sequence, each tile rematerialized: e.g.
    models/llama.py's `mlp_tile`), the largest such part's own residuals, which its backward recomputes
    and holds one part at a time; less the values XLA recomputes inside the fusions that read them
    (`fused_bytes`, docs/planner.md)."""
    leaves, tree = jax.tree.flatten(args)
    closed = jax.make_jaxpr(lambda *xs: f(*jax.tree.unflatten(tree, xs)), axis_env=axis_env or [])(*leaves)
    inner = [residual_bytes(jax.extend.core.jaxpr_as_fun(jax.extend.core.ClosedJaxpr(j, ())),
                            *[jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in j.invars], axis_env=axis_env)
             for j in _checkpointed(closed.jaxpr)]
    saved = residual_bytes(f, *args, axis_env=axis_env) - fused_bytes(f, *args, axis_env=axis_env)
    return saved + max(inner, default=0)


# elementwise primitives: XLA fuses a chain of them into the fusion of the value's consumer. Not a dtype
# conversion: XLA:GPU writes a matmul's output converted (bf16 -> f32) from the matmul's own fusion, so the
# converted value is the one kept
_ELEMENTWISE = frozenset((
    "add", "sub", "mul", "div", "neg", "max", "min", "exp", "exp2", "log", "log1p", "expm1", "tanh", "logistic",
    "sqrt", "rsqrt", "integer_pow", "pow", "square", "abs", "sign", "erf", "sin", "cos",
    "select_n", "and", "or", "not", "eq", "ne", "lt", "le", "gt", "ge", "broadcast_in_dim", "reshape", "copy",
    "squeeze", "expand_dims"))


def fused_bytes(f, *args, axis_env=None) -> int:
    """Bytes of the values f saves for its backward that are elementwise functions of ONE other value of
    their shape, itself saved or an argument (GELU's tanh form from its input, a softmax's shifted
    exponentials): XLA recomputes such a chain inside the fusion of its consumer in the
    backward instead of keeping it. A value of two saved sources (a norm's output: its input and its
    statistics), of anything not saved (a matmul's output) or made by a dtype conversion is kept. Constants
    and scalars are no source."""
    var = jax.extend.core.Var
    j = _residual_jaxpr(f, args, axis_env)
    saved = {v for v in j.outvars if isinstance(v, var)}
    sources = {v: frozenset([v]) for v in (*j.invars, *j.constvars)}   # value -> the kept values it is made of
    fused = set()
    for eqn in j.eqns:
        ins = [v for v in eqn.invars if isinstance(v, var) and v.aval.shape != ()]
        if eqn.primitive.name in _ELEMENTWISE and all(v in sources for v in ins):
            made = frozenset().union(*(sources[v] for v in ins))
            for o in eqn.outvars:
                if o in saved and len(made) <= 1 and all(s.aval.shape == o.aval.shape for s in made):
                    fused.add(o)
                sources[o] = frozenset([o]) if o in saved and o not in fused else made
        else:
            sources.update({o: frozenset([o]) for o in eqn.outvars if o in saved})
    return sum(math.prod(v.aval.shape) * jnp.dtype(v.aval.dtype).itemsize for v in fused)


def _checkpointed(jaxpr) -> list:
    """The jaxprs of the `jax.checkpoint` regions inside `jaxpr` (in loops and calls too), outermost ones."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "remat2":   # jax.checkpoint's primitive (jax._src.ad_checkpoint.remat_p)
            found.append(eqn.params["jaxpr"])
        else:
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                found += _checkpointed(sub)
    return found


def saved_residuals(f, args, axis_env=None) -> list:
    """[(aval, where it comes from)] of what JAX saves from f(*args)'s forward for its backward, as
    jax's `saved_residuals` (public only as print_saved_residuals), traced under `axis_env`."""
    from jax._src import ad_checkpoint
    if not axis_env:
        return ad_checkpoint.saved_residuals(f, *args)
    jaxpr = _residual_jaxpr(f, args, axis_env)
    return ad_checkpoint._saved_residuals(jaxpr, [f"args[{i}]" for i in range(len(jaxpr.invars))])


def _residual_jaxpr(f, args, axis_env=None):
    """The jaxpr of f(*args)'s forward (flat arguments), its outputs the residuals its backward reads,
    traced under `axis_env`."""
    leaves, tree = jax.tree.flatten(args)
    flat = lambda *xs: f(*jax.tree.unflatten(tree, xs))
    closed, (_, vjp_fn) = jax.make_jaxpr(lambda *xs: jax.vjp(flat, *xs), return_shape=True,
                                         axis_env=axis_env or [])(*leaves)
    n_res = len(jax.tree.leaves(vjp_fn))
    return closed.jaxpr.replace(outvars=closed.jaxpr.outvars[len(closed.jaxpr.outvars) - n_res:])


def activation_estimate(plan: FSDP, loss_fn: Callable, local_batch, backend: str | None = None,
                        widen: bool = True, trainable=None) -> dict:
    """Activation bytes per device, from the traced model on one device's batch, per stage:
    `per_unit`: saved by a unit's checkpoint policy (plus the unit's input, which the scan keeps);
    `unit_working`: everything one unit's backward needs at once (its activations with nothing
    recomputed away); and `head`: values the embedding, head and loss keep for backward.
    `stages` lists {'per_unit', 'unit_working'} of each stage; the top-level `per_unit` and
    `unit_working` are the first stage's (the whole answer for a one-stage model).
    `widen=False`: in param_dtype as the program writes it, not as the backend computes it
    (`wire_dtype`): what XLA:CPU stores from the forward pass (see `jfsdp.planning.estimate`).
    `trainable`: a tree of booleans like the parameters (jfsdp.train.frozen.mask), None when all
    train: frozen leaves are differentiated as the step does, not at all (`lax.stop_gradient`), so
    what only their gradients would need is not counted."""
    m = plan.model
    pdt = jnp.dtype(plan.mp.param_dtype or jnp.float32)
    pdt = wire_dtype(pdt, backend or jax.default_backend()) if widen else pdt
    root_layouts, stage_layouts = plan.split(plan.layouts)
    root_p = as_shapes(root_layouts, pdt)
    root_t, stage_t = plan.split(trainable) if trainable is not None else (None, [None] * len(stage_layouts))
    h = jax.eval_shape(lambda r, x: m.root.apply({"params": r}, x, method=m.embed_method), root_p,
                       local_batch["inputs"])
    stages, h = _unit_activations(plan, stage_layouts, pdt, h, stage_t)
    head = _head_activations(plan, loss_fn, local_batch, root_p, h, root_t)
    return {**stages[0], "head": head, "stages": stages}


def stop_frozen(params, trainable):
    """`params` with `lax.stop_gradient` on the leaves that `trainable` (booleans, or None) freezes."""
    if trainable is None:
        return params
    return jax.tree.map(lambda t, p: p if t else jax.lax.stop_gradient(p), trainable, params)


def _unit_activations(plan: FSDP, stage_layouts, pdt, h, stage_trainable):
    """([{'per_unit', 'unit_working'} per stage], the last stage's output shape), from the
    embedding's output shape `h`."""
    policy = getattr(jax.checkpoint_policies, REMAT_POLICIES[plan.remat])
    stages = []
    for st, layouts, t in zip(plan.model.stages, stage_layouts, stage_trainable):
        unit_p = as_shapes(layouts, pdt)
        unit_fn = lambda x, p, unit=st.unit, t=t: unit.apply({"params": stop_frozen(p, t)}, x)
        stages.append({"per_unit": residual_bytes(jax.checkpoint(unit_fn, policy=policy), h, unit_p) + tree_bytes(h),
                       "unit_working": working_bytes(unit_fn, h, unit_p) + tree_bytes(h)})
        h = jax.eval_shape(unit_fn, h, unit_p)
    return stages, h


def _head_activations(plan: FSDP, loss_fn: Callable, local_batch, root_p, h, root_trainable=None) -> int:
    """What the head and the loss keep for their backward, and the gradients their backward makes
    (a frozen weight's none)."""
    m = plan.model

    def head(x, r):
        return m.root.apply({"params": stop_frozen(r, root_trainable)}, x, method=m.head_method)

    out = jax.eval_shape(head, h, root_p)
    total = residual_bytes(lambda x, r, batch: loss_fn(plan.mp.cast_output(head(x, r)), batch), h, root_p, local_batch)
    if isinstance(out, jax.ShapeDtypeStruct):   # logits: + the output's cotangent in fp32
        return total + 2 * nbytes(out)
    return total + fused_head_buffers(plan, loss_fn, out, math.prod(local_batch["inputs"].shape), root_trainable)


def fused_head_buffers(plan: FSDP, loss_fn: Callable, out, tokens: int, root_trainable=None) -> int:
    """The buffers a fused head + loss's backward makes, for its outputs `out` (hidden, weight) on
    `tokens` tokens: the weight's gradient (one buffer of its dtype, written block by block), and the
    hidden states' fp32 gradient accumulator and the product added into it; with jfsdp's lm_loss, a
    few (chunk, vocabulary) fp32 buffers at a time."""
    *hs, w = jax.tree.leaves(out)
    total = (0 if _frozen_weight(plan, w, root_trainable) else nbytes(w)) + 2 * sum(math.prod(x.shape) * 4 for x in hs)
    chunk = getattr(loss_fn, "chunk", None)
    if chunk:   # jfsdp.train.losses.lm_loss
        vocab = w.shape[0] if getattr(loss_fn, "vocab_major", False) else w.shape[-1]
        total += 2 * min(chunk, tokens) * vocab * 4
    return total


def _frozen_weight(plan: FSDP, w, root_trainable) -> bool:
    """Whether the fused head's output weight `w` is a frozen root leaf (one the head reads, of its
    shape or its transpose's): then its backward makes no gradient for it."""
    if root_trainable is None:
        return False
    layouts = jax.tree.leaves(plan.split(plan.layouts)[0], is_leaf=is_layout)
    flags = jax.tree.leaves(root_trainable)
    shapes = {tuple(w.shape), tuple(reversed(w.shape))}
    reads = plan.root_use[1]
    return any(not flags[i] and tuple(layouts[i].shape) in shapes for i in reads)
