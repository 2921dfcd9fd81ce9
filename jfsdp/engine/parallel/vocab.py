"""The vocabulary-parallel root (docs/tensor-parallel.md, "The root"): with a TP plan that names the root's
embedding `rowwise` and its output head `colwise` (torchtitan's spelling), each tensor rank holds 1/T of
the vocabulary, and the logits are never whole on one device.

- The embedding lookup (`nn.Embed.__call__`): the token ids of the TP group's whole sequence are
  all-gathered over `tensor` (4 bytes a token), each rank looks up the ids in its share (zeros
  elsewhere), and the rows are reduce-scattered over `tensor` onto the sequence: the residual stream
  leaves the root sequence-parallel, as between units. Backward: an all-gather of dh.
- The head: the root's head method runs on this rank's 1/T of the sequence (its final norm too), and
  the input of its projection is all-gathered over `tensor` on the sequence: the projection runs on
  the TP group's whole sequence against this rank's share of the vocabulary (`nn.Embed.attend` for a
  tied embedding, `nn.Dense` for an untied head): logits (tokens, V/T). A fused loss's head method
  returns (hidden states, weight) without the projection: its hidden states are gathered
  (`gather_features`). Backward: a reduce-scatter of the projection input's gradient. (Gathering h
  before the norm ran the norm T times over, and kept its fp32 values for the whole sequence: 8 GiB
  per device for llama-70b at FSDP 32 x TP 8, 16 x 8192 tokens a TP group.) Why the sequence and not the vocabulary moves:
  docs/tensor-parallel.md, "The root".
- The loss runs under `loss_parallel(shard)`: jfsdp's losses (jfsdp/train/losses.py) reduce the max
  and the log-sum-exp over `tensor` and pick each target's logit on the rank that holds it. The batch
  is all-gathered on the sequence first, so that the loss sees the rows and tokens the logits cover.
  Every tensor rank then computes the same loss over the TP group's tokens; the engine's sum over
  all devices divided by their count stays the global mean, and jax's transpose of `psum` (a psum)
  sums the T ranks' gradients as that sum asks.
When T does not divide the vocabulary, the last share is padded with zero rows whose logits are -inf
(`VocabShard.mask`): they add nothing to the softmax, and their gradient is zero."""
from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from jfsdp.config.errors import ConfigError
from jfsdp.config.mesh import AXES, CONTEXT_AXIS, TENSOR_AXIS
from jfsdp.engine.layout import is_layout
from jfsdp.engine.parallel.layout import TensorLayout, path_text
from jfsdp.engine.parallel.plan import COLWISE, ROWWISE
from jfsdp.engine.parallel.tensor import dense, gather_sequence, scatter_sequence


@dataclasses.dataclass(frozen=True)
class VocabShard:
    """Each tensor rank's share of a vocabulary of `vocab` entries: `local` of them, from `offset()`;
    the last share is padded when T does not divide `vocab`."""
    vocab: int
    local: int
    tensor: int
    axis: str = TENSOR_AXIS

    def offset(self):
        return lax.axis_index(self.axis) * self.local

    def mask(self, logits):
        """The padded columns of the last share set to -inf (nothing to do when T divides the vocabulary)."""
        if self.local * self.tensor == self.vocab:
            return logits
        cols = self.offset() + jnp.arange(self.local)
        return jnp.where(cols < self.vocab, logits, jnp.array(-jnp.inf, logits.dtype))

    def local_ids(self, ids):
        """(ids - offset clipped into the share, whether each id lies in this rank's share)."""
        local = ids - self.offset()
        return jnp.clip(local, 0, self.local - 1), (local >= 0) & (local < self.local)


_ACTIVE: list = []


@contextlib.contextmanager
def loss_parallel(shard: VocabShard):
    """While tracing a loss: the outputs' last axis is `shard`'s share of the vocabulary (`current()`)."""
    _ACTIVE.append(shard)
    try:
        yield shard
    finally:
        _ACTIVE.pop()


