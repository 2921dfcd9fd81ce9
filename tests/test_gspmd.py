"""The GSPMD side of benchmarks/gspmd_compare.py computes what jfsdp computes: each of its configurations
(both sharding rules, a full-shard and a hybrid mesh, both remat policies, both losses) trains a small Llama on 8 CPU
devices to jfsdp's losses, fp32, within 1e-5 relative, from the same initial parameters. The step
trained here is the very function the benchmark compiles (`gspmd_train_step`), so the benchmark's
memory and communication figures compare the same computation."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jfsdp
import models
from benchmarks import gspmd_compare as gc
from models import factory

STEPS, ROWS, SEQ = 3, 8, 32
CFG = models.get_config("llama-test")   # vocab 259 (divides by nothing), ffn 200, dim 96, GQA, tied head


def batches():
    rng = np.random.default_rng(0)
    toks = rng.integers(0, CFG.vocab_size, (STEPS, ROWS, SEQ + 1), dtype=np.int32)
    return [{"inputs": t[:, :-1], "targets": t[:, 1:]} for t in toks]


@functools.cache
def reference(loss):
    """jfsdp FULL_SHARD on 1x8, fp32, remat full, with the `loss` ('plain' logits or 'fused' head +
    cross-entropy) the benchmark gives both sides: the initial full parameters and the losses."""
    mesh = jfsdp.make_mesh("1x8", jax.devices()[:8])
    stacked, _, loss_fn = factory.language_model(CFG, loss=loss)
    plan = jfsdp.fully_shard(stacked, mesh, jnp.zeros((ROWS, SEQ), jnp.int32), remat="full")
    opt = jfsdp.adamw(1e-3)
    state = jfsdp.init_state(plan, opt, jax.random.key(0))
    params = plan.gather(state.params)
    step = jfsdp.make_train_step(plan, opt, loss_fn)
    losses = []
    for b in batches():
        state, m = step(state, plan.put_batch(b))
        losses.append(float(m["loss"]))
    return params, np.array(losses)


def test_sharding_rules():
    """'largest' shards the largest divisible per-unit dimension, 'dim0' the first (FSDP2's Shard(0)),
    either falling back to what divides; the stack axis of the units is never sharded."""
    assert gc.leaf_spec((259, 96), 8, "largest", False) == P(None, "fsdp")   # 259 divides by nothing
    assert gc.leaf_spec((259, 96), 8, "dim0", False) == P(None, "fsdp")
    assert gc.leaf_spec((2, 96, 200), 8, "largest", True) == P(None, None, "fsdp")
    assert gc.leaf_spec((2, 96, 200), 8, "dim0", True) == P(None, "fsdp", None)
    assert gc.leaf_spec((2, 7), 8, "dim0", True) == P(None, None)             # replicated: nothing divides


@pytest.mark.parametrize("mesh_spec,rule,remat,loss", [
    ("1x8", "largest", "full", "plain"), ("1x8", "dim0", "full", "plain"), ("2x4", "largest", "full", "plain"),
    ("2x4", "dim0", "dots", "plain"), ("1x8", "dim0", "full", "fused")])
def test_gspmd_trains_like_jfsdp(mesh_spec, rule, remat, loss):
    params, want = reference(loss)
    mesh = jfsdp.make_mesh(mesh_spec, jax.devices()[:8])
    opt = jfsdp.adamw(1e-3)
    stacked, _, loss_fn = factory.language_model(CFG, loss=loss)   # as the benchmark builds both sides
    g = gc.gspmd_train_step(CFG, mesh, opt, loss_fn, rule=rule, remat=remat, head_method=stacked.head_method)
    # the state really is sharded by the rule: no parameter of a unit is whole on a device
    specs = {x.spec for x in jax.tree.leaves(g.state_shardings.params["units"])}
    assert all("fsdp" in s for s in specs), specs
    state = g.place(opt, params)
    got = []
    for b in batches():
        state, m = g.step(state, jax.device_put(b, g.batch_sharding))
        got.append(float(m["loss"]))
    np.testing.assert_allclose(got, want, rtol=1e-5)
    assert want[-1] < want[0]   # it trains
