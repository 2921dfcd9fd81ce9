"""More than one process: JAX's distributed runtime, started safely, and meshes that span hosts.

Everything multi-process in jfsdp runs on `jax.distributed` (the coordination service; NCCL between
GPUs, gloo between CPU processes), nothing home-made. This module adds what a training tool needs
around it:

- `detect`: which processes this run has, from explicit flags (`--coordinator HOST:PORT
  --num-processes N --process-id I`) or, when none is given, from a cluster launcher that JAX can read
  (SLURM, Open MPI). Without either, the run is one process and nothing is initialized.
- `initialize`: start the runtime with bounded waiting. jaxlib ends the process with a fatal log
  (SIGABRT, a C++ stack trace) when the coordinator cannot be reached or a peer never joins; a
  user should instead see one line `error: ...` and exit status 2. So a non-zero process first
  probes the coordinator's TCP port, and a watchdog thread ends the process cleanly if
  `jax.distributed.initialize` has not returned within `init_timeout` seconds (the call releases
  the GIL while it waits, so the watchdog runs).
- `make_mesh`: the `data` x `fsdp` mesh with the device order from JAX's hybrid-mesh utility
  (`mesh_utils.create_hybrid_device_mesh`, one process = one granule): `fsdp` stays inside a
  process (a host's fast links) whenever it fits, `data` spans processes; a `fsdp` axis larger than
  a process's devices spans whole processes (full sharding over the slow links).
- `describe_mesh`: which processes and devices each axis spans, for the run's first lines.

A peer that dies mid-run is noticed by the coordination service when its heartbeats stop; every
other process is then ended by jaxlib (a fatal log, exit by SIGABRT) after `heartbeat_timeout`
seconds. jfsdp sets that timeout (default 30 s, JAX's own default is 100 s) so the bound is known;
the local launcher (`python -m jfsdp.launch`) stops the other processes at once.
"""
from __future__ import annotations

import dataclasses
import os
import socket
import sys
import threading
import time

from jfsdp.config.errors import ConfigError
from jfsdp.config.mesh import parse_mesh
from jfsdp.runtime.console import EXIT_BAD_INPUT

DEFAULT_INIT_TIMEOUT = 60      # seconds to wait for the coordinator and for every process to join
DEFAULT_HEARTBEAT_TIMEOUT = 30  # seconds without heartbeats before a peer is declared dead


@dataclasses.dataclass(frozen=True)
class Processes:
    """How this run is spread over processes. `coordinator`/`process_id` are None when a cluster
    launcher (SLURM, Open MPI) provides them to JAX; `num_processes` may then be None too."""
    coordinator: str | None
    num_processes: int | None
    process_id: int | None
    source: str                      # "flags", "slurm", "openmpi" or "single"
    init_timeout: float = DEFAULT_INIT_TIMEOUT
    heartbeat_timeout: int = DEFAULT_HEARTBEAT_TIMEOUT

    @property
    def multi(self) -> bool:
        return self.source != "single"


def _cluster_env(env) -> tuple[str, int | None] | None:
    """A cluster launcher that started more than one task, as JAX's own detection would see it."""
    if "SLURM_JOB_ID" in env and int(env.get("SLURM_NTASKS", env.get("SLURM_NPROCS", "1")) or 1) > 1:
        return "slurm", int(env.get("SLURM_NTASKS", env.get("SLURM_NPROCS")))
    if int(env.get("OMPI_COMM_WORLD_SIZE", "1") or 1) > 1:
        return "openmpi", int(env["OMPI_COMM_WORLD_SIZE"])
    return None


def parse_address(address: str) -> tuple[str, int]:
    host, sep, port = str(address).rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"--coordinator '{address}' is malformed: expected HOST:PORT, e.g. 10.0.0.1:1234")
    return host.strip("[]"), int(port)


def detect(coordinator: str | None = None, num_processes: int | None = None, process_id: int | None = None, *,
           init_timeout: float = DEFAULT_INIT_TIMEOUT, heartbeat_timeout: int = DEFAULT_HEARTBEAT_TIMEOUT,
           env=None) -> Processes:
    """The processes of this run. Explicit flags win and must come as a complete set; otherwise a
    SLURM or Open MPI launch of more than one task is detected; otherwise one process."""
    env = os.environ if env is None else env
    if not init_timeout > 0:
        raise ConfigError(f"--init-timeout must be positive, got {init_timeout}")
    if heartbeat_timeout < 1:
        raise ConfigError(f"--heartbeat-timeout must be at least 1 second, got {heartbeat_timeout}")
    given = {"--coordinator": coordinator, "--num-processes": num_processes, "--process-id": process_id}
    if any(v is not None for v in given.values()):
        missing = [k for k, v in given.items() if v is None]
        if missing:
            raise ConfigError(f"multi-process runs need --coordinator, --num-processes and --process-id "
                              f"together; missing {', '.join(missing)}")
        parse_address(coordinator)
        if num_processes < 1:
            raise ConfigError(f"--num-processes must be at least 1, got {num_processes}")
        if not 0 <= process_id < num_processes:
            raise ConfigError(f"--process-id {process_id} is outside 0..{num_processes - 1}")
        if num_processes == 1:
            return Processes(None, 1, 0, "single", init_timeout, heartbeat_timeout)
        return Processes(coordinator, num_processes, process_id, "flags", init_timeout, heartbeat_timeout)
    cluster = _cluster_env(env)
    if cluster:
        return Processes(None, cluster[1], None, cluster[0], init_timeout, heartbeat_timeout)
    return Processes(None, 1, 0, "single", init_timeout, heartbeat_timeout)


