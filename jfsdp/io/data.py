"""Token data for training: real, offline, deterministic and seekable.

The corpus (sources, byte-level text or a tokenizer, the validation split) is read by
jfsdp.io.corpus, whose names are re-exported here so that `jfsdp.io.data` is the one import a
training loop needs. This module cuts batches from it.

Batches: the training stream is cut into non-overlapping windows of seq_len + 1 tokens; each epoch
visits them in a permutation drawn from (seed, epoch). Global sample g = step * batch_size + row, so
`batch(step)` is a pure function of the step: the loader's whole state is `{"step": n}`, which a
checkpoint can save and `restore` can seek back to. A process reads only the rows its devices hold
(`process_rows`), so on many hosts nobody reads the whole batch.
"""
from __future__ import annotations

import numpy as np

from jfsdp.config.errors import ConfigError
from jfsdp.config.sequence import zigzag
from jfsdp.io.corpus import (BOS, BYTE_VOCAB, DEFAULT_CORPUS, EOS, PAD, STDLIB_BYTES, Corpus, decode, encode,
                             load_tokenizer, load_tokens, stdlib_files)

__all__ = ["BOS", "BYTE_VOCAB", "DEFAULT_CORPUS", "EOS", "PAD", "STDLIB_BYTES", "Corpus", "decode", "encode",
           "load_tokenizer", "load_tokens", "stdlib_files", "process_rows", "Loader", "to_global"]


def process_rows(sharding, global_batch: int, seq_len: int) -> tuple[int, int]:
    """The contiguous rows [start, stop) of the global batch that this process's devices hold."""
    index = sharding.addressable_devices_indices_map((global_batch, seq_len))
    spans = sorted({(s[0].start or 0, global_batch if s[0].stop is None else s[0].stop) for s in index.values()})
    start, stop = spans[0][0], spans[-1][1]
    if sum(b - a for a, b in spans) != stop - start:
        raise ConfigError("this process's devices hold non-contiguous rows of the batch")
    return start, stop


class Loader:
    """Deterministic, seekable batches of {'inputs', 'targets'} (int32, (rows, seq_len)).

    `next()` returns the batch of the current step and advances; `state()` / `restore(state)` are the
    position a checkpoint saves. `rows=(start, stop)` restricts reading to this process's rows. With
    `context` C > 1 (context parallelism) every sequence's tokens, inputs and targets alike, come in the
    zigzag order of jfsdp/config/sequence.py, in which the context ranks hold them."""

    def __init__(self, corpus: Corpus, batch_size: int, seq_len: int, seed: int = 0, rows=None, context: int = 1):
        self.corpus, self.batch_size, self.seq_len, self.seed = corpus, batch_size, seq_len, seed
        self.context = context
        self.rows = rows or (0, batch_size)
        self.n_windows = len(corpus.train) // (seq_len + 1)
        if self.n_windows < 1:
            raise ConfigError(f"training split has {len(corpus.train)} tokens, fewer than one sequence of "
                              f"--seq-len {seq_len} + 1; use more data or a shorter --seq-len")
        if len(corpus.val) < seq_len + 1:
            raise ConfigError(f"validation split has {len(corpus.val)} tokens, fewer than one sequence of "
                              f"--seq-len {seq_len} + 1; use more data or a shorter --seq-len")
        self.step = 0
        self._perm_epoch, self._perm = -1, None

    # the position: all a checkpoint needs to resume the data exactly where it was
    def state(self) -> dict:
        return {"step": int(self.step), "seed": int(self.seed)}

    def restore(self, state: dict) -> None:
        if int(state.get("seed", self.seed)) != self.seed:
            raise ConfigError(f"data state was saved with seed {state['seed']}, not {self.seed}")
        self.step = int(state["step"])

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch != self._perm_epoch:
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.n_windows)
            self._perm_epoch = epoch
        return self._perm

    def _windows(self, tokens: np.ndarray, starts: np.ndarray) -> dict:
        chunk = np.asarray(tokens[starts[:, None] + np.arange(self.seq_len + 1)], dtype=np.int32)
        b = {"inputs": chunk[:, :-1], "targets": chunk[:, 1:]}
        return {k: zigzag(x, self.context) for k, x in b.items()} if self.context > 1 else b

    def batch(self, step: int) -> dict:
        """This process's rows of the training batch of `step` (pure: no state is read or changed)."""
        g = step * self.batch_size + np.arange(*self.rows)
        epoch, pos = np.divmod(g, self.n_windows)
        window = np.empty_like(g)
        for e in np.unique(epoch):
            window[epoch == e] = self._permutation(int(e))[pos[epoch == e]]
        return self._windows(self.corpus.train, window * (self.seq_len + 1))

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        b = self.batch(self.step)
        self.step += 1
        return b

    def epoch(self) -> float:
        return self.step * self.batch_size / self.n_windows

    def val_batches(self, n_batches: int) -> list[dict]:
        """A fixed validation set: n_batches batches of windows evenly spaced over the val split."""
        n = n_batches * self.batch_size
        starts = np.linspace(0, len(self.corpus.val) - self.seq_len - 1, n).astype(np.int64)
        a, b = self.rows
        return [self._windows(self.corpus.val, starts[i * self.batch_size + a: i * self.batch_size + b])
                for i in range(n_batches)]


def to_global(batch: dict, sharding, global_batch: int) -> dict:
    """This process's rows -> global jax arrays split over the mesh (works on one host or many)."""
    import jax
    return {k: jax.make_array_from_process_local_data(sharding, v, (global_batch, *v.shape[1:]))
            for k, v in batch.items()}
