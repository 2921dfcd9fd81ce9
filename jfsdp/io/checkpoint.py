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

Layout on disk: logical shapes, whatever the mesh. In memory jfsdp pads each parameter along its
row dimension to a multiple of the shard count S (core.Layout), because XLA needs even shards: jax
0.10 refuses a NamedSharding whose dimension does not divide (`IndivisibleError`: a (259,) array on
8 shards), so the logical 259-row array cannot exist as a sharded jax.Array. The files hold each
array with its logical shape all the same (259 rows whether written on 8, 4, 3 or 1 shards), through
`_LogicalArrayHandler`, orbax's own jax.Array handler with one step added between its two halves:
- in `save` (the loop waits for this part): orbax's device-to-host copy of the shards this process
  holds (replica 0 of each, or a 1/R slice of each with replica-parallel writing), then each host
  shard is cut to the rows below the logical row count (a numpy view, no copy): a shard wholly in
  the padding writes nothing, the shard holding the last logical rows writes only those;
- in the background (orbax's commit, same transaction, temporary folder and finalizing rename as
  orbax's handler): orbax creates the tensorstore array with the logical global shape and each
  process writes its own cut shards into it.
So no process gathers a leaf, nothing is replicated to be saved, and the zarr arrays' shapes (what
tensorstore and orbax's metadata report) are the model's. Only the chunk grid (one chunk per
writer shard, so two processes never write one chunk) and OCDBT's internal files follow the
writer; any reader reads any region. The row count to keep per leaf comes from the plan
(`_logical_rows`: parameters and every optimizer subtree shaped like them, i.e. Adam's moments).

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
# orbax internals (orbax-checkpoint 0.12.8), used by _LogicalArrayHandler: the two halves of
# ArrayHandler.serialize, replica_slices.transfer_arrays_to_host (the device-to-host copy of the
# shards to write) and jax_array_handlers._async_serialize_replica_slices (tensorstore writes, OCDBT
# transaction, array metadata), plus the types they exchange
from orbax.checkpoint._src.arrays import fragments as _fragments
from orbax.checkpoint._src.arrays import numpy_utils as _np_utils
from orbax.checkpoint._src.futures import future as _future
from orbax.checkpoint._src.metadata import array_metadata_store as _array_metadata_store
from orbax.checkpoint._src.serialization import jax_array_handlers as _jah
from orbax.checkpoint._src.serialization import replica_slices as _rs
from orbax.checkpoint._src.serialization import type_handler_registry as _registry_lib

from jfsdp.engine.layout import is_layout
from jfsdp.engine.sharded import FSDP
from jfsdp.config.errors import ConfigError

FORMAT = "jfsdp-checkpoint/2"                 # arrays stored with their logical shapes
READABLE = (FORMAT, "jfsdp-checkpoint/1")     # /1: padded for the writer's mesh (restore pads/cuts)
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
    match to be restored into `plan`, whatever the mesh. Paths as in the state: `root/...`, then
    `units/...` (`Stacked`) or `stages/<j>/...` (`Staged`), a stage's leaves with its unit count first."""
    root_l, stage_l = plan.split(plan.layouts)
    stacked = plan.join(jax.tree.map(lambda _: (), root_l, is_leaf=is_layout),
                        [jax.tree.map(lambda _: (n,), l, is_leaf=is_layout)
                         for l, n in zip(stage_l, plan.stage_sizes)])
    lead = jax.tree.leaves(stacked, is_leaf=lambda x: isinstance(x, tuple))
    flat = jax.tree_util.tree_flatten_with_path(plan.layouts, is_leaf=is_layout)[0]
    return {_path_str(path): [list(n + l.shape), str(l.dtype)] for (path, l), n in zip(flat, lead)}


def _all_finite(state) -> jax.Array:
    leaves = [x for x in jax.tree.leaves(state) if jnp.issubdtype(x.dtype, jnp.inexact)]
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves])) if leaves else jnp.array(True)


# ---- writing arrays with their logical shapes ------------------------------------------------------
@dataclasses.dataclass
class _SaveArgs(ocp.SaveArgs):
    """orbax's SaveArgs plus which axis of the leaf is padded and how many of its rows are real."""
    pad_axis: int | None = None
    rows: int | None = None


