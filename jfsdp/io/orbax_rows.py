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

from jfsdp.io.relayout import param_like


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
        # replica-parallel writing (each replica of a replicated shard writes a slice of it) pays off across
        # hosts; in one process it only cuts every replicated shard on the device first, one small program
        # compiled per array shape (140 of them for llama-test on 2x8)
        super().__init__(array_metadata_store=_array_metadata_store.Store(), enable_write_sharding_file=False,
                         use_replica_parallel=jax.process_count() > 1)

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


def rows_save_args(sharded, state, layouts=None):
    """A tree like `state` (a TrainState of `sharded`, what `fully_shard` returns) of RowsSaveArgs:
    for each leaf stored padded (parameters and the optimizer subtrees shaped like them, found by
    `relayout.param_like` against `layouts`, default the plan's), its padded axis and real row count;
    the other leaves get plain save args (pad_axis=rows=None)."""
    rows = {k: (a, l.rows) for k, (a, l) in param_like(sharded, state, layouts).items() if l.padded_rows != l.rows}
    return jax.tree_util.tree_map_with_path(
        lambda p, _: RowsSaveArgs(pad_axis=rows.get(jax.tree_util.keystr(p), (None, None))[0],
                                  rows=rows.get(jax.tree_util.keystr(p), (None, None))[1]), state)
