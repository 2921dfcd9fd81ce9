"""A tensor-parallel plan: which parameters of a model's units are split over the `tensor` axis.

`TensorPlan(rules)`: `rules` maps a regular expression on a parameter's path ('units/attention/wq/kernel',
searched, first rule that matches wins) to its kind:
- 'colwise': a Dense kernel (in, out) split on its output dimension (the last): each tensor rank computes
  out/T features (heads) from the whole input;
- 'rowwise': a Dense kernel split on its input dimension (the first): each rank multiplies its slice of the
  features and the partial sums are reduce-scattered over `tensor`;
- 'replicate': not tensor-parallel (the default for every parameter no rule names).
`sequence_dim` is the axis of h that sequence parallelism splits (the residual stream between units is
(batch, sequence, ...) sharded on it over `tensor`). `divides` names sizes T must divide (heads, KV heads,
the FFN width) for a message that says which. Nothing here imports jax; `plan.py` is read by layout.py."""
from __future__ import annotations

import dataclasses
import re

from jfsdp.config.errors import ConfigError

COLWISE, ROWWISE, REPLICATE = "colwise", "rowwise", "replicate"
KINDS = (COLWISE, ROWWISE, REPLICATE)


@dataclasses.dataclass(frozen=True)
class TensorPlan:
    """Path regex -> 'colwise' / 'rowwise' / 'replicate' (a dict or (regex, kind) pairs), the sequence axis
    of h, and {what: size} that T must divide."""
    rules: tuple
    sequence_dim: int = 1
    divides: tuple = ()

    def __post_init__(self):
        rules = tuple(self.rules.items()) if isinstance(self.rules, dict) else tuple(map(tuple, self.rules))
        for pattern, kind in rules:
            if kind not in KINDS:
                raise ConfigError(f"tensor plan rule {pattern!r}: kind {kind!r} is not one of {', '.join(KINDS)}")
            try:
                re.compile(pattern)
            except re.error as e:
                raise ConfigError(f"tensor plan rule {pattern!r} is not a regular expression: {e}") from None
        divides = tuple(self.divides.items()) if isinstance(self.divides, dict) else tuple(map(tuple, self.divides))
        object.__setattr__(self, "rules", rules)
        object.__setattr__(self, "divides", divides)

    def kind(self, path: str) -> str:
        """The kind of the parameter at `path` ('units/attention/wq/kernel'): its first matching rule's."""
        return next((kind for pattern, kind in self.rules if re.search(pattern, path)), REPLICATE)

    def check_rules(self, paths):
        """ConfigError if a rule matches none of `paths` (every parameter's path)."""
        for pattern, kind in self.rules:
            if not any(re.search(pattern, p) for p in paths):
                raise ConfigError(f"tensor plan rule {pattern!r} ({kind}) matches no parameter of the model "
                                  f"(paths look like {sorted(paths)[0]!r})")

    def check_sizes(self, tensor: int):
        """ConfigError if T does not divide a size the plan names."""
        for what, size in self.divides:
            if size % tensor:
                raise ConfigError(f"tensor {tensor} does not divide the {what} ({size}): each tensor rank needs "
                                  "a whole share of them")
