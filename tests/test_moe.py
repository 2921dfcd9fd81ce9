"""Mixture of Experts (models/moe.py, jfsdp/engine/moe.py): the MoE Llama on 1x8, 2x4 and 8x1 in gather mode
and expert-parallel mode with 1 and 2 chunks against a plain single-device MoE written without jfsdp
(tests/moe_reference.py: every expert on every token, no dispatch); routing and capacity against a
numpy loop; each mode's communication read from the compiled program against its formula; the cost
model's choice; compiled memory flat in depth in both modes; bad options as ConfigErrors."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jfsdp



import jfsdp.runtime.metrics
import jfsdp.planning.hlo
import jfsdp.engine.moe
import models
from jfsdp.planning import hlo
from jfsdp.planning import memory
from jfsdp.runtime import metrics as jm
from models import factory, moe
from models.llama import lm_loss
from tests import moe_reference as mref
from tests import reference as ref

BATCH, SEQ = 16, 12
# capacity_factor E/k: every expert can take all T tokens of a sequence, so nothing is dropped and
# the dispatching model equals the dense reference exactly
CFG = dataclasses.replace(models.get_config("moe-test"), capacity_factor=4.0)
# the other cases without moe-test's dense first stage (compile time); the dense + MoE model runs on 2x4 EP k=2
NO_DENSE = dataclasses.replace(CFG, n_dense_layers=0)
FULL_CASE = ("2x4", "ep", 2)
# (8x1 ep with 2 chunks is left out: S = 1 sends nothing, and 2 chunks run on 1x8 and 2x4; its ~3 s went to
# the T = 2 case, test_tensor_parallel_matches_plain_moe)
CASES = [(m, mode, k) for m in ("1x8", "2x4", "8x1") for mode, k in (("gather", 1), ("ep", 1), ("ep", 2))
         if (m, mode, k) != ("8x1", "ep", 2)]


def _batch(seed=0):
    tok = np.random.default_rng(seed).integers(0, CFG.vocab_size, (BATCH, SEQ + 1))
    return {"inputs": jnp.asarray(tok[:, :-1], jnp.int32), "targets": jnp.asarray(tok[:, 1:], jnp.int32)}


def _plan(cfg, mesh_spec, x, **kw):
    r, s = jfsdp.parse_mesh(mesh_spec)
    root, stages = moe.parts(cfg)
    return jfsdp.fully_shard(jfsdp.Staged(root, stages), jfsdp.make_mesh(mesh_spec, jax.devices()[: r * s]), x, **kw)


@pytest.fixture(scope="module")
def references():
    cache = {}

    def get(cfg):
        if cfg not in cache:
            batch = _batch()
            root, stages = moe.parts(cfg)
            with jax.default_device(jax.devices()[0]):
                params = ref.init_staged(root, stages, batch["inputs"])
                loss, grads = jax.jit(jax.value_and_grad(lambda p: mref.loss(cfg, p, batch)))(params)
            cache[cfg] = batch, jax.device_get(params), float(loss), jax.device_get(grads)
        return cache[cfg]
    return get


TRAIN_METRICS = {"aux": moe.aux_loss, "dropped": moe.dropped_fraction}   # the run's model metrics (jfsdp/runtime/build.py)


@pytest.mark.parametrize("mesh_spec,mode,chunks", CASES)
def test_matches_plain_moe(references, mesh_spec, mode, chunks):
    """Loss within 1e-5 relative, first-step gradients within 1e-5 of each leaf's largest. On 2x4 EP
    k=2 the whole moe-test (a dense stage, then MoE) with remat full, so that the all-to-alls are also recomputed in the backward pass. On 2x4 EP k=2 the
    metrics (moe.dropped_fraction: 0; moe.aux_loss: the reference's) through jfsdp.runtime.metrics.forward_metrics."""
    full = (mesh_spec, mode, chunks) == FULL_CASE
    cfg = CFG if full else NO_DENSE
    reference = references(cfg)
    batch, params, want_loss, want_grads = reference
    remat = "full" if full else "none"
    plan = _plan(cfg, mesh_spec, jax.ShapeDtypeStruct(batch["inputs"].shape, jnp.int32), remat=remat,
                 moe=jfsdp.MoE(mode=mode, chunks=chunks))
    assert [s and (s.mode, s.chunks) for s in plan.moe_stages] == [None] * full + [(mode, chunks)]
    params, batch = plan.shard(params), plan.put_batch(batch)
    loss, grads = jax.jit(plan.loss_and_grad(moe.loss(lm_loss, cfg.aux_coef)))(params, batch)
    if full:   # the metrics a trainer logs, as train.py measures them (one forward pass for both)
        got = jax.jit(jm.forward_metrics(plan, TRAIN_METRICS))(params, batch)
        assert float(got["dropped"]) == 0.0
        want_aux = float(jnp.mean(mref.forward(cfg, reference[1], reference[0]["inputs"])[1]))
        assert float(got["aux"]) == pytest.approx(want_aux, rel=1e-5)
    np.testing.assert_allclose(float(loss), want_loss, rtol=1e-5)
    ref.close(plan.gather(grads), want_grads, 1e-5, "grad")


def test_forward_metrics_equal_one_pass_each():
    """train.py's model metrics in one forward pass (jfsdp.runtime.metrics.forward_metrics) equal, bit for bit,
    each metric's own pass through plan.loss, on a router that drops choices (capacity 0.5)."""
    cfg = dataclasses.replace(NO_DENSE, capacity_factor=0.5)
    batch = _batch(1)
    plan = _plan(cfg, "2x2", jax.ShapeDtypeStruct(batch["inputs"].shape, jnp.int32), moe=jfsdp.MoE(mode="ep"))
    params, batch = plan.init(jax.random.key(1)), plan.put_batch(batch)
    got = jax.jit(jm.forward_metrics(plan, TRAIN_METRICS))(params, batch)
    assert sorted(got) == ["aux", "dropped"]
    for name, fn in TRAIN_METRICS.items():
        assert float(got[name]) == float(jax.jit(plan.loss(fn))(params, batch)), name
    assert 0.05 < float(got["dropped"]) < 0.95 and float(got["aux"]) > 0
    with pytest.raises(jfsdp.ConfigError, match="metric 'rows' must return a scalar"):
        jm.forward_metrics(plan, {"rows": lambda out, b: out["moe_stats"][:, 0]})(params, batch)


# ---- routing: priority, capacity and the dropped count against a plain loop

def _route_loop(logits, k, cap):
    b, t, e = logits.shape
    slot, dropped, load = np.full((b, t, k), e * cap), np.zeros(b), np.zeros(b)
    for r in range(b):
        order = np.argsort(-logits[r], axis=-1, kind="stable")[:, :k]
        fill, picked = np.zeros(e, int), np.zeros(e, int)
        for j in range(k):           # all first choices before any second choice
            for i in range(t):
                ex = order[i, j]
                picked[ex] += 1
                if fill[ex] < cap:
                    slot[r, i, j] = ex * cap + fill[ex]
                    fill[ex] += 1
                else:
                    dropped[r] += 1
        load[r] = picked.max()
    return slot, dropped, load


def test_routing_capacity_and_drops():
    logits = np.random.default_rng(3).normal(size=(3, 20, 5)).astype(np.float32)
    logits[0, :, 2] += 3.0   # sequence 0 crowds expert 2: drops
    for k, cap in [(1, 3), (2, 4), (2, 20)]:
        slot, gate, aux, dropped, load = jax.jit(moe.route, static_argnums=(1, 2))(jnp.asarray(logits), k, cap)
        want_slot, want_dropped, want_load = _route_loop(logits, k, cap)
        np.testing.assert_array_equal(np.asarray(slot), want_slot)
        np.testing.assert_array_equal(np.asarray(dropped), want_dropped)
        np.testing.assert_array_equal(np.asarray(load), want_load)   # the capacity that drops nothing
        assert (want_load > cap).tolist() == (want_dropped > 0).tolist()
        np.testing.assert_allclose(np.asarray(gate).sum(-1), 1.0, rtol=1e-6)
    assert want_dropped.sum() == 0 and np.asarray(aux)[0] > np.asarray(aux)[1:].max()


# ---- communication, cost model and memory, read from the compiled train step

TOKENS = (8, 32)
# experts outweigh tokens: 8 experts of 3 x 64 x 256 (1.5 MiB fp32 per unit) against buckets of
# 8 x 10 x 64 per device: expert parallelism must win
BIG_EXPERTS = moe.MoEConfig(vocab_size=61, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, expert_dim=256, n_experts=8,
                            top_k=2, capacity_factor=1.25)
# tokens outweigh experts: 8 experts of 3 x 64 x 8 against 2 sequences of 256 tokens per device
SMALL_EXPERTS = dataclasses.replace(BIG_EXPERTS, expert_dim=8)


@pytest.fixture(scope="module")
def compiled():
    out = {}
    x = jax.ShapeDtypeStruct(TOKENS, jnp.int32)
    opt, batch = jfsdp.adamw(1e-3), {"inputs": x, "targets": x}
    for mode in ("gather", "ep"):
        for depth in (2, 4):
            cfg = dataclasses.replace(BIG_EXPERTS, n_layers=depth)
            plan = _plan(cfg, "1x8", x, remat="full", moe=jfsdp.MoE(mode=mode, chunks=1))
            out[mode, depth] = (plan, memory.compile_step(plan, opt, moe.loss(lm_loss, cfg.aux_coef), batch))
    return out


@pytest.mark.parametrize("mode", ["gather", "ep"])
def test_communication_equals_each_modes_formula(compiled, mode):
    """Per kind, bytes sent per device per step in the compiled HLO within 5% of the formula
    (memory.comm_formula, which takes each EP stage's experts out of the gathers and reduce-scatters
    and adds the cost model's all-to-all bytes); and the expert part alone: gather mode's extra
    all-gather + reduce-scatter over EP mode's equals the cost model's weight volume, EP's all-to-all
    its token volume."""
    plan, c = compiled[mode, 4]
    measured, formula = memory.comm_measured(c, 8), memory.comm_formula(plan)
    assert "unknown_loops" not in hlo.per_step(c.as_text(), 8)
    for kind in ("all-gather", "reduce-scatter", "all-to-all"):
        assert measured[kind] == pytest.approx(formula[kind], rel=0.05, abs=1.0), kind
    cost = plan.moe_stages[0].costs
    if mode == "ep":
        assert measured["all-to-all"] == pytest.approx(cost["ep"], rel=0.05)
        g_plan, g_c = compiled["gather", 4]
        gm = memory.comm_measured(g_c, 8)
        weights = gm["all-gather"] + gm["reduce-scatter"] - measured["all-gather"] - measured["reduce-scatter"]
        assert weights == pytest.approx(cost["gather"], rel=0.05)
    else:
        assert measured["all-to-all"] == 0


def test_cost_model_picks_the_cheaper_mode(compiled):
    """Each mode wins once. BIG_EXPERTS: 'auto' picks ep, and the compiled gather-mode step sends more
    than the compiled EP step. SMALL_EXPERTS (512 tokens per device): 'auto' picks gather; its
    expert weights' volume is below the tokens' (both figures are the formulas checked above)."""
    x = jax.ShapeDtypeStruct(TOKENS, jnp.int32)
    big = _plan(dataclasses.replace(BIG_EXPERTS, n_layers=4), "1x8", x, remat="full", moe=jfsdp.MoE())
    assert big.moe_stages[0].mode == "ep" and "cost model" in big.moe_stages[0].why
    sent = {m: memory.comm_measured(compiled[m, 4][1], 8)["total"] for m in ("gather", "ep")}
    assert sent["ep"] < sent["gather"], sent
    x = jax.ShapeDtypeStruct((16, 256), jnp.int32)
    small = _plan(SMALL_EXPERTS, "1x8", x, remat="full", moe=jfsdp.MoE())
    s = small.moe_stages[0]
    assert s.mode == "gather" and s.costs["gather"] < s.costs["ep"], s
    text = "\n".join(jfsdp.engine.moe.describe(small))
    assert "gather" in text and "cost model" in text


@pytest.mark.parametrize("mode", ["gather", "ep"])
def test_full_shard_memory_flat_in_depth(compiled, mode):
    """2 -> 4 MoE units: XLA's temp memory grows by the kept activations and gradient shards of 2 units,
    far less than 2 gathered units (a gathered unit's experts alone are 1.5 MiB)."""
    (p2, c2), (p4, c4) = compiled[mode, 2], compiled[mode, 4]
    grow = memory.measure(c4)["temp"] - memory.measure(c2)["temp"]
    unit = 4 * sum(int(np.prod(l.stored_shape)) for l in
                   jax.tree.leaves(p4.layouts["stages"][0], is_leaf=lambda l: isinstance(l, jfsdp.Layout)))
    assert unit > 1_500_000
    saved_input = TOKENS[0] // 8 * TOKENS[1] * BIG_EXPERTS.dim * 4 + TOKENS[0] // 8 * 3 * 4
    expected = 2 * (saved_input + unit / 8)
    assert grow < 0.35 * 2 * unit, (grow, unit)
    assert grow <= 1.25 * expected, (grow, expected)


# ---- bad options

def test_tensor_parallel_matches_plain_moe(references):
    """The whole moe-test (a dense stage, then MoE) at T = 2 on 1x2x2, expert-parallel over fsdp x tensor
    (E/(S*T) = 2 experts a device), remat full, the fused vocabulary-parallel loss: attention and the dense
    FFN tensor-parallel (models/factory.py's plan), each MoE layer on whole sequences of half the rows
    (jfsdp/engine/parallel/moe_rows.py). Loss within 1e-5 relative, gradients within 1e-5 of each leaf's
    largest. (With the MoE layer run on half sequences instead, the aux loss moved the loss by 5e-5.)"""
    batch, params, want_loss, want_grads = references(CFG)
    model, option, loss_fn = factory.language_model(CFG, "fused", moe="ep")
    mesh = jfsdp.make_mesh("1x2", tensor=2, devices=jax.devices()[:4])
    plan = jfsdp.fully_shard(model, mesh, jax.ShapeDtypeStruct(batch["inputs"].shape, jnp.int32), remat="full",
                             moe=option, tensor_plan=factory.tensor_plan(CFG))
    assert [s and (s.mode, s.site.buckets[:2]) for s in plan.moe_stages] == [None, ("ep", (8, 4 * SEQ))]
    params, batch = plan.shard(params), plan.put_batch(batch)
    loss, grads = jax.jit(plan.loss_and_grad(loss_fn))(params, batch)
    np.testing.assert_allclose(float(loss), want_loss, rtol=1e-5)
    ref.close(plan.gather(grads), want_grads, 1e-5, "grad")
    # the metrics a trainer logs, on the sequence-split batch: no choice dropped of all the routed ones (t*k a
    # sequence, counted by the layer, not by the block that sees n/T tokens), the reference's aux loss
    routed = lambda out, _: jnp.mean(out["moe_stats"][:, moe.ROUTED])
    got = jax.jit(jm.forward_metrics(plan, {**TRAIN_METRICS, "routed": routed}))(params, batch)
    assert float(got["dropped"]) == 0.0 and float(got["routed"]) == CFG.n_layers * SEQ * CFG.top_k
    want_logits, want_aux = mref.forward(CFG, references(CFG)[1], references(CFG)[0]["inputs"])
    assert float(got["aux"]) == pytest.approx(float(jnp.mean(want_aux)), rel=1e-5)
    # the logits a sampler reads (train.py's plain head, vocabulary-parallel, the 259 entries padded to 260):
    # whole, unpadded, beside the per-row router statistics
    logits = jfsdp.fully_shard(factory.language_model(CFG, "plain", moe="ep", head="head")[0], mesh,
                               jax.ShapeDtypeStruct(batch["inputs"].shape, jnp.int32), moe=option,
                               tensor_plan=factory.tensor_plan(CFG))
    out = jax.jit(logits.apply)(params, batch["inputs"])
    assert out["moe_stats"].shape == (BATCH, 5)
    np.testing.assert_allclose(out["out"], want_logits, atol=1e-5 * float(jnp.max(jnp.abs(want_logits))))


def test_config_errors():
    x = jax.ShapeDtypeStruct((16, 8), jnp.int32)
    with pytest.raises(jfsdp.ConfigError, match="divide over the 16 fsdp"):
        _plan(CFG, "1x16", x, moe=jfsdp.MoE(mode="ep"))
    with pytest.raises(jfsdp.ConfigError, match="sharded"):
        _plan(CFG, "1x8", x, strategy="no_shard", moe=jfsdp.MoE(mode="ep"))
    with pytest.raises(jfsdp.ConfigError, match="applies to expert-parallel"):
        _plan(CFG, "1x8", x, moe=jfsdp.MoE(mode="gather", chunks=2))
    with pytest.raises(jfsdp.ConfigError, match="2 stages"):
        _plan(CFG, "1x8", x, moe=jfsdp.MoE(mode=("ep",)))
    with pytest.raises(jfsdp.ConfigError, match="unknown moe mode"):
        _plan(CFG, "1x8", x, moe=jfsdp.MoE(mode="scatter"))
    with pytest.raises(jfsdp.ConfigError, match="no stage calls an experts module"):
        _plan(CFG, "1x8", x, moe=jfsdp.MoE(experts="Nothing"))
    tp = dict(tensor_plan=factory.tensor_plan(CFG))   # at T = 2: adaptive mode and float8 are refused with a reason
    mesh = jfsdp.make_mesh("1x2", tensor=2, devices=jax.devices()[:4])
    with pytest.raises(jfsdp.ConfigError, match="adaptive is not supported with tensor parallelism yet .*: its load maximum"):
        jfsdp.fully_shard(jfsdp.Staged(*moe.parts(CFG)), mesh, x, moe=jfsdp.MoE(mode="adaptive"), **tp)
    with pytest.raises(jfsdp.ConfigError, match="float8 with an MoE model is not supported with tensor"):
        jfsdp.fully_shard(jfsdp.Staged(*moe.parts(CFG)), mesh, x, moe=jfsdp.MoE(mode="gather"),
                          mp_policy=jfsdp.MixedPrecision.parse("fp8"), **tp)
    # 'auto' never picks ep where it cannot run: 8 experts on 16 shards
    assert _plan(CFG, "1x16", x, moe=jfsdp.MoE()).moe_stages[1].mode == "gather"


# ---- adaptive pipelining on the H100 compile-only target

@pytest.mark.skipif(__import__("sys").platform != "linux", reason="jax-cuda13-plugin: Linux wheels only")
def test_chunked_all_to_all_overlaps_on_h100():
    """Compiled by XLA:GPU for an H100 (no GPU needed): the k that 'auto' picks for a GPU is > 1, and
    with it less all-to-all is left with no matmul in flight (jfsdp.planning.hlo.overlap) than with k = 1."""
    from jfsdp.planning import targets
    cfg = moe.MoEConfig(vocab_size=512, dim=256, n_layers=1, n_dense_layers=0, n_heads=4, n_kv_heads=4,
                        expert_dim=256, n_experts=8, top_k=2, capacity_factor=1.25, attention="cudnn")
    x = jax.ShapeDtypeStruct((8, 512), jnp.int32)
    mesh = jfsdp.make_mesh("1x8", targets.devices("h100", "1x8"))
    exposed = {}
    with targets.tracing_for("h100"):
        for k in ("auto", 1):
            root, stages = moe.parts(cfg)
            plan = jfsdp.fully_shard(jfsdp.Staged(root, stages), mesh, x, remat="full",
                                     mp_policy=jfsdp.MixedPrecision.parse("bf16"),
                                     moe=jfsdp.MoE(mode="ep", chunks=k, backend="gpu"))
            c = targets.compile_step("h100", plan, jfsdp.adamw(1e-4), moe.loss(lm_loss, cfg.aux_coef),
                                     {"inputs": x, "targets": x})
            a2a = [o for o in hlo.overlap(c.as_text(), 8) if o.collective.kind == "all-to-all"]
            s = hlo.overlap_summary(a2a)["all-to-all"]
            exposed[plan.moe_stages[0].chunks] = (s["exposed_bytes"], s["exposed_bytes"] + s["hidden_bytes"])
    chosen = max(exposed)
    assert chosen > 1 and set(exposed) == {1, chosen}
    assert exposed[chosen][1] == pytest.approx(exposed[1][1])          # same bytes, split into chunks
    assert exposed[chosen][0] < 0.75 * exposed[1][0], exposed
