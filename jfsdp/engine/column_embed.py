"""An untied embedding looked up without gathering its table (docs/gpus.md, "The step's first gather").

FSDP gathers every parameter before it computes; for an embedding table that is the step's first collective,
with nothing to hide behind (V x D elements, 877 MiB of bf16 sent per device for Llama 3's 128256 x 4096 on 8
devices). A lookup reads only the rows of this device's tokens, and moves less when its columns travel instead:
- the table's shard (its V/S rows) is exchanged by an all-to-all into the V rows of 1/S of its columns
  (V·D/S² elements sent per device, 1/S of the gather's);
- the token ids of the S devices of the `fsdp` group are all-gathered (4 bytes a token), each device looks
  up every one of them in its columns, and an all-to-all hands each device its own tokens' rows, whole
  (tokens·D·(S-1)/S elements).
Backward (`lookup`'s VJP): the rows' gradient goes back by the all-to-all, is scatter-added into the columns'
gradient in the reduce dtype (the group's tokens summed there, where the gather's path sums each device's
in the compute dtype and reduce-scatters), and an all-to-all returns it to the rows' layout: the shard's
gradient, reduced, with no reduce-scatter of the table.
It pays when the tokens of a device are fewer than the table's rows (`applies`: tokens + V/S < V; else the table is gathered, `embed`), as
in LLM training (Llama 3 8B at 2 x 8192 tokens a device: 222 MiB sent in the forward pass instead of 877).
It applies to an `nn.Embed` / `nnx.Embed` table read by the model's embedding alone (untied), split on its
rows over `fsdp` alone with S dividing both V and D, where the embedding runs in the prefetch pipeline's
first stage (engine/root.py `embed_lead`, as_is/model.py); the modules' lookup is intercepted
(`linen_scope`, `nnx_scope`) for the table whose shard is passed in place of the gathered table."""
from __future__ import annotations

import contextlib
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax

from jfsdp.config.mesh import FSDP_AXIS
from jfsdp.engine.fsdp import Comm, unshard
from jfsdp.engine.layout import Layout


def eligible(layout: Layout) -> bool:
    """Whether a table laid out as `layout` (V x D) can be looked up by columns: its rows split over `fsdp`
    alone without padding, and S dividing D."""
    s = layout.shards
    return (s > 1 and len(layout.shape) == 2 and not layout.is_flat and not layout.padding
            and layout.gather_axes == FSDP_AXIS and layout.shape[1] % s == 0)


def applies(layout: Layout, tokens: int) -> bool:
    """Whether the table is looked up by columns for `tokens` token ids a device: `eligible`, and fewer bytes
    sent than its gather (tokens + V/S < V)."""
    return eligible(layout) and tokens + layout.shape[0] / layout.shards < layout.shape[0]


def embed(shard, ids, layout: Layout, comm: Comm, dtype=None):
    """nn.Embed's lookup of `ids` from this device's shard of the table: by columns where that `applies` to
    this many ids, else from the table gathered (`fsdp.unshard`)."""
    if not jnp.issubdtype(jnp.asarray(ids).dtype, jnp.integer):
        raise ValueError("Input type must be an integer or unsigned integer.")
    if applies(layout, int(np.prod(np.shape(ids)))):
        return _lookup(shard, ids, layout, comm, dtype)
    table = unshard(shard, layout, comm)
    return jnp.take(table if dtype is None else table.astype(dtype), ids, axis=0)


def wire_bytes(layout: Layout, tokens: int, param_itemsize: int, grad_itemsize: int, reduce_itemsize: int) -> dict:
    """Bytes a device sends per step for the lookup, by kind: the forward pass's two all-to-alls (the table's
    shard in the gather dtype, the tokens' rows in the compute dtype, `param_itemsize`), the backward's two
    (the rows' gradient in `grad_itemsize`, the columns' gradient in the reduce dtype) and the ids' gather."""
    (v, d), s = layout.shape, layout.shards
    f = (s - 1) / s
    table, rows = v * d / s * f, tokens * d * f
    return {"all-to-all": table * (param_itemsize + reduce_itemsize) + rows * (param_itemsize + grad_itemsize),
            "all-gather": tokens * 4 * (s - 1)}


