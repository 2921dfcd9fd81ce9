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


# uneven last block, one exact block (not causal: no mask at all), one oversized block (clamped to T: the exact
# block's program, so once)
@pytest.mark.parametrize("causal, block", [(True, 8), (False, 8), (True, 37), (False, 37), (True, 64)])
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


def test_the_ring_kernel_makes_no_array_per_block_under_remat():
    """The two halves the ring runs per hop (blockwise_attention_fwd / _bwd, not causal), inside a custom VJP
    under jax.checkpoint and grad, as a unit runs them: no value of the program is as large as one (T, block)
    score row per head. A mask that depended on the key block only was precomputed for all blocks at once
    there, (n, B, K, G, block, block) booleans per call (256 MiB per hop at llama-8b's heads, 16,384 tokens;
    docs/context-parallel.md); the outputs themselves, (T, H, D), stay. (The other lever, stacked outputs
    made from a zero tied to the call, is XLA:GPU's to see: test_context_parallel's H100 ring test.)"""
    from models.attention import blockwise_attention_bwd, blockwise_attention_fwd
    b, t, h, kv, d, block = 1, 256, 4, 2, 8, 16

    @jax.custom_vjp
    def att(q, k, v):
        return fwd(q, k, v)[0]

    def fwd(q, k, v):
        o, lse = blockwise_attention_fwd(q, k, v, causal=False, block=block)
        return o.astype(q.dtype), (q, k, v, o.astype(q.dtype), lse)

    def bwd(res, do):
        return tuple(g.astype(x.dtype) for g, x in zip(blockwise_attention_bwd(*res, do, causal=False, block=block),
                                                        res[:3]))
    att.defvjp(fwd, bwd)
    q = jax.ShapeDtypeStruct((b, t, h, d), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((b, t, kv, d), jnp.bfloat16)
    loss = lambda q, k, v: jax.checkpoint(lambda *a: att(*a).astype(jnp.float32).sum())(q, k, v)
    jaxpr = jax.make_jaxpr(jax.grad(loss, (0, 1, 2)))(q, k, k).jaxpr

    def sizes(j):
        for eqn in j.eqns:
            yield from (int(np.prod(v.aval.shape)) for v in eqn.outvars if hasattr(v.aval, "shape"))
            for p in eqn.params.values():
                for x in (p if isinstance(p, (list, tuple)) else [p]):
                    inner = getattr(x, "jaxpr", None)
                    if inner is not None:
                        yield from sizes(getattr(inner, "jaxpr", inner))
    assert max(sizes(jaxpr)) <= b * t * h * d          # the output's size; one (T, block) row per head: 16x it
    assert b * t * h * block > b * t * h * d

    def stacking(j):
        # scans with per-iteration outputs: JAX's partial evaluation split the kernel's static-bound loops under
        # the checkpoint into a scan stacking every key and value block (a copy of K and V per call) and one
        # recomputing the rest; XLA:GPU kept those stacks through the step (15.75 GiB at llama-8b 1.5M, C = 8)
        for eqn in j.eqns:
            if eqn.primitive.name == "scan" and len(eqn.outvars) > eqn.params["num_carry"]:
                yield [str(v.aval) for v in eqn.outvars[eqn.params["num_carry"]:]]
            for p in eqn.params.values():
                for x in (p if isinstance(p, (list, tuple)) else [p]):
                    inner = getattr(x, "jaxpr", None)
                    if inner is not None:
                        yield from stacking(getattr(inner, "jaxpr", inner))
    assert not list(stacking(jaxpr))
