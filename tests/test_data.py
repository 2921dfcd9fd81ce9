"""The data loader: every format, deterministic and seekable batches, a disjoint validation split,
clear errors for bad data."""
import json
import sysconfig
from pathlib import Path

import numpy as np
import pytest

from jfsdp import ConfigError

from jfsdp.io import corpus, data

V = data.BYTE_VOCAB


def _text_corpus(tmp_path, n=2000):
    p = tmp_path / "a.txt"
    p.write_bytes(bytes(np.random.default_rng(0).integers(32, 127, n, dtype=np.uint8)))
    return data.load_tokens(str(p), V)


def test_default_corpus_is_stdlib_bytes():
    """The default corpus is the standard library's first .py files in sorted path order, up to the
    first past STDLIB_BYTES, outside its test folders: exactly their bytes, an EOS after each."""
    files = data.stdlib_files()
    root = Path(sysconfig.get_paths()["stdlib"])
    rel = [p.relative_to(root).as_posix() for p in files]
    assert rel == sorted(rel) and all(r.endswith(".py") for r in rel)
    assert not any(part in ("test", "tests", "site-packages") for r in rel for part in r.split("/")[:-1])
    sizes = [p.stat().st_size for p in files]
    assert all(sizes) and sum(sizes[:-1]) < corpus.STDLIB_BYTES <= sum(sizes)
    # none skipped: every non-empty top-level module that sorts before the last chosen file is chosen
    assert {p for p in root.glob("*.py") if p.name < rel[-1] and p.stat().st_size} <= set(files)
    c = data.load_tokens(None, V)
    assert c.is_bytes and c.n_docs == len(files) and len(c.train) > 1_000_000
    tokens = np.concatenate([c.train, c.val])
    assert len(tokens) == sum(sizes) + len(files)                    # the files' bytes and one EOS each
    want = np.frombuffer(files[0].read_bytes(), np.uint8)
    np.testing.assert_array_equal(tokens[:len(want)], want)           # the first file first, byte for byte
    assert tokens[len(want)] == data.EOS and int(c.train.max()) <= data.EOS and data.EOS in c.val


def test_same_seed_same_batches_and_other_seed_differs(tmp_path):
    c = _text_corpus(tmp_path)
    a, b, other = (data.Loader(c, 4, 16, seed=s) for s in (0, 0, 1))
    for _ in range(5):
        x, y = next(a), next(b)
        np.testing.assert_array_equal(x["inputs"], y["inputs"])
    assert not np.array_equal(a.batch(3)["inputs"], other.batch(3)["inputs"])


def test_targets_are_inputs_shifted_by_one(tmp_path):
    b = data.Loader(_text_corpus(tmp_path), 4, 16).batch(0)
    assert b["inputs"].dtype == np.int32 and b["inputs"].shape == (4, 16)
    np.testing.assert_array_equal(b["inputs"][:, 1:], b["targets"][:, :-1])


def test_seek_resume_gives_the_same_batches(tmp_path):
    c = _text_corpus(tmp_path)
    a = data.Loader(c, 4, 16, seed=3)
    for _ in range(40):   # past an epoch boundary: the corpus has ~110 windows, 4 per step
        next(a)
    saved = json.loads(json.dumps(a.state()))   # the state is small and serializable
    b = data.Loader(c, 4, 16, seed=3)
    b.restore(saved)
    for _ in range(3):
        np.testing.assert_array_equal(next(a)["inputs"], next(b)["inputs"])
    with pytest.raises(ConfigError, match="seed"):
        data.Loader(c, 4, 16, seed=4).restore(saved)


def test_each_epoch_visits_every_window_once(tmp_path):
    c = _text_corpus(tmp_path)
    ld = data.Loader(c, 1, 16)
    firsts = {tuple(ld.batch(i)["inputs"][0]) for i in range(ld.n_windows)}
    assert len(firsts) == ld.n_windows


def test_process_rows_read_only_their_part(tmp_path):
    c = _text_corpus(tmp_path)
    full = data.Loader(c, 8, 16, seed=1).batch(5)
    part = data.Loader(c, 8, 16, seed=1, rows=(2, 6)).batch(5)
    np.testing.assert_array_equal(part["inputs"], full["inputs"][2:6])
    val_full = data.Loader(c, 8, 16).val_batches(2)
    val_part = data.Loader(c, 8, 16, rows=(2, 6)).val_batches(2)
    np.testing.assert_array_equal(val_part[1]["targets"], val_full[1]["targets"][2:6])


