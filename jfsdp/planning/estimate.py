"""The analytic answer to "will it fit?": a breakdown of the bytes per device at the peak of one train
step, from the plan's parameter layouts (sizes, dtypes, padding, shards), the optimizer's state shapes
and the activations that the unit's checkpoint policy saves (`jfsdp.planning.activations`). Nothing
is compiled; `jfsdp.planning.memory.measure` is the compiled answer it is checked against."""
from __future__ import annotations

import dataclasses
import math
from typing import Callable

import jax
import jax.numpy as jnp

from jfsdp.config.errors import ConfigError
from jfsdp.config.policy import wire_dtype
from jfsdp.engine.layout import is_layout
from jfsdp.engine.sharded import FSDP
from jfsdp.planning import as_is, context_plan, tensor_memory
from jfsdp.planning.activations import activation_estimate
from jfsdp.engine.layout import stored_bytes
from jfsdp.planning.sizes import elements, stages, tree_bytes
from jfsdp.train import frozen


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


@dataclasses.dataclass(frozen=True)
class _Step:
    """What the peak candidates are made of (bytes per device)."""
    params: int           # the real elements of the master parameters' shard
    pad_grads: int        # the padding of the gradient shards
    gathered: int         # gathered copies at the head's backward (root + units)
    units_gathered: int   # the units' part of it
    one_unit: int         # one gathered unit (0 where nothing is gathered)
    grad_buffers: int     # unsharded unit gradients (ZeRO-2)
    saved: int            # the units' saved activations, as the backward pass holds them
    saved_fwd: int        # the same, as the forward pass wrote them
    recompute: int        # what one unit's backward recomputes on top of them
    head: int             # the head's and the loss's activations
    grads: int            # the real elements of the gradient shards (the trainable parameters')
    unit_grad: int        # one shard's worth: a unit's unsharded gradient where nothing is sharded (S = 1)


@dataclasses.dataclass(frozen=True)
class _Grads:
    """The parameters that have gradients: the layouts with frozen leaves set to None (`root`: the
    root's leaves in the order of `FSDP.root_use`'s indices, None where frozen; `stages`:
    [(one unit's layouts, units)])."""
    mask: object          # frozen.mask's tree of booleans, None when everything trains
    root: list
    stages: list
    real_bytes: int       # bytes of their real elements, in their own (master) dtype
    pad_elements: int
    real_elements: int

    @property
    def root_tree(self) -> list:
        return [l for l in self.root if l is not None]


def grad_layouts(plan: FSDP, trainable=None) -> _Grads:
    """The layouts of the leaves that get gradients under `trainable` (None: all of them)."""
    mask = frozen.mask(plan, trainable)
    layouts = plan.layouts if mask is None else jax.tree.map(lambda t, l: l if t else None, mask, plan.layouts)
    root, stage_l = plan.split(layouts)
    root_all = jax.tree.leaves(plan.split(plan.layouts)[0], is_leaf=is_layout)
    root_keep = root_all if mask is None else [l if t else None for l, t in
                                               zip(root_all, jax.tree.leaves(plan.split(mask)[0]))]
    st = list(zip(stage_l, plan.stage_sizes))
    leaves = [(l, 1) for l in root_keep if l is not None] + [
        (l, n) for u, n in st for l in jax.tree.leaves(u, is_leaf=is_layout)]
    real = sum(n * math.prod(l.shape) * jnp.dtype(l.dtype).itemsize for l, n in leaves)
    return _Grads(mask, root_keep, st, real, sum(n * l.padding for l, n in leaves),
                  sum(n * math.prod(l.shape) for l, n in leaves))


