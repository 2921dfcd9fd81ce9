"""Adaptive MoE stages (TUTEL's dynamic capacity): each MoE layer call measures the router's load and runs
with the smallest precompiled capacity that holds it, in the mode and chunk count the cost model
gives that capacity.

Shapes are static in XLA, so a capacity that follows the load is a few precompiled capacities
("buckets", slots per expert per routing group). A variant per bucket, all in ONE program: every MoE
layer call becomes

    load  = layer.load(x)                    (groups, E) choices per expert per group, before dispatch
    m     = pmax(max(load)) over the mesh     the same on every device (the variants' collectives and
                                              shapes must agree across devices)
    i     = first bucket >= m (the last one if none: then its capacity drops, as a static run does)
    y     = lax.switch(i, [layer with capacity = bucket b, in b's mode and chunks, for each b], x)

The choice costs one scalar all-reduce per MoE layer call and no host round trip: the device picks its
branch, nothing is recompiled, the host never waits. The backward pass is a switch on the same index
over the branches' own VJPs (`switch`, a custom VJP): JAX's own derivative of lax.switch keeps the
residuals of every branch (zeros for the branches not taken) from the forward pass to the backward
one, which cost more memory than the largest variant (docs/moe.md). So the switch saves only its
inputs and the taken branch runs its forward again in the backward pass: the layer's experts once
more, and its collectives (the gather, or the dispatch and combine all-to-alls) as remat would; the
cost model counts them (`costs(..., recompute=True)`).

Every variant reads the parameters in the one sharded layout (Shard(0) along experts): switching moves
no data. The experts enter the switch as raw shards: a gather variant all-gathers them inside its
branch (only the branch taken runs its collectives); an ep variant casts the local shard and
all-to-alls the tokens (expert_parallel.py).

The contract on the model's MoE layer (found by class name, `MoE.layer`): called on x (groups, T, d)
(a routing group per row), a field `capacity` (slots per expert per group; the variants are clones
with it set), properties `n_experts` and `top_k`, a method `load(x)` -> (groups, E) int, and outputs
whose shapes do not depend on the capacity.
"""
from __future__ import annotations

import dataclasses
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

from jfsdp.config.errors import ConfigError
from jfsdp.config.mesh import AXES
from jfsdp.engine import expert_parallel
from jfsdp.engine.fsdp import unshard
from jfsdp.engine.layout import is_layout
from jfsdp.engine.moe import StageMoE, auto_chunks, costs, expert_leaves, path_keys, traced_calls

RUNS = ("auto", "gather", "ep")


@dataclasses.dataclass(frozen=True)
class Variant:
    """One bucket: its capacity, the mode and chunks it runs in, and the cost model's figures for it."""
    capacity: int
    mode: str
    chunks: int
    costs: dict
    seconds: float | None = None   # the measured step time behind the choice (MoE.calibration), if any


@dataclasses.dataclass(frozen=True)
class AdaptiveStage(StageMoE):
    layer_path: tuple
    tokens: int             # T: tokens per routing group
    top_k: int
    variants: tuple         # Variant per bucket, capacities increasing


def buckets_for(option, tokens: int, k: int, n_experts: int) -> tuple:
    """The capacities to compile: `option.buckets` checked, or ceil(T*k/E) doubled up to T; capped at
    ceil(capacity_factor * T * k / E) when a capacity factor is given."""
    low = math.ceil(tokens * k / n_experts)   # the least maximum load top-k routing can produce
    b = option.buckets
    if b is None:
        b, c = [], low
        while c < tokens:
            b.append(c)
            c *= 2
        b.append(tokens)
    else:
        b = list(b) if isinstance(b, (tuple, list)) else [b]
        if not b or not all(isinstance(x, int) and not isinstance(x, bool) for x in b):
            raise ConfigError(f"moe buckets must be integers (slots per expert per routing group), got {option.buckets!r}")
        if any(y <= x for x, y in zip(b, b[1:])):
            raise ConfigError(f"moe buckets must be strictly increasing, got {tuple(b)}")
        if b[0] < low:
            raise ConfigError(f"moe bucket {b[0]} is below ceil(T*k/E) = ceil({tokens}*{k}/{n_experts}) = {low}, the "
                              f"least maximum load top-{k} routing can produce: it would drop tokens at every step")
        if b[-1] > tokens:
            raise ConfigError(f"moe bucket {b[-1]} is above the {tokens} tokens of a routing group (an expert gets a "
                              "token at most once)")
    cf = option.capacity_factor
    if cf is not None:
        if not isinstance(cf, (int, float)) or cf <= 0:
            raise ConfigError(f"moe capacity_factor must be a positive number, got {cf!r}")
        cap = min(tokens, max(low, math.ceil(cf * tokens * k / n_experts)))
        b = sorted({min(x, cap) for x in b})
    return tuple(b)