def current():
    """The VocabShard of the loss being traced, or None (the logits hold the whole vocabulary)."""
    return _ACTIVE[-1] if _ACTIVE else None


def root_modules(root_layouts) -> tuple:
    """({module path in the root: (leaf name, TensorLayout)}, the VocabShard or None) of the root's
    tensor-parallel leaves; ConfigError for two vocabulary sizes."""
    modules, shard = {}, None
    for path, l in jax.tree_util.tree_flatten_with_path(root_layouts, is_leaf=is_layout)[0]:
        if not isinstance(l, TensorLayout):
            continue
        names = tuple(path_text([k]) for k in path)
        modules[names[:-1]] = (names[-1], l)
        s = VocabShard(l.full_shape[l.dim], l.shape[l.dim], l.tensor)
        if shard is not None and s != shard:
            raise ConfigError(f"the root's tensor-parallel leaves split two vocabularies ({shard.vocab}, {s.vocab}): "
                              "a vocabulary-parallel embedding and head must share one vocabulary")
        shard = s
    return modules, shard


def lookup(mod, ids, shard: VocabShard, dim: int):
    """The vocabulary-parallel embedding lookup of sequence-parallel `ids` -> rows, sequence-parallel."""
    if not jnp.issubdtype(ids.dtype, jnp.integer):
        raise ValueError("Input type must be an integer or unsigned integer.")
    ids = gather_sequence(ids, dim)
    (table,) = mod.promote_dtype(mod.embedding, dtype=mod.dtype, inexact=False)
    local, ok = shard.local_ids(ids)
    rows = jnp.where(ok[..., None], jnp.take(table, local, axis=0), jnp.zeros((), table.dtype))
    return scatter_sequence(rows, dim)


def root_interceptor(modules: dict, shard: VocabShard, dim: int):
    """A Linen method interceptor for the root: an `nn.Embed` named rowwise holds its share of the table
    (set in its setup, which would refuse the shape) and looks up / attends with it; an `nn.Dense`
    named colwise multiplies by its share of the head's columns."""
    def intercept(next_fun, args, kwargs, context):
        mod, method = context.module, context.method_name
        entry = modules.get(tuple(mod.path))
        if entry is None:
            return next_fun(*args, **kwargs)
        name, layout = entry
        if isinstance(mod, nn.Embed) and layout.tp == ROWWISE and name == "embedding":
            if method == "setup":
                mod.embedding = nn.meta.unbox(mod.get_variable("params", "embedding"))
                return None
            if method == "__call__":
                return lookup(mod, args[0], shard, dim)
            if method == "attend":
                q, table = mod.promote_dtype(gather_sequence(args[0], dim), mod.embedding, dtype=mod.dtype)
                return shard.mask(jnp.dot(q, table.T))
            return next_fun(*args, **kwargs)
        if isinstance(mod, nn.Dense) and layout.tp == COLWISE and name == "kernel":
            if method != "__call__":
                return next_fun(*args, **kwargs)
            return shard.mask(dense(mod, gather_sequence(args[0], dim))[0])
        raise ConfigError(f"root layer {'/'.join(mod.path)} ({type(mod).__name__}) is {layout.tp}: only an nn.Embed "
                          "named rowwise (its rows, the vocabulary) or an nn.Dense head named colwise can be "
                          "vocabulary-parallel")
    return intercept


def setup(plan, root_layouts, sequence_dim: int):
    """Sets `plan.vocab_shard` (the VocabShard, or None: the root is replicated over `tensor`) and its root
    interceptor."""
    modules, plan.vocab_shard = root_modules(root_layouts)
    plan.root_intercept = root_interceptor(modules, plan.vocab_shard, sequence_dim) if plan.vocab_shard else None


