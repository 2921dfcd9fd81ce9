"""A residual MLP classifier: a second model family, so the engine is not Llama-shaped.

`ResMLPRoot.embed` projects input features to the model width, `ResMLPBlock` is a pre-norm
residual MLP (the repeated unit), `ResMLPRoot.head` normalizes and classifies.
"""
from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class ResMLPConfig:
    in_dim: int = 37
    dim: int = 96
    hidden_dim: int = 200
    n_layers: int = 3
    n_classes: int = 11

    def num_params(self) -> int:
        d, h = self.dim, self.hidden_dim
        block = 2 * d + d * h + h + h * d + d
        return self.in_dim * d + d + 2 * d + d * self.n_classes + self.n_classes + self.n_layers * block


class ResMLPBlock(nn.Module):
    cfg: ResMLPConfig

    @nn.compact
    def __call__(self, x):
        y = nn.LayerNorm(name="norm")(x)
        y = nn.gelu(nn.Dense(self.cfg.hidden_dim, name="fc1")(y))
        return x + nn.Dense(self.cfg.dim, name="fc2")(y)


class ResMLPRoot(nn.Module):
    cfg: ResMLPConfig

    def setup(self):
        self.proj = nn.Dense(self.cfg.dim)
        self.norm = nn.LayerNorm()
        self.classifier = nn.Dense(self.cfg.n_classes)

    def embed(self, x):
        return self.proj(x)

    def head(self, h):
        return self.classifier(self.norm(h))


def classification_loss(logits, batch):
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, batch["targets"][:, None], axis=-1))


def parts(cfg: ResMLPConfig):
    return ResMLPRoot(cfg), ResMLPBlock(cfg), cfg.n_layers
