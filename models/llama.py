"""A Llama-style decoder in Flax: RMSNorm, rotary embeddings, SwiGLU, grouped-query attention.

The model is written as two modules, which is all a sharding library needs to know about it:
`LlamaRoot` holds the non-repeated parameters (token embedding, final norm, output head) and has
two methods, `embed(tokens) -> h` and `head(h) -> logits`; `LlamaBlock` is the repeated decoder
layer, `h -> h`. Nothing here knows about devices, meshes or sharding.
"""
from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp

from models.attention import blockwise_attention
from models.attention_cudnn import applies as cudnn_applies
from models.tiled_mlp import tiled_swiglu

ATTENTION = ("auto", "blockwise", "cudnn", "xla")
# Below this many tokens the T x T scores of the XLA reference are small (4 MiB per head-batch at 1024)
# and its single fused program is faster on CPU; from here on, "auto" switches to blockwise attention.
BLOCKWISE_FROM = 1024


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int = 259
    dim: int = 96
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    ffn_dim: int = 200
    max_seq_len: int = 2048
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = True
    init_std: float = 0.02
    # attention: "blockwise" (models/attention.py: O(T) memory on every backend), "cudnn" (cuDNN's
    # fused attention where it applies), "xla" (jax.nn.dot_product_attention's reference: keeps the
    # T x T scores), "auto" (cudnn on a CUDA backend; elsewhere blockwise from 1024 tokens, xla
    # below); see attention_impl
    attention: str = "auto"
    # run the MLP over the sequence in tiles of this many tokens, each tile under its own checkpoint, so that
    # a unit's backward holds one tile's (tile x ffn_dim) intermediates rather than the whole sequence's
    # (Arctic Long Sequence Training's TiledMLP; docs/context-parallel.md). 0: off, the program unchanged.
    # It must divide the tokens each call sees (T, or T / C under context parallelism).
    mlp_tile: int = 0

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def __post_init__(self):
        if self.dim % self.n_heads or self.n_heads % self.n_kv_heads:
            raise ValueError(f"dim {self.dim}, n_heads {self.n_heads}, n_kv_heads {self.n_kv_heads}: "
                             "dim must divide by n_heads and n_heads by n_kv_heads")
        if self.attention not in ATTENTION:
            raise ValueError(f"attention '{self.attention}': choose {', '.join(ATTENTION)}")
        if self.mlp_tile < 0:
            raise ValueError(f"mlp_tile {self.mlp_tile} must not be negative (0: no tiling)")

    def num_params(self) -> int:
        d, f, v = self.dim, self.ffn_dim, self.vocab_size
        kv = self.n_kv_heads * self.head_dim
        block = 2 * d + d * d + 2 * d * kv + d * d + 3 * d * f
        root = v * d + d + (0 if self.tie_embeddings else d * v)
        return root + self.n_layers * block


class RMSNorm(nn.Module):
    eps: float = 1e-5

    @nn.compact
    def __call__(self, x):
        scale = self.param("scale", nn.initializers.ones, (x.shape[-1],))
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (y * scale.astype(jnp.float32)).astype(x.dtype)


