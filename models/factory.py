"""How jfsdp runs the repository's language models: the one place where a model of `models/` meets
jfsdp, kept beside the models as torchtitan keeps its parallelize function beside its model. The model
files themselves (llama.py, moe.py, attention.py, resmlp.py) import nothing of jfsdp; this module is
imported by train.py, the planner, the benchmarks and the tests, never by `models/__init__`."""
from __future__ import annotations

import jfsdp
from models import moe as moe_model
from models import loss_fn as loss_fn_of, parts
from models.attention import blockwise_attention_bwd, blockwise_attention_fwd, blockwise_dq_out, blockwise_dq_zeros
from models.attention_cudnn import applies as cudnn_applies, backward_workspace as cudnn_backward_workspace
from models.attention_cudnn import cudnn_attention_bwd, cudnn_attention_fwd
from models.llama import Llama, LlamaBlock, LlamaConfig, ScannedLlama, attention_impl
from models.moe import MoEConfig


def language_model(cfg, loss="fused", moe="auto", moe_chunks="auto", backend=None, head=None, buckets=None,
                   capacity_cap=None, calibration=None):
    """(jfsdp model, MoE option or None, loss_fn) of a language-model config (Llama or MoE): one place
    for train.py, the planner, the benchmarks and the tests. loss 'fused': the root's `head_features` hands (hidden
    states, head weight) to a chunked cross-entropy (jfsdp.train.losses.lm_loss), the logits never exist;
    'plain': `head` gives logits. `head` overrides the head method (e.g. 'head' for sampling logits).
    An MoE model adds its load-balancing loss (models.moe.loss) and gets `jfsdp.MoE(moe, moe_chunks)`;
    `buckets` ("64,128" or a tuple), `capacity_cap` and `calibration` (a file jfsdp.config.moe_calibration.read
    reads, or its {(capacity, mode, chunks): seconds}) are adaptive mode's (jfsdp.MoE's buckets, capacity_factor,
    calibration)."""
    fused = loss == "fused"
    head = head or ("head_features" if fused else "head")
    loss_fn = (jfsdp.lm_loss(vocab_major=cfg.tie_embeddings) if fused else
               jfsdp.logits_loss() if isinstance(cfg, (LlamaConfig, MoEConfig)) else loss_fn_of(cfg))
    if isinstance(cfg, MoEConfig):
        if moe_chunks != "auto":
            try:
                moe_chunks = int(moe_chunks)
            except (TypeError, ValueError):
                raise jfsdp.ConfigError(f"--moe-chunks '{moe_chunks}' must be an integer or auto") from None
        if isinstance(buckets, str):
            try:
                buckets = tuple(int(b) for b in buckets.split(","))
            except ValueError:
                raise jfsdp.ConfigError(f"--moe-buckets '{buckets}' must be integers separated by commas") from None
        if (buckets is not None or capacity_cap is not None or calibration is not None) and moe != "adaptive":
            raise jfsdp.ConfigError("--moe-buckets, --moe-capacity-cap and --moe-calibration apply to --moe adaptive")
        if isinstance(calibration, str):
            from jfsdp.config.moe_calibration import read
            calibration = read(calibration)
        root, stages = moe_model.parts(cfg)
        loss_fn = moe_model.loss(loss_fn, cfg.aux_coef)   # + the load-balancing loss
        return (jfsdp.Staged(root, stages, head_method=head),
                jfsdp.MoE(mode=moe, chunks=moe_chunks, backend=backend, buckets=buckets, capacity_factor=capacity_cap,
                          calibration=calibration),
                loss_fn)
    root, unit, n_units = parts(cfg)
    return jfsdp.Stacked(root, unit, n_units, head_method=head), None, loss_fn


AS_IS_FORMS = ("loop", "scan")


