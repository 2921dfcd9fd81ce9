"""`fully_shard`: the one way in. A model given as units (`Stacked`, `Staged`) becomes an `FSDP`; a Flax
model given as it is (a Linen or NNX module, with `units=` naming its FSDP units) becomes an `AsIs`.
Both are the same engine (sharded.py, as_is/)."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Callable

import flax.linen as nn
from flax import nnx

from jfsdp.config.errors import ConfigError
from jfsdp.config.mesh import context_size, tensor_size
from jfsdp.config.policy import MixedPrecision, Strategy
from jfsdp.engine.as_is import AsIs
from jfsdp.engine.layout import Stacked, Staged, check_model
from jfsdp.engine.sharded import FSDP


def resolve_strategy(strategy, reshard_after_forward) -> Strategy:
    """`strategy` with FSDP2's `reshard_after_forward` applied (False turns FULL_SHARD into
    SHARD_GRAD_OP, HYBRID_SHARD into its ZeRO-2 form); a contradiction is a ConfigError."""
    strategy = Strategy.parse(strategy)
    if reshard_after_forward is None:
        return strategy
    if not strategy.sharded:
        raise ConfigError("reshard_after_forward applies to sharded strategies, not no_shard")
    if strategy is Strategy.FULL_SHARD and not reshard_after_forward:
        return Strategy.SHARD_GRAD_OP
    if strategy is Strategy.HYBRID_SHARD and not reshard_after_forward:
        return Strategy.HYBRID_SHARD_ZERO2
    if strategy.reshard_after_forward != reshard_after_forward:
        raise ConfigError(f"strategy {strategy.value} contradicts reshard_after_forward={reshard_after_forward}")
    return strategy


def fully_shard(model, mesh, example_inputs, *, units=None, call: Callable | None = None, strategy="full_shard",
                mp_policy=None, remat="none", reshard_after_forward=None, prefetch=None, moe=None, seed: int = 0,
                rng_streams=("dropout",), init: Callable | None = None, tensor_plan=None, async_tp=None,
                logical_rules=None, context_attention=None):
    """Apply FSDP to a model from outside.

    A Flax model as it is (docs/any-model.md): `model` is an unbound Linen module or an NNX module
    (concrete, or abstract from `nnx.eval_shape` with `init=make`, `make(rngs)` building it);
    `units` a module class, a tuple of classes or a predicate on a submodule's path ('layers/3'): every
    instance it matches is an FSDP unit, gathered just before it is called and freed after, its gradient
    reduce-scattered; everything else is the root. `call(model, batch) -> outputs` applies the model
    (default `model(batch['inputs'])`); `example_inputs` is the example batch (a dict of arrays or
    ShapeDtypeStructs; an array alone is `{'inputs': array}`). `seed` and `rng_streams` (Linen's
    stream names) feed stochastic layers such as dropout. `prefetch` (None: on GPUs, as for `Stacked`)
    prefetches the units in the order the model calls them from its own Python loop (call_order.py).

    `Stacked` / `Staged` (docs/your-model.md): `example_inputs` (an array or ShapeDtypeStruct of
    `batch['inputs']`) fixes the parameter shapes. `prefetch` runs each stage as an explicit software
    pipeline (pipeline.py; FULL_SHARD / HYBRID_SHARD with remat 'full'; None turns it on on GPUs or
    with JFSDP_PREFETCH=1); `moe=jfsdp.MoE(mode, chunks)` says how units that call an experts module run
    (moe.py).

    Either way `reshard_after_forward=False` turns FULL_SHARD into SHARD_GRAD_OP, as in FSDP2.

    Tensor parallelism: on a mesh with a `tensor` axis (`make_mesh(spec, tensor=T)`), a `Stacked` model
    takes `tensor_plan=jfsdp.TensorPlan({regex: 'colwise' | 'rowwise' | 'replicate'})`; Megatron-SP runs
    inside the units (docs/tensor-parallel.md). `async_tp` decomposes its collectives into rings of
    matmuls that overlap their transfers (None: on GPUs). A model given as it is takes it from the logical
    axis names its parameters carry, mapped by `logical_rules` ((name, 'tensor' or None) pairs; default
    mlp, heads, kv, vocab -> tensor), XLA partitioning the units over `tensor` (parallel/logical.py)."""
    strategy = resolve_strategy(strategy, reshard_after_forward)
    mp_policy = mp_policy or MixedPrecision()
    if not isinstance(model, (Stacked, Staged)):
        if not isinstance(model, (nn.Module, nnx.Module)):
            check_model(model)   # neither form: the error names both
        if units is None:
            raise ConfigError(f"a {type(model).__name__} given as it is needs units=: the module class (or classes, or a "
                              "predicate on a submodule's path) of its FSDP units, e.g. units=Block")
        if moe is not None:
            raise ConfigError("moe= applies to jfsdp.Stacked / jfsdp.Staged models")
        if context_size(mesh) > 1 or context_attention is not None:
            raise ConfigError("context parallelism for a model given as it is is not supported yet "
                              "(docs/context-parallel.md): use jfsdp.Stacked with context_attention")
        if tensor_plan is not None or async_tp:
            raise ConfigError("a model given as it is takes tensor parallelism from its logical axis names: pass "
                              "logical_rules= (e.g. {'mlp': 'tensor'}), not tensor_plan= or async_tp= "
                              "(docs/tensor-parallel.md)")
        if not isinstance(example_inputs, Mapping) and not hasattr(example_inputs, "shape"):
            raise ConfigError("example_inputs must be a batch dict of arrays or ShapeDtypeStructs (or an inputs array), "
                              f"got {type(example_inputs).__name__}")
        return AsIs(model, mesh, example_inputs, units, call, strategy, mp_policy, remat, seed, rng_streams, init,
                    logical_rules, prefetch)
    if logical_rules is not None:
        raise ConfigError("logical_rules= describes a model given as it is; a jfsdp.Stacked model takes tensor_plan=")
    if units is not None or call is not None or init is not None:
        raise ConfigError("units=, call= and init= describe a model given as it is; a jfsdp.Stacked / Staged model "
                          "names its units itself")
    check_model(model)
    if not hasattr(example_inputs, "shape") or not hasattr(example_inputs, "dtype"):
        raise ConfigError("example_inputs must be an array or jax.ShapeDtypeStruct of the inputs (batch['inputs']), "
                          f"got {type(example_inputs).__name__}")
    if async_tp and tensor_size(mesh) == 1:
        raise ConfigError("async_tp=True needs a mesh with a tensor axis of size > 1 (make_mesh(spec, tensor=T))")
    return FSDP(model, mesh, example_inputs, strategy, mp_policy, remat, prefetch, moe, tensor_plan, async_tp,
                context_attention)
