"""train.py's watch over its own run on CPU: a run that dies of a signal still ends with one line.

Why a second process. XLA:CPU ends a process from one of its worker threads when devices wait in a
collective that not all of them reach (its rendezvous times out: a C++ fatal log, then abort()). No
Python code of that process runs after it, so the run cannot say what happened nor which checkpoint
survived, and the shell shows only "Aborted". So `jfsdp.cli.main`, on CPU and before jax is imported,
forks (`supervise`): the child goes on to run the training exactly as before; the parent (jax-free)
passes the child's stderr through byte for byte, remembers XLA's fatal rendezvous line, waits, and
returns the child's exit status. A child that dies of a signal ends with one line from the parent:

- after XLA's rendezvous line: `error: XLA:CPU aborted the run: ...` naming the collective, and the
  last complete checkpoint (or that none was saved), exit status 2;
- any other signal (SIGSEGV, SIGABRT, SIGKILL from the out-of-memory killer, ...): `error: ...` naming
  it, the same checkpoint clause, exit status 128 + the signal number (the shell's convention);
- SIGINT or SIGTERM that ended the child outside the training loop (no handler there): a notice, 130/143.

Signals. The child stays in train.py's process group, so a terminal's Ctrl-C (or Ctrl-Z, or a signal to
the group) reaches it directly, as it did the single process. A signal sent to train.py's pid only
(`kill PID`, a test's `send_signal`) reaches the parent alone, which forwards it. A SIGINT or SIGTERM
that reached both must reach the child once (a second one stops without saving), so the parent
forwards one only when (a) the terminal did not send it (the kernel's `si_code`), and (b) the child
does not report having received it itself within `REPORT_WAIT` seconds: the child's Python signal
handler writes every signal it receives into a pipe to the parent (`signal.set_wakeup_fd`, written by
CPython's C-level handler the moment the signal arrives, while the main thread may be busy in XLA). If
the parent is killed, the kernel kills the child (PR_SET_PDEATHSIG): `kill -9` still ends the run.

Where it applies (`applies`): CPU runs of one process on Linux. Not on GPUs (no in-process rendezvous of
XLA:CPU; runs there are under cluster launchers that signal every process they started), not in runs of
several processes (their launcher, SLURM or `python -m jfsdp.launch`, owns the processes and their
signals), and not where jax is already imported (`main` called inside a process that uses jax: a fork
of it is unsafe).
"""
from __future__ import annotations

import os
import re
import select
import signal
import sys
import threading
import time
from pathlib import Path

from jfsdp.runtime.console import EXIT_BAD_INPUT, note, set_stderr_tty

FORWARDED = (signal.SIGINT, signal.SIGTERM)
REPORT_WAIT = 0.5      # seconds the parent waits for the child to say it got a signal itself
SI_KERNEL = 0x80       # Linux si_code of a signal the kernel sent (a terminal's Ctrl-C), not kill()
PR_SET_PDEATHSIG = 1
# XLA's fatal log lines start F<mmdd>; those from its rendezvous (a collective's meeting of devices)
FATAL_RENDEZVOUS = re.compile(r"^F\d{4} [^\]]*\brendezvous\.(?:cc|h):\d+\] (.*)")
SIGNAL_WHAT = {signal.SIGSEGV: "a segmentation fault", signal.SIGBUS: "a bus error",
               signal.SIGABRT: "an abort", signal.SIGFPE: "an arithmetic fault", signal.SIGILL: "an illegal instruction",
               signal.SIGKILL: "killed: kill -9, or the kernel's out-of-memory killer"}


def applies(multi_process: bool) -> bool:
    """Whether train.py runs its training in a watched child process (see the module's docstring)."""
    return (sys.platform.startswith("linux") and not multi_process and "jax" not in sys.modules
            and os.environ.get("JAX_PLATFORMS", "").split(",")[0].strip().lower() == "cpu")


def supervise(ckpt_dir: str | None) -> int | None:
    """Fork. In the child, return None (it goes on to train, its stderr a pipe to the parent); in the
    parent, return the exit status of the whole command once the child has ended."""
    sys.stdout.flush()
    sys.stderr.flush()
    tty = sys.stderr.isatty()
    err_r, err_w = os.pipe()
    sig_r, sig_w = os.pipe()
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED)   # the parent takes them with sigtimedwait
    parent = os.getpid()
    try:
        pid = os.fork()
    except OSError:   # no process to spare: train here, unwatched
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        for fd in (err_r, err_w, sig_r, sig_w):
            os.close(fd)
        return None
    if pid == 0:
        os.close(err_r)
        os.close(sig_r)
        os.dup2(err_w, 2)
        os.close(err_w)
        os.set_blocking(sig_w, False)
        signal.set_wakeup_fd(sig_w, warn_on_full_buffer=False)
        _die_with_parent(parent)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        set_stderr_tty(tty)   # its progress bar as on the terminal: the parent passes the bytes through
        return None
    os.close(err_w)
    os.close(sig_w)
    try:
        return Watch(pid, err_r, sig_r).wait(ckpt_dir)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)


def _die_with_parent(parent: int) -> None:
    try:
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    except (OSError, AttributeError):   # no prctl: a parent killed with -9 leaves the child running
        pass
    if os.getppid() != parent:          # the parent died before the line above
        os._exit(128 + signal.SIGKILL)