def rotary(x, theta: float, positions=None):
    """Rotate pairs (i, i + hd/2) of each head by a position-dependent angle (the Llama/HF layout).
    `positions` (T,): each token's position (default 0..T-1)."""
    t, hd = x.shape[1], x.shape[-1]
    inv_freq = 1.0 / theta ** (jnp.arange(0, hd, 2, dtype=jnp.float32) / hd)
    pos = jnp.arange(t, dtype=jnp.float32) if positions is None else positions.astype(jnp.float32)
    angles = pos[:, None] * inv_freq[None, :]  # (T, hd/2)
    cos = jnp.concatenate([jnp.cos(angles)] * 2, axis=-1)[None, :, None, :]
    sin = jnp.concatenate([jnp.sin(angles)] * 2, axis=-1)[None, :, None, :]
    x32 = x.astype(jnp.float32)
    x1, x2 = x32[..., : hd // 2], x32[..., hd // 2:]
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return (x32 * cos + rotated * sin).astype(x.dtype)


def _dense(features: int, name: str, std: float):
    return nn.Dense(features, use_bias=False, name=name, kernel_init=nn.initializers.normal(std))


def attention_impl(cfg: LlamaConfig, dtype, seq_len: int | None = None) -> str:
    """Which attention runs for this config and compute dtype: "cudnn" (jax.nn.dot_product_attention's
    fused kernel: 16-bit floats, head_dim a multiple of 8 up to 128), "blockwise" (models/attention.py,
    any dtype and backend, O(T) memory) or "xla" (the reference, T x T scores; only when asked for).
    "auto" uses cuDNN only on a CUDA backend; "cudnn" wherever it applies (for a program compiled for
    a GPU on another machine); where cuDNN does not apply (fp32, CPU) both fall back to blockwise
    attention from BLOCKWISE_FROM tokens on (or when the length is not given), to the XLA reference below."""
    if cfg.attention in ("xla", "blockwise"):
        return cfg.attention
    if cudnn_applies(dtype, cfg.head_dim) and (cfg.attention == "cudnn" or jax.default_backend() == "gpu"):
        return "cudnn"
    return "blockwise" if seq_len is None or seq_len >= BLOCKWISE_FROM else "xla"


class Attention(nn.Module):
    cfg: LlamaConfig

    @nn.compact
    def __call__(self, x):
        c = self.cfg
        b, t, _ = x.shape
        hd = c.head_dim
        # the head counts come from the projections' widths (-1): a caller may hand each projection a
        # share of the heads (tensor parallelism runs this code on n_heads / T heads per device)
        q = _dense(c.n_heads * hd, "wq", c.init_std)(x).reshape(b, t, -1, hd)
        k = _dense(c.n_kv_heads * hd, "wk", c.init_std)(x).reshape(b, t, -1, hd)
        v = _dense(c.n_kv_heads * hd, "wv", c.init_std)(x).reshape(b, t, -1, hd)
        pos = self.positions(t)
        q, k = rotary(q, c.rope_theta, pos), rotary(k, c.rope_theta, pos)
        out = self.attend(q, k, v).reshape(b, t, -1)
        return _dense(c.dim, "wo", c.init_std)(out)

    # Two methods rather than inline code, so that a caller who splits the sequence over devices (context
    # parallelism, which intercepts them) can give each part its tokens' positions and its own attention.
    def positions(self, t: int):
        """The positions of the t tokens this call sees: 0..t-1."""
        return jnp.arange(t, dtype=jnp.float32)

    def attend(self, q, k, v):
        """Causal attention, grouped-query natively (k and v keep their n_kv_heads, no repeat)."""
        impl = attention_impl(self.cfg, q.dtype, q.shape[1])
        if impl == "blockwise":
            return blockwise_attention(q, k, v, causal=True)
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=impl)


