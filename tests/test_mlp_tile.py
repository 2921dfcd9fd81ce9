"""Sequence tiling of the Llama MLP (models/llama.py's `mlp_tile`, Arctic Long Sequence Training's TiledMLP;
docs/context-parallel.md): the MLP runs over the tokens in tiles, each tile under its own checkpoint, so that a
unit's backward holds one tile's (tile x ffn) intermediates. Its gradients equal the untiled single-device
model's, its compiled temporaries fall by the intermediates it no longer holds, and the planner counts one
tile's working set."""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jfsdp
from jfsdp.config.errors import ConfigError
from jfsdp.config.sequence import check_mlp_tile, zigzag
from jfsdp.planning.activations import residual_bytes, working_bytes
import models
from models.llama import LlamaBlock
from tests import reference as ref

CFG = models.get_config("llama-test")   # d 96, ffn 200, GQA 4:2, tied embeddings
ROWS, SEQ = 4, 16


@functools.cache
def reference():
    """(batch, initial parameters, loss, gradients) of the untiled llama-test on one device, fp32, written
    without jfsdp (tests/reference.py's forward; jax.value_and_grad)."""
    root, unit, n = models.parts(CFG)
    batch = ref.token_batches(CFG.vocab_size, 1, ROWS, SEQ)[0]
    with jax.default_device(jax.devices()[0]):
        params = ref.init_params(root, unit, n, batch["inputs"])
        loss, grads = jax.jit(jax.value_and_grad(
            lambda p: models.loss_fn(CFG)(ref.forward(root, unit, p, batch["inputs"]), batch)))(params)
    return batch, jax.device_get(params), float(loss), jax.device_get(grads)


def tile_loops(jaxpr) -> list:
    """The trip counts of the loops in `jaxpr` (and its sub-jaxprs) whose body runs under jax.checkpoint: a
    scan's length, a while loop's constant bound (models/attention.py's `index_loop`: `i < n`)."""
    found = []
    for eqn in jaxpr.eqns:
        subs = list(jax.extend.core.jaxprs_in_params(eqn.params))
        if any(e.primitive.name == "remat2" for s in subs for e in s.eqns):
            if eqn.primitive.name == "scan":
                found.append(eqn.params["length"])
            elif eqn.primitive.name == "while":
                bound = eqn.params["cond_jaxpr"].jaxpr.eqns[-1].invars[1]
                found.append(getattr(bound, "val", None))
        for s in subs:
            found += tile_loops(s)
    return found


# (mesh, context C, remat, tile): tokens per device SEQ / C, in SEQ / C / tile tiles
CASES = [("1x2", 1, "full", 4), ("1x1", 2, "dots", 4)]


