"""Does the run fit? `python train.py` asks the planner before it allocates anything.

The planner's analytic estimate (`jfsdp.planning.estimate`, for this run's plan, optimizer, loss,
micro-batch and frozen parameters) is compared with the memory each device has:
- on GPUs (and TPUs), the device's memory (`memory_stats()['bytes_limit']`);
- on fake CPU devices, the host memory available to the process (the smaller of the kernel's
  MemAvailable and what the cgroup's memory.max leaves), shared by this process's devices: the
  budget per device is that divided by their number;
- `JFSDP_MEMORY_BUDGET=SIZE` (e.g. `2GiB`) sets the budget per device instead (tests; a machine
  whose memory the process cannot read).

Estimate above the budget: one `error:` line with the estimate, the budget and the nearest
configurations that fit (`--remat full`, a smaller `--batch-size`, `--update-in-backward`, more
devices), exit status 2. Estimate within its measured error below the budget (ESTIMATE_ERROR): the
run proceeds and says so in one line. `--no-fit-check` skips all this.
"""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import jax

from jfsdp.config.args import parse_bytes
from jfsdp.config.errors import ConfigError
from jfsdp.planning import memory
from jfsdp.planning.report import largest_batch

BUDGET_ENV = "JFSDP_MEMORY_BUDGET"
# The estimate's measured error against compiled programs (docs/planner.md): within 10% on XLA:CPU
# (tests/test_memory.py's bar; measured 0.92-1.06), and compiled 14% above it for an H100 target
# (llama-70b 1x64: XLA:GPU's packing of its temporary buffer, which the estimate does not model).
ESTIMATE_ERROR = {"cpu": 0.10, "gpu": 0.15}
# With context parallelism on a GPU the compiled step was up to 1.34x the estimate (llama-8b on 8 H100s, 256k
# tokens, C = 8: 38.97 GiB estimated, 52.10 compiled) until the blockwise kernel's and the ring's fixes of
# 2026-11-26; since them, estimate / compiled is 0.93-1.08 at C = 2, 4, 8 (docs/results/context-long.md), inside
# the GPU band above, which C > 1 now uses too.


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def host_available() -> int | None:
    """Bytes of host memory this process may still use: MemAvailable, capped by the cgroup's limit
    (cgroup v2 memory.max - memory.current, or v1's limit - usage). None where neither is readable."""
    avail = []
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                avail.append(int(line.split()[1]) * 1024)
    except OSError:
        pass
    for limit_f, usage_f in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                             ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                              "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            limit = Path(limit_f).read_text().strip()
            if limit != "max" and int(limit) < 2**60:
                avail.append(int(limit) - int(Path(usage_f).read_text().strip()))
                break
        except (OSError, ValueError):
            continue
    return min(avail) if avail else None


def device_budget(devices) -> tuple[int | None, str]:
    """(bytes per device, where that figure comes from) for this process's `devices` of the mesh."""
    if os.environ.get(BUDGET_ENV):
        return parse_bytes(os.environ[BUDGET_ENV]), f"{BUDGET_ENV}={os.environ[BUDGET_ENV]}"
    d = devices[0]
    if d.platform != "cpu":
        try:
            limit = (d.memory_stats() or {}).get("bytes_limit")
        except Exception:   # a backend without memory statistics
            limit = None
        return limit, f"{d.platform.upper()} memory"
    host = host_available()
    if host is None:
        return None, "host memory"
    return host // len(devices), f"{_gib(host)} of host memory available, shared by {len(devices)} CPU devices"


@dataclasses.dataclass(frozen=True)
class Case:
    """What the estimate needs: the sharded model, the loss, and the run's settings. The batch is
    `batch_size` rows of `seq_len` tokens ({'inputs', 'targets'}); for a model given as it is,
    `batch_size` rows shaped like its example batch (`seq_len` is not read)."""
    sharded: object
    loss_fn: object
    optimizer: object
    batch_size: int       # global
    seq_len: int
    grad_accum: int
    update_in_backward: bool
    backend: str
    grad_sync: str = "every"
    trainable: object = None   # make_train_step's (--freeze): frozen leaves have no gradient or optimizer state
    # breakdown's results by (plan, rows, update in backward): the decision asks for some of them more than once,
    # and each is a trace of the step
    memo: dict = dataclasses.field(default_factory=dict, init=False, repr=False, compare=False)

    def estimate(self, batch_size=None, update_in_backward=None, sharded=None) -> int:
        """The estimate's total per device (bytes)."""
        return self.breakdown(batch_size, update_in_backward, sharded).total

    def breakdown(self, batch_size=None, update_in_backward=None, sharded=None):
        sharded = sharded or self.sharded
        rows = batch_size or self.batch_size
        x = jax.ShapeDtypeStruct((rows, self.seq_len), "int32")
        batch = {"inputs": x, "targets": x}
        if getattr(sharded, "as_is", False):   # a model given as it is: its example batch's keys and shapes
            batch = jax.tree.map(lambda a: jax.ShapeDtypeStruct((rows, *a.shape[1:]), a.dtype), sharded.example_batch)
        uib = self.update_in_backward if update_in_backward is None else update_in_backward
        key = (id(sharded), rows, uib)
        if key in self.memo and self.memo[key][0] is sharded:
            return self.memo[key][1]
        b = memory.estimate(sharded, self.optimizer, self.loss_fn, batch,
                            prefetch=sharded.prefetch, backend=self.backend, update_in_backward=uib,
                            grad_accum=self.grad_accum, grad_sync=self.grad_sync, trainable=self.trainable)
        self.memo[key] = (sharded, b)   # the plan is kept with it: its id is not reused while it is here
        return b


