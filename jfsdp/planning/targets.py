"""Compile-only GPU targets: XLA:GPU's own compiler, run on a machine without a GPU.

XLA compiles for an NVIDIA GPU from a description of it (a `GpuTargetConfig` text proto: compute
capability, SM count, memory, caches), with no device present. What comes out is XLA:GPU's buffer
assignment (`compiled.memory_analysis()`) and its scheduled program (`compiled.as_text()`: async,
combined collectives, fusions), i.e. what a real GPU run would allocate and issue, up to autotuning
(there is none without a device: gemms keep XLA's default choices).

Needs the CUDA PJRT plugin of the same version as jax (`pip install "jax-cuda13-plugin==<jax
version>" "jax-cuda13-pjrt==<jax version>"`, or `pip install -e ".[gpu-target]"`; no NVIDIA
libraries, no driver) and `JAX_PLATFORMS=cpu` so that jax does not look for a GPU to run on.

    devices = jfsdp.planning.targets.devices("h100", "1x8")          # 8 compile-only H100s
    mesh = jfsdp.make_mesh("1x8", devices=devices)
    ...lower(abstract state, abstract batch).compile(compiler_options=jfsdp.planning.targets.compiler_options())

Each figure below says where it comes from. Most of them only steer code generation (tile sizes,
occupancy, the cost model); `device_memory_size` also bounds the latency-hiding scheduler's memory.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import math

import numpy as np

from jfsdp.config.errors import ConfigError
from jfsdp.config.xla_flags import flags_for, flags_in_env


@dataclasses.dataclass(frozen=True)
class GpuTarget:
    """One NVIDIA GPU as XLA:GPU's compiler sees it (fields of stream_executor.GpuDeviceInfoProto)."""
    name: str
    description: str            # device_description_str: what the CUDA driver calls it
    compute_capability: tuple   # (major, minor)
    sm_count: int               # core_count
    fpus_per_core: int          # FP32 lanes per SM
    memory_bytes: int           # device_memory_size
    memory_bandwidth: int       # bytes/s
    l2_cache_bytes: int
    clock_ghz: float            # boost clock of the SMs
    smem_per_sm: int            # shared_memory_per_core
    smem_per_block_optin: int   # shared_memory_per_block_optin
    source: str

    def text_proto(self, cudnn=None, cuda_runtime=(13, 0)) -> str:
        """The GpuTargetConfig text proto handed to the compiler. The limits that every NVIDIA GPU
        since Volta shares (1024 threads per block, warps of 32, 48 KiB static shared memory per
        block, 64 Ki registers, the grid limits) are from the CUDA C++ Programming Guide's table of
        technical specifications per compute capability."""
        major, minor = self.compute_capability
        return f"""gpu_device_info {{
  cuda_compute_capability {{ major: {major} minor: {minor} }}
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: {self.smem_per_sm}
  shared_memory_per_block_optin: {self.smem_per_block_optin}
  threads_per_core_limit: 2048
  core_count: {self.sm_count}
  fpus_per_core: {self.fpus_per_core}
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {self.memory_bandwidth}
  l2_cache_size: {self.l2_cache_bytes}
  clock_rate_ghz: {self.clock_ghz}
  device_memory_size: {self.memory_bytes}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}}
platform_name: "CUDA"
dnn_version_info {{ major: {(cudnn or _CUDNN)[0]} minor: {(cudnn or _CUDNN)[1]} }}
runtime_version {{ major: {cuda_runtime[0]} minor: {cuda_runtime[1]} }}
device_description_str: "{self.description}"
"""