def as_is_model(cfg, form="loop", loss="fused"):
    """(model, units, call, loss_fn) of a Llama config given as it is, for `fully_shard(model, mesh, batch,
    units=units, call=call)`: form 'loop' is `models.llama.Llama` (its own Python loop over its blocks),
    'scan' is `ScannedLlama` (its blocks under its own `nn.scan`). loss 'fused', as `language_model` runs
    the Stacked model: `call` ends in the root's `head_features` for `jfsdp.lm_loss`; 'plain': the model's
    own `__call__` (call None), its logits. The planner (`python -m jfsdp.plan --as-is`) and
    benchmarks/any_model.py use it."""
    if not isinstance(cfg, LlamaConfig):
        raise jfsdp.ConfigError(f"a model given as it is is planned for the Llama configs (models.llama.Llama, "
                                f"ScannedLlama), not {type(cfg).__name__}")
    if form not in AS_IS_FORMS:
        raise jfsdp.ConfigError(f"as-is form '{form}': choose from {', '.join(AS_IS_FORMS)}")
    model = Llama(cfg) if form == "loop" else ScannedLlama(cfg)
    if loss != "fused":
        return model, LlamaBlock, None, jfsdp.logits_loss()
    return model, LlamaBlock, _head_features_call, jfsdp.lm_loss(vocab_major=cfg.tie_embeddings)


def _head_features_call(model, batch):
    """The model's own forward, its loop or its scan, ending in the head's features instead of logits."""
    h = model.root.embed(batch["inputs"])
    if isinstance(model, ScannedLlama):
        h, _ = model.layers(h, None)
    else:
        for layer in model.layers:
            h = layer(h)
    return model.root.head_features(h)


# The tensor-parallel plan of jfsdp's Llama (torchtitan's, in jfsdp's parameter paths): the attention's
# q, k, v and the FFN's gate and up projections split on their outputs (heads, FFN width), the attention's
# output and the FFN's down projection on their inputs; norms replicated over `tensor`. The root is
# vocabulary-parallel (jfsdp/engine/parallel/vocab.py): the embedding table's rows (the vocabulary) and an
# untied head's columns split over `tensor`, as torchtitan names them (rowwise, colwise).
LLAMA_TP_RULES = {
    r"^root/tok_embeddings/embedding$": "rowwise",
    r"attention/w[qkv]/kernel$": "colwise",
    r"attention/wo/kernel$": "rowwise",
    r"feed_forward/w[13]/kernel$": "colwise",
    r"feed_forward/w2/kernel$": "rowwise",
}


def tensor_plan(cfg):
    """The `jfsdp.TensorPlan` of a Llama or MoE config: its rules, the sequence on axis 1 of h, and the
    sizes T must divide (heads, KV heads, FFN width). An MoE model's root is a LlamaRoot under `lm`; its
    attention and dense layers take the Llama rules, its experts and router none (they stay FSDP or
    expert-parallel over fsdp x tensor: jfsdp/engine/parallel/moe_rows.py)."""
    if not hasattr(cfg, "n_kv_heads"):
        raise jfsdp.ConfigError(f"tensor parallelism is not supported for {type(cfg).__name__} models "
                                "(docs/tensor-parallel.md): only the Llama and MoE models have a tensor plan")
    moe = isinstance(cfg, MoEConfig)
    root = "^root/lm/" if moe else "^root/"
    rules = {k.replace("^root/", root): v for k, v in LLAMA_TP_RULES.items()
             if not (moe and not cfg.n_dense_layers and "feed_forward" in k)}
    rules.update({} if cfg.tie_embeddings else {root + "output/kernel$": "colwise"})
    divides = {"heads": cfg.n_heads, "KV heads": cfg.n_kv_heads}
    divides.update({"FFN width": cfg.ffn_dim} if not moe or cfg.n_dense_layers else {})
    return jfsdp.TensorPlan(rules, sequence_dim=1, divides=divides)


RING_SUMS = ("fp32", "bf16")


