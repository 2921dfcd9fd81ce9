"""A Mixture-of-Experts Llama (Mixtral-style) in Flax: every MoE layer replaces the SwiGLU feed-forward
by E SwiGLU experts of which each token uses its top k.

Routing (per sequence: a sequence is a routing group, so nothing depends on how rows are split
over devices):
- the router gives each token E logits (fp32); the token goes to its k most probable experts with
  weights softmax(top-k logits) (Mixtral's gate: the top-k probabilities renormalized);
- each expert takes at most C = ceil(capacity_factor * T * k / E) tokens of a sequence; slots are
  given first to every token's first choice, then to second choices (GShard's priority), tokens in
  order; a choice that finds its expert full is dropped (its weight is lost; the residual carries
  the token on) and counted;
- load-balancing loss of a sequence (Switch Transformer, with k choices): E * sum_e f_e * P_e, f_e the
  fraction of the sequence's T*k choices that picked e (before capacity), P_e the mean router
  probability of e. It is 1 when routing is uniform.

The experts are one module, `Experts`, called on buckets of shape (E, slots, d) (row e: the tokens
sent to expert e) and returning the same shape; its weights have the expert axis first (E, d, f).
That call is the one place where a sharding library may step in (send the buckets to the devices
that hold the experts instead of gathering the weights); nothing here knows about devices.

Auxiliary outputs travel with the hidden state: every unit maps (x, stats) -> (x, stats), stats of
shape (B, 5) fp32 holding per sequence [sum over MoE layers of the aux loss, dropped choices, routed
choices, largest capacity (slots per expert) any MoE layer ran with, largest load (choices that picked
one expert, before capacity: the capacity that would have dropped nothing) of any MoE layer]. The
head returns {'out': logits (or head features), 'moe_stats': stats}; `loss(inner, coef)` adds coef x
the mean aux loss to the language-model loss. Both are per-row means, so the loss stays a mean over
rows (the loss contract of jfsdp and of any data-parallel trainer).
"""
from __future__ import annotations

import dataclasses
import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from models.llama import Attention, LlamaBlock, LlamaConfig, LlamaRoot, RMSNorm

AUX, DROPPED, ROUTED, CAPACITY, LOAD = 0, 1, 2, 3, 4
N_STATS = 5


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    vocab_size: int = 259
    dim: int = 72
    n_layers: int = 2          # MoE layers (the second stage)
    n_dense_layers: int = 0    # dense Llama layers before them (a first stage), as in DeepSeek-MoE
    n_heads: int = 4
    n_kv_heads: int = 2
    ffn_dim: int = 120         # the dense layers' SwiGLU width
    expert_dim: int = 56       # each expert's SwiGLU width
    n_experts: int = 8
    top_k: int = 2
    capacity_factor: float = 1.25
    aux_coef: float = 0.01
    max_seq_len: int = 2048
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = True
    init_std: float = 0.02
    attention: str = "auto"

    def __post_init__(self):
        if not 1 <= self.top_k <= self.n_experts:
            raise ValueError(f"top_k {self.top_k} must be between 1 and n_experts {self.n_experts}")
        if self.capacity_factor <= 0:
            raise ValueError(f"capacity_factor must be positive, got {self.capacity_factor}")
        self.llama()  # validates the attention shape

    def llama(self) -> LlamaConfig:
        """The dense parts (attention, norms, dense layers, embedding) as a LlamaConfig."""
        return LlamaConfig(vocab_size=self.vocab_size, dim=self.dim, n_layers=self.n_dense_layers, n_heads=self.n_heads,
                           n_kv_heads=self.n_kv_heads, ffn_dim=self.ffn_dim, max_seq_len=self.max_seq_len,
                           rope_theta=self.rope_theta, norm_eps=self.norm_eps, tie_embeddings=self.tie_embeddings,
                           init_std=self.init_std, attention=self.attention)

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def capacity(self, tokens: int) -> int:
        """Slots per expert for a routing group (one sequence) of `tokens` tokens."""
        return min(tokens, math.ceil(self.capacity_factor * tokens * self.top_k / self.n_experts))

    def num_params(self) -> int:
        d, v, e = self.dim, self.vocab_size, self.n_experts
        kv = self.n_kv_heads * self.head_dim
        attn = 2 * d + 2 * d * d + 2 * d * kv
        dense = attn + 3 * d * self.ffn_dim
        moe = attn + d * e + e * 3 * d * self.expert_dim
        root = v * d + d + (0 if self.tie_embeddings else d * v)
        return root + self.n_dense_layers * dense + self.n_layers * moe

    def active_params(self) -> int:
        """Parameters a token uses (k of the E experts)."""
        return self.num_params() - self.n_layers * (self.n_experts - self.top_k) * 3 * self.dim * self.expert_dim


