"""Adaptive MoE stages (jfsdp/engine/moe_adaptive.py): each MoE layer call runs the smallest compiled capacity
that holds the router's measured load. Against the plain single-device MoE (tests/moe_reference.py, every
expert on every token: what any capacity that drops nothing computes): training steps on 1x8 and 2x4
whose batches drive the load up and down; the chosen capacity follows the batch with no compile after
the first call; bad options as ConfigErrors."""
import contextlib
import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jfsdp
import models
import models.factory
from jfsdp.config import moe_calibration
from jfsdp.engine import moe_adaptive
from jfsdp.planning import moe_calibrate
from jfsdp.runtime import metrics as jm
from jfsdp.train.step import state_shardings
from models import moe
from models.llama import lm_loss
from tests import moe_reference as mref
from tests import reference as ref

CFG = dataclasses.replace(models.get_config("moe-test"), n_dense_layers=0)
# experts of width 14: the cost model sends the tokens (ep) at capacity 9 and gathers the experts at 12
# (2 sequences per device: 6 all-to-alls, the backward pass runs the forward's again, of 8 x 2 x c x 72 x 4 B:
# 248.8 KB at 9, 331.8 KB at 12, against the experts' 3 x 8 x 72 x 14 x (2 x 4 + 4) B = 290.3 KB per unit,
# all x (S-1)/S)
MIXED = dataclasses.replace(CFG, expert_dim=14)


def batches(n_rows, seq, seeds):
    """Per seed a batch; seed None: every row one repeated token, so that every token of a sequence
    picks the same k experts (the largest load a sequence can put on an expert: T)."""
    out = []
    for seed in seeds:
        if seed is None:
            tok = np.repeat(np.arange(n_rows)[:, None] * 7 % CFG.vocab_size, seq + 1, axis=1)
        else:
            tok = np.random.default_rng(seed).integers(0, CFG.vocab_size, (n_rows, seq + 1))
        out.append({"inputs": jnp.asarray(tok[:, :-1], jnp.int32), "targets": jnp.asarray(tok[:, 1:], jnp.int32)})
    return out


@contextlib.contextmanager
def compiles_counted():
    """A list that collects XLA backend compilations (jax.monitoring events) while the block runs."""
    compiles = []
    listener = lambda event, *a, **k: compiles.append(event) if "backend_compile" in event else None
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield compiles
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


def plan_for(mesh_spec, rows, seq, cfg=CFG, **moe_kw):
    r, s = jfsdp.parse_mesh(mesh_spec)
    root, stages = moe.parts(cfg)
    return jfsdp.fully_shard(jfsdp.Staged(root, stages), jfsdp.make_mesh(mesh_spec, jax.devices()[: r * s]),
                             jax.ShapeDtypeStruct((rows, seq), jnp.int32), moe=jfsdp.MoE(**moe_kw))


def init_params(batch, cfg=CFG):
    """moe-test's initial parameters with the token embeddings scaled up 10x: the router then sees the
    token more than what attention mixes in, so a batch of random tokens spreads its load (at most 8 or 9
    of a sequence's 24 choices on one expert, seeds 0 and 1) and a repeated token piles it up (12): the
    batch drives the skew."""
    root, stages = moe.parts(cfg)
    with jax.default_device(jax.devices()[0]):
        params = jax.device_get(ref.init_staged(root, stages, batch["inputs"]))
    emb = params["root"]["lm"]["tok_embeddings"]
    emb["embedding"] = emb["embedding"] * 10
    return params


