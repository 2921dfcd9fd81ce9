"""The FSDP engine: the model as units and its parameter layout (layout.py, params.py), the plain path of
gather, compute, free, reduce-scatter (fsdp.py: read this first), the prefetch pipeline (pipeline.py),
Mixture-of-Experts stages (moe.py, expert_parallel.py), and the object `fully_shard` returns (sharded.py)."""