def test_process_rows_from_the_batch_sharding():
    import jax
    import jfsdp
    plan_sharding = jax.sharding.NamedSharding(jfsdp.make_mesh("2x8"),
                                               jax.sharding.PartitionSpec(jfsdp.AXES))
    assert data.process_rows(plan_sharding, 32, 8) == (0, 32)   # one process holds every row
    g = data.to_global(data.Loader(data.load_tokens(None, V), 32, 8).batch(0), plan_sharding, 32)
    assert g["inputs"].shape == (32, 8) and len(g["inputs"].sharding.device_set) == 16


def test_val_split_of_documents_is_disjoint(tmp_path):
    folder = tmp_path / "docs"
    folder.mkdir()
    for i in range(40):
        (folder / f"{i:02d}.txt").write_text(f"document number {i:02d} " * 3)
    c = data.load_tokens(str(folder), V)
    train, val = data.decode(c.train), data.decode(c.val)
    held = [i for i in range(40) if f"number {i:02d}" in val]
    assert len(held) == 2   # 5%: every 20th document
    assert not any(f"number {i:02d}" in train for i in held)
    assert len(c.train) + len(c.val) == sum(len(f"document number {i:02d} " * 3) + 1 for i in range(40))


def test_val_split_of_one_file_is_its_tail(tmp_path):
    p = tmp_path / "one.txt"
    text = bytes(np.random.default_rng(0).integers(0, 256, 3000, dtype=np.uint8))
    p.write_bytes(text)
    c = data.load_tokens(str(p), V)
    both = np.concatenate([c.train, c.val])
    np.testing.assert_array_equal(both[:-1], np.frombuffer(text, np.uint8))
    assert both[-1] == data.EOS and len(c.val) == int(3001 * 0.05)


def test_jsonl(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text("\n".join(json.dumps({"text": f"line {i} é", "id": i}) for i in range(5)) + "\n\n")
    c = data.load_tokens(str(p), V)
    assert c.n_docs == 5 and "line 0 é" in data.decode(np.concatenate([c.train, c.val]))
    p.write_text('{"text": "ok"}\n{"body": "no text"}\n')
    with pytest.raises(ConfigError, match="line 2"):
        data.load_tokens(str(p), V)


def test_bin_uint16_and_uint32(tmp_path):
    tokens = np.arange(5000) % 1000
    p = tmp_path / "train.bin"
    tokens.astype(np.uint16).tofile(p)
    c = data.load_tokens(str(p), 1024)
    assert not c.is_bytes and isinstance(c.train, np.memmap)
    np.testing.assert_array_equal(np.concatenate([c.train, c.val]), tokens)
    tokens.astype(np.uint32).tofile(p)
    c = data.load_tokens(str(p), 1024, dtype="uint32")
    np.testing.assert_array_equal(np.concatenate([c.train, c.val]), tokens)
    b = data.Loader(c, 2, 8).batch(0)
    assert b["inputs"].dtype == np.int32 and b["inputs"].max() < 1000


def test_npy_uint32(tmp_path):
    p = tmp_path / "tok.npy"
    np.save(p, (np.arange(4000) * 7 % 70000).astype(np.uint32))
    c = data.load_tokens(str(p), 70000)
    assert c.train.dtype == np.uint32 and len(c.train) + len(c.val) == 4000


def test_tokens_beyond_the_vocabulary(tmp_path):
    p = tmp_path / "tok.npy"
    np.save(p, np.array([1, 2, 300, 4], np.uint32))
    with pytest.raises(ConfigError, match=r"token 300 .*vocabulary of 259"):
        data.load_tokens(str(p), V)


@pytest.mark.parametrize("name", ["empty.txt", "empty.jsonl", "empty.bin", "empty.npy"])
def test_empty_file(tmp_path, name):
    p = tmp_path / name
    p.write_bytes(b"")
    with pytest.raises(ConfigError, match="empty"):
        data.load_tokens(str(p), V)


def test_missing_path_and_empty_folder(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        data.load_tokens(str(tmp_path / "nope.txt"), V)
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / ".hidden").write_text("skipped")
    with pytest.raises(ConfigError, match="holds no text"):
        data.load_tokens(str(tmp_path / "d"), V)


def test_too_short_for_a_sequence(tmp_path):
    p = tmp_path / "short.txt"
    p.write_text("x" * 100)
    with pytest.raises(ConfigError, match="seq-len"):
        data.Loader(data.load_tokens(str(p), V), 2, 64)
