"""Tensor parallelism with sequence parallelism on a (data, fsdp, tensor) mesh (docs/tensor-parallel.md):
the single-device reference's losses and parameters, the TP collectives in the compiled program, the
placement rule, the vocabulary-parallel root, gradient accumulation with frozen leaves, checkpoints
resumed under another T, T = 1 unchanged, and what is refused so far."""
import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jfsdp
import models
from jfsdp.engine.parallel import layout as tp_layout
from jfsdp.planning import hlo
from jfsdp.train import frozen
from models import factory
from tests.test_tensor_planner import assert_formula_equal
from tests import reference as ref

# llama-test with 8 heads and 4 KV heads (GQA, groups of 2), so that T = 4 divides both; dim 96 (head
# dim 12), ffn 200, vocabulary 259 (padded on every fsdp x tensor count), tied embeddings.
CFG = dataclasses.replace(models.get_config("llama-test"), n_heads=8, n_kv_heads=4)
# T = 16 (1x1x16) needs 16 heads, 16 KV heads and an FFN width 16 divides: head dim 6, ffn 208
CFG16 = dataclasses.replace(CFG, n_heads=16, n_kv_heads=16, ffn_dim=208)
STEPS, BATCH, SEQ = 3, 16, 16
_REF = {}


def reference(cfg=CFG, chunks=1, trainable=None):
    """The case and the single-device trainer's losses and final parameters (tests/reference.py), once per
    (cfg, chunks, trainable). Its loss is models.llama's plain log-softmax cross-entropy, not jfsdp's.
    `chunks` > 1: each step adds up the gradients of that many micro-batches in plain JAX
    (ref.accumulated); `trainable`: a predicate on a leaf's path, the others get no update."""
    key = (cfg, chunks, trainable)
    if key not in _REF:
        root, unit, n = models.parts(cfg)
        batches = [{k: jnp.asarray(v) for k, v in b.items()} for b in ref.token_batches(cfg.vocab_size, STEPS, BATCH, SEQ)]
        with jax.default_device(jax.devices()[0]):
            init = ref.init_params(root, unit, n, batches[0]["inputs"])
            opt = ref.optimizer()
            if trainable is not None:
                labels = jax.tree_util.tree_map_with_path(
                    lambda p, _: "train" if trainable(frozen.path_name(p)) else "frozen", init)
                opt = optax.multi_transform({"train": opt, "frozen": optax.set_to_zero()}, labels)
            loss = lambda p, b: models.loss_fn(cfg)(ref.forward(root, unit, p, b["inputs"]), b)
            losses, final, first = ref.run_steps(opt, loss, init, batches, chunks=chunks)
        _REF[key] = dict(root=root, unit=unit, n=n, batches=batches, init=jax.device_get(init), losses=losses,
                         final=jax.device_get(final), first_norm=float(optax.tree.norm(first)))
    return _REF[key]


def plan_on(spec, tensor, strategy="full_shard", remat="none", cfg=CFG, loss="plain", rows=BATCH, **kw):
    """jfsdp's Llama as train.py builds it (models/factory.py: the head and loss of `loss`; the plan's
    vocabulary-parallel root), on R x S x T, for batches of `rows` rows. `kw`: fully_shard's."""
    model = factory.language_model(cfg, loss)[0]
    mesh = jfsdp.make_mesh(spec, tensor=tensor, devices=jax.devices()[:jfsdp.MeshSpec(*jfsdp.parse_mesh(spec), tensor).devices])
    tok = jax.ShapeDtypeStruct((rows, SEQ), jnp.int32)
    return jfsdp.fully_shard(model, mesh, tok, strategy=strategy, remat=remat,
                             tensor_plan=kw.pop("tensor_plan", factory.tensor_plan(cfg)), **kw)


def compiled_step(plan, cfg=CFG, loss="plain", **kw):
    """(the train step compiled ahead of time, its optimizer): one compilation for the run and the HLO.
    The loss of `loss` (factory.language_model: vocabulary-parallel at T > 1); `kw`: make_train_step's
    (grad_accum, grad_sync, trainable)."""
    opt = jfsdp.adamw(ref.LR, b1=ref.B1, b2=ref.B2, eps=ref.EPS, weight_decay=ref.WD, clip_norm=ref.CLIP,
                      mask=plan.decay_mask())
    batch = {k: jax.ShapeDtypeStruct((BATCH, SEQ), jnp.int32, sharding=plan.batch_sharding) for k in ("inputs", "targets")}
    step = jfsdp.make_train_step(plan, opt, factory.language_model(cfg, loss)[2], **kw)
    state = jfsdp.abstract_state(plan, opt, trainable=kw.get("trainable"))
    return step.lower(state, batch).compile(), opt


