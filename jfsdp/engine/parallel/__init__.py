"""Tensor parallelism with sequence parallelism (Megatron-SP) inside the FSDP engine, on a third mesh axis
`tensor` (docs/tensor-parallel.md): which parameters are tensor-parallel (plan.py: path regex -> colwise /
rowwise / replicate), where every parameter lies on the mesh (layout.py: the placement rule), and the
collectives over `tensor` around the unit's matmuls (tensor.py)."""
