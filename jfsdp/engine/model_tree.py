"""A Flax model's own parameter tree, as nested dicts addressed by paths: the helpers that let the engine
treat the units a model scans itself (Linen `nn.scan`) as stacked stages (`AsIs.split` / `join`)."""
from __future__ import annotations

import jax
import numpy as np

from jfsdp.config.errors import ConfigError


def path_text(path) -> str:
    return "/".join(str(p) for p in path)


def subtree(tree, path):
    """The subtree of nested dicts `tree` at `path` (a tuple of keys)."""
    for k in path:
        tree = tree[k]
    return tree


def without(tree, paths_):
    """A copy of nested dicts `tree` without the subtrees at `paths_`."""
    if not paths_:
        return tree
    heads = {p[0] for p in paths_}
    return {k: (v if k not in heads else without(v, [p[1:] for p in paths_ if p[0] == k]))
            for k, v in tree.items() if (k,) not in [tuple(p) for p in paths_]}


def with_subtree(tree, path, sub):
    """A copy of nested dicts `tree` with `sub` placed at `path`."""
    if not path:
        return sub
    out = dict(tree)
    out[path[0]] = with_subtree(tree.get(path[0], {}), path[1:], sub)
    return out


def scanned_units(params, found) -> dict:
    """{unit path: iterations} of the units that run inside the model's own scan (Linen `nn.scan`): their
    stored parameters are those the call saw with one more leading axis, the iterations."""
    out = {}
    for path, seen in found.unit_shapes.items():
        shape = lambda x: isinstance(x, tuple)
        stored = jax.tree.map(np.shape, subtree(params, path))
        if jax.tree.structure(stored, is_leaf=shape) != jax.tree.structure(seen, is_leaf=shape):
            continue
        pairs = zip(jax.tree.leaves(stored, is_leaf=shape), jax.tree.leaves(seen, is_leaf=shape))
        leads = {a[0] if len(a) == len(b) + 1 and a[1:] == b else None for a, b in pairs}
        if len(leads) == 1 and None not in leads:
            out[tuple(path)] = leads.pop()
    return out


def shared_parameter(unit, owner, names):
    """ConfigError: unit `unit` uses parameters that live outside it (at `owner`)."""
    what = ", ".join(f"{path_text(owner)}/{n}" for n in names) or path_text(owner)
    raise ConfigError(f"unit {path_text(unit)} uses {what}, which lives outside it: FSDP gathers a parameter "
                      "shared between a unit and the rest of the model once for all uses only in the root; "
                      "use it from the root, or do not make that module a unit")


def check_nesting(units, found):
    """ConfigError if a unit (a path in `units`) lies inside another; `found.modules` names their classes."""
    for u in sorted(units, key=len):
        outer = next((v for v in units if len(v) < len(u) and u[:len(v)] == v), None)
        if outer is not None:
            raise ConfigError(f"unit {path_text(u)} ({found.modules.get(u, '?')}) is nested inside unit "
                              f"{path_text(outer)}: units must not contain other units")