_COMPILED = {}


def compiled_case(spec, tensor, strategy="full_shard", remat="none", prefetch=False, cfg=CFG, loss="plain"):
    """(plan, compiled step, optimizer) of a case, compiled once per test session (the checkpoint test
    resumes on the meshes of two equivalence cases)."""
    key = (spec, tensor, strategy, remat, prefetch, cfg, loss)
    if key not in _COMPILED:
        plan = plan_on(spec, tensor, strategy, remat, cfg=cfg, loss=loss, prefetch=prefetch)
        _COMPILED[key] = (plan, *compiled_step(plan, cfg, loss))
    return _COMPILED[key]


def run_and_check(plan, r, step, opt, trainable=None):
    """Run the reference's batches through the compiled step from its initial parameters: losses within
    1e-5 at every step, the first step's gradient norm (the clip's; all leaves trainable) within 1e-5, every final parameter
    within the fp32 + Adam noise floor (norm scales and the tied embedding included), and the parameters
    moved. Returns the final parameters (gathered)."""
    state = jfsdp.init_state(plan, opt, params=plan.shard(r["init"]), trainable=trainable)
    losses, norms = [], []
    for b in r["batches"]:
        state, m = step(state, jax.device_put(b, plan.batch_sharding))
        losses.append(float(m["loss"]))
        norms.append(float(m["grad_norm"]))
    np.testing.assert_allclose(losses, r["losses"], rtol=1e-5)
    if trainable is None:   # (with frozen leaves the reference's gradient has theirs too)
        np.testing.assert_allclose(norms[0], r["first_norm"], rtol=1e-5)
    final = jax.device_get(plan.gather(state.params))
    ref.assert_params_close(final, r["final"], r["init"])
    return final


def tensor_collectives(text, spec, tensor):
    """{(kind, result bytes): count} of the all-gathers / reduce-scatters / all-reduces whose replica
    groups are exactly the mesh's tensor groups (T consecutive devices)."""
    n = jfsdp.MeshSpec(*jfsdp.parse_mesh(spec), tensor).devices
    groups = "{" + ",".join("{" + ",".join(map(str, range(g, g + tensor))) + "}" for g in range(0, n, tensor)) + "}"
    by_name = {c.name: c for c in hlo.collectives(text, n)}
    out = {}
    for line in text.splitlines():
        m = re.match(r"\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=.*replica_groups=(\{\{[\d,{}]*\}\})", line)
        if m and m.group(2) == groups and m.group(1) in by_name:
            c = by_name[m.group(1)]
            out[(c.kind, c.result_bytes)] = out.get((c.kind, c.result_bytes), 0) + 1
    return out


# (R x S, T, strategy, remat, prefetch, config): the meshes 1x4x4, 1x8x2, 4x1x4 (DDP x TP)
# and 1x1x16 under FULL_SHARD (2x2x4: test_async_tp_matches_single_device_and_formula), SHARD_GRAD_OP (ZeRO-2) on 2x4x2; each remat policy at least once; the prefetch
# pipeline (the GPU default for remat full) on 1x4x4. 1x1x16 needs a head count, KV head count and FFN
# width that 16 divides: CFG16 (16 heads and 16 KV heads, no GQA; GQA is in every other case).
CASES = [("1x4", 4, "full_shard", "none", False, CFG),
         ("2x4", 2, "shard_grad_op", "dots", False, CFG), ("1x4", 4, "full_shard", "full", True, CFG),
         ("1x8", 2, "full_shard", "none", False, CFG), ("4x1", 4, "full_shard", "none", False, CFG),
         ("1x1", 16, "full_shard", "none", False, CFG16)]


@pytest.mark.parametrize("spec,tensor,strategy,remat,prefetch,cfg", CASES,
                         ids=[f"{c[0]}x{c[1]}-{c[2]}-{c[3]}" + ("-prefetch" if c[4] else "") for c in CASES])
