"""Mixture-of-Experts units: one sharded layout of the experts, two ways to run them (TUTEL's switchable
parallelism), chosen per stage.

The experts' weights are ordinary unit parameters with the expert axis first, (E, d, f), so jfsdp's
Shard(0) layout already splits them along experts: the shard of device s on the `fsdp` axis holds
experts s*E/S .. (s+1)*E/S - 1 (when S divides E). From that one layout:

- gather mode: the experts are parameters like any other. The unit gathers them (in param_dtype),
  computes every expert on its own tokens, and reduce-scatters their gradients: FSDP, nothing new.
- expert-parallel mode ('ep'): the weights stay where they are. The model calls its experts through
  one module (by default any flax module whose class is named `Experts`) on buckets of shape
  (E, slots, d), row e holding the tokens sent to expert e. From outside (`flax.linen.intercept_methods`
  inside the sharded forward) jfsdp replaces that call by: all-to-all of the buckets over `fsdp`
  (each device receives, from every device, the rows of its own E/S experts), the experts module
  applied with the LOCAL weights (a clone of the module with `n_experts` = E/S), all-to-all back.
  Expert gradients stay local (each device's experts saw every token routed to them); on a hybrid
  mesh they are summed over `data`, as every shard is.

The contract on the experts module: a field `n_experts`, every parameter with the expert axis first,
and row e of its output depending only on row e of its input and on expert e's weights.

Adaptive pipelining: in 'ep' mode the slots are split into k chunks, each dispatched, computed and
combined on its own, so that the all-to-all of one chunk can run while another chunk computes.

The cost model (per MoE unit, bytes each device sends per step, ring/pairwise cost of each collective,
`f` = (S-1)/S, W = the unit's expert parameters (elements), X = elements of the buckets one device
holds (E x slots x d), p and r the bytes of param_dtype and reduce_dtype on the wire):

    gather = W * (g * p + r) * f        g = 2 gathers with reshard_after_forward (ZeRO-3), else 1
    ep     = a * X * p * f              a = 4 all-to-alls (dispatch and combine, forward and backward),
                                            6 when remat recomputes the forward's two in the backward

(the `data`-axis all-reduce of expert gradients on hybrid meshes is the same in both modes and left
out of the comparison). 'auto' takes the cheaper; a tie goes to gather. Gathering wins when the
tokens outweigh the experts (many tokens, small experts), sending tokens when the experts outweigh
them. 'ep' also needs S to divide E.

Adaptive pipelining, how: chunk i+1's dispatch all-to-all is issued beside chunk i's expert compute
and the two are joined by an optimization barrier (`expert_parallel`): written as k independent chunks,
XLA:GPU merges their expert matmuls into one, so every dispatch finishes before any expert computes.
The chunk count for 'auto' (`auto_chunks`): 1 off GPUs (XLA:CPU's collectives are synchronous);
on GPUs the largest power of two k <= 16 (and <= the slots per device) whose chunks still send at least
256 KiB from each device (a2a_bytes = X * p * f; a2a_bytes / k >= 256 KiB), so that chunks do not become
latency-bound messages and small matmuls. The measured exposure by k is in docs/moe.md.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from jfsdp.config.errors import ConfigError
from jfsdp.config.policy import wire_dtype
from jfsdp.engine.layout import is_layout, stored_bytes

MODES = ("auto", "gather", "ep", "adaptive")


@dataclasses.dataclass(frozen=True)
class MoE:
    """The `moe=` option of `fully_shard`: how MoE units run.

    mode: 'auto' (the cost model), 'gather', 'ep' or 'adaptive' (moe_adaptive.py: the capacity, and
      with it the mode and chunks, chosen per call from the router's measured load), for every MoE
      stage; or a tuple with one entry per stage (None for stages without experts).
    chunks: 'auto' or k >= 1 (expert-parallel stages only), for all stages or one per stage.
    experts: the class name (or class) of the model's experts module.
    backend: whose wire dtypes the cost model counts ('gpu', 'cpu', ...; default: jax's backend here).
      XLA:CPU widens bf16 collectives to f32, so a plan made on CPU for a GPU should say 'gpu'.
    Adaptive mode only (moe_adaptive.py):
    buckets: the capacities (slots per expert per routing group) compiled, strictly increasing; None:
      ceil(T*k/E) doubled up to T.
    run: the mode of every bucket's variant, 'gather' or 'ep', or 'auto' (the cost model per bucket).
    capacity_factor: a cap: no bucket above ceil(capacity_factor * T * k / E) (None: no cap).
    layer: the class name (or class) of the model's MoE layer (its `capacity` field and `load` method).
    calibration: measured seconds per step {(capacity, mode, chunks): s} (moe_calibrate.py): each bucket then
      runs its fastest measured (mode, chunks) instead of the byte model's mode (None: the byte model)."""
    mode: Any = "auto"
    chunks: Any = "auto"
    experts: Any = "Experts"
    backend: Any = None
    buckets: Any = None
    run: Any = "auto"
    capacity_factor: Any = None
    layer: Any = "MoEFeedForward"
    calibration: Any = None

    def matches(self, module, name=None) -> bool:
        e = self.experts if name is None else name
        return type(module) is e if isinstance(e, type) else type(module).__name__ == e


@dataclasses.dataclass(frozen=True)
class Site:
    """The experts module of one stage's unit, as traced: where its parameters are in the unit's tree,
    how many experts, and the shape of the buckets it is called on (per device, local batch)."""
    path: tuple
    n_experts: int
    buckets: tuple          # (E, slots, d) on one device
    dtype: Any


@dataclasses.dataclass(frozen=True)
class StageMoE:
    """What jfsdp does with one MoE stage: mode, chunks, and the cost model's figures behind it."""
    site: Site
    mode: str
    chunks: int
    costs: dict             # bytes per device per step of the whole stage: {'gather': .., 'ep': ..}
    why: str


def path_keys(path) -> tuple:
    return tuple(getattr(k, "key", getattr(k, "name", k)) for k in path)


def traced_calls(unit, h, local_rows: int, total_rows: int, match) -> list:
    """Trace `unit` on one device's rows of h (global shapes: `local_rows` of the `total_rows`) and return
    (module, first argument's shape and dtype) of each `__call__` of a module that `match` accepts."""
    found = []

    def spy(next_fun, args, kwargs, context):
        if context.method_name == "__call__" and match(context.module):
            found.append((context.module, tuple(args[0].shape), args[0].dtype))
        return next_fun(*args, **kwargs)

    local = jax.tree.map(lambda a: jax.ShapeDtypeStruct((a.shape[0] * local_rows // total_rows, *a.shape[1:]), a.dtype), h)
    with nn.intercept_methods(spy):
        jax.eval_shape(lambda k: unit.init(k, jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), local))["params"],
                           jax.random.key(0))
    return found


def find_site(unit, h, local_rows: int, total_rows: int, selector: MoE):
    """Trace `unit` on h (global shapes) and return the Site of its experts module, or None. Bucket
    shapes are traced on one device's rows: `local_rows` of the `total_rows` of the batch."""
    found = [(tuple(m.path), getattr(m, "n_experts", None), shape, dtype)
             for m, shape, dtype in traced_calls(unit, h, local_rows, total_rows, selector.matches)]
    if not found:
        return None
    paths = {f[0] for f in found}
    if len(paths) > 1:
        raise ConfigError(f"a unit calls {len(paths)} experts modules ({sorted(paths)}); jfsdp's MoE modes take one per unit")
    path, n, shape, dtype = found[-1]
    if not isinstance(n, int) or len(shape) != 3 or shape[0] != n:
        raise ConfigError(f"the experts module at {'/'.join(path)} must have an integer field n_experts and be called "
                          f"on buckets (n_experts, slots, d); got n_experts={n!r}, buckets {shape}")
    return Site(path, n, shape, jnp.dtype(dtype))


def expert_bytes(layouts, site: Site, dtype) -> int:
    """Bytes of one unit's expert parameters (stored, padded shape) in `dtype`."""
    return stored_bytes(expert_leaves(layouts, site), dtype)


def expert_leaves(layouts, site: Site):
    """The unit's layouts under the experts module (a subtree)."""
    t = layouts
    for k in site.path:
        t = t[k]
    return t


def expert_shards(sharded) -> int:
    """The devices an expert leaf is split over: S, or S·T at T > 1 (fsdp x tensor, parallel/moe_rows.py)."""
    return sharded.shards * getattr(sharded, "tensor", 1)


def _per_stage(value, n, name):
    if isinstance(value, (tuple, list)):
        if len(value) != n:
            raise ConfigError(f"moe {name} has {len(value)} entries, the model has {n} stages (one per stage, None for "
                              "stages without experts)")
        return list(value)
    return [value] * n


def costs(sharded, site: Site, layouts, n_units: int, backend: str | None = None, recompute: bool = False) -> dict:
    """The cost model (module docstring): bytes each device sends per step for the stage's expert
    parameters in gather mode and for its tokens in expert-parallel mode, with the backend's wire
    dtypes (XLA:CPU widens bf16 to f32: `memory.wire_dtype`). `recompute`: the backward pass runs the
    forward's collectives again whatever the remat (an adaptive variant: moe_adaptive.switch)."""
    S = expert_shards(sharded)
    f = (S - 1) / S if S > 1 else 0.0
    backend = backend or jax.default_backend()
    p = wire_dtype(sharded.mp.param_dtype or jnp.float32, backend).itemsize
    r = wire_dtype(sharded.mp.reduce_dtype or sharded.mp.param_dtype or jnp.float32, backend).itemsize
    W = sum(math.prod(l.stored_shape) for l in jax.tree.leaves(expert_leaves(layouts, site),
                                                                 is_leaf=is_layout))
    g = 2 if (sharded.strategy.reshard_after_forward or S == 1 or recompute) else 1
    X = math.prod(site.buckets)
    xb = wire_dtype(sharded.mp.param_dtype or site.dtype, backend).itemsize
    a = 4 if sharded.remat == "none" and not recompute else 6
    return {"gather": n_units * W * (g * p + r) * f, "ep": n_units * a * X * xb * f,
            "weights": n_units * W, "tokens": n_units * X, "all_to_alls": a, "gathers": g, "units": n_units,
            "a2a_bytes": X * xb * f}


# 'auto' chunk count (module docstring): the largest power of two up to MAX_CHUNKS whose chunks each
# still send at least MIN_CHUNK_BYTES per device; 1 off GPUs.
MAX_CHUNKS = 16
MIN_CHUNK_BYTES = 256 * 2**10


def auto_chunks(sharded, site: Site, cost: dict, backend: str | None = None) -> int:
    """k for 'auto' (module docstring): 1 where collectives are synchronous (any backend but 'gpu');
    on GPUs the largest power of two k <= MAX_CHUNKS (and <= the slots per device) such that one
    chunk's all-to-all still sends MIN_CHUNK_BYTES from each device."""
    if (backend or jax.default_backend()) not in ("gpu", "cuda", "rocm"):
        return 1
    k = 1
    while 2 * k <= min(MAX_CHUNKS, site.buckets[1]) and cost["a2a_bytes"] / (2 * k) >= MIN_CHUNK_BYTES:
        k *= 2
    return k


def resolve(sharded, option: MoE | None, adaptive=None) -> list:
    """Per stage: None (no experts, or no `moe=` option: gather as FSDP does) or a StageMoE.
    `adaptive(sharded, option, j, site, layouts, cost, k)` resolves an adaptive stage (moe_adaptive.resolve_stage)."""
    n = len(sharded.model.stages)
    if option is None:
        return [None] * n
    if not isinstance(option, MoE):
        raise ConfigError(f"moe must be a jfsdp.MoE(mode=..., chunks=...), got {type(option).__name__}")
    modes, chunks = _per_stage(option.mode, n, "mode"), _per_stage(option.chunks, n, "chunks")
    rows = sharded.example_inputs.shape[0]
    local_rows = rows // sharded.n_devices if rows % sharded.n_devices == 0 else rows
    out = []
    for j, (st, h, mode, k) in enumerate(zip(sharded.model.stages, sharded.h_shapes, modes, chunks)):
        site = find_site(st.unit, h, local_rows, rows, option)
        if site is None:
            if isinstance(option.mode, (tuple, list)) and mode is not None:
                raise ConfigError(f"stage {j} has no experts module ({option.experts}): its moe mode must be None")
            out.append(None)
            continue
        if mode not in MODES:
            raise ConfigError(f"stage {j}: unknown moe mode {mode!r}; choose from {', '.join(MODES)}")
        if not (k == "auto" or (isinstance(k, int) and not isinstance(k, bool) and k >= 1)):
            raise ConfigError(f"stage {j}: moe chunks must be 'auto' or an integer of at least 1, got {k!r}")
        layouts = sharded.split(sharded.layouts)[1][j]
        cost = costs(sharded, site, layouts, st.n_units, option.backend)
        S, E = expert_shards(sharded), site.n_experts
        ep_ok = sharded.strategy.sharded and E % S == 0
        cheaper = "ep" if cost["ep"] < cost["gather"] else "gather"
        figures = f"gather {cost['gather'] / 2**20:.2f} MiB vs all-to-all {cost['ep'] / 2**20:.2f} MiB per step"
        if mode == "adaptive":
            out.append(adaptive(sharded, option, j, site, layouts, cost, k))
            continue
        if mode == "auto":
            mode = cheaper if ep_ok else "gather"
            why = f"cost model: {figures}" + ("" if ep_ok or cheaper == "gather" else
                                              f" (ep not possible: {E} experts over {S} shards)")
        else:
            why = f"set by moe=; cost model would pick {cheaper}: {figures}"
        if mode == "ep":
            if not sharded.strategy.sharded:
                raise ConfigError(f"stage {j}: expert parallelism needs the experts sharded over fsdp; strategy "
                                  f"{sharded.strategy.value} keeps them whole (use gather mode or a sharded strategy)")
            if E % S:
                axes = "fsdp x tensor" if S > sharded.shards else "fsdp"
                raise ConfigError(f"stage {j}: expert parallelism needs the {E} experts to divide over the {S} {axes} "
                                  f"shards (each device holds E/S whole experts); use gather mode or a mesh whose {axes} "
                                  f"size divides {E}")
            if k != "auto" and k > site.buckets[1]:
                raise ConfigError(f"stage {j}: {k} chunks for {site.buckets[1]} slots per device; use at most that many")
            k = auto_chunks(sharded, site, cost, option.backend) if k == "auto" else k
        else:
            if k not in ("auto", 1):
                raise ConfigError(f"stage {j}: chunks={k} applies to expert-parallel mode, not gather")
            k = 1
        out.append(StageMoE(site, mode, k, cost, why))
    if all(o is None for o in out):
        raise ConfigError(f"moe= was given but no stage calls an experts module ({option.experts})")
    return out


# ---------------------------------------------------------------- inside the sharded forward

def describe(sharded) -> list:
    """Lines for the planner: each MoE stage's mode, chunks and why."""
    lines = []
    for j, s in enumerate(getattr(sharded, "moe_stages", None) or []):
        if s is None:
            continue
        lines.append(f"stage {j} ({sharded.stage_sizes[j]} MoE units, {s.site.n_experts} experts, buckets "
                     f"{'x'.join(map(str, s.site.buckets))} per device): {s.mode}"
                     + (f", {s.chunks} chunk(s)" if s.mode == "ep" else "") + f" -- {s.why}")
        for v in getattr(s, "variants", ()):
            lines.append(f"  capacity {v.capacity}: {v.mode}" + (f", {v.chunks} chunk(s)" if v.mode == "ep" else "")
                         + f"; modelled gather {v.costs['gather'] / 2**20:.2f} MiB, all-to-all "
                         f"{v.costs['ep'] / 2**20:.2f} MiB per step" + (f"; measured {v.seconds:.4g} s per step"
                                                                         if v.seconds is not None else ""))
    return lines
