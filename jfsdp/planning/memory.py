"""Memory and communication accounting: "will it fit?" answered twice, and the two answers compared.

1. `estimate` (`jfsdp.planning.estimate`): an analytic breakdown per device, from the plan's parameter
   layouts, the optimizer's state shapes and the activations that the unit's checkpoint policy saves.
   Nothing is compiled.
2. `measure`: XLA's buffer assignment of the real compiled train step, lowered from
   `jax.ShapeDtypeStruct` inputs so that no state is allocated (works on fake CPU devices).

`comm_formula` is the contract's communication per step, `comm_measured` the same read from the
compiled HLO (collectives inside the unit scan multiplied by its trip count).

This module is the planner's API: `estimate` and its `Breakdown` are given here beside the compiled
side, so that a caller compares the two from one place.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Callable

import jax
import jax.numpy as jnp

from jfsdp.config.errors import ConfigError
from jfsdp.config.policy import wire_dtype
from jfsdp.engine import column_embed
from jfsdp.engine.sharded import FSDP
from jfsdp.planning import as_is, context_plan, hlo
from jfsdp.planning.estimate import Breakdown, estimate, grad_layouts
from jfsdp.engine.layout import stored_bytes
from jfsdp.planning.sizes import elements, float8_leaves, gathered_bytes, stages
from jfsdp.train.step import abstract_state, make_train_step

__all__ = ["Breakdown", "abstract_batch", "comm_formula", "comm_measured", "compile_step", "device_peak", "estimate",
           "measure"]


# ---------------------------------------------------------------- abstract inputs (nothing allocated)

def abstract_batch(plan: FSDP, batch):
    """A (global) batch tree of shapes -> ShapeDtypeStructs split over all devices."""
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=plan.batch_sharding), batch)


def compile_step(plan: FSDP, optimizer, loss_fn: Callable, batch, grad_accum: int = 1,
                 compiler_options: dict | None = None, update_in_backward: bool = False, grad_sync: str = "every",
                 trainable=None):
    """The real train step (jfsdp.make_train_step, donated state), compiled from abstract inputs.
    `compiler_options`: XLA options for this compilation (e.g. jfsdp.planning.targets.compiler_options()).
    `trainable`: make_train_step's (frozen parameters)."""
    step = make_train_step(plan, optimizer, loss_fn, grad_accum, update_in_backward=update_in_backward,
                           grad_sync=grad_sync, trainable=trainable)
    lowered = step.lower(abstract_state(plan, optimizer, trainable=trainable), abstract_batch(plan, batch))
    return lowered.compile(compiler_options=compiler_options) if compiler_options else lowered.compile()


def measure(compiled) -> dict:
    """Per-device bytes from XLA's buffer assignment: argument, output, temp, alias, and `total` =
    argument + output + temp − alias (donated state: the new state reuses the old one's buffers)."""
    return hlo.memory(compiled)


def device_peak(device=None) -> int | None:
    """Peak bytes in use on a real accelerator after steps have run (None where unsupported, e.g. CPU)."""
    device = device or jax.devices()[0]
    try:
        stats = device.memory_stats()
    except Exception:  # some backends raise instead of returning None
        stats = None
    return int(stats["peak_bytes_in_use"]) if stats and "peak_bytes_in_use" in stats else None


# ---------------------------------------------------------------- communication per step

