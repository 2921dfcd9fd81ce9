"""The XLA flags that make the suite's CPU compiles faster, jax-free (read before jax starts; the test
processes' helpers pass them to the processes they start).

- `--xla_backend_optimization_level=0`: LLVM at -O0 halves compile time on CPU; the optimized HLO, and so
  the collectives and memory_analysis() that tests assert on, are unchanged (checked on llama-test, 2x8).
- `--xla_cpu_use_fusion_emitters=false`: XLA:CPU's older elemental emitters, which compile a llama-test
  train step (2x8, FULL_SHARD, remat full) in 0.65-1.1 s instead of 2.5 s (2026-11-26, 2-core EPYC, jax
  0.10.2). Fusion then keeps some reductions out of their fusions, so the optimized HLO differs: the
  collectives are the same, the temporaries a few hundred bytes apart. The tests' numerical bounds are
  taken from noise floors, which this changes no more than any reassociation; the tests that need the
  program train.py runs (tests/test_cpu_schedule.py) do not use it. Only passed to an XLA that knows
  the flag (an unknown flag in XLA_FLAGS aborts the process), and not when JFSDP_TESTS_DEFAULT_EMITTERS is
  set: a claim that holds bit for bit under XLA:CPU's default emitters only (deferred init's values) is
  checked in a child pytest with it set (tests/test_any_model.py).

For the programs the tests compile for an NVIDIA target on this CPU machine (`gpu_fast`, added by
tests/conftest.py to jfsdp.planning.targets.compiler_options in the test processes, not to their children):
- `xla_gpu_kernel_cache_file`: one file per test worker, where XLA:GPU keeps each kernel's binary by the
  kernel's fingerprint; a later compile of the same fusion (another test's program of the same widths) loads
  it instead of running PTX -> cubin again. PTX -> cubin is most of XLA:GPU's backend time here (an
  fp8-rowwise llama step: 36 of 38 s, 203 kernels; the same compile again with the cache: backend 40 -> 8 s;
  2026-11-26).
- `xla_gpu_disable_gpuasm_optimizations`: ptxas at -O0 (PTX -> cubin about 15% faster here).
Neither changes the optimized HLO, its schedule or its buffer assignment, which is all the tests read: the
kernels are never run (there is no GPU). The fp8-rowwise step's memory_analysis is the same with and without.
"""
import glob
import mmap
import os

NAME = "xla_cpu_use_fusion_emitters"


def _known(name: str) -> bool:
    """Whether the installed jaxlib's shared libraries carry the flag's name (found without jax)."""
    import importlib.util
    spec = importlib.util.find_spec("jaxlib")
    if spec is None or not spec.submodule_search_locations:
        return False
    for so in glob.glob(os.path.join(spec.submodule_search_locations[0], "**", "*.so"), recursive=True):
        if os.path.getsize(so) < 1 << 20:
            continue
        with open(so, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            if m.find(name.encode()) >= 0:   # searched in place, not read into memory (hundreds of MB)
                return True
    return False


DEFAULT_EMITTERS_ENV = "JFSDP_TESTS_DEFAULT_EMITTERS"
LEGACY_EMITTERS = not os.environ.get(DEFAULT_EMITTERS_ENV) and _known(NAME)
FAST = "--xla_backend_optimization_level=0" + (f" --{NAME}=false" if LEGACY_EMITTERS else "")


def gpu_fast(cache_dir: str, worker: str) -> dict:
    """XLA:GPU options for the tests' deviceless GPU compiles (see the module docstring)."""
    return {"xla_gpu_kernel_cache_file": os.path.join(cache_dir, f"gpu-kernels-{worker}.bin"),
            "xla_gpu_disable_gpuasm_optimizations": True}
