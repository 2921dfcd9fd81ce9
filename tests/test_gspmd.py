"""The GSPMD side of benchmarks/gspmd_compare.py computes what jfsdp computes: each of its configurations
(both sharding rules, a full-shard and a hybrid mesh, both remat policies) trains a small Llama on 8 CPU
devices to jfsdp's losses, fp32, within 1e-5 relative, from the same initial parameters. The step
trained here is the very function the benchmark compiles (`gspmd_train_step`), so the benchmark's
memory and communication figures compare the same computation."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jfsdp
import models
from benchmarks import gspmd_compare as gc

STEPS, ROWS, SEQ = 3, 8, 32
CFG = models.get_config("llama-test")   # vocab 259 (divides by nothing), ffn 200, dim 96, GQA, tied head


def batches():
    rng = np.random.default_rng(0)
    toks = rng.integers(0, CFG.vocab_size, (STEPS, ROWS, SEQ + 1), dtype=np.int32)
    return [{"inputs": t[:, :-1], "targets": t[:, 1:]} for t in toks]


@pytest.fixture(scope="module")
def reference():
    """jfsdp FULL_SHARD on 1x8, fp32, remat full: the initial full parameters and the losses."""
    mesh = jfsdp.make_mesh("1x8", jax.devices()[:8])
    root, unit, n = models.parts(CFG)
    plan = jfsdp.fully_shard(jfsdp.Stacked(root, unit, n), mesh, jnp.zeros((ROWS, SEQ), jnp.int32), remat="full")
    opt = jfsdp.adamw(1e-3)
    state = jfsdp.init_state(plan, opt, jax.random.key(0))
    params = plan.gather(state.params)
    step = jfsdp.make_train_step(plan, opt, models.loss_fn(CFG))
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


@pytest.mark.parametrize("mesh_spec,rule,remat", [("1x8", "largest", "full"), ("1x8", "dim0", "full"),
                                                  ("2x4", "largest", "full"), ("2x4", "dim0", "dots")])
def test_gspmd_trains_like_jfsdp(reference, mesh_spec, rule, remat):
    params, want = reference
    mesh = jfsdp.make_mesh(mesh_spec, jax.devices()[:8])
    opt = jfsdp.adamw(1e-3)
    g = gc.gspmd_train_step(CFG, mesh, opt, models.loss_fn(CFG), rule=rule, remat=remat)
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
