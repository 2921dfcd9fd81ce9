"""What tensor parallelism (T > 1) supports so far, and a ConfigError that says why for the rest.

Supported: a `jfsdp.Stacked` model with a `TensorPlan`, FULL_SHARD / SHARD_GRAD_OP / HYBRID_SHARD
(and its ZeRO-2 form), any remat policy, the prefetch pipeline, fp32 or bf16 mixed precision, tensorwise
float8, gradient accumulation (both grad_sync modes), frozen parameters, a vocabulary-parallel root
(parallel/vocab.py), checkpoints and Hugging Face import (io/tensor_rows.py), the in-backward update
(train/update_in_backward.py), `Staged` models, MoE in gather or ep mode (parallel/moe_rows.py), context
parallelism on a `Stacked` model (C > 1: its own refusals, parallel/context.py `check`). Refused
until a later slice: NO_SHARD, adaptive MoE, float8 with MoE, rowwise float8. (A model given as it is takes
T > 1 through its logical axis names: parallel/logical.py.)"""
from __future__ import annotations

import jax
import numpy as np

from jfsdp.config.errors import ConfigError
from jfsdp.config.mesh import tensor_size
from jfsdp.engine.layout import Stacked, Staged
from jfsdp.engine.parallel.plan import TensorPlan

LATER = "is not supported with tensor parallelism yet (docs/tensor-parallel.md)"


def check(model, mesh, strategy, mp_policy, prefetch, moe, tensor_plan):
    """ConfigError for what T > 1 does not support; the prefetch option to use (None or False)."""
    t = tensor_size(mesh)
    if t == 1:
        if tensor_plan is not None and not isinstance(tensor_plan, TensorPlan):
            raise ConfigError(f"tensor_plan must be a jfsdp.TensorPlan, got {type(tensor_plan).__name__}")
        return prefetch
    if not isinstance(tensor_plan, TensorPlan):
        raise ConfigError(f"a mesh with tensor {t} needs tensor_plan=jfsdp.TensorPlan(...) saying which layers are "
                          "colwise and rowwise (models/factory.py has the plan of jfsdp's Llama)")
    if not isinstance(model, (Stacked, Staged)):
        raise ConfigError(f"a jfsdp.{type(model).__name__} model {LATER}: use jfsdp.Stacked or jfsdp.Staged")
    if not strategy.sharded:
        raise ConfigError(f"strategy no_shard {LATER}: use full_shard, shard_grad_op or hybrid_shard")
    if moe is not None and "adaptive" in (moe.mode if isinstance(moe.mode, (tuple, list)) else (moe.mode,)):
        raise ConfigError(f"MoE mode adaptive {LATER}: its load maximum (the switch's index) is taken over data x "
                          "fsdp and its ep variants send over fsdp alone, not tensor; use gather, ep or auto")
    if moe is not None and mp_policy.float8 is not None:
        raise ConfigError(f"float8 with an MoE model {LATER}: use bf16 or fp32")
    if mp_policy.float8 is not None and mp_policy.float8.recipe == "rowwise":
        raise ConfigError(f"float8 with rowwise scaling {LATER}: use the tensorwise recipe (fp8)")
    return prefetch   # the prefetch pipeline gathers the TP-local units over `fsdp`; TP stays inside each unit


def async_tp(asked, platform: str) -> bool:
    """Whether the TP collectives run as rings of collective matmuls: asked, or by default on GPUs."""
    return platform == "gpu" if asked is None else bool(asked)


def check_sequence(tree, tensor: int, dim: int):
    """ConfigError unless every batch leaf has a sequence axis `dim` that T divides (sequence parallelism
    splits it over `tensor`)."""
    for x in jax.tree.leaves(tree):
        shape = np.shape(x)
        if len(shape) <= dim or shape[dim] % tensor:
            raise ConfigError(f"a batch leaf of shape {shape}: sequence parallelism splits axis {dim} (the sequence) "
                              f"over tensor {tensor}, which must divide it")


def chain(interceptors: list):
    """Linen method interceptors as one, the first outermost (as nested `nn.intercept_methods` would run them)."""
    def run(hooks, next_fun, args, kwargs, context):
        if not hooks:
            return next_fun(*args, **kwargs)
        return hooks[0](lambda *a, **k: run(hooks[1:], next_fun, a, k, context), args, kwargs, context)
    return lambda next_fun, args, kwargs, context: run(list(interceptors), next_fun, args, kwargs, context)
