"""Checkpoints of a jfsdp run on orbax-checkpoint: save, resume exactly, restore onto another mesh.

A checkpoint is one step folder of an orbax `CheckpointManager` directory:

    DIR/<step>/state/...        the train state (params, optimizer state, step), orbax/tensorstore (OCDBT)
    DIR/<step>/meta/metadata    JSON: the run's configuration, the data loader's position, and the
                                logical (unpadded) shape and dtype of every parameter
    DIR/<step>/_CHECKPOINT_METADATA   orbax's own record (written last, with the finalizing rename)

What is guaranteed, and how:
- Atomic: orbax writes into `<step>.orbax-checkpoint-tmp-*` and renames it to `<step>` only once every
  item is complete; a folder with the tmp suffix (a write that was killed) is never listed as a
  checkpoint, so resume takes the previous complete one.
- Asynchronous: `save` returns once the device-to-host copy is done; tensorstore writes the files in a
  background thread while training continues. The next `save` (or `wait`) waits for the previous one.
- Every process writes only its own shards: orbax writes, for every array, the shards this process
  addresses (replica 0 of each), never gathering anything to process 0. The JSON is written by
  process 0 only (it is small and the same everywhere).
- Never a non-finite state: `save` first reduces the whole state to one "all finite" flag under jit
  (a pass over the shards where they live) and refuses to save otherwise (NonFiniteState).

Layout on disk, and resharding. jfsdp stores each parameter padded along its first dimension to a
multiple of the shard count S (core.Layout), because XLA needs even shards: jax 0.10 refuses a
NamedSharding whose dimension does not divide (`IndivisibleError`: a (259,) array on 8 shards), so a
logical 259-row array cannot be a sharded jax.Array at all. Writing the logical array would need
every process to gather its rows into some even re-tiling first (communication) or a custom orbax
type handler. Instead the arrays are written as they live (each process writes its own padded
shards, no copy), the JSON records each parameter's logical shape, and restore relies on a property
of the padding plus one of orbax's reader:
- padding rows are always zero: they start at zero, their gradient is zero (the reduce-scatter
  of a zero-padded gradient), so Adam's moments stay zero and weight decay keeps them at zero;
- orbax restores an array into a different global shape when asked (`ArrayRestoreArgs(global_shape=,
  strict=False)`): rows beyond the stored ones are read as zeros, rows beyond the requested ones are
  dropped. Since every padded shape has at least the logical rows, restoring the 264-row array
  written on 8 shards into the 261 rows of 3 shards (or the 259 of NO_SHARD, or 272 of 16) drops or
  adds padding rows only.
So restore is one orbax call whose targets are the new mesh's abstract state: each device reads just
its own slice of the files (tensorstore reads any region) and it is placed directly with the new
sharding; no device ever holds a whole parameter unless its sharding says so, and nothing is re-padded
afterwards. The stored arrays' row counts therefore depend on the mesh that wrote them, but what a
checkpoint means does not: `logical_params` gives the unpadded parameters (export uses it), and any
mesh and strategy restores any checkpoint.
"""
from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from jfsdp.core import ROOT, UNITS, FSDP, _is_layout
from jfsdp.mesh import ConfigError

FORMAT = "jfsdp-checkpoint/1"
STATE, META = "state", "meta"


class CheckpointError(ConfigError):
    """A checkpoint that cannot be used: missing, corrupt, partial or written by an incompatible run.
    The message names the file and the problem."""


class NonFiniteState(RuntimeError):
    """The train state holds NaN or inf: it was not saved."""


def _path_str(path) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path)


def param_signature(plan: FSDP) -> dict:
    """{parameter path: [logical shape, dtype]} of the full (unpadded) layout: what a checkpoint must
    match to be restored into `plan`, whatever the mesh."""
    n = plan.model.n_units
    sig = {}
    for part, stacked in ((ROOT, ()), (UNITS, (n,))):
        for path, l in jax.tree_util.tree_flatten_with_path(plan.layouts[part], is_leaf=_is_layout)[0]:
            sig[f"{part}/{_path_str(path)}"] = [list(stacked + l.shape), str(l.dtype)]
    return sig


def _all_finite(state) -> jax.Array:
    leaves = [x for x in jax.tree.leaves(state) if jnp.issubdtype(x.dtype, jnp.inexact)]
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves])) if leaves else jnp.array(True)


