"""orbax's jax.Array handler, writing each array with its logical (unpadded) row count.

In memory jfsdp pads each parameter along its row dimension to a multiple of the shard count S
(engine.layout.Layout), because XLA needs even shards: jax 0.10 refuses a NamedSharding whose
dimension does not divide (`IndivisibleError`: a (259,) array on 8 shards), so the logical 259-row
array cannot exist as a sharded jax.Array. The files hold each array with its logical shape all the
same (259 rows whether written on 8, 4, 3 or 1 shards), through `LogicalArrayHandler`, orbax's own
jax.Array handler with one step added between its two halves:
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
writer; any reader reads any region. Which leaves are padded, along which axis and how many of
their rows are real, each leaf's `RowsSaveArgs` says (`rows_save_args`, from the FSDP object's
layouts).
"""
from __future__ import annotations

import dataclasses

import jax
import orbax.checkpoint as ocp
# orbax internals (orbax-checkpoint 0.12.8), used by LogicalArrayHandler: the two halves of
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


@dataclasses.dataclass
class RowsSaveArgs(ocp.SaveArgs):
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


class LogicalArrayHandler(ocp.type_handlers.ArrayHandler):
    """orbax's jax.Array handler that writes each array with the logical shape given in its
    `RowsSaveArgs` (see the module docstring). Reading, metadata and the typestr are orbax's: the
    files are ordinary orbax arrays that any orbax reader opens. No sharding file is written: it
    would record the writer's mesh, and restore always passes the target's shardings."""

    def __init__(self):
        super().__init__(array_metadata_store=_array_metadata_store.Store(), enable_write_sharding_file=False)

    async def serialize(self, values, infos, args=None):
        args = args or [ocp.SaveArgs()] * len(values)
        if not any(isinstance(a, RowsSaveArgs) and a.rows is not None for a in args):
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


def type_handler_registry():
    """orbax's default type handlers, with jax.Array written by LogicalArrayHandler."""
    return ocp.type_handlers.create_type_handler_registry(
        *[(t, LogicalArrayHandler() if t is jax.Array else h) for t, h in _registry_lib._DEFAULT_TYPE_HANDLERS])


def rows_save_args(sharded, state):
    """A tree like `state` (a TrainState of `sharded`, what `fully_shard` returns) of RowsSaveArgs:
    for each leaf stored padded (see `_logical_rows`), its
    padded axis and real row count; the other leaves get plain save args (pad_axis=rows=None)."""
    rows = _logical_rows(sharded, state)
    return jax.tree_util.tree_map_with_path(
        lambda p, _: RowsSaveArgs(pad_axis=rows.get(jax.tree_util.keystr(p), (None, None))[0],
                                  rows=rows.get(jax.tree_util.keystr(p), (None, None))[1]), state)


def _logical_rows(sharded, state) -> dict:
    """{leaf key path: (padded axis, logical rows)} for every leaf of `state` stored padded: the
    parameters and each subtree shaped like them (Adam's moments; found by tree structure, as
    optax.tree_map_params does), when the leaf has the padded shape."""
    root_l, stage_l = sharded.split(sharded.layouts)
    axes = sharded.join(jax.tree.map(lambda _: 0, root_l, is_leaf=is_layout),      # root: rows are axis 0;
                     [jax.tree.map(lambda _: 1, u, is_leaf=is_layout) for u in stage_l])   # units: axis 1
    flat = list(zip(jax.tree.leaves(axes), jax.tree.leaves(sharded.layouts, is_leaf=is_layout)))
    pdef = jax.tree.structure(sharded.layouts, is_leaf=is_layout)
    like_params = lambda x: x is not state and jax.tree.structure(x) == pdef   # noqa: E731
    out = {}
    for path, sub in jax.tree_util.tree_flatten_with_path(state, is_leaf=like_params)[0]:
        if not like_params(sub):
            continue
        for (sub_path, x), (axis, l) in zip(jax.tree_util.tree_flatten_with_path(sub)[0], flat):
            want = (x.shape[0],) + l.stored_shape if axis else l.stored_shape
            if tuple(x.shape) == want and l.padded_rows != l.rows:
                out[jax.tree_util.keystr(path + sub_path)] = (axis, l.rows)
    # subtrees shaped like the parameters but with holes (optax.MaskedNode where a parameter is frozen:
    # jfsdp/train/frozen.py): a leaf whose key path ends with a parameter's and has its padded shape
    params = {jax.tree_util.keystr(p): a for p, a in jax.tree_util.tree_flatten_with_path(
        sharded.layouts, is_leaf=is_layout)[0]}
    for (key, l), axis in zip(params.items(), jax.tree.leaves(axes)):
        for path, x in jax.tree_util.tree_flatten_with_path(state)[0]:
            k = jax.tree_util.keystr(path)
            want = (x.shape[0],) + l.stored_shape if axis and x.ndim else l.stored_shape
            if k not in out and k.endswith(key) and tuple(x.shape) == want and l.padded_rows != l.rows:
                out[k] = (axis, l.rows)
    return out
