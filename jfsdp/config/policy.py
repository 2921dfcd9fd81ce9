"""The policies: sharding strategy, mixed precision, activation checkpointing (remat), prefetch.

jax-free (dtypes are numpy's, bfloat16 from ml_dtypes): the command lines validate flags with these
before jax starts."""
from __future__ import annotations

import dataclasses
import enum
import math
import os
import re

import ml_dtypes
import numpy as np

from jfsdp.config.errors import ConfigError


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


_DTYPES = {"fp32": np.float32, "float32": np.float32, "bf16": ml_dtypes.bfloat16, "bfloat16": ml_dtypes.bfloat16,
           "fp16": np.float16, "float16": np.float16}


def _dtype(x):
    if x is None:
        return None
    if isinstance(x, str):
        if x not in _DTYPES:
            raise ConfigError(f"unknown dtype '{x}'; choose from {', '.join(_DTYPES)}")
        return np.dtype(_DTYPES[x])
    return np.dtype(x)


FLOAT8_RECIPES = ("tensorwise", "rowwise")


@dataclasses.dataclass(frozen=True)
class Float8:
    """Which of the units' dense matmuls run in float8 (jfsdp/engine/float8.py), as torchtitan's
    filter_fqns, by path or by size. `skip`: regular expressions searched in a kernel's path inside its
    unit (e.g. "router", "attention"); `min_size`: kernels with fewer elements stay bf16 (small matmuls
    lose more to scaling than they gain). Kernels with a dimension that is not a multiple of 16 stay
    bf16 (float8 gemms on H100 need it). The root (embedding, head, norms) is never float8. `recipe`:
    "tensorwise" (one scale per tensor, weights all-gathered in float8) or "rowwise" (a scale per row of
    the activation and per column of the weight, weights all-gathered in param_dtype; docs/float8.md)."""
    skip: tuple = ("router",)
    min_size: int = 0
    recipe: str = "tensorwise"

    def __post_init__(self):
        object.__setattr__(self, "skip", (self.skip,) if isinstance(self.skip, str) else tuple(self.skip))
        for p in self.skip:
            try:
                re.compile(p)
            except re.error as e:
                raise ConfigError(f"float8 skip pattern {p!r} is not a regular expression: {e}") from None
        if not isinstance(self.min_size, int) or self.min_size < 0:
            raise ConfigError(f"float8 min_size must be a non-negative integer, got {self.min_size!r}")
        if self.recipe not in FLOAT8_RECIPES:
            raise ConfigError(f"unknown float8 recipe {self.recipe!r}; choose from {', '.join(FLOAT8_RECIPES)}")

    def select(self, kernels: dict) -> dict:
        """{path: shape} -> those of the kernels that run in float8."""
        return {p: s for p, s in kernels.items()
                if not any(re.search(r, p) for r in self.skip) and math.prod(s) >= self.min_size
                and len(s) == 2 and s[0] % 16 == 0 and s[1] % 16 == 0}


@dataclasses.dataclass(frozen=True)
class MixedPrecision:
    """As FSDP2's MixedPrecisionPolicy. Master parameters and optimizer state stay fp32 and sharded;
    the shard is cast to `param_dtype` before the all-gather (so communication is in param_dtype) and
    the unit computes in it; gradients are reduce-scattered in `reduce_dtype`; the model output is cast
    to `output_dtype`. None means: leave as is (fp32). `float8` (a `Float8` filter): the units' selected
    dense matmuls run in float8 and their weights are all-gathered in float8 (jfsdp/engine/float8.py);
    everything else as param_dtype says (bf16; or fp32, where only the float8 matmuls round)."""
    param_dtype: object = None
    reduce_dtype: object = None
    output_dtype: object = None
    float8: object = None

    def __post_init__(self):
        for f in ("param_dtype", "reduce_dtype", "output_dtype"):
            object.__setattr__(self, f, _dtype(getattr(self, f)))
        if self.float8 is True:
            object.__setattr__(self, "float8", Float8())
        if self.float8 is not None:
            if not isinstance(self.float8, Float8):
                raise ConfigError(f"MixedPrecision.float8 must be a jfsdp.Float8 filter or True, got {self.float8!r}")
            if self.param_dtype not in (None, np.dtype(ml_dtypes.bfloat16), np.dtype(np.float32)):
                raise ConfigError("float8 matmuls take param_dtype bf16 (MixedPrecision.parse('fp8')) or fp32 for "
                                  f"the rest of the model, got {self.param_dtype}")

    @classmethod
    def parse(cls, name: str) -> "MixedPrecision":
        if name in ("fp32", "float32", None):
            return cls()
        if name in ("bf16", "bfloat16"):
            return cls(param_dtype=ml_dtypes.bfloat16, reduce_dtype=np.float32, output_dtype=np.float32)
        if name in ("fp8", "float8", "fp8-rowwise"):
            return cls(param_dtype=ml_dtypes.bfloat16, reduce_dtype=np.float32, output_dtype=np.float32,
                       float8=Float8(recipe="rowwise" if name == "fp8-rowwise" else "tensorwise"))
        raise ConfigError(f"unknown precision '{name}'; choose from {', '.join(PRECISIONS)}")


    def cast_output(self, out):
        """The head's outputs in `output_dtype`: applies to a head that returns an array (logits); a head
        that returns a pytree (hidden states and a weight for a fused loss) hands its precision to the loss."""
        if self.output_dtype is not None and hasattr(out, "astype") and hasattr(out, "dtype"):
            return out.astype(self.output_dtype)
        return out


