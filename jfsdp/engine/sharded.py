"""What `fully_shard` returns for a `Stacked`/`Staged` model: the model placed on a mesh with a strategy, and
its sharded loss API (a model given as it is gets `AsIs`, as_is/, the same engine).

`FSDP` extends the parameter layout (params.py) with the engine: the forward pass inside `shard_map`
gathers the root where it is used and runs each stage by the plain scan (fsdp.py), the prefetch pipeline
(pipeline.py) or expert parallelism (moe.py); `loss_and_grad` and `loss` wrap it for the train step.
"""
from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

from jfsdp.config.errors import ConfigError
from jfsdp.config.mesh import AXES, DATA_AXIS, TENSOR_AXIS, context_size, mesh_shape, platform, tensor_size
from jfsdp.config.policy import resolve_prefetch
from jfsdp.engine import accumulate, expert_parallel, float8, moe as moe_engine, moe_adaptive, step_metrics
from jfsdp.engine.fsdp import Comm, any_unreduced, checkpoint_policy, scan_stage, unshard, unshard_tree
from jfsdp.engine.layout import tree_shapes
from jfsdp.engine.params import ParamLayout
from jfsdp.engine.root import RootPasses
from jfsdp.engine.parallel import context as cp, layout as tp_layout, support, tensor as tp, vocab
from jfsdp.engine.pipeline import StagePasses, pipelined_stage


