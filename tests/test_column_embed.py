"""An untied embedding looked up by columns on the prefetch paths (jfsdp/engine/column_embed.py): its table is
never gathered; two all-to-alls move 1/S of its columns and the looked-up rows instead, and the gradient
comes back reduced without a reduce-scatter of the table.

The references are independent: the single-device gradient of the same model (jax.grad of the model's
own apply), and XLA's compiled programs (the collectives in the optimized HLO, the scheduled H100
program's overlap, compiled on this CPU machine without a GPU)."""
import dataclasses
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import flax.linen as nn
import pytest
from flax import nnx

import jfsdp
import models
from jfsdp.engine import column_embed
from jfsdp.planning import hlo, memory, targets
from jfsdp.planning.sizes import gathered_bytes
from models.llama import Llama, LlamaBlock, ScannedLlama
from tests import reference as ref

# a vocabulary that 16, 8 and 4 shards divide, with more rows than a device's tokens (16 x 32 / S)
CFG = dataclasses.replace(models.get_config("llama-test"), tie_embeddings=False, vocab_size=512)


def _batch(vocab, rows=16, seq=32):
    tok = np.random.default_rng(0).integers(0, vocab, (rows, seq + 1))
    return {"inputs": jnp.asarray(tok[:, :-1], jnp.int32), "targets": jnp.asarray(tok[:, 1:], jnp.int32)}


def _mesh(spec):
    r, s = jfsdp.parse_mesh(spec)
    return jfsdp.make_mesh(spec, devices=jax.devices()[: r * s])


def _gathered_shapes(text):
    return set(re.findall(r"= \w+\[([\d,]+)\][^ ]* all-gather(?:-start)?\(", text))


def _check(plan, loss_fn, params, batch, want_loss, want, table_shape):
    """The step's loss and gradients against the single-device ones (fp32: 1e-5, as the pipeline's other
    equivalence tests), and its program: the table never all-gathered, four all-to-alls (two each way)."""
    f = jax.jit(plan.loss_and_grad(loss_fn))
    args = (plan.shard(params), jax.device_put(batch, plan.batch_sharding))
    text = f.lower(*args).compile().as_text()
    assert ",".join(map(str, table_shape)) not in _gathered_shapes(text), _gathered_shapes(text)
    assert len(re.findall(r" all-to-all(?:-start)?\(", text)) == 4, re.findall(r"all-to-all\S*\(", text)
    got_loss, grads = f(*args)
    np.testing.assert_allclose(float(got_loss), float(want_loss), rtol=1e-5)
    ref.close(plan.gather(grads), want, 1e-5, "grad")


@pytest.mark.parametrize("spec,remat", [("1x16", "dots"), ("2x4", "full")])
def test_stacked_lookup_by_columns_equals_single_device(spec, remat):
    """`Stacked` on its prefetch pipeline, the embedding the first stage's lead (engine/root.py): FULL_SHARD
    on 16 shards and hybrid (2 replicas: the table's gradient summed over `data` too)."""
    root, unit, n = models.parts(CFG)
    b, lf = _batch(CFG.vocab_size), models.loss_fn(CFG)
    with jax.default_device(jax.devices()[0]):   # jitted: one program each, not op by op
        init = jax.jit(lambda x: ref.init_params(root, unit, n, x))(b["inputs"])
        want_loss, want = jax.device_get(jax.jit(jax.value_and_grad(
            lambda p: lf(ref.forward(root, unit, p, b["inputs"]), b)))(init))
    plan = jfsdp.fully_shard(jfsdp.Stacked(root, unit, n), _mesh(spec), b["inputs"], remat=remat, prefetch=True)
    table = plan.layouts["root"]["tok_embeddings"]["embedding"]
    assert plan.column_lookups() == [table]
    _check(plan, lf, init, b, want_loss, want, (CFG.vocab_size, CFG.dim))