def resolve_stage(sharded, option, j, site, layouts, cost, chunks):
    """moe.resolve's hook for an adaptive stage: its layer, buckets, and per bucket (mode, chunks)."""
    st = sharded.model.stages[j]
    rows = sharded.example_inputs.shape[0]
    local_rows = rows // sharded.n_devices if rows % sharded.n_devices == 0 else rows
    calls = traced_calls(st.unit, sharded.h_shapes[j], local_rows, rows, lambda m: option.matches(m, option.layer))
    paths = {tuple(m.path) for m, _, _ in calls}
    if len(paths) != 1:
        raise ConfigError(f"stage {j}: adaptive MoE needs one MoE layer module ({option.layer}) per unit, found {len(paths)}")
    layer, shape, _ = calls[-1]
    if not (hasattr(layer, "capacity") and hasattr(layer, "load") and len(shape) == 3):
        raise ConfigError(f"stage {j}: the MoE layer {option.layer} needs a `capacity` field and a `load(x)` method "
                          f"and must be called on (groups, tokens, d); got input {shape}")
    tokens, k, E, S = shape[1], layer.top_k, site.n_experts, sharded.shards
    if option.run not in RUNS:
        raise ConfigError(f"stage {j}: adaptive MoE run must be one of {', '.join(RUNS)}, got {option.run!r}")
    ep_ok = sharded.strategy.sharded and E % S == 0
    if option.run == "ep" and not ep_ok:
        raise ConfigError(f"stage {j}: adaptive MoE with run='ep' needs the {E} experts to divide over the {S} fsdp "
                          f"shards of a sharded strategy; use run='gather' or 'auto', or a mesh whose fsdp size divides {E}")
    variants = []
    for c in buckets_for(option, tokens, k, E):
        vsite = dataclasses.replace(site, buckets=(E, shape[0] * c, site.buckets[2]))   # local groups x capacity
        vc = costs(sharded, vsite, layouts, st.n_units, option.backend, recompute=True)
        if option.calibration is not None:
            modes = (option.run,) if option.run != "auto" else ("gather", "ep") if ep_ok else ("gather",)
            mode, n, s = calibrated(option.calibration, j, c, modes, chunks, vsite.buckets[1])
            variants.append(Variant(c, mode, n, vc, s))
            continue
        mode = option.run if option.run != "auto" else ("ep" if ep_ok and vc["ep"] < vc["gather"] else "gather")
        if mode == "ep":
            n = auto_chunks(sharded, vsite, vc, option.backend) if chunks == "auto" else min(chunks, vsite.buckets[1])
        elif chunks not in ("auto", 1) and option.run == "gather":
            raise ConfigError(f"stage {j}: chunks={chunks} applies to expert-parallel mode, not gather")
        else:
            n = 1
        variants.append(Variant(c, mode, n, vc))
    why = (f"adaptive: {len(variants)} capacities {tuple(v.capacity for v in variants)} of T={tokens}, k={k}, E={E}; "
           f"each call runs the smallest that holds the measured maximum load")
    return AdaptiveStage(site, "adaptive", max(v.chunks for v in variants), cost, why, tuple(layer.path), tokens, k,
                         tuple(variants))


def calibrated(table, j: int, capacity: int, modes: tuple, chunks, slots: int) -> tuple:
    """(mode, chunks, seconds): the fastest measured variant at `capacity` among `modes` (and the option's
    `chunks` where it is not 'auto'; never more chunks than the slots per device). `table`:
    {(capacity, mode, chunks): seconds per step}, what moe_calibrate.py measures."""
    if not isinstance(table, dict):
        raise ConfigError(f"moe calibration must be a dict {{(capacity, mode, chunks): seconds}}, got {type(table).__name__}")
    ok = [(s, m, n) for (c, m, n), s in table.items() if c == capacity and m in modes and n <= slots
          and (m == "gather" and n == 1 or m == "ep" and chunks in ("auto", n))]
    if not ok:
        have = sorted({c for c, m, _ in table if m in modes})
        raise ConfigError(f"stage {j}: the moe calibration has no measured {'/'.join(modes)} variant at capacity "
                          f"{capacity}; it measures capacities {', '.join(map(str, have)) or 'none'}. The buckets follow "
                          "the tokens per routing group (the sequence length): plan or train at the shape it was "
                          "measured for, give buckets it measures (--moe-buckets), or measure every bucket "
                          "(jfsdp/planning/moe_calibrate.py)")
    s, m, n = min(ok, key=lambda o: (o[0], o[1] != "gather", o[2]))   # a tie: gather, then fewer chunks
    return m, n, float(s)