def test_matches_single_device_fp32(spec, tensor, strategy, remat, prefetch, cfg):
    """Losses within 1e-5 at every step and final parameters (norm scales and the tied embedding
    included) at the fp32 + Adam noise floor of test_equivalence, against the plain single-device trainer.
    On 1x4x4 the same compiled programs also show Megatron-SP's collectives over the tensor groups, and
    the planner's communication formula is checked against them (and under remat full with async TP
    on 2x2x4: test_async_tp_matches_single_device_and_formula)."""
    r = reference(cfg)
    plan, step, opt = compiled_case(spec, tensor, strategy, remat, prefetch, cfg)
    assert plan.prefetch == prefetch
    if (spec, tensor) == ("1x4", 4):
        rows, d = BATCH // 4, CFG.dim   # each device's rows; 4 bytes per fp32 element
        whole, part, n = rows * SEQ * d * 4, rows * (SEQ // tensor) * d * 4, rows * SEQ
        # per block, forward: 2 all-gathers of the sequence (before attention, before the FFN) and 2
        # reduce-scatters (after wo, after w2); backward: their transposes. One scan body each way, remat
        # none: 4 of each. The vocabulary-parallel root adds one of each: the embedding's reduce-scatter
        # and the all-gather of h before the head, and their transposes (2 + 2 more). The token ids (for
        # the lookup) and the targets (for the loss) are all-gathered, 4 bytes a token. The loss
        # all-reduces 3 floats a token forward (the max, the sum of exponentials, the target's logit) and
        # 1 backward (the transpose of the sum's psum; the target logit's cotangent is one constant, its
        # psum folded). No other all-reduce over `tensor` (nothing summed twice).
        # The prefetch pipeline (remat full) runs both units outside a loop (llama-test has 2: unit 0
        # in the one-iteration loop, unit 1 peeled) and each unit's backward recomputes its forward
        # first: 2 x 4 in the forward pass; per unit's backward, 2 all-gathers and 1 reduce-scatter
        # recomputed (the block's last reduce-scatter feeds only its output, which the backward does
        # not need) and 2 + 2 transposed: 4 + 2 x 4 = 12 all-gathers and 4 + 2 x 3 = 10 reduce-scatters
        # in the units. The root is not rematerialized: its 2 + 2 and the ids', targets' and loss's
        # collectives are those of remat none, so 14 all-gathers and 12 reduce-scatters of activations.
        got = tensor_collectives(step.as_text(), spec, tensor)
        reduced = sum(b * c for (kind, b), c in got.items() if kind == "all-reduce")
        units = (12, 10) if prefetch else (4, 4)
        assert {k: c for k, c in got.items() if k[0] != "all-reduce"} == {
            ("all-gather", whole): units[0] + 2, ("reduce-scatter", part): units[1] + 2, ("all-gather", n * 4): 2}, got
        assert reduced == 4 * n * 4, got
        if not prefetch:
            base = plan_on(spec, 1, tensor_plan=None)
            check_comm_formula(plan, step, "plain", base=(base, compiled_step(base)[0]))
    run_and_check(plan, r, step, opt)


def check_comm_formula(plan, step, loss, base=None):
    """The planner's formula (jfsdp/planning/tensor_comm.py) against the compiled step's collectives,
    classified by the mesh axes of their replica groups (hlo.per_axes): equal for every kind and
    axes (under remat none a unit's norm scales are gathered once, as the formula says; at T = 1 the
    formula of memory.comm_formula over-counts them). `base`: the T = 1 step on the same R x S, whose
    FSDP all-gathers are T times those of this step over `fsdp` (to padding, under 1%). More cases
    (bf16, remat dots, ZeRO-2, the H100 target): tests/test_tensor_planner.py."""
    from jfsdp.planning import tensor_comm
    want = tensor_comm.tensor_comm(plan, BATCH, SEQ, fused=loss == "fused", backend="cpu")
    got = {k: v["wire_bytes"] for k, v in hlo.per_axes(step.as_text(), tuple(plan.mesh.shape.items())).items()}
    assert_formula_equal(want, got)
    if base is not None:
        base_plan, base_step = base
        t1 = hlo.per_axes(base_step.as_text(), tuple(base_plan.mesh.shape.items()))
        ratio = t1[("all-gather", ("fsdp",))]["wire_bytes"] / got[("all-gather", ("fsdp",))]
        assert ratio == pytest.approx(plan.tensor, rel=0.01), ratio


def test_async_tp_matches_single_device_and_formula():
    """Async TP (parallel/tensor.py: every TP all-gather and reduce-scatter of the units as a ring of
    T - 1 collective-permutes, one block's matmul per hop) on 2x2x4 (HYBRID: the `data` axis too) with
    the GPU defaults (remat full, the prefetch pipeline): the single-device reference's losses and
    parameters, and the compiled
    collectives equal to the formula by kind and mesh axes. The formula then has no all-gather or
    reduce-scatter over `tensor` in the units, only the root's, and the rings' collective-permutes
    over the tensor groups carry the same bytes as the collectives they replace."""
    r = reference()
    plan = plan_on("2x2", 4, remat="full", prefetch=True, async_tp=True)
    step, opt = compiled_step(plan)
    assert plan.async_tp and ("collective-permute", ("tensor",)) in hlo.per_axes(
        step.as_text(), tuple(plan.mesh.shape.items()))
    check_comm_formula(plan, step, "plain")
    run_and_check(plan, r, step, opt)


def test_update_in_backward_matches_single_device():
    """make_train_step(update_in_backward=True) (jfsdp/train/update_in_backward.py) on 2x2x2 (HYBRID: the
    `data` axis too), remat full, clipped AdamW whose clip acts at every step (the two-pass path: norm
    first, then the updates): the single-device trainer's losses, first gradient norm and parameters,
    as the usual step's. Each of the step's T > 1 pieces fails this without it: the vocabulary-parallel
    lookup and loss (shape errors), the batch's sequence over `tensor` (norm scales off), the loss's
    sum over `tensor` (loss / T), the gradient norm's sum over `tensor` (the clip's scale off)."""
    r = reference()
    plan = plan_on("2x2", 2, remat="full")
    step, opt = compiled_step(plan, update_in_backward=True)
    assert r["first_norm"] > ref.CLIP
    run_and_check(plan, r, step, opt)


# Frozen: the tied embedding (vocabulary-parallel: rowwise, 259 rows padded to 4 x 65) and every FFN kernel (colwise w1, w3 and rowwise
# w2): only attention and the norms train.
def test_staged_model_matches_single_device():
    """A `jfsdp.Staged` model at T = 2 (1x2x2, remat full): two stages of different unit modules (Llama
    blocks of FFN widths 200 and 136), each under the same TensorPlan, the vocabulary-parallel root. Against
    the plain single-device staged trainer (tests/reference.py): losses within 1e-5 at every step, final
    parameters at the fp32 + Adam noise floor."""
    from models.llama import LlamaBlock
    root = models.parts(CFG)[0]
    stages = [(LlamaBlock(CFG), 1), (LlamaBlock(dataclasses.replace(CFG, ffn_dim=136)), 1)]
    batches = [{k: jnp.asarray(v) for k, v in b.items()} for b in ref.token_batches(CFG.vocab_size, STEPS, BATCH, SEQ)]
    with jax.default_device(jax.devices()[0]):
        init = jax.device_get(ref.init_staged(root, stages, batches[0]["inputs"]))
        want, final, _ = ref.train_staged(root, [u for u, _ in stages], models.loss_fn(CFG), init, batches)
    mesh = jfsdp.make_mesh("1x2", tensor=2, devices=jax.devices()[:4])
    plan = jfsdp.fully_shard(jfsdp.Staged(root, stages), mesh, jax.ShapeDtypeStruct((BATCH, SEQ), jnp.int32),
                             remat="full", tensor_plan=factory.tensor_plan(CFG))
    assert plan.tensor == 2 and plan.stage_sizes == (1, 1)
    opt = jfsdp.adamw(ref.LR, b1=ref.B1, b2=ref.B2, eps=ref.EPS, weight_decay=ref.WD, clip_norm=ref.CLIP,
                      mask=plan.decay_mask())
    state = jfsdp.init_state(plan, opt, params=plan.shard(init))
    step = jfsdp.make_train_step(plan, opt, jfsdp.logits_loss())
    losses = []
    for b in batches:
        state, m = step(state, jax.device_put(b, plan.batch_sharding))
        losses.append(float(m["loss"]))
    np.testing.assert_allclose(losses, want, rtol=1e-5)
    ref.assert_params_close(jax.device_get(plan.gather(state.params)), jax.device_get(final), init)


FROZEN = ("tok_embeddings", "feed_forward")


def is_trainable(path):
    return not any(f in path for f in FROZEN)


@pytest.mark.parametrize("grad_sync", ["every", "once"])
def test_accumulation_and_frozen_match_single_device(grad_sync):
    """Gradient accumulation (2 micro-batches, each grad_sync mode) with frozen leaves on 2x2x4, against the
    single-device trainer that adds up its micro-batches' gradients in plain JAX and updates only the
    trainable leaves: losses within 1e-5, parameters at the noise floor, frozen leaves bit-identical.
    jfsdp's micro-batch i on row-device d (the 4 of data x fsdp) is the reference's chunk 2d + i."""
    k = 2
    r = reference(chunks=4 * k, trainable=is_trainable)
    plan = plan_on("2x2", 4, rows=BATCH // k)
    step, opt = compiled_step(plan, grad_accum=k, grad_sync=grad_sync, trainable=is_trainable)
    final = run_and_check(plan, r, step, opt, trainable=is_trainable)
    n_frozen = 0
    for path, g, b in ref.paired(final, r["init"]):
        if not is_trainable(path):
            assert np.array_equal(g, b), path
            n_frozen += 1
    assert n_frozen == 4   # the embedding, w1, w2, w3


def test_checkpoint_resumes_under_another_tensor_and_shards(tmp_path):
    """Saved after step 1 on 1x4x4 (S = 4, T = 4), resumed on 1x8x2 (S = 8, T = 2): steps 2 and 3 give the
    never-stopped run's losses (the single-device trainer's) within 1e-5 and its final parameters at the
    noise floor (Adam's moments restored too). On disk every parameter is whole: the exporter's reader
    (a T = 1 plan's logical parameters) gives the saving plan's gathered parameters bit for bit, and so
    does the resumed plan. The vocabulary-parallel embedding (259 rows: 4 x 65 padded on 1x4x4, 2 x 130
    on 1x8x2) is stored as its 259 rows."""
    from jfsdp import export
    from jfsdp.io import checkpoint as jckpt
    r = reference()
    a, step_a, opt_a = compiled_case("1x4", 4)
    state = jfsdp.init_state(a, opt_a, params=a.shard(r["init"]))
    state, m = step_a(state, jax.device_put(r["batches"][0], a.batch_sharding))
    losses = [float(m["loss"])]
    c = jckpt.Checkpointer(tmp_path, async_save=False)
    c.save(1, state, {"model_config": dataclasses.asdict(CFG)}, plan=a)
    c.wait()
    saved = jax.device_get(a.gather(state.params))
    whole = export.read_params(str(tmp_path))[0]
    assert (CFG.vocab_size, CFG.dim) in {np.shape(x) for x in jax.tree.leaves(whole)}
    for path, want, got in ref.paired(saved, whole):
        np.testing.assert_array_equal(got, want, err_msg=path)
    b, step_b, opt_b = compiled_case("1x8", 2)
    with pytest.raises(jfsdp.ConfigError, match="needs plan="):
        c.restore(1, jfsdp.abstract_state(b, opt_b))
    state = c.restore(1, jfsdp.abstract_state(b, opt_b), plan=b)
    c.close()
    for path, want, got in ref.paired(saved, jax.device_get(b.gather(state.params))):
        np.testing.assert_array_equal(got, want, err_msg=path)
    for batch in r["batches"][1:]:
        state, m = step_b(state, jax.device_put(batch, b.batch_sharding))
        losses.append(float(m["loss"]))
    np.testing.assert_allclose(losses, r["losses"], rtol=1e-5)
    ref.assert_params_close(jax.device_get(b.gather(state.params)), r["final"], r["init"])


def vocabulary_buffers(text, vocab):
    """The shapes (f32 / bf16 arrays) in an optimized HLO text with a dimension the size of the whole
    vocabulary, or of the vocabulary padded to a multiple of 4."""
    return {m.group(0) for m in re.finditer(r"(?:f32|bf16)\[([\d,]+)\]", text)
            if {int(x) for x in m.group(1).split(",")} & {vocab, -(-vocab // 4) * 4}}


# The vocabulary-parallel root with the fused (chunked) loss tied, and the plain loss untied (the plain
# tied case is CASES above), on 1x4x4: the single-device reference with models.llama's plain loss; and
# no array of the whole vocabulary's size in the compiled step, where the T = 1 step of the same model
# and loss (1x16) has its logits (the fused loss: one chunk's, 16 tokens). Untied on the prefetch
# pipeline too, which runs the embedding's lookup (its tensor collectives) inside the first stage.
@pytest.mark.parametrize("loss,tied,prefetch", [("fused", True, False), ("plain", False, False), ("plain", False, True)])
def test_vocabulary_parallel_root_matches_single_device(loss, tied, prefetch):
    cfg = dataclasses.replace(CFG, tie_embeddings=tied)
    plan = plan_on("1x4", 4, cfg=cfg, loss=loss, prefetch=prefetch)
    assert plan.prefetch == prefetch
    step, opt = compiled_step(plan, cfg, loss)
    assert not vocabulary_buffers(step.as_text(), cfg.vocab_size)
    base, _ = compiled_step(plan_on("1x16", 1, cfg=cfg, loss=loss, tensor_plan=None), cfg, loss)
    logits = f"f32[1,16,{cfg.vocab_size}]" if loss == "plain" else f"f32[16,{cfg.vocab_size}]"
    assert logits in vocabulary_buffers(base.as_text(), cfg.vocab_size)
    if not prefetch:   # on the pipeline the formula counts 1800 bytes of (fsdp, tensor) gathers where 2520 are
        check_comm_formula(plan, step, loss)   # compiled, with the embedding inside the stage or not (open)
    run_and_check(plan, reference(cfg), step, opt)


@pytest.mark.parametrize("vocab_major", [True, False])
def test_fused_vocabulary_parallel_loss_matches_log_softmax(vocab_major):
    """The fused loss under loss_parallel on 4 tensor ranks (V = 259 in 4 shares of 65, the last padded),
    both weight layouts, against jax.nn.log_softmax on the whole logits: the mean loss and the gradients
    of h and of the weight, each rank's share of it. Every rank holds the whole h, as the engine's
    all-gather before the head leaves it; the engine's sum over ranks is taken here by hand."""
    from jax.sharding import NamedSharding, PartitionSpec as P
    from jfsdp.engine.parallel import vocab
    n, d, v, t = 24, 8, 259, 4
    k = jax.random.split(jax.random.key(0), 3)
    h = jax.random.normal(k[0], (2, n // 2, d))
    w = jax.random.normal(k[1], (v, d) if vocab_major else (d, v)) * 0.5
    targets = jax.random.randint(k[2], (2, n // 2), 0, v)

    def plain(h, w):
        logits = jnp.einsum("btd,vd->btv" if vocab_major else "btd,dv->btv", h, w)
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], -1))
    want, (want_dh, want_dw) = jax.value_and_grad(plain, argnums=(0, 1))(h, w)

    mesh = jax.make_mesh((t,), ("tensor",), devices=jax.devices()[:t])
    axis = 0 if vocab_major else 1
    shares = jnp.pad(w, [(0, 1) if a == axis else (0, 0) for a in range(2)])
    loss_fn, shard = jfsdp.lm_loss(vocab_major=vocab_major, chunk=8), vocab.VocabShard(v, 65, t)

    def local(h, w_share):
        def f(h, w_share):
            with vocab.loss_parallel(shard):
                return loss_fn((h, w_share), {"targets": targets})
        loss, (dh, dw) = jax.value_and_grad(f, argnums=(0, 1))(h, w_share)
        return jax.lax.psum(loss, "tensor")[None] / t, jax.lax.psum(dh, "tensor") / t, dw / t
    spec = P("tensor") if vocab_major else P(None, "tensor")
    got, dh, dw = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P(), spec), out_specs=(P("tensor"), P(), spec),
                                        check_vma=False))(h, jax.device_put(shares, NamedSharding(mesh, spec)))
    np.testing.assert_allclose(np.asarray(got), float(want), rtol=1e-5)
    np.testing.assert_allclose(dh, want_dh, rtol=1e-4, atol=1e-6)
    dw = np.asarray(dw)[:v] if vocab_major else np.asarray(dw)[:, :v]
    np.testing.assert_allclose(dw, want_dw, rtol=1e-4, atol=1e-6)


# bf16: the engine's outputs (plan.apply) from the same fp32 parameters against the single-device bf16
# model's, both compiled with every bf16 rounding kept (reference.run_exact). Each rowwise layer sums its
# T partial products in fp32 and rounds once, so the engine differs from the reference only by the order
# of fp32 sums, seen through bf16 roundings it flips: measured 1.9e-4 (T = 2) and 2.1e-4 (T = 4) in L2,
# on 1x4x4, 2x2x4, 4x1x4, 2x4x2 and 1x8x2 (1.8e-4, 2.0e-4 under --xla_cpu_max_isa=SSE4_2), against a
# floor of 9.0e-5 for the reference itself with its rowwise sums split (`python -m tests.noise_floor
# tp-bf16`, 2026-11-26). The tolerance is 4.7x jfsdp's figure; the bf16 reference lies 6.1e-3 from the
# fp32 one, and rounding each partial product to bf16 first (Megatron's way) lands 5.2e-3 from it.
TP_BF16_OUT_RTOL = 1e-3


def test_bf16_outputs_match_single_device_bf16():
    r = reference()
    x = r["batches"][0]["inputs"]
    with jax.default_device(jax.devices()[0]):
        want = ref.run_exact(lambda p: ref.forward(r["root"], r["unit"], p, x, jnp.bfloat16, jnp.float32), r["init"])
        fp32 = ref.run_exact(lambda p: ref.forward(r["root"], r["unit"], p, x), r["init"])
    plan = plan_on("2x2", 4, mp_policy=jfsdp.MixedPrecision.parse("bf16"))
    got = ref.run_exact(plan.apply, plan.shard(r["init"]), jax.device_put(x, plan.batch_sharding))
    assert ref.rel_l2(want, fp32) > 5 * TP_BF16_OUT_RTOL
    assert ref.rel_l2(got, want) <= TP_BF16_OUT_RTOL, ref.rel_l2(got, want)


def test_placement_rule():
    """Every leaf of the Llama plan is sharded over, or summed over, `fsdp` and `tensor`, each once: TP
    kernels on (tensor, fsdp) and gathered over fsdp alone, every other leaf over (fsdp, tensor); a
    placement that sums over `tensor` twice or never is refused."""
    plan = plan_on("2x2", 4)
    tp = {"wq", "wk", "wv", "wo", "w1", "w2", "w3", "tok_embeddings"}   # the embedding: vocabulary-parallel
    for path, l in jax.tree_util.tree_flatten_with_path(plan.layouts, is_leaf=lambda x: isinstance(x, jfsdp.Layout))[0]:
        name = path[-2].key
        if isinstance(l, tp_layout.TensorLayout):
            assert name in tp and l.gather_axes == "fsdp" and tp_layout.spec_axes(l) == ("tensor", "fsdp"), path
            assert l.shards == 2 and l.full_shape[l.dim] == (4 * l.shape[l.dim] if name != "tok_embeddings" else 259)
            assert name != "tok_embeddings" or (l.shape, l.full) == ((65, 96), 259)   # 259 rows padded to 4 x 65
        else:
            assert name not in tp and l.gather_axes == ("fsdp", "tensor") and l.shards == 8, path
        tp_axis = "tensor" if isinstance(l, tp_layout.TensorLayout) else None
        tp_layout.check_placement(tp_axis, (l.gather_axes,) if isinstance(l.gather_axes, str) else l.gather_axes)
    for bad in [("tensor", ("fsdp", "tensor")), (None, ("fsdp",)), ("tensor", ("data", "fsdp"))]:
        with pytest.raises(RuntimeError, match="placement rule"):
            tp_layout.check_placement(*bad)
    for kind in ("colwise", "rowwise", "replicate"):
        tp_layout.check_placement(*tp_layout.placement(kind))


def test_tensor_one_is_the_two_axis_program():
    """make_mesh(spec, tensor=1) is today's (data, fsdp) mesh, and a Llama plan given on it changes
    nothing: the lowered train step is the same text as without the argument and the plan."""
    root, unit, n = models.parts(CFG)
    tok = jax.ShapeDtypeStruct((BATCH, SEQ), jnp.int32)

    def lowered(mesh, **kw):
        plan = jfsdp.fully_shard(jfsdp.Stacked(root, unit, n), mesh, tok, remat="full", **kw)
        opt = jfsdp.adamw(ref.LR, mask=plan.decay_mask())
        batch = {k: jax.ShapeDtypeStruct((BATCH, SEQ), jnp.int32, sharding=plan.batch_sharding) for k in ("inputs", "targets")}
        return jfsdp.make_train_step(plan, opt, models.loss_fn(CFG)).lower(jfsdp.abstract_state(plan, opt), batch).as_text()
    assert jfsdp.make_mesh("2x8", tensor=1).axis_names == ("data", "fsdp")
    base = lowered(jfsdp.make_mesh("2x8"))
    assert lowered(jfsdp.make_mesh("2x8", tensor=1), tensor_plan=factory.tensor_plan(CFG)) == base
    assert '"tensor"' not in base


def test_bad_input_and_what_is_not_supported_yet():
    """T must divide the devices, the heads, the KV heads and the sequence; a plan is required, its rules
    must match; NO_SHARD, rowwise float8 and, under a vocabulary-parallel root, a loss that does not reduce over
    `tensor` (models.loss_fn's log-softmax on V/T logits) are refused with a reason. (HF import works at
    T > 1: tests/test_hf_interop.py.)"""
    with pytest.raises(jfsdp.ConfigError, match="needs 24 devices"):
        jfsdp.make_mesh("2x4", tensor=3)
    with pytest.raises(jfsdp.ConfigError, match="KV heads"):
        plan_on("1x2", 8)
    with pytest.raises(jfsdp.ConfigError, match="heads"):
        plan_on("2x1", 8, cfg=dataclasses.replace(CFG, n_heads=12, dim=96, n_kv_heads=4))
    with pytest.raises(jfsdp.ConfigError, match="needs tensor_plan"):
        plan_on("2x2", 4, tensor_plan=None)
    with pytest.raises(jfsdp.ConfigError, match="matches no parameter"):
        plan_on("2x2", 4, tensor_plan=jfsdp.TensorPlan({r"mlp/up/kernel": "colwise"}))
    with pytest.raises(jfsdp.ConfigError, match="no_shard is not supported with tensor parallelism"):
        plan_on("2x2", 4, strategy="no_shard")
    with pytest.raises(jfsdp.ConfigError, match="async_tp=True needs a mesh with a tensor axis"):
        plan_on("2x4", 1, tensor_plan=None, async_tp=True)
    with pytest.raises(jfsdp.ConfigError, match="float8 with rowwise scaling is not supported with tensor parallelism"):
        plan_on("2x2", 4, mp_policy=jfsdp.MixedPrecision.parse("fp8-rowwise"))
    plan = plan_on("2x2", 4)
    batch = {k: jax.ShapeDtypeStruct((BATCH, SEQ), jnp.int32, sharding=plan.batch_sharding) for k in ("inputs", "targets")}
    params = jfsdp.abstract_state(plan, jfsdp.adamw(ref.LR)).params
    with pytest.raises(jfsdp.ConfigError, match="the loss must reduce over `tensor`"):   # log_softmax on V/T logits
        jax.eval_shape(plan.loss(models.loss_fn(CFG)), params, batch)
    odd = {k: np.zeros((BATCH, 6), np.int32) for k in ("inputs", "targets")}
    with pytest.raises(jfsdp.ConfigError, match="sequence parallelism splits axis 1"):
        plan.check_batch(odd)


@pytest.mark.parametrize("argv,why", [
    (["train.py", "--mesh", "2x4", "--tensor", "2", "--precision", "fp8-rowwise"], "--precision fp8-rowwise is not supported with tensor"),
    (["train.py", "--mesh", "2x4", "--tensor", "3", "--seq-len", "64"], "--tensor 3 does not divide --seq-len 64"),
    (["train.py", "--mesh", "2x4", "--async-tp", "on"], "--async-tp on needs --tensor T > 1"),
    (["-m", "jfsdp.plan", "--mesh", "1x4", "--tensor", "4", "--model", "llama-test", "--no-compile"],
     "tensor 4 does not divide the KV heads (2)"),
])
def test_command_lines_refuse_with_one_line(argv, why):
    """train.py and the planner: what --tensor does not support, or a T that does not divide the model
    (found by the engine, once jax has started), is one `error:` line, exit status 2."""
    import os
    import subprocess
    import sys
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, *argv], capture_output=True, text=True, cwd=repo, timeout=120,
                       env={**os.environ, "PYTHONPATH": repo})
    assert r.returncode == 2, r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and why in errors[0], r.stderr