def alternatives(case: Case, budget: int, reshard) -> list[str]:
    """The nearest configurations whose estimate fits `budget`, as flags. `reshard(remat)`: the same
    model sharded with another remat policy."""
    out = []
    plan = case.sharded
    full = reshard("full") if plan.remat != "full" else plan
    if full is not plan:
        e = case.estimate(sharded=full)
        if e <= budget:
            out.append(f"--remat full ({_gib(e)})")
    n = plan.n_devices // getattr(plan, "context", 1) * case.grad_accum   # the devices that hold rows
    fits = lambda k: case.estimate(batch_size=k * n) <= budget
    k = largest_batch(fits, limit=max(1, case.batch_size // n - 1)) if case.batch_size > n else 0
    if k:
        out.append(f"--batch-size {k * n} ({_gib(case.estimate(batch_size=k * n))})")
    if case.grad_sync == "once" and case.grad_accum > 1:
        e = dataclasses.replace(case, grad_sync="every").estimate()
        if e <= budget:
            out.append(f"--grad-sync every ({_gib(e)})")
    from jfsdp.train import update_in_backward
    if (not case.update_in_backward and case.grad_sync != "once" and case.trainable is None
            and not update_in_backward.unsupported(plan, case.grad_accum)):
        for p, prefix in [(plan, "")] + ([(full, "--remat full ")] if full is not plan else []):
            e = case.estimate(update_in_backward=True, sharded=p)
            if e <= budget:
                out.append(f"{prefix}--update-in-backward ({_gib(e)})")
                break
    more = more_devices(case, budget, plan)
    if more is None and full is not plan:
        more = more_devices(case, budget, full)
        more = more and f"--remat full on {more}"
    if more:
        out.append(more)
    return out


def more_devices(case: Case, budget: int, plan) -> str | None:
    """The smallest mesh with more shards (same replicas, same batch per device) on which `plan`'s
    estimate fits: the sharded state (parameters, gradient shards, optimizer state, padding) scaled by
    S / S'; the gathered units, activations and batch per device stay. An extrapolation: no such mesh
    exists here to trace."""
    if not plan.strategy.sharded:
        return None
    b = case.breakdown(sharded=plan)
    state = b.params + b.grads + b.optimizer + b.padding
    rest, s, s2 = b.total - state, plan.shards, plan.shards * 2
    while s2 <= 1 << 16 and rest + state * s / s2 > budget:
        s2 *= 2
    if s2 > 1 << 16:
        return None
    t, c = plan.tensor, getattr(plan, "context", 1)   # at C > 1 the shards are fsdp x context
    return (f"{plan.replicas * s2 * t} devices (--mesh {plan.replicas}x{s2 // c}" + (f" --context {c}" if c > 1 else "")
            + (f" --tensor {t}" if t > 1 else "") + f", the same batch per device: about {_gib(rest + state * s / s2)})")


def floor(case: Case) -> int:
    """What no number of shards removes: the estimate less its sharded state."""
    b = case.breakdown()
    return b.total - (b.params + b.grads + b.optimizer + b.padding)


def check(case: Case, devices, reshard) -> str | None:
    """The decision: None when the estimate is well within the budget (or no budget is known), a note
    when it is within the estimate's error of it; ConfigError with the alternatives when above it."""
    budget, source = device_budget(devices)
    if budget is None:
        return f"fit check skipped: {source} unknown here (set {BUDGET_ENV}=SIZE per device)"
    est = case.estimate()
    err = ESTIMATE_ERROR.get(case.backend, ESTIMATE_ERROR["gpu"])
    if est > budget:
        alts = alternatives(case, budget, reshard)
        near = ("nearest that fit: " + "; ".join(alts) if alts else
                f"nothing near it fits (one gathered unit, the activations and the batch alone need "
                f"{_gib(floor(case))})")
        raise ConfigError(f"does not fit: the planner estimates {_gib(est)} per device, the budget is {_gib(budget)} "
                          f"per device ({source}); {near} (--no-fit-check runs anyway)")
    if est * (1 + err) > budget:
        return (f"fit check: the estimate {_gib(est)} per device is within its error (±{err:.0%}) of the budget "
                f"{_gib(budget)} ({source}): proceeding")
    return None