def wait_for_coordinator(address: str, timeout: float) -> None:
    """Until the coordinator's port accepts a connection; ConfigError after `timeout` seconds."""
    host, port = parse_address(address)
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection((host, port), timeout=min(2.0, timeout)):
                return
        except OSError as e:
            last = e
        if time.monotonic() >= deadline:
            raise ConfigError(f"coordinator {address} did not answer within {timeout:g} s ({last.strerror or last}); "
                              "is process 0 running, and is the address reachable from here?")
        time.sleep(0.25)


def initialize(p: Processes, *, cpu: bool) -> None:
    """Start JAX's distributed runtime for `p` (nothing for one process). Call before anything
    touches jax's backends. On CPU the cross-process collectives are gloo's."""
    if not p.multi:
        return
    import jax
    if cpu:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    started = time.monotonic()   # one clock for the probe and the join: both fit in --init-timeout
    if p.coordinator and p.process_id:
        wait_for_coordinator(p.coordinator, p.init_timeout)
    who = f"process {p.process_id}" if p.process_id is not None else "this process"

    def give_up():
        # jaxlib would abort with a C++ stack trace at its own timeout; end with one line instead
        print(f"error: {who} could not join the distributed run within {p.init_timeout:g} s "
              f"(coordinator {p.coordinator or 'from ' + p.source}, {p.num_processes} processes): "
              "did every process start, with the same --coordinator and --num-processes?",
              file=sys.stderr, flush=True)
        os._exit(EXIT_BAD_INPUT)

    watchdog = threading.Timer(max(0.0, p.init_timeout - (time.monotonic() - started)), give_up)
    watchdog.daemon = True
    watchdog.start()
    try:
        kw = {} if p.source != "flags" else dict(coordinator_address=p.coordinator, num_processes=p.num_processes,
                                                  process_id=p.process_id)
        jax.distributed.initialize(**kw, initialization_timeout=int(p.init_timeout) + 30,
                                   heartbeat_timeout_seconds=int(p.heartbeat_timeout))
    except (RuntimeError, ValueError) as e:
        raise ConfigError(f"jax.distributed.initialize failed for {who}: {str(e).splitlines()[0]}") from None
    finally:
        watchdog.cancel()


def make_mesh(spec: str, devices=None, tensor: int = 1):
    """A `data` x `fsdp` mesh over the devices of every process (with tensor=T > 1, `data` x `fsdp` x
    `tensor`, `tensor` innermost). One process: the devices in order. More: JAX's hybrid-mesh utility
    with each process as a granule, so an `fsdp` group (with its T-device tensor groups) never straddles
    processes when it fits in one (hybrid sharding: reduce-scatter over the fast links, all-reduce of
    the shard across hosts), and an `fsdp` axis of several whole processes otherwise. A tensor group
    always lies inside one process (its collectives run in every layer)."""
    import jax
    import numpy as np
    from jax.experimental import mesh_utils
    from jax.sharding import Mesh

    from jfsdp.config.mesh import make_mesh as single_process_mesh, mesh_spec

    r, s = parse_mesh(spec)
    m = mesh_spec(spec, tensor)
    devices = list(jax.devices() if devices is None else devices)
    procs = sorted({d.process_index for d in devices})
    if len(procs) == 1:
        return single_process_mesh(spec, devices=devices, tensor=tensor)
    if m.devices != len(devices):
        raise ConfigError(f"mesh {r}x{s}{f' with tensor {tensor}' if tensor > 1 else ''} needs {m.devices} devices but "
                          f"the {len(procs)} processes have {len(devices)} in all")
    local = len(devices) // len(procs)
    if any(sum(d.process_index == p for d in devices) != local for p in procs):
        raise ConfigError("every process must bring the same number of devices")
    if local % tensor:
        raise ConfigError(f"--tensor {tensor} must divide the {local} devices of each process: a tensor group lies "
                          "inside one process")
    st = s * tensor             # an fsdp group's devices, each with its tensor group
    if local % st == 0:         # fsdp inside a process, data over local groups and processes
        ici, dcn = (local // st, st), (len(procs), 1)
    elif st % local == 0:       # fsdp spans st/local whole processes
        ici, dcn = (1, local), (r, st // local)
    else:
        raise ConfigError(f"mesh {r}x{s}: the fsdp size {s}{f' x tensor {tensor}' if tensor > 1 else ''} must divide, "
                          f"or be a multiple of, the {local} devices of each process")
    grid = mesh_utils.create_hybrid_device_mesh(ici, dcn, devices, process_is_granule=True)
    return Mesh(np.asarray(grid).reshape(m.replicas, m.shards, *([tensor] if tensor > 1 else [])), m.axes)


def describe_mesh(mesh) -> list[str]:
    """One line per axis: its size, and whether its groups stay inside a process or span several."""
    import numpy as np
    procs = np.vectorize(lambda d: d.process_index)(mesh.devices)
    lines = []
    for i, name in enumerate(mesh.axis_names):
        groups = np.moveaxis(procs, i, -1).reshape(-1, procs.shape[i])
        spans = sorted({len(set(g.tolist())) for g in groups})
        where = ("inside one process" if spans == [1] else
                 f"across {'/'.join(map(str, spans))} processes")
        lines.append(f"{name} axis: {procs.shape[i]} devices per group, {groups.shape[0]} groups, {where}")
    lines.append("processes: " + ", ".join(f"{p} -> devices "
                                           f"{sorted(d.id for d in mesh.devices.flat if d.process_index == p)}"
                                           for p in sorted(set(procs.ravel().tolist()))))
    return lines
