"""16 fake CPU devices, set before jax is imported anywhere in the test session."""
import os

# LLVM optimization level 0 halves compile time on CPU; the optimized HLO, and so the collectives
# and memory_analysis() that tests assert on, are the same (checked on llama-test, 2x8). Flags given
# from outside are kept (appended to), e.g. XLA_FLAGS=--xla_cpu_max_isa=AVX2 to run the numerical
# tests as on an AVX2-only CPU (docs/numerics.md).
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=16 --xla_backend_optimization_level=0").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

assert jax.device_count() == 16, f"expected 16 fake CPU devices, got {jax.device_count()}"

from tests.ci_skips import pytest_sessionfinish, pytest_terminal_summary  # noqa: E402,F401  (a skip under CI fails)
