"""Memory and communication accounting: "will it fit?" answered twice, and the two answers compared.

1. `estimate`: an analytic breakdown per device, from the plan's parameter layouts (sizes, dtypes,
   padding, shards), the optimizer's state shapes and the activations that the unit's checkpoint
   policy saves (read from the traced unit, so it works for any model handed to `fully_shard`).
   Nothing is compiled.
2. `measure`: XLA's buffer assignment of the real compiled train step, lowered from
   `jax.ShapeDtypeStruct` inputs so that no state is allocated (works on fake CPU devices).

`comm_formula` is the contract's communication per step, `comm_measured` the same read from the
compiled HLO (collectives inside the unit scan multiplied by its trip count).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from jfsdp.planning import hlo
from jfsdp.engine.layout import Layout, is_layout
from jfsdp.engine.sharded import FSDP
from jfsdp.config.policy import wire_dtype
from jfsdp.train.step import abstract_state, make_train_step

GiB = 1 << 30


def _nbytes(x) -> int:
    return int(math.prod(x.shape)) * jnp.dtype(x.dtype).itemsize


def _tree_bytes(tree) -> int:
    return sum(_nbytes(x) for x in jax.tree.leaves(tree))


# ---------------------------------------------------------------- abstract inputs (nothing allocated)

def abstract_batch(plan: FSDP, batch):
    """A (global) batch tree of shapes -> ShapeDtypeStructs split over all devices."""
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=plan.batch_sharding), batch)


def compile_step(plan: FSDP, optimizer, loss_fn: Callable, batch, grad_accum: int = 1,
                 compiler_options: dict | None = None, update_in_backward: bool = False):
    """The real train step (jfsdp.make_train_step, donated state), compiled from abstract inputs.
    `compiler_options`: XLA options for this compilation (e.g. jfsdp.planning.targets.compiler_options())."""
    step = make_train_step(plan, optimizer, loss_fn, grad_accum, update_in_backward=update_in_backward)
    lowered = step.lower(abstract_state(plan, optimizer), abstract_batch(plan, batch))
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


# ---------------------------------------------------------------- the analytic estimate

@dataclasses.dataclass(frozen=True)
class Breakdown:
    """Bytes per device. `params`, `grads`, `optimizer` count real elements only; `padding` is the
    padding rows of all three. `gathered`: unsharded copies in param_dtype (root + one unit, two
    with prefetch; every unit for SHARD_GRAD_OP). `grad_buffers`: unsharded gradients before they
    are reduce-scattered (a ZeRO-2 unit's; root weights' whose reduce-scatter waits: a tied weight's,
    an untied embedding table's in its backward, on CPU an untied head's). `activations`: what the
    remat policy keeps for all units, the head's saved values, and the working set of one unit's
    backward."""
    params: int
    grads: int
    optimizer: int
    padding: int
    gathered: int
    grad_buffers: int
    activations: int
    batch: int

    persistent_padding: int = 0  # the part of `padding` in parameters and optimizer state

    @property
    def persistent(self) -> int:
        """Held between steps: parameters, optimizer state and their padding."""
        return self.params + self.optimizer + self.persistent_padding

    @property
    def total(self) -> int:
        return (self.params + self.grads + self.optimizer + self.padding + self.gathered + self.grad_buffers
                + self.activations + self.batch)

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["persistent"], d["total"] = self.persistent, self.total
        return d


def _stages(plan: FSDP):
    """[(layouts of one unit, number of units)] for every stage of the plan."""
    return list(zip(plan.split(plan.layouts)[1], plan.stage_sizes))


def _elements(plan: FSDP):
    """(real elements, padding elements) of all parameters, whole model (each stage's unit counted
    n times)."""
    real = pad = 0
    for layouts, mult in [(plan.split(plan.layouts)[0], 1)] + _stages(plan):
        for l in jax.tree.leaves(layouts, is_leaf=is_layout):
            real += mult * math.prod(l.shape)
            pad += mult * l.padding
    return real, pad


def _stored_bytes(layouts, dtype=None) -> int:
    """Bytes of one unsharded (gathered, padded) copy of these layouts, in `dtype` (default: own)."""
    return sum(math.prod(l.stored_shape) * jnp.dtype(dtype or l.dtype).itemsize
               for l in jax.tree.leaves(layouts, is_leaf=is_layout))


def _cast(layouts, dtype):
    return jax.tree.map(lambda l: jax.ShapeDtypeStruct(l.shape, dtype or l.dtype), layouts, is_leaf=is_layout)


def _residual_bytes(f, *args, skip_args=True) -> int:
    """Bytes of the values JAX saves from f's forward for its backward (its checkpoint policy
    applied). Arguments are skipped: the caller accounts for them."""
    from jax._src.ad_checkpoint import saved_residuals  # public only as print_saved_residuals
    total = 0
    for aval, where in saved_residuals(f, *args):
        if skip_args and where.startswith("from the argument"):
            continue
        total += int(math.prod(aval.shape)) * jnp.dtype(aval.dtype).itemsize
    return total


def activation_estimate(plan: FSDP, loss_fn: Callable, local_batch, backend: str | None = None,
                        widen: bool = True) -> dict:
    """Activation bytes per device, from the traced model on one device's batch, per stage:
    `per_unit`: saved by a unit's checkpoint policy (plus the unit's input, which the scan keeps);
    `unit_working`: everything one unit's backward needs at once (its activations with nothing
    recomputed away); and `head`: values the embedding, head and loss keep for backward.
    `stages` lists {'per_unit', 'unit_working'} of each stage; the top-level `per_unit` and
    `unit_working` are the first stage's (the whole answer for a one-stage model).
    `widen=False`: in param_dtype as the program writes it, not as the backend computes it
    (`wire_dtype`): what XLA:CPU stores from the forward pass (see `estimate`)."""
    m, mp = plan.model, plan.mp
    pdt = jnp.dtype(mp.param_dtype or jnp.float32)
    pdt = wire_dtype(pdt, backend or jax.default_backend()) if widen else pdt
    root_layouts, stage_layouts = plan.split(plan.layouts)
    root_p = _cast(root_layouts, pdt)
    inputs = local_batch["inputs"]
    h = jax.eval_shape(lambda r, x: m.root.apply({"params": r}, x, method=m.embed_method), root_p, inputs)
    cp = jax.checkpoint_policies
    base = {"none": cp.everything_saveable, "full": cp.nothing_saveable, "dots": cp.dots_saveable}[plan.remat]
    stages = []
    for st, layouts in zip(m.stages, stage_layouts):
        unit_p = _cast(layouts, pdt)
        unit_fn = lambda x, p, unit=st.unit: unit.apply({"params": p}, x)
        stages.append({"per_unit": _residual_bytes(jax.checkpoint(unit_fn, policy=base), h, unit_p) + _tree_bytes(h),
                       "unit_working": _residual_bytes(unit_fn, h, unit_p) + _tree_bytes(h)})
        h = jax.eval_shape(unit_fn, h, unit_p)

    def head_loss(x, r, batch):
        out = m.root.apply({"params": r}, x, method=m.head_method)
        out = out.astype(mp.output_dtype) if mp.output_dtype and isinstance(out, jax.Array) else out
        return loss_fn(out, batch)

    out = jax.eval_shape(lambda x, r: m.root.apply({"params": r}, x, method=m.head_method), h, root_p)
    head = _residual_bytes(head_loss, h, root_p, local_batch)
    if isinstance(out, jax.ShapeDtypeStruct):   # logits: + the output's cotangent in fp32
        head += 2 * _nbytes(out)
    else:   # a fused head + loss (hidden, weight): the weight's gradient (one buffer of its dtype,
        # written block by block), and the hidden states' fp32 gradient accumulator and the
        # product added into it
        *hs, w = jax.tree.leaves(out)
        head += _nbytes(w) + 2 * sum(math.prod(x.shape) * 4 for x in hs)
        chunk = getattr(loss_fn, "chunk", None)
        if chunk:   # jfsdp.train.losses.lm_loss: a few (chunk, vocabulary) fp32 buffers at a time
            vocab = w.shape[0] if getattr(loss_fn, "vocab_major", False) else w.shape[-1]
            tokens = math.prod(inputs.shape)
            head += 2 * min(chunk, tokens) * vocab * 4
    return {**stages[0], "head": head, "stages": stages}


def estimate(plan: FSDP, optimizer, loss_fn: Callable, batch, *, prefetch: bool = False,
             backend: str | None = None, update_in_backward: bool = False) -> Breakdown:
    """Analytic per-device bytes at the peak of one train step of `plan` on the global `batch`
    (a tree of shapes): the state plus the largest of what is live at four points of the step, the
    head's backward, the units' backward, the embedding's backward and the update (see the
    comments below). `backend`: whose dtypes ('cpu' widens bf16 compute to f32: `wire_dtype`) and
    whose scheduling the figure is for; the compiled CPU figure assumes XLA:CPU's memory-minimizing
    scheduler (jfsdp.config.xla_flags.CPU_FLAGS, as train.py and the planner compile).
    `update_in_backward`: the step of `make_train_step(update_in_backward=True)`, which runs the
    prefetch pipeline's loops (two gathered units) and never holds the units' whole gradient."""
    backend = backend or jax.default_backend()
    S, N = plan.shards, plan.n_devices
    root_l = plan.split(plan.layouts)[0]
    stages = _stages(plan)
    master = max(jnp.dtype(l.dtype).itemsize for l in jax.tree.leaves(plan.layouts, is_leaf=is_layout))
    real, pad = _elements(plan)
    params = real * master // S
    opt_total = _tree_bytes(jax.eval_shape(optimizer.init, plan.abstract_params()))
    opt_per_byte = opt_total / ((real + pad) * master)  # AdamW: 2.0 (two fp32 moments)
    optimizer_b = int(round(params * opt_per_byte))
    pad_state = int(round(pad * master * (1 + opt_per_byte) / S))
    pad_grads = pad * master // S

    pdt = plan.mp.param_dtype or jnp.float32
    rdt = plan.mp.reduce_dtype or pdt
    gdt = wire_dtype(pdt, backend)
    # the root leaves the head reads stay gathered to its backward (the peak); those only the
    # embedding reads are gathered and freed at the start (FSDP.root_use)
    leaves = jax.tree.leaves(root_l, is_leaf=is_layout)
    head_root = [leaves[i] for i in sorted(plan.root_use[1])]
    root_g = _stored_bytes(head_root, gdt)
    unit_g = [_stored_bytes(l, gdt) for l, _ in stages]   # one gathered unit of each stage
    for j, m in enumerate(getattr(plan, "moe_stages", None) or []):
        if m is not None and m.mode == "ep":   # its experts are not gathered: a cast local shard
            from jfsdp.engine import moe
            unit_g[j] -= moe.expert_bytes(stages[j][0], m.site, gdt) * (S - 1) // S
    unit_r = [_stored_bytes(l, rdt) for l, _ in stages]
    if S > 1:
        # ZeRO-3 keeps one gathered unit at a time (two with prefetch): the largest of any stage. Its
        # unsharded gradient needs no room of its own: each leaf's gradient is reduce-scattered as
        # soon as it is complete and the gathered leaf dies after its last use, so one takes the
        # place of the other (measured: the compiled peak holds root + one unit, not root + unit +
        # unit gradient).
        # ZeRO-2 keeps every unit from the forward scans (stacked buffers, freed only when each
        # backward scan ends), so the unit being differentiated needs a gradient buffer besides.
        # A one-unit stage is kept like the root: XLA removes a loop of one iteration and merges
        # its forward and backward gathers (measured: +1.34 MB for a 1.41 MB unit at 1x8).
        if plan.strategy.reshard_after_forward:
            single = sum(u for u, (_, n) in zip(unit_g, stages) if n == 1)
            looped = max([u for u, (_, n) in zip(unit_g, stages) if n > 1], default=0)
            gathered = root_g + single + looped * (2 if prefetch or update_in_backward else 1)
            grad_buffers = 0
        else:
            gathered = root_g + sum(u * n for u, (_, n) in zip(unit_g, stages))
            grad_buffers = max(unit_r)
    else:
        # One shard (NO_SHARD, or any strategy on an Rx1 mesh): unshard is at most a cast, which the
        # backward pass redoes rather than keeps (core.FSDP), so a param_dtype copy exists for the
        # root and one unit at a time, and only where compute runs in another dtype than the master.
        # The gradient all-reduce runs in place (an earlier "second full gradient" measured with N > 1
        # devices was the optimizer's clipped copy of the gradients, gone since jfsdp.step's clipping).
        gathered = 0 if gdt == jnp.dtype(jnp.float32) else root_g + max(unit_g)
        grad_buffers = 0

    local = jax.tree.map(lambda a: jax.ShapeDtypeStruct((a.shape[0] // N, *a.shape[1:]), a.dtype), batch)
    act = activation_estimate(plan, loss_fn, local, backend)
    recompute = max(s["unit_working"] - s["per_unit"] for s in act["stages"])
    saved = sum(n * s["per_unit"] for s, (_, n) in zip(act["stages"], stages))
    # Until the backward scan starts, the saved activations are held in the dtype the forward wrote:
    # XLA:CPU widens a bf16 plan's arithmetic, not the forward scan's stacked outputs; it converts
    # the whole stack to f32 just before the backward scan (measured, llama-70b bf16 on 1x64: 2.50
    # GiB of bf16 unit inputs through the head's backward, 5.00 GiB of f32 in the units' backward).
    saved_fwd = saved
    if gdt != jnp.dtype(pdt):
        act_fwd = activation_estimate(plan, loss_fn, local, backend, widen=False)
        saved_fwd = sum(n * s["per_unit"] for s, (_, n) in zip(act_fwd["stages"], stages))
    # Four candidates for the peak; the largest is the estimate.
    # (a) the head's backward: the gathered root and the head's working set; no gradient shard
    #     exists yet (XLA:CPU's memory-minimizing scheduler makes the units' stacked gradient buffers
    #     just before the backward scan: jfsdp.config.xla_flags.CPU_FLAGS).
    # (b) the units' backward: every unit's gradient shard (one stacked buffer per stage), the
    #     unsharded gradient of a root weight the embedding also reads (a tied weight: reduced once,
    #     after the embedding's backward), the gathered unit(s) and what remat recomputes. On CPU
    #     also the unsharded gradient of the root leaves only the head reads (an untied output
    #     weight, in param_dtype as the head writes it): XLA:CPU's scheduler reduce-scatters it after
    #     the backward scan, XLA:GPU right after the head's backward (measured, llama-70b on 1x64:
    #     1.96 GiB of bf16 held through the units' backward on CPU, not on the H100 target).
    # (c) the embedding's backward, once the units' are done: every unit's gradient shard, the
    #     unsharded gradient of the root leaves only the embedding reads (an untied table: the
    #     lookup's gradient is a scatter-add into a whole table, in param_dtype, and its cast to
    #     reduce_dtype for the reduce-scatter) and one gathered unit (XLA:GPU overlaps the last
    #     unit's backward with it and reduces both in one combined reduce-scatter; measured on the
    #     H100 target, llama-70b on 1x64: 1.96 GiB bf16 + 3.91 GiB f32 table + the last unit).
    # (d) the update: the state and every gradient shard.
    unit_grads = sum(n * _stored_bytes(l) for l, n in stages) // S
    embed_reads, head_reads = plan.root_use
    shared = [leaves[i] for i in sorted(embed_reads & head_reads)]
    head_only = [leaves[i] for i in sorted(head_reads - embed_reads)]
    embed_only = [leaves[i] for i in sorted(embed_reads - head_reads)]
    held = _stored_bytes(head_only, pdt) if backend == "cpu" else 0
    rdt_wire = wire_dtype(rdt, backend)
    table = _stored_bytes(embed_only, gdt) + (_stored_bytes(embed_only, rdt_wire) if rdt_wire != gdt else 0)
    units_gathered = gathered - (root_g if S > 1 or gathered else 0)
    one_unit = max(unit_g) if S > 1 or gathered else 0
    # (gradient shards, gathered, unsharded gradients, activations, padding of the gradients)
    points = {
        "head": (0, gathered, grad_buffers, saved_fwd + act["head"], 0),
        "units": (unit_grads, units_gathered, grad_buffers + _stored_bytes(shared, gdt) + held, saved + recompute, 0),
        "embed": (unit_grads, one_unit if embed_only else 0, held + table, 0, 0),
        "update": (params, 0, 0, 0, pad_grads),
    }
    if update_in_backward:
        # No stacked gradient: each unit's gradient shard is consumed (one leaf's rows at a time: its
        # gradient and new parameter and moment rows) inside the backward loop. The root's gradient
        # shards, reduced right after the head's backward, are held to the root's update at the end.
        root_grads = _stored_bytes(leaves) // S
        unit_leaves = [x for l, _ in stages for x in jax.tree.leaves(l, is_leaf=is_layout)]
        rows = 4 * max(_stored_bytes([x]) for x in unit_leaves) // S
        # (the tied weight's head gradient is reduced then too: no unsharded gradient is held)
        points["units"] = (root_grads + rows, units_gathered, grad_buffers, saved + recompute, 0)
        points["embed"] = (root_grads,) + points["embed"][1:]
        points["update"] = (root_grads, 0, 0, 0, 0)
    name = max(points, key=lambda k: sum(points[k]))
    grads, gath, buffers, activations, pad_g = points[name]
    return Breakdown(params=params, grads=grads, optimizer=optimizer_b, padding=pad_state + pad_g,
                     persistent_padding=pad_state, gathered=gath, grad_buffers=buffers,
                     activations=activations, batch=_tree_bytes(local))


# ---------------------------------------------------------------- communication per step

def comm_formula(plan: FSDP, backend: str | None = None) -> dict:
    """Bytes each device sends per step, by collective kind, from the contract (ring cost model),
    with the root (gathered once per step, not twice), padding and the backend's wire dtype
    (`wire_dtype`) counted exactly.
    `contract` is the headline approximation: 3Ψ·b·(S−1)/S (FULL_SHARD), 2Ψ·b(N−1)/N (DDP)."""
    S, R, N = plan.shards, plan.replicas, plan.n_devices
    backend = backend or jax.default_backend()
    pdt = wire_dtype(plan.mp.param_dtype or jnp.float32, backend)
    rdt = wire_dtype(plan.mp.reduce_dtype or pdt, backend)
    root_l = plan.split(plan.layouts)[0]
    root_p = _stored_bytes(root_l, pdt)
    unit_p = sum(n * _stored_bytes(l, pdt) for l, n in _stages(plan))
    grads = _stored_bytes(root_l, rdt) + sum(n * _stored_bytes(l, rdt) for l, n in _stages(plan))
    psi = _elements(plan)[0]
    # the headline formula uses the policy's dtypes, not the backend's
    pb = jnp.dtype(plan.mp.param_dtype or jnp.float32).itemsize
    rb = jnp.dtype(plan.mp.reduce_dtype or plan.mp.param_dtype or jnp.float32).itemsize
    out = {"all-gather": 0.0, "reduce-scatter": 0.0, "all-reduce": 0.0, "all-to-all": 0.0}
    # expert-parallel MoE stages (jfsdp/moe.py): their experts are neither gathered nor
    # reduce-scattered; their tokens travel by all-to-all instead (the cost model's 'ep' figure)
    from jfsdp.engine import moe
    a2a = ep_grads = 0.0
    for (layouts, n), m in zip(_stages(plan), getattr(plan, "moe_stages", None) or []):
        if m is not None and m.mode == "ep":
            unit_p -= n * moe.expert_bytes(layouts, m.site, pdt)
            ep_grads += n * moe.expert_bytes(layouts, m.site, rdt)
            a2a += moe.costs(plan, m.site, layouts, n, backend)["ep"]
    grads -= ep_grads
    if plan.strategy.sharded:
        gathers = 2 if plan.strategy.reshard_after_forward else 1
        f = (S - 1) / S
        out["all-gather"] = (root_p + gathers * unit_p) * f
        out["reduce-scatter"] = grads * f
        out["all-reduce"] = 2 * (grads / S) * (R - 1) / R  # the shard, summed over replicas
        out["all-reduce"] += 2 * (ep_grads / S) * (R - 1) / R  # local experts' gradients, over replicas
        out["all-to-all"] = a2a
        contract = (gathers * psi * pb + psi * rb) * f + 2 * psi * rb / S * (R - 1) / R
    else:
        out["all-reduce"] = 2 * grads * (N - 1) / N
        contract = 2 * psi * rb * (N - 1) / N
    out["total"] = sum(out.values())
    out["contract"] = contract
    return out


def comm_measured(compiled, n_devices: int) -> dict:
    """Bytes each device sends per step, by kind, read from the compiled HLO (loops unrolled by
    their trip counts). Scalars (the loss, the gradient norm) are included; they are a few bytes."""
    per = hlo.per_step(compiled.as_text(), n_devices)
    out = {k: per.get(k, {}).get("wire_bytes", 0.0) for k in ("all-gather", "reduce-scatter", "all-reduce", "all-to-all")}
    out["total"] = sum(v["wire_bytes"] for v in per.values())
    return out
