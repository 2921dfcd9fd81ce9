"""Model definitions and their named configurations. Plain Flax: no sharding in here."""
from __future__ import annotations

from models import llama, moe, resmlp
from models.llama import LlamaConfig
from models.moe import MoEConfig
from models.resmlp import ResMLPConfig

# Byte-level vocabulary: 256 bytes + 3 specials (259 does not divide any shard count above 1,
# which keeps the padding path exercised).
BYTE_VOCAB = 259

CONFIGS = {
    # test size: uneven dims (vocab 259, ffn 200 pad on 16 shards), tied embeddings, GQA
    "llama-test": LlamaConfig(vocab_size=BYTE_VOCAB, dim=96, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=200),
    # the default of train.py: learns bytes of text in minutes on a 2-core CPU
    "llama-tiny": LlamaConfig(vocab_size=BYTE_VOCAB, dim=128, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=352),
    "llama-small": LlamaConfig(vocab_size=BYTE_VOCAB, dim=384, n_layers=6, n_heads=6, n_kv_heads=2, ffn_dim=1024),
    # the published Llama 3 shapes, for planning
    "llama-1b": LlamaConfig(vocab_size=128256, dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim=8192,
                            rope_theta=500000.0, tie_embeddings=True),
    "llama-8b": LlamaConfig(vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336,
                            rope_theta=500000.0, tie_embeddings=False),
    "llama-70b": LlamaConfig(vocab_size=128256, dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim=28672,
                             rope_theta=500000.0, tie_embeddings=False),
    "resmlp-test": ResMLPConfig(),
    # MoE test size: one dense layer then 2 MoE layers of 8 experts (so expert parallelism runs on 1, 2, 4
    # and 8 shards), top-2, odd widths (dim 72, expert hidden 56, dense hidden 120, vocabulary 259)
    "moe-test": MoEConfig(vocab_size=BYTE_VOCAB, dim=72, n_layers=2, n_dense_layers=1, n_heads=4, n_kv_heads=2,
                          ffn_dim=120, expert_dim=56, n_experts=8, top_k=2, capacity_factor=1.25),
    # Mixtral 8x7B (Jiang et al. 2024, "Mixtral of Experts", arXiv:2401.04088, Table 1; and the
    # config.json of mistralai/Mixtral-8x7B-v0.1): dim 4096, 32 layers, 32 heads, 8 KV heads, expert
    # hidden 14336, 8 experts, top-2, vocabulary 32000, rope theta 1e6, untied head. For planning.
    "mixtral-8x7b": MoEConfig(vocab_size=32000, dim=4096, n_layers=32, n_dense_layers=0, n_heads=32, n_kv_heads=8,
                              ffn_dim=14336, expert_dim=14336, n_experts=8, top_k=2, capacity_factor=1.25,
                              aux_coef=0.02, max_seq_len=32768, rope_theta=1e6, tie_embeddings=False),
}


def get_config(name: str):
    try:
        return CONFIGS[name]
    except KeyError:
        raise ValueError(f"unknown model '{name}'; choose from {', '.join(CONFIGS)}") from None


def parts(cfg):
    """(root module with embed/head methods, unit module, number of units) for a config."""
    if isinstance(cfg, LlamaConfig):
        return llama.parts(cfg)
    if isinstance(cfg, ResMLPConfig):
        return resmlp.parts(cfg)
    if isinstance(cfg, MoEConfig):
        raise TypeError("an MoE model has several stages: use models.moe.parts(cfg) -> (root, [(unit, n), ...])")
    raise TypeError(f"no model for config {type(cfg).__name__}")


def loss_fn(cfg):
    if isinstance(cfg, MoEConfig):   # cross-entropy on the logits + aux_coef x the load-balancing loss
        return moe.loss(llama.lm_loss, cfg.aux_coef)
    return llama.lm_loss if isinstance(cfg, LlamaConfig) else resmlp.classification_loss
