"""Frozen parameters (`trainable=`, jfsdp/train/frozen.py): the same training as a single-device
reference that updates only the unfrozen leaves, frozen leaves bit-identical, no reduce-scatter and no
optimizer state for them in the compiled step, and checkpoints that save and restore them."""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jfsdp
import models
from jfsdp.io import checkpoint as jckpt
from jfsdp.planning import memory
from jfsdp.train import frozen
from tests import reference as ref

CFG = dataclasses.replace(models.get_config("llama-test"), n_layers=2)
BATCH, SEQ, STEPS = 8, 16, 3
FROZEN = ("tok_embeddings", "feed_forward")   # the (tied) embedding and the MLPs: only attention and norms train


def is_trainable(path):
    return not any(f in path for f in FROZEN)


def _batches():
    return ref.token_batches(CFG.vocab_size, STEPS, BATCH, SEQ, seed=1)


@functools.lru_cache(maxsize=None)
def _init():
    root, unit, n = models.parts(CFG)
    with jax.default_device(jax.devices()[0]):
        return jax.device_get(ref.init_params(root, unit, n, _batches()[0]["inputs"]))


def _plan(mesh_spec="2x4"):
    r, s = jfsdp.parse_mesh(mesh_spec)
    root, unit, n = models.parts(CFG)
    plan = jfsdp.fully_shard(jfsdp.Stacked(root, unit, n), jfsdp.make_mesh(mesh_spec, jax.devices()[: r * s]),
                             jnp.zeros((BATCH, SEQ), jnp.int32), remat="full")
    opt = jfsdp.adamw(ref.LR, b1=ref.B1, b2=ref.B2, eps=ref.EPS, weight_decay=ref.WD, clip_norm=ref.CLIP,
                      mask=plan.decay_mask())
    return plan, opt


@functools.lru_cache(maxsize=None)
def _trained():
    plan, opt = _plan()
    state = jfsdp.init_state(plan, opt, params=plan.shard(_init()), trainable=is_trainable)
    step = jfsdp.make_train_step(plan, opt, models.loss_fn(CFG), trainable=is_trainable)
    compiled = step.lower(state, jax.device_put(_batches()[0], plan.batch_sharding)).compile()
    losses = []
    for b in _batches():
        state, m = step(state, jax.device_put(b, plan.batch_sharding))
        losses.append(float(m["loss"]))
    return plan, state, losses, compiled


def test_matches_a_reference_that_trains_only_the_unfrozen():
    plan, state, losses, _ = _trained()
    root, unit, _ = models.parts(CFG)
    params = _init()
    labels = jax.tree_util.tree_map_with_path(lambda p, _: "train" if is_trainable(frozen.path_name(p)) else "frozen",
                                              params)
    opt = optax.multi_transform({"train": ref.optimizer(), "frozen": optax.set_to_zero()}, labels)
    loss = lambda p, b: models.loss_fn(CFG)(ref.forward(root, unit, p, b["inputs"]), b)
    with jax.default_device(jax.devices()[0]):
        losses_r, final_r, _ = ref.run_steps(opt, loss, params, _batches())
    np.testing.assert_allclose(losses, losses_r, rtol=1e-5)
    got = jax.device_get(plan.gather(state.params))
    ref.paired(final_r, got, params)   # the same leaves in all three before pairing them by position
    for (path, g), w, p0 in zip(jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(jax.device_get(final_r)),
                                jax.tree.leaves(params)):
        name = frozen.path_name(path)
        if is_trainable(name):
            err = np.max(np.abs(np.asarray(g, np.float64) - w))
            assert err <= ref.PARAM_RTOL * np.max(np.abs(w)) + ref.PARAM_ATOL, name
            assert not np.array_equal(g, p0), f"{name} did not train"
        else:
            assert np.array_equal(g, p0), f"frozen {name} changed"


