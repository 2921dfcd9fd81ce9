"""The noise floor under the tests' numerical tolerances, measured: `python -m tests.noise_floor [SECTION...]`.

Every test that holds jfsdp against a single-device reference compares two float32 computations of
the same sums in different orders: a data-parallel mesh sums each device's gradient and then the
devices', a chunked loss sums tokens chunk by chunk, and the CPU's vector width (XLA_FLAGS
--xla_cpu_max_isa) changes how XLA's loops reassociate. The floor here is the reference against
itself with each batch split into k micro-batches (k = 2, 4, 8, 16, the data-parallel degrees of the
test meshes) and the loss the mean of theirs: the same mathematics in another order, no jfsdp. For
the single operations (fused loss, attention, the Llama against transformers) it is the float32
computation against itself in float64.

Printed as the worst over leaves and over k, and as a ratio to the tolerance the tests use (tests/
reference.py), so 1/ratio is the margin. Bugs the tests must catch, simulated on the reference, are
printed as the same ratio: how far beyond the tolerance they land. Sections: the model names of
CASES (parameters, gradients, losses in float32), bf16, bf16-compute, tp-bf16, cp-bf16, resume, ops, hf.
docs/numerics.md keeps the figures; re-measure natively and with XLA_FLAGS=--xla_cpu_max_isa=AVX2 (and SSE4_2).
"""
import dataclasses
import importlib
import os
import sys

importlib.import_module("tests.conftest")   # 16 CPU devices and the tests' XLA flags, before jax loads

import jax
import jax.numpy as jnp
import numpy as np
import optax

import models
from tests import reference as ref
from tests import test_equivalence as te
from tests import test_stages as ts

SPLITS = (2, 4, 8, 16)
# the tolerances the tests write as figures (the parameters' are tests/reference.py's)
LOSS_RTOL, GRAD_RTOL = 1e-5, 1e-5     # losses relative, gradients of each leaf's largest magnitude
OP_RTOL = 1e-5                        # test_ops, test_attention: fp32 against the plain computation
LOGITS_RTOL, LOGITS_ATOL = 1e-4, 1e-5  # test_llama_vs_transformers, test_hf_interop
RESUME_RTOL, RESUME_ATOL = 2e-4, 2e-6  # test_checkpoint: parameters 2 steps after a restore, elementwise


def split(loss, k):
    """The loss as the mean of k equal micro-batches' losses (the batch's leading axis split in k)."""
    if k == 1:
        return loss

    def f(p, batch):
        m = jax.tree.leaves(batch)[0].shape[0] // k
        return sum(loss(p, jax.tree.map(lambda x: x[i * m:(i + 1) * m], batch)) for i in range(k)) / k
    return f


def run(opt, loss, params, bs, ks):
    """ref.run_steps with the loss split in ks[i] micro-batches at step i -> (losses, params, first grads)."""
    steps, state, losses, first = {}, opt.init(params), [], None
    for k, b in zip(ks, bs):
        if k not in steps:
            def step(p, s, b, lf=split(loss, k)):
                v, g = jax.value_and_grad(lf)(p, b)
                u, s = opt.update(g, s, p)
                return optax.apply_updates(p, u), s, v, g
            steps[k] = jax.jit(step)
        params, state, v, g = steps[k](params, state, b)
        losses.append(float(v))
        first = g if first is None else first
    return jax.device_get((losses, params, first))


def llama_case(tied=True, steps=3, batch=16, seq=16, dtype=None):
    cfg = dataclasses.replace(models.get_config("llama-test"), tie_embeddings=tied)
    root, unit, n = models.parts(cfg)
    bs = token_batches(cfg.vocab_size, steps, batch, seq)
    params = ref.init_params(root, unit, n, bs[0]["inputs"])
    out = dtype and jnp.float32
    loss = lambda p, b: models.loss_fn(cfg)(ref.forward(root, unit, p, b["inputs"], dtype, out), b)
    return ref.optimizer(), loss, params, bs


