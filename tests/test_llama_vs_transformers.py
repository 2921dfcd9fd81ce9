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
from jfsdp.io import hf

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def hf_model(cfg):
    hf_cfg = transformers.LlamaConfig(**hf.to_hf_config(dataclasses.asdict(cfg)))
    return transformers.LlamaForCausalLM(hf_cfg).eval()


def load_weights(model, root_p, unit_ps, cfg):
    """Ours -> HF through jfsdp.hf, the one mapping of names and transposes."""
    full = {"root": root_p, "units": jax.tree.map(lambda *xs: np.stack(xs), *unit_ps)}
    sd = {k: torch.from_numpy(v.astype(np.float32)) for k, v in hf.to_hf(jax.device_get(full), cfg.tie_embeddings).items()}
    missing, unexpected = model.load_state_dict(sd, strict=False)
    assert not unexpected and all("rotary" in k or (cfg.tie_embeddings and k == "lm_head.weight") for k in missing), \
        (missing, unexpected)
    return full


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
    full = load_weights(model, root_p, unit_ps, cfg)
    # and back: transformers' own state dict read through the mapping gives our parameters again
    theirs_sd = {k: v.numpy() for k, v in model.state_dict().items()}
    back = hf.from_hf(theirs_sd.__getitem__, cfg.n_layers, cfg.tie_embeddings)
    jax.tree.map(np.testing.assert_array_equal, back, jax.device_get(full))
    assert models.LlamaConfig(**hf.from_hf_config(model.config.to_dict())) == cfg
    with torch.no_grad():
        theirs = model(torch.from_numpy(tokens)).logits.numpy()
    assert ours.shape == theirs.shape
    np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-5)