def _forward(shard, ids, comm: Comm, dtype):
    table = shard.astype(comm.param_dtype or shard.dtype)
    if dtype is not None:
        table = table.astype(dtype)
    cols = lax.all_to_all(table, FSDP_AXIS, 1, 0, tiled=True)             # (V, D/S): 1/S of the columns
    every = lax.all_gather(ids, FSDP_AXIS, axis=0, tiled=True)             # the group's ids, device by device
    rows = jnp.take(cols, every, axis=0)                                   # nn.Embed's lookup, on the columns
    return lax.all_to_all(rows, FSDP_AXIS, 0, rows.ndim - 1, tiled=True), every   # this device's rows, whole


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _lookup(shard, ids, layout, comm, dtype):
    """The rows of `ids` (this device's token ids) in the table whose row-shard this device holds: ids.shape +
    (D,), in `comm.param_dtype` (or `dtype`, the module's); its VJP reduces the table's gradient into the
    shard's (reduce dtype, summed over the replica axes, scaled), as `fsdp.unshard`'s does."""
    return _forward(shard, ids, comm, dtype)[0]


def _lookup_fwd(shard, ids, layout, comm, dtype):
    return _forward(shard, ids, comm, dtype)


def _lookup_bwd(layout, comm, dtype, every, g):
    rdt = comm.reduce_dtype or g.dtype
    g = lax.all_to_all(g, FSDP_AXIS, g.ndim - 1, 0, tiled=True)          # the group's rows, this device's columns
    cols = jnp.zeros((layout.shape[0], layout.shape[1] // layout.shards), rdt)
    _, put = jax.vjp(lambda c: jnp.take(c, every, axis=0), cols)          # the lookup's transpose: a scatter-add
    d = lax.all_to_all(put(g.astype(rdt))[0], FSDP_AXIS, 0, 1, tiled=True)   # back to this device's rows
    return comm.finish(d, layout.dtype), None


_lookup.defvjp(_lookup_fwd, _lookup_bwd)


def linen_scope(tables: dict):
    """While active, an `nn.Embed` whose table is one of `tables` ({id(shard): (layout, comm)}: the shard passed
    in the module's parameters in place of the whole table) looks up by columns; other modules run as written."""
    if not tables:
        return contextlib.nullcontext()

    def intercept(next_fun, args, kwargs, context):
        mod = context.module
        if not isinstance(mod, nn.Embed) or context.method_name not in ("setup", "__call__", "attend"):
            return next_fun(*args, **kwargs)
        table = mod.get_variable("params", "embedding") if mod.has_variable("params", "embedding") else None
        entry = tables.get(id(nn.meta.unbox(table))) if table is not None else None
        if entry is None:
            return next_fun(*args, **kwargs)
        if context.method_name == "setup":   # nn.Embed's setup would refuse the shard's shape
            mod.embedding = nn.meta.unbox(table)
            return None
        if context.method_name == "attend":
            raise AssertionError("a table looked up by columns is read by the embedding alone (untied)")
        return embed(mod.embedding, args[0] if args else kwargs["inputs"], *entry, mod.dtype)
    return nn.intercept_methods(intercept)


@contextlib.contextmanager
def _nnx_call(make):
    """While active, `nnx.Embed.__call__` is `make(the library's __call__)`."""
    real = nnx.Embed.__call__
    nnx.Embed.__call__ = make(real)
    try:
        yield
    finally:
        nnx.Embed.__call__ = real


def nnx_scope(tables: dict):
    """`linen_scope` for NNX: `nnx.Embed.__call__` looks up by columns where its table is one of `tables`."""
    def make(real):
        def call(self, inputs, *args, **kwargs):
            entry = tables.get(id(self.embedding.get_value()))
            if entry is None:
                return real(self, inputs, *args, **kwargs)
            return embed(self.embedding.get_value(), inputs, *entry, self.dtype)
        return call
    return _nnx_call(make) if tables else contextlib.nullcontext()


@contextlib.contextmanager
def recording(index: dict, found: set):
    """While active, the lookups of `nn.Embed` / `nnx.Embed` modules whose table is one of `index` ({id(array):
    i}) add i to `found` (an abstract trace of a model tells which of its leaves are tables looked up). A
    subclass with a `__call__` of its own is not recorded: its table stays gathered."""
    def seen(table):
        i = index.get(id(nn.meta.unbox(table)))
        if i is not None:
            found.add(i)

    def intercept(next_fun, args, kwargs, context):
        mod = context.module
        if (isinstance(mod, nn.Embed) and type(mod).__call__ is nn.Embed.__call__ and context.method_name == "__call__"
                and mod.has_variable("params", "embedding")):   # (a subclass's own lookup is left alone)
            seen(mod.get_variable("params", "embedding"))
        return next_fun(*args, **kwargs)

    def make(real):
        def call(self, inputs, *args, **kwargs):
            if type(self).__call__ is call:
                seen(self.embedding.get_value())
            return real(self, inputs, *args, **kwargs)
        return call
    with _nnx_call(make), nn.intercept_methods(intercept):
        yield


def scope(kind: str, tables: dict):
    """`linen_scope` or `nnx_scope` for a model of `kind` ('linen' or 'nnx')."""
    return linen_scope(tables) if kind == "linen" else nnx_scope(tables)