def comm_formula(plan: FSDP, backend: str | None = None, grad_accum: int = 1, grad_sync: str = "every",
                 trainable=None, batch=None) -> dict:
    """Bytes each device sends per step, by collective kind, from the contract (ring cost model),
    with the root (gathered once per step, not twice), padding and the backend's wire dtype
    (`wire_dtype`) counted exactly.
    `contract` is the headline approximation: 3Ψ·b·(S−1)/S (FULL_SHARD), 2Ψ·b(N−1)/N (DDP).
    With `grad_accum` = k micro-batches each gathers its units (k times the all-gathers); the
    gradients are reduced k times (`grad_sync='every'`) or once ('once').
    `trainable` (make_train_step's): frozen leaves are gathered but never reduced; the contract's Ψ of
    the reduction is the trainable parameters'.
    At C > 1, `collective-permute`: the ring attention's K/V and gradient blocks for the global `batch` (a
    tree of shapes; jfsdp.planning.context_plan.ring_bytes), not part of the contract."""
    plan = as_is.view(plan)   # a model given as it is: its units as stages (jfsdp.planning.as_is)
    if plan.tensor > 1:
        raise ConfigError("with tensor parallelism the formula depends on the batch and the loss: "
                          "jfsdp.planning.tensor_comm.tensor_comm (by_kind for this function's form)")
    S, R, N = plan.shards, plan.replicas, plan.n_devices
    backend = backend or jax.default_backend()
    pdt = wire_dtype(plan.mp.param_dtype or jnp.float32, backend)
    rdt = wire_dtype(plan.mp.reduce_dtype or pdt, backend)
    root_p = stored_bytes(plan.split(plan.layouts)[0], pdt)
    # the units as gathered: a float8 plan's selected kernels go out at 1 byte (plan.unit_layouts)
    gathered = list(zip(getattr(plan, "unit_layouts", None) or plan.split(plan.layouts)[1], plan.stage_sizes))
    unit_p = sum(n * gathered_bytes(l, pdt) for l, n in gathered)
    g = grad_layouts(plan, trainable)
    grads = stored_bytes(g.root_tree, rdt) + sum(n * stored_bytes(l, rdt) for l, n in g.stages)
    psi, psi_g = elements(plan)[0], g.real_elements   # psi_g: the parameters that are reduced (trainable)
    # the headline formula uses the policy's dtypes, not the backend's
    pb = jnp.dtype(plan.mp.param_dtype or jnp.float32).itemsize
    rb = jnp.dtype(plan.mp.reduce_dtype or plan.mp.param_dtype or jnp.float32).itemsize
    out = {"all-gather": 0.0, "reduce-scatter": 0.0, "all-reduce": 0.0, "all-to-all": 0.0}
    # expert-parallel MoE stages (jfsdp.engine.moe): their experts are neither gathered nor reduce-scattered;
    # their tokens travel by all-to-all instead (the cost model's 'ep' figure)
    from jfsdp.engine import moe
    a2a = ep_grads = 0.0
    for (layouts, n), m in zip(stages(plan), getattr(plan, "moe_stages", None) or []):
        if m is not None and m.mode == "ep":
            unit_p -= n * moe.expert_bytes(layouts, m.site, pdt)
            ep_grads += n * moe.expert_bytes(layouts, m.site, rdt)
            a2a += moe.costs(plan, m.site, layouts, n, backend)["ep"]
    grads -= ep_grads
    if plan.strategy.sharded:
        gathers = 2 if plan.strategy.reshard_after_forward else 1
        f = (S - 1) / S
        # the backward's re-gathers: every unit leaf, except where the plan knows the backward reads
        # fewer (a model given as it is: AsIsView.regathered)
        again = getattr(plan, "regathered", None)
        unit_p_again = unit_p if again is None else sum(n * gathered_bytes(l, pdt) for l, n in zip(again, plan.stage_sizes))
        if plan.saves_last_unit and not (again is not None and grad_sync == "once"):   # the last unit saved for its
            unit_p_again -= gathered_bytes(gathered[-1][0] if again is None else again[-1], pdt)   # backward (AsIs too)
        out["all-gather"] = (root_p + unit_p + (gathers - 1) * unit_p_again) * f
        # float8: one fp32 amax all-reduce (max over fsdp) per float8 leaf and gather
        out["all-reduce"] += gathers * sum(n * float8_leaves(l) for l, n in gathered) * 2 * 4 * f
        out["reduce-scatter"] = grads * f
        out["all-reduce"] += 2 * (grads / S) * (R - 1) / R  # the shard, summed over replicas
        out["all-reduce"] += 2 * (ep_grads / S) * (R - 1) / R  # local experts' gradients, over replicas
        out["all-to-all"] = a2a
        contract = (gathers * psi * pb + psi_g * rb) * f + 2 * psi_g * rb / S * (R - 1) / R
    else:
        out["all-reduce"] = 2 * grads * (N - 1) / N
        contract = 2 * psi_g * rb * (N - 1) / N
    # an untied embedding looked up by columns in each micro-batch (jfsdp/engine/column_embed.py)
    looked_up = column_lookup_terms(plan, out, lookup_tokens(plan, batch, grad_accum), grad_sync, pdt, rdt)
    k_reduce = grad_accum if grad_sync == "every" else 1
    for key, times in (("all-gather", grad_accum), ("all-to-all", grad_accum), ("reduce-scatter", k_reduce),
                       ("all-reduce", k_reduce)):
        out[key] *= times
    if plan.strategy.sharded and getattr(plan, "root_gathered_once", False) and grad_accum > 1:
        # the root's gathers once per step, but a head gathered in the last unit call (as_is/late_root.py)
        late = plan.root_in_every_micro_batch(pdt) if grad_sync == "every" else 0
        out["all-gather"] -= (root_p - late - looked_up) * (S - 1) / S * (grad_accum - 1)
    if getattr(plan, "context", 1) > 1:
        if batch is None:
            raise ConfigError("at C > 1 the ring's bytes depend on the batch: comm_formula(..., batch=)")
        out["collective-permute"] = context_plan.ring_bytes(plan, batch, backend)
    out["total"] = sum(out.values())
    out["contract"] = contract * k_reduce if not plan.strategy.sharded else contract + (
        (gathers * psi * pb * (S - 1) / S) * (grad_accum - 1)
        + (psi_g * rb * (S - 1) / S + 2 * psi_g * rb / S * (R - 1) / R) * (k_reduce - 1))
    return out


