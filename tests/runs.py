"""The engine's side of the float8 comparisons (tests/test_float8.py, tests/test_float8_rowwise.py): a plan's
first-step gradients and a few clipped AdamW steps with the constants of the single-device reference
(tests/reference.py)."""
import jax
import jax.numpy as jnp

import jfsdp
from tests import reference as ref


def stacked_plan(case, mesh_spec, strategy, remat, mp):
    """A float8 case's Stacked model (case: root, unit, n, batches) on the first devices of `mesh_spec`."""
    r, s = jfsdp.parse_mesh(mesh_spec)
    mesh = jfsdp.make_mesh(mesh_spec, devices=jax.devices()[:r * s])
    return jfsdp.fully_shard(jfsdp.Stacked(case["root"], case["unit"], case["n"]), mesh, case["batches"][0]["inputs"],
                             strategy=strategy, remat=remat, mp_policy=mp)


def float8_run(plan, loss_fn, init, batches, steps):
    """jfsdp's gradients on batches[0], then `steps` clipped AdamW steps (the reference's constants) ->
    (losses, gathered gradients, gathered final parameters or None when steps is 0)."""
    loss, grads = jax.jit(plan.loss_and_grad(loss_fn))(plan.shard(init), jax.device_put(batches[0], plan.batch_sharding))
    if not steps:
        return [float(loss)], plan.gather(grads), None
    opt = jfsdp.adamw(ref.LR, b1=ref.B1, b2=ref.B2, eps=ref.EPS, weight_decay=ref.WD, clip_norm=ref.CLIP, mask=plan.decay_mask())
    state = jfsdp.init_state(plan, opt, params=plan.shard(init))
    step = jfsdp.make_train_step(plan, opt, loss_fn)
    losses = []
    for b in batches[:steps]:
        state, m = step(state, jax.device_put(b, plan.batch_sharding))
        losses.append(float(m["loss"]))
    return losses, plan.gather(grads), plan.gather(state.params)


def bf16_rest_run(case, loss_fn, ref_forward, devices, mp):
    """A float8 case's first loss and gradients with the rest of the model in bf16, on 1x`devices`, against
    the single-device reference `ref_forward` (root, unit, params, inputs, dtype) run one device's rows at
    a time (so each float8 cast sees that device's amax); both compiled with every bf16 rounding kept
    (reference.run_exact) -> (got loss, want loss, gathered gradients, reference gradients)."""
    batch = case["batches"][0]
    rows_per = batch["inputs"].shape[0] // devices

    def loss(p, b):
        rows = [jax.tree.map(lambda x: x[i * rows_per:(i + 1) * rows_per], b) for i in range(devices)]
        return sum(loss_fn(ref_forward(case["root"], case["unit"], p, r["inputs"], jnp.bfloat16), r)
                   for r in rows) / devices
    with jax.default_device(jax.devices()[0]):
        want_loss, want = ref.run_exact(jax.value_and_grad(loss), case["init"], batch)
    plan = stacked_plan(case, f"1x{devices}", "full_shard", "none", mp)
    got_loss, got = ref.run_exact(plan.loss_and_grad(loss_fn), plan.shard(case["init"]),
                                  jax.device_put(batch, plan.batch_sharding))
    return got_loss, want_loss, plan.gather(got), want
