"""The public API's contract: clear errors for bad input, deferred init, padding, tied weights."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jfsdp
import models
from jfsdp.planning import hlo
from tests import reference as ref

CFG = models.get_config("llama-test")


def plan_for(mesh_spec="1x16", cfg=CFG, batch=16, seq=16, **kw):
    root, unit, n = models.parts(cfg)
    return jfsdp.fully_shard(jfsdp.Stacked(root, unit, n), jfsdp.make_mesh(mesh_spec),
                             jax.ShapeDtypeStruct((batch, seq), jnp.int32), **kw)


@pytest.mark.parametrize("spec", ["2x", "0x8", "axb", "", "2x8x1", "-1x16", "2 by 8"])
def test_malformed_mesh_is_refused(spec):
    with pytest.raises(jfsdp.ConfigError, match="malformed"):
        jfsdp.make_mesh(spec)


def test_mesh_that_does_not_match_devices_names_both_counts():
    with pytest.raises(jfsdp.ConfigError, match=r"mesh 2x4 needs 8 devices but 16 are present"):
        jfsdp.make_mesh("2x4")
    assert jfsdp.make_mesh("2x4", devices=jax.devices()[:8]).shape == {"data": 2, "fsdp": 4}


def test_unknown_strategy_lists_the_choices():
    with pytest.raises(jfsdp.ConfigError, match="unknown strategy 'zero4'.*full_shard.*hybrid_shard_zero2"):
        plan_for(strategy="zero4")
    assert jfsdp.Strategy.parse("FULL-SHARD") is jfsdp.Strategy.FULL_SHARD


@pytest.mark.parametrize("kw,match", [
    (dict(remat="some"), "unknown remat 'some'"),
    (dict(strategy="shard_grad_op", reshard_after_forward=True), "contradicts"),
    (dict(strategy="no_shard", reshard_after_forward=False), "sharded strategies"),
])
def test_bad_options_are_refused(kw, match):
    with pytest.raises(jfsdp.ConfigError, match=match):
        plan_for(**kw)


def test_unknown_dtype_and_precision_are_refused():
    with pytest.raises(jfsdp.ConfigError, match="unknown dtype 'fp8'"):
        jfsdp.MixedPrecision(param_dtype="fp8")
    with pytest.raises(jfsdp.ConfigError, match="unknown precision 'int4'"):
        jfsdp.MixedPrecision.parse("int4")


def test_reshard_after_forward_false_is_zero2():
    assert plan_for(reshard_after_forward=False).strategy is jfsdp.Strategy.SHARD_GRAD_OP


@pytest.mark.parametrize("batch,accum,match", [
    (12, 1, "batch size 12 does not divide over the 16 devices"),
    (16, 2, "per-device batch 1 does not divide into 2 gradient-accumulation micro-batches"),
])
def test_batch_that_does_not_divide_is_refused(batch, accum, match):
    plan = plan_for()
    params = jax.eval_shape(plan.init, jax.random.key(0))
    tok = jax.ShapeDtypeStruct((batch, 16), jnp.int32)
    with pytest.raises(jfsdp.ConfigError, match=match):
        jax.eval_shape(plan.loss_and_grad(models.loss_fn(CFG), grad_accum=accum), params, {"inputs": tok, "targets": tok})


def test_padding_for_uneven_sizes():
    """On 5 shards: vocab 259 does not divide, so the embedding is flattened and padded by fewer than 5
    elements (259*96 = 24864 -> 24865); ffn 200 divides (w2 split on its rows, no padding); the 96-wide
    norm scales are padded to 100. Not refused, and the padding stays zero through training."""
    root, unit, n = models.parts(CFG)
    plan = jfsdp.fully_shard(jfsdp.Stacked(root, unit, n), jfsdp.make_mesh("1x5", devices=jax.devices()[:5]),
                             jax.ShapeDtypeStruct((15, 16), jnp.int32))
    L = plan.layouts
    assert L["root"]["tok_embeddings"]["embedding"].stored_shape == (24865, 1)
    assert L["units"]["feed_forward"]["w2"]["kernel"].stored_shape == (200, 96)
    assert L["units"]["attention_norm"]["scale"].stored_shape == (100,)
    opt = jfsdp.adamw(1e-2, mask=plan.decay_mask())
    state = jfsdp.init_state(plan, opt, jax.random.key(0))
    step = jfsdp.make_train_step(plan, opt, models.loss_fn(CFG))
    tok = jax.device_put(jnp.asarray(np.random.default_rng(0).integers(0, 259, (15, 16)), jnp.int32), plan.batch_sharding)
    for _ in range(2):
        state, _ = step(state, {"inputs": tok, "targets": tok})
    emb = np.asarray(state.params["root"]["tok_embeddings"]["embedding"])
    norm = np.asarray(state.params["units"]["attention_norm"]["scale"])
    assert np.all(emb[24864:] == 0) and np.all(norm[:, 96:] == 0)
    assert np.any(emb[:24864] != 0)
    mu = state.opt_state[1][0].mu  # clip, then adamw's scale_by_adam state
    assert np.all(np.asarray(mu["root"]["tok_embeddings"]["embedding"])[24864:] == 0)


def test_deferred_init_equals_unsharded_init_and_never_holds_the_model():
    """plan.init builds the shards in place. Its values equal an independent single-device init with
    the documented key split (root from the first key, unit i from split(second key, n)[i]); and the
    compiled init program's per-device output + temp memory is far below the whole model's size."""
    cfg = dataclasses.replace(CFG, n_layers=4)
    plan = plan_for(cfg=cfg)
    root, unit, n = models.parts(cfg)
    key = jax.random.key(7)
    root_key, unit_key = jax.random.split(key)
    tok = jnp.zeros((16, 16), jnp.int32)
    want_root = root.init(root_key, tok, method=lambda m, x: m.head(m.embed(x)))["params"]
    h = root.apply({"params": want_root}, tok, method="embed")
    want_units = [unit.init(k, h)["params"] for k in jax.random.split(unit_key, n)]
    got = plan.gather(plan.init(key))
    want = {"root": want_root, "units": jax.tree.map(lambda *xs: jnp.stack(xs), *want_units)}
    for path, w, g in ref.paired(want, got):   # same bits; erfinv may round differently jitted
        np.testing.assert_allclose(g, np.asarray(w), rtol=1e-6, atol=1e-8, err_msg=path)
    init = jax.jit(plan.init).lower(jax.random.key(0)).compile()
    mem = hlo.memory(init)
    model_bytes = 4 * cfg.num_params()
    assert mem["output"] < 1.2 * model_bytes / 16
    assert mem["output"] + mem["temp"] < model_bytes / 2, (mem, model_bytes)


def test_tied_embeddings_have_one_weight_and_untied_have_two():
    tied = plan_for()
    untied = plan_for(cfg=dataclasses.replace(CFG, tie_embeddings=False))
    assert "output" not in tied.layouts["root"]
    assert untied.layouts["root"]["output"]["kernel"].shape == (96, 259)


def test_example_inputs_batch_does_not_fix_the_batch():
    """Parameter shapes come from example_inputs, but any batch that divides works: a batch of 32 on a
    plan made for 16 gives the single-device reference's loss (1e-5 relative, the fp32 floor of
    docs/numerics.md)."""
    plan = plan_for(batch=16)
    params = plan.init(jax.random.key(0))
    batch = ref.token_batches(CFG.vocab_size, 1, 32, 16, seed=3)[0]
    loss = jax.jit(plan.loss(models.loss_fn(CFG)))(params, jax.device_put(batch, plan.batch_sharding))
    root, unit, _ = models.parts(CFG)
    with jax.default_device(jax.devices()[0]):
        want = models.loss_fn(CFG)(ref.forward(root, unit, jax.device_get(plan.gather(params)), batch["inputs"]), batch)
    assert float(loss) == pytest.approx(float(want), rel=1e-5)


def test_abstract_params_are_what_init_returns():
    """abstract_params reads the shards' shapes from the layouts (nothing traced): each leaf equals what
    deferred init returns (eval_shape of `init`, its out_shardings), with padding (5 shards: rows of the
    norms and elements of the flat kernels), flat leaves (every plan here), tensor parallelism and the
    context axis."""
    root, unit, n = models.parts(CFG)
    x = jax.ShapeDtypeStruct((4, 16), jnp.int32)
    from models import factory
    model = jfsdp.Stacked(root, unit, n)
    plans = [jfsdp.fully_shard(model, jfsdp.make_mesh("1x5", devices=jax.devices()[:5]), jax.ShapeDtypeStruct((5, 16), jnp.int32)),
             plan_for("2x8"),
             jfsdp.fully_shard(model, jfsdp.make_mesh("1x4", devices=jax.devices()[:8], tensor=2), x,
                               tensor_plan=factory.tensor_plan(CFG)),
             jfsdp.fully_shard(factory.language_model(CFG, "plain")[0], jfsdp.make_mesh("1x4", devices=jax.devices()[:8], context=2),
                               x, context_attention=factory.context_kernel(block=4))]
    for plan in plans:
        got, want = plan.abstract_params(), jax.eval_shape(plan.init, jax.random.key(0))
        assert jax.tree.structure(got) == jax.tree.structure(want)
        for g, w, s in zip(jax.tree.leaves(got), jax.tree.leaves(want), jax.tree.leaves(plan.param_shardings)):
            assert (g.shape, g.dtype, g.sharding) == (w.shape, w.dtype, s), (g, w)