PRECISIONS = ("fp32", "bf16", "fp8", "fp8-rowwise")


def wire_dtype(dtype, backend: str):
    """The dtype that `dtype` really takes in the compiled program. XLA's CPU backend has no 16-bit
    float collectives or arithmetic: its float-normalization passes widen them to f32: a bf16 plan's all-gathers, kept
    units and saved activations are f32 in the compiled CPU program, and its memory that of the fp32 plan. GPUs and TPUs keep bf16 as bf16."""
    import jax.numpy as jnp

    dtype = jnp.dtype(dtype)
    if backend == "cpu" and dtype.itemsize < 4 and jnp.issubdtype(dtype, jnp.floating):
        return jnp.dtype(jnp.float32)
    return dtype


# Activation checkpointing per unit: what the backward pass of a unit may reuse from its forward pass,
# by the name of the jax.checkpoint_policies member. 'none' saves every activation, 'full' only the
# unit's input, 'dots' matmul outputs (the elementwise work is recomputed). On top of it, the engine
# decides on the gathered parameters (jfsdp.engine.fsdp.checkpoint_policy).
REMAT_POLICIES = {"none": "everything_saveable", "full": "nothing_saveable", "dots": "dots_saveable"}
REMAT = tuple(REMAT_POLICIES)


def check_remat(remat: str) -> str:
    if remat not in REMAT_POLICIES:
        raise ConfigError(f"unknown remat '{remat}'; choose from {', '.join(REMAT)}")
    return remat


def prefetch_unsupported(strategy: Strategy, remat: str, shards: int) -> str | None:
    """Why the explicit prefetch pipeline cannot run this combination (None: it can)."""
    if not strategy.sharded or shards == 1:
        return "there is nothing to gather (no_shard, or one shard on an Rx1 mesh)"
    return None


# Why the default leaves ZeRO-2 to XLA's own pipeliner (docs/gpus.md has the figures): its backward has no
# gather to prefetch, and on the plain scan XLA already hides the forward gathers as well and hides unit
# 0's reduce-scatter, which the pipeline leaves exposed.
_ZERO2_PLAIN = "its backward gathers nothing and XLA's pipeliner hides its forward gathers as well"


def prefetch_by_default(strategy: Strategy, remat: str, shards: int, on_gpu: bool) -> bool:
    """`fully_shard(prefetch=None)`'s choice: the pipeline where it is supported and the devices are
    GPUs, or as JFSDP_PREFETCH=1 / 0 says on every platform; resharding strategies only (ZeRO-2 takes
    it with prefetch=True). Also read by train.py before jax starts its backend, so that XLA gets the
    pipeline's flags."""
    env = os.environ.get("JFSDP_PREFETCH", "").strip().lower()
    if env not in ("", "0", "1", "true", "false"):
        raise ConfigError(f"JFSDP_PREFETCH must be 1 or 0, got {env!r}")
    on = env in ("1", "true") if env else on_gpu
    return on and prefetch_unsupported(strategy, remat, shards) is None and strategy.reshard_after_forward


def schedule(strategy: Strategy, remat: str, shards: int, prefetch: bool) -> str:
    """One line for the planner's overlap report: which schedule runs the units, and why not the
    prefetch pipeline where it does not."""
    if prefetch:
        return "jfsdp's prefetch pipeline (each unit's gather in flight while the previous unit computes)"
    why = prefetch_unsupported(strategy, remat, shards)
    if why is None and not strategy.reshard_after_forward:
        why = f"{strategy.value}: {_ZERO2_PLAIN} (prefetch=True runs it)"
    return f"the plain scan, XLA's pipeliner: {why or 'prefetch off (prefetch=False or JFSDP_PREFETCH=0)'}"


def resolve_prefetch(prefetch, strategy: Strategy, remat: str, shards: int, on_gpu: bool) -> bool:
    """prefetch: True (the explicit pipeline, ConfigError where unsupported), False (the plain scan),
    None: on where supported and the mesh's devices are GPUs (XLA:CPU runs collectives synchronously,
    so prefetching there only costs the memory of a gathered unit); the environment variable
    JFSDP_PREFETCH=1 / 0 turns that default on or off for every platform."""
    if prefetch not in (None, True, False):
        raise ConfigError(f"prefetch must be True, False or None (automatic), got {prefetch!r}")
    why = prefetch_unsupported(strategy, remat, shards)
    if prefetch is True and why:
        raise ConfigError(f"prefetch=True (the explicit prefetch pipeline) needs a sharded strategy over more "
                          f"than one shard: {why}; use prefetch=None or False")
    if prefetch is not None:
        return prefetch
    return prefetch_by_default(strategy, remat, shards, on_gpu)
