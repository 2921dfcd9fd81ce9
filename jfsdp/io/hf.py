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

from jfsdp.config.errors import ConfigError

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


# ---- folders: config.json, *.safetensors, tokenizer.json ----------------------------------------

def read_config(folder: str) -> dict:
    """LlamaConfig keyword arguments from `folder/config.json` (ConfigError naming the file)."""
    import json
    from pathlib import Path
    path = Path(folder) / "config.json"
    if not Path(folder).is_dir():
        raise ConfigError(f"--init-from {folder}: not a folder")
    try:
        hf = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: missing (a Hugging Face model folder has a config.json)") from None
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path}: unreadable ({e})") from None
    try:
        return from_hf_config(hf)
    except ConfigError as e:
        raise ConfigError(f"{path}: {str(e).removeprefix('config.json: ')}") from None


def tokenizer_path(folder: str) -> str | None:
    from pathlib import Path
    p = Path(folder) / "tokenizer.json"
    return str(p) if p.is_file() else None


def _tensor_files(folder: str) -> dict:
    """{HF tensor name: safetensors file} for every *.safetensors file of the folder (headers only)."""
    from pathlib import Path
    from safetensors import safe_open
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise ConfigError(f"{folder}: no *.safetensors file")
    where = {}
    for f in files:
        try:
            with safe_open(str(f), framework="numpy") as h:
                where.update({k: str(f) for k in h.keys()})
        except Exception as e:   # safetensors raises its own error types
            raise ConfigError(f"{f}: not a readable safetensors file ({str(e).splitlines()[0][:200]})") from None
    return where


def read_slice(files: dict, name: str, transpose: bool, rows: slice, rest: tuple) -> np.ndarray:
    """Rows `rows` of our layout of HF tensor `name` (then `rest` of the other dims): only that
    region is read from the file. Our rows of a transposed (out, in) tensor are its columns."""
    from safetensors import safe_open
    with safe_open(files[name], framework="numpy") as h:
        sl = h.get_slice(name)
        x = np.asarray(sl[:, rows]).T if transpose else np.asarray(sl[rows])
    return x[(slice(None), *rest)] if rest else x


def read_flat(files: dict, name: str, transpose: bool, shape: tuple, e0: int, e1: int) -> np.ndarray:
    """Elements e0:e1 of our layout of HF tensor `name` flattened (a flat-sharded leaf): the rows that
    hold them are read, then cut to the range."""
    per_row = int(np.prod(shape[1:]))
    if e1 <= e0:
        return np.zeros((0,), np.float32)
    lo, hi = e0 // per_row, -(-e1 // per_row)
    x = read_slice(files, name, transpose, slice(lo, hi), ()).reshape(-1)
    return x[e0 - lo * per_row: e1 - lo * per_row]


def load_params(plan, folder: str):
    """Hugging Face weights -> the plan's shards, streamed: every leaf is built with
    `jax.make_array_from_callback`, whose callback reads from the safetensors file only the rows
    (the region of the index) that one device holds, so neither the host nor any device ever holds
    the whole model, and a sharded leaf is never whole anywhere. Padding rows are zeros.
    Under tensor parallelism (T > 1) a TP kernel, or the vocabulary-parallel embedding or head, is
    streamed the same way into its whole parameter's row form over (fsdp, tensor), then split into
    its T slices on the devices (io/tensor_rows.py, as a checkpoint's restore does): while that runs
    a device may hold the whole leaf, its units stacked."""
    import jax
    from jfsdp.engine.layout import ROOT, UNITS, is_layout
    from jfsdp.io.tensor_rows import read_form
    cfg = read_config(folder)
    files = _tensor_files(folder)
    sources = leaf_sources(cfg["n_layers"], cfg["tie_embeddings"])
    missing = [n for n, *_ in tensor_names(cfg["n_layers"], cfg["tie_embeddings"]) if n not in files]
    if missing:
        raise ConfigError(f"{folder}: the safetensors files lack {missing[0]}" +
                          (f" and {len(missing) - 1} more tensors" if len(missing) > 1 else ""))
    from safetensors import safe_open

    def build(part, path, layout, sharding):
        srcs = _get(sources, (part, *path))
        stacked = part == UNITS
        layout, sharding, turn = read_form(layout, sharding, int(stacked))
        for name, tr in srcs:
            with safe_open(files[name], framework="numpy") as h:
                shape = tuple(h.get_slice(name).get_shape())
            want = tuple(reversed(layout.shape)) if tr else layout.shape
            if shape != want:
                raise ConfigError(f"{files[name]}: {name} has shape {list(shape)}, config.json implies {list(want)}")
        full_shape = ((len(srcs),) if stacked else ()) + layout.stored_shape

        def cb(index):
            index = tuple(index) + (slice(None),) * (len(full_shape) - len(index))
            layers = range(*index[0].indices(len(srcs))) if stacked else [0]
            row_idx = index[1] if stacked else index[0]
            r0, r1, _ = row_idx.indices(layout.padded_rows)
            rest = index[2:] if stacked else index[1:]
            out = []
            for i in layers:
                name, tr = srcs[i]
                x = (read_flat(files, name, tr, layout.shape, r0, min(r1, layout.rows)).reshape(-1, *layout.row_shape)
                     if layout.is_flat
                     else read_slice(files, name, tr, slice(r0, min(r1, layout.rows)), rest))
                pad = [(0, max(0, r1 - max(r0, layout.rows)))] + [(0, 0)] * (x.ndim - 1)
                out.append(np.pad(x.astype(layout.dtype), pad))
            return np.stack(out) if stacked else out[0]
        return turn(jax.make_array_from_callback(full_shape, sharding, cb))

    out = {}
    for part in (ROOT, UNITS):
        flat = jax.tree_util.tree_flatten_with_path(plan.layouts[part], is_leaf=is_layout)[0]
        shard_flat = jax.tree.leaves(plan.param_shardings[part])
        leaves = [build(part, tuple(k.key for k in p), l, s) for (p, l), s in zip(flat, shard_flat)]
        out[part] = jax.tree.unflatten(jax.tree.structure(plan.layouts[part], is_leaf=is_layout), leaves)
    return out


def save_folder(folder: str, full: dict, fields: dict, tokenizer: str | None = None) -> list[str]:
    """Write a Hugging Face Llama folder: config.json + model.safetensors (+ tokenizer.json)."""
    import json
    import shutil
    from pathlib import Path
    from safetensors.numpy import save_file
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    tensors = to_hf(full, fields["tie_embeddings"])
    dtype = str(next(iter(tensors.values())).dtype)
    (out / "config.json").write_text(json.dumps(to_hf_config(fields, dtype), indent=2) + "\n")
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    written = ["config.json", "model.safetensors"]
    if tokenizer:
        shutil.copyfile(tokenizer, out / "tokenizer.json")
        written.append("tokenizer.json")
    return written
