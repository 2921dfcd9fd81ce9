"""The engine's side of the float8 comparisons (tests/test_float8.py, tests/test_float8_rowwise.py): a plan's
first-step gradients and a few clipped AdamW steps with the constants of the single-device reference
(tests/reference.py); the figures every float8 test bounds (also tests/test_float8_any_model.py), and the
check that the other recipe's reference is out of those bounds (benchmarks/float8_floor.py sweeps them)."""
import jax
import jax.numpy as jnp
import numpy as np
import optax

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
    (losses, gathered gradients, gathered final parameters or None when steps is 0). With steps, the
    first-step gradients are the train step's own, kept by ref.keep_gradients (one program, not a
    loss_and_grad program beside the step); without, loss_and_grad's."""
    if not steps:
        loss, grads = jax.jit(plan.loss_and_grad(loss_fn))(plan.shard(init),
                                                           jax.device_put(batches[0], plan.batch_sharding))
        return [float(loss)], plan.gather(grads), None
    adamw = jfsdp.adamw(ref.LR, b1=ref.B1, b2=ref.B2, eps=ref.EPS, weight_decay=ref.WD, clip_norm=ref.CLIP,
                        mask=plan.decay_mask())
    opt = optax.chain(ref.keep_gradients(), adamw)
    state = jfsdp.init_state(plan, opt, params=plan.shard(init))
    step = jfsdp.make_train_step(plan, opt, loss_fn)
    losses = []
    for b in batches[:steps]:
        state, m = step(state, jax.device_put(b, plan.batch_sharding))
        losses.append(float(m["loss"]))
    return losses, plan.gather(state.opt_state[0][0]), plan.gather(state.params)


def bf16_rest_run(case, loss_fn, ref_forward, devices, mp):
    """A float8 case's first loss and gradients with the rest of the model in bf16, on 1x`devices`, against
    the single-device reference `ref_forward` (root, unit, params, inputs, dtype) run one device's rows at
    a time (so each float8 cast sees that device's amax); both compiled with every bf16 rounding kept
    (reference.run_exact) -> (got loss, want loss, gathered gradients, reference gradients)."""
    batch = case["batches"][0]

    def loss(p, b):
        return rows_of_each(devices, lambda r: loss_fn(ref_forward(case["root"], case["unit"], p, r["inputs"], jnp.bfloat16), r), b)
    with jax.default_device(jax.devices()[0]):
        want_loss, want = ref.run_exact(jax.value_and_grad(loss), case["init"], batch)
    plan = stacked_plan(case, f"1x{devices}", "full_shard", "none", mp)
    got_loss, got = ref.run_exact(plan.loss_and_grad(loss_fn), plan.shard(case["init"]),
                                  jax.device_put(batch, plan.batch_sharding))
    return got_loss, want_loss, plan.gather(got), want


def rows_of(devices, loss, b):
    """The mean of `loss(rows)` over `devices` devices' rows, each computed alone (vmapped over the
    devices: one copy of the model in the program): an activation's (and a gradient's) scale is its
    own device's amax, as in torchtitan's tensorwise recipe (no cross-device amax but the weights').
    For a model in fp32: with parameters cast to bf16 inside `loss`, vmap sums the devices' parameter
    cotangents in bf16 (`rows_of_each` does not)."""
    split = jax.tree.map(lambda x: x.reshape(devices, x.shape[0] // devices, *x.shape[1:]), b)
    return jnp.mean(jax.vmap(loss)(split))


def rows_of_each(devices, loss, b):
    """`rows_of` with one copy of the model per device (their parameter cotangents summed in fp32 after
    each device's bf16 cast is transposed, as the engine does): the bf16-rest references."""
    per = jax.tree.leaves(b)[0].shape[0] // devices
    return sum(loss(jax.tree.map(lambda x: x[i * per:(i + 1) * per], b)) for i in range(devices)) / devices


def first_step_others(root, unit, lf, params, batch, other, devices):
    """The first loss and gradients without float8 (`plain`) and in the `other` recipe's matmul for every
    unit Dense (`other`, `other_loss`), the rest in fp32, in one program."""
    def both(p, b):
        plain = jax.grad(lambda p: lf(ref.forward(root, unit, p, b["inputs"]), b))(p)
        mine = ref.float8_dense(lambda path: True, other)
        value, grads = jax.value_and_grad(lambda p: rows_of(devices,
            lambda r: lf(ref.forward(root, unit, p, r["inputs"], unit_interceptor=mine), r), b))(p)
        return dict(plain=plain, other=grads, other_loss=value)
    return jax.device_get(jax.jit(both)(params, batch))


def figures(got, want, conv=lambda t: t, init=None):
    """The engine's run `got` (losses, first-step gradients, final parameters) against the reference's:
    `grad`, the largest per-leaf L2 error of the first-step gradients against the same recipe's reference
    (`leaf` names that leaf); `other` and `plain`, the same against the other recipe's reference and the
    trainer without float8 (what a swapped recipe or float8 off would give); `loss0` and `loss`, the
    relative error of the first loss and the largest over the steps; `other_loss0`, the first loss against
    the other recipe's; `update` (with `init`), the largest per-leaf L2 error of final - init."""
    losses, grads, final = got
    errs = ref.leaf_errors(grads, conv(want["grads"]))
    rel = lambda a, b: abs(a - b) / abs(b)
    out = dict(grad=max(errs.values()), leaf=max(errs, key=errs.get), grad_all=ref.total_error(grads, conv(want["grads"])),
               other=max(ref.leaf_errors(grads, conv(want["other"])).values()),
               other_all=ref.total_error(grads, conv(want["other"])),
               plain=max(ref.leaf_errors(grads, conv(want["plain"])).values()),
               plain_all=ref.total_error(grads, conv(want["plain"])),
               loss0=rel(losses[0], want["losses"][0]),
               loss=max(rel(a, b) for a, b in zip(losses, want["losses"][:len(losses)], strict=True)),
               other_loss0=rel(losses[0], want["other_loss"]))
    if init is not None and final is not None:
        delta = lambda a, b: np.asarray(a, np.float64) - np.asarray(b, np.float64)
        out["update"] = max(ref.leaf_errors(jax.tree.map(delta, final, conv(init)),
                                            jax.tree.map(delta, conv(want["final"]), conv(init))).values())
    return {k: v if isinstance(v, str) else float(v) for k, v in out.items()}


SEPARATION = 2   # the other recipe's reference, and the trainer without float8, at least this many bounds away


def check(m, bounds):
    """`figures` within `bounds` (grad, grad_all, loss0, loss, and update where given), and the other
    recipe's reference and the trainer without float8 further than SEPARATION x the bound on the gradients
    over all leaves (`grad_all`): a run that swapped the recipes or left float8 off would fail. The
    per-leaf bound `grad` is looser (a small leaf such as a norm scale moves most when a float8 rounding
    flips, docs/numerics.md) and separates nothing."""
    for k, b in bounds.items():
        assert m[k] <= b, (k, b, m)
    assert m["other_all"] > SEPARATION * bounds["grad_all"], m
    assert m["plain_all"] > SEPARATION * bounds["grad_all"], m
