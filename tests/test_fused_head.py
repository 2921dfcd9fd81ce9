"""The fused head + loss inside the engine: a Llama whose root hands (hidden, head weight) to
`jfsdp.train.losses.lm_loss` trains exactly like the single-device reference with the plain head and
log_softmax loss, and its compiled step holds no vocabulary-sized logits."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jfsdp

import jfsdp.train.losses
import models
from jfsdp.planning import memory
from tests import reference as ref

STEPS, BATCH, SEQ = 3, 16, 16


def batches(cfg, seed=0):
    rng = np.random.default_rng(seed)
    tok = [rng.integers(0, cfg.vocab_size, (BATCH, SEQ + 1)) for _ in range(STEPS)]
    return [{"inputs": jnp.asarray(t[:, :-1], jnp.int32), "targets": jnp.asarray(t[:, 1:], jnp.int32)} for t in tok]


@pytest.fixture(scope="module", params=[True, False], ids=["tied", "untied"])
def case(request):
    cfg = dataclasses.replace(models.get_config("llama-test"), tie_embeddings=request.param)
    root, unit, n = models.parts(cfg)
    bs = batches(cfg)
    with jax.default_device(jax.devices()[0]):
        params = ref.init_params(root, unit, n, bs[0]["inputs"])
        # ref.train's steps (plain head and loss), with the first step's gradients: jax.grad of the plain
        # loss on the first batch at the initial parameters
        loss = lambda p, b: models.loss_fn(cfg)(ref.forward(root, unit, p, b["inputs"]), b)
        losses, final, grads = ref.run_steps(ref.optimizer(), loss, params, bs)
    return dict(cfg=cfg, root=root, unit=unit, n=n, batches=bs, init=jax.device_get(params), losses=losses,
                final=jax.device_get(final), grads=jax.device_get(grads))


@pytest.mark.parametrize("mesh_spec", ["1x8", "2x4"])
def test_fused_loss_equals_plain_reference(case, mesh_spec):
    mesh = jfsdp.make_mesh(mesh_spec, devices=jax.devices()[:8])
    model = jfsdp.Stacked(case["root"], case["unit"], case["n"], head_method="head_features")
    plan = jfsdp.fully_shard(model, mesh, case["batches"][0]["inputs"], strategy="full_shard", remat="full")
    adamw = jfsdp.adamw(ref.LR, b1=ref.B1, b2=ref.B2, eps=ref.EPS, weight_decay=ref.WD, clip_norm=ref.CLIP)
    opt = optax.chain(ref.keep_gradients(), adamw)   # the step's own first gradients, in the same program
    state = jfsdp.init_state(plan, opt, params=case["init"])
    # chunk 40 does not divide the 32 (1x8: 2 rows x 16) or 64 tokens per device: a ragged last chunk
    step = jfsdp.make_train_step(plan, opt, jfsdp.train.losses.lm_loss(vocab_major=case["cfg"].tie_embeddings, chunk=40))
    losses = []
    for b in case["batches"]:
        state, m = step(state, plan.put_batch(b))
        losses.append(float(m["loss"]))
    np.testing.assert_allclose(losses, case["losses"], rtol=1e-5)
    # the step's first gradients (kept by ref.keep_gradients), against jax.grad of the plain single-device
    # loss (measured <= 7e-7 when this read them from plan.loss_and_grad of the same loss, a program of its own)
    for path, b, a in ref.paired(case["grads"], plan.gather(state.opt_state[0][0])):
        assert np.max(np.abs(a - b)) <= 1e-5 * np.max(np.abs(b)), path
    # parameters after 3 AdamW steps, within tests/reference.py's parameter tolerance. Adam turns
    # summation-order noise in the gradient (the chunked head, the mesh's reduction) into lr-sized
    # update differences where a gradient is near eps; the untied embedding (gradient only from the
    # tokens that occur) is the most sensitive leaf measured: the reference against itself
    # reassociated differs by up to 3.1e-4 of its largest magnitude (2.8e-3 x 3 lr), a third of the
    # tolerance there; a missing data-axis reduce lands >100x above it (docs/numerics.md)
    ref.close(plan.gather(state.params), case["final"], ref.PARAM_RTOL, "param", ref.PARAM_ATOL)


def test_fused_loss_bf16_close_to_reference(case):
    """bf16 mixed precision: the gathered bf16 head weight goes into the fused loss as is (fp32
    accumulation inside); close to the reference run of the same policy with the plain head."""
    cfg, bs = case["cfg"], case["batches"]
    with jax.default_device(jax.devices()[0]):
        ref_losses, _ = ref.train(case["root"], case["unit"], models.loss_fn(cfg), jax.device_put(case["init"]), bs,
                                  param_dtype=jnp.bfloat16, output_dtype=jnp.float32)
    mesh = jfsdp.make_mesh("1x8", devices=jax.devices()[:8])
    model = jfsdp.Stacked(case["root"], case["unit"], case["n"], head_method="head_features")
    plan = jfsdp.fully_shard(model, mesh, bs[0]["inputs"], strategy="full_shard",
                             mp_policy=jfsdp.MixedPrecision.parse("bf16"))
    opt = jfsdp.adamw(ref.LR, b1=ref.B1, b2=ref.B2, eps=ref.EPS, weight_decay=ref.WD, clip_norm=ref.CLIP)
    state = jfsdp.init_state(plan, opt, params=case["init"])
    step = jfsdp.make_train_step(plan, opt, jfsdp.train.losses.lm_loss(vocab_major=cfg.tie_embeddings))
    # what the head hands to the fused loss (the normed hidden states and the head weight), against the
    # reference's head_features in bf16 and in fp32 from the same parameters
    x = bs[0]["inputs"]
    with jax.default_device(jax.devices()[0]):
        outs = [ref.run_exact(lambda p, dt=dt: ref.forward(case["root"], case["unit"], p, x, *dt, head="head_features"),
                              case["init"])[0] for dt in ((jnp.bfloat16, jnp.float32), (None, None))]
    got = ref.run_exact(plan.apply, plan.shard(case["init"]), plan.put_batch(bs[0])["inputs"])
    assert {a.dtype for a in jax.tree.leaves(got)} == {jnp.dtype(jnp.bfloat16)}   # as is into the fused loss
    ref.assert_bf16_outputs(got[0], *outs, "fused head")   # the hidden states (the weight is the bf16 cast)
    for b, r in zip(bs, ref_losses):
        state, m = step(state, plan.put_batch(b))
        assert abs(float(m["loss"]) - r) <= 1e-3 * abs(r)


def test_fused_loss_compiled_memory():
    """A vocabulary of 8192 and 512 tokens per device: one fp32 (tokens, V) logits buffer is 16 MiB.
    The plain loss's compiled step holds several at its peak; the fused one at most a chunk's worth,
    so the whole step's temporary memory drops by more than two full logits buffers."""
    cfg = dataclasses.replace(models.get_config("llama-test"), vocab_size=8192, max_seq_len=512)
    root, unit, n = models.parts(cfg)
    mesh = jfsdp.make_mesh("1x8", devices=jax.devices()[:8])
    x = jax.ShapeDtypeStruct((8, 512), jnp.int32)
    logits = 512 * cfg.vocab_size * 4

    def compiled(head, loss):
        plan = jfsdp.fully_shard(jfsdp.Stacked(root, unit, n, head_method=head), mesh, x, remat="full")
        opt, batch = jfsdp.adamw(1e-3), {"inputs": x, "targets": x}
        return plan, opt, batch, memory.compile_step(plan, opt, loss, batch)

    plain = compiled("head", models.loss_fn(cfg))[3].memory_analysis().temp_size_in_bytes
    fused_loss = jfsdp.train.losses.lm_loss(vocab_major=True, chunk=128)
    plan, opt, batch, c = compiled("head_features", fused_loss)
    fused = c.memory_analysis().temp_size_in_bytes
    print(f"train-step temp bytes per device: plain {plain:,}, fused {fused:,}, one logits buffer {logits:,}")
    assert plain - fused >= 2 * logits
    # the planner's estimate knows the fused head too (the bar: within 10% of the compiled total)
    ratio = memory.estimate(plan, opt, fused_loss, batch).total / memory.measure(c)["total"]
    print(f"estimate / compiled: {ratio:.3f}")
    assert 0.9 <= ratio <= 1.1, ratio
