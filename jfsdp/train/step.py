"""The train step: sharded gradients from the FSDP core, then an optax update on the shards."""
from __future__ import annotations

import os
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from jfsdp.config.errors import ConfigError
from jfsdp.config.mesh import platform
from jfsdp.config.xla_flags import run_hazard

# The XLA_FLAGS this process had when jfsdp was imported. XLA reads them once, when jax's backend starts,
# which in the usual order (flags set, jfsdp imported, first device used) is after this: a later change
# of the environment (an in-process planner call sets its compile-only flags) does not reach XLA.
XLA_FLAGS_AT_IMPORT = os.environ.get("XLA_FLAGS", "")
from jfsdp.engine import step_metrics
from jfsdp.engine.accumulate import check_grad_sync
from jfsdp.engine.sharded import FSDP
from jfsdp.train import frozen, update_in_backward as in_backward


class TrainState(NamedTuple):
    step: jax.Array
    params: Any      # shards, as placed by the sharded
    opt_state: Any   # shards too: optax's elementwise state follows the parameters' sharding


def state_shardings(sharded: FSDP, optimizer: optax.GradientTransformation, trainable=None) -> TrainState:
    """Where every leaf of the train state lives: optimizer leaves that mirror a parameter (Adam's
    moments) are sharded like it, the rest (step counts) replicated. Fixing these for the step's
    inputs and outputs means one compilation, and lets the planner lower with abstract inputs.
    `trainable`: frozen parameters have no optimizer state (jfsdp/train/frozen.py)."""
    train_mask = frozen.mask(sharded, trainable)
    optimizer = frozen.optimizer(optimizer, train_mask)
    replicated = NamedSharding(sharded.mesh, P())
    if train_mask is not None:
        opt = frozen.opt_shardings(sharded, jax.eval_shape(optimizer.init, sharded.abstract_params()), replicated)
        return TrainState(replicated, sharded.param_shardings, opt)
    opt = optax.tree_map_params(optimizer, lambda _, s: s, jax.eval_shape(optimizer.init, sharded.abstract_params()),
                                sharded.param_shardings, transform_non_params=lambda _: replicated)
    return TrainState(replicated, sharded.param_shardings, opt)


def abstract_state(sharded: FSDP, optimizer: optax.GradientTransformation, trainable=None) -> TrainState:
    """The train state as ShapeDtypeStructs with shardings: lower and compile without allocating."""
    params = sharded.abstract_params()
    shardings = state_shardings(sharded, optimizer, trainable)
    optimizer = frozen.optimizer(optimizer, frozen.mask(sharded, trainable))
    opt = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                       jax.eval_shape(optimizer.init, params), shardings.opt_state)
    return TrainState(jax.ShapeDtypeStruct((), jnp.int32, sharding=shardings.step), params, opt)


def init_state(sharded: FSDP, optimizer: optax.GradientTransformation, rng=None, params=None,
               trainable=None) -> TrainState:
    """Sharded state: parameters from deferred init (`rng`) or from `params`, and optimizer state
    placed like them.

    `params` may be full parameters in the sharded's layout (host or device arrays, unpadded:
    {'root': ..., 'units': stacked} for `Stacked`, {'root': ..., 'stages': [...]} for `Staged`;
    `sharded.from_layers(root, layers)` builds it from per-layer trees) or this sharded's shards (from
    `sharded.shard` / `sharded.init`). Either way the state gets its own copy: the train step donates
    its input state, and the arrays passed here stay valid. `trainable` (as make_train_step's): no
    optimizer state for frozen parameters."""
    if params is None and rng is None and hasattr(sharded, "own_params"):
        params = sharded.own_params()   # a concrete NNX model's own weights
    if params is None:
        if rng is None:
            raise ConfigError("init_state needs rng (deferred initialization) or params= (existing weights)")
        params = sharded.init(rng)
    else:
        params = sharded.place(params)
    shardings = state_shardings(sharded, optimizer, trainable)
    optimizer = frozen.optimizer(optimizer, frozen.mask(sharded, trainable))
    opt_state = jax.jit(optimizer.init, out_shardings=shardings.opt_state)(params)
    return TrainState(jax.device_put(jnp.zeros((), jnp.int32), shardings.step), params, opt_state)


class TrainStep:
    """The jitted train step `(state, batch) -> (new state, {'loss', 'grad_norm'})`.

    The batch is checked first (`sharded.check_batch`: a dict with 'inputs', rows dividing over the
    devices and into the micro-batches), so a bad batch is a ConfigError, host arrays included.
    With donate=True (the default) the input state's buffers are reused for the new state: the
    state passed in is deleted, keep only the returned one (`state, m = step(state, batch)`);
    passing a donated state again is a ConfigError. `lower` checks the batch too; other attributes of
    the jitted function pass through."""

    def __init__(self, jitted, sharded: FSDP, grad_accum: int, donate: bool):
        self._jitted, self.sharded, self.grad_accum, self.donate = jitted, sharded, grad_accum, donate
        self._safe_to_run = False

    def __call__(self, state: TrainState, batch):
        self.sharded.check_batch(batch, self.grad_accum)
        if not self._safe_to_run:   # once: a program that would mix up its collectives never runs
            mesh = self.sharded.mesh
            why = run_hazard(XLA_FLAGS_AT_IMPORT) if mesh.size > 1 and platform(mesh) == "cpu" else None
            if why:
                raise ConfigError(why)
            self._safe_to_run = True
        # checked before the call: jax 0.10.2 on CPU crashed the process (segmentation fault) when a
        # sharded program was given deleted buffers, instead of raising. A few dozen leaves: ~µs.
        if self.donate and _donated(state):
            raise ConfigError("this TrainState was donated to an earlier step and its buffers are gone: "
                              "use the state that step returned (state, metrics = step(state, batch)), "
                              "or make the step with donate=False")
        return self._jitted(state, batch)

    def lower(self, state, batch):
        """Lower for given (possibly abstract) inputs, after the same batch check as a call."""
        self.sharded.check_batch(batch, self.grad_accum)
        return self._jitted.lower(state, batch)

    def __getattr__(self, name):
        return getattr(self._jitted, name)


