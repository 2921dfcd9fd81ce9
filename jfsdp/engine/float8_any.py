"""Float8 training for a Flax model given as it is (as_is/): the units' dense matmuls in float8 and
their kernels all-gathered in float8, with float8.py's recipe (`Float8Layout`, `unshard_float8`,
`float8_dot`, the `Float8` filter), reached from outside the model's code.

Which kernels (`mark_units`, once, when the plan is built):
- Linen: an abstract trace of the model's `init` records every `nn.Dense` / `nn.DenseGeneral` that a
  unit calls (the modules `float8.interceptor` can run), with the kernel's shape as the unit sees it
  (one layer's, inside the model's own `nn.scan`);
- NNX: every `nnx.Linear` inside a unit whose `__call__` is `nnx.Linear`'s own (a subclass that
  rewrites it is left alone), the shape being the unit's parameter layout (one layer's, for layers
  stacked by `nnx.vmap`);
- the filter `jfsdp.Float8(skip, min_size)` picks among them by the kernel's path inside its unit
  (e.g. "['attention']['wq']['kernel']") and its size, as for `Stacked`; the chosen leaves become
  `Float8Layout`s. The root (embedding, head, everything outside the units) is never float8.

How the matmuls are reached (`unit_compute`, each unit call): the unit's shards are gathered with its
layouts (the float8 leaves arrive as `Float8Weight`s) and the unit runs with
- Linen: `nn.intercept_methods(float8.interceptor)`, which replaces the call of a Dense whose kernel
  is a `Float8Weight` by `float8_dot`;
- NNX: `nnx.Linear.__call__` swapped, for the duration of the unit's trace, for one that runs
  `float8_dot` when the kernel `Param` holds a `Float8Weight` and the original otherwise. The class
  attribute is restored when the unit's trace ends, as flax_models.py does with the units' own calls.
"""
from __future__ import annotations

import contextlib

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx

from jfsdp.config.errors import ConfigError
from jfsdp.engine.float8 import KERNELS, Float8Layout, handles, interceptor
from jfsdp.engine.float8_rowwise import RowwiseLayout
from jfsdp.engine.fsdp import Unreduced, unshard_tree
from jfsdp.engine.layout import is_layout


def _key(k):
    return getattr(k, "key", getattr(k, "idx", k))


def _text(path) -> str:
    """A path inside a unit as the filter reads it: "['attention']['wq']['kernel']"."""
    return "".join(f"[{p!r}]" for p in path)


def unit_leaf_paths(plan) -> dict:
    """{unit path: [each of the unit's leaves' path inside the unit]}, in the order of `plan.leaf_layouts`."""
    out = {}
    for p, _ in jax.tree_util.tree_flatten_with_path(plan.layouts, is_leaf=is_layout)[0]:
        u = plan.unit_of[jax.tree_util.keystr(p)]
        if u is not None:
            out.setdefault(u, []).append(_text(tuple(_key(k) for k in p)[len(u):]))
    return out


def _unit_of(path, units):
    return next((u for u in units if tuple(path[:len(u)]) == tuple(u)), None)


def linen_kernels(plan) -> dict:
    """{unit path: {kernel path inside the unit: shape}} of the Dense layers the units call (Linen)."""
    found = {}

    def spy(next_fun, args, kwargs, context):
        out = next_fun(*args, **kwargs)
        mod = context.module
        u = _unit_of(mod.path, plan.units)
        if (u is not None and context.method_name == "__call__" and handles(mod)
                and mod.has_variable("params", "kernel")):
            shape = tuple(jnp.shape(nn.meta.unbox(mod.get_variable("params", "kernel"))))
            found.setdefault(u, {})[_text((*mod.path[len(u):], "kernel"))] = shape
        return out

    def init(key):
        batch = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), plan.example_batch)
        with nn.intercept_methods(spy):
            return plan.model.init_variables(key, batch)
    jax.eval_shape(init, jax.random.key(0))
    return found


