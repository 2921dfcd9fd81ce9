"""Hugging Face Llama naming: jfsdp's Llama parameters <-> `LlamaForCausalLM` tensors and config.json.

One mapping, used by checkpoint export/import and by the PyTorch comparisons, so that the
correspondence of names, transposes and config keys is written down once. It works on the full
(unsharded, unpadded) layout `{'root': tree, 'units': tree stacked on axis 0}` of `models/llama.py`
(the layout `FSDP.gather` returns and `FSDP.shard` takes); nothing here imports `models`.

Flax `Dense` kernels are (in, out); torch `Linear` weights are (out, in): every projection is
transposed on the way across. The rotary layout of models/llama.py (pairs i, i + head_dim/2) is the
one transformers uses, so q/k projections cross without any permutation.
"""
from __future__ import annotations

from typing import Callable, Iterator

import numpy as np

from jfsdp.mesh import ConfigError

# (our path inside the root tree) -> (HF tensor name, transpose?)
ROOT_TENSORS = {
    ("tok_embeddings", "embedding"): ("model.embed_tokens.weight", False),
    ("norm", "scale"): ("model.norm.weight", False),
    ("output", "kernel"): ("lm_head.weight", True),   # untied heads only
}
# (our path inside one unit) -> (HF tensor name with {i} for the layer, transpose?)
UNIT_TENSORS = {
    ("attention", "wq", "kernel"): ("model.layers.{i}.self_attn.q_proj.weight", True),
    ("attention", "wk", "kernel"): ("model.layers.{i}.self_attn.k_proj.weight", True),
    ("attention", "wv", "kernel"): ("model.layers.{i}.self_attn.v_proj.weight", True),
    ("attention", "wo", "kernel"): ("model.layers.{i}.self_attn.o_proj.weight", True),
    ("feed_forward", "w1", "kernel"): ("model.layers.{i}.mlp.gate_proj.weight", True),
    ("feed_forward", "w3", "kernel"): ("model.layers.{i}.mlp.up_proj.weight", True),
    ("feed_forward", "w2", "kernel"): ("model.layers.{i}.mlp.down_proj.weight", True),
    ("attention_norm", "scale"): ("model.layers.{i}.input_layernorm.weight", False),
    ("ffn_norm", "scale"): ("model.layers.{i}.post_attention_layernorm.weight", False),
}

# jfsdp LlamaConfig field -> config.json key
CONFIG_KEYS = {
    "vocab_size": "vocab_size", "dim": "hidden_size", "ffn_dim": "intermediate_size",
    "n_layers": "num_hidden_layers", "n_heads": "num_attention_heads", "n_kv_heads": "num_key_value_heads",
    "max_seq_len": "max_position_embeddings", "rope_theta": "rope_theta", "norm_eps": "rms_norm_eps",
    "tie_embeddings": "tie_word_embeddings", "init_std": "initializer_range",
}


def to_hf_config(fields: dict, dtype: str = "float32") -> dict:
    """A `config.json` for `LlamaForCausalLM` from a LlamaConfig's fields (`dataclasses.asdict`)."""
    cfg = {hf: fields[ours] for ours, hf in CONFIG_KEYS.items() if ours in fields}
    # rope: transformers >= 5 reads `rope_parameters`, older versions `rope_theta`; write both
    cfg.update(architectures=["LlamaForCausalLM"], model_type="llama", hidden_act="silu",
               head_dim=fields["dim"] // fields["n_heads"], attention_bias=False, mlp_bias=False,
               rope_parameters={"rope_type": "default", "rope_theta": fields["rope_theta"]},
               dtype=dtype, torch_dtype=dtype)
    return cfg


