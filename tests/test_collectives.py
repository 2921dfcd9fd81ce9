"""What the compiled program does, read from XLA: which collectives, where, how big, in which dtype;
and per-device memory. Nothing is executed: programs are lowered from abstract inputs."""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jfsdp
import models
from jfsdp.planning import hlo

BATCH, SEQ = 16, 32


@functools.lru_cache(maxsize=None)
def compile_grad(mesh_spec, strategy, remat="full", n_layers=4, precision="fp32"):
    """The compiled (params, batch) -> (loss, grads) program of llama-test with n_layers units (each
    program compiled once per module: the placement tests read the 8-unit ones the memory tests use)."""
    cfg = dataclasses.replace(models.get_config("llama-test"), n_layers=n_layers)
    root, unit, n = models.parts(cfg)
    mesh = jfsdp.make_mesh(mesh_spec)
    tokens = jax.ShapeDtypeStruct((BATCH, SEQ), jnp.int32)
    plan = jfsdp.fully_shard(jfsdp.Stacked(root, unit, n), mesh, tokens, strategy=strategy, remat=remat,
                             mp_policy=jfsdp.MixedPrecision.parse(precision))
    params = plan.abstract_params()
    tok = jax.ShapeDtypeStruct((BATCH, SEQ), jnp.int32, sharding=plan.batch_sharding)
    compiled = jax.jit(plan.loss_and_grad(models.loss_fn(cfg))).lower(params, {"inputs": tok, "targets": tok}).compile()
    return cfg, plan, compiled


