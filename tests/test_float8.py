"""Float8 training (jfsdp/engine/float8.py) on CPU devices: the matmul against an fp32 reference within
float8's error bound, the scale of a float8 all-gather identical on every shard, the FSDP step in fp8
against a single-device fp8 trainer written here (no jfsdp), and bad input. What the program compiled for
an H100 does (f8 all-gathers, f8 gemms) is in tests/test_gpu_target.py."""
import dataclasses
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jfsdp
import models
from jfsdp.engine import float8
from jfsdp.engine.fsdp import Comm
from jfsdp.engine.layout import Layout
from models import factory
from tests import reference as ref
from tests import runs

U4M3 = 2.0 ** -4    # unit roundoff of e4m3 (3 mantissa bits, round to nearest)
U5M2 = 2.0 ** -3    # e5m2 (2 mantissa bits)
SUB4M3 = 2.0 ** -10  # half the spacing of e4m3's subnormals (2^-9): absolute error below 2^-6
SUB5M2 = 2.0 ** -17  # e5m2's: spacing 2^-16
BF16 = 2.0 ** -8


def _err(a, u, sub, amax, fmax):
    """Elementwise rounding bound of a tensorwise-scaled cast: relative u, absolute `sub` in the scaled
    units (subnormals), brought back by the scale fmax / amax."""
    return u * np.abs(a) + sub * amax / fmax


