"""Export a jfsdp checkpoint as a Hugging Face Llama folder that `transformers` loads.

    python -m jfsdp.export CKPT_DIR OUT_DIR [--step N]

Writes OUT_DIR/config.json and OUT_DIR/model.safetensors (fp32, torch's (out, in) layout, names of
`LlamaForCausalLM`, through jfsdp.hf's one mapping), and the run's tokenizer.json if it had one.
Only the parameters are read (orbax partial restore, as host arrays: the optimizer state is not
touched); each is stored with its logical shape (format /2) or padded for its writer's mesh
(format /1), then cut to its logical shape. The single output file needs
the whole model in host memory once; nothing is placed on a device. Bad input: `error: ...`, exit 2;
so is a checkpoint of any model but jfsdp's Llama (no Llama model_config in its JSON, or parameters
other than that Llama's, e.g. a jfsdp.Staged model's): only LlamaForCausalLM is written.
"""
from __future__ import annotations

import argparse
import sys

import jax
import numpy as np
import orbax.checkpoint as ocp

from jfsdp.io import hf
from jfsdp.io.checkpoint import (STATE, CheckpointError, Checkpointer, ignore_closed_loop_callbacks, logical_params,
                                 one_line_error)
from jfsdp.config.errors import ConfigError
from jfsdp.config.zoo import repo_models


def read_params(ckpt_dir: str, step: int | None = None):
    """(full parameters as host arrays, the checkpoint's metadata, its step)."""
    models = repo_models("python -m jfsdp.export")
    from pathlib import Path
    if not Path(ckpt_dir).is_dir():
        raise CheckpointError(f"{ckpt_dir}: no such checkpoint folder")
    c = Checkpointer(ckpt_dir)
    try:
        step = c.latest_step() if step is None else step
        if step is None or step not in c.steps():
            raise CheckpointError(f"{c.directory}: no complete checkpoint" + ("" if step is None else f" {step}"))
        meta = c.read_meta(step)
    finally:
        c.close()
    where = c.step_dir(step) / "meta" / "metadata"
    not_llama = (f"{where}: checkpoint {step} does not hold jfsdp's Llama model ({{}}); export writes "
                 "Hugging Face LlamaForCausalLM folders only")
    mc = meta.get("model_config")
    if not isinstance(mc, dict):
        raise ConfigError(not_llama.format("its metadata has no model_config"))
    try:
        cfg = models.LlamaConfig(**mc)
    except (TypeError, ValueError) as e:   # another model's configuration (unknown or missing fields)
        raise ConfigError(not_llama.format(f"model_config {one_line_error(e)}")) from None
    # the layouts (logical shapes) of this model; a 1x1 plan is only a way to compute them
    import jax.numpy as jnp
    from jfsdp.io.checkpoint import param_signature
    from jfsdp.engine.layout import Stacked
    from jfsdp.engine.entry import fully_shard
    from jfsdp.config.mesh import make_mesh
    root, unit, n = models.parts(cfg)
    plan = fully_shard(Stacked(root, unit, n), make_mesh("1x1", devices=jax.devices()[:1]),
                       jax.ShapeDtypeStruct((1, 1), jnp.int32), strategy="no_shard")
    # the parameters saved must be the Llama ones of that config (a model of several stages, say,
    # saved with a Llama-like model_config is not)
    want, have = param_signature(plan), meta.get("params")
    if isinstance(have, dict) and have != want:
        diff = sorted(set(have) ^ set(want)) or sorted(k for k in want if have[k] != want[k])
        raise ConfigError(not_llama.format(f"its parameters differ from the Llama of its model_config, "
                                           f"first at {diff[0]}"))
    path = c.step_dir(step) / STATE
    ignore_closed_loop_callbacks()
    try:
        with ocp.PyTreeCheckpointer() as ckptr:
            stored = ckptr.metadata(path).item_metadata.tree["params"]
            target = jax.tree.map(lambda m: np.zeros((), m.dtype), stored)
            args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), target)
            got = ckptr.restore(path, args=ocp.args.PyTreeRestore(item={"params": target},
                                                                   restore_args={"params": args},
                                                                   partial_restore=True))["params"]
    except Exception as e:
        raise CheckpointError(f"{path}: cannot be read ({one_line_error(e)}): checkpoint {step} is corrupt or partial") from None
    return logical_params(plan, got), meta, step


def export(ckpt_dir: str, out_dir: str, step: int | None = None) -> tuple[list[str], int]:
    """Write the Hugging Face folder; returns (files written, the checkpoint's step)."""
    full, meta, step = read_params(ckpt_dir, step)
    return hf.save_folder(out_dir, full, meta["model_config"], tokenizer=meta.get("tokenizer")), step


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m jfsdp.export", description=__doc__.split("\n\n")[0])
    p.add_argument("ckpt_dir", help="a --ckpt-dir of train.py")
    p.add_argument("out_dir", help="the Hugging Face folder to write")
    p.add_argument("--step", type=int, default=None, help="which checkpoint (default: the latest)")
    a = p.parse_args(argv)
    try:
        written, step = export(a.ckpt_dir, a.out_dir, a.step)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"error: {e.filename}: {e.strerror}", file=sys.stderr)
        return 2
    print(f"exported checkpoint {step} of {a.ckpt_dir} to {a.out_dir}: {', '.join(written)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
