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

Layout on disk: logical shapes, whatever the mesh. In memory each parameter is padded along its row
dimension to a multiple of the shard count (XLA needs even shards); the files hold each array with
its logical shape all the same (jfsdp.io.orbax_rows: orbax's own jax.Array handler, cutting each
process's host shards to the real rows before they are written). The row count to keep per leaf
comes from the FSDP object's layouts (`rows_save_args`: parameters and every optimizer subtree shaped
like them, i.e. Adam's moments).

Restore is one orbax call whose targets are the new mesh's abstract state: orbax reads, for each
device, its row range of the logical array (`ArrayRestoreArgs(global_shape=padded, strict=False)`:
rows past the stored ones read as zeros) and places the array directly with its new sharding: no
device ever holds a whole parameter unless its sharding says so. Padding rows must be zero for the
reduce-scatters, and they are (they start at zero, their gradient is zero, so are Adam's moments,
and weight decay keeps zero at zero).

Checkpoints of format jfsdp-checkpoint/1 (written before this layout: arrays stored padded for the
writer's mesh) stay readable: the same restore adds or drops zero padding rows to fit the target,
and export cuts them to the logical shape.
"""
from __future__ import annotations

import dataclasses
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

from jfsdp.config.mesh import TENSOR_AXIS
from jfsdp.engine.layout import is_layout
from jfsdp.engine.sharded import FSDP
from jfsdp.config.errors import ConfigError
from jfsdp.io import tensor_rows
from jfsdp.io.orbax_rows import rows_save_args, type_handler_registry
from jfsdp.io.relayout import from_rows, path_name, read_targets, to_rows

FORMAT = "jfsdp-checkpoint/2"                 # arrays stored with their logical shapes
READABLE = (FORMAT, "jfsdp-checkpoint/1")     # /1: padded for the writer's mesh (restore pads/cuts)
STATE, META = "state", "meta"


class CheckpointError(ConfigError):
    """A checkpoint that cannot be used: missing, corrupt, partial or written by an incompatible run.
    The message names the file and the problem."""


class NonFiniteState(RuntimeError):
    """The train state holds NaN or inf: it was not saved."""


def param_signature(plan: FSDP) -> dict:
    """{parameter path: [logical shape, dtype]} of the full (unpadded) layout: what a checkpoint must
    match to be restored into `plan`, whatever the mesh. Paths as in the state: `root/...`, then
    `units/...` (`Stacked`) or `stages/<j>/...` (`Staged`), a stage's leaves with its unit count first."""
    root_l, stage_l = plan.split(plan.layouts)
    stacked = plan.join(jax.tree.map(lambda _: (), root_l, is_leaf=is_layout),
                        [jax.tree.map(lambda _: (n,), l, is_leaf=is_layout)
                         for l, n in zip(stage_l, plan.stage_sizes)])
    lead = jax.tree.leaves(stacked, is_leaf=lambda x: isinstance(x, tuple))
    flat = jax.tree_util.tree_flatten_with_path(plan.layouts, is_leaf=is_layout)[0]
    return {path_name(path): [list(n + l.full_shape), str(l.dtype)] for (path, l), n in zip(flat, lead)}


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
                STATE: ocp.PyTreeCheckpointHandler(type_handler_registry=type_handler_registry()),
                META: ocp.JsonCheckpointHandler()})
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
    def save(self, step: int, state, meta: dict, *, plan: FSDP) -> Path:
        """Start saving `state` (a TrainState of shards of `plan`) and `meta` (JSON-able) as checkpoint
        `step`, every array with its logical shape (the plan's layouts say which rows are padding).
        Returns after the device-to-host copy; the files are written in the background. Raises
        NonFiniteState, saving nothing, if any array of the state is NaN or inf."""
        if not bool(self._finite(state)):
            raise NonFiniteState(f"the train state at step {step} holds NaN or inf; it was not saved")
        meta = {"format": FORMAT, "step": int(step), **meta}
        meta["params"] = param_signature(plan)
        if step in self._mgr.all_steps():   # e.g. the final save right after a periodic one
            return self.step_dir(step)
        # tensor-parallel leaves as whole parameters (tensor_rows.py), flat leaves in their row form (relayout.py)
        state, rows = to_rows(plan, tensor_rows.to_logical(plan, state), tensor_rows.save_layouts(plan))
        save_args = rows_save_args(plan, state, rows)
        self._mgr.save(step, args=ocp.args.Composite(**{STATE: ocp.args.PyTreeSave(state, save_args=save_args),
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
        if not isinstance(meta, dict) or meta.get("format") not in READABLE:
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

    def restore(self, step: int, target, plan: FSDP | None = None) -> Any:
        """The state of checkpoint `step` placed like `target` (a tree of ShapeDtypeStructs with
        shardings, e.g. `jfsdp.abstract_state(plan, opt)` for any mesh and strategy). Each device
        reads only its own row range of the stored (logical) arrays; the rows past them, the target
        mesh's padding, are zeros. A format /1 checkpoint (padded for its writer) restores the same
        way, its extra padding rows dropped. A target on a mesh with a `tensor` axis needs its `plan`
        (which leaves are tensor-parallel: read whole, then split, tensor_rows.py)."""
        if any(TENSOR_AXIS in getattr(getattr(x, "sharding", None), "mesh", {}).shape for x in jax.tree.leaves(target)):
            if plan is None or getattr(plan, "tensor", 1) == 1:
                raise ConfigError("restoring onto a mesh with a tensor axis needs plan= (the FSDP object the target "
                                  "is laid out for): its tensor-parallel leaves are read whole, then split")
        target, tp_later = (tensor_rows.logical_targets(plan, target) if getattr(plan, "tensor", 1) > 1
                            else (target, {}))
        path = self.step_dir(step) / STATE
        ignore_closed_loop_callbacks()
        try:
            stored = self._mgr.item_metadata(step)[STATE]
        except Exception as e:   # orbax raises many kinds for a damaged folder
            raise CheckpointError(f"{path}: unreadable metadata ({one_line_error(e)}): checkpoint {step} is "
                                  "corrupt or partial") from None
        if stored is None:
            raise CheckpointError(f"{path}: missing: checkpoint {step} is partial")
        shapes = {path_name(p): tuple(m.shape) for p, m in jax.tree_util.tree_flatten_with_path(
            stored, is_leaf=lambda x: hasattr(x, "shape") and hasattr(x, "dtype"))[0] if hasattr(m, "shape")}
        target, later = read_targets(shapes, target)   # flat leaves read in rows, turned after
        _check_stored(path, stored, target)
        try:
            # each device reads its row range of the stored array; rows past the stored ones are zeros
            restore_args = jax.tree.map(lambda a: dataclasses.replace(a, strict=False),
                                        ocp.checkpoint_utils.construct_restore_args(target))
            out = self._mgr.restore(step, args=ocp.args.Composite(
                **{STATE: ocp.args.PyTreeRestore(item=target, restore_args=restore_args)}))
        except Exception as e:
            raise CheckpointError(f"{path}: cannot be read ({one_line_error(e)}): checkpoint {step} is corrupt "
                                  "or partial") from None
        return tensor_rows.from_logical(from_rows(out[STATE], later), tp_later)


def _check_stored(path: Path, stored, target) -> None:
    """Raise CheckpointError unless every array of `target` is in the checkpoint's metadata `stored`
    with its dtype and a shape that differs from the target's along one axis at most."""
    t_leaves = jax.tree_util.tree_flatten_with_path(target)[0]
    try:
        s_leaves = {path_name(p): m for p, m in jax.tree_util.tree_flatten_with_path(
            stored, is_leaf=lambda x: hasattr(x, "shape") and hasattr(x, "dtype"))[0]}
    except Exception:
        s_leaves = {}
    for p, t in t_leaves:
        name = path_name(p)
        m = s_leaves.get(name)
        if m is None:
            raise CheckpointError(f"{path}: has no array {name}: incompatible or partial checkpoint")
        if jnp.dtype(m.dtype) != jnp.dtype(t.dtype):
            raise CheckpointError(f"{path}: array {name} is {jnp.dtype(m.dtype)}, this run expects "
                                  f"{jnp.dtype(t.dtype)}: incompatible checkpoint")
        # stored logical rows (or another mesh's padded rows, format /1) differ from the target's
        # padded rows along one axis at most
        if len(m.shape) != len(t.shape) or sum(a != b for a, b in zip(m.shape, t.shape)) > 1:
            raise CheckpointError(f"{path}: array {name} has shape {tuple(m.shape)}, this run expects "
                                  f"{t.shape}: incompatible checkpoint")


def ignore_closed_loop_callbacks() -> None:
    """After a failed read of a damaged checkpoint, tensorstore still completes the other reads that
    orbax started and calls back into orbax's event loop, which is closed by then; Python reports each
    as an unraisable `RuntimeError: Event loop is closed` traceback on stderr (orbax 0.12.8). They
    are harmless: the failure itself has been raised. Drop those, pass on the rest."""
    previous = sys.unraisablehook
    if getattr(previous, "_jfsdp", False):
        return

    def hook(u):
        if isinstance(u.exc_value, RuntimeError) and "Event loop is closed" in str(u.exc_value):
            return
        previous(u)
    hook._jfsdp = True
    sys.unraisablehook = hook


def one_line_error(e: BaseException) -> str:
    """The first line of an exception (and of its cause), for a one-line error."""
    msgs = []
    while e is not None and len(msgs) < 2:
        line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        msgs.append(re.sub(r"\s+", " ", line)[:200])
        e = e.__cause__
    return ": ".join(msgs)


def logical_params(plan: FSDP, params: dict) -> dict:
    """Padded params (host arrays, any shard count: `plan`'s or another mesh's) -> the full layout,
    using `plan`'s layouts for the logical shapes (any model, `Stacked` or `Staged`)."""
    root_l, stage_l = plan.split(plan.layouts)
    root_x, stage_x = plan.split(params)
    root = jax.tree.map(lambda l, x: np.asarray(x)[: l.rows].reshape(l.shape), root_l, root_x, is_leaf=is_layout)
    stages = [jax.tree.map(lambda l, x: np.asarray(x)[:, : l.rows].reshape(x.shape[0], *l.shape), ls, xs,
                           is_leaf=is_layout) for ls, xs in zip(stage_l, stage_x)]
    return plan.join(root, stages)
