"""Expert parallelism: an MoE stage's experts stay where their shards are and the tokens go to them.

The cost model and the choice of mode per stage are in moe.py; this is the run of an 'ep' stage inside
the sharded forward: each device's expert weights used as they are (`place_params`, `local_shard`), and the
experts module's call replaced from outside (`interceptor`) by all-to-all dispatch, the local experts,
and all-to-all combine, in k chunks pipelined against each other (`expert_parallel`).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from jfsdp.config.mesh import FSDP_AXIS
from jfsdp.engine.layout import is_layout
from jfsdp.engine.moe import MoE, StageMoE, expert_leaves, path_keys


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def local_shard(shard, comm, dtype):
    """An expert shard used where it lives: cast to param_dtype, no gather. Its gradient is summed
    over the replica axes (the `data` axis of a hybrid mesh) only, and scaled like every gradient;
    `dtype` is the shard's own (master) dtype."""
    return shard.astype(comm.param_dtype or shard.dtype)


def _local_fwd(shard, comm, dtype):
    return local_shard(shard, comm, dtype), None


def _local_bwd(comm, dtype, _, g):
    g = g.astype(comm.reduce_dtype or g.dtype)
    if comm.reduce_axes:
        g = lax.psum(g, comm.reduce_axes)
    return ((g * comm.scale).astype(dtype),)


local_shard.defvjp(_local_fwd, _local_bwd)


def place_params(unshard_fn, shards, layouts, stage: StageMoE, comm):
    """The unit's parameters for an expert-parallel unit: everything gathered, except the experts'
    leaves, which are the local shards (cast)."""
    site = stage.site

    def one(path, l, x):
        if path_keys(path)[: len(site.path)] == site.path:
            return local_shard(x, comm, jnp.dtype(x.dtype))
        return unshard_fn(x, l)
    return jax.tree_util.tree_map_with_path(one, layouts, shards, is_leaf=is_layout)


def _chunks(n: int, k: int) -> list:
    bounds = [round(i * n / k) for i in range(k + 1)]
    return [(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]


def expert_parallel(buckets, compute, shards: int, chunks: int, axes=FSDP_AXIS):
    """buckets (E, n, d) on every device -> (E, n, d): each chunk of slots all-to-all'ed over `fsdp`
    to the devices holding its experts ((E/S, S*c, d) there), computed with the local experts, sent back.
    `axes`: the experts' (fsdp, or fsdp x tensor at T > 1, their S = S·T devices; parallel/moe_rows.py).

    With k > 1 chunks the chunks form a software pipeline: chunk i+1's dispatch is issued next to
    chunk i's expert compute, and an optimization barrier ties the two together (chunk i+1's
    experts take the barrier's output, which waits for chunk i's). Without it XLA:GPU merges the k
    chunks' expert matmuls into one over the concatenated chunks, so every dispatch must finish
    before any compute starts and nothing is overlapped (jfsdp/engine/moe.py). The barrier is
    the identity on values (and on gradients), so the result is the same for every k."""
    parts = [buckets[:, a:b] for a, b in _chunks(buckets.shape[1], chunks)]

    def send(x):
        return lax.all_to_all(x, axes, 0, 1, tiled=True) if shards > 1 else x

    def back(y):
        return lax.all_to_all(y, axes, 1, 0, tiled=True) if shards > 1 else y

    outs = []
    x = send(parts[0])
    for i in range(len(parts)):
        y = compute(x)
        if i + 1 < len(parts):
            y, x = lax.optimization_barrier((y, send(parts[i + 1])))
        outs.append(back(y))
    return outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=1)


def interceptor(stage: StageMoE, selector: MoE, shards: int, comm=None, layouts=None):
    """The flax method interceptor that runs the experts module expert-parallel."""
    local_n = stage.site.n_experts // shards   # shards: S, or S·T at T > 1 (the experts' own axes)
    axes = FSDP_AXIS if layouts is None else \
        jax.tree.leaves(expert_leaves(layouts, stage.site), is_leaf=is_layout)[0].gather_axes
    inside = []   # the local experts' own call passes through (it is the same module class)

    def hook(next_fun, args, kwargs, context):
        mod = context.module
        if inside or context.method_name != "__call__" or not selector.matches(mod):
            return next_fun(*args, **kwargs)
        local = mod.variables["params"]
        clone = mod.clone(parent=None, n_experts=local_n)

        def compute(x):
            inside.append(True)
            try:
                return clone.apply({"params": local}, x)
            finally:
                inside.pop()
        return expert_parallel(args[0], compute, shards, stage.chunks, axes)
    return hook
