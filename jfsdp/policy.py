"""Configuration: sharding strategy, mixed precision, activation checkpointing."""
from __future__ import annotations

import dataclasses
import enum

import jax
import jax.numpy as jnp

from jfsdp.mesh import ConfigError


class Strategy(enum.Enum):
    """How state is sharded. The mesh decides the scope: state is sharded over `fsdp` and replicated
    over `data`, so on an RxS mesh with R > 1 every sharded strategy is hybrid sharding (as in FSDP2).
    HYBRID_SHARD and HYBRID_SHARD_ZERO2 are the FSDP1 names for that layout and compile to the same
    programs as FULL_SHARD and SHARD_GRAD_OP."""
    FULL_SHARD = "full_shard"            # ZeRO-3: gather per unit in forward and again in backward
    SHARD_GRAD_OP = "shard_grad_op"      # ZeRO-2: keep the gathered unit from forward for backward
    NO_SHARD = "no_shard"                # DDP: everything replicated, gradients all-reduced
    HYBRID_SHARD = "hybrid_shard"
    HYBRID_SHARD_ZERO2 = "hybrid_shard_zero2"

    @classmethod
    def parse(cls, name) -> "Strategy":
        if isinstance(name, Strategy):
            return name
        key = str(name).strip().lower().replace("-", "_")
        for s in cls:
            if s.value == key:
                return s
        raise ConfigError(f"unknown strategy '{name}'; choose from {', '.join(s.value for s in cls)}")

    @property
    def sharded(self) -> bool:
        return self is not Strategy.NO_SHARD

    @property
    def reshard_after_forward(self) -> bool:
        return self in (Strategy.FULL_SHARD, Strategy.HYBRID_SHARD)


_DTYPES = {"fp32": jnp.float32, "float32": jnp.float32, "bf16": jnp.bfloat16, "bfloat16": jnp.bfloat16,
           "fp16": jnp.float16, "float16": jnp.float16}


def _dtype(x):
    if x is None:
        return None
    if isinstance(x, str):
        if x not in _DTYPES:
            raise ConfigError(f"unknown dtype '{x}'; choose from {', '.join(_DTYPES)}")
        return jnp.dtype(_DTYPES[x])
    return jnp.dtype(x)


@dataclasses.dataclass(frozen=True)
class MixedPrecision:
    """As FSDP2's MixedPrecisionPolicy. Master parameters and optimizer state stay fp32 and sharded;
    the shard is cast to `param_dtype` before the all-gather (so communication is in param_dtype) and
    the unit computes in it; gradients are reduce-scattered in `reduce_dtype`; the model output is cast
    to `output_dtype`. None means: leave as is (fp32)."""
    param_dtype: object = None
    reduce_dtype: object = None
    output_dtype: object = None

    def __post_init__(self):
        for f in ("param_dtype", "reduce_dtype", "output_dtype"):
            object.__setattr__(self, f, _dtype(getattr(self, f)))

    @classmethod
    def parse(cls, name: str) -> "MixedPrecision":
        if name in ("fp32", "float32", None):
            return cls()
        if name in ("bf16", "bfloat16"):
            return cls(param_dtype=jnp.bfloat16, reduce_dtype=jnp.float32, output_dtype=jnp.float32)
        raise ConfigError(f"unknown precision '{name}'; choose from fp32, bf16")


REMAT = ("none", "full", "dots")  # activation checkpointing per unit; see core.checkpoint_policy
