"""The training step on top of the engine: the optimizer (optim.py), the jitted step (step.py), the
optimizer applied inside the backward pass (update_in_backward.py) and the fused head + loss (losses.py)."""