def resmlp_case(steps=3, batch=16, dtype=None):
    cfg = models.get_config("resmlp-test")
    root, unit, n = models.parts(cfg)
    rng = np.random.default_rng(0)
    bs = []
    for _ in range(steps):
        x = rng.normal(size=(batch, cfg.in_dim)).astype(np.float32)
        bs.append({"inputs": jnp.asarray(x), "targets": jnp.asarray(rng.integers(0, cfg.n_classes, batch), jnp.int32)})
    params = ref.init_params(root, unit, n, bs[0]["inputs"])
    out = dtype and jnp.float32
    loss = lambda p, b: models.loss_fn(cfg)(ref.forward(root, unit, p, b["inputs"], dtype, out), b)
    return ref.optimizer(), loss, params, bs


def token_batches(vocab, steps, batch, seq):
    """The tests' batches: seeded random tokens, targets the inputs shifted by one."""
    rng = np.random.default_rng(0)
    toks = [rng.integers(0, vocab, (batch, seq + 1)) for _ in range(steps)]
    return [{"inputs": jnp.asarray(t[:, :-1], jnp.int32), "targets": jnp.asarray(t[:, 1:], jnp.int32)} for t in toks]


def stages_case(dtype=None):
    root, units = ts.Root(), [u for u, _ in ts.TWO_STAGES]
    bs = token_batches(ts.VOCAB, ts.STEPS, ts.BATCH, ts.SEQ)
    params = ref.init_staged(root, ts.TWO_STAGES, bs[0]["inputs"])
    out = dtype and jnp.float32
    loss = lambda p, b: ts.lm_loss(ref.forward_staged(root, units, p, b["inputs"], dtype, out), b)
    return ref.staged_optimizer(), loss, params, bs


CASES = {   # name: (builder, the tests that compare on it)
    "llama": (llama_case, "test_equivalence, test_update_in_backward"),
    "llama-untied": (lambda **kw: llama_case(tied=False, **kw), "test_fused_head"),
    "resmlp": (resmlp_case, "test_equivalence, test_update_in_backward"),
    "stages": (stages_case, "test_stages, test_example (the same trainer)"),
    "llama-10-steps": (lambda **kw: llama_case(steps=10, batch=8, **kw), "test_torch_parity (10 steps)"),
}


def worst(got, want, scale):
    """max over leaves of max|got - want| / scale(want leaf) -> (value, leaf name)."""
    out = (0.0, "")
    for (path, w), g in zip(jax.tree_util.tree_leaves_with_path(want), jax.tree.leaves(got)):
        w, g = np.asarray(w, np.float64), np.asarray(g, np.float64)
        out = max(out, (float(np.max(np.abs(g - w)) / scale(w)), jax.tree_util.keystr(path)))
    return out


def largest(w):
    return max(np.max(np.abs(w)), 1e-30)


def compare(got, want, steps):
    """The figures the tests assert on, got against want (each run's (losses, params, grads)), as
    ratios to the tests' tolerances."""
    return {"loss": max(abs(a - b) / abs(b) for a, b in zip(got[0], want[0])) / LOSS_RTOL,
            "grad": worst(got[2], want[2], lambda w: GRAD_RTOL * largest(w))[0],
            "param": worst(got[1], want[1], lambda w: ref.PARAM_RTOL * largest(w) + ref.param_atol(steps)),
            "param/(n lr)": worst(got[1], want[1], lambda w: steps * ref.LR)[0]}