class Checkpointer:
    """Save/restore train states under `directory` (local path; orbax also takes gs:// etc.).

    keep: how many of the latest checkpoints to keep (None: all). async_save: write in the background."""

    def __init__(self, directory: str | os.PathLike, *, keep: int | None = None, async_save: bool = True):
        self.directory = Path(directory).absolute()
        if self.directory.exists() and not self.directory.is_dir():
            raise CheckpointError(f"--ckpt-dir {self.directory} exists and is not a folder")
        opts = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=async_save,
                                            create=True, cleanup_tmp_directories=False)
        try:
            self._mgr = ocp.CheckpointManager(self.directory, options=opts, item_handlers={
                STATE: ocp.StandardCheckpointHandler(), META: ocp.JsonCheckpointHandler()})
        except OSError as e:
            raise CheckpointError(f"cannot use {self.directory} for checkpoints: {e.strerror or e}") from None
        self._finite = jax.jit(_all_finite)

    # ---- what is there
    def steps(self) -> list[int]:
        """Complete checkpoints, oldest first (folders of killed writes are not among them)."""
        return sorted(self._mgr.all_steps())

    def latest_step(self) -> int | None:
        s = self.steps()
        return s[-1] if s else None

    def partial_writes(self) -> list[str]:
        """Folders that orbax started and never finalized (a killed write)."""
        return sorted(p.name for p in self.directory.glob("*.orbax-checkpoint-tmp*"))

    def step_dir(self, step: int) -> Path:
        return self.directory / str(step)

    # ---- saving
    def save(self, step: int, state, meta: dict, *, plan: FSDP | None = None) -> Path:
        """Start saving `state` (a TrainState of shards) and `meta` (JSON-able) as checkpoint `step`.
        Returns after the device-to-host copy; the files are written in the background. Raises
        NonFiniteState, saving nothing, if any array of the state is NaN or inf."""
        if not bool(self._finite(state)):
            raise NonFiniteState(f"the train state at step {step} holds NaN or inf; it was not saved")
        meta = {"format": FORMAT, "step": int(step), **meta}
        if plan is not None:
            meta["params"] = param_signature(plan)
        if step in self._mgr.all_steps():   # e.g. the final save right after a periodic one
            return self.step_dir(step)
        self._mgr.save(step, args=ocp.args.Composite(**{STATE: ocp.args.StandardSave(state),
                                                         META: ocp.args.JsonSave(meta)}), force=True)
        return self.step_dir(step)

    def wait(self) -> None:
        """Block until every started save is on disk and finalized."""
        self._mgr.wait_until_finished()

    def close(self) -> None:
        self._mgr.close()

    # ---- reading
    def read_meta(self, step: int) -> dict:
        path = self.step_dir(step) / META / "metadata"
        try:
            meta = json.loads(path.read_text())
        except FileNotFoundError:
            raise CheckpointError(f"{path}: missing: checkpoint {step} is incomplete") from None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{path}: unreadable ({e}): checkpoint {step} is corrupt") from None
        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            raise CheckpointError(f"{path}: not a {FORMAT} checkpoint (format {meta.get('format')!r})"
                                  if isinstance(meta, dict) else f"{path}: not a jfsdp checkpoint")
        return meta

    def check_compatible(self, step: int, meta: dict, current: dict, plan: FSDP | None = None) -> None:
        """Raise CheckpointError naming the file and the first difference between the saved run's
        `meta` and this run's `current` values (the keys of `current` must match; e.g. model config,
        precision, data), and between the saved and expected parameter shapes/dtypes."""
        path = self.step_dir(step) / META / "metadata"
        for key, want in current.items():
            have = meta.get(key)
            if isinstance(want, dict) and isinstance(have, dict):
                for k in sorted(set(want) | set(have)):
                    if have.get(k) != want.get(k):
                        raise CheckpointError(f"{path}: checkpoint has {key} {k}={have.get(k)!r}, this run "
                                              f"{k}={want.get(k)!r}: incompatible checkpoint")
            elif have != want:
                raise CheckpointError(f"{path}: checkpoint has {key}={have!r}, this run {key}={want!r}: "
                                      "incompatible checkpoint")
        if plan is not None:
            want, have = param_signature(plan), meta.get("params", {})
            for k in sorted(set(want) | set(have)):
                if k not in want:
                    raise CheckpointError(f"{path}: checkpoint has parameter {k}, which this run's model lacks: "
                                          "incompatible checkpoint")
                if k not in have:
                    raise CheckpointError(f"{path}: checkpoint lacks parameter {k}: incompatible checkpoint")
                if have[k] != want[k]:
                    raise CheckpointError(f"{path}: parameter {k} is {have[k][0]} {have[k][1]}, this run expects "
                                          f"{want[k][0]} {want[k][1]}: incompatible checkpoint")

    def restore(self, step: int, target) -> Any:
        """The state of checkpoint `step` placed like `target` (a tree of ShapeDtypeStructs with
        shardings, e.g. `jfsdp.abstract_state(plan, opt)` for any mesh and strategy). Each device
        reads only its own slice; padding rows are added or dropped to fit the target's shard count."""
        path = self.step_dir(step) / STATE
        _ignore_closed_loop_callbacks()
        try:
            stored = self._mgr.item_metadata(step)[STATE]
        except Exception as e:   # orbax raises many kinds for a damaged folder
            raise CheckpointError(f"{path}: unreadable metadata ({_short(e)}): checkpoint {step} is "
                                  "corrupt or partial") from None
        if stored is None:
            raise CheckpointError(f"{path}: missing: checkpoint {step} is partial")
        t_leaves = jax.tree_util.tree_flatten_with_path(target)[0]
        try:
            s_leaves = {_path_str(p): m for p, m in jax.tree_util.tree_flatten_with_path(
                stored, is_leaf=lambda x: hasattr(x, "shape") and hasattr(x, "dtype"))[0]}
        except Exception:
            s_leaves = {}
        for p, t in t_leaves:
            name = _path_str(p)
            m = s_leaves.get(name)
            if m is None:
                raise CheckpointError(f"{path}: has no array {name}: incompatible or partial checkpoint")
            if jnp.dtype(m.dtype) != jnp.dtype(t.dtype):
                raise CheckpointError(f"{path}: array {name} is {jnp.dtype(m.dtype)}, this run expects "
                                      f"{jnp.dtype(t.dtype)}: incompatible checkpoint")
            if len(m.shape) != len(t.shape):
                raise CheckpointError(f"{path}: array {name} has shape {tuple(m.shape)}, this run expects "
                                      f"{t.shape}: incompatible checkpoint")
        try:
            out = self._mgr.restore(step, args=ocp.args.Composite(
                **{STATE: ocp.args.StandardRestore(target, strict=False)}))
        except Exception as e:
            raise CheckpointError(f"{path}: cannot be read ({_short(e)}): checkpoint {step} is corrupt "
                                  "or partial") from None
        return out[STATE]