# Shared memory per SM and the per-block opt-in maximum are the CUDA C++ Programming Guide's
# figures per compute capability: 8.0: 164 KiB / 163 KiB; 9.0 and 10.0: 228 KiB / 227 KiB.
TARGETS = {
    "h100": GpuTarget(
        "h100", "NVIDIA H100 80GB HBM3", (9, 0), sm_count=132, fpus_per_core=128,
        memory_bytes=84_929_347_584, memory_bandwidth=3_352_320_000_000, l2_cache_bytes=52_428_800,
        clock_ghz=1.98, smem_per_sm=233_472, smem_per_block_optin=232_448,
        source="H100 SXM5 80GB. Device memory, bandwidth, L2, clock, SMs and shared memory as an H100's "
               "CUDA runtime reports them, in the GpuTargetConfig posted in openxla/xla PR #25919 (2025) and "
               "matching a deviceQuery of 'NVIDIA H100 80GB HBM3' (132 SMs, 1980 MHz, 50 MiB L2, 228 KiB "
               "shared memory per SM)."),
    "h200": GpuTarget(
        "h200", "NVIDIA H200", (9, 0), sm_count=132, fpus_per_core=128,
        memory_bytes=143_771 * 2**20, memory_bandwidth=4_800_000_000_000, l2_cache_bytes=52_428_800,
        clock_ghz=1.98, smem_per_sm=233_472, smem_per_block_optin=232_448,
        source="H200 SXM 141GB: the same GH100 die as the H100 SXM (132 SMs, 1.98 GHz, 50 MiB L2, "
               "compute capability 9.0), with 141 GB HBM3e at 4.8 TB/s (NVIDIA H200 datasheet); memory "
               "size 143,771 MiB as nvidia-smi reports an H200's total (not measured here)."),
    "a100": GpuTarget(
        "a100", "NVIDIA A100-SXM4-80GB", (8, 0), sm_count=108, fpus_per_core=64,
        memory_bytes=81_920 * 2**20, memory_bandwidth=2_039_000_000_000, l2_cache_bytes=41_943_040,
        clock_ghz=1.41, smem_per_sm=167_936, smem_per_block_optin=166_912,
        source="A100 SXM4 80GB: 108 SMs of 64 FP32 lanes, 1410 MHz boost, 40 MiB L2 (NVIDIA A100 "
               "Tensor Core GPU architecture whitepaper), 2,039 GB/s HBM2e (A100 datasheet); memory size 81,920 MiB as nvidia-smi reports its total."),
    "b200": GpuTarget(
        "b200", "NVIDIA B200", (10, 0), sm_count=148, fpus_per_core=128,
        memory_bytes=183_359 * 2**20, memory_bandwidth=8_000_000_000_000, l2_cache_bytes=132_120_576,
        clock_ghz=1.965, smem_per_sm=233_472, smem_per_block_optin=232_448,
        source="B200 (HGX B200): 148 SMs, compute capability 10.0, 180 GB HBM3e at 8 TB/s (NVIDIA "
               "DGX/HGX B200 datasheet); L2 126 MiB and 1965 MHz boost are the "
               "published Blackwell figures; memory size 183,359 MiB as nvidia-smi reports its total. "
               "The least checked of the four: compiled here, never compared with a device."),
}


def get(name: str) -> GpuTarget:
    key = str(name).strip().lower()
    if key not in TARGETS:
        raise ConfigError(f"unknown GPU target '{name}'; choose from {', '.join(TARGETS)}")
    return TARGETS[key]


def _install_hint() -> str:
    try:
        from jax import __version__ as v
    except Exception:  # pragma: no cover
        v = "<jax version>"
    return (f'pip install "jax-cuda13-plugin=={v}" "jax-cuda13-pjrt=={v}"  '
            '(or pip install -e ".[gpu-target]"; the plugin version must equal jax\'s)')


def plugin_available() -> bool:
    """Whether jax's CUDA plugin is importable (it is what compiles for a GPU)."""
    import importlib.util
    return any(importlib.util.find_spec(m) is not None for m in ("jax_cuda13_plugin", "jax_cuda12_plugin"))


@functools.lru_cache(maxsize=None)
def topology_devices(target: str, n: int) -> tuple:
    """n compile-only devices of `target` (lower-case name), built once per process and target
    (`topology_devices.cache_clear()` forgets them). ConfigError, in one line, where jax's CUDA plugin
    is missing or cannot build the topology."""
    from jax.experimental import topologies
    t = get(target)
    try:
        desc = topologies.get_topology_desc(platform="cuda", target_config=t.text_proto(), topology=f"1x1x{n}")
    except Exception as e:  # no plugin, or a plugin of another version than jax
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        if not plugin_available():
            raise ConfigError(f"compiling for {target} needs jax's CUDA plugin: {_install_hint()}") from None
        import jax
        if jax.config.jax_platforms != "cpu":
            raise ConfigError(f"could not build a {target} topology ({msg}): set JAX_PLATFORMS=cpu before jax "
                              "starts (the CUDA plugin otherwise looks for a GPU and its libraries)") from None
        raise ConfigError(f"could not build a {target} topology ({msg}); {_install_hint()}") from None
    return tuple(desc.devices)


def devices(target: str, mesh, tensor: int = 1, context: int = 1) -> list:
    """Compile-only devices of `target` for an RxS mesh (R*S*C*T of them, with `context` = C and `tensor`
    = T): pass them to make_mesh. They compile programs but run nothing."""
    from jfsdp.config.mesh import parse_mesh
    r, s = parse_mesh(mesh) if isinstance(mesh, str) else mesh
    get(target)
    return list(topology_devices(str(target).strip().lower(), r * s * context * tensor))


