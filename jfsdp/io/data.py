"""Token data for training: real, offline, deterministic and seekable.

Sources (`load_tokens`):
  - None / "stdlib": the default corpus that every machine already has: the running interpreter's
    standard-library `.py` files, sorted by path, up to a fixed number of bytes (so reading is fast and
    the corpus is the same on every run of the same Python).
  - a text file, or a folder of text files (read recursively, sorted by path, hidden files skipped);
  - JSON lines (`.jsonl`), one object per line with a string field `text`;
  - a pre-tokenized token array: nanoGPT-style `.bin` (raw uint16 unless told otherwise) or `.npy`
    (dtype from its header). These are memory-mapped, never read whole.

Text is byte-level: token = byte value 0..255, and the three ids above the bytes are specials
(BOS 256, EOS 257, PAD 258; vocabulary 259). EOS ends every document; PAD only fills the unused
tail of the generation buffer; BOS is reserved. With a `tokenizer` (a Hugging Face `tokenizer.json`,
read with the `tokenizers` library) text is tokenized with it instead, each document followed by the
tokenizer's end-of-text token if it has one (`</s>`, `<|endoftext|>`, `<|end_of_text|>`, `<eos>`).

Validation split: with at least 1/val_fraction documents, every k-th document is held out (so the
validation text is spread over the corpus rather than being its alphabetical tail); otherwise
(a single text file, a token array) the last val_fraction of the token stream is.

Batches: the training stream is cut into non-overlapping windows of seq_len + 1 tokens; each epoch
visits them in a permutation drawn from (seed, epoch). Global sample g = step * batch_size + row, so
`batch(step)` is a pure function of the step: the loader's whole state is `{"step": n}`, which a
checkpoint can save and `restore` can seek back to. A process reads only the rows its devices hold
(`process_rows`), so on many hosts nobody reads the whole batch.
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys
import sysconfig
from pathlib import Path

import numpy as np

from jfsdp.config.errors import ConfigError

BOS, EOS, PAD = 256, 257, 258
BYTE_VOCAB = 259
DEFAULT_CORPUS = "stdlib"
STDLIB_BYTES = 4 << 20          # 4 MiB of the standard library: plenty for the default model, read in ~0.1 s
_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "__pycache__", "idle_test"}
_TOKEN_SUFFIXES = {".bin", ".npy"}


@dataclasses.dataclass(frozen=True)
class Corpus:
    """Token streams of the two splits, and what they are."""
    train: np.ndarray          # 1-D integer array (may be a read-only memmap)
    val: np.ndarray
    name: str
    is_bytes: bool             # byte-level text (decodable) or pre-tokenized ids
    n_docs: int
    tokenizer: object = None   # a tokenizers.Tokenizer that made (and decodes) the ids, if any
    eos: int | None = EOS      # the id that ends a document, if any
    tokenizer_name: str = ""

    @property
    def can_decode(self) -> bool:
        return self.is_bytes or self.tokenizer is not None

    def encode(self, text: str) -> np.ndarray:
        if self.tokenizer is not None:
            return np.asarray(self.tokenizer.encode(text).ids, np.int32)
        return encode(text)

    def decode(self, tokens) -> str:
        if self.tokenizer is not None:
            return self.tokenizer.decode([int(t) for t in tokens])
        return decode(tokens)

    def describe(self) -> str:
        kind = ("byte-level text" if self.is_bytes else
                f"text tokenized with {self.tokenizer_name}" if self.tokenizer is not None else "pre-tokenized")
        return (f"{self.name}: {kind}, {self.n_docs} document(s), "
                f"{len(self.train):,} train / {len(self.val):,} val tokens")


# ---- reading sources -----------------------------------------------------------------------------

def _bytes_doc(data: bytes) -> np.ndarray:
    return np.append(np.frombuffer(data, np.uint8).astype(np.uint16), np.uint16(EOS))


def stdlib_files(limit_bytes: int = STDLIB_BYTES) -> list[Path]:
    """The first `limit_bytes` of the standard library's .py files, in sorted path order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS]   # prune: the test suite alone is huge
        found += [Path(dirpath, f) for f in filenames if f.endswith(".py")]
    files = sorted(found, key=lambda p: p.relative_to(root).as_posix())
    chosen, total = [], 0
    for p in files:
        if total >= limit_bytes:
            break
        size = p.stat().st_size
        if size:
            chosen.append(p)
            total += size
    if not chosen:
        raise ConfigError(f"no .py files found in the standard library at {root}; pass --data")
    return chosen


def _jsonl_docs(path: Path) -> list[np.ndarray]:
    docs = []
    with open(path, "rb") as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError:
                raise ConfigError(f"{path} line {i}: not valid JSON") from None
            if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
                raise ConfigError(f"{path} line {i}: expected an object with a string field 'text'")
            if obj["text"]:
                docs.append(_bytes_doc(obj["text"].encode("utf-8")))
    return docs


def _text_docs(path: Path) -> list[np.ndarray]:
    if path.suffix in _TOKEN_SUFFIXES:
        raise ConfigError(f"{path}: token files (.bin, .npy) go alone in --data, not inside a folder")
    if path.suffix == ".jsonl":
        return _jsonl_docs(path)
    data = path.read_bytes()
    return [_bytes_doc(data)] if data else []


def _token_file(path: Path, dtype: str | None) -> np.ndarray:
    if path.stat().st_size == 0:
        raise ConfigError(f"data file {path} is empty")
    if path.suffix == ".npy":
        try:
            arr = np.load(path, mmap_mode="r")
        except ValueError as e:
            raise ConfigError(f"{path}: not a readable .npy array ({e})") from None
        if not np.issubdtype(arr.dtype, np.integer):
            raise ConfigError(f"{path}: token array has dtype {arr.dtype}; expected unsigned integers")
        return arr.reshape(-1)
    dt = np.dtype(dtype or "uint16")   # nanoGPT writes uint16
    size = path.stat().st_size
    if size % dt.itemsize:
        raise ConfigError(f"{path}: {size} bytes is not a whole number of {dt} tokens (see --data-dtype)")
    return np.memmap(path, dtype=dt, mode="r")


