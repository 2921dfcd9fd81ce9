"""`make_train_step(update_in_backward=True)`: the optimizer applied to each unit inside the backward
pass gives the single-device reference's training (clipped and unclipped, one and several stages,
sharded and replicated), refuses what it cannot do, and needs less memory than the usual step where
the units' gradient is what it saves."""
import json
import os
import subprocess
import sys

import jax
import numpy as np
import optax
import pytest

import jfsdp

import jfsdp.train.step
import models
from jfsdp.config.xla_flags import cpu_xla_flags
from tests import reference as ref
from tests import test_equivalence as te
from tests import test_stages as ts
from tests.compile_flags import FAST


def _steps(plan, opt, loss_fn, params, batches, in_backward):
    """Run the batches; `in_backward` is a list of booleans, one per step (the two kinds of step share
    one state layout, so a run may switch)."""
    state = jfsdp.init_state(plan, opt, params=params)
    steps = {ib: jfsdp.make_train_step(plan, opt, loss_fn, update_in_backward=ib) for ib in set(in_backward)}
    losses, norms = [], []
    for ib, b in zip(in_backward, batches):
        state, m = steps[ib](state, plan.put_batch(b))
        losses.append(float(m["loss"]))
        norms.append(float(m["grad_norm"]))
    return state, losses, norms


@pytest.mark.parametrize("family,mesh_spec,strategy,remat", [("llama", "2x8", "full_shard", "full"),
                                                             ("resmlp", "4x4", "no_shard", "full"),
                                                             ("llama", "2x8", "shard_grad_op", "dots")])
def test_clipped_adamw_matches_single_device(family, mesh_spec, strategy, remat):
    """Three clipped AdamW steps (every step's norm is above the clip, so the two-pass path runs):
    losses within 1e-5, first-step gradient norm within 1e-5 of the reference's, parameters within
    1e-4 of each leaf's largest plus ref.PARAM_ATOL (docs/numerics.md). Under remat dots the backward
    loop rebuilds each unit's VJP from what the policy saved; under ZeRO-2 from the kept gathered unit."""
    case = te.get_case(family)
    r, s = jfsdp.parse_mesh(mesh_spec)
    mesh = jfsdp.make_mesh(mesh_spec, devices=jax.devices()[: r * s])
    plan = jfsdp.fully_shard(jfsdp.Stacked(case["root"], case["unit"], case["n"]), mesh, case["batches"][0]["inputs"],
                             strategy=strategy, remat=remat)
    opt = jfsdp.adamw(ref.LR, b1=ref.B1, b2=ref.B2, eps=ref.EPS, weight_decay=ref.WD, clip_norm=ref.CLIP,
                      mask=plan.decay_mask())
    state, losses, norms = _steps(plan, opt, models.loss_fn(case["cfg"]), plan.shard(case["init"]), case["batches"],
                                  [True] * len(case["batches"]))
    np.testing.assert_allclose(losses, case["ref_losses"], rtol=1e-5)
    want_norm = optax.tree.norm(te.reference_grads(case))   # of jax.grad of the single-device loss
    assert min(norms) > ref.CLIP, "the clip must act for this test to cover the two-pass path"
    np.testing.assert_allclose(norms[0], want_norm, rtol=1e-5)
    ref.assert_params_close(plan.gather(state.params), case["ref_final"], case["init"], 1e-4)


def test_unclipped_staged_model_matches_single_device_and_switches_with_the_usual_step():
    """Three stages (2 MLP units, one unit that narrows the width, 2 GLU units), no clipping (one
    pass), sharded on 1x8: step 1 is the usual step, steps 2-3 update in the backward pass; the result
    is the reference's (AdamW without clipping, default decay mask)."""
    stages = ts.NARROWING
    root, batches = ts.Root(), ts._batches()
    with jax.default_device(jax.devices()[0]):
        params = ref.init_staged(root, stages, batches[0]["inputs"])
        mask = lambda p: {"root": jax.tree.map(lambda x: x.ndim >= 2, p["root"]),
                          "stages": [jax.tree.map(lambda x: x.ndim >= 3, u) for u in p["stages"]]}
        loss = lambda p, b: ts.lm_loss(ref.forward_staged(root, [u for u, _ in stages], p, b["inputs"]), b)
        want_losses, want, _ = ref.run_steps(optax.adamw(ref.LR, b1=ref.B1, b2=ref.B2, eps=ref.EPS, weight_decay=ref.WD,
                                                         mask=mask), loss, params, batches)
    plan = ts._plan(stages, "1x8", "full_shard", "full")
    opt = jfsdp.adamw(ref.LR, b1=ref.B1, b2=ref.B2, eps=ref.EPS, weight_decay=ref.WD, clip_norm=None)
    state, losses, _ = _steps(plan, opt, ts.lm_loss, jax.device_get(params), batches, [False, True, True])
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    ref.close(plan.gather(state.params), jax.device_get(want), 1e-4, "param", ref.PARAM_ATOL)