def bugs(opt, bs):
    """Reference runs with a bug jfsdp could have: (optimizer or None for the case's, batches)."""
    half = [jax.tree.map(lambda x: x[: x.shape[0] // 2], b) for b in bs]
    decay_all = optax.chain(optax.clip_by_global_norm(ref.CLIP),
                            optax.adamw(ref.LR, b1=ref.B1, b2=ref.B2, eps=ref.EPS, weight_decay=ref.WD))
    return {"data-axis reduce missing (half the batch)": (opt, half), "weight decay on every leaf": (decay_all, bs)}


def fp32_section(name):
    build, used_by = CASES[name]
    print(f"\n== {name} fp32  ({used_by}); ratios to the tolerance")
    with jax.default_device(jax.devices()[0]):
        opt, loss, params, bs = build()
        want, n = run(opt, loss, params, bs, [1] * len(bs)), len(bs)
        for k in SPLITS:
            if bs[0]["inputs"].shape[0] % k == 0:
                r = compare(run(opt, loss, params, bs, [k] * n), want, n)
                print(f"  k={k:<3d} loss {r['loss']:.3f}  grad {r['grad']:.3f}  param {r['param'][0]:.3f} "
                      f"({r['param'][1]}; {r['param/(n lr)']:.1e} of n lr)")
        for b, (o, data) in bugs(opt, bs).items():
            r = compare(run(o, loss, params, data, [1] * n), want, n)
            print(f"  bug, {b}: param {r['param'][0]:.0f} ({r['param'][1]}), grad {r['grad']:.0f}, "
                  f"loss {r['loss']:.1f}")


def bf16_section():
    """bf16 compute against itself reassociated: losses and each leaf's update (final - init) in L2."""
    print("\n== bf16 (test_equivalence, test_stages, test_fused_head); ratios to the tolerance")
    for name in ("llama", "resmlp", "stages"):
        with jax.default_device(jax.devices()[0]):
            opt, loss, params, bs = CASES[name][0](dtype=jnp.bfloat16)
            want = run(opt, loss, params, bs, [1] * len(bs))
            init = jax.device_get(params)
            variants = [(f"k={k}", opt, loss, bs, k) for k in SPLITS]
            variants += [("bug, computed in fp32 (policy ignored)", opt, CASES[name][0]()[1], bs, 1)]
            variants += [(f"bug, {b}", o, loss, data, 1) for b, (o, data) in bugs(opt, bs).items()]
            for what, o, lf, data, k in variants:
                got = run(o, lf, params, data, [k] * len(bs))
                lo = max(abs(a - b) / abs(b) for a, b in zip(got[0], want[0])) / te.BF16_LOSS_RTOL
                up = max((np.linalg.norm((g - w).ravel()) / np.linalg.norm((w - b).ravel()), jax.tree_util.keystr(p))
                         for (p, w), g, b in zip(jax.tree_util.tree_leaves_with_path(want[1]),
                                                 jax.tree.leaves(got[1]), jax.tree.leaves(init)))
                print(f"  {name} {what}: loss {lo:.3f}  update {up[0] / te.BF16_UPDATE_RTOL:.3f} ({up[1]})")


def forward_case(name):
    """(forward(params, rows, dtype) -> outputs in fp32, params, inputs) of a bf16-compute model."""
    if name == "stages":
        root, units = ts.Root(), [u for u, _ in ts.TWO_STAGES]
        x = token_batches(ts.VOCAB, 1, ts.BATCH, ts.SEQ)[0]["inputs"]
        params = ref.init_staged(root, ts.TWO_STAGES, x)
        return lambda p, r, dt: ref.forward_staged(root, units, p, r, dt, dt and jnp.float32), params, x
    cfg = models.get_config(name + "-test")
    root, unit, n = models.parts(cfg)
    x = (token_batches(cfg.vocab_size, 1, 16, 16)[0]["inputs"] if name == "llama"
         else jnp.asarray(np.random.default_rng(0).normal(size=(16, cfg.in_dim)), jnp.float32))
    params = ref.init_params(root, unit, n, x)
    return lambda p, r, dt: ref.forward(root, unit, p, r, dt, dt and jnp.float32), params, x


def bf16_compute_section():
    """reference.assert_bf16_outputs' figures: the fp32 forward against itself on k row splits (the
    floor), the bf16 one likewise, bf16 against fp32, and bf16 weights computed in fp32 (an engine that
    upcasts the gathered unit) against bf16; all compiled with excess precision off (ref.run_exact)."""
    print("\n== bf16-compute (test_equivalence, test_stages, test_fused_head, test_any_model: outputs, L2)")
    print(f"  tolerance {ref.BF16_OUT_RTOL:.0e}, fp32 floor used {ref.FP32_OUT_FLOOR:.0e}")
    for name in ("llama", "resmlp", "stages"):
        with jax.default_device(jax.devices()[0]):
            fwd, params, x = forward_case(name)
            up = lambda p: jax.tree.map(lambda a: a.astype(jnp.bfloat16).astype(jnp.float32), p)
            out = {dt: ref.run_exact(lambda p, dt=dt: fwd(p, x, dt), params) for dt in (None, jnp.bfloat16)}
            mutant = ref.run_exact(lambda p: fwd(up(p), x, None), params)
            for dt, what in ((None, "fp32"), (jnp.bfloat16, "bf16")):
                worst_k = max(ref.rel_l2(np.concatenate([ref.run_exact(lambda p, r=r: fwd(p, r, dt), params)
                                                         for r in np.split(np.asarray(x), k)]), out[dt])
                              for k in SPLITS)
                print(f"  {name} {what} against itself on 2-16 row splits: {worst_k:.2e}")
            print(f"  {name} bf16 against fp32: {ref.rel_l2(out[jnp.bfloat16], out[None]):.2e}; bf16 weights "
                  f"computed in fp32 against bf16: {ref.rel_l2(mutant, out[jnp.bfloat16]):.2e}")


def split_rowwise(t, round_parts=False):
    """A Linen interceptor for the reference: the Llama's rowwise layers (wo, w2) as T partial products
    over slices of their input features, summed in fp32 and rounded once (tensor parallelism's order of
    sums, without jfsdp); with `round_parts`, each partial rounded to the compute dtype first (Megatron's)."""
    import flax.linen as nn

    def intercept(next_fun, args, kwargs, context):
        mod = context.module
        if context.method_name != "__call__" or not isinstance(mod, nn.Dense) or mod.name not in ("wo", "w2"):
            return next_fun(*args, **kwargs)
        x, k = args[0], mod.get_variable("params", "kernel").astype(args[0].dtype)
        parts = [jnp.matmul(xp, kp, preferred_element_type=jnp.float32)
                 for xp, kp in zip(jnp.split(x, t, axis=-1), jnp.split(k, t, axis=0))]
        parts = [q.astype(x.dtype).astype(jnp.float32) for q in parts] if round_parts else parts
        return sum(parts).astype(x.dtype)
    return intercept


def tp_bf16_section():
    """test_tensor_parallel's bf16 tolerance: the bf16 reference (llama-test with 8 heads, 4 KV heads)
    against itself with its rowwise layers summed as T partial products (the floor), and with each partial
    rounded to bf16 (Megatron's order, what the tolerance must catch), and bf16 against fp32."""
    from tests import test_tensor_parallel as ttp
    print("\n== tp-bf16 (test_tensor_parallel: outputs, L2)")
    print(f"  tolerance {ttp.TP_BF16_OUT_RTOL:.0e}")
    root, unit, n = models.parts(ttp.CFG)
    with jax.default_device(jax.devices()[0]):
        x = token_batches(ttp.CFG.vocab_size, 1, 16, 16)[0]["inputs"]
        params = ref.init_params(root, unit, n, x)
        fwd = lambda p, dt=jnp.bfloat16, i=None: ref.forward(root, unit, p, x, dt, dt and jnp.float32, unit_interceptor=i)
        bf16, fp32 = ref.run_exact(fwd, params), ref.run_exact(lambda p: fwd(p, None), params)
        for t in (2, 4, 8):
            floor = ref.rel_l2(ref.run_exact(lambda p: fwd(p, i=split_rowwise(t)), params), bf16)
            parts = ref.rel_l2(ref.run_exact(lambda p: fwd(p, i=split_rowwise(t, True)), params), bf16)
            print(f"  T={t}: split sums {floor:.2e}; partials rounded to bf16 {parts:.2e}")
        print(f"  bf16 against fp32: {ref.rel_l2(bf16, fp32):.2e}")
    import jfsdp   # the engine's own figure beside the floor (what the test bounds)
    for spec, t in (("2x4", 2), ("1x8", 2), ("1x4", 4), ("2x2", 4), ("4x1", 4)):
        plan = ttp.plan_on(spec, t, mp_policy=jfsdp.MixedPrecision.parse("bf16"))
        got = ref.run_exact(plan.apply, plan.shard(params), jax.device_put(x, plan.batch_sharding))
        print(f"  jfsdp {spec} --tensor {t}: {ref.rel_l2(got, bf16):.2e}")


def attend_blockwise(block):
    """A Linen interceptor for the reference: the Llama's attention as blockwise attention in blocks of `block`
    (models/attention.py; the online softmax over key blocks, another order of the same sums)."""
    from models.attention import blockwise_attention

    def intercept(next_fun, args, kwargs, context):
        if context.method_name != "attend":
            return next_fun(*args, **kwargs)
        return blockwise_attention(*args, causal=True, block=block)
    return intercept


def cp_bf16_section():
    """test_context_parallel's bf16 test: jfsdp at C > 1 (ring attention) under the bf16 policy against the
    single-device bf16 reference with blockwise attention (test_equivalence's llama-test case, 3 AdamW steps):
    losses (relative), each leaf's update (final - init, L2) and the outputs of one forward pass (L2, every bf16
    rounding kept). The floor: the reference against itself with its batch in k micro-batches and with its
    attention in blocks of 2 to 8 (another order of the online softmax's sums); beside it the reference with
    XLA's attention (the model's default below 1,024 tokens), bf16 against fp32, jfsdp with the fp32 policy,
    the ring's per-block outputs rounded to bf16 before the merge, batches not in zigzag order (mutants), and
    --ring-sums bf16."""
    from models import factory
    from tests import test_context_parallel as tcp
    print("\n== cp-bf16 (test_context_parallel: losses, updates per leaf, outputs L2)")
    case = te.get_case("llama")
    init, bs = case["init"], case["batches"]
    x, lf = bs[0]["inputs"], models.loss_fn(case["cfg"])

    def reference(dtype=jnp.bfloat16, i=None, k=1, attention="blockwise"):
        root, unit, _ = models.parts(dataclasses.replace(case["cfg"], attention=attention))
        out = dtype and jnp.float32
        fwd = lambda p, r: ref.forward(root, unit, p, r, dtype, out, unit_interceptor=i)
        with jax.default_device(jax.devices()[0]):
            losses, final, _ = run(ref.optimizer(), lambda p, b: lf(fwd(p, b["inputs"]), b), init, bs, [k] * len(bs))
            return losses, final, ref.run_exact(lambda p: fwd(p, x), init)
    want = reference()
    print(f"  tolerances: losses {te.BF16_LOSS_RTOL:.0e}, updates {te.BF16_UPDATE_RTOL:.2f} (outputs: none); against "
          "the bf16 reference with blockwise attention (one block of 16)")

    def show(what, got):
        got = got if isinstance(got, tuple) else (got["losses"], got["final"], got["outputs"])
        lo = max(abs(a - b) / abs(b) for a, b in zip(got[0], want[0]))
        up = max((np.linalg.norm(np.asarray(g, np.float64) - w) / np.linalg.norm(np.asarray(w, np.float64) - b), p)
                 for p, w, g, b in ref.paired(jax.device_get(want[1]), jax.device_get(got[1]), init))
        print(f"  {what}: losses {lo:.2e}  update {up[0]:.3f} ({up[1]})  outputs {ref.rel_l2(got[2], want[2]):.2e}")
    for k in (2, 4, 8, 16):
        show(f"reference, {k} micro-batches", reference(k=k))
    for block in (2, 4, 8):
        show(f"reference, attention in blocks of {block}", reference(i=attend_blockwise(block)))
    show("reference with XLA's attention", reference(attention="xla"))
    show("fp32 reference", reference(None))
    for spec, c in (("1x2", 2), ("1x1", 4), ("1x4", 4), ("2x2", 2), ("1x2", 8)):
        show(f"jfsdp {spec} --context {c}", tcp.bf16_context_run(case, spec, c))
    for spec, c in (("1x2", 2), ("1x4", 4)):
        show(f"jfsdp {spec} --context {c}, fp32 policy", tcp.bf16_context_run(case, spec, c, "fp32"))
    k = factory.context_kernel(4)
    rounded = k._replace(fwd=lambda *a: (lambda o, lse: (o.astype(a[0].dtype).astype(jnp.float32), lse))(*k.fwd(*a)))
    for spec, c in (("1x2", 2), ("1x4", 4)):
        show(f"mutant, jfsdp {spec} --context {c}, per-block outputs rounded to bf16",
             tcp.bf16_context_run(case, spec, c, kernel=rounded))
    for spec, c in (("1x2", 2), ("1x1", 4)):
        show(f"mutant, jfsdp {spec} --context {c}, batches not in zigzag order",
             tcp.bf16_context_run(case, spec, c, zz=False))
    show("jfsdp 1x2 --context 2, --ring-sums bf16",
         tcp.bf16_context_run(case, "1x2", 2, kernel=factory.context_kernel(4, "bf16")))


def resume_section():
    """test_checkpoint's resumed training: 3 steps in common, then 2 steps on another mesh, elementwise."""
    print("\n== resume (test_checkpoint: 2 steps after a restore, elementwise); ratio to the tolerance")
    with jax.default_device(jax.devices()[0]):
        opt, loss, params, bs = llama_case(steps=5, batch=48)
        want = run(opt, loss, params, bs, [1] * 5)[1]
        for k in SPLITS:
            got = run(opt, loss, params, bs, [1, 1, 1, k, k])[1]
            ratio = max((float(np.max(np.abs(np.asarray(g, np.float64) - w) / (RESUME_ATOL + RESUME_RTOL * np.abs(w)))),
                         jax.tree_util.keystr(p)) for (p, w), g in zip(jax.tree_util.tree_leaves_with_path(want),
                                                                         jax.tree.leaves(got)))
            print(f"  k={k:<3d} {ratio[0]:.3f} ({ratio[1]})")


def moe_section():
    """test_moe's plain MoE reference against itself reassociated: loss and gradients."""
    from models import moe
    from tests import moe_reference as mref
    from tests.test_moe import BATCH, CFG, SEQ
    print("\n== moe (test_moe: loss and gradients); ratios to the tolerance")
    with jax.default_device(jax.devices()[0]):
        batch = token_batches(CFG.vocab_size, 1, BATCH, SEQ)[0]
        root, stages = moe.parts(CFG)
        params = ref.init_staged(root, stages, batch["inputs"])
        lf = lambda p, b: mref.loss(CFG, p, b)
        want = jax.device_get(jax.jit(jax.value_and_grad(lf))(params, batch))
        for k in SPLITS:
            got = jax.device_get(jax.jit(jax.value_and_grad(split(lf, k)))(params, batch))
            print(f"  k={k:<3d} loss {abs(got[0] - want[0]) / abs(want[0]) / LOSS_RTOL:.3f}  "
                  f"grad {worst(got[1], want[1], lambda w: GRAD_RTOL * largest(w))[0]:.3f}")


def ops_section():
    """The fused loss and blockwise attention against the plain computation in float32 and in float64."""
    from jfsdp.train.losses import linear_cross_entropy
    from tests.test_attention import plain_attention
    from models.attention import blockwise_attention
    from tests.test_ops import data, plain
    rel = lambda a, b: float(jnp.max(jnp.abs(a.astype(jnp.float64) - b)) / jnp.max(jnp.abs(b)))
    print("\n== ops (test_ops, test_attention): float32 against float64, ratios to the tolerance")
    with jax.default_device(jax.devices()[0]):
        h, w, t = data()
        ks = jax.random.split(jax.random.key(1), 4)
        q, do = jax.random.normal(ks[0], (2, 37, 6, 16)), jax.random.normal(ks[3], (2, 37, 6, 16))
        k, v = jax.random.normal(ks[1], (2, 37, 2, 16)), jax.random.normal(ks[2], (2, 37, 2, 16))
        fused = lambda h, w: linear_cross_entropy(h, w, t, chunk=16)
        for what, f in [("plain", lambda h, w: plain(h, w, t)), ("fused", fused)]:
            f32 = jax.value_and_grad(f, (0, 1))(h, w)
            with jax.enable_x64(True):
                h64, w64 = h.astype(jnp.float64), w.astype(jnp.float64)
                f64 = jax.value_and_grad(lambda h, w: plain(h, w, t), (0, 1))(h64, w64)
                print(f"  loss {what} f32: loss {rel(f32[0], f64[0]) / OP_RTOL:.3f}  "
                      f"dh {rel(f32[1][0], f64[1][0]) / OP_RTOL:.3f}  dw {rel(f32[1][1], f64[1][1]) / OP_RTOL:.3f}")
        for what, f in [("plain", plain_attention), ("blockwise", lambda *a: blockwise_attention(*a, block=8))]:
            o, vjp = jax.vjp(f, q, k, v)
            g = vjp(do)
            with jax.enable_x64(True):
                o64, vjp64 = jax.vjp(plain_attention, *(x.astype(jnp.float64) for x in (q, k, v)))
                g64 = vjp64(do.astype(jnp.float64))
                print(f"  attention {what} f32: out {rel(o, o64) / OP_RTOL:.3f}  "
                      + "  ".join(f"d{n} {rel(a, b) / OP_RTOL:.3f}" for n, a, b in zip("qkv", g, g64)))


def hf_section():
    """transformers' Llama in float32 against itself in float64, as test_llama_vs_transformers compares."""
    import torch
    from tests.test_llama_vs_transformers import hf_model
    print("\n== hf (test_llama_vs_transformers, test_hf_interop): torch f32 against f64; ratio to the tolerance")
    for tied in (True, False):
        cfg = dataclasses.replace(models.get_config("llama-test"), tie_embeddings=tied, rope_theta=500000.0)
        torch.manual_seed(0)
        model = hf_model(cfg)
        tokens = torch.from_numpy(np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 24)))
        with torch.no_grad():
            a = model(tokens).logits.double().numpy()
            b = model.double()(tokens).logits.numpy()
        print(f"  tied={tied}: {np.max(np.abs(a - b) / (LOGITS_ATOL + LOGITS_RTOL * np.abs(b))):.3f}")


if __name__ == "__main__":
    print(f"XLA_FLAGS={os.environ.get('XLA_FLAGS')!r}")
    sections = {**{n: (lambda n=n: fp32_section(n)) for n in CASES}, "bf16": bf16_section, "bf16-compute": bf16_compute_section,
                "tp-bf16": tp_bf16_section, "cp-bf16": cp_bf16_section,
                "resume": resume_section, "moe": moe_section, "ops": ops_section, "hf": hf_section}
    for name in sys.argv[1:] or sections:
        sections[name]()
