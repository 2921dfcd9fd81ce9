"""A Flax model as it is, Linen or NNX, seen through one small interface: its parameter tree, how to
initialize it, and how to run it with every call of a unit instance handed to the engine.

`LinenModel` intercepts unit calls with `flax.linen.intercept_methods`; `NNXModel` swaps the unit
classes' `__call__` for the duration of a trace. In both, a unit call becomes
`hook(path, shards, fn, inputs)`, where `shards` is the unit's parameter subtree as the engine placed
it, `inputs` the call's arrays (positional, keyword, the unit's random keys) and
`fn(params, inputs) -> outputs` the unit applied to whole parameters, a pure function. Flags and other
non-array arguments stay static. Nothing here knows about meshes or collectives.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx
from flax.core.tracers import current_trace

from jfsdp.config.errors import ConfigError
from jfsdp.engine.model_tree import check_nesting, path_text, scanned_units, shared_parameter, subtree
from jfsdp.engine.unit_call import split_arguments


@dataclasses.dataclass
class Found:
    """What one trace of the model saw: every module (path -> class name) and the unit calls, in order."""
    modules: dict = dataclasses.field(default_factory=dict)
    unit_calls: list = dataclasses.field(default_factory=list)
    unit_shapes: dict = dataclasses.field(default_factory=dict)   # path -> the unit's parameter shapes in a call
    top: object = None                                          # the trace the model's call starts in
    nested: list = dataclasses.field(default_factory=list)      # units called inside a transform of the model's own

    def saw(self, path):
        """Record a unit call; one made in another trace than the model's call (inside its nn.remat, nn.scan,
        lax.cond, ...) is `nested` as well."""
        self.unit_calls.append(path)
        if current_trace() != self.top:
            self.nested.append(path)


class UnitMatcher:
    """`units=`: a module class, a tuple of classes, or a predicate on a submodule's path ('a/b/0')."""

    def __init__(self, units):
        if isinstance(units, type) or (isinstance(units, tuple) and units and all(isinstance(u, type) for u in units)):
            self.classes, self.predicate = units if isinstance(units, tuple) else (units,), None
        elif callable(units):
            self.classes, self.predicate = None, units
        else:
            raise ConfigError("units= must be a module class, a tuple of classes, or a predicate on a submodule's "
                              f"path, got {units!r}")

    def __call__(self, path, module) -> bool:
        if not path:
            return False
        if self.classes is not None:
            return isinstance(module, self.classes)
        return bool(self.predicate(path_text(path)))


class LinenModel:
    """An unbound Linen module; `call(module, batch)` applies it (a method of the bound module)."""
    kind = "linen"

    def __init__(self, module: nn.Module, call: Callable, rng_streams: tuple):
        self.module, self.call, self.rng_streams = module, call, tuple(rng_streams)

    def _rngs(self, key):
        keys = jax.random.split(key, 1 + len(self.rng_streams))
        return {"params": keys[0], **{s: k for s, k in zip(self.rng_streams, keys[1:])}}

    def init_variables(self, key, batch, matcher=None, found=None):
        """All the model's variables from its own initializers (boxed metadata as `init` gives it)."""
        hook = _linen_recorder(matcher, found) if found is not None else None
        if found is not None:
            found.top = current_trace()
        with (nn.intercept_methods(hook) if hook else contextlib.nullcontext()):
            return self.module.init(self._rngs(key), batch, method=self.call)

    def apply(self, params, batch, hook, units, rngs: dict):
        """The model's outputs with `params` (units' subtrees as shards), unit calls sent to `hook`."""
        busy = []

        def intercept(next_fun, args, kwargs, context):
            mod = context.module
            if busy or context.method_name == "setup" or mod.path not in units:
                return next_fun(*args, **kwargs)
            unbound, variables = mod.unbind()
            keys = {s: jax.random.key_data(mod.make_rng(s)) for s in sorted(mod.scope.rngs)}
            arrays, rebuild = split_arguments(args, kwargs)
            method = context.method_name

            def fn(p, inputs):
                a, kw = rebuild(inputs[1:])
                rng = {s: jax.random.wrap_key_data(k) for s, k in inputs[0].items()}
                busy.append(True)
                try:
                    return unbound.apply({"params": p}, *a, rngs=rng, method=method, **kw)
                finally:
                    busy.pop()
            return hook(tuple(mod.path), variables["params"], fn, [keys, *arrays])
        with nn.intercept_methods(intercept):
            return self.module.apply({"params": params}, batch, method=self.call, rngs=rngs)


