"""Every strategy on every mesh gives the single-device reference's losses and parameters."""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jfsdp
import models
from tests import reference as ref

MESHES = ["1x16", "2x8", "4x4", "16x1", "1x1"]
# hybrid_shard and hybrid_shard_zero2 are full_shard and shard_grad_op by another name (the mesh's data
# axis makes any sharded strategy hybrid): test_hybrid_names_are_the_same_programs shows that they
# lower to the same program on a hybrid mesh, so the grid runs the three distinct strategies.
STRATEGIES = ["full_shard", "shard_grad_op", "no_shard"]
REMATS = ["none", "full", "dots"]
STEPS, BATCH, SEQ = 3, 16, 16

# The test Llama: hidden 96 with GQA, ffn 200 and vocab 259 (padded on 16 and 4x4's 4 shards... and
# 259 on every shard count), tied embeddings. The second family: a residual MLP classifier with
# input width 37 and 11 classes.
LLAMA = models.get_config("llama-test")
RESMLP = models.get_config("resmlp-test")


def _batches(cfg, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(STEPS):
        if isinstance(cfg, models.LlamaConfig):
            tok = rng.integers(0, cfg.vocab_size, (BATCH, SEQ + 1))
            out.append({"inputs": jnp.asarray(tok[:, :-1], jnp.int32), "targets": jnp.asarray(tok[:, 1:], jnp.int32)})
        else:
            x = rng.normal(size=(BATCH, cfg.in_dim)).astype(np.float32)
            out.append({"inputs": jnp.asarray(x), "targets": jnp.asarray(rng.integers(0, cfg.n_classes, BATCH), jnp.int32)})
    return out


_CASES = {}


def get_case(family):
    """The family's model, batches, initial parameters and single-device reference, built once."""
    if family not in _CASES:
        _CASES[family] = _make_case(LLAMA if family == "llama" else RESMLP)
    return _CASES[family]


@pytest.fixture(params=["llama", "resmlp"])
def case(request):
    return get_case(request.param)


def _make_case(cfg):
    root, unit, n = models.parts(cfg)
    batches = _batches(cfg)
    with jax.default_device(jax.devices()[0]):
        params = ref.init_params(root, unit, n, batches[0]["inputs"])
        # ref.train's AdamW steps; its first-step gradients are reference_grads'
        loss = lambda p, b: models.loss_fn(cfg)(ref.forward(root, unit, p, b["inputs"]), b)
        losses, final, first = ref.run_steps(ref.optimizer(), loss, params, batches)
    return dict(cfg=cfg, root=root, unit=unit, n=n, batches=batches, init=jax.device_get(params),
                ref_losses=losses, ref_final=jax.device_get(final), cache={"grads": jax.device_get(first)})


def reference_once(case, name, compute):
    """A reference result that depends on the case only (not on the mesh or strategy): computed by
    the first test that needs it, on one device, and kept for the others."""
    if name not in case["cache"]:
        with jax.default_device(jax.devices()[0]):
            case["cache"][name] = jax.device_get(compute())
    return case["cache"][name]


def reference_grads(case):
    """jax.grad of the single-device loss on the first batch, at the initial parameters (the reference
    run's first step computed them: `_make_case`)."""
    return case["cache"]["grads"]


def run_jfsdp(case, mesh_spec, strategy, remat="none", mp=None, grad_accum=1):
    n_dev = jfsdp.parse_mesh(mesh_spec)[0] * jfsdp.parse_mesh(mesh_spec)[1]
    mesh = jfsdp.make_mesh(mesh_spec, devices=jax.devices()[:n_dev])
    model = jfsdp.Stacked(case["root"], case["unit"], case["n"])
    plan = jfsdp.fully_shard(model, mesh, case["batches"][0]["inputs"], strategy=strategy, remat=remat, mp_policy=mp)
    opt = jfsdp.adamw(ref.LR, b1=ref.B1, b2=ref.B2, eps=ref.EPS, weight_decay=ref.WD, clip_norm=ref.CLIP, mask=plan.decay_mask())
    state = jfsdp.init_state(plan, opt, params=plan.shard(case["init"]))
    step = jfsdp.make_train_step(plan, opt, models.loss_fn(case["cfg"]), grad_accum=grad_accum)
    losses = []
    for b in case["batches"]:
        state, m = step(state, jax.device_put(b, plan.batch_sharding))
        losses.append(float(m["loss"]))
    return plan, state, losses


# Llama on every mesh with every strategy; the residual MLP (the second family: other shapes and
# paddings, biases) on every mesh once, with the strategies in turn (so every strategy and every
# remat at least once): the mesh x strategy grid is the Llama's.
GRID = ([("llama", m, s) for m in MESHES for s in STRATEGIES]
        + [("resmlp", m, STRATEGIES[i % len(STRATEGIES)]) for i, m in enumerate(MESHES)])


@pytest.mark.parametrize("family,mesh_spec,strategy", GRID)
def test_matches_single_device_fp32(family, mesh_spec, strategy):
    case = get_case(family)
    remat = REMATS[(MESHES.index(mesh_spec) + STRATEGIES.index(strategy)) % len(REMATS)]
    plan, state, losses = run_jfsdp(case, mesh_spec, strategy, remat)
    np.testing.assert_allclose(losses, case["ref_losses"], rtol=1e-5)
    ref.assert_params_close(plan.gather(state.params), case["ref_final"], case["init"], rtol=1e-4)


def test_hybrid_names_are_the_same_programs():
    """The train step of hybrid_shard (hybrid_shard_zero2) lowers to exactly the program of full_shard
    (shard_grad_op) on a 2x8 mesh: what the grid checks for one holds for the other. (Remat and the
    strategy meet only through `reshard_after_forward`, equal within each pair.)"""
    root, unit, n = models.parts(LLAMA)
    tok = jax.ShapeDtypeStruct((BATCH, SEQ), jnp.int32)
    mesh = jfsdp.make_mesh("2x8")

    def lowered(strategy, remat):
        plan = jfsdp.fully_shard(jfsdp.Stacked(root, unit, n), mesh, tok, strategy=strategy, remat=remat)
        opt = jfsdp.adamw(ref.LR, mask=plan.decay_mask())
        batch = {k: jax.ShapeDtypeStruct((BATCH, SEQ), jnp.int32, sharding=plan.batch_sharding)
                 for k in ("inputs", "targets")}
        step = jfsdp.make_train_step(plan, opt, models.loss_fn(LLAMA))
        return step.lower(jfsdp.abstract_state(plan, opt), batch).as_text()

    programs = {}
    for hybrid, plain in [("hybrid_shard", "full_shard"), ("hybrid_shard_zero2", "shard_grad_op")]:
        h, p = jfsdp.Strategy.parse(hybrid), jfsdp.Strategy.parse(plain)
        assert (h.sharded, h.reshard_after_forward) == (p.sharded, p.reshard_after_forward)
        programs[plain] = lowered(plain, "full")
        assert lowered(hybrid, "full") == programs[plain], hybrid
    assert programs["full_shard"] != programs["shard_grad_op"]   # the comparison can tell them apart


@pytest.mark.parametrize("mesh_spec,strategy", [("1x16", "full_shard"), ("2x8", "hybrid_shard"), ("4x4", "no_shard")])
def test_gradients_match(case, mesh_spec, strategy):
    """The sharded gradients, gathered, equal jax.grad of the single-device loss (before any optimizer)."""
    mesh = jfsdp.make_mesh(mesh_spec)
    root, unit, lf, b = case["root"], case["unit"], models.loss_fn(case["cfg"]), case["batches"][0]
    plan = jfsdp.fully_shard(jfsdp.Stacked(root, unit, case["n"]), mesh, b["inputs"], strategy=strategy, remat="full")
    want = reference_grads(case)
    loss, grads = jax.jit(plan.loss_and_grad(lf))(plan.shard(case["init"]), jax.device_put(b, plan.batch_sharding))
    np.testing.assert_allclose(float(loss), case["ref_losses"][0], rtol=1e-5)
    ref.close(plan.gather(grads), want, 1e-5, "grad")


@pytest.mark.parametrize("mesh_spec,strategy", [("2x4", "full_shard"), ("1x8", "shard_grad_op")])
def test_gradient_accumulation_matches(case, mesh_spec, strategy):
    """Two micro-batches per device (8 devices, 2 sequences each) give the gradient of the whole batch."""
    plan, state, losses = run_jfsdp(case, mesh_spec, strategy, "full", grad_accum=2)
    np.testing.assert_allclose(losses, case["ref_losses"], rtol=1e-5)
    ref.assert_params_close(plan.gather(state.params), case["ref_final"], case["init"], rtol=1e-4)


# bf16 parameters and compute, fp32 reduction and loss. Both sides round the same fp32 parameters to
# bf16, but the sharded run sums gradients in another order and its bf16 matmuls see other tilings,
# so the two agree to bf16's resolution (8 mantissa bits: 2^-8 ~ 0.4% per rounding), not exactly.
# The noise floor, the bf16 reference against itself with the batch in 2 to 16 micro-batches (natively
# and under --xla_cpu_max_isa=SSE4_2, docs/numerics.md): losses within 1.1e-4 relative, the parameter
# updates (final - initial) within 5.7% in L2 per leaf (resmlp's biases and norm scales: Adam turns
# small bf16 gradient differences into sign-sized update differences on elements whose gradient is
# near zero). Tolerances 3.5x or more above it: losses 1e-3 relative, updates 20% in L2 per leaf; a
# missing data-axis reduce lands 5x above both. Those cannot tell bf16 compute from fp32; the model's
# outputs can (reference.assert_bf16_outputs: a forward pass from the same parameters, elementwise,
# where bf16's rounding of every matmul shows and the gradient sums' order does not), and the compiled program
# shows the unit's dots in bf16 (test_collectives.py, test_gpu_target.py). resmlp-test takes float
# inputs, so its Dense layers promote bf16 weights to the fp32 input's dtype: under the policy it
# computes in fp32 on bf16-rounded weights, in the reference as in the engine.
BF16_LOSS_RTOL, BF16_UPDATE_RTOL = 1e-3, 0.20


@pytest.mark.parametrize("mesh_spec,strategy", [("2x8", "full_shard"), ("1x16", "shard_grad_op"), ("4x4", "no_shard")])
def test_bf16_policy_matches_single_device_bf16(case, mesh_spec, strategy):
    losses_ref, final_ref = reference_once(case, "bf16", lambda: ref.train(
        case["root"], case["unit"], models.loss_fn(case["cfg"]), case["init"], case["batches"],
        param_dtype=jnp.bfloat16, output_dtype=jnp.float32))
    plan, state, losses = run_jfsdp(case, mesh_spec, strategy, "full", mp=jfsdp.MixedPrecision.parse("bf16"))
    x = case["batches"][0]["inputs"]
    fwd = lambda *dt: lambda: ref.run_exact(lambda p: ref.forward(case["root"], case["unit"], p, x, *dt), case["init"])
    outs = [reference_once(case, "out-bf16", fwd(jnp.bfloat16, jnp.float32)), reference_once(case, "out-fp32", fwd())]
    got = ref.run_exact(plan.apply, plan.shard(case["init"]), jax.device_put(x, plan.batch_sharding))
    ref.assert_bf16_outputs(got, *outs, case["cfg"].__class__.__name__)
    np.testing.assert_allclose(losses, losses_ref, rtol=BF16_LOSS_RTOL)
    got, want = plan.gather(state.params), jax.device_get(final_ref)
    ref.assert_updates_close(got, want, case["init"], BF16_UPDATE_RTOL)


@functools.lru_cache(maxsize=None)
def first_step_reference(cfg):
    """(initial parameters, loss, jax.grad of the single-device loss) on cfg's first batch: the llama case's
    (its reference run's first step) for LLAMA itself, else computed here once per config."""
    if cfg == LLAMA:
        case = get_case("llama")
        return case["init"], case["ref_losses"][0], reference_grads(case)
    root, unit, n = models.parts(cfg)
    b, lf = _batches(cfg)[0], models.loss_fn(cfg)
    with jax.default_device(jax.devices()[0]):
        init = ref.init_params(root, unit, n, b["inputs"])
        loss = lambda p: lf(ref.forward(root, unit, p, b["inputs"]), b)
        return jax.device_get((init, *jax.value_and_grad(loss)(init)))


@pytest.mark.parametrize("mesh_spec,remat,tied", [("1x16", "dots", False), ("2x4", "full", False), ("1x8", "full", True)])
def test_prefetch_pipeline_gradients_match(mesh_spec, remat, tied):
    """The prefetch pipeline's end of the backward (engine/step_end.py: unit 0's gradient reduced in two
    parts, its feed-forward's first) and, untied, the embedding run inside the first stage (its gather,
    lookup and gradient reduce-scatter, the last under unit 0's weight gradients: engine/root.py,
    `embed_lead`): the loss and the sharded gradients, gathered, equal jax.grad of the single-device loss."""
    cfg = dataclasses.replace(LLAMA, tie_embeddings=tied)
    root, unit, n = models.parts(cfg)
    b, lf = _batches(cfg)[0], models.loss_fn(cfg)
    init, want_loss, want = first_step_reference(cfg)
    n_dev = jfsdp.parse_mesh(mesh_spec)[0] * jfsdp.parse_mesh(mesh_spec)[1]
    mesh = jfsdp.make_mesh(mesh_spec, devices=jax.devices()[:n_dev])
    plan = jfsdp.fully_shard(jfsdp.Stacked(root, unit, n), mesh, b["inputs"], remat=remat, prefetch=True)
    assert plan.prefetch and bool(plan.root_use[0] & plan.root_use[1]) == tied   # untied: the stage's lead
    got_loss, grads = jax.jit(plan.loss_and_grad(lf))(plan.shard(init), jax.device_put(b, plan.batch_sharding))
    np.testing.assert_allclose(float(got_loss), float(want_loss), rtol=1e-5)
    ref.close(plan.gather(grads), want, 1e-5, "grad")