# 1x8 'auto' runs both modes (ep at capacity 9, gather at 12) over 3 steps; 2x4 ('ep' in every bucket) and
# 8x1 (S = 1: the load's maximum is taken over `data` alone) over the first 2 (the bucket changes 9 -> 12),
# for the suite's time.
@pytest.mark.parametrize("mesh_spec,run,steps", [("1x8", "auto", 3), ("2x4", "ep", 2), ("8x1", "auto", 2)])
def test_adaptive_training_matches_plain_moe(mesh_spec, run, steps):
    """AdamW steps (random, one-token-per-row, random batches: the load and with it the bucket change,
    9, 12, 9 as test_capacity_follows_the_load shows): losses within 1e-5 relative at every step,
    first-step gradients within 1e-5 of each leaf's largest, of the single-device MoE that drops nothing.
    1x8 'auto': the cost model mixes the modes (ep at 9, gather at 12), so the mode switches with the
    bucket. The state's shardings equal those of the static gather and ep plans: every variant reads
    the one layout."""
    cfg = MIXED if mesh_spec == "1x8" else CFG
    data = batches(16, 12, [0, None, 1][:steps])
    params = init_params(data[0], cfg)
    want_losses, _, want_grads = mref.train(cfg, params, data)
    plan = plan_for(mesh_spec, 16, 12, cfg, mode="adaptive", run=run, buckets=(9, 12))
    modes = {"1x8": ["ep", "gather"], "8x1": ["gather"] * 2}.get(mesh_spec, [run] * 2)
    assert [(v.capacity, v.mode) for v in plan.moe_stages[0].variants] == list(zip((9, 12), modes))
    adamw = jfsdp.adamw(ref.LR, b1=ref.B1, b2=ref.B2, eps=ref.EPS, weight_decay=ref.WD, clip_norm=ref.CLIP)
    opt = optax.chain(ref.keep_gradients(), adamw)
    for static in ("gather", "ep"):
        other = plan_for(mesh_spec, 16, 12, cfg, mode=static, chunks=1)
        assert state_shardings(other, opt) == state_shardings(plan, opt), static
    step = jfsdp.make_train_step(plan, opt, moe.loss(lm_loss, cfg.aux_coef))
    state = jfsdp.init_state(plan, opt, params=params)
    losses = []
    for i, b in enumerate(data):
        with compiles_counted() as compiles:
            state, m = step(state, plan.put_batch(b))
            losses.append(float(m["loss"]))
        assert (compiles != []) == (i == 0), compiles   # compiled once; the bucket changes, the program does not
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    ref.close(plan.gather(state.opt_state[0][0]), want_grads, 1e-5, "grad")


def test_capacity_follows_the_load_without_recompiling():
    """2x4, run='gather' (every variant gathers the experts): one compiled forward picks a smaller capacity for random batches than for a
    batch whose rows repeat one token (there: T, every choice kept, where the static capacity factor
    1.25 drops a measured share); every loss equals the plain MoE's (when nothing is dropped the
    result does not depend on the capacity); no compile after the first call."""
    rows, seq = 16, 12
    data = batches(rows, seq, [0, None, 1])
    params = init_params(data[0])
    plan = plan_for("2x4", rows, seq, mode="adaptive", run="gather", buckets=(6, 9, 12))
    fns = {"capacity": moe.capacity_used, "dropped": moe.dropped_fraction, "loss": moe.loss(lm_loss, CFG.aux_coef)}
    forward = jax.jit(jm.forward_metrics(plan, fns))
    sharded = plan.shard(params)
    got = [forward(sharded, plan.put_batch(data[0]))]
    with compiles_counted() as compiles:
        got += [forward(sharded, plan.put_batch(b)) for b in data[1:]]
    assert compiles == [] and forward._cache_size() == 1
    got = [{k: float(v) for k, v in g.items()} for g in got]
    assert [g["dropped"] for g in got] == [0.0] * 3
    assert [g["capacity"] for g in got] == [9, 12, 9], got
    plain = jax.jit(lambda b: mref.loss(CFG, params, b))
    for g, b in zip(got, data):
        assert g["loss"] == pytest.approx(float(plain(b)), rel=1e-5)
    # one bucket: lax.switch calls its one branch in place (traced outside the unit's interceptor: the
    # variant's ep experts were once met by the whole experts module holding local shards)
    one = plan_for("2x4", rows, seq, mode="adaptive", run="ep", buckets=(12,))
    got = jax.jit(jm.forward_metrics(one, fns))(one.shard(params), one.put_batch(data[1]))
    assert float(got["capacity"]) == 12 and float(got["loss"]) == pytest.approx(float(plain(data[1])), rel=1e-5)
    static = dataclasses.replace(CFG, capacity_factor=1.25)
    root, stages = moe.parts(static)
    out = jax.jit(lambda p, x: ref.forward_staged(root, [u for u, _ in stages], p, x))(params, data[1]["inputs"])
    assert float(moe.dropped_fraction(out, None)) > 0.3   # capacity 4 of 12


def _reference_stats(cfg, params, batch):
    """(aux loss, dropped share, max load) of the single-device model (no jfsdp) on `batch`, at cfg's capacity."""
    root, stages = moe.parts(cfg)
    out = jax.jit(lambda p, x: ref.forward_staged(root, [u for u, _ in stages], p, x))(params, batch["inputs"])
    return float(moe.aux_loss(out, None)), float(moe.dropped_fraction(out, None)), float(moe.max_load(out, None))


