"""The FSDP step: gather a unit, compute, free it; reduce-scatter its gradient.

Parameters live as shards: every leaf is padded along its first dimension to a multiple of S and
split over the `fsdp` mesh axis (FSDP2's per-parameter Shard(0)). Inside `shard_map`, `unshard`
casts a shard to the compute dtype and all-gathers it; its custom VJP is the gradient path:
reduce-scatter over `fsdp` in the reduce dtype, then a sum over the replica axes. The repeated units
run under `lax.scan` over their stacked shards, each body wrapped in `jax.checkpoint` with a policy
that decides whether the gathered unit is kept for the backward pass (ZeRO-2) or gathered again
(ZeRO-3). A scan, not a Python loop: XLA cannot merge the gathers of different iterations, so only
one unit is ever unsharded, however deep the model.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

from jfsdp.mesh import AXES, DATA, FSDP as FSDP_AXIS, ConfigError, mesh_shape
from jfsdp.policy import REMAT, MixedPrecision, Strategy

ROOT, UNITS = "root", "units"


@dataclasses.dataclass(frozen=True)
class Stacked:
    """A model as FSDP units: `root` holds the non-repeated parameters and has two methods,
    `embed(inputs) -> h` and `head(h) -> outputs`; `unit` (h -> h) is repeated `n_units` times with
    its own parameters each. Tied weights live in the root and are used by both methods."""
    root: nn.Module
    unit: nn.Module
    n_units: int
    embed_method: str = "embed"
    head_method: str = "head"


@dataclasses.dataclass(frozen=True)
class Layout:
    """One parameter: its unsharded shape (per unit) and how it is padded into S row-shards."""
    shape: tuple
    dtype: Any
    shards: int

    @property
    def rows(self) -> int:
        return self.shape[0] if self.shape else 1

    @property
    def padded_rows(self) -> int:
        return -(-self.rows // self.shards) * self.shards

    @property
    def stored_shape(self) -> tuple:
        return (self.padded_rows, *self.shape[1:])

    @property
    def padding(self) -> int:
        """Elements of padding per unit."""
        return (self.padded_rows - self.rows) * math.prod(self.shape[1:])

    def pad(self, x, xp=jnp):
        x = x.reshape(self.rows, *self.shape[1:])
        return xp.pad(x, [(0, self.padded_rows - self.rows)] + [(0, 0)] * (x.ndim - 1))

    def unpad(self, x):
        return x[: self.rows].reshape(self.shape)


@dataclasses.dataclass(frozen=True)
class Comm:
    """How gradients come back: reduce-scatter over `fsdp` when S > 1, then a sum over
    `reduce_axes`, then `scale` (1/N: the loss is the mean over all N devices' batches)."""
    reduce_axes: tuple
    scale: float
    param_dtype: Any
    reduce_dtype: Any


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def unshard(shard, layout: Layout, comm: Comm):
    """Shard (rows/S, ...) in the master dtype -> the whole parameter in param_dtype."""
    x = shard.astype(comm.param_dtype or shard.dtype)
    if layout.shards > 1:
        x = lax.all_gather(x, FSDP_AXIS, axis=0, tiled=True)
    return layout.unpad(x)


def _unshard_fwd(shard, layout, comm):
    return unshard(shard, layout, comm), None


def _unshard_bwd(layout, comm, _, g):
    g = layout.pad(g.astype(comm.reduce_dtype or g.dtype))
    if layout.shards > 1:
        g = lax.psum_scatter(g, FSDP_AXIS, scatter_dimension=0, tiled=True)
    if comm.reduce_axes:
        g = lax.psum(g, comm.reduce_axes)
    return (g.astype(layout.dtype) * comm.scale,)


unshard.defvjp(_unshard_fwd, _unshard_bwd)


def _is_unshard(prim, params) -> bool:
    """Whether a primitive seen by a checkpoint policy is `unshard` (a custom_vjp call whose
    backward is ours)."""
    return prim.name == "custom_vjp_call" and getattr(params.get("bwd"), "f", None) is _unshard_bwd


@functools.cache
def _policy_sees_unshard() -> bool:
    """Self-check, once per process: does a checkpoint policy recognize `unshard` in this jax
    version? `_is_unshard` reads a jax-internal attribute; if that ever changes, ZeRO-2/ZeRO-3
    would silently swap memory behaviour, so fully_shard refuses to run instead."""
    seen = []

    def probe(prim, *_, **params):
        seen.append(_is_unshard(prim, params))
        return False

    layout, comm = Layout((2,), jnp.dtype(jnp.float32), 1), Comm((), 1.0, None, None)
    f = jax.checkpoint(lambda x: jnp.sum(unshard(x, layout, comm) ** 2), policy=probe)
    jax.eval_shape(jax.grad(f), jax.ShapeDtypeStruct((2,), jnp.float32))
    return any(seen)


def checkpoint_policy(remat: str, reshard_after_forward: bool):
    """What the backward pass of a unit may reuse from its forward pass.

    remat: 'none' saves every activation, 'full' saves only the unit's input, 'dots' saves matmul
    outputs and recomputes the elementwise work. On top of that, a gathered parameter (the output of
    `unshard`) is never saved when resharding after forward (ZeRO-3: the backward pass gathers it
    again) and always saved when not (ZeRO-2). The decision is made on `unshard` itself: naming its
    output would not do, because remat then saves the nearest saveable producer, which is the same
    gathered array."""
    if remat not in REMAT:
        raise ConfigError(f"unknown remat '{remat}'; choose from {', '.join(REMAT)}")
    if not _policy_sees_unshard():
        raise RuntimeError(f"jfsdp cannot identify its all-gather inside jax.checkpoint on jax {jax.__version__}; "
                           "reshard_after_forward cannot be honoured (please report this)")
    cp = jax.checkpoint_policies
    base = {"none": cp.everything_saveable, "full": cp.nothing_saveable, "dots": cp.dots_saveable}[remat]
    keep_unsharded = not reshard_after_forward

    def policy(prim, *avals, **params):
        if _is_unshard(prim, params):
            return keep_unsharded
        return base(prim, *avals, **params)
    return policy


def _is_layout(x):
    return isinstance(x, Layout)


class FSDP:
    """A model placed on a mesh with a strategy. Build it with `fully_shard`."""

    def __init__(self, model: Stacked, mesh, example_inputs, strategy, mp_policy, remat):
        self.model, self.mesh, self.strategy, self.mp, self.remat = model, mesh, strategy, mp_policy, remat
        r, s = mesh_shape(mesh)
        self.replicas, self.shards, self.n_devices = r, (s if strategy.sharded else 1), r * s
        if strategy.sharded:
            reduce_axes = (DATA,) if r > 1 else ()
        else:
            reduce_axes = tuple(a for a in AXES if mesh.shape[a] > 1)
        self.comm = Comm(reduce_axes, 1.0 / self.n_devices, mp_policy.param_dtype, mp_policy.reduce_dtype)
        # With one shard (NO_SHARD, or any strategy on an Rx1 mesh) unshard is at most a cast:
        # redoing it in the backward pass is free, while saving it would stack a second copy of
        # every unit's parameters (measured: DDP's peak held the weights twice).
        self.policy = checkpoint_policy(remat, strategy.reshard_after_forward or self.shards == 1)
        self.example_inputs = jax.ShapeDtypeStruct(example_inputs.shape, example_inputs.dtype)
        full = jax.eval_shape(self._init_full, jax.random.key(0), self.example_inputs)
        unit_shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), full[UNITS])
        self.layouts = jax.tree.map(lambda x: Layout(tuple(x.shape), jnp.dtype(x.dtype), self.shards),
                                    {ROOT: full[ROOT], UNITS: unit_shapes})
        row = FSDP_AXIS if strategy.sharded else None
        self.param_specs = {ROOT: jax.tree.map(lambda _: P(row), self.layouts[ROOT], is_leaf=_is_layout),
                            UNITS: jax.tree.map(lambda _: P(None, row), self.layouts[UNITS], is_leaf=_is_layout)}
        self.param_shardings = jax.tree.map(lambda p: NamedSharding(mesh, p), self.param_specs)
        self.batch_sharding = NamedSharding(mesh, P(AXES))

    # ---- parameters: the full layout {'root': tree, 'units': tree stacked on axis 0} <-> shards
    def _init_full(self, rng, inputs):
        m = self.model
        root_key, unit_key = jax.random.split(rng)
        embed_then_head = lambda mod, x: getattr(mod, m.head_method)(getattr(mod, m.embed_method)(x))
        root = m.root.init(root_key, inputs, method=embed_then_head)["params"]
        h = jax.eval_shape(lambda r: m.root.apply({"params": r}, inputs, method=m.embed_method), root)
        h = jnp.zeros(h.shape, h.dtype)
        units = jax.vmap(lambda k: m.unit.init(k, h)["params"])(jax.random.split(unit_key, m.n_units))
        return {ROOT: root, UNITS: units}

    def _pad(self, full, xp=jnp):
        root = jax.tree.map(lambda l, x: l.pad(x, xp), self.layouts[ROOT], full[ROOT], is_leaf=_is_layout)
        units = jax.tree.map(lambda l, x: xp.stack([l.pad(u, xp) for u in x]) if xp is np else jax.vmap(l.pad)(x),
                             self.layouts[UNITS], full[UNITS], is_leaf=_is_layout)
        return {ROOT: root, UNITS: units}

    def init(self, rng):
        """Deferred initialization: one jitted program whose outputs are the shards, computed where
        they live (the random bits are partitionable), so no device ever holds the full model.
        Values equal `init_full(rng)` of the unsharded model."""
        init = jax.jit(lambda k: self._pad(self._init_full(k, self._zeros_inputs())),
                       out_shardings=self.param_shardings)
        return init(rng)

    def _zeros_inputs(self):
        # only the shapes matter to init; a constant inside the traced function costs nothing
        return jnp.zeros(self.example_inputs.shape, self.example_inputs.dtype)

    def abstract_params(self):
        """The shards as ShapeDtypeStructs carrying their shardings: lower and compile without
        allocating anything."""
        shapes = jax.eval_shape(self.init, jax.random.key(0))
        return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), shapes,
                            self.param_shardings)

    def init_full(self, rng):
        """The unsharded initial parameters (one device): the reference for `init`."""
        return jax.jit(lambda k: self._init_full(k, self._zeros_inputs()))(rng)

    def shard(self, full):
        """Place full parameters (host or device arrays) as shards; each device receives its slice."""
        host = jax.tree.map(np.asarray, full)
        return jax.device_put(self._pad(host, np), self.param_shardings)

    def gather(self, params):
        """Shards -> full parameters as host numpy arrays (for export and comparison)."""
        host = jax.device_get(params)
        root = jax.tree.map(lambda l, x: l.unpad(x), self.layouts[ROOT], host[ROOT], is_leaf=_is_layout)
        units = jax.tree.map(lambda l, x: np.stack([l.unpad(u) for u in x]), self.layouts[UNITS], host[UNITS],
                             is_leaf=_is_layout)
        return {ROOT: root, UNITS: units}

    def decay_mask(self):
        """Weight decay on matrices, not on norms, biases or scalars (by unsharded shape)."""
        return jax.tree.map(lambda l: len(l.shape) >= 2, self.layouts, is_leaf=_is_layout)

    # ---- the sharded forward: runs inside shard_map on local shards
    def _unshard(self, shards, layouts):
        return jax.tree.map(lambda l, x: unshard(x, l, self.comm), layouts, shards, is_leaf=_is_layout)

    def _forward(self, params, inputs):
        m = self.model
        # The root is gathered once for both ends of the model: it holds the embedding and the head,
        # which may share a tied weight, and is needed again as soon as the backward pass starts
        # (FSDP2 likewise keeps the root unsharded through the step).
        root = self._unshard(params[ROOT], self.layouts[ROOT])
        h = m.root.apply({"params": root}, inputs, method=m.embed_method)

        def unit(h, shards):
            return m.unit.apply({"params": self._unshard(shards, self.layouts[UNITS])}, h), None

        h, _ = lax.scan(jax.checkpoint(unit, policy=self.policy, prevent_cse=False), h, params[UNITS])
        out = m.root.apply({"params": root}, h, method=m.head_method)
        return out.astype(self.mp.output_dtype) if self.mp.output_dtype else out

    def _check_batch(self, batch, grad_accum=1):
        for x in jax.tree.leaves(batch):
            b = x.shape[0]
            if b % self.n_devices:
                raise ConfigError(f"batch size {b} does not divide over the {self.n_devices} devices of the mesh")
            if (b // self.n_devices) % grad_accum:
                raise ConfigError(f"per-device batch {b // self.n_devices} does not divide into "
                                  f"{grad_accum} gradient-accumulation micro-batches")

    def _shard_map(self, f, in_specs, out_specs):
        return jax.shard_map(f, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)

    def loss_and_grad(self, loss_fn: Callable, grad_accum: int = 1):
        """(params, batch) -> (mean loss, gradients as shards). `loss_fn(outputs, batch)` returns the
        mean loss of a (micro-)batch; `batch['inputs']` feeds `embed`. With grad_accum = k, every
        device runs k micro-batches, each with its own gathers and reduce-scatters."""
        if grad_accum < 1:
            raise ConfigError(f"grad_accum must be at least 1, got {grad_accum}")

        def micro(params, mb):
            return loss_fn(self._forward(params, mb["inputs"]), mb)

        def local(params, batch):
            vg = jax.value_and_grad(micro)
            if grad_accum == 1:
                loss, grads = vg(params, batch)
            else:
                mbs = jax.tree.map(lambda x: x.reshape(grad_accum, -1, *x.shape[1:]), batch)

                def acc(carry, mb):
                    return jax.tree.map(jnp.add, carry, vg(params, mb)), None

                zero = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, params))
                (loss, grads), _ = lax.scan(acc, zero, mbs)
                loss, grads = loss / grad_accum, jax.tree.map(lambda g: g / grad_accum, grads)
            return lax.psum(loss, AXES) / self.n_devices, grads

        sharded = self._shard_map(local, (self.param_specs, P(AXES)), (P(), self.param_specs))

        def fn(params, batch):
            self._check_batch(batch, grad_accum)
            return sharded(params, batch)
        return fn

    def loss(self, loss_fn: Callable):
        """(params, batch) -> mean loss, forward only (evaluation)."""
        def local(params, batch):
            return lax.psum(loss_fn(self._forward(params, batch["inputs"]), batch), AXES) / self.n_devices
        sharded = self._shard_map(local, (self.param_specs, P(AXES)), P())

        def fn(params, batch):
            self._check_batch(batch)
            return sharded(params, batch)
        return fn

    def apply(self, params, inputs):
        """Model outputs for a batch of inputs split over all devices (call under jit)."""
        self._check_batch(inputs)
        return self._shard_map(self._forward, (self.param_specs, P(AXES)), P(AXES))(params, inputs)


