"""A plain single-device trainer written without jfsdp: the reference the engine must match.

It uses only the model modules, jax.grad and optax: embed, a Python loop over the units, head,
loss; global-norm clipping and AdamW on whole parameters. Mixed precision is modelled the obvious
way: parameters cast to param_dtype for the forward pass, the output cast to output_dtype, gradients
taken with respect to the fp32 parameters.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

# Adam's eps is 1e-6, not 1e-8: an element whose gradient is below eps gets an update of about
# lr * g / eps, so eps = 1e-8 turns the float noise of a summation order (1e-7 of the leaf's largest
# gradient, measured) into parameter differences above 1e-4. Gradients themselves are compared
# directly in test_gradients_match.
LR, B1, B2, EPS, WD, CLIP = 3e-3, 0.9, 0.95, 1e-6, 0.1, 1.0


def init_params(root, unit, n_units, inputs, seed=0):
    """Independent initialization: root and each unit from their own keys, units stacked on axis 0."""
    keys = jax.random.split(jax.random.key(seed), n_units + 1)
    root_p = root.init(keys[0], inputs, method=lambda m, x: m.head(m.embed(x)))["params"]
    h = root.apply({"params": root_p}, inputs, method="embed")
    units = [unit.init(k, h)["params"] for k in keys[1:]]
    return {"root": root_p, "units": jax.tree.map(lambda *xs: jnp.stack(xs), *units)}


def optimizer():
    # decay matrices only: ndim >= 2 per unit (stacked unit leaves carry one more axis)
    mask = lambda p: {"root": jax.tree.map(lambda x: x.ndim >= 2, p["root"]),
                      "units": jax.tree.map(lambda x: x.ndim >= 3, p["units"])}
    return optax.chain(optax.clip_by_global_norm(CLIP), optax.adamw(LR, b1=B1, b2=B2, eps=EPS, weight_decay=WD, mask=mask))


def forward(root, unit, params, inputs, param_dtype=None, output_dtype=None):
    p = jax.tree.map(lambda x: x.astype(param_dtype), params) if param_dtype else params
    h = root.apply({"params": p["root"]}, inputs, method="embed")
    n = jax.tree.leaves(p["units"])[0].shape[0]
    for i in range(n):
        h = unit.apply({"params": jax.tree.map(lambda x: x[i], p["units"])}, h)
    out = root.apply({"params": p["root"]}, h, method="head")
    return out.astype(output_dtype) if output_dtype else out


def train(root, unit, loss_fn, params, batches, param_dtype=None, output_dtype=None):
    """Steps of AdamW on one device; returns (losses, final params)."""
    opt = optimizer()
    state = opt.init(params)

    @jax.jit
    def step(params, state, batch):
        f = lambda p: loss_fn(forward(root, unit, p, batch["inputs"], param_dtype, output_dtype), batch)
        loss, grads = jax.value_and_grad(f)(params)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    losses = []
    for batch in batches:
        params, state, loss = step(params, state, batch)
        losses.append(float(loss))
    return losses, params