def _ignore_closed_loop_callbacks() -> None:
    """After a failed read of a damaged checkpoint, tensorstore still completes the other reads that
    orbax started and calls back into orbax's event loop, which is closed by then; Python reports each
    as an unraisable `RuntimeError: Event loop is closed` traceback on stderr (measured with orbax
    0.12.8). They are harmless: the failure itself has been raised. Drop those, pass on the rest."""
    previous = sys.unraisablehook
    if getattr(previous, "_jfsdp", False):
        return

    def hook(u):
        if isinstance(u.exc_value, RuntimeError) and "Event loop is closed" in str(u.exc_value):
            return
        previous(u)
    hook._jfsdp = True
    sys.unraisablehook = hook


def _short(e: BaseException) -> str:
    """The first line of an exception (and of its cause), for a one-line error."""
    msgs = []
    while e is not None and len(msgs) < 2:
        line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        msgs.append(re.sub(r"\s+", " ", line)[:200])
        e = e.__cause__
    return ": ".join(msgs)


def logical_params(plan_layouts: dict, params: dict) -> dict:
    """Padded params (host arrays, any shard count) -> the full layout, using the layouts' shapes."""
    root = jax.tree.map(lambda l, x: np.asarray(x)[: l.rows].reshape(l.shape), plan_layouts[ROOT], params[ROOT],
                        is_leaf=_is_layout)
    units = jax.tree.map(lambda l, x: np.asarray(x)[:, : l.rows].reshape(x.shape[0], *l.shape),
                         plan_layouts[UNITS], params[UNITS], is_leaf=_is_layout)
    return {ROOT: root, UNITS: units}