def test_float8_matmul_within_float8_error_bound():
    """float8_dot and its gradients against fp32 numpy: every element within the bound that rounding both
    operands to float8 (scaled by their own amax) and the output to bf16 allows, and the error is
    really float8's (far above bf16's)."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(4, 32, 128)).astype(np.float32)
    x[0, 0, :4] = 30.0                                     # outliers: a tensorwise scale must cope
    w = (rng.normal(size=(128, 96)) * 0.02).astype(np.float32)
    g = rng.normal(size=(4, 32, 96)).astype(np.float32) * 1e-3
    xb = np.asarray(jnp.asarray(x, jnp.bfloat16), np.float32)   # the bf16 activations the unit computes on
    w8, ws = float8.dynamic(jnp.asarray(w), float8.E4M3)
    wq = jnp.asarray(w8, jnp.bfloat16)
    y, vjp = jax.vjp(lambda a, b: float8.float8_dot(a, b, ws, jnp.bfloat16), jnp.asarray(x, jnp.bfloat16), wq)
    dx, dw = vjp(jnp.asarray(g, jnp.bfloat16))
    gb = np.asarray(jnp.asarray(g, jnp.bfloat16), np.float32)
    e4, e5 = float(jnp.finfo(float8.E4M3).max), float(jnp.finfo(float8.E5M2).max)
    ex = _err(xb, U4M3, SUB4M3, np.abs(xb).max(), e4)
    ew = _err(w, U4M3, SUB4M3, np.abs(w).max(), e4)
    eg = _err(gb, U5M2, SUB5M2, np.abs(gb).max(), e5)

    def check(got, want, bound, what):
        got = np.asarray(got, np.float32)
        bound = bound + BF16 * np.abs(want) + 1e-7
        assert np.all(np.abs(got - want) <= bound), f"{what}: {np.max(np.abs(got - want) / bound):.2f} x the bound"
        rel = np.linalg.norm(got - want) / np.linalg.norm(want)
        assert rel > 4 * BF16 / 16, f"{what}: error {rel:.2e} is not float8's: the matmul did not run in float8"
        return rel
    ax, aw, ag = np.abs(xb), np.abs(w), np.abs(gb)
    check(y, xb @ w, ex @ aw + ax @ ew + ex @ ew, "y")
    check(dx, gb @ w.T, eg @ aw.T + ag @ ew.T + eg @ ew.T, "dx")
    xf, gf = xb.reshape(-1, 128), gb.reshape(-1, 96)
    exf, egf = ex.reshape(-1, 128), eg.reshape(-1, 96)
    check(dw, xf.T @ gf, exf.T @ np.abs(gf) + np.abs(xf).T @ egf + exf.T @ egf, "dw")


def test_float8_gather_scale_is_identical_on_every_shard():
    """A weight of 100 rows (padded to 104 over 8 shards) with its largest element on one shard: every
    shard computes the whole tensor's scale (pmax of the amax), bit for bit, and the gathered weight is
    the cast of the whole tensor (numpy and ml_dtypes), byte for byte."""
    rng = np.random.default_rng(1)
    w = (rng.normal(size=(100, 64)) * 0.05).astype(np.float32)
    w[97, 3] = -0.9
    layout = Layout((100, 64), jnp.dtype(jnp.float32), 8)
    mesh = jfsdp.make_mesh("1x8", jax.devices()[:8])

    def local(shard):
        fw = float8.unshard_float8(shard, layout, Comm((), 1 / 8, jnp.bfloat16, jnp.float32))
        return fw.data[None], fw.scale[None]
    f = jax.shard_map(local, mesh=mesh, in_specs=P("fsdp"), out_specs=(P("fsdp"), P("fsdp")), check_vma=False)
    data, scales = jax.jit(f)(jnp.asarray(np.asarray(layout.pad(w, np))))
    scales = np.asarray(scales)
    want = np.float32(448.0) / np.float32(0.9)
    assert scales.dtype == np.float32 and len(set(scales.view(np.uint32).tolist())) == 1
    assert scales[0] == want
    cast = (w * want).astype(ml_dtypes.float8_e4m3fn)
    for d in np.asarray(data):
        assert np.array_equal(d.astype(ml_dtypes.float8_e4m3fn).view(np.uint8), cast.view(np.uint8))


# ---- the single-device reference in the same precision, without jfsdp: a Dense whose kernel is fp32
# runs tests/reference.py's float8_matmul (kernel and input cast with their own amax scale, e4m3; the
# incoming gradient e5m2; fp32 accumulation; bf16 out); the rest of the model in bf16.
def _ref_interceptor(next_fun, args, kwargs, context):
    mod = context.module
    if context.method_name == "__call__" and isinstance(mod, nn.Dense):
        k = mod.get_variable("params", "kernel")
        if k.dtype == jnp.float32:
            return ref.float8_matmul(args[0], k)
    return next_fun(*args, **kwargs)


def _ref_forward(root, unit, params, inputs, dtype):
    cast = lambda t: jax.tree.map(lambda x: x.astype(dtype), t)
    # unit kernels stay fp32 (the master weights the float8 cast reads); everything else in `dtype`
    units = jax.tree_util.tree_map_with_path(
        lambda p, x: x if jax.tree_util.keystr(p).endswith("['kernel']") else x.astype(dtype), params["units"])
    h = root.apply({"params": cast(params["root"])}, inputs, method="embed")
    for i in range(jax.tree.leaves(units)[0].shape[0]):
        with nn.intercept_methods(_ref_interceptor):
            h = unit.apply({"params": jax.tree.map(lambda x: x[i], units)}, h)
    return root.apply({"params": cast(params["root"])}, h, method="head").astype(jnp.float32)


CFG = dataclasses.replace(models.get_config("llama-test"), dim=64, ffn_dim=128, n_heads=4, n_kv_heads=2, n_layers=2)
STEPS, BATCH, SEQ, DEVICES = 3, 8, 16, 4
# fp8 with the rest of the model in bf16 (parse('fp8')) and in fp32 (MixedPrecision(float8=True))
POLICIES = {"bf16": jfsdp.MixedPrecision.parse("fp8"), "fp32": jfsdp.MixedPrecision(float8=True)}


def reference_case(seed=0):
    """The tests' batches and initial parameters (from `seed`), the single-device tensorwise trainer's 3
    steps with the rest in fp32 (`fp32`), and its first step without float8 and in the rowwise recipe."""
    root, unit, n = models.parts(CFG)
    batches = [jax.tree.map(jnp.asarray, b) for b in ref.token_batches(CFG.vocab_size, STEPS, BATCH, SEQ, seed=seed)]
    lf = models.loss_fn(CFG)
    out = dict(root=root, unit=unit, n=n, batches=batches)
    with jax.default_device(jax.devices()[0]):
        init = ref.init_params(root, unit, n, batches[0]["inputs"], seed=seed)
        loss = lambda p, b: runs.rows_of(DEVICES, lambda r: lf(_ref_forward(root, unit, p, r["inputs"], jnp.float32), r), b)
        losses, final, grads = ref.run_steps(ref.optimizer(), loss, init, batches)
        out["fp32"] = dict(losses=losses, final=jax.device_get(final), grads=jax.device_get(grads))
        out.update(runs.first_step_others(root, unit, lf, init, batches[0], ref.rowwise_matmul, DEVICES))
    out["init"] = jax.device_get(init)
    return out


@pytest.fixture(scope="module")
def fp8_case():
    return reference_case()


def stacked_run(c, mesh_spec, strategy, remat, steps):
    """The Stacked engine with the rest in fp32 on `c` -> figures against the reference (runs.figures)."""
    plan = runs.stacked_plan(c, mesh_spec, strategy, remat, POLICIES["fp32"])
    got = runs.float8_run(plan, models.loss_fn(CFG), c["init"], c["batches"], steps)
    return runs.figures(got, {**c["fp32"], **{k: c[k] for k in ("plain", "other", "other_loss")}}, init=c["init"])


# What tolerance holds, and why. The reference models the recipe exactly: weights scaled by the whole
# tensor's amax (the engine pmax'es it over shards), activations and gradients by each device's own rows
# (the reference runs one device's rows at a time; scaling the whole batch at once instead moves the
# gradients by 12% in L2, measured). With one device (batch 2) the engine's gradients equal the
# reference's bit for bit; with 2 devices within 4e-7. But a float8 cast turns a summation-order
# difference in its input into a whole float8 step on an element near a rounding boundary (e5m2: 25%),
# and the backward pass carries it on: the reference against itself, jitted and eager, already differs
# by 6e-5 on 8 rows. The bounds come from the seed sweep of benchmarks/float8_floor.py (this test is its
# seed 0; docs/numerics.md, float8; 5 seeds, XLA:CPU, AVX2), worst seed on 1x4 (rerun 2026-11-26 with the
# reference's device rows under vmap): first-step gradients 0.58% over all leaves and 0.94% in the worst
# leaf (the other seeds 3e-7 to 4e-6), first loss 2.6e-7, 3 losses 8.6e-5, AdamW updates 10% per leaf
# (2026-11-25, one unrolled copy per device: 0.81%, 2.35%, 8.5e-8, 1.9e-4, 11%); the rowwise reference
# 8.5% away over all leaves, the trainer without float8 6.6%. Bounds as the same model's given as it is
# (tests/test_float8_any_model.py, whose floor is 1.6%): 3% over all leaves, 10% per leaf, losses 1e-5
# and 1e-3, updates 40%; runs.check asserts both references more than twice the 3% away.
BOUNDS = dict(grad=0.1, grad_all=0.03, loss0=1e-5, loss=1e-3, update=0.4)


@pytest.mark.parametrize("mesh_spec,strategy,remat,steps", [("1x4", "full_shard", "full", STEPS),
                                                            ("2x2", "shard_grad_op", "dots", 0)])
def test_fp8_step_matches_single_device_fp8(fp8_case, mesh_spec, strategy, remat, steps):
    """fp32 elsewhere: first-step gradients (the float8 backward), losses and AdamW updates against the
    single-device tensorwise trainer; the rowwise reference and the trainer without float8 out of bound."""
    m = stacked_run(fp8_case, mesh_spec, strategy, remat, steps)
    runs.check(m, BOUNDS if steps else {k: v for k, v in BOUNDS.items() if k != "update"})


# Tensor parallelism (T = 2 on 1x4x2, docs/tensor-parallel.md): the colwise and rowwise matmuls in float8
# on kernel slices, each weight scaled by the whole weight's amax (pmax over fsdp and tensor), a rowwise
# input and a colwise gradient (feature slices) by their device rows' whole amax (pmax over tensor): the
# same casts as the single-device reference with 4 devices' rows, so the same BOUNDS hold.
@pytest.mark.parametrize("async_tp", [False, True])
def test_fp8_tensor_parallel_matches_single_device_fp8(fp8_case, async_tp):
    """fp32 elsewhere, 1x4 x tensor 2, one-shot TP collectives and async TP (rings, each block its own
    dot, one scale for all blocks): first loss and first-step gradients against the single-device
    tensorwise trainer (the other recipe and float8 off out of bound); every TP matmul an f8 dot."""
    c, (model, _, lf) = fp8_case, factory.language_model(CFG, "plain")   # its loss: vocabulary-parallel
    mesh = jfsdp.make_mesh("1x4", tensor=2, devices=jax.devices()[:8])
    plan = jfsdp.fully_shard(model, mesh, c["batches"][0]["inputs"], strategy="full_shard", remat="none",
                             mp_policy=POLICIES["fp32"], tensor_plan=factory.tensor_plan(CFG), async_tp=async_tp)
    # runs.float8_run's first step (steps 0), the program lowered once: run here and read below
    args = (plan.shard(c["init"]), jax.device_put(c["batches"][0], plan.batch_sharding))
    lowered = jax.jit(plan.loss_and_grad(lf)).lower(*args)
    loss, grads = lowered.compile()(*args)
    m = runs.figures(([float(loss)], plan.gather(grads), None),
                     {**c["fp32"], **{k: c[k] for k in ("plain", "other", "other_loss")}})
    runs.check(m, {k: v for k, v in BOUNDS.items() if k != "update"})
    print("tp fp8 figures", m)
    # XLA:CPU widens f8 dots to f32 when it compiles, so the program is read as lowered: every unit
    # matmul's dot takes float8 operands: 7 TP matmuls (q, k, v, o, w1, w2, w3) x 3 (forward, dX, dW),
    # in the scanned unit's body, once per sequence block with async TP; the head's stays f32
    text = lowered.as_text()
    dots = re.findall(r"stablehlo.dot_general .*?: \((tensor<[^>]*>), (tensor<[^>]*>)\)", text)
    f8 = [d for d in dots if "f8E" in d[0] and "f8E" in d[1]]
    print("tp fp8 dots", len(f8), "of", len(dots))
    assert len(f8) == 7 * 3 * (2 if async_tp else 1), dots


# With the rest in bf16, both sides compiled with every bf16 rounding kept (reference.run_exact: XLA's
# excess precision off), the engine's first loss equals the reference's bit for bit and its gradients
# (the float8 backward: e5m2 gradients against e4m3 operands) are within 0.55% in L2 per leaf (1x4,
# measured 2026-11-25); by default the two programs drop different bf16 roundings and float8 amplifies
# that to 8.7%. Bound 2%: the fp32-rest reference (no bf16 rounding) is further away.
BF16_REST_GRAD_TOL = 0.02


def test_fp8_with_bf16_matches_single_device_fp8(fp8_case):
    """parse('fp8'): first loss and first-step gradients against the bf16-rest float8 reference."""
    c, lf = fp8_case, models.loss_fn(CFG)
    got_loss, want_loss, got, want = runs.bf16_rest_run(c, lf, _ref_forward, DEVICES, POLICIES["bf16"])
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-5)
    errs = ref.leaf_errors(got, want)
    assert max(errs.values()) <= BF16_REST_GRAD_TOL, errs
    assert max(ref.leaf_errors(got, c["fp32"]["grads"]).values()) > 2 * BF16_REST_GRAD_TOL


def test_float8_bad_input_is_one_config_error():
    root, unit, n = models.parts(CFG)
    x = jax.ShapeDtypeStruct((8, 16), jnp.int32)
    mesh = jfsdp.make_mesh("1x8", jax.devices()[:8])
    shard = lambda mp: jfsdp.fully_shard(jfsdp.Stacked(root, unit, n), mesh, x, mp_policy=mp)
    fp8 = lambda **kw: dataclasses.replace(jfsdp.MixedPrecision.parse("fp8"), float8=jfsdp.Float8(**kw))
    cases = [(lambda: shard(fp8(skip=("w",))), "selects no unit matmul"),      # every kernel's path has a 'w'
             (lambda: shard(fp8(min_size=10**9)), "selects no unit matmul"),
             (lambda: jfsdp.MixedPrecision(param_dtype="fp16", float8=True), "param_dtype bf16"),
             (lambda: jfsdp.Float8(skip=("(",)), "not a regular expression"),
             (lambda: jfsdp.MixedPrecision.parse("fp4"), "unknown precision")]
    from models import moe
    mcfg = models.get_config("moe-test")
    mroot, stages = moe.parts(mcfg)
    ep = lambda: jfsdp.fully_shard(jfsdp.Staged(mroot, stages), mesh, x, mp_policy=jfsdp.MixedPrecision.parse("fp8"),
                                   moe=jfsdp.MoE(mode="ep"))
    cases.append((ep, "expert-parallel"))
    for make, msg in cases:
        with pytest.raises(jfsdp.ConfigError, match=msg) as e:
            make()
        assert "\n" not in str(e.value)


def test_remat_dots_keeps_the_float8_matmul_output_in_bf16(capsys):
    """Under remat 'dots' a float8 matmul saves its bf16 output, as a bf16 matmul does, and neither its
    fp32 accumulator nor its gathered weight (llama-8b compiled for H100 was 98.5 GiB with the
    accumulator saved, 60.0 GiB without, docs/float8.md)."""
    from jfsdp.engine.fsdp import checkpoint_policy
    x = jnp.ones((4, 32, 64), jnp.bfloat16)
    w = jnp.ones((64, 48), jnp.float32)
    layout, comm = Layout((64, 48), jnp.dtype(jnp.float32), 1), Comm((), 1.0, jnp.bfloat16, jnp.float32)

    def unit(x, w):
        fw = float8.unshard_float8(w, layout, comm)
        return jnp.sum(jnp.tanh(float8.float8_dot(x, fw.data, fw.scale, jnp.bfloat16)).astype(jnp.float32))
    capsys.readouterr()
    jax.ad_checkpoint.print_saved_residuals(jax.checkpoint(unit, policy=checkpoint_policy("dots", True)), x, w)
    saved = [line.split()[0] for line in capsys.readouterr().out.splitlines() if line.strip()]
    assert "bf16[4,32,48]" in saved, saved
    assert "f32[4,32,48]" not in saved and "bf16[64,48]" not in saved, saved