@dataclasses.dataclass(frozen=True)
class _CutSlices(_rs.ReplicaSlices):
    """Host shards cut to the logical shape: their fragments differ in size (the last real shard is
    shorter, shards wholly in the padding are gone), which orbax's own `to_fragments` asserts against."""

    def to_fragments(self):
        return _fragments.ConcreteFragments(shape=self.global_shape, dtype=self.dtype, fragments=[
            _fragments.ConcreteFragment(index=r.index, value=r.data()) for r in self.replica_slices])


def _cut(host: _rs.ReplicaSlices, axis: int | None, rows: int | None) -> _rs.ReplicaSlices:
    """This process's host shards of one padded array -> the same data for the array of `rows` rows
    along `axis` (views into the host copies, nothing copied)."""
    shape = tuple(host.global_shape)
    if axis is None or rows is None or axis >= len(shape) or shape[axis] <= rows:
        return host
    kept = []
    for r in host.replica_slices:
        index = list(_np_utils.resolve_slice(r.index, shape))
        lo, hi = index[axis].start, index[axis].stop
        if lo >= rows:
            continue                                   # wholly padding: nothing to write
        value = r.data()
        if hi > rows:
            value = value[(slice(None),) * axis + (slice(0, rows - lo),)]
            index[axis] = slice(lo, rows)
        kept.append(dataclasses.replace(r, index=tuple(index), unsliced_data=value))
    return _CutSlices(global_shape=shape[:axis] + (rows,) + shape[axis + 1:], local_shape=host.local_shape,
                      sharding=host.sharding, dtype=host.dtype, is_on_host=True, replica_slices=kept)


class _LogicalArrayHandler(ocp.type_handlers.ArrayHandler):
    """orbax's jax.Array handler that writes each array with the logical shape given in its
    `_SaveArgs` (see the module docstring). Reading, metadata and the typestr are orbax's: the files
    are ordinary orbax arrays that any orbax reader opens. No sharding file is written: it would
    record the writer's mesh, and restore always passes the target's shardings."""

    def __init__(self):
        super().__init__(array_metadata_store=_array_metadata_store.Store(), enable_write_sharding_file=False)

    async def serialize(self, values, infos, args=None):
        args = args or [ocp.SaveArgs()] * len(values)
        if not any(isinstance(a, _SaveArgs) and a.rows is not None for a in args):
            return await super().serialize(values, infos, args)
        for v, info in zip(values, infos):
            if jax.dtypes.issubdtype(v.dtype, jax.dtypes.prng_key) or (jax.process_count() > 1
                                                                        and v.is_fully_addressable):
                raise ValueError(f"{info.name}: jfsdp checkpoints hold global arrays of numbers only")
        self._ext_metadata = {}
        # the part the training loop waits for: the device-to-host copy of this process's shards
        host = _rs.transfer_arrays_to_host(
            values, self._replica_id, self._use_replica_parallel, self._min_slice_bytes_for_replica_parallel,
            self._max_replicas_for_replica_parallel, enable_pinned_host_transfer=infos[0].enable_pinned_host_transfer)
        host = [_cut(h, getattr(a, "pad_axis", None), getattr(a, "rows", None)) for h, a in zip(host, args)]
        plain = [ocp.SaveArgs(**{f.name: getattr(a, f.name) for f in dataclasses.fields(ocp.SaveArgs)})
                 for a in args]
        # the background part, inside orbax's commit (temporary folder, then the finalizing rename)
        write = _jah._async_serialize_replica_slices(
            host, infos, plain, primary_host=self._primary_host, metadata_key=self._metadata_key,
            array_metadata_store=self._array_metadata_store,
            enable_replica_parallel_separate_folder=self._enable_replica_parallel_separate_folder,
            use_replica_parallel=self._use_replica_parallel, ext_metadata=self._ext_metadata)
        return [_future.CommitFutureAwaitingContractedSignals(write, name="jfsdp_logical_arrays")]


