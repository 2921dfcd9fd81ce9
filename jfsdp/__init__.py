"""jfsdp: Fully Sharded Data Parallel training on JAX/XLA.

The names below are loaded on first use (PEP 562), so that `import jfsdp.cli` does not import jax:
the command line must set XLA's device flags and JAX_PLATFORMS before jax starts, and bad flags
fail in a fraction of a second. `from jfsdp import X` and `jfsdp.X` work as with plain imports.
"""
import importlib

_EXPORTS = {   # module -> the names it gives this package ("alias=name" where they differ)
    "config.errors": ("ConfigError",),
    "config.mesh": ("AXES", "CONTEXT_AXIS", "DATA_AXIS", "DATA=DATA_AXIS", "FSDP_AXIS", "MeshSpec", "TENSOR_AXIS",
                    "context_size", "make_mesh", "mesh_shape", "parse_mesh", "tensor_size"),
    "config.policy": ("REMAT", "Float8", "MixedPrecision", "Strategy"),
    "engine.layout": ("Layout", "Stacked", "Stage", "Staged", "stack_units", "unstack_units"),
    "engine.sharded": ("FSDP", "checkpoint_policy", "unshard"),
    "engine.entry": ("fully_shard",),
    "engine.as_is": ("AsIs",),
    "engine.moe": ("MoE",),
    "engine.parallel.plan": ("TensorPlan",),
    "train.losses": ("linear_cross_entropy", "lm_loss", "logits_loss"),
    "train.optim": ("adamw", "matrices", "unit_view", "warmup_cosine"),
    "train.step": ("TrainState", "TrainStep", "abstract_state", "init_state", "make_train_step", "state_shardings"),
}
_WHERE = {alias: (module, name) for module, names in _EXPORTS.items()
          for alias, _, name in (n.partition("=") if "=" in n else (n, "", n) for n in names)}
_SUBPACKAGES = ("config", "engine", "train", "planning", "io", "runtime")

__all__ = sorted(_WHERE)


def __getattr__(name):
    if name in _WHERE:
        module, attr = _WHERE[name]
        value = getattr(importlib.import_module(f"{__name__}.{module}"), attr)
        globals()[name] = value
        return value
    if name in _SUBPACKAGES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__) | set(_SUBPACKAGES))