@pytest.mark.parametrize("mesh_spec, context, remat, tile", CASES, ids=["C1-full", "C2-dots"])
def test_tiled_mlp_gradients_equal_the_untiled_single_device_model(mesh_spec, context, remat, tile):
    """llama-test (fp32, 4 rows of 16 tokens) with its MLP in tiles, under jfsdp (Stacked, FULL_SHARD, the
    remat policy, at C = 2 the ring and zigzag order): the loss and the gathered gradients equal jax.grad of
    the untiled model on one device (`reference`) within test_equivalence's tolerances (losses 1e-5,
    gradients 1e-5 of each leaf's largest; floor 1.4e-6, docs/numerics.md), and the program does
    loop over the tiles, each under a checkpoint (a tiling silently off would match too)."""
    from models import factory
    b, init, want_loss, want_grads = reference()
    model, _, loss_fn = factory.language_model(dataclasses.replace(CFG, mlp_tile=tile), "plain")
    n_dev = jfsdp.parse_mesh(mesh_spec)[0] * jfsdp.parse_mesh(mesh_spec)[1] * context
    mesh = jfsdp.make_mesh(mesh_spec, devices=jax.devices()[:n_dev], context=context)
    ring = factory.context_kernel(block=4) if context > 1 else None
    plan = jfsdp.fully_shard(model, mesh, b["inputs"], remat=remat, context_attention=ring)
    batch = jax.device_put({k: zigzag(x, context) if context > 1 else x for k, x in b.items()}, plan.batch_sharding)
    step = plan.loss_and_grad(loss_fn)
    params = plan.shard(init)
    # the layers' scan (2 units) is one too; the tiles' loop runs in the forward pass and in the backward's recompute
    assert tile_loops(jax.make_jaxpr(step)(params, batch).jaxpr).count(SEQ // context // tile) >= 1
    loss, grads = jax.jit(step)(params, batch)
    np.testing.assert_allclose(float(loss), want_loss, rtol=1e-5)
    ref.close(jax.device_get(plan.gather(grads)), want_grads, 1e-5, "grad")


def test_tiling_cuts_the_compiled_temporaries_and_the_planner_counts_one_tile():
    """One llama-test unit (d 96, ffn 200) on 4,096 tokens, its forward and backward under jax.checkpoint (remat
    full, as jfsdp runs a unit), compiled for XLA:CPU: with tiles of 256 tokens the temporaries are lower by at
    least the two (T - tile) x ffn fp32 matmul outputs (gate and up) that the untiled backward holds at once
    and a tiled one holds per tile only. The planner's working set of the unit (jfsdp.planning.activations.
    working_bytes) falls by as much, and counts one tile's intermediates on top of what the unit saves."""
    t, tile = 4096, 256
    cfg = CFG
    x = jax.ShapeDtypeStruct((1, t, cfg.dim), jnp.float32)
    temp, work, saved = {}, {}, {}
    for k in (0, tile):
        unit = LlamaBlock(dataclasses.replace(cfg, mlp_tile=k))
        p = jax.eval_shape(unit.init, jax.random.key(0), x)
        fn = lambda x, p, unit=unit: unit.apply(p, x)

        def grads(x, p, ct, fn=fn):
            return jax.vjp(jax.checkpoint(fn), x, p)[1](ct)
        temp[k] = jax.jit(grads).lower(x, p, x).compile().memory_analysis().temp_size_in_bytes
        work[k], saved[k] = working_bytes(fn, x, p), residual_bytes(fn, x, p)
    intermediates = 2 * (t - tile) * cfg.ffn_dim * 4
    assert temp[tile] <= temp[0] - intermediates, (temp, intermediates)
    assert work[tile] <= work[0] - intermediates, (work, intermediates)
    assert work[tile] >= saved[tile] + 2 * tile * cfg.ffn_dim * 4, (work, saved)   # one tile's, counted
    assert work[0] == saved[0]   # untiled: nothing checkpointed inside the unit


def test_bad_tiles_are_refused():
    """A tile that does not divide the tokens per device (T, or T / C) is a ConfigError naming both; so is a
    negative one, and tiling with tensor parallelism (not supported yet)."""
    check_mlp_tile(0, 1000)
    check_mlp_tile(256, 4096, context=2)
    with pytest.raises(ConfigError, match="does not divide the 2048 tokens per device"):
        check_mlp_tile(3072, 4096, context=2)
    with pytest.raises(ConfigError, match="does not divide --seq-len 1000"):
        check_mlp_tile(256, 1000)
    with pytest.raises(ConfigError, match="negative"):
        check_mlp_tile(-1, 1000)
    with pytest.raises(ConfigError, match="--tensor"):
        check_mlp_tile(256, 4096, tensor=2)


def test_the_planners_tile_rule():
    """`python -m jfsdp.plan --mlp-tile auto` (jfsdp.planning.tiling.choose) on a made-up estimate that falls
    with the tile: off where the untiled plan fits, else the largest halving of the tokens per device that
    fits, never below the model's width (the smallest such halving when nothing fits), off under tensor
    parallelism."""
    from types import SimpleNamespace

    from jfsdp.planning import tiling
    cfg = SimpleNamespace(dim=96, mlp_tile=0)
    tried = []

    def total(tile):   # bytes: 1,000 + 1 per token of tile (untiled: the whole 4,096 tokens)
        tried.append(tile)
        return 1000 + (tile or 4096)
    assert tiling.candidates(4096, 96) == [2048, 1024, 512, 256, 128]
    assert tiling.choose(total, 4096, 5096, cfg) == 0
    assert tiling.choose(total, 4096, 2100, cfg) == 1024 and len(tried) <= 1 + 1 + 3   # bisection, not all
    assert tiling.choose(total, 4096, 1300, cfg) == 256
    assert tiling.choose(total, 4096, 10, cfg) == 128     # nothing fits: the smallest, and the report says so
    assert tiling.choose(total, 4096, 10, cfg, tensor=2) == 0
    assert tiling.candidates(96 * 3, 96) == [144]         # odd halvings stop
