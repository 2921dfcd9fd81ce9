"""The fused, chunked head + cross-entropy against the plain computation (full logits, log_softmax),
and its memory from the compiled program: the full logits never exist."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jfsdp.train.losses import linear_cross_entropy


def plain(h, w, t, vocab_major=False, weights=None):
    logits = jnp.einsum("...d,vd->...v" if vocab_major else "...d,dv->...v", h, w).astype(jnp.float32)
    nll = -jnp.take_along_axis(jax.nn.log_softmax(logits, -1), t[..., None], -1)[..., 0]
    if weights is None:
        return jnp.mean(nll)
    return jnp.sum(nll * weights) / jnp.sum(weights)


def data(B=3, T=37, d=48, V=259, dtype=jnp.float32):
    k = jax.random.split(jax.random.key(0), 4)
    h = jax.random.normal(k[0], (B, T, d)).astype(dtype)
    w = (0.2 * jax.random.normal(k[1], (d, V))).astype(dtype)
    t = jax.random.randint(k[2], (B, T), 0, V)
    return h, w, t


def rel(a, b):
    return float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))) / jnp.max(jnp.abs(b)))


@pytest.mark.parametrize("vocab_major", [False, True])      # untied (d, V) head, tied (V, d) embedding
@pytest.mark.parametrize("chunk", [16, 111, 4096])           # uneven last chunk, exact fit, one chunk
def test_equals_plain_fp32(vocab_major, chunk):
    with jax.default_device(jax.devices()[0]):
        h, w, t = data()
        w = w.T if vocab_major else w
        ours = jax.value_and_grad(lambda h, w: linear_cross_entropy(h, w, t, chunk=chunk, vocab_major=vocab_major),
                                  (0, 1))(h, w)
        ref = jax.value_and_grad(lambda h, w: plain(h, w, t, vocab_major), (0, 1))(h, w)
    assert abs(float(ours[0]) - float(ref[0])) <= 1e-5 * abs(float(ref[0]))
    for a, b in zip(ours[1], ref[1]):
        assert a.shape == b.shape and rel(a, b) < 1e-5


def test_weights_and_sum():
    with jax.default_device(jax.devices()[0]):
        h, w, t = data()
        m = (jax.random.uniform(jax.random.key(3), t.shape) > 0.3).astype(jnp.float32)
        ours = jax.grad(lambda h: linear_cross_entropy(h, w, t, weights=m, chunk=20))(h)
        ref = jax.grad(lambda h: plain(h, w, t, weights=m))(h)
        assert rel(ours, ref) < 1e-5
        assert np.all(np.asarray(ours)[np.asarray(m) == 0] == 0)   # a dropped token gets no gradient
        s = linear_cross_entropy(h, w, t, reduction="sum")
        assert abs(float(s) - float(plain(h, w, t)) * t.size) < 1e-4 * float(s)


def test_bf16_compute_accumulates_in_fp32():
    """bf16 inputs: close to the fp32 computation on the same (bf16-rounded) values, i.e. no bf16
    accumulation error over the vocabulary or the tokens."""
    with jax.default_device(jax.devices()[0]):
        h, w, t = data(dtype=jnp.bfloat16)
        loss, (dh, dw) = jax.value_and_grad(lambda h, w: linear_cross_entropy(h, w, t, chunk=32), (0, 1))(h, w)
        ref_loss, (rh, rw) = jax.value_and_grad(lambda h, w: plain(h, w, t), (0, 1))(h.astype(jnp.float32),
                                                                                    w.astype(jnp.float32))
    assert dh.dtype == jnp.bfloat16 and dw.dtype == jnp.bfloat16 and loss.dtype == jnp.float32
    assert abs(float(loss) - float(ref_loss)) < 1e-5 * float(ref_loss)
    assert rel(dh, rh) < 1e-2 and rel(dw, rw) < 1e-2     # bf16 rounding of the results only


def test_full_logits_never_exist():
    """Compiled temporary memory of loss + gradients: the plain path holds several (N, V) fp32
    buffers; the fused one holds about a chunk's worth. N = 4096 tokens, V = 8192: one (N, V) fp32
    buffer is 128 MiB; a chunk of 256 tokens is 8 MiB."""
    N, d, V, chunk = 4096, 256, 8192, 256
    h = jax.ShapeDtypeStruct((N, d), jnp.float32)
    w = jax.ShapeDtypeStruct((d, V), jnp.float32)
    t = jax.ShapeDtypeStruct((N,), jnp.int32)
    full = N * V * 4

    def temp(f):
        c = jax.jit(jax.value_and_grad(f, (0, 1))).lower(h, w, t).compile()
        return c.memory_analysis().temp_size_in_bytes

    plain_temp = temp(lambda h, w, t: plain(h, w, t))
    fused_temp = temp(lambda h, w, t: linear_cross_entropy(h, w, t, chunk=chunk))
    assert plain_temp >= 2 * full                      # the plain path: logits and their gradient at least
    # fused: a few chunk-sized (chunk, V) fp32 buffers, the fp32 weight-gradient accumulator, dh, the lse
    budget = 6 * chunk * V * 4 + 2 * d * V * 4 + 2 * N * d * 4 + N * 4
    assert fused_temp <= budget, (fused_temp, budget, plain_temp)
    assert fused_temp < full / 2
    print(f"temp bytes: plain {plain_temp:,}, fused {fused_temp:,}, one (N, V) fp32 buffer {full:,}")
