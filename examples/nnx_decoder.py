"""An NNX decoder written the way Flax's NNX examples write one, trained with jfsdp as it is.

    python examples/nnx_decoder.py [--mesh 2x4] [--strategy full_shard] [--steps 100] [--dropout 0.1]

The model knows nothing of jfsdp: an `nnx.List` of blocks of two kinds that alternate, local
(sliding-window) attention and global attention, each called as `layer(x, positions, mask)` with
rotary positions and its own mask; dropout draws from the model's own `nnx.Rngs`; its kernels, a bias and
the embedding carry logical axis names (`nnx.with_partitioning`), which tensor parallelism reads
(docs/tensor-parallel.md). jfsdp is told
which classes are the FSDP units (`units=(LocalBlock, GlobalBlock)`) and takes the module with its
weights. On a machine without accelerators the script fakes 8 CPU devices.
"""
from __future__ import annotations

import os

from jfsdp.config.xla_flags import accelerator_present  # noqa: E402  (jax-free)

if not accelerator_present():
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import argparse  # noqa: E402
import dataclasses  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Config:
    vocab: int = 61
    width: int = 48
    heads: int = 4
    mlp: int = 96
    layers: int = 4          # local, global, local, global
    window: int = 8
    dropout: float = 0.0


KERNEL, EMBED = nnx.initializers.lecun_normal(), nnx.initializers.variance_scaling(1.0, "fan_in", "normal", out_axis=0)


def named(init, names):
    """`init` whose parameter carries logical axis names (for tensor parallelism: docs/tensor-parallel.md);
    not placed on a mesh when it is made (eager_sharding=False), jfsdp places it."""
    return nnx.with_partitioning(init, names, eager_sharding=False)


def rotate(x, positions):
    """Rotary position embedding over the last axis (pairs i, i + d/2)."""
    d = x.shape[-1]
    freq = 1.0 / 10000 ** (jnp.arange(0, d, 2) / d)
    angle = positions[..., None, None].astype(jnp.float32) * freq        # (B, T, 1, d/2)
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return jnp.concatenate([x1 * jnp.cos(angle) - x2 * jnp.sin(angle), x2 * jnp.cos(angle) + x1 * jnp.sin(angle)], -1)


class Block(nnx.Module):
    """Attention with rotary positions and an MLP, pre-norm, dropout on each branch."""

    def __init__(self, cfg: Config, rngs: nnx.Rngs):
        d, h = cfg.width, cfg.heads
        self.heads = h
        self.norm1, self.norm2 = nnx.RMSNorm(d, rngs=rngs), nnx.RMSNorm(d, rngs=rngs)
        self.qkv = nnx.Linear(d, 3 * d, use_bias=False, kernel_init=named(KERNEL, ("embed", "heads")), rngs=rngs)
        self.out = nnx.Linear(d, d, use_bias=False, kernel_init=named(KERNEL, ("heads", "embed")), rngs=rngs)
        self.up = nnx.Linear(d, cfg.mlp, kernel_init=named(KERNEL, ("embed", "mlp")),
                             bias_init=named(nnx.initializers.zeros_init(), ("mlp",)), rngs=rngs)
        self.down = nnx.Linear(cfg.mlp, d, kernel_init=named(KERNEL, ("mlp", "embed")), rngs=rngs)
        self.drop = nnx.Dropout(cfg.dropout, rngs=rngs)

    def attend(self, x, positions, mask, deterministic):
        b, t, d = x.shape
        q, k, v = jnp.split(self.qkv(self.norm1(x)).reshape(b, t, 3 * self.heads, d // self.heads), 3, axis=2)
        q, k = rotate(q, positions), rotate(k, positions)
        y = jax.nn.dot_product_attention(q, k, v, mask=mask[:, None])
        return x + self.drop(self.out(y.reshape(b, t, d)), deterministic=deterministic)

    def __call__(self, x, positions, mask, deterministic=True):
        x = self.attend(x, positions, self.own_mask(mask), deterministic)
        return x + self.drop(self.down(nnx.gelu(self.up(self.norm2(x)))), deterministic=deterministic)


class GlobalBlock(Block):
    def own_mask(self, mask):
        return mask


class LocalBlock(Block):
    def __init__(self, cfg: Config, rngs: nnx.Rngs):
        super().__init__(cfg, rngs)
        self.window = cfg.window

    def own_mask(self, mask):
        t = mask.shape[-1]
        near = jnp.abs(jnp.arange(t)[:, None] - jnp.arange(t)[None, :]) < self.window
        return mask & near


class Decoder(nnx.Module):
    def __init__(self, cfg: Config, rngs: nnx.Rngs):
        self.embed = nnx.Embed(cfg.vocab, cfg.width, embedding_init=named(EMBED, ("vocab", "embed")), rngs=rngs)
        self.layers = nnx.List([(LocalBlock if i % 2 == 0 else GlobalBlock)(cfg, rngs) for i in range(cfg.layers)])
        self.norm = nnx.RMSNorm(cfg.width, rngs=rngs)
        self.training = False

    def __call__(self, tokens):
        t = tokens.shape[1]
        positions = jnp.broadcast_to(jnp.arange(t), tokens.shape)
        mask = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (tokens.shape[0], t, t))
        h = self.embed(tokens)
        for layer in self.layers:
            h = layer(h, positions, mask, deterministic=not self.training)
        return self.embed.attend(self.norm(h))      # tied head


def loss_fn(logits, batch):
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()


def data(cfg: Config, steps: int, batch: int, seq: int, seed: int = 0):
    """Counting sequences modulo the vocabulary from random starts: learnable, no download."""
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        start = rng.integers(0, cfg.vocab, (batch, 1))
        toks = ((start + np.arange(seq + 1)) % cfg.vocab).astype(np.int32)
        yield {"inputs": toks[:, :-1], "targets": toks[:, 1:]}


def train(mesh="2x4", strategy="full_shard", steps=100, batch=16, seq=32, cfg=Config(), seed=0, devices=None):
    """Train the decoder as it is with jfsdp; returns (losses, sharded, state, model)."""
    import jfsdp
    r, s = jfsdp.parse_mesh(mesh)
    mesh = jfsdp.make_mesh(mesh, devices=(devices or jax.devices())[: r * s])
    batches = list(data(cfg, steps, batch, seq, seed))
    model = Decoder(cfg, nnx.Rngs(params=seed, dropout=seed + 1))
    model.training = True
    sharded = jfsdp.fully_shard(model, mesh, batches[0], units=(LocalBlock, GlobalBlock), strategy=strategy, seed=seed)
    optimizer = jfsdp.adamw(3e-3)
    state = jfsdp.init_state(sharded, optimizer)        # the model's own weights, sharded
    step = jfsdp.make_train_step(sharded, optimizer, loss_fn)
    losses = []
    for b in batches:
        state, metrics = step(state, b)
        losses.append(float(metrics["loss"]))
    nnx.update(model, sharded.gather(state.params))     # the trained weights back in the model
    return losses, sharded, state, model


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mesh", default="2x4")
    p.add_argument("--strategy", default="full_shard")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--dropout", type=float, default=0.1)
    a = p.parse_args()
    losses, *_ = train(a.mesh, a.strategy, a.steps, cfg=Config(dropout=a.dropout))
    print(f"loss {losses[0]:.3f} at step 1, {losses[-1]:.3f} at step {len(losses)}")


if __name__ == "__main__":
    main()