def _linen_recorder(matcher, found: Found):
    stack = []

    def record(next_fun, args, kwargs, context):
        mod = context.module
        path = tuple(mod.path)
        found.modules.setdefault(path, type(mod).__name__)
        if stack and path[:len(stack[-1])] != stack[-1]:
            shared_parameter(stack[-1], path, list(mod.variables.get("params", {})) if mod.scope else [])
        if context.method_name == "setup" or not matcher(path, mod) or (stack and stack[-1] == path):
            return next_fun(*args, **kwargs)   # (the unit's own methods calling each other: one call)
        if stack:
            raise ConfigError(f"unit {path_text(path)} ({type(mod).__name__}) is nested inside unit "
                              f"{path_text(stack[-1])}: units must not contain other units")
        found.saw(path)
        stack.append(path)
        try:
            out = next_fun(*args, **kwargs)
        finally:
            stack.pop()
        # what the call saw: inside a Linen transform (nn.scan) one iteration's slice of stacked parameters
        found.unit_shapes[path] = jax.tree.map(jnp.shape, nn.meta.unbox(mod.variables.get("params", {})))
        return out
    return record


class NNXModel:
    """An NNX module (concrete, or abstract from `nnx.eval_shape`); `call(model, batch)` applies it."""
    kind = "nnx"

    def __init__(self, module: nnx.Module, call: Callable, init: Callable | None):
        self.graphdef, self.params_state, self.rest = nnx.split(module, nnx.Param, ...)
        self.module, self.call, self.init_fn = module, call, init

    def params(self):
        return self.params_state.to_pure_dict()

    def submodules(self):
        return [(tuple(p), m) for p, m in nnx.iter_graph(self.module) if isinstance(m, nnx.Module)]

    def merged(self, params, rest=None):
        state = nnx.State(self.params_state)   # a copy whose values are replaced
        nnx.replace_by_pure_dict(state, params)
        # fresh Variable objects for the rest (random counters): NNX refuses to mutate a Variable made
        # outside the trace that mutates it
        rest = jax.tree.map(lambda x: x, self.rest if rest is None else rest)
        return nnx.merge(self.graphdef, state, rest)

    def fresh_rest(self, key):
        """The non-parameter state with every random key folded with `key` and counts reset, so that
        each step (and each device, each micro-batch) draws its own random numbers from the seed."""
        def fold(x):
            value = x.get_value() if hasattr(x, "get_value") else x.value   # .value: flax before 0.12
            if isinstance(x, nnx.RngKey):   # (keys stacked per layer for the model's scan: each one folded)
                folded = jax.vmap(lambda k: jax.random.fold_in(k, jax.random.key_data(key)[-1]))(value.reshape(-1))
                return x.replace(folded.reshape(value.shape))
            if isinstance(x, nnx.RngCount):
                return x.replace(jnp.zeros_like(value))
            return x
        return jax.tree.map(fold, self.rest, is_leaf=lambda x: isinstance(x, nnx.Variable))

    def apply(self, params, batch, hook, units, key, classes=None):
        self.live = model = self.merged(params, None if key is None else self.fresh_rest(key))   # (late_root.py)
        with _nnx_calls(_targets(model, units), hook, classes):
            return self.call(model, batch)

    def trace_units(self, batch, matcher, found: Found):
        """One abstract call recording unit calls (nesting is refused before: see `check_nesting`)."""
        for p, m in self.submodules():
            found.modules.setdefault(p, type(m).__name__)
        units = {p for p, m in self.submodules() if matcher(p, m)}
        check_nesting(units, found)
        check_shared(self.module, units)
        model = self.merged(jax.tree.map(jnp.zeros_like, self.params()))
        anonymous = []

        def record(path, shards, fn, inputs):
            if path is None:
                anonymous.append(jax.tree.map(jnp.shape, shards))
            else:
                found.saw(path)
            return fn(shards, inputs)
        found.top = current_trace()
        with _nnx_calls(_targets(model, units), record, matcher.classes):
            out = self.call(model, batch)
        # a unit never called itself but whose stacked parameters a unit made inside the model's scan saw
        stored = self.params()
        for path in sorted(units - set(found.unit_calls)):
            for seen in anonymous:
                found.unit_shapes[path] = seen
                if path in scanned_units(stored, found):
                    found.unit_calls.append(path)
                    break
                del found.unit_shapes[path]
            else:
                seen = jax.tree.map(jnp.shape, subtree(stored, path))
                if any(a == seen for a in anonymous):
                    raise ConfigError(f"unit {path_text(path)} ({found.modules.get(path, '?')}) is called inside an "
                                      "NNX transform of the model's own other than nnx.scan over stacked layers "
                                      "(nnx.remat, nnx.cond, nnx.vmap, ...): jfsdp does not follow a unit into it; "
                                      "call the unit directly (fully_shard's remat= does what nnx.remat did)")
        return out