def scope(plan):
    """The context the root's methods run in: the root interceptor when the root is vocabulary-parallel."""
    intercept = getattr(plan, "root_intercept", None)
    return nn.intercept_methods(intercept) if intercept else contextlib.nullcontext()


def embed(plan, root, inputs):
    """The root's embedding method on `inputs` with the root's parameters `root`: with a vocabulary-parallel
    root, the lookup in this rank's share of the table (the root interceptor)."""
    with scope(plan):
        return plan.model.root.apply({"params": root}, inputs, method=plan.model.embed_method)


def gather_features(plan, outputs):
    """The head method's outputs. A fused loss's (hidden states..., weight): with a vocabulary-parallel
    root the hidden states of the TP group's whole sequence (the logits of a plain head come whole on
    the sequence from its projection, whose input the root interceptor gathers)."""
    if getattr(plan, "vocab_shard", None) and isinstance(outputs, Mapping):   # e.g. {'out': ..., 'moe_stats': ...}
        return {k: gather_features(plan, v) for k, v in outputs.items()}
    if not getattr(plan, "vocab_shard", None) or not isinstance(outputs, (tuple, list)):
        return outputs
    *hidden, weight = outputs
    return (*(gather_sequence(x, plan.tensor_plan.sequence_dim) for x in hidden), weight)


def loss(plan, loss_fn, outputs, batch):
    """loss_fn(outputs, batch); with a vocabulary-parallel root, on the whole sequence's batch under
    `loss_parallel` (ConfigError for a loss_fn that does not say it reduces over the vocabulary's shares)."""
    shard = getattr(plan, "vocab_shard", None)
    if shard is None:
        return loss_fn(outputs, batch)
    if not getattr(loss_fn, "vocab_parallel", False):
        raise ConfigError("with a vocabulary-parallel root the head's outputs hold 1/T of the vocabulary: the loss must "
                          "reduce over `tensor` (jfsdp.lm_loss, jfsdp.logits_loss; a loss_fn with .vocab_parallel = True)")
    batch = jax.tree.map(lambda x: gather_sequence(x, plan.tensor_plan.sequence_dim), batch)
    with loss_parallel(shard):
        return loss_fn(outputs, batch)


def out_spec(plan):
    """The outputs' PartitionSpecs for `apply`. At T > 1 a leaf of 3 or more dimensions is a per-token
    output: a vocabulary-parallel head's logits are (rows, the whole sequence (split over `context` at C > 1),
    the vocabulary split over `tensor`), other heads' (rows, the sequence split over `tensor`). A leaf of fewer dimensions holds
    per-row values that every tensor rank has (an MoE model's router statistics): its rows alone are split."""
    if getattr(plan, "tensor", 1) == 1:
        return plan.batch_spec
    seq = CONTEXT_AXIS if getattr(plan, "context", 1) > 1 else None   # the TP group's sequence: its context rank's
    token = P(AXES, seq, TENSOR_AXIS) if getattr(plan, "vocab_shard", None) else plan.batch_spec
    return jax.tree.map(lambda a: token if len(a.shape) >= 3 else P(AXES), head_shapes(plan))


def head_shapes(plan):
    """The head method's outputs as ShapeDtypeStructs (the whole model's shapes, traced, nothing computed)."""
    m, root_l = plan.model, plan.split(plan.layouts)[0]
    full = jax.tree.map(lambda l: jax.ShapeDtypeStruct(l.full_shape, l.dtype), root_l, is_leaf=is_layout)
    return jax.eval_shape(lambda p, h: m.root.apply({"params": p}, h, method=m.head_method), full, plan.h_shapes[-1])


def unpad(plan, outputs):
    """`apply`'s outputs without the padded vocabulary columns of the last share (in its per-token leaves)."""
    shard = getattr(plan, "vocab_shard", None)
    if shard is None or shard.local * shard.tensor == shard.vocab:
        return outputs
    return jax.tree.map(lambda x: x[..., :shard.vocab] if x.ndim >= 3 else x, outputs)
