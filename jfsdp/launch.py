"""Start N local processes of a jfsdp program, for trying multi-process runs on one machine.

    python -m jfsdp.launch -n 2 train.py --mesh 2x4 --steps 50

runs `python train.py --mesh 2x4 --steps 50 --coordinator 127.0.0.1:PORT --num-processes 2
--process-id I` for I = 0, 1 (a free port unless `--port` is given). On a machine without an
accelerator each process fakes its share of the mesh's devices on the CPU and the processes talk
over gloo, exactly as separate hosts would over the network. Process 0's output is shown as is;
the others' standard output is dropped (only process 0 reports) and their errors are shown. If a
process fails, the others are stopped at once and the launcher exits with the failed process's
status; Ctrl-C is passed to every process.
"""
from __future__ import annotations

import argparse
import signal
import socket
import subprocess
import sys
import time

from jfsdp.config.args import ArgParser


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def main(argv=None) -> int:
    p = ArgParser(prog="python -m jfsdp.launch", description=__doc__.split("\n\n")[0])
    p.add_argument("-n", "--num-processes", type=int, required=True, help="processes to start")
    p.add_argument("--host", default="127.0.0.1", help="coordinator address (this machine)")
    p.add_argument("--port", type=int, default=0, help="coordinator port (default: a free one)")
    p.add_argument("--grace", type=float, default=10.0, help="seconds between SIGTERM and SIGKILL when stopping")
    p.add_argument("script", help="the Python program, e.g. train.py")
    p.add_argument("args", nargs=argparse.REMAINDER, help="its arguments")
    a = p.parse_args(argv)
    if a.num_processes < 1:
        p.error(f"-n must be at least 1, got {a.num_processes}")
    address = f"{a.host}:{a.port or free_port(a.host)}"
    procs = []
    for i in range(a.num_processes):
        cmd = [sys.executable, a.script, *a.args, "--coordinator", address,
               "--num-processes", str(a.num_processes), "--process-id", str(i)]
        procs.append(subprocess.Popen(cmd, stdout=None if i == 0 else subprocess.DEVNULL))
    status = 0
    try:
        while True:
            codes = [q.poll() for q in procs]
            failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                i, status = failed[0]
                others = [q for q in procs if q.poll() is None]
                if others:
                    print(f"error: process {i} exited with status {status}; stopping the other "
                          f"{len(others)}", file=sys.stderr, flush=True)
                    stop(others, a.grace)
                break
            if all(c == 0 for c in codes):
                break
            time.sleep(0.2)
    except KeyboardInterrupt:
        for q in procs:
            if q.poll() is None:
                q.send_signal(signal.SIGINT)
        for q in procs:
            try:
                q.wait(a.grace * 3)
            except subprocess.TimeoutExpired:
                stop([q], a.grace)
        status = max((q.returncode or 0) for q in procs) or 130
    return status if status >= 0 else 128 - status


def stop(procs, grace: float) -> None:
    for q in procs:
        q.terminate()
    deadline = time.monotonic() + grace
    for q in procs:
        try:
            q.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            q.kill()
            q.wait()


if __name__ == "__main__":
    sys.exit(main())