def test_train_step_returns_its_own_moe_metrics():
    """make_train_step(metrics=...) (train.py's logged MoE figures): the router's statistics of the step's own
    forward pass, before its update, against the single-device model on the initial parameters. 2x4 adaptive,
    2 micro-batches (one row per device each): one of random rows (a small bucket), one of one-token rows
    (capacity 12 = T): the step reports the largest capacity (12, where a mean would name no bucket) and load,
    nothing dropped, the aux loss averaged over the micro-batches, and the plain MoE's loss. Static gather with
    grad_sync='once' (the other accumulation path): the dropped share at capacity factor 1.25. Bad metrics:
    ConfigErrors."""
    rows, seq = 16, 12
    rand, same = batches(rows, seq, [0, None])
    # device d holds rows 2d, 2d + 1 and runs them as its micro-batches 0 and 1
    mixed = {k: jnp.stack([rand[k][: rows // 2], same[k][: rows // 2]], 1).reshape(rows, seq) for k in rand}
    micro = [{k: v[i::2] for k, v in mixed.items()} for i in (0, 1)]
    params = init_params(rand)
    fns = {"aux": moe.aux_loss, "dropped": moe.dropped_fraction, "capacity": (moe.capacity_used, "max"),
           "load": (moe.max_load, "max")}
    opt, loss_fn = optax.adamw(1e-3), moe.loss(lm_loss, CFG.aux_coef)
    plan = plan_for("2x4", rows, seq, mode="adaptive", run="gather", buckets=(9, 12))
    step = jfsdp.make_train_step(plan, opt, loss_fn, grad_accum=2, metrics=fns)
    _, m = step(jfsdp.init_state(plan, opt, params=params), plan.put_batch(mixed))
    nodrop = dataclasses.replace(CFG, capacity_factor=CFG.n_experts / CFG.top_k)
    want = [_reference_stats(nodrop, params, b) for b in micro]
    assert (float(m["capacity"]), float(m["dropped"]), float(m["load"])) == (12.0, 0.0, 12.0)
    assert float(m["aux"]) == pytest.approx(np.mean([w[0] for w in want]), rel=1e-5)
    assert float(m["loss"]) == pytest.approx(float(jax.jit(lambda b: mref.loss(CFG, params, b))(mixed)), rel=1e-5)
    assert sorted(m) == ["aux", "capacity", "dropped", "grad_norm", "load", "loss"]

    static = plan_for("2x4", rows, seq, mode="gather")
    step = jfsdp.make_train_step(static, opt, loss_fn, grad_accum=2, grad_sync="once", metrics=fns)
    _, m = step(jfsdp.init_state(static, opt, params=params), static.put_batch(mixed))
    want = [_reference_stats(CFG, params, b) for b in micro]
    assert float(m["capacity"]) == 4.0   # ceil(1.25 x 12 x 2 / 8)
    assert float(m["load"]) == max(w[2] for w in want) > 4.0   # above the capacity: it drops
    assert float(m["dropped"]) == pytest.approx(np.mean([w[1] for w in want]), rel=1e-5) and float(m["dropped"]) > 0.1
    assert float(m["aux"]) == pytest.approx(np.mean([w[0] for w in want]), rel=1e-5)

    for bad, match in [({"loss": moe.aux_loss}, "the train step returns itself"),
                       ({"aux": (moe.aux_loss, "min")}, "reduce 'min' is not one of mean, max"),
                       ({"aux": 3}, "is not a function"), ({"aux": (moe.aux_loss,)}, "got 1 items")]:
        with pytest.raises(jfsdp.ConfigError, match=match):
            jfsdp.make_train_step(static, opt, loss_fn, metrics=bad)
    with pytest.raises(jfsdp.ConfigError, match="cannot combine with update_in_backward"):
        jfsdp.make_train_step(static, opt, loss_fn, update_in_backward=True, metrics=fns)


def test_bad_adaptive_options():
    x = (16, 8)
    with pytest.raises(jfsdp.ConfigError, match="strictly increasing"):
        plan_for("1x8", *x, mode="adaptive", buckets=(4, 4))
    with pytest.raises(jfsdp.ConfigError, match=r"below ceil\(T\*k/E\) = ceil\(8\*2/8\) = 2"):
        plan_for("1x8", *x, mode="adaptive", buckets=(1, 8))
    with pytest.raises(jfsdp.ConfigError, match="divide over the 16 fsdp"):
        plan_for("1x16", *x, mode="adaptive", run="ep")
    # a capacity factor caps the buckets: ceil(1.25 * 8 * 2 / 8) = 3
    assert [v.capacity for v in plan_for("1x8", *x, mode="adaptive", capacity_factor=1.25).moe_stages[0].variants] == [2, 3]
    with pytest.raises(jfsdp.ConfigError, match="apply to --moe adaptive"):
        models.factory.language_model(CFG, moe="ep", buckets="2,4")


def test_calibration_picks_the_fastest_measured_variant():
    """MoE(calibration={(capacity, mode, chunks): seconds}) (jfsdp/planning/moe_calibrate.py): each bucket runs
    its fastest measured (mode, chunks), within what the option allows (`moe_adaptive.calibrated`); a
    bucket without a measurement is a ConfigError. moe_calibrate.candidates lists what there is to measure."""
    table = {(2, "gather", 1): 1.0, (2, "ep", 1): 2.0, (2, "ep", 2): 0.5, (4, "gather", 1): 1.0, (4, "ep", 1): 3.0}
    plan = plan_for("1x8", 16, 8, mode="adaptive", buckets=(2, 4), calibration=table)
    got = plan.moe_stages[0].variants
    assert [(v.capacity, v.mode, v.chunks, v.seconds) for v in got] == [(2, "ep", 2, 0.5), (4, "gather", 1, 1.0)]
    assert moe_calibrate.candidates(plan, chunks=(1, 2, 4, 8)) == [
        (2, "gather", 1), (2, "ep", 1), (2, "ep", 2), (2, "ep", 4), (4, "gather", 1), (4, "ep", 1), (4, "ep", 2),
        (4, "ep", 4), (4, "ep", 8)]   # 2 sequences per device: 4 and 8 slots
    both = ("gather", "ep")
    assert moe_adaptive.calibrated(table, 0, 2, both, 1, 4) == ("gather", 1, 1.0)   # chunks=1: ep k=2 not allowed
    assert moe_adaptive.calibrated(table, 0, 2, both, "auto", 1) == ("gather", 1, 1.0)   # 1 slot: no 2 chunks
    assert moe_adaptive.calibrated(table, 0, 4, ("ep",), "auto", 8) == ("ep", 1, 3.0)   # run='ep'
    with pytest.raises(jfsdp.ConfigError, match="no measured gather/ep variant at capacity 8; it measures capacities 2, 4[.] "):
        moe_adaptive.calibrated(table, 0, 8, both, "auto", 16)


def test_calibration_file(tmp_path):
    """--moe-calibration FILE[:PART] (train.py, jfsdp.plan): jfsdp.config.moe_calibration.read gives the table from a list of rows,
    from an object holding them under "calibration", or from one part of benchmarks/moe_adaptive.py's file; what
    is not such a file is a ConfigError naming it. models.factory.language_model reads a path into the MoE option."""
    rows = [{"capacity": 2, "mode": "gather", "chunks": 1, "seconds": 1.0}, {"capacity": 2, "mode": "ep", "chunks": 2,
                                                                            "seconds": 0.5}]
    want = {(2, "gather", 1): 1.0, (2, "ep", 2): 0.5}
    files = {"list.json": rows, "object.json": {"calibration": rows, "device": "x"},
             "parts.json": {"cpu": {"calibration": rows}, "h100": {"static": []}},
             "two.json": {"cpu": {"calibration": rows}, "gpu": {"calibration": rows[:1]}},
             "bad_row.json": [{**rows[0], "seconds": -1}], "bad_mode.json": [{**rows[0], "mode": "tp"}],
             "empty.json": {"calibration": []}}
    for name, content in files.items():
        (tmp_path / name).write_text(json.dumps(content))
    (tmp_path / "text.json").write_text("capacity,mode\n")
    for name in ("list.json", "object.json", "parts.json", "parts.json:cpu"):
        assert moe_calibration.read(str(tmp_path / name)) == want, name
    assert moe_calibration.read(str(tmp_path / "two.json:gpu")) == {(2, "gather", 1): 1.0}
    for name, why in [("two.json", "several parts hold a calibration .cpu, gpu.: name one as"),
                      ("parts.json:h100", "no \"calibration\" list in it"), ("parts.json:tpu", "no part 'tpu' .it has cpu, h100."),
                      ("bad_row.json", "row 0 .* is not"), ("bad_mode.json", "row 0"), ("empty.json", "non-empty list"),
                      ("text.json", "not JSON"), ("missing.json", "No such file")]:
        with pytest.raises(jfsdp.ConfigError, match=f"moe calibration .*{why}"):
            moe_calibration.read(str(tmp_path / name))
    _, option, _ = models.factory.language_model(CFG, moe="adaptive", calibration=str(tmp_path / "list.json"))
    assert option.calibration == want
    with pytest.raises(jfsdp.ConfigError, match="--moe-calibration apply to --moe adaptive"):
        models.factory.language_model(CFG, moe="auto", calibration=str(tmp_path / "list.json"))
