"""jfsdp: Fully Sharded Data Parallel training on JAX/XLA."""
from jfsdp.core import (FSDP, Layout, Stacked, Stage, Staged, checkpoint_policy, fully_shard, stack_units, unshard,
                        unstack_units)
from jfsdp.mesh import AXES, DATA, FSDP as FSDP_AXIS, ConfigError, make_mesh, mesh_shape, parse_mesh
from jfsdp import ops
from jfsdp.moe import MoE
from jfsdp.policy import REMAT, MixedPrecision, Strategy
from jfsdp.step import (TrainState, TrainStep, abstract_state, adamw, init_state, make_train_step, matrices,
                        state_shardings, unit_view, warmup_cosine)

__all__ = ["MoE", "FSDP", "Layout", "Stacked", "Stage", "Staged", "fully_shard", "unshard", "stack_units", "unstack_units",
           "AXES", "DATA", "FSDP_AXIS", "ConfigError", "make_mesh", "mesh_shape", "parse_mesh", "REMAT",
           "MixedPrecision", "Strategy", "checkpoint_policy", "TrainState", "TrainStep", "abstract_state",
           "state_shardings", "adamw", "init_state", "make_train_step", "matrices", "unit_view", "warmup_cosine"]
