"""What a model given as it is (`jfsdp.engine.as_is.AsIs`) does differently on a mesh with `tensor` T > 1.

The same engine (the same `fully_shard`, `init_state`, `make_train_step`, checkpoints), with three changes
(the placement and why every gradient is right: parallel/logical.py):
- the step's `shard_map` is manual over `data` and `fsdp` only: `tensor` is XLA's (partial-auto);
- the parameters are laid out from their logical axis names (`logical.lay_out`); a tensor-parallel
  leaf is gathered over `fsdp` and assembled whole, split on `tensor` (`LogicalTensorLayout.unshard`);
- the batch's rows lie on (`data`, `fsdp`); with a rule ('sequence', 'tensor'), each unit's float inputs
  and outputs (batch, sequence, ...) are constrained to lie split on `tensor` along the sequence
  (sequence parallelism between units; off by default: docs/tensor-parallel.md has what XLA makes of it).
Each (data, fsdp) program computes the loss of its rows whole, which stands for its T tensor ranks: the
loss is weighted by T (`loss_weight`) so that the engine's mean over all R·S·T devices, and its gradient
scale 1/(R·S·T), are the mean and the gradient of the mean.
"""
from __future__ import annotations

import jax
import numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from jfsdp.config.errors import ConfigError
from jfsdp.config.mesh import AXES, DATA_AXIS, FSDP_AXIS, TENSOR_AXIS
from jfsdp.engine.fsdp import unshard
from jfsdp.engine.parallel import logical

LATER = "is not supported for a model given as it is with tensor parallelism yet (docs/tensor-parallel.md)"


class TensorAsIs:
    """The T > 1 side of `AsIs` (a mixin: `AsIs(TensorAsIs, FSDP)`)."""
    loss_weight, sequence_parallel = 1, False

    def set_tensor(self, logical_rules, strategy, mp_policy):
        """Check what T > 1 supports, read the rules; at T = 1 only the rules' axes are checked."""
        self.logical_rules = logical.check_rules(logical_rules, self.mesh) if (
            logical_rules is not None or self.tensor > 1) else None
        if self.tensor == 1:
            return
        types = getattr(self.mesh, "axis_types", None) or ()
        if any(t != AxisType.Auto for t in types):
            raise ConfigError(f"tensor parallelism for a model given as it is needs a mesh whose axes are Auto (got "
                              f"{tuple(str(t) for t in types)}): build it with jfsdp.make_mesh(spec, tensor=T)")
        if not strategy.sharded:
            raise ConfigError(f"strategy no_shard {LATER}: use full_shard, shard_grad_op or hybrid_shard")
        if mp_policy.float8 is not None:
            raise ConfigError(f"float8 {LATER}")
        self.loss_weight = self.tensor
        self.sequence_parallel = (logical.SEQUENCE, TENSOR_AXIS) in self.logical_rules
        self.batch_spec, self.loss_axes = P(AXES), AXES
        self.batch_sharding = NamedSharding(self.mesh, self.batch_spec)

    def lay_out(self, full, sharded: bool):
        if self.tensor == 1:
            return super().lay_out(full, sharded)
        if self.scanned:
            raise ConfigError(f"a unit inside the model's own scan {LATER}: call the units from a Python loop")
        self.layouts, self.param_specs, self.param_shardings = logical.lay_out(
            full, self.names, self.logical_rules, self.shards, self.tensor, self.mesh)

    def gather_root(self, x, layout):
        """A root leaf gathered whole (a tensor-parallel one assembled split on `tensor`)."""
        return layout.unshard(x, self.comm) if hasattr(layout, "unshard") else unshard(x, layout, self.comm)

    def sequence_split(self, tree):
        """Sequence parallelism at a unit's boundary, where a rule maps 'sequence' to `tensor`."""
        if self.tensor == 1 or not self.sequence_parallel:
            return tree
        return jax.tree.map(lambda x: logical.sequence_split(x, self.tensor), tree)

    def shard_map(self, f, in_specs, out_specs):
        if self.tensor == 1:
            return super().shard_map(f, in_specs, out_specs)
        return jax.shard_map(f, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs,
                             axis_names={DATA_AXIS, FSDP_AXIS}, check_vma=False)

    def _check_rows(self, tree, grad_accum=1):
        if self.tensor == 1:
            return super()._check_rows(tree, grad_accum)
        rows = self.n_devices // self.tensor   # the rows lie on data x fsdp; XLA splits the rest over tensor
        for x in jax.tree.leaves(tree):
            if not np.ndim(x):
                raise ConfigError(f"every batch leaf needs a leading batch axis, got a scalar ({x!r})")
            b = np.shape(x)[0]
            if b % rows or (b // rows) % grad_accum:
                raise ConfigError(f"batch size {b} does not divide over the {rows} (data x fsdp) devices of the mesh"
                                  + (f" into {grad_accum} micro-batches each" if grad_accum > 1 else ""))

    def loss_and_grad(self, loss_fn, grad_accum: int = 1, grad_sync: str = "every", trainable=None, metrics=None):
        if self.tensor > 1 and grad_sync == "once" and grad_accum > 1:
            raise ConfigError(f"grad_sync='once' {LATER}: use grad_sync='every'")
        return super().loss_and_grad(loss_fn, grad_accum, grad_sync, trainable, metrics)
