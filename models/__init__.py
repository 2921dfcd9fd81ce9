"""Model definitions and their named configurations. Plain Flax: no sharding in here."""
from __future__ import annotations

from models import llama, resmlp
from models.llama import LlamaConfig
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
    raise TypeError(f"no model for config {type(cfg).__name__}")


def loss_fn(cfg):
    return llama.lm_loss if isinstance(cfg, LlamaConfig) else resmlp.classification_loss
