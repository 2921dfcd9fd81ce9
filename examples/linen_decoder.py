"""A Linen decoder written the way Flax's own examples write one, trained with jfsdp as it is.

    python examples/linen_decoder.py [--mesh 2x4] [--strategy full_shard] [--steps 100] [--dropout 0.1]

The model knows nothing of jfsdp: a `Decoder` embeds tokens and positions, builds the causal mask,
and loops over `DecoderBlock`s, each called with the mask and a `deterministic` flag; its kernels carry
logical axis names (`nn.with_logical_partitioning`), as models written for pjit do. jfsdp is told
only which module class is the FSDP unit (`units=DecoderBlock`). On a machine without accelerators
the script fakes 8 CPU devices.
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

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Config:
    vocab: int = 61
    width: int = 48
    heads: int = 4
    mlp: int = 96
    layers: int = 3
    max_len: int = 64
    dropout: float = 0.0


def dense(features, axes, name):
    init = nn.with_logical_partitioning(nn.initializers.normal(0.02), axes)
    return nn.Dense(features, kernel_init=init, name=name)


def sinusoid(positions, width):
    """Fixed position signal (B, T) -> (B, T, width)."""
    freq = 1.0 / 10000 ** (jnp.arange(0, width, 2) / width)
    angle = positions[..., None].astype(jnp.float32) * freq
    return jnp.concatenate([jnp.sin(angle), jnp.cos(angle)], -1)


class DecoderBlock(nn.Module):
    """Pre-norm self-attention (queries and keys see the positions) and MLP, dropout on each output."""
    cfg: Config

    @nn.compact
    def __call__(self, x, mask, positions, deterministic: bool):
        c = self.cfg
        y = nn.LayerNorm(name="ln_attn")(x) + sinusoid(positions, c.width)
        y = nn.MultiHeadDotProductAttention(c.heads, kernel_init=nn.with_logical_partitioning(
            nn.initializers.normal(0.02), ("embed", "heads", "kv")), out_kernel_init=nn.with_logical_partitioning(
            nn.initializers.normal(0.02), ("heads", "kv", "embed")), name="attn")(y, y, mask=mask, deterministic=True)
        x = x + nn.Dropout(c.dropout)(y, deterministic=deterministic)
        y = dense(c.mlp, ("embed", "mlp"), "up")(nn.LayerNorm(name="ln_mlp")(x))
        y = dense(c.width, ("mlp", "embed"), "down")(nn.gelu(y))
        return x + nn.Dropout(c.dropout)(y, deterministic=deterministic)


class Decoder(nn.Module):
    cfg: Config

    @nn.compact
    def __call__(self, tokens, train: bool = False):
        c = self.cfg
        positions = jnp.arange(tokens.shape[1])[None]
        h = nn.Embed(c.vocab, c.width, name="tokens")(tokens) + nn.Embed(c.max_len, c.width, name="positions")(positions)
        mask = nn.make_causal_mask(tokens)
        for i in range(c.layers):
            h = DecoderBlock(c, name=f"block_{i}")(h, mask, positions, deterministic=not train)
        return dense(c.vocab, ("embed", "vocab"), "head")(nn.LayerNorm(name="ln_f")(h))


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
    """Train the decoder as it is with jfsdp; returns (losses, sharded, state)."""
    import jfsdp
    r, s = jfsdp.parse_mesh(mesh)
    mesh = jfsdp.make_mesh(mesh, devices=(devices or jax.devices())[: r * s])
    batches = list(data(cfg, steps, batch, seq, seed))
    sharded = jfsdp.fully_shard(Decoder(cfg), mesh, batches[0], units=DecoderBlock, strategy=strategy,
                                call=lambda model, b: model(b["inputs"], train=True), seed=seed)
    optimizer = jfsdp.adamw(3e-3)
    state = jfsdp.init_state(sharded, optimizer, jax.random.key(seed))
    step = jfsdp.make_train_step(sharded, optimizer, loss_fn)
    losses = []
    for b in batches:
        state, metrics = step(state, b)
        losses.append(float(metrics["loss"]))
    return losses, sharded, state


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mesh", default="2x4")
    p.add_argument("--strategy", default="full_shard")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--dropout", type=float, default=0.1)
    a = p.parse_args()
    losses, _, _ = train(a.mesh, a.strategy, a.steps, cfg=Config(dropout=a.dropout))
    print(f"loss {losses[0]:.3f} at step 1, {losses[-1]:.3f} at step {len(losses)}")


if __name__ == "__main__":
    main()
