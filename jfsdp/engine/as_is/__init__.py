"""A Flax model given as it is (Linen or NNX): FSDP units named by class or path, the model's own code.

`AsIs` is the same engine as `FSDP` (it is one: the strategies, mixed precision, the loss contract,
gradient accumulation, `loss_and_grad` and `loss` are FSDP's), with a different way to describe the
model. Its parameters are the model's own tree, every leaf split by rows over the `fsdp` axis
(`Layout`), none stacked (params.py). While the model's code runs (model.py; the model itself behind
jfsdp/engine/flax_models.py), each call of a unit instance goes to `call_unit` (jfsdp/engine/unit_call.py):
gathered just before, freed after, re-gathered in the backward pass, its gradient reduce-scattered. Every other parameter belongs to the root, gathered once per step
and reduced once, like the root of a `Stacked` model. With prefetch (GPUs' default) a model's own Python loop
prefetches in call order (jfsdp/engine/call_order.py) and its own scan runs as a stage of the prefetch
pipeline (own_scan.py).

Random numbers: each step draws from `fold_in(seed, step)`, then per device and micro-batch (a batch
row index), then per unit (Linen folds in the module path; NNX modules carry their own streams).
A run is deterministic for a seed, a mesh and `grad_accum`; on another mesh the dropout masks differ.
"""
from jfsdp.engine.as_is.model import RNG_ROWS, AsIs

__all__ = ["AsIs", "RNG_ROWS"]