@pytest.mark.parametrize("model_class,spec", [(Llama, "1x8"), (ScannedLlama, "2x4")])
def test_as_is_lookup_by_columns_equals_single_device(model_class, spec):
    """A Linen model given as it is, prefetch in call order (its own loop) and its own nn.scan on the pipeline:
    the untied table (late_root.root_uses: read by an nn.Embed, only before the units) looked up by columns."""
    b, lf, model = _batch(CFG.vocab_size), models.loss_fn(CFG), model_class(CFG)
    with jax.default_device(jax.devices()[0]):   # jitted: one program each, not op by op
        init = jax.jit(model.init)(jax.random.key(0), b["inputs"])["params"]
        want_loss, want = jax.device_get(jax.jit(jax.value_and_grad(
            lambda p: lf(model.apply({"params": p}, b["inputs"]), b)))(init))
    plan = jfsdp.fully_shard(model, _mesh(spec), b, units=LlamaBlock, rng_streams=(), remat="full", prefetch=True)
    assert len(plan.column_tables) == 1 and len(plan.column_lookups()) == 1
    _check(plan, lf, init, b, want_loss, want, (CFG.vocab_size, CFG.dim))


class _Block(nnx.Module):
    def __init__(self, width, rngs):
        self.lin = nnx.Linear(width, width, rngs=rngs)

    def __call__(self, h):
        return h + jnp.tanh(self.lin(h))


class _Untied(nnx.Module):
    """An NNX model with an untied head: nnx.Embed, two blocks, nnx.Linear."""
    def __init__(self, rngs, vocab=256, width=16):
        self.embed = nnx.Embed(vocab, width, rngs=rngs)
        self.blocks = nnx.List([_Block(width, rngs) for _ in range(2)])
        self.head = nnx.Linear(width, vocab, rngs=rngs)

    def __call__(self, ids):
        h = self.embed(ids)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def test_nnx_as_is_lookup_by_columns_equals_single_device():
    """nnx.Embed's lookup intercepted the same way (column_embed.nnx_scope), FULL_SHARD on 1x8."""
    b = _batch(256)   # 64 tokens a device: 64 + 256/8 < 256
    lf = lambda logits, batch: -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), batch["targets"][..., None], -1))
    graphdef, params = nnx.split(_Untied(nnx.Rngs(0)), nnx.Param)
    with jax.default_device(jax.devices()[0]):   # jitted: one program, not op by op
        want_loss, want = jax.device_get(jax.jit(jax.value_and_grad(
            lambda p: lf(nnx.merge(graphdef, p)(b["inputs"]), b)))(params))
    plan = jfsdp.fully_shard(_Untied(nnx.Rngs(0)), _mesh("1x8"), b, units=_Block, remat="full", prefetch=True)
    assert len(plan.column_tables) == 1
    _check(plan, lf, jax.device_get(params.to_pure_dict()), b, want_loss, want.to_pure_dict(), (256, 16))


def test_only_where_it_sends_fewer_bytes():
    """`applies`: S dividing both dimensions, rows split over `fsdp` without padding, and fewer token rows than
    table rows; the byte-level vocabulary (259 rows) stays gathered, and so does any table on the plain path
    (no prefetch) or tied to the head."""
    lay = lambda shape, s=8: jfsdp.engine.layout.Layout(shape, jnp.float32, s)
    assert column_embed.applies(lay((128256, 4096)), 2 * 8192)
    assert not column_embed.applies(lay((128256, 4096)), 128256)           # as many tokens as rows
    assert not column_embed.applies(lay((259, 96)), 8)                      # flat: 8 does not divide 259
    assert not column_embed.applies(lay((512, 100)), 8)                     # 8 does not divide the width
    assert not column_embed.applies(lay((512, 96), 1), 8)                   # one shard: nothing gathered
    b = _batch(CFG.vocab_size)
    for cfg, prefetch in ((CFG, False), (dataclasses.replace(CFG, tie_embeddings=True), True),
                          (dataclasses.replace(CFG, vocab_size=259), True)):
        root, unit, n = models.parts(cfg)
        plan = jfsdp.fully_shard(jfsdp.Stacked(root, unit, n), _mesh("1x8"), b["inputs"], remat="full", prefetch=prefetch)
        assert plan.column_lookups() == [], (cfg.vocab_size, cfg.tie_embeddings, prefetch)


