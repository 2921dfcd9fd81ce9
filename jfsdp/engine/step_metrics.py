"""A train step's own metrics: scalars read from the same forward pass as its loss (`metrics=` of
`FSDP.loss_and_grad` and `make_train_step`), such as an MoE router's load-balancing loss, dropped share
and the capacity it ran with.

A metric is `fn(outputs, batch) -> scalar` with the loss contract's arguments (the head's outputs and
one device's rows of one micro-batch), or `(fn, reduce)`: reduce 'mean' (the default: averaged over
micro-batches and devices, as the loss is) or 'max' (the largest over micro-batches and devices, for a
figure such as the capacity a step ran with, where a mean would name no capacity at all). Values are
float32 and never differentiated.
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from jfsdp.config.errors import ConfigError

REDUCE = ("mean", "max")


def check(metrics, reserved=()) -> dict | None:
    """{name: (fn, reduce)} from a `metrics=` argument (None or empty: None); ConfigError for a name in
    `reserved` (what the caller returns beside them), something not callable, or an unknown reduction."""
    if not metrics:
        return None
    if not hasattr(metrics, "items"):
        raise ConfigError(f"metrics must be a dict of name -> fn(outputs, batch) (or (fn, 'mean'|'max')), got "
                          f"{type(metrics).__name__}")
    out = {}
    for name, spec in metrics.items():
        if isinstance(spec, tuple) and len(spec) != 2:
            raise ConfigError(f"metric '{name}': a tuple is (fn, 'mean'|'max'), got {len(spec)} items")
        fn, reduce = spec if isinstance(spec, tuple) else (spec, "mean")
        if name in reserved:
            raise ConfigError(f"metric name '{name}' is one the train step returns itself; choose another")
        if not callable(fn):
            raise ConfigError(f"metric '{name}' is not a function of (outputs, batch): {fn!r}")
        if reduce not in REDUCE:
            raise ConfigError(f"metric '{name}': reduce '{reduce}' is not one of {', '.join(REDUCE)}")
        out[str(name)] = (fn, reduce)
    return out


def local(metrics: dict, outputs, batch) -> dict:
    """One device's values on its rows (inside shard_map), float32 scalars, cut off from the gradient."""
    out = {}
    for name, (fn, _) in metrics.items():
        x = fn(outputs, batch)
        if jnp.shape(x) != ():
            raise ConfigError(f"metric '{name}' must return a scalar, got shape {jnp.shape(x)}")
        out[name] = lax.stop_gradient(jnp.asarray(x).astype(jnp.float32))
    return out


def over_micro_batches(metrics: dict, stacked: dict) -> dict:
    """Values stacked over micro-batches (leading axis) -> one per metric, by its reduction."""
    return {k: jnp.max(v, 0) if metrics[k][1] == "max" else jnp.mean(v, 0) for k, v in stacked.items()}


def over_devices(metrics: dict, values: dict, plan) -> dict:
    """One device's values -> the global ones (inside the plan's shard_map): the mean over the rows (a psum
    over the plan's `loss_axes`, divided as the loss is: by its devices, less the T tensor ranks that share
    one row's figure where the loss is weighted by T, `loss_weight`), or the largest."""
    axes = plan.loss_axes
    n = plan.n_devices // getattr(plan, "loss_weight", 1)
    return {k: lax.pmax(v, axes) if metrics[k][1] == "max" else lax.psum(v, axes) / n for k, v in values.items()}