def _donated(state) -> bool:
    def deleted(x):
        try:
            return isinstance(x, jax.Array) and x.is_deleted()
        except Exception:  # a tracer (the step called inside another jit) has no buffers to check
            return False
    return any(deleted(x) for x in jax.tree.leaves(state))


def make_train_step(sharded: FSDP, optimizer: optax.GradientTransformation, loss_fn: Callable,
                    grad_accum: int = 1, donate: bool = True, update_in_backward: bool = False,
                    grad_sync: str = "every", trainable=None, metrics=None) -> TrainStep:
    """(state, batch) -> (state, {'loss', 'grad_norm', **metrics}), jitted (see `TrainStep`).

    `loss_fn(outputs, batch)` is the loss contract (see `FSDP.loss_and_grad`): the head's outputs
    and the same rows of the batch dict, on one device's (micro-)batch, -> the mean loss, a scalar.
    `batch['inputs']` is what the root's embed method receives.

    `update_in_backward=True` applies the optimizer to each unit inside the backward pass as soon as
    its gradient shard is reduced (jfsdp/update_in_backward.py): no whole gradient is ever held, which
    lowers the peak by about one gradient shard of the units. Same result as the usual step; needs
    remat 'full', grad_accum 1, a resharding strategy (or one shard) and an elementwise optimizer
    (`jfsdp.adamw`, optax's adam/sgd family); with clipping the units' backward runs twice (norm,
    then updates).

    `grad_sync`: with grad_accum = k > 1, 'every' (default) reduce-scatters each micro-batch's
    gradients; 'once' adds them up unreduced on each device (one unsharded gradient of the model in
    the reduce dtype) and reduces once per step: 1/k of the reduce-scatter traffic, same result
    (jfsdp/engine/accumulate.py). Not with update_in_backward or expert-parallel MoE stages.

    `trainable`: a tree of booleans like the parameters (or a prefix of it), or a predicate on a
    parameter's path ('root/embed/embedding'); frozen parameters are gathered for compute but get no
    gradient, reduce-scatter, optimizer state, weight decay or update (jfsdp/train/frozen.py). Pass
    the same to init_state / abstract_state.

    `metrics`: {name: fn(outputs, batch)} (or (fn, 'mean'|'max')), scalars the step returns beside its loss,
    read from the step's own forward pass (before the update; jfsdp/engine/step_metrics.py): e.g. an MoE
    router's dropped share and the capacity it ran with, at no extra pass. Not with update_in_backward."""
    shardings = state_shardings(sharded, optimizer, trainable)
    train_mask = frozen.mask(sharded, trainable)
    optimizer = frozen.optimizer(optimizer, train_mask)
    if train_mask is not None and update_in_backward:
        raise ConfigError("trainable= (frozen parameters) is not supported with update_in_backward")
    if check_grad_sync(grad_sync) == "once" and update_in_backward:
        raise ConfigError("grad_sync='once' cannot combine with update_in_backward: the optimizer runs on each "
                          "unit's reduced gradient inside the backward pass, which 'once' reduces only after the "
                          "last micro-batch")
    metrics = step_metrics.check(metrics, reserved=("loss", "grad_norm"))
    if update_in_backward and metrics:
        raise ConfigError("metrics= cannot combine with update_in_backward: its fused backward returns the loss "
                          "and the gradient norm only (measure them with a forward pass of their own)")
    if update_in_backward:
        why = in_backward.unsupported(sharded, grad_accum)
        if why:
            raise ConfigError(f"update_in_backward: {why}")
        fused = in_backward.make_step(sharded, optimizer, loss_fn, jax.tree.map(lambda s: s.spec, shardings.opt_state))

        def step(state: TrainState, batch):
            params, opt_state, loss, norm = fused(state.params, state.opt_state, batch)
            return TrainState(state.step + 1, params, opt_state), {"loss": loss, "grad_norm": norm}
    else:
        loss_and_grad = sharded.loss_and_grad(loss_fn, grad_accum, grad_sync, trainable=train_mask, metrics=metrics)

        def step(state: TrainState, batch):
            loss, grads, *aux = loss_and_grad(state.params, sharded.step_batch(batch, state.step))
            updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
            params = frozen.keep_frozen(optax.apply_updates(state.params, updates), state.params, train_mask)
            out = {"loss": loss, "grad_norm": optax.tree.norm(grads), **(aux[0] if aux else {})}
            return TrainState(state.step + 1, params, opt_state), out

    jitted = jax.jit(step, in_shardings=(shardings, sharded.batch_sharding), out_shardings=(shardings, shardings.step),
                     donate_argnums=(0,) if donate else ())
    return TrainStep(jitted, sharded, grad_accum, donate)
