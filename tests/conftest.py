"""16 fake CPU devices, set before jax is imported anywhere in the test session."""
import os
import tempfile

# NumPy's OpenBLAS on one thread, in the test processes and the processes they start: its idle worker threads
# spin after each call (about 1% of a test process's CPU samples, perf, 2026-11-27), on a machine whose two
# cores the two xdist workers already fill. Set before anything imports NumPy.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

from tests.compile_flags import FAST, gpu_fast  # noqa: E402  (jax-free)

# Faster CPU compiles (tests/compile_flags.py says what each flag changes). Flags given from outside are
# kept (appended to), e.g. XLA_FLAGS=--xla_cpu_max_isa=AVX2 to run the numerical tests as on an
# AVX2-only CPU (docs/numerics.md).
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=16 " + FAST).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import gc  # noqa: E402
import subprocess  # noqa: E402

import pytest  # noqa: E402

import jax  # noqa: E402

assert jax.device_count() == 16, f"expected 16 fake CPU devices, got {jax.device_count()}"

# The processes that tests start (train.py, the planner, the two-process runs) share XLA's persistent
# compilation cache, one directory per test session (pytest-xdist's run id, so both workers share it and
# no earlier session's entries are read): a train.py run that resumes, or repeats another test's
# configuration, loads its compiled step (a repeated run: 24 s -> 14 s, measured 2026-11-25). Set after
# jax started, so this process's own programs are not cached: caching them too made no difference to a
# fresh-clone run (1,744 s with, 1,750 s without, 2026-11-25).
_SESSION_DIR = os.path.join(tempfile.gettempdir(),
                            f"jfsdp-tests-xla-cache-{os.environ.get('PYTEST_XDIST_TESTRUNUID', os.getpid())}")
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", _SESSION_DIR)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")   # the eval and sampling programs too
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

# This process's compiles for a GPU target (jfsdp.planning.targets): a kernel cache per worker and ptxas at -O0
# (tests/compile_flags.py says why neither changes what the tests read).
from jfsdp.planning import targets as _targets  # noqa: E402
_jfsdp_gpu_options = _targets.compiler_options
_GPU_FAST = gpu_fast(_SESSION_DIR, os.environ.get("PYTEST_XDIST_WORKER", "main"))
os.makedirs(_SESSION_DIR, exist_ok=True)


def _compiler_options(*args, **kwargs):
    return {**_jfsdp_gpu_options(*args, **kwargs), **_GPU_FAST}


_targets.compiler_options = _compiler_options

# pytest-xdist's --dist loadfile hands the files out in collection order, each to the next free worker: the
# costliest files first (worker-seconds in a fresh-clone run, 2026-11-26: test_gpu_target 268, test_any_model
# 229, test_checkpoint 180, ...) so that the run does not end on one worker finishing a long file alone.
HEAVY_FIRST = ("test_gpu_target.py", "test_any_model.py", "test_checkpoint.py", "test_equivalence.py", "test_moe.py",
               "test_grad_sync.py", "test_multiprocess.py", "test_tensor_parallel.py", "test_context_parallel.py",
               "test_train_cli.py", "test_memory.py", "test_even_shards.py", "test_update_in_backward.py",
               "test_float8_rowwise.py", "test_float8_any_model.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(HEAVY_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))   # stable: the rest keep their order


# Python's cyclic garbage collector: the modules imported so far are frozen out of its scans, and it runs
# less often (jax's tracing allocates many short-lived objects: about 5% of a traced-and-compiled step's CPU
# time went to collections at the default thresholds, perf, 2026-11-27). No test depends on when garbage is
# collected. (JAX_INCLUDE_FULL_TRACEBACKS_IN_LOCATIONS=false was tried beside it and is not used: it drops the
# Flax module names from the HLO's op_name, which the GPU-target tests read.)
gc.collect()
gc.freeze()
gc.set_threshold(20_000, 50, 100)

from tests.ci_skips import pytest_sessionfinish, pytest_terminal_summary  # noqa: E402,F401  (a skip under CI fails)


@pytest.fixture
def train_main(monkeypatch, capsys):
    """train.py's main (jfsdp.cli.main) in this process, which is faster than a subprocess (no Python start,
    no jax import): `train_main(args)` -> CompletedProcess(args, exit status, stdout, stderr), whether main
    returned its status or raised SystemExit with it. The mesh takes the first devices of this session's 16;
    the device set-up main does writes XLA_FLAGS and JAX_PLATFORMS, which monkeypatch puts back."""
    for k in ("XLA_FLAGS", "JAX_PLATFORMS"):
        monkeypatch.setenv(k, os.environ.get(k, ""))
    from jfsdp import cli

    def run(args):
        args = [str(a) for a in args]
        try:
            code = cli.main(args)
        except SystemExit as e:
            code = e.code
        out = capsys.readouterr()
        return subprocess.CompletedProcess(args, code, out.out, out.err)
    return run
