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


def single(out, *args):
    """The reference, started at once (it runs while the test waits on the other processes): train.py `args` in
    one process with 8 fake devices, its metrics in `out` and its error output beside them. -> the process."""
    with open(out.with_suffix(".err"), "w") as err:
        return subprocess.Popen([sys.executable, "train.py", *args, "--metrics-out", str(out)], cwd=ROOT, env=env(),
                                stdout=subprocess.DEVNULL, stderr=err)


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


# Process 0 of the run whose peer dies: train.py, held in the metrics record of step 6 once checkpoint 4 is
# complete on disk (orbax finishes it in its own threads meanwhile), so that kill -9 of process 1 lands at the
# same step after the same checkpoint on every machine, however fast its steps. Held, process 0 can only be
# ended by the coordination service, once process 1's heartbeats stop.
HOLD_AT_STEP_6 = """
import runpy, sys, time
from pathlib import Path
import jfsdp.runtime.metrics
marker, ckpt = Path(sys.argv.pop(1)), Path(sys.argv.pop(1))
real_write = jfsdp.runtime.metrics.MetricsFile.write
def write(self, **rec):
    real_write(self, **rec)
    if rec.get("step") == 6 and "loss" in rec:
        deadline = time.monotonic() + 120
        while not (ckpt / "4").is_dir() and time.monotonic() < deadline:
            time.sleep(0.1)
        marker.write_text("at 6")
        time.sleep(300)
jfsdp.runtime.metrics.MetricsFile.write = write
sys.argv[0] = "train.py"
runpy.run_path("train.py", run_name="__main__")
"""


def test_dead_peer_stops_the_others_and_both_resume_equal_to_one_process(tmp_path):
    """fsdp across the two processes (1x8, started by hand: no launcher watching): kill -9 of process 1 after
    step 6 (checkpoint 4 on disk); process 0 stops by itself because the coordination service saw process 1's
    heartbeats stop (its error output says so), instead of hanging in a collective. Then --resume on both
    processes through the launcher, on 2x2 with --tensor 2 (hybrid: data across the processes, tensor groups
    inside each; a T = 1 checkpoint under T = 2; fp32: the losses of T = 2 and T = 1 agree to 1.8e-7 relative,
    measured), continues from checkpoint 4; only process 0 reports, saves' lines and writes the metrics; the
    losses of both runs are those of one process running 1x8 straight through."""
    out, ckpt, marker, err0, out0 = (tmp_path / n for n in ("m.jsonl", "ckpt", "marker", "process0.err", "process0.out"))
    flags = [*RUN, "--save-every", "4", "--ckpt-dir", str(ckpt)]   # 8 steps: held at 6, the run does not end
    ref_out = tmp_path / "single.jsonl"
    ref = single(ref_out, "--mesh", "1x8", *RUN)
    args = ["train.py", "--mesh", "1x8", *flags, "--metrics-out", str(out), "--coordinator", f"127.0.0.1:{free_port()}",
            "--num-processes", "2", "--heartbeat-timeout", "5"]
    with open(err0, "w") as log, open(out0, "w") as stdout:
        procs = [subprocess.Popen([sys.executable, "-c", HOLD_AT_STEP_6, str(marker), str(ckpt), *args[1:], "--process-id", "0"],
                                  cwd=ROOT, env=env(), stdout=stdout, stderr=log),
                 subprocess.Popen([sys.executable, *args, "--process-id", "1"], cwd=ROOT, env=env(),
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]
    try:
        deadline = time.monotonic() + 240
        while not marker.exists():
            assert time.monotonic() < deadline and procs[0].poll() is None, ("the run did not reach step 6",
                                                                             err0.read_text()[-2000:])
            time.sleep(0.2)
        procs[1].send_signal(signal.SIGKILL)
        # a hang, not a slow machine, is what fails here: 120 s is far above the 5 s heartbeat timeout; what
        # stopped the process is read from its own error output
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
    assert "fsdp axis: 8 devices per group, 1 groups, across 2 processes" in out0.read_text(), out0.read_text()
    assert sorted(os.listdir(ckpt)) == ["4"], os.listdir(ckpt)
    # both processes resume from checkpoint 4, under tensor parallelism, and go on to step 8
    p = launch("2x2", out, *flags[len(RUN):], "--tensor", "2", "--resume", "--gen-tokens", "4")
    assert "tensor axis: 2 devices per group, 4 groups, inside one process" in p.stdout, p.stdout
    assert p.stderr.count(f"resumed from {ckpt / '4'} (step 4,") == 1, p.stderr
    assert p.stderr.count("checkpoint saved to") == 1, p.stderr                   # said once, by process 0
    assert p.stdout.count("== summary") == 1 and p.stdout.count("== sample") == 1   # process 0 only
    assert records(out)[-1]["step"] == 8
    # the resumed run logs step 6 and evaluates step 4 again: drop those repeats, then compare
    seen, unique = set(), []
    for r in losses(records(out)):
        if r[:2] not in seen:
            seen.add(r[:2])
            unique.append(r)
    assert ref.wait(timeout=300) == 0, ref_out.with_suffix(".err").read_text()[-2000:]
    assert_same_losses(unique, losses(records(ref_out)))


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
