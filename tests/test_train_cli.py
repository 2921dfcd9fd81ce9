"""train.py as users run it: a subprocess with its own environment (it fakes its own CPU devices)."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
TINY = ["--mesh", "2x4", "--model", "llama-test", "--batch-size", "8", "--seq-len", "32"]


def _env():
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)          # conftest's 16 devices are for in-process tests
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONUNBUFFERED"] = "1"
    return env


def run_train(*args, timeout=300):
    return subprocess.run([sys.executable, str(REPO / "train.py"), *args], capture_output=True, text=True,
                          env=_env(), timeout=timeout, cwd=REPO)


def test_tiny_run_end_to_end(tmp_path):
    metrics = tmp_path / "run" / "metrics.jsonl"
    r = run_train(*TINY, "--steps", "16", "--log-every", "4", "--eval-every", "8", "--lr", "3e-3",
                  "--warmup", "4", "--gen-tokens", "8", "--metrics-out", str(metrics))
    assert r.returncode == 0, r.stderr
    assert "faking 8 CPU devices" in r.stderr and "Traceback" not in r.stderr
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    train = [x for x in records if "loss" in x]
    val = [x for x in records if "val_loss" in x]
    assert [x["step"] for x in train] == [4, 8, 12, 16]
    assert [x["step"] for x in val] == [0, 8, 16]
    for x in train:
        assert {"step", "loss", "lr", "tokens_per_sec", "grad_norm"} <= x.keys()
        assert x["tokens_per_sec"] > 0 and x["mfu"] is None   # no peak FLOP/s on CPU
    assert train[-1]["loss"] < train[0]["loss"]
    assert val[-1]["val_loss"] < 0.9 * val[0]["val_loss"]
    assert (tmp_path / "run" / "metrics.png").stat().st_size > 1000
    assert "summary" in r.stdout and "MFU n/a on CPU" in r.stdout and "== sample" in r.stdout


BAD = {
    "mesh-missing-size": (["--mesh", "2x"], "mesh"),
    "mesh-zero": (["--mesh", "0x8"], "mesh"),
    "mesh-letters": (["--mesh", "axb"], "mesh"),
    "batch-not-divisible": (["--mesh", "2x4", "--batch-size", "12"], "does not divide"),
    "unknown-model": (["--model", "llama-nope"], "unknown model"),
    "not-a-language-model": (["--model", "resmlp-test"], "not a language model"),
    "unknown-strategy": (["--strategy", "zero9"], "unknown strategy"),
    "missing-data": (["--data", "/nonexistent/corpus.txt"], "does not exist"),
    "zero-steps": (["--steps", "0"], "--steps must be positive"),
    "negative-steps": (["--steps", "-3"], "--steps must be positive"),
    "steps-not-a-number": (["--steps", "ten"], "invalid int"),
    "resume-without-ckpt-dir": (["--resume"], "--resume needs --ckpt-dir"),
}


def _assert_one_line_error(r, expect):
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and expect in errors[0], r.stderr
    assert len(r.stderr.strip().splitlines()) <= 2   # the error, and at most the fake-devices notice


@pytest.mark.parametrize("name", BAD)
def test_bad_input(name):
    args, expect = BAD[name]
    _assert_one_line_error(run_train(*args, "--metrics-out", ""), expect)


@pytest.mark.parametrize("name", ["empty", "beyond-vocab"])
def test_bad_data_file(tmp_path, name):
    if name == "empty":
        p, expect = tmp_path / "empty.txt", "is empty"
        p.write_text("")
    else:
        p, expect = tmp_path / "tokens.npy", "token 1000 is outside the model's vocabulary of 259"
        np.save(p, np.arange(1001, dtype=np.uint32))
    _assert_one_line_error(run_train(*TINY, "--data", str(p), "--metrics-out", ""), expect)


def test_nan_loss_is_an_error(tmp_path):
    # an absurd learning rate blows the weights up within a few steps
    r = run_train(*TINY, "--steps", "6", "--log-every", "3", "--lr", "1e30", "--warmup", "0", "--clip", "0",
                  "--metrics-out", "")
    _assert_one_line_error(r, "training diverged")


def test_ctrl_c_stops_cleanly(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    p = subprocess.Popen([sys.executable, str(REPO / "train.py"), *TINY, "--steps", "100000", "--log-every", "1",
                          "--metrics-out", str(metrics)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, env=_env(), cwd=REPO)
    try:
        deadline = time.time() + 120
        while time.time() < deadline and p.poll() is None:   # wait until training steps are running
            if metrics.exists() and '"loss"' in metrics.read_text():
                break
            time.sleep(0.2)
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 130, err
    assert "interrupted at step" in err and "Traceback" not in err
    assert "summary" in out and metrics.exists()


def test_help_documents_every_flag():
    r = run_train("--help")
    assert r.returncode == 0
    for flag in ("--mesh", "--strategy", "--model", "--precision", "--remat", "--steps", "--batch-size",
                 "--seq-len", "--grad-accum", "--lr", "--warmup", "--clip", "--seed", "--data", "--eval-every",
                 "--metrics-out", "--ckpt-dir", "--save-every", "--resume", "--profile", "--cpu-devices"):
        assert flag in r.stdout, flag