class Watch:
    """The parent's side: the child's stderr passed through (a thread), its signal reports read, the
    signals sent to train.py forwarded, and the child's end told in one line."""

    def __init__(self, pid: int, err_fd: int, report_fd: int):
        self.pid, self.report_fd = pid, report_fd
        self.fatal: str | None = None       # XLA's first fatal rendezvous line from the child
        self.direct: list[tuple[int, float]] = []   # signals the child got itself: (signum, when)
        self.echoes = {s: 0 for s in FORWARDED}     # forwarded signals whose report is still to come
        self.pump = threading.Thread(target=self._pass_through, args=(err_fd,), daemon=True)
        self.pump.start()

    def _pass_through(self, fd: int) -> None:
        tail = b""
        while chunk := os.read(fd, 1 << 16):
            _write_all(2, chunk)
            lines = (tail + chunk).split(b"\n")
            tail = lines.pop()[-(1 << 16):]
            if self.fatal is None:
                for line in lines:
                    m = FATAL_RENDEZVOUS.match(line.decode(errors="replace"))
                    if m:
                        self.fatal = m.group(1)
                        break
        os.close(fd)

    def wait(self, ckpt_dir: str | None) -> int:
        while True:
            done, status = os.waitpid(self.pid, os.WNOHANG)
            if done:
                break
            info = signal.sigtimedwait(FORWARDED, 0.1)
            self._read_reports(0)
            if info is not None:
                self._on_signal(info)
        self.pump.join(timeout=10)   # the rest of the child's stderr (a grandchild may hold the pipe)
        os.close(self.report_fd)
        if os.WIFEXITED(status):
            return os.WEXITSTATUS(status)
        return self._died(os.WTERMSIG(status), ckpt_dir)

    def _read_reports(self, timeout: float) -> None:
        if not select.select([self.report_fd], [], [], timeout)[0]:
            return
        for signum in os.read(self.report_fd, 512):
            if signum not in self.echoes:
                continue
            if self.echoes[signum]:
                self.echoes[signum] -= 1
            else:
                self.direct.append((signum, time.monotonic()))

    def _on_signal(self, info) -> None:
        signum = info.si_signo
        if info.si_code == SI_KERNEL:   # from the terminal, to the foreground process group: the child has it
            return
        deadline = time.monotonic() + REPORT_WAIT
        while True:
            now = time.monotonic()
            self.direct = [(s, t) for s, t in self.direct if t > now - 2 * REPORT_WAIT]
            mine = [d for d in self.direct if d[0] == signum]
            if mine:                    # sent to the child too (a process group, a cgroup): it has it
                self.direct.remove(mine[0])
                return
            if now >= deadline:
                break
            self._read_reports(deadline - now)
        try:
            os.kill(self.pid, signum)
            self.echoes[signum] += 1
        except ProcessLookupError:      # already gone: waitpid reports how
            pass

    def _died(self, signum: int, ckpt_dir: str | None) -> int:
        name = signal.Signals(signum).name
        saved = checkpoint_clause(ckpt_dir)
        if self.fatal is not None:
            print(f"error: XLA:CPU aborted the run: {rendezvous_summary(self.fatal)}; {saved}",
                  file=sys.stderr, flush=True)
            return EXIT_BAD_INPUT
        if signum in FORWARDED:
            note(f"{'interrupted' if signum == signal.SIGINT else 'terminated'} ({name}) outside the "
                 f"training loop; {saved}")
        else:
            what = SIGNAL_WHAT.get(signum, "a signal")
            print(f"error: the training process died of {name} ({what}); {saved}", file=sys.stderr, flush=True)
        return 128 + signum


def _write_all(fd: int, data: bytes) -> None:
    try:
        while data:
            data = data[os.write(fd, data):]
    except OSError:   # our own stderr is gone: keep reading, so the child never blocks on it
        pass


def rendezvous_summary(fatal: str) -> str:
    """What XLA's fatal rendezvous line says, as a clause: which collective, and how the devices missed
    each other (a timeout: some never came; a failed check: they ran their collectives out of step)."""
    key = re.search(r"([a-z]+(?: [a-z]+)*) RendezvousKey\{([^}]*)\}", fatal)   # "all gather RendezvousKey{..}"
    op = re.search(r"op_id=(\d+)", key.group(2)) if key else None
    named = [key.group(1) + (f", op_id {op.group(1)}" if op else "")] if key else []
    came = re.search(r"Expected (\d+) threads to join the rendezvous, but only (\d+)", fatal)
    if came or "Termination timeout" in fatal:
        counted = [f"{came.group(2)} of {came.group(1)} devices arrived"] if came else []
        return f"devices waited in a collective that not all of them reached ({'; '.join(named + counted)})"
    check = re.search(r"Check failed: (.*?)(?:\s*\(\S+ vs\. \S+\)|$)", fatal)   # "... (4 vs. 4)"
    said = f"XLA: Check failed: {check.group(1)}" if check else f"XLA: {fatal.strip()[:200]}"
    return f"devices ran their collectives out of step ({'; '.join(named + [said])})"


def checkpoint_clause(ckpt_dir: str | None) -> str:
    """Which checkpoint the run leaves, read from --ckpt-dir: the complete ones are the folders named
    by their step (an unfinished write keeps orbax's tmp suffix, jfsdp.io.checkpoint)."""
    if not ckpt_dir:
        return "no checkpoint was saved (no --ckpt-dir)"
    d = Path(ckpt_dir).absolute()
    steps = sorted(int(p.name) for p in d.iterdir() if p.name.isdigit() and p.is_dir()) if d.is_dir() else []
    if not steps:
        return f"no checkpoint had been saved yet in {d}"
    return f"no checkpoint was lost: the last saved is {d / str(steps[-1])} (--resume continues from it)"
