"""16 fake CPU devices, set before jax is imported anywhere in the test session."""
import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=16").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

assert jax.device_count() == 16, f"expected 16 fake CPU devices, got {jax.device_count()}"