def own_scan_unit(plan) -> tuple | None:
    """(gathered bytes, reduced shard bytes) of the largest unit that a model given as it is runs in its
    own scan (`nn.scan`, `nnx.scan`) on sharded GPUs, as XLA's combiners measure them (the gather's
    result in the gather dtype, float8 where the layout says so; the reduce-scatter's result in the
    reduce dtype); None for every other plan, and where the model's scan runs on jfsdp's prefetch pipeline
    (plan.prefetch: engine/as_is/own_scan.py), which needs no pipeliner. `flags_for(own_scan=...)` makes them the combine
    thresholds. The reduced bytes count, besides the unit, the root's leaves no larger than the unit's
    smallest leaf (a final norm): XLA combined the final norm's reduce-scatter with the backward loop's
    last pipelined unit, which a threshold of one unit then split in two, and the larger part ran
    exposed (llama-8b, H100 target: 672 MiB, reduce-scatters 1.27x `Stacked`'s; with the norm counted,
    `Stacked`'s). Larger root leaves are not counted: with the small Llama's embedding (33 KiB per
    device) counted, tests/test_gpu_target.py's own-scan case exposed two units' reduce-scatters (1.92x)."""
    scanned = getattr(plan, "scanned", None)
    if not getattr(plan, "as_is", False) or not scanned or plan.shards <= 1 or plan.on_cpu or plan.prefetch:
        return None
    import jax
    from jfsdp.engine.layout import is_layout
    from jfsdp.planning.sizes import gathered_bytes
    units = [plan.leaf_layouts[p] for p in scanned]
    param, reduce = plan.comm.param_dtype, plan.comm.reduce_dtype
    reduced = lambda ls: sum(math.prod(l.shard_shape) * np.dtype(reduce or l.dtype).itemsize for l in ls)
    smallest = min(reduced([l]) for ls in units for l in ls)
    root = [reduced([l]) for p, l in jax.tree_util.tree_flatten_with_path(plan.layouts, is_leaf=is_layout)[0]
            if plan.unit_of[jax.tree_util.keystr(p)] is None]
    return (max(gathered_bytes(ls, param or ls[0].dtype) for ls in units),
            max(reduced(ls) for ls in units) + sum(b for b in root if b <= smallest))


def compiler_options(overrides: dict | None = None, prefetch: bool = False, async_tp: bool = False,
                     context: bool = False, own_scan: tuple | None = None) -> dict:
    """The XLA:GPU options jfsdp compiles with: `flags_for(prefetch, async_tp, context, own_scan)`, minus
    any flag the user set in XLA_FLAGS, plus `overrides` (a value of None drops a flag). Pass to
    `Lowered.compile(compiler_options=...)`; `own_scan_unit(plan)` for a model's own scan."""
    env = flags_in_env()
    opts = {k: v for k, v in flags_for(prefetch, async_tp, context, own_scan).items() if k not in env and defined(k, v)}
    for k, v in (overrides or {}).items():
        if v is None:
            opts.pop(k, None)
        else:
            opts[k] = v
    return opts


@functools.lru_cache(maxsize=None)
def defined(name: str, value) -> bool:
    """Whether this jax's XLA defines the compile option `name`: XLA rejects an option it does not define
    (INVALID_ARGUMENT: No such compile option) on every backend, so a trivial program compiled once on
    this process's own backend tells. jax 0.11.2's XLA no longer has xla_gpu_enable_pipelined_all_gather,
    _reduce_scatter and _all_reduce (found on the GPU machine, 2026-11-27), which jfsdp's flags set for jax
    0.10; such an option is left out of `compiler_options`, with a warning (the program then compiles as
    that XLA does by default)."""
    import warnings

    import jax
    import jax.numpy as jnp
    try:
        jax.jit(lambda x: x + 1).lower(jnp.zeros(1)).compile(compiler_options={name: value})
    except Exception as e:  # jax's runtime error type differs across versions: matched by its message
        if "No such compile option" not in str(e):
            raise
        warnings.warn(f"jax {jax.__version__}'s XLA has no option {name}: compiling without it", stacklevel=3)
        return False
    return True


@contextlib.contextmanager
def tracing_for(target: str):
    """Trace for a compile-only target. jax asks the local cuDNN library for its version before it
    emits cuDNN's fused attention (jax.nn.dot_product_attention(implementation="cudnn")); a machine
    without a GPU has none, so while this is active the answer is the version the target's config
    declares (cuDNN 9.8). On a machine with cuDNN, or a jax without that check, nothing changes."""
    get(target)
    try:
        from jax._src.cudnn import fused_attention_stablehlo as fa
    except Exception:  # a jax without it: nothing to patch
        yield
        return
    real = getattr(fa, "check_cudnn_version", None)
    try:
        real() if real else None
        patched = False
    except Exception:
        patched = True
    if patched:
        fa.check_cudnn_version = lambda: _CUDNN[0] * 10000 + _CUDNN[1] * 100
    try:
        yield
    finally:
        if patched:
            fa.check_cudnn_version = real


_CUDNN = (9, 8)


def compile_step(target: str, plan, optimizer, loss_fn, batch, grad_accum: int = 1, overrides: dict | None = None,
                 update_in_backward: bool = False, grad_sync: str = "every", trainable=None):
    """jfsdp's real train step for `plan` (whose mesh is made of `devices(target, ...)`), compiled by
    XLA:GPU for `target` with jfsdp's GPU options (`compiler_options(overrides)`). Nothing runs.
    `trainable`: make_train_step's (frozen parameters)."""
    from jfsdp.planning import memory
    with tracing_for(target):
        return memory.compile_step(plan, optimizer, loss_fn, batch, grad_accum,
                                   compiler_options(overrides, getattr(plan, "prefetch", False) or update_in_backward,
                                                    getattr(plan, "async_tp", False), getattr(plan, "context", 1) > 1,
                                                    own_scan_unit(plan)),
                                   update_in_backward=update_in_backward, grad_sync=grad_sync, trainable=trainable)
