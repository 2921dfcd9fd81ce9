"""cuDNN's fused (flash) attention as two halves with the log-sum-exp: the per-block attention of context
parallelism's ring on NVIDIA GPUs (models/factory.py `context_kernel`; docs/context-parallel.md).

The ring merges each block's partial output by its log-sum-exp, and its backward hands every block the
merged output and log-sum-exp of the whole row. `jax.nn.dot_product_attention` gives neither: it returns
no log-sum-exp, and its backward recomputes the probabilities from the block's own. So these two halves
use jax's cuDNN module directly (`jax._src.cudnn.fused_attention_stablehlo`, the code behind
`jax.nn.dot_product_attention(implementation="cudnn")`, unchanged in its signatures from jax 0.10 to 0.11):
- forward: `dot_product_attention(..., return_residual=True)`, which returns the softmax statistics (the
  log-sum-exp of the scaled scores, fp32, per batch, head and query);
- backward: cuDNN's backward kernel given the merged output and log-sum-exp in place of the block's: it
  recomputes P = exp(S - lse) and rowsum(dO * O) from them, which is the block's share of the whole row's
  gradient.
What it needs (`applies`): 16-bit inputs (bf16, fp16), a head dimension that is a multiple of 8 up to 128,
and a CUDA device or a program compiled for one. Grouped-query attention is native (K, V keep their heads).
The forward's output comes in the input dtype (cuDNN's), widened to fp32 for the merge; the gradients too.
Pure JAX beside the models: imports nothing of jfsdp."""
from __future__ import annotations

import jax
import jax.numpy as jnp

_NEEDS = ("dot_product_attention", "_dot_product_attention_bwd_p_wrapper", "MaskType", "AttentionLayout")


def applies(dtype, head_dim: int) -> bool:
    """Whether cuDNN's fused attention takes these inputs (the models' own attention too: models/llama.py
    `attention_impl`)."""
    return jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)) and head_dim % 8 == 0 \
        and head_dim <= 128


def backward_workspace(b: int, t: int, h: int, d: int) -> int:
    """Bytes of cuDNN's attention-backward workspace for b x t queries of h heads of size d, as XLA sizes it
    when it compiles on a GPU (measured on an H100, cuDNN 9, jax 0.11.2, 2026-11-27: 270,532,864 B at 8 x 2,048
    x 32 x 64, 1,077,936,384 at 1 x 32,768 x 32 x 128; benchmarks/cudnn_workspace.py). A compile for a GPU
    target made without a GPU gives it 0 bytes."""
    return b * h * t * (8 * d + 4) + 256


def _module():
    from jax._src.cudnn import fused_attention_stablehlo as fa
    missing = [n for n in _NEEDS if not hasattr(fa, n)]
    if missing:
        raise RuntimeError(f"jax {jax.__version__}'s cuDNN attention module lacks {', '.join(missing)}: the "
                           "ring's cuDNN kernel cannot run; use the blockwise kernel (attention 'blockwise')")
    return fa


def _check(q, k, v, scale):
    if q.ndim != 4 or k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3] \
            or q.shape[2] % k.shape[2]:
        raise ValueError(f"cuDNN attention wants q (B, T, H, D), k and v (B, S, K, D), K dividing H; got "
                         f"{q.shape}, {k.shape}, {v.shape}")
    if not applies(q.dtype, q.shape[3]) or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"cuDNN attention needs bf16 or fp16 q, k, v of one dtype and a head dimension that is "
                         f"a multiple of 8 up to 128; got {q.dtype}/{k.dtype}/{v.dtype}, {q.shape[3]}")
    return float(scale if scale is not None else q.shape[3] ** -0.5)


def _mask(fa, causal: bool):
    return fa.MaskType.CAUSAL if causal else fa.MaskType.NO_MASK


def cudnn_attention_fwd(q, k, v, *, causal: bool = True, scale: float | None = None):
    """(o fp32 (B, T, H, D), lse fp32 (B, T, H)) of softmax attention of q over k, v (causal: query i sees
    keys 0..i, both counted from each block's start)."""
    fa, scale = _module(), _check(q, k, v, scale)
    o, stats = fa.dot_product_attention(q, k, v, scale=scale, mask_type=_mask(fa, causal), qkv_layout="BTNH",
                                        return_residual=True)
    return o.astype(jnp.float32), jnp.swapaxes(stats, 1, 2).astype(jnp.float32)   # stats (B, H, T)


def cudnn_attention_bwd(q, k, v, o, lse, do, *, causal: bool = True, scale: float | None = None):
    """(dq, dk, dv) fp32 of attention of q over k, v for the cotangent do, given the output o and
    log-sum-exp lse (B, T, H) of each query's whole row (in the ring: merged over every block)."""
    fa, scale = _module(), _check(q, k, v, scale)
    none = jnp.zeros(0, q.dtype)
    stats = jnp.swapaxes(lse.astype(jnp.float32), 1, 2)
    grads = fa._dot_product_attention_bwd_p_wrapper.bind(
        q, k, v, none, none, none, none, none, none, none, stats, o.astype(q.dtype), do.astype(q.dtype),
        scale=scale, seed=42, dropout_rate=0.0, variadic_args=(False, False), mask_type=_mask(fa, causal),
        layout=fa.AttentionLayout.BTNH.value, sliding_window_length=None)
    return tuple(g.astype(jnp.float32) for g in grads[:3])