class FeedForward(nn.Module):
    cfg: LlamaConfig

    def setup(self):
        c = self.cfg
        self.w1 = _dense(c.ffn_dim, "w1", c.init_std)
        self.w3 = _dense(c.ffn_dim, "w3", c.init_std)
        self.w2 = _dense(c.dim, "w2", c.init_std)

    def __call__(self, x):
        tile, t = self.cfg.mlp_tile, x.shape[1]
        if not tile or tile >= t:
            return self.swiglu(x)
        if t % tile:
            raise ValueError(f"mlp_tile {tile} does not divide the {t} tokens of this call")
        if self.is_initializing():   # the parameters, made as the untiled call makes them
            return self.swiglu(x)
        ws = [getattr(self, n).variables["params"]["kernel"] for n in ("w1", "w3", "w2")]
        if all(isinstance(w, jax.Array) for w in ws):
            # a loop over the tiles with its own VJP, each tile's intermediates recomputed in the backward
            # and no buffer XLA can hoist out of the loop over layers (models/tiled_mlp.py)
            return tiled_swiglu(x, *ws, tile)
        # kernels that are not plain arrays (float8's): (B, T, d) -> (T/tile, B, tile, d), a scan over the
        # tiles, each one's intermediates recomputed in its own backward (nn.remat), the weights shared by
        # every tile (variable_broadcast)
        b, d = x.shape[0], x.shape[2]
        tiles = x.reshape(b, t // tile, tile, d).swapaxes(0, 1)
        body = nn.remat(lambda mdl, carry, xt: (carry, mdl.swiglu(xt)), prevent_cse=False)
        _, y = nn.scan(body, variable_broadcast="params", split_rngs={"params": False})(self, None, tiles)
        return y.swapaxes(0, 1).reshape(b, t, -1)

    def swiglu(self, x):
        return self.w2(nn.silu(self.w1(x)) * self.w3(x))


class LlamaBlock(nn.Module):
    """One decoder layer: the FSDP unit."""
    cfg: LlamaConfig

    @nn.compact
    def __call__(self, x):
        c = self.cfg
        x = x + Attention(c, name="attention")(RMSNorm(c.norm_eps, name="attention_norm")(x))
        return x + FeedForward(c, name="feed_forward")(RMSNorm(c.norm_eps, name="ffn_norm")(x))


class LlamaRoot(nn.Module):
    """The non-repeated parameters: token embedding, final norm and output head (tied or not)."""
    cfg: LlamaConfig

    def setup(self):
        c = self.cfg
        self.tok_embeddings = nn.Embed(c.vocab_size, c.dim, embedding_init=nn.initializers.normal(c.init_std))
        self.norm = RMSNorm(c.norm_eps)
        if not c.tie_embeddings:
            self.output = _dense(c.vocab_size, "output", c.init_std)

    def embed(self, tokens):
        return self.tok_embeddings(tokens)

    def head(self, h):
        h = self.norm(h)
        return self.tok_embeddings.attend(h) if self.cfg.tie_embeddings else self.output(h)

    def head_features(self, h):
        """The head without its matmul: (normed hidden states, head weight), for a loss that fuses the
        output projection with the cross-entropy and never forms the logits. The weight is the
        embedding table (V, d) when tied, the output kernel (d, V) otherwise (`vocab_major` =
        `cfg.tie_embeddings`)."""
        h = self.norm(h)
        if self.cfg.tie_embeddings:
            return h, self.tok_embeddings.embedding
        if self.is_initializing():   # create the kernel exactly as `head` would
            self.output(h)
        return h, self.output.variables["params"]["kernel"]


class Llama(nn.Module):
    """The whole decoder as one module, written the usual Flax way: the root's embedding, a Python loop
    over the blocks, the root's head. The same parameters as `parts` gives ({'root': ..., 'layers_i':
    ...} per block), for training a model given as it is (FSDP units: `LlamaBlock`)."""
    cfg: LlamaConfig

    def setup(self):
        self.root = LlamaRoot(self.cfg)
        self.layers = [LlamaBlock(self.cfg) for _ in range(self.cfg.n_layers)]

    def __call__(self, tokens):
        h = self.root.embed(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.root.head(h)


class ScannedBlock(LlamaBlock):
    """A decoder layer in `nn.scan`'s calling convention: (carry, x) -> (carry, output)."""

    def __call__(self, h, _):
        return super().__call__(h), None


class ScannedLlama(nn.Module):
    """The decoder with its blocks under `nn.scan` (parameters stacked on a leading layer axis), the way
    deep Flax models keep compile time flat in depth; same root and blocks as `Llama`. Its parts are
    made in `setup` (the same parameters and values as inline in `__call__`), so that a `call=` can
    reach `self.root` and `self.layers`, as for `Llama` (models.factory.as_is_model's fused head)."""
    cfg: LlamaConfig

    def setup(self):
        self.root = LlamaRoot(self.cfg)
        self.layers = nn.scan(ScannedBlock, variable_axes={"params": 0}, split_rngs={"params": True},
                              length=self.cfg.n_layers)(self.cfg)

    def __call__(self, tokens):
        h, _ = self.layers(self.root.embed(tokens), None)
        return self.root.head(h)


def lm_loss(logits, batch):
    """Mean next-token cross-entropy; `batch["targets"]` holds the inputs shifted by one."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    nll = -jnp.take_along_axis(logp, batch["targets"][..., None], axis=-1)[..., 0]
    return jnp.mean(nll)


def parts(cfg: LlamaConfig):
    """(root module, unit module, number of units)."""
    return LlamaRoot(cfg), LlamaBlock(cfg), cfg.n_layers