def _registry():
    """orbax's default type handlers, with jax.Array written by _LogicalArrayHandler."""
    return ocp.type_handlers.create_type_handler_registry(
        *[(t, _LogicalArrayHandler() if t is jax.Array else h) for t, h in _registry_lib._DEFAULT_TYPE_HANDLERS])


def _logical_rows(plan: FSDP, state) -> dict:
    """{leaf path: (padded axis, logical rows)} for every leaf of `state` stored padded: the
    parameters and each subtree shaped like them (Adam's moments; found by tree structure, as
    optax.tree_map_params does), when the leaf has the padded shape."""
    root_l, stage_l = plan.split(plan.layouts)
    axes = plan.join(jax.tree.map(lambda _: 0, root_l, is_leaf=is_layout),      # root: rows are axis 0;
                     [jax.tree.map(lambda _: 1, u, is_leaf=is_layout) for u in stage_l])   # units: axis 1
    flat = list(zip(jax.tree.leaves(axes), jax.tree.leaves(plan.layouts, is_leaf=is_layout)))
    pdef = jax.tree.structure(plan.layouts, is_leaf=is_layout)
    like_params = lambda x: x is not state and jax.tree.structure(x) == pdef   # noqa: E731
    out = {}
    for path, sub in jax.tree_util.tree_flatten_with_path(state, is_leaf=like_params)[0]:
        if not like_params(sub):
            continue
        for (sub_path, x), (axis, l) in zip(jax.tree_util.tree_flatten_with_path(sub)[0], flat):
            want = (x.shape[0],) + l.stored_shape if axis else l.stored_shape
            if tuple(x.shape) == want and l.padded_rows != l.rows:
                out[_path_str(path + sub_path)] = (axis, l.rows)
    return out


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
                STATE: ocp.PyTreeCheckpointHandler(type_handler_registry=_registry()),
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
        rows = _logical_rows(plan, state)
        save_args = jax.tree_util.tree_map_with_path(
            lambda p, _: _SaveArgs(pad_axis=rows.get(_path_str(p), (None, None))[0],
                                   rows=rows.get(_path_str(p), (None, None))[1]), state)
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

    def restore(self, step: int, target) -> Any:
        """The state of checkpoint `step` placed like `target` (a tree of ShapeDtypeStructs with
        shardings, e.g. `jfsdp.abstract_state(plan, opt)` for any mesh and strategy). Each device
        reads only its own row range of the stored (logical) arrays; the rows past them, the target
        mesh's padding, are zeros. A format /1 checkpoint (padded for its writer) restores the same
        way, its extra padding rows dropped."""
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
            # stored logical rows (or another mesh's padded rows, format /1) differ from the target's
            # padded rows along one axis at most
            if len(m.shape) != len(t.shape) or sum(a != b for a, b in zip(m.shape, t.shape)) > 1:
                raise CheckpointError(f"{path}: array {name} has shape {tuple(m.shape)}, this run expects "
                                      f"{t.shape}: incompatible checkpoint")
        try:
            # each device reads its row range of the stored array; rows past the stored ones are zeros
            restore_args = jax.tree.map(lambda a: dataclasses.replace(a, strict=False),
                                        ocp.checkpoint_utils.construct_restore_args(target))
            out = self._mgr.restore(step, args=ocp.args.Composite(
                **{STATE: ocp.args.PyTreeRestore(item=target, restore_args=restore_args)}))
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


def logical_params(plan: FSDP, params: dict) -> dict:
    """Padded params (host arrays, any shard count: `plan`'s or another mesh's) -> the full layout,
    using `plan`'s layouts for the logical shapes (any model, `Stacked` or `Staged`)."""
    root_l, stage_l = plan.split(plan.layouts)
    root_x, stage_x = plan.split(params)
    root = jax.tree.map(lambda l, x: np.asarray(x)[: l.rows].reshape(l.shape), root_l, root_x, is_leaf=is_layout)
    stages = [jax.tree.map(lambda l, x: np.asarray(x)[:, : l.rows].reshape(x.shape[0], *l.shape), ls, xs,
                           is_leaf=is_layout) for ls, xs in zip(stage_l, stage_x)]
    return plan.join(root, stages)