def estimate(plan: FSDP, optimizer, loss_fn: Callable, batch, *, prefetch: bool = False,
             backend: str | None = None, update_in_backward: bool = False, grad_accum: int = 1,
             grad_sync: str = "every", trainable=None) -> Breakdown:
    """Analytic per-device bytes at the peak of one train step of `plan` on the global `batch`
    (a tree of shapes): the state plus the largest of what is live at four points of the step, the
    head's backward, the units' backward, the embedding's backward and the update (`_peak_points`).
    `backend`: whose dtypes ('cpu' widens bf16 compute to f32: `wire_dtype`) and whose scheduling
    the figure is for; the compiled CPU figure assumes XLA:CPU's memory-minimizing scheduler
    (jfsdp.config.xla_flags.CPU_FLAGS, as train.py and the planner compile).
    `update_in_backward`: the step of `make_train_step(update_in_backward=True)`, which runs the
    prefetch pipeline's loops (two gathered units) and never holds the units' whole gradient.
    `grad_accum` = k > 1: activations of one micro-batch (1/k of the batch), and the accumulated
    gradient besides the micro-batch's: every gradient shard (`grad_sync='every'`), or, with
    `grad_sync='once'`, the whole gradient in the reduce dtype twice (the sum so far and the
    micro-batch's, which the backward pass writes before it is added: `_accumulation_points`).
    `trainable` (as make_train_step's: a tree of booleans or a predicate on parameter paths;
    `optimizer` is the unmasked one): frozen leaves are still held and gathered, but have no gradient
    shard, unsharded gradient or optimizer state (`_Grads`).
    Tensor parallelism (T > 1): the state and gradient shards per leaf over its own group, and the
    activations traced as one tensor rank runs them (`jfsdp.planning.tensor_memory`).
    Context parallelism (C > 1): the activations traced on a device's T/C tokens of its rows, and the ring's
    buffers in the units' backward (`jfsdp.planning.context_plan`)."""
    if getattr(plan, "as_is", False) and update_in_backward:   # as make_train_step refuses it
        from jfsdp.train import update_in_backward as in_backward
        raise ConfigError(f"update_in_backward: {in_backward.unsupported(plan, grad_accum)}")
    plan = as_is.view(plan)   # a model given as it is: its units as stages (jfsdp.planning.as_is)
    backend = backend or jax.default_backend()
    N = plan.n_devices
    g = grad_layouts(plan, trainable)
    params, optimizer_b, pad_state, pad_grads = _state(plan, optimizer, g)
    gathered, units_gathered, one_unit, grad_buffers = _gathered(plan, backend, prefetch or update_in_backward, g)
    local = jax.tree.map(lambda a: context_plan.local_shape(a, N, getattr(plan, "context", 1)), batch)
    micro = jax.tree.map(lambda a: jax.ShapeDtypeStruct((a.shape[0] // grad_accum, *a.shape[1:]), a.dtype), local)
    saved, saved_fwd, recompute, head = _activations(plan, loss_fn, micro, backend, g.mask)
    recompute += context_plan.ring_buffers(plan, micro, backend)   # C > 1: the ring's hops (context_plan)
    grad_shards = tensor_memory.real_grad_shards(g) if plan.tensor > 1 else g.real_bytes // plan.shards
    step = _Step(params, pad_grads, gathered, units_gathered, one_unit, grad_buffers, saved, saved_fwd, recompute,
                 head, grad_shards, _unit_grad(plan, g))
    points = _peak_points(plan, backend, step, g)
    if update_in_backward:
        points.update(_update_in_backward_points(plan, step, points["embed"], g))
    if grad_accum > 1:
        points = _accumulation_points(plan, points, grad_sync, g, step.unit_grad)
    if getattr(plan, "as_is", False):   # what a model's own scan holds besides (jfsdp.planning.as_is)
        points = as_is.scan_gradient_points(plan, points, g, _grad_shards, grad_accum > 1 and grad_sync == "once")
    name = max(points, key=lambda k: sum(points[k]))
    grads, gath, buffers, activations, pad_g = points[name]
    return Breakdown(params=params, grads=grads, optimizer=optimizer_b, padding=pad_state + pad_g,
                     persistent_padding=pad_state, gathered=gath, grad_buffers=buffers,
                     activations=activations, batch=tree_bytes(local))


def _state(plan: FSDP, optimizer, g: _Grads) -> tuple[int, int, int, int]:
    """(parameters, optimizer state, padding of both, padding of the gradients) of one shard. The
    optimizer state and the gradients are the trainable leaves' (`g`) only."""
    S = plan.shards
    master = max(jnp.dtype(l.dtype).itemsize for l in jax.tree.leaves(plan.layouts, is_leaf=is_layout))
    real, pad = elements(plan)
    params = real * master // S
    # the state of the optimizer as the step runs it: on the trainable leaves only (frozen.optimizer)
    opt = frozen.optimizer(optimizer, g.mask)
    opt_total = tree_bytes(jax.eval_shape(opt.init, plan.abstract_params()))
    if plan.tensor > 1:   # each leaf over its own group: S for a tensor-parallel leaf, S·T for the rest
        return tensor_memory.state(plan, opt_total, g)
    opt_per_byte = opt_total / (g.real_bytes + g.pad_elements * master)  # AdamW: 2.0 (two fp32 moments)
    optimizer_b = int(round(g.real_bytes * opt_per_byte)) // S
    pad_state = int(round((pad * master + g.pad_elements * master * opt_per_byte) / S))
    return params, optimizer_b, pad_state, g.pad_elements * master // S


def _root_leaves(plan: FSDP) -> list:
    return jax.tree.leaves(plan.split(plan.layouts)[0], is_leaf=is_layout)


def _gathered_units(plan: FSDP, gdt) -> list:
    """Bytes of one gathered unit of each stage, in `gdt`. An expert-parallel MoE stage's experts
    are not gathered: they stay a cast local shard."""
    S, st = plan.shards, stages(plan)
    unit_g = [stored_bytes(l, gdt) for l, _ in st]
    for j, m in enumerate(getattr(plan, "moe_stages", None) or []):
        if m is not None and m.mode == "ep":
            from jfsdp.engine import moe
            unit_g[j] -= moe.expert_bytes(st[j][0], m.site, gdt) * (S - 1) // S
    return unit_g


def _gathered(plan: FSDP, backend: str, two_units: bool, g: _Grads) -> tuple[int, int, int, int]:
    """(gathered at the head's backward, the units' part of it, one gathered unit, unsharded unit
    gradients) per device. `two_units`: the prefetch pipeline keeps the next unit gathered too. A
    frozen leaf is gathered like any other, but has no gradient (`g`)."""
    S, st = plan.shards, stages(plan)
    pdt = plan.mp.param_dtype or jnp.float32
    rdt = plan.mp.reduce_dtype or pdt
    gdt = wire_dtype(pdt, backend)
    # the root leaves the head reads stay gathered to its backward (the peak); those only the
    # embedding reads are gathered and freed at the start (FSDP.root_use)
    leaves = _root_leaves(plan)
    root_g = stored_bytes([leaves[i] for i in sorted(plan.root_use[1])], gdt)
    unit_g = _gathered_units(plan, gdt)
    if S > 1:
        # ZeRO-3 keeps one gathered unit at a time (two with prefetch): the largest of any stage. Its
        # unsharded gradient needs no room of its own: each leaf's gradient is reduce-scattered as
        # soon as it is complete and the gathered leaf dies after its last use, so one takes the
        # place of the other (the compiled peak holds root + one unit, not root + unit + gradient).
        # ZeRO-2 keeps every unit from the forward scans (stacked buffers, freed only when each
        # backward scan ends), so the unit being differentiated needs a gradient buffer besides.
        # A one-unit stage is kept like the root: XLA removes a loop of one iteration and merges
        # its forward and backward gathers.
        # A unit of a model given as it is is re-gathered however many iterations it has (call_unit).
        if plan.strategy.reshard_after_forward:
            merged = lambda n: n == 1 and not getattr(plan, "as_is", False)
            single = sum(u for u, (_, n) in zip(unit_g, st) if merged(n))
            looped = max([u for u, (_, n) in zip(unit_g, st) if not merged(n)], default=0)
            gathered = root_g + single + looped * (2 if two_units else 1)
            grad_buffers = 0
        else:
            gathered = root_g + sum(u * n for u, (_, n) in zip(unit_g, st))
            grad_buffers = max(stored_bytes(l, rdt) for l, _ in g.stages)
    else:
        # One shard (NO_SHARD, or any strategy on an Rx1 mesh): unshard is at most a cast, which the
        # backward pass redoes rather than keeps (FSDP), so a param_dtype copy exists for the root
        # and one unit at a time, and only where compute runs in another dtype than the master.
        # The gradient all-reduce runs in place (no second full gradient: the optimizer's clipping
        # makes no copy of the gradients).
        gathered = 0 if gdt == jnp.dtype(jnp.float32) else root_g + max(unit_g)
        grad_buffers = 0
    units_gathered = gathered - (root_g if S > 1 or gathered else 0)
    one_unit = max(unit_g) if S > 1 or gathered else 0
    return gathered, units_gathered, one_unit, grad_buffers


def _unit_grad(plan: FSDP, g: _Grads) -> int:
    """One unit's unsharded gradient in the reduce dtype where the plan has one shard (its all-reduce
    runs per unit, out of place: `_peak_points`); 0 where it is sharded."""
    if plan.shards > 1:
        return 0
    rdt = plan.mp.reduce_dtype or plan.mp.param_dtype or jnp.float32
    return max((stored_bytes(l, rdt) for l, _ in g.stages), default=0)


def _activations(plan: FSDP, loss_fn: Callable, local, backend: str, mask=None) -> tuple[int, int, int, int]:
    """(saved unit activations in the backward pass, the same in the forward pass, one unit's
    recomputation, the head's activations) per device for the local batch `local`; `mask`: the
    trainable leaves (frozen ones are not differentiated). T > 1: traced per tensor rank (tensor_memory)."""
    st = stages(plan)
    trace = (tensor_memory.activation_estimate if plan.tensor > 1 else
             as_is.activation_estimate if getattr(plan, "as_is", False) else activation_estimate)
    act = trace(plan, loss_fn, local, backend, trainable=mask)
    recompute = max(s["unit_working"] - s["per_unit"] for s in act["stages"])
    saved = sum(n * s["per_unit"] for s, (_, n) in zip(act["stages"], st))
    # Until the backward scan starts, the saved activations are held in the dtype the forward wrote:
    # XLA:CPU widens a bf16 plan's arithmetic, not the forward scan's stacked outputs; it converts
    # the whole stack to f32 just before the backward scan.
    saved_fwd = saved
    pdt = plan.mp.param_dtype or jnp.float32
    if wire_dtype(pdt, backend) != jnp.dtype(pdt):
        act_fwd = trace(plan, loss_fn, local, backend, widen=False, trainable=mask)
        saved_fwd = sum(n * s["per_unit"] for s, (_, n) in zip(act_fwd["stages"], st))
    return saved, saved_fwd, recompute, act["head"]


def _grad_shards(plan: FSDP, layouts_and_units) -> int:
    """Bytes per device of the gradient shards of [(layouts, units)] (stored, padded): over S, or at T > 1
    each leaf over its own group (tensor_memory.grad_shards)."""
    if plan.tensor > 1:
        return tensor_memory.grad_shards(layouts_and_units)
    return sum(n * stored_bytes(l) for l, n in layouts_and_units) // plan.shards


def _peak_points(plan: FSDP, backend: str, s: _Step, g: _Grads) -> dict:
    """The four candidates for the peak, each (gradient shards, gathered, unsharded gradients,
    activations, padding of the gradients); the largest is the estimate.
    (a) the head's backward: the gathered root and the head's working set; no gradient shard
        exists yet (XLA:CPU's memory-minimizing scheduler makes the units' stacked gradient buffers
        just before the backward scan: jfsdp.config.xla_flags.CPU_FLAGS).
    (b) the units' backward: every unit's gradient shard (one stacked buffer per stage), the
        unsharded gradient of a root weight the embedding also reads (a tied weight: reduced once,
        after the embedding's backward), the gathered unit(s) and what remat recomputes. On CPU
        also the unsharded gradient of the root leaves only the head reads (an untied output
        weight, in param_dtype as the head writes it): XLA:CPU's scheduler reduce-scatters it after
        the backward scan, XLA:GPU right after the head's backward.
    (c) the embedding's backward, once the units' are done: every unit's gradient shard, the
        unsharded gradient of the root leaves only the embedding reads (an untied table: the
        lookup's gradient is a scatter-add into a whole table, in param_dtype, and its cast to
        reduce_dtype for the reduce-scatter) and one gathered unit (XLA:GPU overlaps the last
        unit's backward with it and reduces both in one combined reduce-scatter).
    (d) the update: the state and every gradient shard.
    With one shard (S = 1: DDP, an Rx1 mesh) the units' backward also holds the unit's gradient as
    the backward writes it and its all-reduce's output, which XLA writes out of place before it goes
    into the stacked gradient: two unit gradients in the reduce dtype (measured 1.6-1.8 of them on
    XLA:CPU, at 2 and 4 units alike: docs/planner.md).
    Gradients of trainable leaves only (`g`): a frozen root weight has no unsharded gradient either."""
    pdt = plan.mp.param_dtype or jnp.float32
    rdt = plan.mp.reduce_dtype or pdt
    gdt = wire_dtype(pdt, backend)
    unit_grads = _grad_shards(plan, g.stages)
    leaves = g.root
    embed_reads, head_reads = plan.root_use
    shared = [leaves[i] for i in sorted(embed_reads & head_reads) if leaves[i] is not None]
    head_only = [leaves[i] for i in sorted(head_reads - embed_reads) if leaves[i] is not None]
    embed_only = [leaves[i] for i in sorted(embed_reads - head_reads) if leaves[i] is not None]
    held = stored_bytes(head_only, pdt) if backend == "cpu" else 0
    rdt_wire = wire_dtype(rdt, backend)
    table = stored_bytes(embed_only, gdt) + (stored_bytes(embed_only, rdt_wire) if rdt_wire != gdt else 0)
    return {
        "head": (0, s.gathered, s.grad_buffers, s.saved_fwd + s.head, 0),
        "units": (unit_grads, s.units_gathered, s.grad_buffers + 2 * s.unit_grad + stored_bytes(shared, gdt) + held,
                  s.saved + s.recompute, 0),
        "embed": (unit_grads, s.one_unit if embed_only else 0, held + table, 0, 0),
        "update": (s.grads, 0, 0, 0, s.pad_grads),
    }


def _accumulation_points(plan: FSDP, points: dict, grad_sync: str, g: _Grads, unit_grad: int = 0) -> dict:
    """The candidates with k > 1 micro-batches. 'every': the sum of the gradient shards (all of them,
    master dtype) is held through every micro-batch besides the micro-batch's own. 'once': no gradient
    shard exists before the reduction after the last micro-batch; the sum of the whole gradients
    (reduce dtype) is held throughout, one copy: each parameter's gradient is added to the sum where it
    is made (the stage passes' backward adds each unit's in place, jfsdp/engine/pipeline.py; a root
    leaf's is added by `unshard`'s backward, fsdp.Unreduced); then the reduction turns the sum into
    shards (a point of its own). Trainable leaves only (`g`). With one shard, 'once' runs no
    all-reduce per unit: of its two unit gradients (`unit_grad` each, `_peak_points`) only the one the
    backward writes remains."""
    layouts = [(g.root_tree, 1)] + g.stages
    shards = _grad_shards(plan, layouts)
    if grad_sync != "once":
        return {k: (g + (shards if k != "update" else 0), *rest) for k, (g, *rest) in points.items()}
    rdt = plan.mp.reduce_dtype or plan.mp.param_dtype or jnp.float32
    whole = sum(n * stored_bytes(l, rdt) for l, n in layouts)
    out = {}
    for k, (g, gath, buf, act, pad) in points.items():
        if k == "head":
            out[k] = (g, gath, buf + whole, act, pad)
        elif k in ("units", "embed"):
            out[k] = (0, gath, buf + whole - (unit_grad if k == "units" else 0), act, pad)
        else:
            out[k] = (g, gath, buf, act, pad)
    out["reduce"] = (shards, 0, whole, 0, 0)
    return out


def _update_in_backward_points(plan: FSDP, s: _Step, embed: tuple, g: _Grads) -> dict:
    """The units', embedding's and update's candidates when the optimizer runs inside the backward
    pass. No stacked gradient: each unit's gradient shard is consumed (one leaf's rows at a time: its
    gradient and new parameter and moment rows) inside the backward loop. The root's gradient
    shards, reduced right after the head's backward, are held to the root's update at the end (the
    tied weight's head gradient is reduced then too: no unsharded gradient is held)."""
    root_grads = _grad_shards(plan, [(g.root_tree, 1)])
    unit_leaves = [x for l, _ in g.stages for x in jax.tree.leaves(l, is_leaf=is_layout)]
    # at T > 1 each leaf over its own group (S for a tensor-parallel leaf, S·T for the rest)
    group = lambda x: x.shards if plan.tensor > 1 else plan.shards
    rows = max((4 * stored_bytes([x]) // group(x) for x in unit_leaves), default=0)
    return {"units": (root_grads + rows, s.units_gathered, s.grad_buffers, s.saved + s.recompute, 0),
            "embed": (root_grads,) + embed[1:],
            "update": (root_grads, 0, 0, 0, 0)}