def test_refuses_what_it_cannot_do():
    case = te.get_case("llama")
    x = case["batches"][0]["inputs"]
    model = jfsdp.Stacked(case["root"], case["unit"], case["n"])
    mesh = jfsdp.make_mesh("1x4", devices=jax.devices()[:4])
    loss = models.loss_fn(case["cfg"])
    full = jfsdp.fully_shard(model, mesh, x, remat="full")
    with pytest.raises(jfsdp.ConfigError, match="micro-batches"):
        jfsdp.make_train_step(full, jfsdp.adamw(1e-3), loss, grad_accum=2, update_in_backward=True)
    # a global clip inside an optax chain would see one unit at a time: refused, not run
    for tx in (optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3)), optax.lamb(1e-3)):
        with pytest.raises(jfsdp.ConfigError, match="elementwise"):
            jfsdp.make_train_step(full, tx, loss, update_in_backward=True)


_PEAKS = """
import dataclasses, json, jax, jax.numpy as jnp, numpy as np
import jfsdp, models
from jfsdp.planning import memory
from models.factory import language_model
cfg = dataclasses.replace(models.get_config("llama-small"), n_layers=16)
model, _, loss_fn = language_model(cfg, "fused")
x = jax.ShapeDtypeStruct((1, 64), jnp.int32)
plan = jfsdp.fully_shard(model, jfsdp.make_mesh("1x1"), x, remat="full")
opt = jfsdp.adamw(1e-3, mask=plan.decay_mask())
peak = lambda ib: memory.measure(memory.compile_step(plan, opt, loss_fn, {"inputs": x, "targets": x},
                                                     update_in_backward=ib))["total"]
units = sum(int(np.prod(l.shape)) * 4 for l in jax.tree.leaves(plan.abstract_params()["units"]))
est = memory.estimate(plan, opt, loss_fn, {"inputs": x, "targets": x}, backend="cpu", update_in_backward=True)
print(json.dumps({"usual": peak(False), "in_backward": peak(True), "unit_grads": units, "estimate": est.total}))
"""


def test_peak_below_the_usual_step_by_most_of_a_gradient():
    """XLA's compiled peak on one device (XLA:CPU with jfsdp.config.xla_flags.CPU_FLAGS, as train.py and the
    benchmarks run; a process of its own, since XLA:CPU reads that flag from XLA_FLAGS only), the
    usual step against this one, both donated, for a model whose units' gradient outweighs its
    activations (llama-small's layers, 16 of them, at 64 tokens). Updating in the backward pass never holds the
    units' whole gradient: the peak falls by at least half of it (the rest: one leaf's rows in flight,
    the root's gradient, the two-pass clip). The planner's estimate of it is within 10%."""
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=cpu_xla_flags("--xla_force_host_platform_device_count=1 " + FAST))
    out = subprocess.run([sys.executable, "-c", _PEAKS], env=env, capture_output=True, text=True, timeout=600,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.returncode == 0, out.stderr[-2000:]
    m = json.loads(out.stdout.strip().splitlines()[-1])
    assert m["usual"] - m["in_backward"] >= 0.5 * m["unit_grads"], m
    # the planner's estimate of this step (memory.estimate(update_in_backward=True)) within 10%
    assert abs(m["estimate"] / m["in_backward"] - 1) < 0.10, m


@pytest.mark.parametrize("mesh_spec,strategy,remat", [("2x4", "full_shard", "full"), ("2x4", "full_shard", "dots"),
                                                      ("1x8", "full_shard", "none"), ("2x4", "shard_grad_op", "dots")])
def test_prefetch_pipeline_matches_single_device(mesh_spec, strategy, remat):
    """The prefetch pipeline's own VJP (the usual step over `_stage_passes`, which the in-backward
    step shares; on by default on GPUs only) on CPU devices, under every remat policy (each unit's VJP
    residuals saved as the policy says, the gathered unit regathered) and ZeRO-2 (the gathered unit
    saved): the reference's first-step gradients (within 1e-5 of each leaf's largest: clipped AdamW's
    parameters would not see a constant scale on every gradient), losses and parameters."""
    case = te.get_case("llama")
    r, s = jfsdp.parse_mesh(mesh_spec)
    mesh = jfsdp.make_mesh(mesh_spec, devices=jax.devices()[: r * s])
    plan = jfsdp.fully_shard(jfsdp.Stacked(case["root"], case["unit"], case["n"]), mesh, case["batches"][0]["inputs"],
                             strategy=strategy, remat=remat, prefetch=True)
    assert plan.prefetch
    adamw = jfsdp.adamw(ref.LR, b1=ref.B1, b2=ref.B2, eps=ref.EPS, weight_decay=ref.WD, clip_norm=ref.CLIP,
                        mask=plan.decay_mask())
    opt = optax.chain(ref.keep_gradients(), adamw)   # the step's own first gradients, in the same program
    state, losses, _ = _steps(plan, opt, models.loss_fn(case["cfg"]), plan.shard(case["init"]), case["batches"],
                              [False] * len(case["batches"]))
    ref.close(plan.gather(state.opt_state[0][0]), te.reference_grads(case), 1e-5, "grad")
    np.testing.assert_allclose(losses, case["ref_losses"], rtol=1e-5)
    ref.assert_params_close(plan.gather(state.params), case["ref_final"], case["init"], 1e-4)
