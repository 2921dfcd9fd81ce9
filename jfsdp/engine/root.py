"""The root around the stages of a `Stacked`/`Staged` model (`RootPasses`, which `FSDP`, sharded.py, extends):
which root leaves the embedding and the head read, where each is gathered, and the sharded forward pass
that runs the embedding, the stages (`FSDP.run_stage`) and the head inside `shard_map`."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jfsdp.engine import column_embed
from jfsdp.engine.fsdp import any_unreduced, unshard
from jfsdp.engine.layout import is_layout
from jfsdp.engine.parallel import vocab
from jfsdp.engine.barriers import after


class RootPasses:
    """The root's part of the sharded forward pass; the rest of the engine (the stages, `run_stage`) is
    `FSDP`'s."""

    @functools.cached_property
    def root_use(self) -> tuple:
        """(indices of the root's leaves that `embed` reads, those that `head` reads), in the order
        of jax.tree.leaves(root layouts); read from the traced methods."""
        m = self.model
        layouts, treedef = jax.tree.flatten(self.split(self.layouts)[0], is_leaf=is_layout)
        abstract = [jax.ShapeDtypeStruct(l.full_shape, l.dtype) for l in layouts]

        def reads(method, arg):
            f = lambda leaves, a: m.root.apply({"params": jax.tree.unflatten(treedef, leaves)}, a, method=method)
            jaxpr = jax.make_jaxpr(f)(abstract, arg).jaxpr
            refs = {id(v) for e in jaxpr.eqns for v in e.invars} | {id(v) for v in jaxpr.outvars}
            return frozenset(i for i, v in enumerate(jaxpr.invars[:len(layouts)]) if id(v) in refs)
        return reads(m.embed_method, self.example_inputs), reads(m.head_method, self.h_shapes[-1])

    @functools.cached_property
    def embed_tables(self) -> frozenset:
        """Indices of the root's leaves that the embedding method looks up as an `nn.Embed` table laid out for a
        lookup by columns (column_embed.eligible), read from one abstract trace."""
        m = self.model
        layouts, treedef = jax.tree.flatten(self.split(self.layouts)[0], is_leaf=is_layout)
        found = set()

        def f(leaves, a):
            with column_embed.recording({id(x): i for i, x in enumerate(leaves)}, found):
                return m.root.apply({"params": jax.tree.unflatten(treedef, leaves)}, a, method=m.embed_method)
        jax.eval_shape(f, [jax.ShapeDtypeStruct(l.full_shape, l.dtype) for l in layouts], self.example_inputs)
        return frozenset(i for i in found if column_embed.eligible(layouts[i]))

    def root_tree(self, shards, reads, gathered=None):
        """The root's parameter tree for a method that reads the leaves `reads` (indices into the flat
        root shards): those gathered (once, when `gathered` caches them across methods), the others
        placeholders that XLA drops."""
        layouts, treedef = jax.tree.flatten(self.split(self.layouts)[0], is_leaf=is_layout)
        gathered = {} if gathered is None else gathered
        for i in sorted(reads - set(gathered)):
            gathered[i] = unshard(shards[i], layouts[i], self.comm)
        return jax.tree.unflatten(treedef, [gathered[i] if i in reads else
                                            jnp.zeros(l.shape, self.comm.param_dtype or l.dtype)
                                            for i, l in enumerate(layouts)])

    def forward(self, params, inputs):
        """The model's outputs for one device's inputs, from shards (inside shard_map)."""
        # The root is gathered where it is used: a leaf only the embedding reads (an untied table) when
        # the step starts, for the lookup alone (its backward needs no weights; on the prefetch pipeline
        # inside the first stage, whose backward reduces its gradient under unit 0's); a leaf only the head
        # reads while the last unit computes (the pipeline ties it there; else once h exists, never
        # hoisted to the start of the step), kept for the head's backward. A leaf both read (a tied
        # embedding) is gathered once for both uses, as FSDP does with a shared parameter, and kept
        # to the head's backward, with one gradient reduced for it.
        (root_l, stage_l), (root_p, stage_p) = self.split(self.layouts), self.split(params)
        shards = jax.tree.structure(root_l, is_leaf=is_layout).flatten_up_to(root_p)
        (embed_reads, head_reads), gathered = self.root_use, {}
        root = lambda reads: self.root_tree(shards, reads, gathered)
        lead = self.embed_lead(shards, stage_p[0])
        h = inputs if lead else vocab.embed(self, root(embed_reads), inputs)
        late = sorted(head_reads - set(gathered))
        held, last = [shards[i] for i in late], len(stage_p) - 1
        for j, (shards_j, layouts_j) in enumerate(zip(stage_p, stage_l)):
            ahead = held if late and j == last and self.prefetches(j) else None
            h, ahead = self.run_stage(j, h, shards_j, layouts_j, ahead, lead if j == 0 else None)
        if late:
            h, held = (h, ahead) if ahead is not None else after(h, held)
            shards = [dict(zip(late, held)).get(i, x) for i, x in enumerate(shards)]
        return self.head(root(head_reads), h)

    @property
    def untied_lead(self) -> bool:
        """Whether the embedding can be the first stage's lead (`embed_lead`): only it reads its leaves (untied)
        and the first stage runs the prefetch pipeline."""
        embed_reads, head_reads = self.root_use
        return not embed_reads & head_reads and self.prefetches(0)

    def embed_lead(self, shards, first_stage):
        """The embedding as the first stage's lead (its gather and lookup run inside the prefetch pipeline, its
        backward under unit 0's weight gradients: pipeline.pipelined_stage): (function, the leaves it reads)
        where only the embedding reads them (untied) and the first stage runs the pipeline; else None."""
        embed_reads = self.root_use[0]
        if not self.untied_lead or any_unreduced(first_stage) or any_unreduced(shards):
            return None
        reads, tables = sorted(embed_reads), sorted(embed_reads & self.embed_tables)
        layouts = jax.tree.leaves(self.split(self.layouts)[0], is_leaf=is_layout)

        def embed(leaves, inputs):   # an nn.Embed table passed as its shard: looked up by columns (column_embed.py)
            placed = dict(zip(reads, leaves))
            now = [placed.get(i, x) for i, x in enumerate(shards)]
            with column_embed.linen_scope({id(now[i]): (layouts[i], self.comm) for i in tables}):
                return vocab.embed(self, self.root_tree(now, embed_reads, {i: now[i] for i in tables}), inputs)
        return embed, [shards[i] for i in reads]

    def column_lookups(self, grad_sync: str = "every") -> list:
        """The layouts of the root leaves whose lookup runs by columns where the tokens allow it
        (column_embed.applies): the untied `nn.Embed` tables of the first stage's lead (`embed_lead`)."""
        if not self.untied_lead or grad_sync == "once":   # (grad_sync 'once': the first stage's shards unreduced)
            return []
        layouts = jax.tree.leaves(self.split(self.layouts)[0], is_leaf=is_layout)
        return [layouts[i] for i in sorted(self.root_use[0] & self.embed_tables)]

    def head(self, root, h):
        """The root's head method on h, its outputs cast by the precision policy (`cast_output`)."""
        with vocab.scope(self):   # vocabulary-parallel: the projection on the whole sequence (parallel/vocab.py)
            h = vocab.gather_features(self, self.model.root.apply({"params": root}, h, method=self.model.head_method))
        return self.mp.cast_output(h)