class _Scaled(nn.Embed):
    def __call__(self, ids):
        return super().__call__(ids) * 2.0


def test_a_subclass_with_its_own_lookup_keeps_its_table_gathered():
    """Only an nn.Embed / nnx.Embed whose `__call__` is the library's is looked up by columns: a subclass's
    own `__call__` (here a scaled lookup) may read the table otherwise, so its table is not recorded."""
    ids = jnp.zeros((2, 4), jnp.int32)
    for cls, want in ((nn.Embed, {0}), (_Scaled, set())):
        found = set()

        def f(table):
            with column_embed.recording({id(table): 0}, found):
                return cls(512, 8).apply({"params": {"embedding": table}}, ids)
        jax.eval_shape(f, jax.ShapeDtypeStruct((512, 8), jnp.float32))
        assert found == want, cls


@pytest.mark.skipif(sys.platform != "linux", reason="jax-cuda13-plugin: Linux wheels only")
def test_h100_exposes_no_table_gather_and_the_formula_holds():
    """Compiled for an H100 (bf16, remat full, 1x8, 8 x 128 tokens): `Stacked` and the same model given as it
    is (its own loop) expose, of all-gathers, the first unit's gather and the ids' and no table's (before: the
    table's 7/8 too); every
    collective's bytes equal the planner's formula (all-to-alls included); as-is within 5% of Stacked's
    exposed all-gather and reduce-scatter bytes."""
    cfg = dataclasses.replace(CFG, dim=256, ffn_dim=688, n_layers=4, attention="cudnn", vocab_size=4096)
    x = jax.ShapeDtypeStruct((8, 128), jnp.int32)
    b, mesh = {"inputs": x, "targets": x}, jfsdp.make_mesh("1x8", targets.devices("h100", "1x8"))
    mp, out = jfsdp.MixedPrecision.parse("bf16"), {}
    with targets.tracing_for("h100"):
        root, unit, n = models.parts(cfg)
        for name, plan in (("stacked", jfsdp.fully_shard(jfsdp.Stacked(root, unit, n), mesh, x, remat="full", mp_policy=mp)),
                           ("as-is", jfsdp.fully_shard(Llama(cfg), mesh, b, units=LlamaBlock, rng_streams=(),
                                                       remat="full", mp_policy=mp))):
            assert plan.prefetch and plan.column_lookups(), name
            compiled = targets.compile_step("h100", plan, jfsdp.adamw(1e-3), models.loss_fn(cfg), b)
            got, want = memory.comm_measured(compiled, 8), memory.comm_formula(plan, backend="gpu")
            for kind in ("all-gather", "reduce-scatter", "all-to-all"):
                assert got[kind] == pytest.approx(want[kind], rel=1e-6), (name, kind, got, want)
            out[name] = hlo.overlap_summary(hlo.overlap(compiled.as_text(), 8))
            if name == "stacked":
                unit0 = gathered_bytes(plan.split(plan.layouts)[1][0], jnp.bfloat16) * 7 / 8
    for kind in ("all-gather", "reduce-scatter"):
        assert out["as-is"][kind]["exposed_bytes"] <= 1.05 * out["stacked"][kind]["exposed_bytes"], (kind, out)
    ids = 4 * 128 * 7   # the ids of 128 tokens a device, gathered from the 7 others
    assert out["stacked"]["all-gather"]["exposed_bytes"] == unit0 + ids, (out, unit0)   # measured equal, 2026-11-27
