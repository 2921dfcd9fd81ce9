"""jfsdp: Fully Sharded Data Parallel training on JAX/XLA."""
from jfsdp.core import FSDP, Layout, Stacked, checkpoint_policy, fully_shard, unshard
from jfsdp.mesh import AXES, DATA, FSDP as FSDP_AXIS, ConfigError, make_mesh, mesh_shape, parse_mesh
from jfsdp.policy import REMAT, MixedPrecision, Strategy
from jfsdp.step import TrainState, abstract_state, adamw, init_state, make_train_step, state_shardings, warmup_cosine

__all__ = ["FSDP", "Layout", "Stacked", "fully_shard", "unshard", "AXES", "DATA", "FSDP_AXIS", "ConfigError",
           "make_mesh", "mesh_shape", "parse_mesh", "REMAT", "MixedPrecision", "Strategy", "checkpoint_policy",
           "TrainState", "abstract_state", "state_shardings", "adamw", "init_state", "make_train_step", "warmup_cosine"]
