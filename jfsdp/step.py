"""The train step: sharded gradients from the FSDP core, then an optax update on the shards."""
from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from jfsdp.core import FSDP


class TrainState(NamedTuple):
    step: jax.Array
    params: Any      # shards, as placed by the plan
    opt_state: Any   # shards too: optax's elementwise state follows the parameters' sharding


def adamw(learning_rate, *, weight_decay: float = 0.1, b1: float = 0.9, b2: float = 0.95, eps: float = 1e-8,
          clip_norm: float | None = 1.0, mask=None) -> optax.GradientTransformation:
    """AdamW with global-norm clipping. Run on sharded gradients under jit, the norm is the global
    norm across all shards (padding is zero and adds nothing)."""
    tx = optax.adamw(learning_rate, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay, mask=mask)
    return optax.chain(optax.clip_by_global_norm(clip_norm), tx) if clip_norm else tx


def warmup_cosine(lr: float, steps: int, warmup: int, final_fraction: float = 0.1):
    warmup = max(0, min(warmup, steps - 1))
    return optax.warmup_cosine_decay_schedule(0.0 if warmup else lr, lr, warmup, max(steps, warmup + 1),
                                              end_value=lr * final_fraction)


def state_shardings(plan: FSDP, optimizer: optax.GradientTransformation) -> TrainState:
    """Where every leaf of the train state lives: optimizer leaves that mirror a parameter (Adam's
    moments) are sharded like it, the rest (step counts) replicated. Fixing these for the step's
    inputs and outputs means one compilation, and lets the planner lower with abstract inputs."""
    replicated = NamedSharding(plan.mesh, P())
    opt = optax.tree_map_params(optimizer, lambda _, s: s, jax.eval_shape(optimizer.init, plan.abstract_params()),
                                plan.param_shardings, transform_non_params=lambda _: replicated)
    return TrainState(replicated, plan.param_shardings, opt)


def abstract_state(plan: FSDP, optimizer: optax.GradientTransformation) -> TrainState:
    """The train state as ShapeDtypeStructs with shardings: lower and compile without allocating."""
    params = plan.abstract_params()
    shardings = state_shardings(plan, optimizer)
    opt = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                       jax.eval_shape(optimizer.init, params), shardings.opt_state)
    return TrainState(jax.ShapeDtypeStruct((), jnp.int32, sharding=shardings.step), params, opt)


def init_state(plan: FSDP, optimizer: optax.GradientTransformation, rng=None, params=None) -> TrainState:
    """Sharded state: parameters from deferred init (or given shards) and optimizer state placed like them."""
    shardings = state_shardings(plan, optimizer)
    params = plan.init(rng) if params is None else params
    opt_state = jax.jit(optimizer.init, out_shardings=shardings.opt_state)(params)
    return TrainState(jax.device_put(jnp.zeros((), jnp.int32), shardings.step), params, opt_state)


def make_train_step(plan: FSDP, optimizer: optax.GradientTransformation, loss_fn: Callable,
                    grad_accum: int = 1, donate: bool = True):
    """jit'ed (state, batch) -> (state, {'loss', 'grad_norm'})."""
    loss_and_grad = plan.loss_and_grad(loss_fn, grad_accum)

    def step(state: TrainState, batch):
        loss, grads = loss_and_grad(state.params, batch)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        return TrainState(state.step + 1, params, opt_state), {"loss": loss, "grad_norm": optax.tree.norm(grads)}

    shardings = state_shardings(plan, optimizer)
    return jax.jit(step, in_shardings=(shardings, plan.batch_sharding), out_shardings=(shardings, shardings.step),
                   donate_argnums=(0,) if donate else ())
