"""Frozen parameters: `trainable=` of `make_train_step`, `init_state` and `abstract_state`.

A frozen leaf is still sharded at rest and gathered for compute like any other (the forward pass and
the input gradients need it), but
- the loss is differentiated with respect to the trainable shards only (`lax.stop_gradient` on the
  frozen ones, `FSDP.loss_and_grad(trainable=)`): `unshard`'s backward, and so its reduce-scatter,
  never runs for a frozen leaf;
- the optimizer sees only the trainable leaves (`optax.multi_transform`: a frozen leaf has no
  optimizer state, no weight decay, no update), and the step returns the frozen leaves untouched
  (bit-identical).

`trainable` is a tree of booleans shaped like the parameters (or a prefix of them: `{'root': False,
'units': True}`), or a predicate on a parameter's path, `'root/embed/embedding'` or
`'units/attn/wq/kernel'` (the keys joined by '/'; a stage's leaf is one path for all its units).
"""
from __future__ import annotations

import re
from typing import Any

import jax
import optax

from jfsdp.config.errors import ConfigError
from jfsdp.engine.layout import is_layout

TRAIN, FROZEN = "train", "frozen"


def path_name(keypath) -> str:
    """A key path of the parameter tree as 'root/embed/embedding'."""
    parts = []
    for k in keypath:
        parts.append(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))))
    return "/".join(parts)


def param_paths(sharded) -> list[str]:
    """Every parameter leaf's path, in the order of jax.tree.leaves."""
    return [path_name(p) for p, _ in jax.tree_util.tree_flatten_with_path(sharded.layouts, is_leaf=is_layout)[0]]


def mask(sharded, trainable) -> Any | None:
    """`trainable` (None, a predicate on paths, or a tree of booleans) -> a tree of booleans in the
    layout of `sharded`'s parameters, or None when everything trains. ConfigError when nothing does,
    or when the tree does not match the parameters."""
    if trainable is None:
        return None
    layouts = sharded.layouts
    if callable(trainable):
        out = jax.tree_util.tree_map_with_path(lambda p, _: bool(trainable(path_name(p))), layouts, is_leaf=is_layout)
    else:
        try:
            out = jax.tree.map(lambda t, sub: jax.tree.map(lambda _: bool(t), sub, is_leaf=is_layout),
                               trainable, layouts)
        except (ValueError, TypeError) as e:
            raise ConfigError(f"trainable= must be a tree of booleans shaped like the parameters (or a prefix of "
                              f"them), or a predicate on a parameter's path: {e}") from None
    flags = jax.tree.leaves(out)
    if not any(flags):
        raise ConfigError("trainable= freezes every parameter: nothing would train")
    return None if all(flags) else out


def optimizer(opt: optax.GradientTransformation, trainable_mask) -> optax.GradientTransformation:
    """`opt` on the trainable leaves only; frozen leaves get no state and a zero update."""
    if trainable_mask is None:
        return opt
    labels = jax.tree.map(lambda t: TRAIN if t else FROZEN, trainable_mask)
    return optax.multi_transform({TRAIN: opt, FROZEN: optax.set_to_zero()}, labels)


def opt_shardings(sharded, opt_shapes, replicated):
    """Shardings of an optimizer state whose parameter-like subtrees have holes (optax.MaskedNode where
    a leaf is frozen), which optax.tree_map_params cannot match to the parameters: a leaf whose key path
    ends with a parameter's and has its shape is placed like it; the rest (counts) is replicated."""
    params = {jax.tree_util.keystr(p): (x.shape, s) for (p, x), s in
              zip(jax.tree_util.tree_flatten_with_path(sharded.abstract_params())[0],
                  jax.tree.leaves(sharded.param_shardings))}

    def place(path, x):
        key = jax.tree_util.keystr(path)
        for k, (shape, s) in params.items():
            if key.endswith(k) and tuple(x.shape) == tuple(shape):
                return s
        return replicated
    return jax.tree_util.tree_map_with_path(place, opt_shapes)


def keep_frozen(new_params, old_params, trainable_mask):
    """The step's new parameters, with every frozen leaf the old one itself (not old + 0)."""
    if trainable_mask is None:
        return new_params
    return jax.tree.map(lambda t, new, old: new if t else old, trainable_mask, new_params, old_params)


def matching(sharded, pattern: str) -> list[str]:
    """The parameter paths that the regular expression `pattern` matches (re.search)."""
    try:
        rx = re.compile(pattern)
    except re.error as e:
        raise ConfigError(f"--freeze '{pattern}' is not a regular expression: {e}") from None
    return [p for p in param_paths(sharded) if rx.search(p)]


def freeze(sharded, pattern: str | None, flag: str = "--freeze"):
    """A command line's `--freeze REGEX` -> (make_train_step's `trainable` predicate, the frozen paths);
    (None, []) without a pattern. A pattern that matches no parameter is bad input (ConfigError that
    lists the paths); one that matches every parameter too (`mask`)."""
    if pattern is None:
        return None, []
    hit = matching(sharded, pattern)
    if not hit:
        raise ConfigError(f"{flag} '{pattern}' matches no parameter; the paths are: {', '.join(param_paths(sharded))}")
    hit_set = set(hit)
    predicate = lambda path: path not in hit_set
    mask(sharded, predicate)   # everything frozen: an error now, not at the step
    return predicate, hit
