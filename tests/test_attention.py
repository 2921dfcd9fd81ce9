"""Blockwise attention (models/attention.py) against the textbook computation, and its memory from
the compiled program: O(T), where the plain path keeps (B, H, T, T) scores."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.attention import blockwise_attention


def rel(a, b):
    return float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))) / jnp.max(jnp.abs(b)))


def plain_attention(q, k, v, causal=True):
    """The textbook computation (as models/llama.py wrote it): repeat K/V, full (T, T) scores."""
    T, D, g = q.shape[1], q.shape[3], q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, g, 2), jnp.repeat(v, g, 2)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) / np.sqrt(D)
    if causal:
        s = jnp.where(jnp.tril(jnp.ones((T, T), bool)), s, jnp.finfo(jnp.float32).min)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1).astype(v.dtype), v)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("block", [8, 37, 64])     # uneven last block, one exact block, one oversized block
def test_blockwise_attention_equals_plain(causal, block):
    ks = jax.random.split(jax.random.key(1), 4)
    B, T, H, K, D = 2, 37, 6, 2, 16                  # grouped-query attention 6:2
    with jax.default_device(jax.devices()[0]):
        q, do = jax.random.normal(ks[0], (B, T, H, D)), jax.random.normal(ks[3], (B, T, H, D))
        k, v = jax.random.normal(ks[1], (B, T, K, D)), jax.random.normal(ks[2], (B, T, K, D))
        o, vjp = jax.vjp(lambda *a: blockwise_attention(*a, causal=causal, block=block), q, k, v)
        r, rvjp = jax.vjp(lambda *a: plain_attention(*a, causal=causal), q, k, v)
        assert rel(o, r) < 1e-5
        for a, b in zip(vjp(do), rvjp(do)):
            assert a.shape == b.shape and rel(a, b) < 1e-5


def test_blockwise_attention_memory_is_linear_in_sequence():
    """Compiled temporary memory of attention + its gradients: the plain path grows with T^2 (the
    (B, H, T, T) fp32 scores: 64 MiB at T = 2048 with 4 heads), the blockwise one with T."""
    B, H, K, D, block = 1, 4, 2, 32, 256

    def temp(f, T):
        q = jax.ShapeDtypeStruct((B, T, H, D), jnp.float32)
        kv = jax.ShapeDtypeStruct((B, T, K, D), jnp.float32)
        g = jax.jit(lambda q, k, v: jax.grad(lambda *a: jnp.sum(f(*a) ** 2), (0, 1, 2))(q, k, v))
        return g.lower(q, kv, kv).compile().memory_analysis().temp_size_in_bytes

    blockwise = lambda q, k, v: blockwise_attention(q, k, v, block=block)
    f1, f2 = temp(blockwise, 2048), temp(blockwise, 4096)
    p1, p2 = temp(plain_attention, 2048), temp(plain_attention, 4096)
    scores = B * H * 2048 * 2048 * 4
    assert p1 >= scores and p2 >= 3.5 * p1 * 0.9            # quadratic
    assert f2 <= 2.2 * f1 and f1 < scores / 4              # linear, and far below one score matrix
    print(f"attention temp bytes T=2048/4096: plain {p1:,}/{p2:,}, blockwise {f1:,}/{f2:,}")
