"""train.py's watch over its run on CPU (jfsdp/runtime/supervisor.py), with a jax-free child in place of
the training: every signal sent to train.py reaches the child exactly once, whoever sent it to whom; a
child that dies of a signal ends with one line; killing train.py with -9 kills the child. The real
thing, an abort by XLA:CPU's rendezvous inside train.py, is in tests/test_train_cli.py."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jfsdp.runtime import supervisor

REPO = Path(__file__).resolve().parents[1]

# A child that counts the SIGINT/SIGTERM it gets while its main thread runs Python (so each one runs
# its handler at once: two signals are two calls, as in the training loop between steps).
CHILD = """
import os, signal, sys, time
from jfsdp.runtime import supervisor
status = supervisor.supervise(sys.argv[1] or None)
if status is not None:
    sys.exit(status)
got = []
for s in (signal.SIGINT, signal.SIGTERM):
    signal.signal(s, lambda signum, frame: got.append(signum))
print("ready", os.getpid(), flush=True)
what = sys.argv[2]
if what == "count":
    end = time.monotonic() + 3
    while time.monotonic() < end:
        time.sleep(0.01)
    print("got", *got, flush=True)
    sys.exit(len(got))
if what == "sleep":
    time.sleep(120)
print("some output first", file=sys.stderr, flush=True)
if what == "fatal":   # what XLA:CPU writes when it gives up on a rendezvous, then abort()
    print(sys.argv[3], file=sys.stderr, flush=True)
os.kill(os.getpid(), getattr(signal, sys.argv[-1]))
"""

# XLA:CPU's line (jaxlib 0.10.2), as train.py's child wrote it when two of four devices waited in an
# all-gather (tests/test_train_cli.py makes it happen)
XLA_TIMEOUT = ("F1125 18:17:59.378090   22003 rendezvous.cc:161] [id=1] Termination timeout for `all gather "
               "RendezvousKey{run_id=RunId: -1319317164, global_devices=[0, 1, 2, 3], num_local_participants=4, "
               "collective_op_kind=cross_module, op_id=1}` of 2 seconds exceeded. Exiting to ensure a consistent "
               "program state. Expected 4 threads to join the rendezvous, but only 2 of them arrived on time.")
# and what it wrote for issue 27's own run (train.py under the memory-minimizing scheduler, by hand)
XLA_CHECK = ("F1125 18:42:18.926210     937 rendezvous.h:314] Check failed: id < num_threads (4 vs. 4) Id can't be "
             "larger than the number of participating threads: id=4, num_threads=4, name=all gather "
             "RendezvousKey{run_id=RunId: -902453195, global_devices=[0, 1, 2, 3], num_local_participants=4, "
             "collective_op_kind=cross_module, op_id=1}")


def _start(*args):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO)}
    p = subprocess.Popen([sys.executable, "-c", CHILD, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, env=env, cwd=REPO, start_new_session=True)   # its own group to signal
    line = p.stdout.readline()
    assert line.startswith("ready"), (line, p.stderr.read() if p.poll() is not None else "")
    return p, int(line.split()[1])


@pytest.mark.parametrize("to", ["pid", "group"])
@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_a_signal_reaches_the_child_once(sig, to):
    """To train.py's pid (`kill PID`): forwarded. To its process group (a terminal's Ctrl-C, `kill
    -INT -PGID`, `timeout`), which holds the child too: not forwarded, else the child would see two
    and stop without saving."""
    p, child = _start("", "count")
    assert child != p.pid
    signum = getattr(signal, sig)
    if to == "pid":
        p.send_signal(signum)
    else:
        os.killpg(p.pid, signum)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 1 and out.split()[-2:] == ["got", str(int(signum))], (out, err)


# Runs CHILD on a new terminal (as its session's foreground group), types Ctrl-C once it is ready.
ON_A_TERMINAL = """
import os, pty, sys
pid, fd = pty.fork()
if pid == 0:
    os.execv(sys.executable, [sys.executable, "-c", sys.argv[1], "", "count"])