class FSDP(RootPasses, ParamLayout):
    """A model placed on a mesh with a strategy. Build it with `fully_shard`. The parameter layout
    (`init`, `shard`, `gather`, `layouts`, `from_layers`, ...) is `ParamLayout`'s."""

    def __init__(self, model, mesh, example_inputs, strategy, mp_policy, remat, prefetch=None, moe=None,
                 tensor_plan=None, async_tp=None, context_attention=None):
        self.context_attention, prefetch = cp.check(model, mesh, strategy, mp_policy, prefetch, moe, context_attention)
        prefetch = support.check(model, mesh, strategy, mp_policy, prefetch, moe, tensor_plan)
        super().__init__(model, mesh, example_inputs, sharded=strategy.sharded, tensor_plan=tensor_plan,
                         shards=mesh_shape(mesh)[1] * context_size(mesh) if strategy.sharded else 1)
        self.set_strategy(strategy, mp_policy, remat)
        self.prefetch = resolve_prefetch(prefetch, strategy, remat, self.shards, on_gpu=platform(mesh) == "gpu")
        if self.tensor > 1:   # Megatron-SP around the units' tensor-parallel matmuls (parallel/tensor.py)
            self.async_tp = support.async_tp(async_tp, platform(mesh))
            self.tp_intercept = tp.interceptor(tp_layout.tp_modules(self.split(self.layouts)[1]), tensor_plan.sequence_dim,
                                               mp_policy.reduce_dtype, self.tensor, self.async_tp, moe)
            vocab.setup(self, self.split(self.layouts)[0], tensor_plan.sequence_dim)   # parallel/vocab.py
        self.moe, self.moe_stages = moe, moe_engine.resolve(self, moe, moe_adaptive.resolve_stage)   # None or its mode
        self.unit_layouts = self.float8_layouts()

    def set_strategy(self, strategy, mp_policy, remat):
        """How this model runs on `self.mesh` with `self.shards` row-shards: the strategy, the precision,
        the remat policy, the communication (`Comm`) and the batch's placement. Shared by every way a
        model is described (`AsIs` too)."""
        (r, s), self.tensor, self.context = mesh_shape(self.mesh), tensor_size(self.mesh), context_size(self.mesh)
        self.strategy, self.mp, self.remat = strategy, mp_policy, remat
        self.replicas, self.n_devices = r, r * s * self.context * self.tensor
        if strategy.sharded:
            reduce_axes = (DATA_AXIS,) if r > 1 else ()
        else:
            reduce_axes = tuple(a for a in AXES if self.mesh.shape[a] > 1)
        self.comm = Comm(reduce_axes, 1.0 / self.n_devices, mp_policy.param_dtype, mp_policy.reduce_dtype)
        # With one shard (NO_SHARD, or any strategy on an Rx1 mesh) unshard is at most a cast: redoing
        # it in the backward pass is free, while saving it would stack a second copy of every unit's
        # parameters (DDP's peak held the weights twice).
        self.policy = checkpoint_policy(remat, strategy.reshard_after_forward or self.shards == 1)
        self.on_cpu = platform(self.mesh) == "cpu"
        # the batch's rows over (data, fsdp); its sequence over `tensor` at T > 1 (sequence parallelism) and
        # `context` at C > 1
        self.batch_spec, self.loss_axes = cp.placement(P(AXES) if self.tensor == 1 else P(AXES, TENSOR_AXIS),
                                                       AXES if self.tensor == 1 else (*AXES, TENSOR_AXIS), self.context)
        self.batch_sharding = NamedSharding(self.mesh, self.batch_spec)

    def float8_layouts(self) -> list:
        """Each stage's unit layouts as gathered: with a float8 policy the selected Dense kernels are
        `float8.Float8Layout`s (gathered and multiplied in float8), else the plain layouts."""
        stage_l = self.split(self.layouts)[1]
        if self.mp.float8 is None:
            return stage_l
        if any(m is not None and m.mode in ("ep", "adaptive") for m in self.moe_stages):
            raise ConfigError("float8 with an expert-parallel or adaptive MoE stage is not supported (its experts are "
                              "einsums run by jfsdp, not Dense matmuls); use moe=MoE('gather') or bf16")
        return float8.mark_stages(self.model, self.h_shapes, stage_l, self.mp.float8, self.mp.param_dtype)

    def unit_apply(self, unit, extra=None):
        """(unit params, h) -> h: the unit's apply under its interceptors, the outermost first (support.chain): TP's
        at T > 1, float8's where it has matmuls to take, then `extra` (expert parallelism's); at C > 1 with its
        attention as a ring over `context` around them all (parallel/context.py: it takes other methods)."""
        hooks = ([self.tp_intercept] if self.tensor > 1 else []) + [float8.interceptor] * (self.tensor > 1 or
                                                                                         self.mp.float8 is not None)
        hook = support.chain(hooks + ([extra] if extra is not None else []))

        def apply(params, h):
            with nn.intercept_methods(hook) if hooks or extra is not None else contextlib.nullcontext():
                return unit.apply({"params": params}, h)
        return cp.with_ring(apply, self.context_attention, self.context, self.tensor)

    # ---- the sharded forward: runs inside shard_map on local shards
    def run_stage(self, j, h, shards, layouts, extra=None, lead=None):
        """Stage j (the prefetch pipeline, expert parallelism, or the plain scan): (h, extra tied or None).
        `lead`: (a function (its params, h) -> the stage's input, its params) run first, on the pipeline
        inside the stage (pipeline.pipelined_stage)."""
        unit, moe = self.model.stages[j].unit, self.moe_stages[j]
        layouts = self.unit_layouts[j]
        ep = moe is not None and moe.mode in ("ep", "adaptive")   # local experts, or capacity by load (moe_adaptive.py)
        if not ep and (any_unreduced(shards) or self.prefetches(j)):   # (grad_sync='once': for the in-place sum)
            fn, lead_p = lead or (None, None)
            stage = pipelined_stage(self.stage_passes(j, prefetch=bool(self.prefetch)), fn)
            h, ahead = stage(h, shards, extra or [], lead_p)
            return h, (None if extra is None else ahead)
        if lead is not None:
            h = lead[0](lead[1], h)

        def compute(h, shards):
            if ep:
                unshard_one = lambda x, l: unshard(x, l, self.comm)
                run = moe_adaptive if moe.mode == "adaptive" else expert_parallel
                params = run.place_params(unshard_one, shards, layouts, moe, self.comm)   # experts over fsdp x tensor
                hook = run.interceptor(moe, self.moe, self.shards * self.tensor, self.comm, layouts)
                return self.unit_apply(unit, hook)(params, h)
            return self.unit_apply(unit)(unshard_tree(shards, layouts, self.comm), h)
        keeps_shape = tree_shapes(self.h_shapes[j]) == tree_shapes(self.h_shapes[j + 1])
        return scan_stage(compute, h, shards, self.policy, keeps_shape), extra

    @property
    def saves_last_unit(self) -> bool:
        """The prefetch pipeline's last stage saves its last unit's gathered parameters for the backward
        (pipeline.StagePasses.last_stage): under ZeRO-3 that unit is gathered once a step, not twice. (A model given as it is
        has its own: engine/as_is/model.py.)"""
        last = len(self.stage_sizes) - 1
        return not getattr(self, "as_is", False) and self.prefetches(last) and self.strategy.reshard_after_forward

    def prefetches(self, j) -> bool:   # stage j runs the prefetch pipeline (MoE 'ep'/'adaptive' stages never do)
        return getattr(self.moe_stages[j], "mode", None) not in ("ep", "adaptive") and bool(self.prefetch) and self.stage_sizes[j] > 1

    def stage_passes(self, j, prefetch: bool = True) -> StagePasses:
        """Stage j's pipelined forward and backward passes (pipeline.py), for the prefetch pipeline
        and for steps that consume each unit's gradient as it is reduced. They save what the remat
        policy saves, and the gathered units where the strategy keeps them (ZeRO-2)."""
        return self.passes_of(self.unit_apply(self.model.stages[j].unit), self.unit_layouts[j], self.stage_sizes[j],
                              j == 0, j == len(self.stage_sizes) - 1, prefetch)

    def passes_of(self, apply, layouts, n, first, last, prefetch: bool = True) -> StagePasses:
        """StagePasses of n units of `apply` with `layouts` under this plan's strategy, policy and
        communication; the step's first and last stage where `first` / `last` (a model's own scan's too:
        as_is/own_scan.py)."""
        keep = self.shards > 1 and not self.strategy.reshard_after_forward
        return StagePasses(apply=apply, layouts=layouts, comm=self.comm, n=n, first_stage=first, on_cpu=self.on_cpu,
                           policy=self.policy, keep_gathered=keep, prefetch=prefetch, last_stage=last)

    def step_batch(self, batch, step):
        """The batch a train step feeds to `loss_and_grad` at `step` (a model given as it is adds the rows
        that carry the step's random numbers; a `Stacked`/`Staged` model draws none)."""
        return batch

    def _check_rows(self, tree, grad_accum=1):
        if self.tensor > 1:
            support.check_sequence(tree, self.tensor, self.tensor_plan.sequence_dim)
        rows, n = cp.batch_rows(tree, self.n_devices, self.tensor, self.context)   # rows on data x fsdp
        for x in jax.tree.leaves(tree):
            if not np.ndim(x):
                raise ConfigError(f"every batch leaf needs a leading batch axis, got a scalar ({x!r})")
            b = np.shape(x)[0]
            if b % n:
                raise ConfigError(f"batch size {b} does not divide over the {n} devices of the mesh"
                                  + (" that hold its rows (data x fsdp)" if self.context > 1 else ""))
            if (b // rows) % grad_accum:
                raise ConfigError(f"per-device batch {b // rows} does not divide into "
                                  f"{grad_accum} gradient-accumulation micro-batches")

    def check_batch(self, batch, grad_accum: int = 1):
        """The batch contract: a dict whose 'inputs' is fed to the root's embed method (all of it is
        passed to the loss); every leaf's first axis is the batch and divides over all devices (and
        then into grad_accum micro-batches). ConfigError otherwise."""
        if not isinstance(batch, Mapping) or "inputs" not in batch:
            got = f"keys {sorted(map(str, batch))}" if isinstance(batch, Mapping) else type(batch).__name__
            raise ConfigError(f"a batch must be a dict with key 'inputs' (fed to root.{self.model.embed_method}; the "
                              f"whole dict, e.g. with 'targets', goes to loss_fn(outputs, batch)), got {got}")
        self._check_rows(batch, grad_accum)

    def put_batch(self, batch, grad_accum: int = 1):
        """Check a (global, host) batch with `check_batch` and split it over all devices. One process;
        with several, build the global array from each process's rows (jfsdp.io.data.process_rows)."""
        self.check_batch(batch, grad_accum)
        return jax.device_put(batch, self.batch_sharding)

    def shard_map(self, f, in_specs, out_specs):
        """`jax.shard_map` over this mesh."""
        return jax.shard_map(f, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)

    def batch_loss(self, loss_fn, params, batch, metrics=None):
        """One device's mean loss on its rows of `batch` (inside shard_map): the loss contract's scalar; with
        `metrics` (step_metrics.check's), (loss, {name: this device's value}) from the same forward pass."""
        outputs = self.forward(params, batch["inputs"])
        loss = self.scalar_loss(vocab.loss(self, loss_fn, outputs, batch))
        return loss if metrics is None else (loss, step_metrics.local(metrics, outputs, batch))

    @staticmethod
    def scalar_loss(loss):
        """The loss contract's scalar, as float32 (ConfigError for anything else)."""
        if jnp.shape(loss) != ():
            raise ConfigError(f"loss_fn must return a scalar (the mean loss over its batch), got shape {jnp.shape(loss)}")
        return loss.astype(jnp.float32)

    def loss_and_grad(self, loss_fn: Callable, grad_accum: int = 1, grad_sync: str = "every", trainable=None,
                      metrics=None):
        """(params, batch) -> (mean loss, gradients as shards), or with `metrics` (loss, gradients, {name: value}).

        The loss contract: `loss_fn(outputs, batch)` gets the head's outputs for the batch rows on
        one device (one micro-batch with grad_accum) and that same slice of the batch dict, and returns
        the mean loss over those rows, a scalar. jfsdp averages it over devices and micro-batches, which
        is the global mean because every device holds as many rows (a loss that averages over a
        varying count, such as unmasked tokens, becomes a mean of means). `batch['inputs']` feeds
        `embed`. With grad_accum = k, every device runs k micro-batches, each with its own gathers
        and reduce-scatters; with grad_sync='once' each device adds up its whole gradients over the k
        micro-batches and reduces them once (jfsdp/engine/accumulate.py). `trainable`: a tree of booleans
        like the parameters (jfsdp/train/frozen.py): a frozen leaf is gathered but not differentiated,
        so its gradient (zeros) is never reduce-scattered. `metrics`: {name: fn(outputs, batch)} read from
        the same forward passes (jfsdp/engine/step_metrics.py)."""
        if not isinstance(grad_accum, int) or grad_accum < 1:
            raise ConfigError(f"grad_accum must be an integer of at least 1, got {grad_accum}")
        metrics = step_metrics.check(metrics)
        if accumulate.check_grad_sync(grad_sync) == "once" and grad_accum > 1:
            return accumulate.loss_and_grad_once(self, loss_fn, grad_accum, trainable, metrics)

        def differentiated(params, batch):
            return self.batch_loss(loss_fn, accumulate.stop_frozen(params, trainable), batch, metrics)

        def local(params, batch):
            vg = jax.value_and_grad(differentiated, has_aux=metrics is not None)
            split = (lambda r: r) if metrics is None else (lambda r: (r[0][0], r[1], r[0][1]))
            if grad_accum == 1:
                loss, grads, *aux = split(vg(params, batch))
            else:
                mbs = jax.tree.map(lambda x: x.reshape(grad_accum, -1, *x.shape[1:]), batch)

                def acc(carry, mb):
                    loss, grads, *aux = split(vg(params, mb))
                    return jax.tree.map(jnp.add, carry, (loss, grads)), aux

                zero = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, params))
                (loss, grads), aux = lax.scan(acc, zero, mbs)
                loss, grads = loss / grad_accum, jax.tree.map(lambda g: g / grad_accum, grads)
                aux = [step_metrics.over_micro_batches(metrics, a) for a in aux]
            loss = lax.psum(loss, self.loss_axes) / self.n_devices
            return (loss, grads, *[step_metrics.over_devices(metrics, a, self) for a in aux])

        out_specs = (P(), self.param_specs) + (() if metrics is None else ({k: P() for k in metrics},))
        sharded = self.shard_map(local, (self.param_specs, self.batch_spec), out_specs)

        def fn(params, batch):
            self.check_batch(batch, grad_accum)
            return sharded(params, batch)
        return fn

    def loss(self, loss_fn: Callable):
        """(params, batch) -> mean loss, forward only (evaluation). Same contract as `loss_and_grad`."""
        def local(params, batch):
            return lax.psum(self.batch_loss(loss_fn, params, batch), self.loss_axes) / self.n_devices
        sharded = self.shard_map(local, (self.param_specs, self.batch_spec), P())

        def fn(params, batch):
            self.check_batch(batch)
            return sharded(params, batch)
        return fn

    def apply(self, params, inputs):
        """Model outputs for a batch of inputs split over all devices (call under jit)."""
        self._check_rows(inputs)
        out = self.shard_map(self.forward, (self.param_specs, self.batch_spec), vocab.out_spec(self))(params, inputs)
        return vocab.unpad(self, out)