def nnx_kernels(plan) -> dict:
    """{unit path: {kernel path inside the unit: shape}} of the `nnx.Linear` layers inside the units."""
    shapes = {u: dict(zip(unit_leaf_paths(plan)[u], [l.shape for l in ls])) for u, ls in plan.leaf_layouts.items()}
    found = {}
    for path, m in nnx.iter_graph(plan.model.module):
        u = _unit_of(tuple(path), plan.units)
        if u is not None and isinstance(m, nnx.Linear) and type(m).__call__ is nnx.Linear.__call__:
            k = _text((*tuple(path)[len(u):], "kernel"))
            if k in shapes[u]:
                found.setdefault(u, {})[k] = shapes[u][k]
    return found


MARKED = (Float8Layout, RowwiseLayout)   # unit kernels run in float8 (tensorwise, rowwise recipes)


def mark_units(plan) -> dict:
    """`plan.leaf_layouts` with the kernels that `plan.mp.float8` selects as `Float8Layout`s.
    ConfigError when the filter selects none."""
    spec = plan.mp.float8
    cls = RowwiseLayout if spec.recipe == "rowwise" else Float8Layout
    kernels = linen_kernels(plan) if plan.model.kind == "linen" else nnx_kernels(plan)
    names = unit_leaf_paths(plan)
    out = {}
    for u, ls in plan.leaf_layouts.items():
        chosen = spec.select(kernels.get(u, {}))
        out[u] = [cls(l.shape, l.dtype, l.shards) if p in chosen else l for p, l in zip(names[u], ls)]
    if not any(isinstance(l, MARKED) for ls in out.values() for l in ls):
        what = "Dense" if plan.model.kind == "linen" else "nnx.Linear"
        n = sum(len(k) for k in kernels.values())
        raise ConfigError(f"float8: the filter selects no unit matmul ({n} {what} kernels in the units; "
                          f"skip={list(spec.skip)}, min_size={spec.min_size}; dimensions must be multiples of 16)")
    return out


def _linear_call(mod, x, w):
    """nnx.Linear on a float8 kernel (a `float8.KERNELS` box): its float8 matmul over the last axis, bias
    added in the output dtype."""
    out_dtype = mod.dtype or x.dtype
    y = w.dot(x, out_dtype)
    if mod.bias is not None:
        y = y + jnp.asarray(mod.bias[...]).astype(out_dtype)
    return y


@contextlib.contextmanager
def intercepted():
    """While active, a Linen Dense or an `nnx.Linear` whose kernel is a `Float8Weight` runs `float8_dot`."""
    original = nnx.Linear.__dict__["__call__"]

    def __call__(self, x, *args, **kwargs):
        w = self.kernel.get_value() if hasattr(self.kernel, "get_value") else self.kernel.value
        if not isinstance(w, KERNELS):
            return original(self, x, *args, **kwargs)
        return _linear_call(self, x, w)
    nnx.Linear.__call__ = __call__
    try:
        with nn.intercept_methods(interceptor):
            yield
    finally:
        nnx.Linear.__call__ = original


def gathered_compute(fn, float8: bool):
    """`fn` (the unit on whole parameters) on parameters already gathered (float8 kernels boxed), with the
    float8 matmuls intercepted where `float8`."""
    def compute(params, inputs):
        with intercepted() if float8 else contextlib.nullcontext():
            return fn(params, inputs)
    return compute


def unit_compute(fn, layouts, comm):
    """`(shards, inputs) -> outputs` of a unit call: the shards gathered with `layouts` (float8 leaves
    in float8) and `fn` (the unit on whole parameters) run with the float8 matmuls intercepted."""
    def compute(shards, inputs):
        pairs = jax.tree.leaves(jax.tree.map(lambda l, s: isinstance(l, MARKED) and isinstance(s, Unreduced),
                                             layouts, shards, is_leaf=is_layout))
        if any(pairs):
            raise ConfigError("float8 with grad_sync='once' is not supported: the float8 all-gather reduces each "
                              "micro-batch's gradient itself; use grad_sync='every'")
        params = unshard_tree(shards, layouts, comm)
        with intercepted():
            return fn(params, inputs)
    return compute
