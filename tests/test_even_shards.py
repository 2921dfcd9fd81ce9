"""Every leaf sharded evenly (jfsdp.engine.layout.Layout): each device's state between steps is 1/S of the
model whatever the leaves' shapes, read from the compiled program (XLA:CPU, fake devices), for jfsdp's
Llama, its MoE (8 experts on 16 shards) and two models given as they are whose kernels have small leading
axes: a Linen block with (2, d, f) and (heads, d, h) kernels, an NNX block with a fused (3, d, h) QKV."""
import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jfsdp
import models
from jfsdp.planning import memory
from jfsdp.train.optim import matrices
from models.factory import language_model

D, F, HEADS, H, VOCAB = 64, 128, 4, 16, 100


class GatedBlock(nn.Module):
    """Gemma's kind of kernels: gating (2, d, f), q and o per head (heads, d, h), (heads, h, d)."""

    @nn.compact
    def __call__(self, x):
        init = nn.initializers.normal(0.05)
        gate = self.param("gating", init, (2, D, F))
        down = self.param("down", init, (F, D))
        q = self.param("q", init, (HEADS, D, H))
        o = self.param("o", init, (HEADS, H, D))
        g = jnp.einsum("btd,kdf->kbtf", x, gate)
        x = x + (nn.gelu(g[0]) * g[1]) @ down
        return x + jnp.einsum("btnh,nhd->btd", jnp.tanh(jnp.einsum("btd,ndh->btnh", x, q)), o)


class LinenModel(nn.Module):
    @nn.compact
    def __call__(self, tokens):
        emb = self.param("embedding", nn.initializers.normal(0.05), (VOCAB, D))
        x = emb[tokens]
        for _ in range(2):
            x = GatedBlock()(x)
        return x @ emb.T


class QKVBlock(nnx.Module):
    """A fused (3, d, h) QKV kernel, causal attention of one head, (h, d) out."""

    def __init__(self, rngs):
        self.qkv = nnx.Param(jax.random.normal(rngs.params(), (3, D, H)) * 0.05)
        self.out = nnx.Param(jax.random.normal(rngs.params(), (H, D)) * 0.05)

    def __call__(self, x):
        q, k, v = jnp.einsum("btd,kdh->kbth", x, self.qkv[...])
        t = x.shape[1]
        s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), q @ k.swapaxes(1, 2) / np.sqrt(H), -1e9)
        return x + jax.nn.softmax(s, -1) @ v @ self.out[...]


class NNXModel(nnx.Module):
    def __init__(self, rngs):
        self.embedding = nnx.Param(jax.random.normal(rngs.params(), (VOCAB, D)) * 0.05)
        self.blocks = nnx.List([QKVBlock(rngs) for _ in range(2)])

    def __call__(self, tokens):
        x = self.embedding[...][tokens]
        for b in self.blocks:
            x = b(x)
        return x @ self.embedding[...].T


def ce(logits, batch):
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()


def _batch(n, seq=16):
    x = jax.ShapeDtypeStruct((n, seq), jnp.int32)
    return {"inputs": x, "targets": x}


def build(kind, s):
    """(plan, loss_fn, batch) of one model on a 1xS mesh."""
    mesh = jfsdp.make_mesh(f"1x{s}", devices=jax.devices()[:s])
    b = _batch(s)
    if kind == "llama":
        cfg = models.get_config("llama-test")
        root, unit, n = models.parts(cfg)
        return jfsdp.fully_shard(jfsdp.Stacked(root, unit, n), mesh, b["inputs"]), models.loss_fn(cfg), b
    if kind == "moe":
        cfg = models.get_config("moe-test")
        model, moe, loss = language_model(cfg, loss="plain")
        return jfsdp.fully_shard(model, mesh, b["inputs"], moe=moe), loss, b
    if kind == "linen":
        return jfsdp.fully_shard(LinenModel(), mesh, b, units=GatedBlock,
                                 call=lambda m, batch: m(batch["inputs"])), ce, b
    model = nnx.eval_shape(lambda: NNXModel(nnx.Rngs(0)))
    return jfsdp.fully_shard(model, mesh, b, units=QKVBlock, call=lambda m, batch: m(batch["inputs"]),
                             init=NNXModel), ce, b


def logical_elements(plan) -> tuple[int, int]:
    """(parameter elements of the model, unpadded; leaves, each stage's units counted one by one)."""
    root, stages = plan.split(plan.layouts)
    is_l = lambda x: isinstance(x, jfsdp.Layout)   # noqa: E731
    total = sum(int(np.prod(l.shape)) for l in jax.tree.leaves(root, is_leaf=is_l))
    leaves = len(jax.tree.leaves(root, is_leaf=is_l))
    for ls, n in zip(stages, plan.stage_sizes):
        total += n * sum(int(np.prod(l.shape)) for l in jax.tree.leaves(ls, is_leaf=is_l))
        leaves += n * len(jax.tree.leaves(ls, is_leaf=is_l))
    return total, leaves


@pytest.mark.parametrize("kind,s", [("llama", 8), ("llama", 16), ("moe", 16), ("moe", 8), ("linen", 8), ("linen", 16),
                                    ("nnx", 8), ("nnx", 16)])
def test_state_per_device_is_one_over_s(kind, s):
    """Per device, the compiled step's arguments (fp32 parameters and Adam's two moments, the batch, the
    step counters) and the gradient shards it makes (output: the new state, aliased to the old)
    ≤ 1.02 x 3 x total/S + 3 x S elements per leaf, + the batch and 64 bytes of counters."""
    plan, loss, b = build(kind, s)
    total, leaves = logical_elements(plan)
    m = memory.measure(memory.compile_step(plan, jfsdp.adamw(1e-3, mask=plan.decay_mask()), loss, b))
    batch = 2 * b["inputs"].shape[0] * b["inputs"].shape[1] * 4 // s
    bound = 1.02 * 3 * 4 * total / s + 3 * 4 * s * leaves + batch + 64
    assert m["argument"] <= bound, (kind, s, m["argument"], bound, 3 * 4 * total / s)
    assert m["output"] <= bound, (kind, s, m["output"], bound)


def test_small_leading_axes_are_flat_and_padded_by_fewer_than_s():
    """The rule: dimension 0 when S divides it (no padding, FSDP2's Shard(0)); else flat, < S padding."""
    f32 = jnp.dtype(jnp.float32)
    for shape, s, kind, stored in [((256, 96), 16, "dim0", (256, 96)), ((2, 1152, 6912), 64, "flat", (2 * 1152 * 6912, 1, 1)),
                                   ((8, 72, 56), 16, "flat", (8 * 72 * 56, 1, 1)), ((259, 96), 8, "flat", (24864, 1)),
                                   ((200,), 16, "dim0", (208,)), ((), 4, "dim0", (4,)), ((3, 5, 7), 4, "flat", (108, 1, 1))]:
        l = jfsdp.Layout(shape, f32, s)
        assert (l.kind, l.stored_shape) == (kind, stored), shape
        assert l.padding < s and l.stored_shape[0] % s == 0
        # a flat leaf keeps its number of dimensions: the default weight-decay mask (matrices) still sees one
        assert len(l.stored_shape) == max(len(shape), 1) and matrices({"w": np.zeros(l.stored_shape)})["w"] == (len(shape) >= 2)
        x = np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape)
        np.testing.assert_array_equal(np.asarray(l.unpad(l.pad(x, np))), x)
