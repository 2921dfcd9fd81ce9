"""train.py (or planner) runs of one test module that share one start-up: a server process imports jax and
jfsdp once, then forks once per run (no XLA backend has started yet: each run fakes its devices as train.py
and the planner do) and the fork runs train.py as `python train.py ...` would (runpy, as __main__; or
`python -m jfsdp.plan ...`), its stdout and stderr in files of its own; the server reports the fork's exit
status. A run no longer pays Python's start and the jax and jfsdp imports (2.8 s of CPU on the 2-core VM),
and the imported modules are frozen out of its cyclic garbage collections (gc.freeze, as tests/conftest.py
does): tests/test_checkpoint.py's train.py runs took 69.4 s of CPU through a server and 97.8 s as processes
of their own (the two versions of the file run side by side, 2-core Intel Xeon VM, 2026-11-27). The run's
own set-up, compiles and training stay.

Jax being imported already, train.py trains in the fork itself instead of a supervised child
(jfsdp/runtime/supervisor.py): tests whose point is the process (signals, an XLA abort, exit statuses of the
real command, several processes) start train.py themselves. Every run of one server has the same
environment (XLA_FLAGS, JAX_* are read when jax is imported).

    server = TrainServer(env, folder)      # a module-scoped fixture; main="jfsdp.plan" for the planner
    r = server.run("--mesh", "1x2", ...)   # a subprocess.CompletedProcess
    server.close()
"""
import json
import os
import select
import signal
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

SERVE = """
import json, os, runpy, sys
import gc, jax, jfsdp.cli, jfsdp.planning.memory, jfsdp.runtime.run   # imported once; none starts a backend
import matplotlib; matplotlib.use("Agg"); import matplotlib.pyplot   # the run's loss curve (0.85 s to import)
gc.collect()
gc.freeze()   # the imported modules stay out of the forks' collections (which would copy their pages)
main = sys.argv.pop(1)
for line in sys.stdin:
    argv, out = json.loads(line)
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        for fd, name in ((1, out + ".stdout"), (2, out + ".stderr")):
            os.dup2(os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
        sys.argv = [main, *argv]
        if main.endswith(".py"):
            runpy.run_path(main, run_name="__main__")
        else:
            runpy.run_module(main, run_name="__main__", alter_sys=True)
        sys.exit(0)
    print(json.dumps(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])), flush=True)
"""


class TrainServer:
    """One server process (its own process group: a run past its timeout ends with the server)."""

    def __init__(self, env, folder, main="train.py"):
        self.folder, self.count, self.main = Path(folder), 0, main
        self.log = open(self.folder / "server.stderr", "w")
        self.proc = subprocess.Popen([sys.executable, "-c", SERVE, main], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.log, text=True, env=env, cwd=REPO, start_new_session=True)

    def run(self, *argv, timeout=300) -> subprocess.CompletedProcess:
        """`python train.py *argv` (or `python -m main *argv`) -> its exit status, stdout and stderr."""
        self.count += 1
        out = str(self.folder / f"run{self.count}")
        self.proc.stdin.write(json.dumps([[str(a) for a in argv], out]) + "\n")
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            self.kill()
            err = Path(out + ".stderr")
            raise AssertionError(f"{self.main} {' '.join(map(str, argv))}: no exit status within {timeout} s; "
                                 + (self.folder / "server.stderr").read_text()[-2000:]
                                 + (err.read_text()[-2000:] if err.exists() else ""))
        return subprocess.CompletedProcess([self.main, *argv], json.loads(line), Path(out + ".stdout").read_text(),
                                           Path(out + ".stderr").read_text())

    def kill(self):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def close(self):
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.kill()
        self.log.close()