def column_lookup_terms(plan, out: dict, tokens, grad_sync: str, pdt, rdt) -> int:
    """`comm_formula`'s terms for the embedding tables looked up by columns (jfsdp/engine/column_embed.py) at
    `tokens` a device, added to `out` (one micro-batch's bytes by kind): no gather or reduce-scatter of the
    table; its four all-to-alls and the ids' gather. Returns the tables' gathered bytes (`pdt`)."""
    looked_up = 0
    for l in plan.column_lookups(grad_sync) if tokens is not None else ():
        if column_embed.applies(l, tokens):
            f, wire = (l.shards - 1) / l.shards, column_embed.wire_bytes(l, tokens, pdt.itemsize, pdt.itemsize,
                                                                        rdt.itemsize)
            looked_up += stored_bytes(l, pdt)
            out["all-gather"] += wire["all-gather"] - stored_bytes(l, pdt) * f
            out["reduce-scatter"] -= stored_bytes(l, rdt) * f
            out["all-to-all"] += wire["all-to-all"]
    return looked_up


def lookup_kind(plan, batch=None, grad_accum: int = 1, grad_sync: str = "every") -> str | None:
    """How the step looks up an untied nn.Embed table on the prefetch paths (jfsdp/engine/column_embed.py): 'columns'
    (no gather of the table), 'gathered' (the tokens outnumber what a column lookup saves), None (no such table)."""
    tables = plan.column_lookups(grad_sync) if plan.tensor == 1 else []   # (T > 1: leaves on more axes, none eligible)
    if not tables:
        return None
    tokens = lookup_tokens(plan, batch, grad_accum)
    return "columns" if tokens is not None and all(column_embed.applies(l, tokens) for l in tables) else "gathered"


def lookup_tokens(plan, batch=None, grad_accum: int = 1) -> int | None:
    """Token ids a device looks up per micro-batch: its share of the batch's `inputs` (`batch`, a tree of shapes,
    or the plan's example inputs), or None where the plan has no such array."""
    x = batch if batch is not None else getattr(plan, "example_inputs", None)
    if x is None:
        x = getattr(plan, "example_batch", None)
    x = x.get("inputs") if isinstance(x, Mapping) else x
    if not hasattr(x, "shape"):
        return None
    return math.prod(x.shape) // (plan.n_devices * grad_accum)


def comm_measured(compiled, n_devices: int) -> dict:
    """Bytes each device sends per step, by kind, read from the compiled HLO (loops unrolled by
    their trip counts). Scalars (the loss, the gradient norm) are included; they are a few bytes."""
    per = hlo.per_step(compiled.as_text(), n_devices)
    out = {k: per.get(k, {}).get("wire_bytes", 0.0) for k in ("all-gather", "reduce-scatter", "all-reduce", "all-to-all",
                                                              "collective-permute")}
    out["total"] = sum(v["wire_bytes"] for k, v in per.items() if k != "unknown_loops")
    if per.get("unknown_loops"):   # loops whose trip count XLA does not state: their collectives counted once
        out["unknown_loops"] = per["unknown_loops"]
    return out