def _split_docs(docs: list[np.ndarray], val_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    every = max(2, round(1 / val_fraction))
    if len(docs) >= every:
        # hold out the middle document of every group of `every`
        val = [d for i, d in enumerate(docs) if i % every == every // 2]
        train = [d for i, d in enumerate(docs) if i % every != every // 2]
        return np.concatenate(train), np.concatenate(val)
    return _split_tail(np.concatenate(docs), val_fraction)


def _split_tail(tokens: np.ndarray, val_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    n_val = max(1, int(len(tokens) * val_fraction))
    return tokens[:-n_val], tokens[-n_val:]


_EOS_NAMES = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>")


def load_tokenizer(path: str):
    """A `tokenizers.Tokenizer` from a tokenizer.json, and its end-of-text id (or None)."""
    from tokenizers import Tokenizer
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as e:   # the Rust side raises plain Exceptions for bad files
        raise ConfigError(f"{path}: not a readable tokenizer.json ({str(e).splitlines()[0][:200]})") from None
    eos = next((tok.token_to_id(n) for n in _EOS_NAMES if tok.token_to_id(n) is not None), None)
    return tok, eos


def _tokenize_docs(docs: list[np.ndarray], tok, eos: int | None) -> list[np.ndarray]:
    """Byte docs (each ending in the byte-level EOS) -> token-id docs, each ending in `eos` if any."""
    texts = [d[:-1].astype(np.uint8).tobytes().decode("utf-8", errors="replace") for d in docs]
    ids = [e.ids for e in tok.encode_batch(texts)]
    return [np.asarray(i + ([eos] if eos is not None else []), np.uint32) for i in ids if i]


def load_tokens(path: str | None, vocab_size: int, *, val_fraction: float = 0.05,
                dtype: str | None = None, tokenizer: str | None = None) -> Corpus:
    """Read a source (see the module docstring) and split it; every token must be < vocab_size.
    `tokenizer`: a tokenizer.json that tokenizes text sources instead of bytes."""
    if path in (None, "", DEFAULT_CORPUS):
        files = stdlib_files()
        docs = [_bytes_doc(p.read_bytes()) for p in files]
        name = f"Python {sys.version.split()[0]} standard library ({len(files)} files)"
        is_bytes = True
    else:
        p = Path(path)
        if not p.exists():
            raise ConfigError(f"data path {path} does not exist")
        is_bytes = not (p.is_file() and p.suffix in _TOKEN_SUFFIXES)
        name = str(p)
        if not is_bytes:
            tokens = _token_file(p, dtype)
            lo, hi = int(tokens.min()), int(tokens.max())
            if lo < 0 or hi >= vocab_size:
                bad = hi if hi >= vocab_size else lo
                raise ConfigError(f"{path}: token {bad} is outside the model's vocabulary of {vocab_size} "
                                  f"(max token {hi}); use a model with a larger vocab_size")
            train, val = _split_tail(tokens, val_fraction)
            return Corpus(train, val, name, False, 1, eos=None)
        if p.is_dir():
            files = sorted((f for f in p.rglob("*") if f.is_file()
                            and not any(part.startswith(".") for part in f.relative_to(p).parts)),
                           key=lambda f: f.relative_to(p).as_posix())
            docs = [d for f in files for d in _text_docs(f)]
            if not docs:
                raise ConfigError(f"data folder {path} holds no text")
        else:
            docs = _text_docs(p)
            if not docs:
                raise ConfigError(f"data file {path} is empty" + (" (no non-empty 'text')" if p.suffix == ".jsonl" else ""))
    if tokenizer is not None:
        tok, eos = load_tokenizer(tokenizer)
        docs = _tokenize_docs(docs, tok, eos)
        if not docs:
            raise ConfigError(f"data {path} gives no tokens with {tokenizer}")
        hi = max(int(d.max()) for d in docs)
        if hi >= vocab_size:
            raise ConfigError(f"{tokenizer} gives token {hi}, outside the model's vocabulary of {vocab_size}")
        train, val = _split_docs(docs, val_fraction)
        return Corpus(train, val, name, False, len(docs), tokenizer=tok, eos=eos, tokenizer_name=str(tokenizer))
    if vocab_size < BYTE_VOCAB - 1:   # bytes + EOS
        raise ConfigError(f"byte-level text needs a vocabulary of at least {BYTE_VOCAB - 1} "
                          f"(256 bytes + EOS); the model has {vocab_size}")
    train, val = _split_docs(docs, val_fraction)
    return Corpus(train, val, name, True, len(docs))


# ---- batches -------------------------------------------------------------------------------------

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
    position a checkpoint saves. `rows=(start, stop)` restricts reading to this process's rows."""

    def __init__(self, corpus: Corpus, batch_size: int, seq_len: int, seed: int = 0, rows=None):
        self.corpus, self.batch_size, self.seq_len, self.seed = corpus, batch_size, seq_len, seed
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
        return {"inputs": chunk[:, :-1], "targets": chunk[:, 1:]}

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


def decode(tokens) -> str:
    """Byte tokens -> text; specials are shown as nothing (EOS as a newline)."""
    out = bytearray()
    for t in tokens:
        t = int(t)
        if t < 256:
            out.append(t)
        elif t == EOS:
            out += b"\n"
    return out.decode("utf-8", errors="replace")


def encode(text: str) -> np.ndarray:
    return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32)