def from_hf_config(hf: dict) -> dict:
    """LlamaConfig keyword arguments from a `config.json`; a ConfigError for what models/llama.py
    does not implement (so a model is never loaded into a definition that computes something else)."""
    if hf.get("model_type", "llama") != "llama":
        raise ConfigError(f"config.json: model_type '{hf.get('model_type')}' is not 'llama'")
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise ConfigError(f"config.json: rope type '{rope.get('rope_type', rope.get('type'))}' is not supported "
                          "(jfsdp's Llama has plain rotary embeddings)")
    if "rope_theta" in rope:
        hf = {**hf, "rope_theta": rope["rope_theta"]}
    unsupported = {"hidden_act": ("silu",), "attention_bias": (False, None), "mlp_bias": (False, None)}
    for key, allowed in unsupported.items():
        if hf.get(key, allowed[0]) not in allowed:
            raise ConfigError(f"config.json: {key}={hf[key]!r} is not supported (jfsdp's Llama has "
                              f"{key}={allowed[0]!r})")
    missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                           "num_attention_heads") if k not in hf]
    if missing:
        raise ConfigError(f"config.json lacks {', '.join(missing)}")
    kw = {ours: hf[key] for ours, key in CONFIG_KEYS.items() if key in hf}
    kw.setdefault("n_kv_heads", kw["n_heads"])
    kw.setdefault("tie_embeddings", False)   # transformers' default for Llama
    head_dim = hf.get("head_dim") or kw["dim"] // kw["n_heads"]
    if head_dim * kw["n_heads"] != kw["dim"]:
        raise ConfigError(f"config.json: head_dim {head_dim} x {kw['n_heads']} heads != hidden_size {kw['dim']}")
    for k in ("rope_theta", "norm_eps", "init_std"):
        if k in kw:
            kw[k] = float(kw[k])
    return kw


def _get(tree, path):
    for p in path:
        tree = tree[p]
    return tree


def _set(tree, path, value):
    for p in path[:-1]:
        tree = tree.setdefault(p, {})
    tree[path[-1]] = value


def tensor_names(n_layers: int, tie_embeddings: bool) -> Iterator[tuple[str, tuple, int | None, bool]]:
    """Every HF tensor of the model: (name, our path in the full layout, layer index or None, transpose?).
    Our path is ('root', ...) or ('units', ...), the layer index selects a row of the stacked units."""
    for path, (name, tr) in ROOT_TENSORS.items():
        if path[0] == "output" and tie_embeddings:
            continue
        yield name, ("root", *path), None, tr
    for i in range(n_layers):
        for path, (name, tr) in UNIT_TENSORS.items():
            yield name.format(i=i), ("units", *path), i, tr


def leaf_sources(n_layers: int, tie_embeddings: bool) -> dict:
    """A tree shaped like the full layout whose leaves are lists of (HF name, transpose?), one per
    stacked row (a single entry for a root leaf): how to build each of our leaves, one at a time,
    from a safetensors file, without holding the whole model."""
    out: dict = {}
    for name, path, layer, tr in tensor_names(n_layers, tie_embeddings):
        try:
            _get(out, path).append((name, tr))
        except KeyError:
            _set(out, path, [(name, tr)])
    return out


def to_hf(full: dict, tie_embeddings: bool) -> dict[str, np.ndarray]:
    """Full parameters (host arrays) -> {HF tensor name: array in torch's (out, in) layout}."""
    n_layers = int(np.shape(_get(full, ("units", *next(iter(UNIT_TENSORS)))))[0])
    out = {}
    for name, path, layer, tr in tensor_names(n_layers, tie_embeddings):
        x = np.asarray(_get(full, path))
        x = x[layer] if layer is not None else x
        out[name] = np.ascontiguousarray(x.T if tr else x)
    return out


def from_hf(get: Callable[[str], np.ndarray], n_layers: int, tie_embeddings: bool) -> dict:
    """{HF name -> array} (a callable, so tensors can be read lazily) -> full parameters."""
    out: dict = {}
    for path, sources in _leaves(leaf_sources(n_layers, tie_embeddings)):
        arrays = [np.asarray(get(name)).T if tr else np.asarray(get(name)) for name, tr in sources]
        _set(out, path, np.stack(arrays) if path[0] == "units" else arrays[0])
    return out


def _leaves(tree, prefix=()):
    for k, v in tree.items():
        if isinstance(v, dict):
            yield from _leaves(v, prefix + (k,))
        else:
            yield prefix + (k,), v