text = b""
try:
    while b"ready" not in text or not text.split(b"ready", 1)[1].endswith(b"\\n"):   # the whole ready line
        text += os.read(fd, 4096)
    os.write(fd, b"\\x03")
    while True:
        text += os.read(fd, 4096)
except OSError:   # EIO: the terminal's last process is gone
    pass
_, status = os.waitpid(pid, 0)
# the terminal echoes ^C and may drop the output still queued when it signals (the ready line's end): a space
# keeps "got" a word of its own
print(os.waitstatus_to_exitcode(status), text.decode().replace("^C", " ").split()[-2:])
"""


def test_ctrl_c_on_a_terminal_reaches_the_child_once():
    """A terminal's Ctrl-C goes to its foreground process group: train.py and its child alike."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO)}
    r = subprocess.run([sys.executable, "-c", ON_A_TERMINAL, CHILD], capture_output=True, text=True, env=env,
                       cwd=REPO, timeout=60)
    assert r.stdout.strip() == f"1 ['got', '{int(signal.SIGINT)}']", (r.stdout, r.stderr)


def _one_error_line(err):
    lines = err.strip().splitlines()
    errors = [line for line in lines if line.startswith("error:")]
    assert len(errors) == 1 and lines[-1] == errors[0] and "Traceback" not in err, err
    return errors[0]


def test_a_rendezvous_abort_is_one_line_naming_the_collective(tmp_path):
    ck = tmp_path / "ck"
    for name in ("2", "6", "8.orbax-checkpoint-tmp-1764092000"):   # 8 was being written: not a checkpoint
        (ck / name).mkdir(parents=True)
    p, _ = _start(str(ck), "fatal", XLA_TIMEOUT, "SIGABRT")
    _, err = p.communicate(timeout=60)
    assert p.returncode == 2, err
    assert "some output first" in err and XLA_TIMEOUT in err     # the child's stderr, passed through
    assert _one_error_line(err) == (
        "error: XLA:CPU aborted the run: devices waited in a collective that not all of them reached "
        f"(all gather, op_id 1; 2 of 4 devices arrived); no checkpoint was lost: the last saved is {ck / '6'} "
        "(--resume continues from it)")


def test_a_rendezvous_check_failure_and_other_deaths_are_one_line(tmp_path):
    p, _ = _start("", "fatal", XLA_CHECK, "SIGABRT")
    _, err = p.communicate(timeout=60)
    line = _one_error_line(err)
    assert p.returncode == 2, err
    assert line == ("error: XLA:CPU aborted the run: devices ran their collectives out of step (all gather, op_id 1; "
                    "XLA: Check failed: id < num_threads); no checkpoint was saved (no --ckpt-dir)")
    p, _ = _start(str(tmp_path / "empty"), "die", "SIGSEGV")
    _, err = p.communicate(timeout=60)
    assert p.returncode == 128 + signal.SIGSEGV, err
    assert _one_error_line(err) == ("error: the training process died of SIGSEGV (a segmentation fault); "
                                    f"no checkpoint had been saved yet in {tmp_path / 'empty'}")


def test_kill_9_of_train_py_kills_the_child():
    p, child = _start("", "sleep")
    p.kill()
    p.wait(timeout=60)
    deadline = time.time() + 30
    while time.time() < deadline:
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        if Path(f"/proc/{child}/stat").read_text().split(") ")[1].startswith("Z"):
            break   # a zombie: dead, not yet reaped by init
        time.sleep(0.05)
    else:
        os.kill(child, signal.SIGKILL)
        pytest.fail("the child outlived train.py's kill -9")


def test_applies_only_to_one_cpu_process_without_jax(monkeypatch):
    """In this process jax is imported (conftest): `main` called here never forks."""
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    assert not supervisor.applies(multi_process=False)
    monkeypatch.delitem(sys.modules, "jax")
    assert supervisor.applies(multi_process=False)
    assert not supervisor.applies(multi_process=True)
    monkeypatch.setenv("JAX_PLATFORMS", "cuda")
    assert not supervisor.applies(multi_process=False)