def check_shared(model, units):
    """An NNX unit that reaches a parameter that the rest of the model reaches too (a tied embedding
    referenced by a unit): ConfigError naming it."""
    outside, seen = {}, set()

    def walk(node, path):   # the model's graph, not entering units
        if id(node) in seen:
            return
        seen.add(id(node))
        for key, child in nnx.iter_children(node):
            p = (*path, key)
            if isinstance(child, nnx.Param):
                outside.setdefault(id(child), p)
            elif isinstance(child, nnx.Module) and p in units:
                continue
            elif not isinstance(child, nnx.Variable):
                walk(child, p)
    walk(model, ())
    for p, m in nnx.iter_graph(model):
        if isinstance(m, nnx.Module) and tuple(p) in units:
            for q, x in nnx.iter_graph(m):
                if isinstance(x, nnx.Param) and id(x) in outside:
                    where = outside[id(x)]
                    shared_parameter(tuple(p), where[:-1], [where[-1]])


def _targets(model, units) -> dict:
    """{id(module): (path, module)} of the unit instances of a merged NNX model."""
    return {id(m): (tuple(p), m) for p, m in nnx.iter_graph(model) if isinstance(m, nnx.Module) and tuple(p) in units}


@contextlib.contextmanager
def _nnx_calls(targets: dict, hook, classes=None):
    """While active, calling a module in `targets` (`_targets`) goes to `hook`; the unit's
    non-parameter state (random counters) that the call updates is written back. An instance of one of
    `classes` that is not a target is a unit made anew inside an NNX transform (`nnx.scan` over stacked
    layers): it goes to `hook` with the path None."""
    busy = []
    originals = {}

    def patched_for(cls, original):
        def __call__(self, *args, **kwargs):
            known = id(self) in targets
            if busy or not (known or (classes and isinstance(self, classes))):
                return original(self, *args, **kwargs)
            gdef, shards, rest = nnx.split(self, nnx.Param, ...)
            arrays, rebuild = split_arguments(args, kwargs)

            def fn(p, inputs):
                state = nnx.State(shards)
                nnx.replace_by_pure_dict(state, p)
                unit = nnx.merge(gdef, state, inputs[0])
                a, kw = rebuild(inputs[1:])
                busy.append(True)
                try:
                    out = original(unit, *a, **kw)
                finally:
                    busy.pop()
                return out, nnx.state(unit, nnx.Not(nnx.Param))
            out, new_rest = hook(targets[id(self)][0] if known else None, shards.to_pure_dict(), fn, [rest, *arrays])
            nnx.update(self, new_rest)
            return out
        return __call__

    for cls in {type(m) for _, m in targets.values()}:
        originals[cls] = cls.__dict__.get("__call__")
        cls.__call__ = patched_for(cls, cls.__call__)
    try:
        yield
    finally:
        for cls, original in originals.items():
            if original is None:
                del cls.__call__
            else:
                cls.__call__ = original


def adapt(model, call, rng_streams=("dropout",), init=None):
    """The model behind a uniform interface: Linen (an unbound module) or NNX (a module)."""
    if isinstance(model, nn.Module):
        if model.scope is not None:
            raise ConfigError("give fully_shard the Linen module unbound (as constructed), not a bound one")
        return LinenModel(model, call or (lambda m, batch: m(batch["inputs"])), rng_streams)
    if isinstance(model, nnx.Module):
        return NNXModel(model, call or (lambda m, batch: m(batch["inputs"])), init)
    raise ConfigError(f"fully_shard expects a Flax model: a Linen module (flax.linen.Module), an NNX module "
                      f"(flax.nnx.Module), or jfsdp.Stacked / jfsdp.Staged; got {type(model).__name__}")