def context_kernel(block: int = 512, ring_sums: str = "fp32", attention: str = "blockwise"):
    """The per-block attention of context parallelism's ring (jfsdp.engine.parallel.context) for the Llama
    models, fully_shard's `context_attention` at C > 1. `attention` "blockwise": blockwise attention's two
    halves (models/attention.py), which give the log-sum-exp that the ring's merge needs, on every backend;
    "cudnn": cuDNN's fused attention with its log-sum-exp, its backward fed the merged output and
    log-sum-exp (models/attention_cudnn.py; bf16/fp16 inputs only: `ring_attention_impl` picks it where it
    applies). `ring_sums` "bf16": the backward's sums across hops (dQ, dK, dV) in bf16 for bf16 compute, half
    their memory and bytes, at the price of accuracy (train.py's --ring-sums; docs/context-parallel.md);
    "fp32" (default) keeps them in fp32."""
    if ring_sums not in RING_SUMS:
        raise jfsdp.ConfigError(f"ring sums '{ring_sums}': choose fp32 or bf16")
    from jfsdp.engine.parallel.ring import Into, Kernel, sum_dtype   # here: importing this module must not start jax
    low = ring_sums == "bf16"
    if attention == "cudnn":   # no rowsum(dO * O) in o's place: cuDNN's backward takes o itself
        return Kernel(lambda q, k, v, causal: cudnn_attention_fwd(q, k, v, causal=causal),
                      lambda q, k, v, o, lse, do, causal: cudnn_attention_bwd(q, k, v, o, lse, do, causal=causal),
                      low_sums=low, workspace=cudnn_backward_workspace)
    if attention != "blockwise":
        raise jfsdp.ConfigError(f"ring attention '{attention}': choose blockwise or cudnn")
    # the ring's running dQ as one accumulator in the kernel's layout, each call adding into it in place
    into = Into(lambda q, piece, after: blockwise_dq_zeros(q, piece, block=block, dtype=sum_dtype(q, low), after=after),
                lambda q, k, v, o, lse, do, causal, acc, at: blockwise_attention_bwd(
                    q, k, v, o, lse, do, causal=causal, dq_dtype=acc.dtype, dq_into=acc, dq_at=at),
                lambda acc, q: blockwise_dq_out(acc, q.shape))
    return Kernel(lambda q, k, v, causal: blockwise_attention_fwd(q, k, v, causal=causal, block=block),
                  lambda q, k, v, o, lse, do, causal: blockwise_attention_bwd(
                      q, k, v, o, lse, do, causal=causal, block=block, dq_dtype=sum_dtype(q, low)),
                  sums=True, low_sums=low, into=into)


def ring_attention_impl(cfg, mp, choice: str = "auto") -> str:
    """The ring's per-block attention for a model config and mixed-precision policy (train.py's and the
    planner's --ring-attention `choice`): "blockwise" as asked; "cudnn" as asked, where cuDNN takes the
    inputs (bf16 compute, a head dimension it takes: else a ConfigError); "auto": "cudnn" where the model's
    own attention would be cuDNN's (models/llama.py `attention_impl`: also a CUDA backend, or attention
    "cudnn" for a program compiled for a GPU), else "blockwise"."""
    import jax.numpy as jnp
    from jfsdp.config.args import RING_ATTENTION
    if choice not in RING_ATTENTION:
        raise jfsdp.ConfigError(f"ring attention '{choice}': choose {', '.join(RING_ATTENTION)}")
    cfg = cfg.llama() if isinstance(cfg, MoEConfig) else cfg
    dtype = getattr(mp, "param_dtype", None) or jnp.float32
    if choice == "cudnn":
        if not isinstance(cfg, LlamaConfig) or not cudnn_applies(dtype, cfg.head_dim):
            raise jfsdp.ConfigError("ring attention 'cudnn' needs bf16 compute and a head dimension that is a "
                                    "multiple of 8 up to 128 (models/attention_cudnn.py)")
        return "cudnn"
    if choice == "blockwise" or not isinstance(cfg, LlamaConfig):
        return "blockwise"
    return "cudnn" if attention_impl(cfg, dtype) == "cudnn" else "blockwise"
