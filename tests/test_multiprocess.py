"""More than one process: train.py on 2 processes x 4 fake CPU devices (gloo on 127.0.0.1) computes
what one process with 8 devices computes, and each fault ends the run with its cause named (a hang fails
at a timeout far above the normal run).

The reference is an independent run: the same command in one process. Every process here is a
subprocess; the test session's own 16 devices are not used."""
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jfsdp.runtime import distributed
from jfsdp.config.errors import ConfigError
from tests.compile_flags import FAST

ROOT = Path(__file__).resolve().parents[1]
RUN = ["--model", "llama-test", "--steps", "8", "--batch-size", "8", "--seq-len", "32", "--eval-every", "4",
       "--eval-iters", "1", "--log-every", "2", "--gen-tokens", "0", "--warmup", "2"]   # sampling: one test


def env():
    e = dict(os.environ)   # train.py fakes the devices itself; conftest's LLVM level compiles faster, same HLO
    e["XLA_FLAGS"] = FAST
    e["JAX_PLATFORMS"] = "cpu"
    e["PYTHONPATH"] = str(ROOT)
    return e


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def records(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def losses(recs):
    return [(r["step"], "loss" if "loss" in r else "val_loss", r.get("loss", r.get("val_loss"))) for r in recs]


_SINGLE = {}


def single(mesh, tmp_path_factory):
    """The reference: the same command in one process with 8 fake devices, on the same mesh."""
    if mesh not in _SINGLE:
        out = tmp_path_factory.mktemp("single") / "m.jsonl"
        p = subprocess.run([sys.executable, "train.py", "--mesh", mesh, *RUN, "--metrics-out", str(out)], cwd=ROOT,
                           env=env(), capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stderr[-2000:]
        _SINGLE[mesh] = records(out)
    return _SINGLE[mesh]


def launch(mesh, out, *extra):
    p = subprocess.run([sys.executable, "-m", "jfsdp.launch", "-n", "2", "train.py", "--mesh", mesh, *RUN,
                        "--metrics-out", str(out), *extra], cwd=ROOT, env=env(), capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return p


def assert_same_losses(ours, ref):
    assert [r[:2] for r in ours] == [r[:2] for r in ref]                      # no duplicated lines either
    for (step, kind, a), (_, _, b) in zip(ours, ref):
        assert abs(a - b) <= 1e-6 * abs(b), (step, kind, a, b)


def test_two_processes_equal_one_through_a_resume(tmp_path_factory, tmp_path):
    """The launcher's 2 processes on 2x4 (hybrid sharding: fsdp inside a process, data across them):
    4 steps, stop, then --resume on both processes for the rest, on 2x2 with --tensor 2 (tensor
    parallelism across processes; fp32: the losses of T = 2 and T = 1 agree to 1.8e-7 relative, measured);
    only process 0 reports, saves' lines and writes the metrics; the losses are those of one process
    running straight through on 2x4.
    (test_dead_peer_stops_the_others runs fsdp across the two processes, 1x8.)"""
    out, ckpt = tmp_path / "m.jsonl", tmp_path / "ckpt"
    p = launch("2x4", out, "--ckpt-dir", str(ckpt), "--save-every", "4", "--stop-after", "4")
    assert "fsdp axis: 4 devices per group, 2 groups, inside one process" in p.stdout, p.stdout
    assert p.stderr.count("checkpoint saved to") == 1, p.stderr                   # said once, by process 0
    # resumed under tensor parallelism: 2x2 x tensor 2, each tensor group inside a process
    p = launch("2x2", out, "--tensor", "2", "--ckpt-dir", str(ckpt), "--save-every", "4", "--resume", "--gen-tokens", "4")
    assert "tensor axis: 2 devices per group, 4 groups, inside one process" in p.stdout, p.stdout
    assert p.stderr.count("resumed from") == 1, p.stderr
    assert p.stdout.count("== summary") == 1 and p.stdout.count("== sample") == 1   # process 0 only
    # the resumed run evaluates again at its first step: drop that repeat, then compare
    seen, unique = set(), []
    for r in losses(records(out)):
        if r[:2] not in seen:
            seen.add(r[:2])
            unique.append(r)
    assert_same_losses(unique, losses(single("2x4", tmp_path_factory)))


def test_coordinator_faults_are_errors_within_the_timeout():
    """Two faults, run side by side (each mostly waits out its 3 s): process 1 finds no coordinator
    at the address; process 0 starts the coordinator but process 1 never comes. jaxlib would abort
    after its own timeout with a stack trace; jfsdp says so in one line, naming its 3 s timeout, and
    exits 2."""
    def start(process_id):
        return subprocess.Popen([sys.executable, "train.py", "--mesh", "2x4", *RUN, "--coordinator",
                                 f"127.0.0.1:{free_port()}", "--num-processes", "2", "--process-id", str(process_id),
                                 "--init-timeout", "3"], cwd=ROOT, env=env(), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
    unreachable, missing_peer = start(1), start(0)
    try:
        # a hang, not a slow start, is what fails here: 120 s is ten times the 3 s timeout plus starting
        # Python and importing jax (on the loaded 2-core machine); the bound itself is in the message
        _, err = unreachable.communicate(timeout=120)
        assert unreachable.returncode == 2, err[-2000:]
        errors = [line for line in err.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and "did not answer within 3 s" in errors[0], err
        assert "Traceback" not in err
        _, err = missing_peer.communicate(timeout=120)
        assert missing_peer.returncode == 2, err[-2000:]
        assert "error: process 0 could not join the distributed run within 3 s" in err
    finally:
        for q in (unreachable, missing_peer):
            if q.poll() is None:
                q.kill()


def test_dead_peer_stops_the_others(tmp_path):
    """fsdp across the two processes (1x8): kill -9 of process 1 mid-run: process 0 stops by itself (no
    launcher watching) because the
    coordination service saw process 1's heartbeats stop (its error output says so), instead of
    hanging in a collective; then --resume on both processes continues from the last complete
    checkpoint."""
    out = tmp_path / "m.jsonl"
    port = free_port()
    ckpt = tmp_path / "ckpt"
    flags = [*RUN, "--steps", "1000", "--eval-every", "0", "--ckpt-dir", str(ckpt), "--save-every", "2"]
    args = [sys.executable, "train.py", "--mesh", "1x8", *flags, "--metrics-out", str(out),
            "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--heartbeat-timeout", "5"]
    err0 = tmp_path / "process0.err"
    with open(err0, "w") as log:
        procs = [subprocess.Popen(args + ["--process-id", str(i)], cwd=ROOT, env=env(), stdout=subprocess.DEVNULL,
                                  stderr=log if i == 0 else subprocess.DEVNULL) for i in range(2)]
    try:
        deadline = time.monotonic() + 240
        while not (out.exists() and '"step": 4,' in out.read_text()):
            assert time.monotonic() < deadline and procs[0].poll() is None, "the run did not start"
            time.sleep(0.5)
        procs[1].send_signal(signal.SIGKILL)
        # a hang in a collective, not a slow machine, is what fails here: 120 s is far above the 5 s
        # heartbeat timeout; what stopped the process is read from its own error output
        code = procs[0].wait(timeout=120)
    finally:
        for q in procs:
            if q.poll() is None:
                q.kill()
    # jaxlib's coordination service ends it (a fatal log, SIGABRT) naming the missed heartbeats of task 1,
    # in one of its two wordings (jaxlib 0.10.2: which one depends on which of its threads sees it first)
    text = err0.read_text()
    missed = re.search(r"Task 1 heartbeat timeout|unhealthy \(stopped sending heartbeats\):\s*1\b", text)
    assert code == -signal.SIGABRT and missed, (code, text[-2000:])
    # both processes resume from the last complete checkpoint and go on
    p = subprocess.run([sys.executable, "-m", "jfsdp.launch", "-n", "2", "train.py", "--mesh", "1x8", *flags,
                        "--metrics-out", str(out), "--resume", "--stop-after", "2"], cwd=ROOT, env=env(),
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "fsdp axis: 8 devices per group, 1 groups, across 2 processes" in p.stdout, p.stdout
    step = int(p.stderr.split("resumed from")[1].split("(step ")[1].split(",")[0])
    assert step >= 2 and step % 2 == 0, p.stderr   # the last save that completed before the kill
    assert records(out)[-1]["step"] == step + 2


def test_detect():
    assert not distributed.detect(env={}).multi
    p = distributed.detect("127.0.0.1:1234", 2, 1, env={})
    assert (p.coordinator, p.num_processes, p.process_id, p.source) == ("127.0.0.1:1234", 2, 1, "flags")
    slurm = distributed.detect(env={"SLURM_JOB_ID": "7", "SLURM_NTASKS": "4"})
    assert slurm.source == "slurm" and slurm.num_processes == 4 and slurm.coordinator is None
    assert distributed.detect(env={"SLURM_JOB_ID": "7", "SLURM_NTASKS": "1"}).source == "single"
    assert distributed.detect(env={"OMPI_COMM_WORLD_SIZE": "2"}).source == "openmpi"
    # flags win over a cluster environment
    assert distributed.detect("h:1", 2, 0, env={"OMPI_COMM_WORLD_SIZE": "8"}).source == "flags"
    for bad, msg in [(("h:1", 2, None), "missing --process-id"), (("h:1", 2, 2), "outside 0..1"),
                     (("h", 2, 0), "malformed"), (("h:99999", 2, 0), "malformed"), ((None, 2, 0), "missing --coordinator")]:
        with pytest.raises(ConfigError, match=msg):
            distributed.detect(*bad, env={})
    with pytest.raises(ConfigError, match="init-timeout"):
        distributed.detect(init_timeout=0, env={})