class Experts(nn.Module):
    """E SwiGLU experts applied row by row: buckets (E, slots, d) -> (E, slots, d). Row e of the
    buckets only meets expert e's weights, so any subset of rows can be computed with the same
    subset of the weights (a module with `n_experts` = that subset's size)."""
    n_experts: int
    dim: int
    hidden: int
    init_std: float = 0.02

    @nn.compact
    def __call__(self, buckets):
        init = nn.initializers.normal(self.init_std)
        e, d, f = self.n_experts, self.dim, self.hidden
        w1 = self.param("w1", init, (e, d, f))
        w3 = self.param("w3", init, (e, d, f))
        w2 = self.param("w2", init, (e, f, d))
        x = buckets
        w1, w3, w2 = (w.astype(x.dtype) for w in (w1, w3, w2))
        g = nn.silu(jnp.einsum("ecd,edf->ecf", x, w1)) * jnp.einsum("ecd,edf->ecf", x, w3)
        return jnp.einsum("ecf,efd->ecd", g, w2)


def route(logits, k: int, capacity: int):
    """Top-k routing of one batch of sequences. logits (B, T, E) fp32 ->
    (slot (B, T, k) int32 into the E*C slots of its sequence, or E*C for a dropped choice,
     gate (B, T, k) weights, aux (B,), dropped (B,) choices that found their expert full, load (B,) the
     most choices that picked one expert, before capacity)."""
    b, t, e = logits.shape
    probs = jax.nn.softmax(logits, axis=-1)
    top_logits, idx = jax.lax.top_k(logits, k)                           # (B, T, k)
    gate = jax.nn.softmax(top_logits, axis=-1)
    # choices in priority order: every token's 1st choice, then every 2nd choice, ...
    onehot = jax.nn.one_hot(jnp.swapaxes(idx, 1, 2), e, dtype=jnp.int32)  # (B, k, T, E)
    flat = onehot.reshape(b, k * t, e)
    pos = jnp.cumsum(flat, axis=1) - 1                                   # position within the expert
    pos = jnp.sum(pos * flat, axis=-1).reshape(b, k, t)                  # of each choice
    pos = jnp.swapaxes(pos, 1, 2)                                        # (B, T, k)
    keep = pos < capacity
    slot = jnp.where(keep, idx * capacity + pos, e * capacity).astype(jnp.int32)
    f = jnp.mean(flat.astype(jnp.float32), axis=1)                       # (B, E) share of choices
    p = jnp.mean(probs, axis=1)                                          # (B, E) mean probability
    aux = e * jnp.sum(f * p, axis=-1)
    dropped = jnp.sum(~keep, axis=(1, 2)).astype(jnp.float32)
    load = jnp.max(jnp.sum(flat, axis=1), axis=-1).astype(jnp.float32)
    return slot, gate, aux, dropped, load


class MoEFeedForward(nn.Module):
    """Router, dispatch into per-expert buckets, `Experts`, combine. x (B, T, d) ->
    (y (B, T, d), aux (B,), dropped (B,), capacity (B,), routed choices (B,): T*k, load (B,): the most
    choices of the sequence that picked one expert).

    `capacity`: slots per expert per sequence; None: the config's capacity factor (`MoEConfig.capacity`).
    `load(x)`: the router's load before dispatch, (B, E) choices per expert per sequence. Together they
    let a runner outside the model pick the capacity per call from the measured load (jfsdp's adaptive
    MoE mode clones this module with another `capacity`); the outputs' shapes do not depend on it."""
    cfg: MoEConfig
    capacity: int | None = None

    @property
    def n_experts(self) -> int:
        return self.cfg.n_experts

    @property
    def top_k(self) -> int:
        return self.cfg.top_k

    def setup(self):
        c = self.cfg
        self.router = nn.Dense(c.n_experts, use_bias=False, kernel_init=nn.initializers.normal(c.init_std))
        self.experts = Experts(c.n_experts, c.dim, c.expert_dim, c.init_std)

    def load(self, x):
        """(B, E) int32: how many of each sequence's T*k choices picked each expert (before capacity)."""
        _, idx = jax.lax.top_k(self.router(x).astype(jnp.float32), self.cfg.top_k)
        return jnp.sum(jax.nn.one_hot(idx, self.cfg.n_experts, dtype=jnp.int32), axis=(1, 2))

    def __call__(self, x):
        c = self.cfg
        b, t, d = x.shape
        e, k = c.n_experts, c.top_k
        cap = c.capacity(t) if self.capacity is None else self.capacity
        logits = self.router(x).astype(jnp.float32)
        slot, gate, aux, dropped, load = route(logits, k, cap)
        # dispatch: each kept choice copies its token into its slot; slot E*C collects the dropped
        rows = jnp.arange(b)[:, None]
        xk = jnp.broadcast_to(x[:, :, None, :], (b, t, k, d)).reshape(b, t * k, d)
        buckets = jnp.zeros((b, e * cap + 1, d), x.dtype).at[rows, slot.reshape(b, t * k)].add(xk)
        buckets = buckets[:, : e * cap].reshape(b, e, cap, d).transpose(1, 0, 2, 3).reshape(e, b * cap, d)
        out = self.experts(buckets)
        out = out.reshape(e, b, cap, d).transpose(1, 0, 2, 3).reshape(b, e * cap, d)
        out = jnp.concatenate([out, jnp.zeros((b, 1, d), out.dtype)], axis=1)
        picked = out[rows, slot.reshape(b, t * k)].reshape(b, t, k, d)
        y = jnp.sum(picked * gate[..., None].astype(x.dtype), axis=2)
        # routed choices per sequence: t * k of the whole sequence (a runner may call this layer on whole
        # sequences while the block around it sees a part of each: sequence parallelism)
        return y, aux, dropped, jnp.full((b,), cap, jnp.float32), jnp.full((b,), t * k, jnp.float32), load


