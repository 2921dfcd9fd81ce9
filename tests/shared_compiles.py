"""One compile for tests of a file that compile the very same program (the same jaxpr, devices, flags):
jax's persistent compilation cache, switched on in this process only while such a test runs, in a folder of
the test module's, so that the second test (or the second run inside one test) loads the executable XLA
wrote for the first instead of compiling it again. What the program computes is the same either way: the
cache is keyed by the program, the devices, the compile options and XLA's version, and a program that
differs in any of them compiles anew.

tests/conftest.py keeps this process's own programs out of the cache otherwise (caching all of them made no
difference to a whole run: few repeat, and each write costs); the processes the tests start share one
cache there.

A test module imports both fixtures and marks its tests with `@pytest.mark.usefixtures("shared_programs")`."""
import contextlib

import jax
import pytest
from jax.experimental.compilation_cache import compilation_cache

_SETTINGS = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs")


@contextlib.contextmanager
def shared_compiles(folder):
    """Within the block, compiles of 0.5 s and more are written to (and read from) `folder`."""
    before = {name: getattr(jax.config, name) for name in _SETTINGS}
    jax.config.update("jax_compilation_cache_dir", str(folder))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    compilation_cache.reset_cache()   # jax decides once whether the cache is on: ask it again
    try:
        yield
    finally:
        for name, value in before.items():
            jax.config.update(name, value)
        compilation_cache.reset_cache()


@pytest.fixture(scope="module")
def program_folder(tmp_path_factory):
    """The test module's folder of compiled programs."""
    return tmp_path_factory.mktemp("xla_cache")


@pytest.fixture
def shared_programs(program_folder):
    """The test's compiles go through the module's folder (`shared_compiles`)."""
    with shared_compiles(program_folder):
        yield
