"""The token corpus of a run: real text, offline and deterministic, read and split once.

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

The batches cut from it are jfsdp.io.data's.
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
STDLIB_BYTES = 4 << 20          # 4 MiB of the standard library: plenty for the default model, and quick to read
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
