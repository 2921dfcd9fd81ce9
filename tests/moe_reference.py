"""A plain single-device Mixture-of-Experts Llama, written without jfsdp and without the model's
dispatch: every expert runs on every token and the top-k gate weights pick the outputs (exact when
no choice is dropped, i.e. capacity >= tokens per sequence). Attention, norms and dense layers are
the Llama modules (checked against transformers in test_llama_vs_transformers); the parameters are
the MoE model's own trees, so the same initial values feed both."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from models.llama import Attention, LlamaBlock, LlamaRoot, RMSNorm
from tests import reference as ref


def moe_ffn(cfg, p, x):
    """x (B, T, d) -> (y, aux (B,)): top-k of the router's logits, softmax over the k, every expert dense."""
    logits = (x @ p["router"]["kernel"]).astype(jnp.float32)
    probs = jax.nn.softmax(logits, -1)
    top, idx = jax.lax.top_k(logits, cfg.top_k)
    gate = jax.nn.softmax(top, -1)
    chosen = jax.nn.one_hot(idx, cfg.n_experts)                       # (B, T, k, E)
    weight = jnp.einsum("btk,btke->bte", gate, chosen)
    e = p["experts"]
    hid = jax.nn.silu(jnp.einsum("btd,edf->btef", x, e["w1"])) * jnp.einsum("btd,edf->btef", x, e["w3"])
    y = jnp.einsum("bte,btef,efd->btd", weight.astype(x.dtype), hid, e["w2"])
    share = jnp.mean(chosen, axis=(1, 2))                             # (B, E) of the T*k choices
    aux = cfg.n_experts * jnp.sum(share * jnp.mean(probs, 1), -1)
    return y, aux


def forward(cfg, params, tokens):
    """-> (logits, summed aux per row)."""
    lc = cfg.llama()
    x = LlamaRoot(lc).apply({"params": params["root"]["lm"]}, tokens, method="embed")
    aux = jnp.zeros(tokens.shape[0], jnp.float32)
    stages = params["stages"]
    if cfg.n_dense_layers:
        for i in range(cfg.n_dense_layers):
            x = LlamaBlock(lc).apply({"params": jax.tree.map(lambda a: a[i], stages[0])["block"]}, x)
    for i in range(cfg.n_layers):
        p = jax.tree.map(lambda a: a[i], stages[-1])
        x = x + Attention(lc).apply({"params": p["attention"]},
                                    RMSNorm(cfg.norm_eps).apply({"params": p["attention_norm"]}, x))
        y, a = moe_ffn(cfg, p["moe"], RMSNorm(cfg.norm_eps).apply({"params": p["ffn_norm"]}, x))
        x, aux = x + y, aux + a
    return LlamaRoot(lc).apply({"params": params["root"]["lm"]}, x, method="head"), aux


def loss(cfg, params, batch):
    logits, aux = forward(cfg, params, batch["inputs"])
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), -1)
    ce = -jnp.mean(jnp.take_along_axis(logp, batch["targets"][..., None], -1))
    return ce + cfg.aux_coef * jnp.mean(aux)


def train(cfg, params, batches):
    """AdamW steps (tests/reference.py's optimizer) -> (losses, final params, first-step gradients)."""
    return ref.run_steps(ref.staged_optimizer(), lambda p, batch: loss(cfg, p, batch), params, batches)
