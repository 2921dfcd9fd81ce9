"""The optimizer: AdamW with global-norm clipping on sharded gradients, its weight-decay mask and schedule.

Everything here is plain optax on the shards: elementwise updates follow the parameters' sharding, and a
global norm computed under jit on sharded gradients is the norm across all shards (padding is zero)."""
from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jfsdp.config.errors import ConfigError
from jfsdp.engine.layout import ROOT, STAGES, UNITS


def unit_view(params):
    """Parameters as one unit sees them: the leaves of the stacked stages ('units' / 'stages')
    become ShapeDtypeStructs without the stack axis; the root is left as it is. What a callable
    weight-decay mask given to `adamw` is called with, so that `x.ndim >= 2` means a matrix."""
    if not (isinstance(params, Mapping) and ROOT in params and (UNITS in params or STAGES in params)):
        return params
    drop = lambda t: jax.tree.map(lambda x: jax.ShapeDtypeStruct(tuple(x.shape[1:]), x.dtype), t)
    view = dict(params)
    if UNITS in view:
        view[UNITS] = drop(view[UNITS])
    if STAGES in view:
        view[STAGES] = [drop(s) for s in view[STAGES]]
    return type(params)(view) if not isinstance(params, dict) else view


def matrices(params):
    """The default weight-decay mask: True for parameters that are matrices (or higher) per unit,
    False for biases, norm scales and scalars, in jfsdp's stacked layout or any plain tree."""
    return jax.tree.map(lambda x: len(np.shape(x)) >= 2, unit_view(params))


def adamw(learning_rate, *, weight_decay: float = 0.1, b1: float = 0.9, b2: float = 0.95, eps: float = 1e-8,
          clip_norm: float | None = 1.0, mask=None) -> optax.GradientTransformation:
    """AdamW with global-norm clipping. Run on sharded gradients under jit, the norm is the global
    norm across all shards (padding is zero and adds nothing).

    Weight decay applies where `mask` says. Default: matrices only (`matrices`: not biases, norm
    scales, scalars), which is `sharded.decay_mask()`. A callable mask is called with `unit_view(params)`
    (the stack axis removed), so the usual `lambda p: jax.tree.map(lambda x: x.ndim >= 2, p)` is
    right for stacked units too; a tree of booleans is used as it is."""
    if mask is None:
        mask = matrices
    elif callable(mask):
        user = mask
        mask = lambda params: user(unit_view(params))
    tx = optax.adamw(learning_rate, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay, mask=mask)
    return clipped(clip_by_global_norm(clip_norm), tx, clip_norm) if clip_norm else tx


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformation:
    """`optax.clip_by_global_norm`, written so that the clipped gradients never exist as a tree of
    their own: each gradient is multiplied by one scalar (1, or max_norm / norm) where it is used.
    optax divides every leaf by the norm instead; XLA counts a division as expensive and does not
    duplicate it into its two users (Adam's first and second moments), so it wrote the clipped
    gradients to new buffers while the gradients were still live: at the update the step held two
    full gradient trees. A multiply by a scalar is fused into each user, and a gradient dies once both
    moments have read it."""
    def update_fn(updates, state, params=None):
        del params
        g_norm = optax.tree.norm(updates)
        scale = jnp.where(g_norm < max_norm, 1.0, max_norm / g_norm)
        return jax.tree.map(lambda t: t * scale.astype(t.dtype), updates), state
    return optax.GradientTransformation(optax.init_empty_state, update_fn)


def warmup_cosine(lr: float, steps: int, warmup: int, final_fraction: float = 0.1):
    warmup = max(0, min(warmup, steps - 1))
    return optax.warmup_cosine_decay_schedule(0.0 if warmup else lr, lr, warmup, max(steps, warmup + 1),
                                              end_value=lr * final_fraction)


class Clipped(optax.GradientTransformationExtraArgs):
    """`optax.chain(clip_by_global_norm(clip_norm), inner)` that remembers its parts (`clip_norm`,
    `inner`), so that a step applying the update unit by unit can clip by the global norm first.
    Its state is the chain's: (clip's empty state, inner's state)."""


def clipped(clip, inner: optax.GradientTransformation, clip_norm: float) -> Clipped:
    """`clip` then `inner`, as a `Clipped` chain."""
    chain = optax.chain(clip, inner)
    out = Clipped(chain.init, chain.update)
    out.clip_norm, out.inner = clip_norm, inner
    return out


# primitives that map elements to elements (and compare/select them): an update made of these, plus
# scalars that depend on no array (step counts, schedules), can run on any slice of the tree
_ELEMENTWISE = frozenset("""abs add and atan2 broadcast_in_dim ceil clamp convert_element_type copy copy_p cos div eq
    erf exp exp2 expm1 floor ge gt integer_pow is_finite le log log1p logistic lt max min mul ne neg nextafter not or
    pow rem round rsqrt select_n sign sin sqrt square stop_gradient sub tan tanh xor""".split())
_CALLS = ("jit", "pjit", "closed_call", "core_call", "custom_jvp_call", "custom_vjp_call", "remat", "checkpoint")


def _across(jaxpr, tainted_in) -> tuple[str | None, list]:
    """Follow values derived from the array inputs (`tainted_in`) through a jaxpr: the name of the
    first primitive that is not elementwise on them (None if there is none), and which outputs derive
    from them."""
    tainted = {v for v, t in zip(jaxpr.invars, tainted_in) if t}
    is_var = lambda v: type(v).__name__ != "Literal"
    for e in jaxpr.eqns:
        ins = [is_var(v) and v in tainted for v in e.invars]
        if not any(ins):
            continue
        name = e.primitive.name
        sub = e.params.get("jaxpr", e.params.get("call_jaxpr"))
        if name in _CALLS and sub is not None:
            why, out = _across(getattr(sub, "jaxpr", sub), ins)
            if why:
                return why, []
            tainted.update(v for v, t in zip(e.outvars, out) if t)
        elif name in _ELEMENTWISE:
            tainted.update(e.outvars)
        else:
            return name, []
    return None, [is_var(v) and v in tainted for v in jaxpr.outvars]


def check_elementwise(update, grads, state, params):
    """ConfigError unless `update(grads, state, params)` is elementwise in every array it reads."""
    leaves = jax.tree.leaves((grads, state, params))
    jaxpr = jax.make_jaxpr(lambda *xs: update(*jax.tree.unflatten(jax.tree.structure((grads, state, params)), xs)))(*leaves)
    why, _ = _across(jaxpr.jaxpr, [len(x.shape) > 0 for x in leaves])
    if why:
        raise ConfigError(f"update_in_backward needs an elementwise optimizer (each parameter's update from its own "
                          f"gradient and state), but this one combines elements ('{why}' in its update: a global "
                          f"clip or norm inside the optax chain?); give clipping as jfsdp.adamw(clip_norm=...)")