def unit_bytes(plan, dtype_bytes=4):
    """Bytes of one whole (unsharded, unpadded) unit and of one unit's shard on each device."""
    layouts = jax.tree.leaves(plan.layouts["units"], is_leaf=lambda l: isinstance(l, jfsdp.Layout))
    full = sum(int(np.prod(l.shape)) for l in layouts) * dtype_bytes
    shard = sum(int(np.prod(l.stored_shape)) // l.shards for l in layouts) * dtype_bytes
    return full, shard


def by_loop(colls, kind):
    return hlo.loops_with(colls, kind)


def test_full_shard_gathers_in_forward_and_backward_and_reduce_scatters():
    cfg, plan, c = compile_grad("1x16", "full_shard", n_layers=8)
    colls = hlo.collectives(c.as_text(), 16)
    n_leaves = len(jax.tree.leaves(plan.layouts["units"], is_leaf=lambda l: isinstance(l, jfsdp.Layout)))
    gathers = {loop: k for loop, k in by_loop(colls, "all-gather").items() if loop}
    # two loops gather every unit: the forward scan and the backward scan (ZeRO-3 regathers)
    assert len(gathers) == 2 and all(k == n_leaves for k in gathers.values()), gathers
    rs = {loop: k for loop, k in by_loop(colls, "reduce-scatter").items() if loop}
    assert len(rs) == 1 and list(rs.values())[0] == n_leaves, rs
    # the reduce-scatters sit in a loop that also gathers: the backward scan
    assert set(rs) <= set(gathers)
    # no all-reduce of parameter size: only the scalar loss
    assert all(x.result_bytes <= 8 for x in colls if x.kind == "all-reduce"), \
        [(x.result_bytes, x.group_size) for x in colls if x.kind == "all-reduce"]
    assert all(x.group_size == 16 for x in colls if x.kind in ("all-gather", "reduce-scatter"))


def test_shard_grad_op_gathers_once():
    cfg, plan, c = compile_grad("1x16", "shard_grad_op", n_layers=8)
    colls = hlo.collectives(c.as_text(), 16)
    gathers = {loop for loop, k in by_loop(colls, "all-gather").items() if loop}
    rs = {loop for loop, k in by_loop(colls, "reduce-scatter").items() if loop}
    assert len(gathers) == 1, gathers          # forward only
    assert rs and not (rs & gathers)           # reduce-scatters in the backward loop, which gathers nothing
    assert all(x.result_bytes <= 8 for x in colls if x.kind == "all-reduce")


def test_no_shard_all_reduces_only():
    cfg, plan, c = compile_grad("2x8", "no_shard")
    colls = hlo.collectives(c.as_text(), 16)
    kinds = {x.kind for x in colls}
    assert kinds == {"all-reduce"}, kinds
    assert all(x.group_size == 16 for x in colls)
    # per step the all-reduced gradient bytes are the whole model (the in-loop op runs n_units times)
    per_step = hlo.per_step(c.as_text(), 16)
    psi_bytes = 4 * sum(int(np.prod(x.shape)) for x in jax.tree.leaves(jax.eval_shape(plan.init_full, jax.random.key(0))))
    assert per_step["all-reduce"]["result_bytes"] == pytest.approx(psi_bytes + 4, rel=1e-3)


def test_hybrid_reduce_scatters_over_fsdp_and_all_reduces_shards_over_data():
    cfg, plan, c = compile_grad("2x8", "hybrid_shard")
    colls = hlo.collectives(c.as_text(), 16)
    assert all(x.group_size == 8 for x in colls if x.kind in ("all-gather", "reduce-scatter"))
    data_ar = [x for x in colls if x.kind == "all-reduce" and x.group_size == 2]
    assert data_ar, "expected gradient all-reduces over the data axis"
    full, shard = unit_bytes(plan)
    # each data all-reduce carries at most one unit's shard (1/8 of the unit), never a whole unit
    in_loop = [x for x in data_ar if x.loops]
    assert in_loop and all(x.result_bytes <= shard for x in in_loop), (shard, [x.result_bytes for x in in_loop])
    # and all of them together, per step, are the sharded gradient: (params + padding) / 8
    per_step_bytes = sum(x.result_bytes * (cfg.n_layers if x.loops else 1) for x in data_ar)
    padded = 4 * sum(int(np.prod(x.shape)) for x in jax.tree.leaves(jax.eval_shape(plan.init, jax.random.key(0))))
    assert per_step_bytes == padded // 8


def test_bf16_policy_gathers_in_bf16_and_reduces_in_fp32():
    """Read from the program jfsdp emits (the jaxpr), since XLA:CPU upcasts bf16 collectives to f32
    when it compiles (see hlo.emitted_collectives); fp32 as the control."""
    seen = {}
    for precision in ("bf16", "fp32"):
        cfg = models.get_config("llama-test")
        root, unit, n = models.parts(cfg)
        tok = jnp.zeros((BATCH, SEQ), jnp.int32)
        plan = jfsdp.fully_shard(jfsdp.Stacked(root, unit, n), jfsdp.make_mesh("1x16"), tok,
                                 mp_policy=jfsdp.MixedPrecision.parse(precision))
        params = jax.eval_shape(plan.init, jax.random.key(0))
        jaxpr = jax.make_jaxpr(plan.loss_and_grad(models.loss_fn(cfg)))(params, {"inputs": tok, "targets": tok})
        seen[precision] = hlo.emitted_collectives(jaxpr)
    dtypes = lambda prec, prim: {d for (p, d) in seen[prec] if p == prim}
    assert dtypes("bf16", "all_gather") == {"bfloat16"}
    assert dtypes("bf16", "reduce_scatter") == {"float32"}
    assert dtypes("fp32", "all_gather") == {"float32"}


# the matmuls of a LlamaBlock: 4 projections and 3 feed-forward kernels, attention's two einsums (in its
# `attend` method, which context parallelism replaces by the ring)
# (Llama's MLP runs its matmuls in a `swiglu` method, which a tiled MLP scans over the tokens; its attention
# einsums in `attend`, context parallelism's hook: both name the op)
UNIT_MATMULS = {"attention/wq", "attention/wk", "attention/wv", "attention/wo", "feed_forward/feed_forward.swiglu/w1",
                "feed_forward/feed_forward.swiglu/w2", "feed_forward/feed_forward.swiglu/w3",
                "attention/attention.attend/vmap(BTNH,BSNH->BNTS)", "attention/attention.attend/vmap(BNTS,BSNH->BTNH)"}


@pytest.mark.parametrize("model", ["scan", "pipeline", "as_is"])
def test_bf16_policy_runs_the_unit_matmuls_in_bf16(model):
    """Every dot of the loss-and-gradient program, the units' (forward, rematerialized forward and
    backward) and the root's tied head, takes bf16 operands under the bf16 policy and f32 ones under
    fp32: on the plain unit scan, on the prefetch pipeline and on a Llama given as it is (its own loop).
    Read from the program as lowered (XLA's HLO before its passes, with the op names): XLA:CPU then
    rewrites every bf16 dot into an f32 dot of converted operands whose result it rounds to bf16 (a
    probe, 2026-11-25), so the CPU's optimized program cannot show it; the program compiled for an H100
    keeps bf16 gemms (tests/test_gpu_target.py). An engine that gathered in bf16 and computed the unit
    in fp32 would emit f32 unit dots here."""
    from models.llama import Llama, LlamaBlock
    cfg = models.get_config("llama-test")
    root, unit, n = models.parts(cfg)
    tok = jax.ShapeDtypeStruct((BATCH, SEQ), jnp.int32)
    mesh = jfsdp.make_mesh("1x8", jax.devices()[:8])
    for precision, dtype in (("bf16", "bf16"), ("fp32", "f32")):
        mp = jfsdp.MixedPrecision.parse(precision)
        if model == "as_is":
            plan = jfsdp.fully_shard(Llama(cfg), mesh, {"inputs": tok}, units=LlamaBlock, remat="full",
                                     rng_streams=(), mp_policy=mp)
        else:
            plan = jfsdp.fully_shard(jfsdp.Stacked(root, unit, n), mesh, tok, remat="full",
                                     prefetch=model == "pipeline", mp_policy=mp)
        lowered = jax.jit(plan.loss_and_grad(models.loss_fn(cfg))).lower(plan.abstract_params(),
                                                                         {"inputs": tok, "targets": tok})
        dots = hlo.gemms(lowered.as_text(dialect="hlo", debug_info=True))
        units = [g for g in dots if "LlamaBlock/" in g.op_name]
        assert {g.op_name.split("LlamaBlock/")[-1].removesuffix("/dot_general") for g in units} == UNIT_MATMULS
        assert len(units) >= 3 * len(UNIT_MATMULS) - 2, len(units)   # forward, recomputed forward, backward
        assert any("head" in g.op_name for g in dots)
        assert all(g.dtypes == (dtype, dtype) for g in dots), (precision, {(g.op_name, g.dtypes) for g in dots
                                                                           if g.dtypes != (dtype, dtype)})


# ---- gather, compute, free: per-device memory from XLA's buffer assignment

def test_full_shard_temp_memory_does_not_grow_with_depth_beyond_remat_activations():
    """8 units vs 2 units, FULL_SHARD, full remat, 1x16. With remat 'full' a unit keeps only its
    input for the backward pass: (batch/16) x seq x dim fp32 = 1 x 32 x 96 x 4 = 12 KiB. Bound: the
    6 extra units may add 6 x that input, plus 10% for buffer alignment. A gathered unit is 334 KiB:
    keeping even one extra gathered unit would break the bound nearly five times over."""
    _, _, c2 = compile_grad("1x16", "full_shard", n_layers=2)
    cfg, plan, c8 = compile_grad("1x16", "full_shard", n_layers=8)
    kept_per_unit = (BATCH // 16) * SEQ * cfg.dim * 4
    growth = hlo.memory(c8)["temp"] - hlo.memory(c2)["temp"]
    full, _ = unit_bytes(plan)
    assert kept_per_unit * 6 * 1.1 < full, "the bound must be tighter than one gathered unit"
    assert growth <= 6 * kept_per_unit * 1.1, (growth, kept_per_unit)


def test_shard_grad_op_keeps_gathered_units_so_memory_grows():
    """The contrast that shows the measurement sees gathered units: ZeRO-2 keeps every unit's
    gathered parameters from forward to backward, so each extra unit adds at least one whole unit."""
    _, _, c2 = compile_grad("1x16", "shard_grad_op", n_layers=2)
    cfg, plan, c8 = compile_grad("1x16", "shard_grad_op", n_layers=8)
    full, _ = unit_bytes(plan)
    assert hlo.memory(c8)["temp"] - hlo.memory(c2)["temp"] >= 6 * full


def test_train_step_arguments_are_state_over_16():
    """Per-device argument bytes of the whole train step (params, Adam moments, step, batch) are
    within 2% of the unsharded state / 16, padding included."""
    cfg = dataclasses.replace(models.get_config("llama-test"), n_layers=8)
    root, unit, n = models.parts(cfg)
    tokens = jax.ShapeDtypeStruct((BATCH, SEQ), jnp.int32)
    plan = jfsdp.fully_shard(jfsdp.Stacked(root, unit, n), jfsdp.make_mesh("1x16"), tokens, remat="full")
    opt = jfsdp.adamw(1e-3, mask=plan.decay_mask())
    state = jfsdp.abstract_state(plan, opt)
    tok = jax.ShapeDtypeStruct((BATCH, SEQ), jnp.int32, sharding=plan.batch_sharding)
    step = jfsdp.make_train_step(plan, opt, models.loss_fn(cfg))
    c = step.lower(state, {"inputs": tok, "targets": tok}).compile()
    psi = cfg.num_params()  # counted from the config, independently of the engine
    padding = sum(l.padding * (n if i else 1)
                  for i, part in enumerate(("root", "units"))
                  for l in jax.tree.leaves(plan.layouts[part], is_leaf=lambda l: isinstance(l, jfsdp.Layout)))
    expected = 3 * 4 * (psi + padding) / 16 + 2 * BATCH * SEQ * 4 / 16  # params + 2 moments; tokens
    got = hlo.memory(c)["argument"]
    assert abs(got - expected) <= 0.02 * expected, (got, expected)