def test_no_reduce_scatter_and_no_optimizer_state_for_frozen_leaves():
    plan, _, _, compiled = _trained()
    opt = _plan()[1]
    full = jfsdp.make_train_step(plan, opt, models.loss_fn(CFG)).lower(
        jfsdp.abstract_state(plan, opt), memory.abstract_batch(plan, _batches()[0])).compile()
    got, want = memory.comm_measured(compiled, 8), memory.comm_measured(full, 8)
    layouts = jax.tree_util.tree_flatten_with_path(plan.layouts, is_leaf=lambda x: isinstance(x, jfsdp.Layout))[0]
    n_of = lambda path: 1 if frozen.path_name(path).startswith("root") else CFG.n_layers
    size = lambda keep: sum(n_of(p) * int(np.prod(l.stored_shape)) * 4 for p, l in layouts
                            if is_trainable(frozen.path_name(p)) == keep)
    # the gradient reduce-scatter carries the trainable leaves only: (S-1)/S of their bytes
    assert got["reduce-scatter"] == pytest.approx(size(True) * 3 / 4, rel=0.02)
    assert want["reduce-scatter"] == pytest.approx((size(True) + size(False)) * 3 / 4, rel=0.02)
    assert got["all-gather"] == pytest.approx(want["all-gather"], rel=1e-6)   # frozen leaves still gathered
    # optimizer state: AdamW's two moments of the trainable shards only; the arguments drop by the
    # frozen leaves' two moments (measured from the compiled step's buffers)
    state = jfsdp.abstract_state(plan, opt, trainable=is_trainable)
    moments = sum(x.size * 4 for x in jax.tree.leaves(state.opt_state) if x.ndim)   # global shapes
    assert moments == 2 * size(True)
    drop = memory.measure(full)["argument"] - memory.measure(compiled)["argument"]
    assert drop == pytest.approx(2 * size(False) / 4, rel=0.01)


def test_checkpoint_saves_and_restores_them(tmp_path):
    """Saved on 2x4 (the 259-row embedding padded to 260 rows), restored onto 1x8 (264 rows): the
    frozen leaves are in the checkpoint, exact, and export reads the whole model."""
    plan, state, _, _ = _trained()
    c = jckpt.Checkpointer(tmp_path / "ck")
    c.save(STEPS, state, {"model_config": dataclasses.asdict(CFG)}, plan=plan)
    c.wait()
    plan8, opt8 = _plan("1x8")
    restored = c.restore(STEPS, jfsdp.abstract_state(plan8, opt8, trainable=is_trainable))
    want = jax.device_get(plan.gather(state.params))
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(plan8.gather(restored.params)), want)
    # and the training goes on there
    step = jfsdp.make_train_step(plan8, opt8, models.loss_fn(CFG), trainable=is_trainable)
    restored, m = step(restored, jax.device_put(_batches()[0], plan8.batch_sharding))
    assert np.isfinite(float(m["loss"]))
    from jfsdp.export import read_params
    full, _, _ = read_params(str(tmp_path / "ck"))
    assert full["root"]["tok_embeddings"]["embedding"].shape == (CFG.vocab_size, CFG.dim)
    np.testing.assert_array_equal(full["root"]["tok_embeddings"]["embedding"], _init()["root"]["tok_embeddings"]["embedding"])


def test_bad_trainable():
    plan, opt = _plan()
    with pytest.raises(jfsdp.ConfigError, match="nothing would train"):
        jfsdp.make_train_step(plan, opt, models.loss_fn(CFG), trainable=lambda p: False)
    with pytest.raises(jfsdp.ConfigError, match="tree of booleans"):
        jfsdp.make_train_step(plan, opt, models.loss_fn(CFG), trainable={"nope": True})
    # a prefix tree: the whole root frozen
    m = frozen.mask(plan, {"root": False, "units": True})
    assert not any(jax.tree.leaves(m["root"])) and all(jax.tree.leaves(m["units"]))


def test_with_gradient_accumulation_reduced_once():
    """trainable= with grad_sync='once': the same step as with 'every' (SGD: no Adam amplification of
    summation-order noise), frozen leaves untouched, their slots never reduced."""
    plan, _ = _plan()
    opt = optax.sgd(0.5)
    two = _batches()[:2]   # 16 rows: two micro-batches of one row per device
    b = jax.device_put(jax.tree.map(lambda *x: np.concatenate(x), *two), plan.batch_sharding)
    out = {}
    for sync in ("every", "once"):
        state = jfsdp.init_state(plan, opt, params=plan.shard(_init()), trainable=is_trainable)
        step = jfsdp.make_train_step(plan, opt, models.loss_fn(CFG), grad_accum=2, grad_sync=sync,
                                     trainable=is_trainable)
        state, m = step(state, b)
        out[sync] = float(m["loss"]), jax.device_get(plan.gather(state.params))
    assert out["once"][0] == pytest.approx(out["every"][0], rel=1e-6)
    ref.close(out["once"][1], out["every"][1], 1e-6, "params ")
    assert np.array_equal(out["once"][1]["root"]["tok_embeddings"]["embedding"],
                          _init()["root"]["tok_embeddings"]["embedding"])