def fully_shard(model: Stacked, mesh, example_inputs, *, strategy="full_shard", mp_policy=None,
                remat="none", reshard_after_forward=None) -> FSDP:
    """Apply FSDP to a model from outside. `example_inputs` (an array or ShapeDtypeStruct) fixes the
    parameter shapes. `reshard_after_forward=False` turns FULL_SHARD into SHARD_GRAD_OP, as in FSDP2;
    a value that contradicts `strategy` is an error."""
    strategy = Strategy.parse(strategy)
    if reshard_after_forward is not None:
        if not strategy.sharded:
            raise ConfigError("reshard_after_forward applies to sharded strategies, not no_shard")
        if strategy is Strategy.FULL_SHARD and not reshard_after_forward:
            strategy = Strategy.SHARD_GRAD_OP
        elif strategy is Strategy.HYBRID_SHARD and not reshard_after_forward:
            strategy = Strategy.HYBRID_SHARD_ZERO2
        elif strategy.reshard_after_forward != reshard_after_forward:
            raise ConfigError(f"strategy {strategy.value} contradicts reshard_after_forward={reshard_after_forward}")
    if not isinstance(model, Stacked):
        raise ConfigError("fully_shard expects a jfsdp.Stacked(root=..., unit=..., n_units=...)")
    if model.n_units < 1:
        raise ConfigError(f"n_units must be at least 1, got {model.n_units}")
    return FSDP(model, mesh, example_inputs, strategy, mp_policy or MixedPrecision(), remat)