def place_params(unshard_fn, shards, layouts, stage: AdaptiveStage, comm):
    """The unit's parameters: everything gathered but the experts, which stay raw local shards; each
    variant gathers them (gather) or casts them where they are (ep) inside its own branch, so that the
    switch's saved inputs hold shards, never gathered experts."""
    site = stage.site

    def one(path, l, x):
        return x if path_keys(path)[: len(site.path)] == site.path else unshard_fn(x, l)
    return jax.tree_util.tree_map_with_path(one, layouts, shards, is_leaf=is_layout)


def interceptor(stage: AdaptiveStage, selector, shards: int, comm, layouts):
    """The flax method interceptor of an adaptive stage: the layer's call becomes the switch over the
    variants (module docstring); inside a variant, the experts' call runs that variant's mode."""
    current = []                 # the variant being traced (innermost last)
    in_experts = []
    capacities = jnp.asarray([v.capacity for v in stage.variants], jnp.int32)
    e_layouts = expert_leaves(layouts, stage.site)

    def experts(mod, x):
        v = current[-1]
        params = mod.variables["params"]   # raw shards: cast where they are (ep) or gather them here
        params = (jax.tree.map(lambda p: expert_parallel.local_shard(p, comm, jnp.dtype(p.dtype)), params)
                  if v.mode == "ep" else jax.tree.map(lambda p, l: unshard(p, l, comm), params, e_layouts))
        n = stage.site.n_experts // shards if v.mode == "ep" else stage.site.n_experts
        clone = mod.clone(parent=None, n_experts=n)

        def compute(b):
            in_experts.append(True)
            try:
                return clone.apply({"params": params}, b)
            finally:
                in_experts.pop()
        if v.mode == "ep":
            return expert_parallel.expert_parallel(x, compute, shards, v.chunks)
        return compute(x)

    def branch(mod, v):
        def run(params, x):
            current.append(v)
            try:
                return mod.clone(parent=None, capacity=v.capacity).apply({"params": params}, x)
            finally:
                current.pop()
        return run

    def hook(next_fun, args, kwargs, context):
        mod = context.module
        if context.method_name != "__call__" or in_experts:
            return next_fun(*args, **kwargs)
        if current and selector.matches(mod):
            return experts(mod, args[0])
        if current or not selector.matches(mod, selector.layer):
            return next_fun(*args, **kwargs)
        x = args[0]
        m = jnp.max(mod.load(x)).astype(jnp.int32)
        m = lax.pmax(m, AXES)
        i = jnp.minimum(jnp.sum(capacities < m), len(stage.variants) - 1)
        return switch([branch(mod, v) for v in stage.variants], hook)(i, mod.variables["params"], x)
    return hook


def switch(branches, hook):
    """(i, params, x) -> lax.switch(i, branches, params, x), differentiated by a custom VJP that saves only
    (i, params, x) and whose backward pass is a switch over the branches' own VJPs: differentiating
    lax.switch itself would keep the residuals of every branch (zeros for those not taken) from the
    forward pass to the backward one. The taken branch runs its forward again in the backward pass."""
    @jax.custom_vjp
    def f(i, params, x):
        # With one branch lax.switch calls it in place, and there the unit's interceptor did not reach the
        # variant's experts call (seen: one 'ep' bucket met the whole experts module holding local shards;
        # cause not traced further). Re-entering the hook makes one and several branches alike; where it is
        # already active the second copy passes every call through (`current` / `in_experts`).
        with nn.intercept_methods(hook):
            return lax.switch(i, branches, params, x)

    def fwd(i, params, x):
        return f(i, params, x), (i, params, x)

    def bwd(res, g):
        i, params, x = res

        def back(run):
            return lambda p, x, g: jax.vjp(run, p, x)[1](g)
        with nn.intercept_methods(hook):
            return (None, *lax.switch(i, [back(b) for b in branches], params, x, g))
    f.defvjp(fwd, bwd)
    return f
