"""The Llama definition against an independent implementation: Hugging Face transformers'
LlamaForCausalLM (PyTorch, CPU) with the same weights gives the same logits.

This checks the model, not the engine: RMSNorm, the rotary layout, grouped-query attention with
its head repetition, SwiGLU, the causal mask and tied or untied output heads."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import models

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def hf_model(cfg):
    hf_cfg = transformers.LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.dim, intermediate_size=cfg.ffn_dim,
        num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_kv_heads,
        head_dim=cfg.head_dim, rms_norm_eps=cfg.norm_eps, rope_theta=cfg.rope_theta,
        max_position_embeddings=cfg.max_seq_len, tie_word_embeddings=cfg.tie_embeddings,
        attention_bias=False, mlp_bias=False, hidden_act="silu")
    return transformers.LlamaForCausalLM(hf_cfg).eval()


def load_weights(model, root_p, unit_ps, cfg):
    """Ours -> HF: Flax Dense kernels are (in, out), torch Linear weights (out, in)."""
    t = lambda a: torch.from_numpy(np.asarray(a, np.float32).copy())
    sd = {"model.embed_tokens.weight": t(root_p["tok_embeddings"]["embedding"]),
          "model.norm.weight": t(root_p["norm"]["scale"])}
    if not cfg.tie_embeddings:
        sd["lm_head.weight"] = t(root_p["output"]["kernel"]).T
    else:
        sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
    for i, p in enumerate(unit_ps):
        a, f = p["attention"], p["feed_forward"]
        pre = f"model.layers.{i}."
        sd |= {pre + "self_attn.q_proj.weight": t(a["wq"]["kernel"]).T,
               pre + "self_attn.k_proj.weight": t(a["wk"]["kernel"]).T,
               pre + "self_attn.v_proj.weight": t(a["wv"]["kernel"]).T,
               pre + "self_attn.o_proj.weight": t(a["wo"]["kernel"]).T,
               pre + "mlp.gate_proj.weight": t(f["w1"]["kernel"]).T,
               pre + "mlp.up_proj.weight": t(f["w3"]["kernel"]).T,
               pre + "mlp.down_proj.weight": t(f["w2"]["kernel"]).T,
               pre + "input_layernorm.weight": t(p["attention_norm"]["scale"]),
               pre + "post_attention_layernorm.weight": t(p["ffn_norm"]["scale"])}
    missing, unexpected = model.load_state_dict(sd, strict=False)
    assert not unexpected and all("rotary" in k for k in missing), (missing, unexpected)


@pytest.mark.parametrize("tied", [True, False])
def test_logits_match_transformers_llama(tied):
    cfg = dataclasses.replace(models.get_config("llama-test"), tie_embeddings=tied, rope_theta=500000.0)
    root, unit, n = models.parts(cfg)
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 24))
    with jax.default_device(jax.devices()[0]):
        keys = jax.random.split(jax.random.key(1), n + 1)
        x = jnp.asarray(tokens, jnp.int32)
        root_p = root.init(keys[0], x, method=lambda m, t: m.head(m.embed(t)))["params"]
        # norm scales start at one; perturb them so the test sees whether they are applied
        root_p = jax.tree.map(lambda a: a + 0.1 * jax.random.normal(keys[0], a.shape) if a.ndim == 1 else a, root_p)
        h = root.apply({"params": root_p}, x, method="embed")
        unit_ps = []
        for k in keys[1:]:
            p = unit.init(k, h)["params"]
            p = jax.tree.map(lambda a: a + 0.1 * jax.random.normal(k, a.shape) if a.ndim == 1 else a, p)
            unit_ps.append(p)
            h = unit.apply({"params": p}, h)
        ours = np.asarray(root.apply({"params": root_p}, h, method="head"))
    model = hf_model(cfg)
    load_weights(model, root_p, unit_ps, cfg)
    with torch.no_grad():
        theirs = model(torch.from_numpy(tokens)).logits.numpy()
    assert ours.shape == theirs.shape
    np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-5)