def _add_stats(stats, aux, dropped, routed, capacity, load):
    zero = jnp.zeros_like(aux)
    new = jnp.stack([aux, dropped, routed, zero, zero], axis=-1)
    out = (stats + new).at[:, CAPACITY].set(jnp.maximum(stats[:, CAPACITY], capacity))
    return out.at[:, LOAD].set(jnp.maximum(stats[:, LOAD], load))


class MoEBlock(nn.Module):
    """One decoder layer with an MoE feed-forward: (x, stats) -> (x, stats). The FSDP unit."""
    cfg: MoEConfig

    @nn.compact
    def __call__(self, h):
        x, stats = h
        c, lc = self.cfg, self.cfg.llama()
        x = x + Attention(lc, name="attention")(RMSNorm(c.norm_eps, name="attention_norm")(x))
        y, aux, dropped, cap, routed, load = MoEFeedForward(c, name="moe")(RMSNorm(c.norm_eps, name="ffn_norm")(x))
        return x + y, _add_stats(stats, aux, dropped, routed, cap, load)


class DenseBlock(nn.Module):
    """A dense Llama layer carrying the stats along: (x, stats) -> (x, stats)."""
    cfg: MoEConfig

    @nn.compact
    def __call__(self, h):
        x, stats = h
        return LlamaBlock(self.cfg.llama(), name="block")(x), stats


class MoERoot(nn.Module):
    """Embedding in, final norm and head out, as `LlamaRoot`; embed starts the stats at zero and the
    head hands them on beside its output."""
    cfg: MoEConfig

    def setup(self):
        self.lm = LlamaRoot(self.cfg.llama())

    def embed(self, tokens):
        return self.lm.embed(tokens), jnp.zeros((tokens.shape[0], N_STATS), jnp.float32)

    # 'moe_stats' sorts before 'out': the head weight stays the last leaf of the outputs, where a
    # planner looking at a fused head's outputs (jfsdp.planning.estimate) finds it
    def head(self, h):
        x, stats = h
        return {"out": self.lm.head(x), "moe_stats": stats}

    def head_features(self, h):
        x, stats = h
        return {"out": self.lm.head_features(x), "moe_stats": stats}


def loss(inner, aux_coef: float):
    """The training loss of the MoE model: inner(outputs['out'], batch) (the language-model loss on
    logits or head features) + aux_coef x the mean over rows of the summed load-balancing losses."""
    def fn(outputs, batch):
        return inner(outputs["out"], batch) + aux_coef * jnp.mean(outputs["moe_stats"][:, AUX])
    fn.lm_loss = lambda outputs, batch: inner(outputs["out"], batch)   # the language-model part alone
    fn.chunk = getattr(inner, "chunk", None)              # what jfsdp.planning.estimate reads of a fused loss
    fn.vocab_major = getattr(inner, "vocab_major", False)
    fn.vocab_parallel = getattr(inner, "vocab_parallel", False)   # a loss that reduces over a split vocabulary
    return fn


def aux_loss(outputs, batch):
    """Metric: mean over rows of the load-balancing loss, summed over the MoE layers (as it enters the loss)."""
    return jnp.mean(outputs["moe_stats"][:, AUX])


def dropped_fraction(outputs, batch):
    """Metric: the fraction of routed choices dropped for capacity (every row routes as many, so the
    mean over devices of this is the global fraction)."""
    s = outputs["moe_stats"]
    return jnp.sum(s[:, DROPPED]) / jnp.maximum(jnp.sum(s[:, ROUTED]), 1.0)


def max_load(outputs, batch):
    """Metric: the most choices of one sequence that picked one expert in any MoE layer, before capacity:
    the smallest capacity that would have dropped nothing (take it with reduce 'max': the largest over
    devices and micro-batches)."""
    return jnp.max(outputs["moe_stats"][:, LOAD])


def capacity_used(outputs, batch):
    """Metric: the largest capacity (slots per expert per sequence) an MoE layer ran with. Every row of a
    step holds the same value when the capacity is chosen for the whole batch (jfsdp's adaptive mode
    takes the maximum load over all devices), so the mean over devices is that value."""
    return jnp.max(outputs["moe_stats"][:, CAPACITY])


def parts(cfg: MoEConfig):
    """(root module, [(unit module, number of units) per stage]): dense layers first if any."""
    stages = ([(DenseBlock(cfg), cfg.n_dense_layers)] if cfg.n_dense_layers else []) + [(MoEBlock(cfg), cfg.n_layers)]
    return MoERoot(cfg), stages
