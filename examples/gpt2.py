"""A model of your own, trained with jfsdp: a GPT-2-style decoder written here, not taken from `models/`.

    python examples/gpt2.py [--mesh 2x4] [--strategy full_shard] [--steps 200]

What jfsdp needs from a model is two Flax modules: a root with `embed(inputs) -> h` and
`head(h) -> outputs` (everything that is not repeated: token and position embeddings, final norm,
head), and the repeated block `h -> h` (the FSDP unit). The weights here start as one tree per
layer, as they would when loaded from elsewhere, and go through `plan.from_layers`.
On a machine without accelerators the script fakes 8 CPU devices.
"""
from __future__ import annotations

import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import argparse  # noqa: E402
import dataclasses  # noqa: E402

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jfsdp  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Config:
    vocab: int = 97       # awkward sizes on purpose: nothing divides 8 devices
    width: int = 40
    heads: int = 3
    head_dim: int = 16    # 3 heads x 16 = 48, projected back to the width 40
    layers: int = 3
    mlp: int = 160
    max_len: int = 64


class Block(nn.Module):
    """Pre-LayerNorm decoder block with biases: causal multi-head attention, then a GELU MLP."""
    cfg: Config

    @nn.compact
    def __call__(self, x):
        c, (b, t, _) = self.cfg, x.shape
        qkv = nn.Dense(3 * c.heads * c.head_dim, name="qkv")(nn.LayerNorm(name="ln1")(x))
        q, k, v = jnp.split(qkv.reshape(b, t, 3 * c.heads, c.head_dim), 3, axis=2)
        att = jnp.einsum("bthd,bshd->bhts", q, k) / np.sqrt(c.head_dim)
        att = jnp.where(jnp.tril(jnp.ones((t, t), bool)), att, jnp.finfo(att.dtype).min)
        y = jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(att, axis=-1), v).reshape(b, t, -1)
        x = x + nn.Dense(c.width, name="proj")(y)
        y = nn.Dense(c.mlp, name="fc")(nn.LayerNorm(name="ln2")(x))
        return x + nn.Dense(c.width, name="out")(nn.gelu(y))


class GPT(nn.Module):
    """The root: token + learned position embeddings in, final LayerNorm + untied head (with bias) out."""
    cfg: Config

    def setup(self):
        c = self.cfg
        self.wte = nn.Embed(c.vocab, c.width, embedding_init=nn.initializers.normal(0.02))
        self.wpe = self.param("wpe", nn.initializers.normal(0.01), (c.max_len, c.width))
        self.ln_f = nn.LayerNorm()
        self.lm_head = nn.Dense(c.vocab)

    def embed(self, tokens):
        return self.wte(tokens) + self.wpe[: tokens.shape[1]]

    def head(self, h):
        return self.lm_head(self.ln_f(h))


def loss_fn(logits, batch):
    """The loss contract: the head's outputs for one device's rows and those rows of the batch dict
    -> the mean loss over them."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, batch["targets"][..., None], axis=-1))


def data(cfg: Config, steps: int, batch: int, seq: int, seed: int = 0):
    """A learnable toy language: each sequence counts up by its own stride modulo the vocabulary."""
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        start, stride = rng.integers(0, cfg.vocab, (batch, 1)), rng.integers(1, 7, (batch, 1))
        tok = (start + stride * np.arange(seq + 1)) % cfg.vocab
        yield {"inputs": tok[:, :-1].astype(np.int32), "targets": tok[:, 1:].astype(np.int32)}


def init_layers(cfg: Config, seq: int, seed: int = 0):
    """Weights as a user has them: the root's tree and one tree per layer (plain Flax init)."""
    @jax.jit  # one program: Flax init run eagerly dispatches op by op
    def init(key):
        keys = jax.random.split(key, cfg.layers + 1)
        tokens = jnp.zeros((1, seq), jnp.int32)
        root = GPT(cfg).init(keys[0], tokens, method=lambda m, x: m.head(m.embed(x)))["params"]
        h = jnp.zeros((1, seq, cfg.width))
        return root, [Block(cfg).init(k, h)["params"] for k in keys[1:]]
    return jax.device_get(init(jax.random.key(seed)))


def train(mesh: str = "2x4", strategy: str = "full_shard", steps: int = 200, batch: int = 16, seq: int = 32,
          remat: str = "full", weights=None, optimizer=None, devices=None, cfg: Config = Config()):
    """Train with jfsdp; returns (plan, final state, losses). `weights`: (root, [layer trees])."""
    r, s = jfsdp.parse_mesh(mesh)
    mesh = jfsdp.make_mesh(mesh, devices=(devices or jax.devices())[: r * s])
    model = jfsdp.Stacked(GPT(cfg), Block(cfg), cfg.layers)
    plan = jfsdp.fully_shard(model, mesh, jax.ShapeDtypeStruct((batch, seq), jnp.int32), strategy=strategy,
                             remat=remat)
    optimizer = optimizer or jfsdp.adamw(3e-3, weight_decay=0.1)  # decays matrices only, by default
    root, layers = weights or init_layers(cfg, seq)
    state = jfsdp.init_state(plan, optimizer, params=plan.from_layers(root, layers))  # your arrays stay yours
    step = jfsdp.make_train_step(plan, optimizer, loss_fn)  # donates `state`: keep the one it returns
    losses = []
    for b in data(cfg, steps, batch, seq):
        state, metrics = step(state, plan.put_batch(b))  # put_batch: checked, split over the devices
        losses.append(float(metrics["loss"]))
    return plan, state, losses


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mesh", default="2x4")
    p.add_argument("--strategy", default="full_shard")
    p.add_argument("--steps", type=int, default=200)
    a = p.parse_args()
    try:
        plan, state, losses = train(a.mesh, a.strategy, a.steps)
    except jfsdp.ConfigError as e:
        raise SystemExit(f"error: {e}")
    for i in range(0, len(losses), max(1, len(losses) // 10)):
        print(f"step {i + 1:>4}  loss {losses[i]:.4f}")
    print(f"final loss {losses[-1]:.4f} on {a.mesh} {plan.strategy.value}")
    root, layers = plan.to_layers(plan.gather(state.params))  # back to one tree per layer, host arrays
    print(f"trained weights: root {sorted(root)}, {len(layers)} layers of {sorted(layers[0])}")


if __name__ == "__main__":
    main()
