"""The training command line (`python train.py`): flags -> TrainConfig -> devices -> `jfsdp.runtime.run.train`.

    python train.py --mesh 2x8                      # the default run: 16 fake CPU devices if no GPU
    python train.py --mesh 1x8 --model llama-small --precision bf16 --steps 2000 --data my_text/

Nothing here imports jax before `setup_devices` has chosen the platform and set XLA_FLAGS: without an
accelerator the devices the mesh needs are faked on the CPU (XLA's host device count, which has to be
set before jax starts), and JAX_PLATFORMS=cpu keeps jax from loading the plugins of accelerators that
are not there. So the flags are parsed and checked with jax-free modules only (`jfsdp.config`,
`jfsdp.runtime.config`, `jfsdp.runtime.console`; `import jfsdp` loads its names lazily), and jax is
imported after. Bad input (and a diverged loss, and an unusable checkpoint) ends with one line
`error: ...` and exit status 2 (`jfsdp.runtime.console.fail`). Ctrl-C (SIGINT) and SIGTERM finish the
current step, save a checkpoint if --ckpt-dir is set, and exit with 130 and 143. On CPU the training
runs in a child process that train.py watches (`jfsdp.runtime.supervisor`): a run that XLA aborts (or
that dies of any signal) still ends with one line saying what happened and which checkpoint is the last.
The run itself (model, plan, data, loop, checkpoints, summary, sample) is `jfsdp.runtime.run`.
See docs/training.md and docs/checkpoints.md for every flag, the data formats and what the progress line shows.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import re

from jfsdp.config.args import ASYNC_TP, RING_ATTENTION, ArgParser, async_tp_option
from jfsdp.config.errors import ConfigError
from jfsdp.config.mesh import mesh_spec
from jfsdp.config.moe_calibration import check_calibrate, read as read_calibration
from jfsdp.config.policy import Strategy, prefetch_by_default
from jfsdp.config.sequence import check_mlp_tile
from jfsdp.config.xla_flags import accelerator_present, gpu_xla_flags, run_hazard
from jfsdp.runtime.config import TrainConfig
from jfsdp.runtime.console import EXIT_INTERRUPTED, fail, note


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    def _get_help_string(self, action):  # no "(default: None)", and no second default where help names one
        if action.default is None or action.default is False or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def parse_args(argv=None) -> TrainConfig:
    d = TrainConfig()
    p = ArgParser(description="Train a language model with Fully Sharded Data Parallel (jfsdp).",
                  formatter_class=HelpFormatter)
    for add_flags in (model_flags, optimization_flags, data_flags, reporting_flags, checkpoint_flags,
                      process_flags):
        add_flags(p, d)
    return TrainConfig(**vars(p.parse_args(argv)))


def model_flags(p: argparse.ArgumentParser, d: TrainConfig) -> None:
    g = p.add_argument_group("parallelism and model")
    g.add_argument("--mesh", default=d.mesh, help="device mesh RxS: R replicas (data axis) of S shards (fsdp axis); "
                   "1xN = full sharding, Nx1 = data parallel, both > 1 = hybrid sharding")
    g.add_argument("--tensor", type=int, default=d.tensor, metavar="T",
                   help="tensor-parallel size: a third mesh axis of T consecutive devices (R*S*T devices in all), "
                   "Megatron tensor and sequence parallelism inside each unit (docs/tensor-parallel.md)")
    g.add_argument("--context", type=int, default=d.context, metavar="C",
                   help="context-parallel size: a mesh axis of C devices between fsdp and tensor (R*S*C*T devices in "
                   "all) over which each sequence is split, attention as a ring, weights sharded over fsdp x context "
                   "(docs/context-parallel.md)")
    g.add_argument("--ring-sums", default=d.ring_sums, choices=("fp32", "bf16"),
                   help="with --context C > 1: the ring backward's sums across hops (dQ, dK, dV) in fp32, or in bf16 "
                   "with bf16 compute: half their memory and ring bytes, dK up to 1.9x one device's error at C = 8 "
                   "(docs/context-parallel.md)")
    g.add_argument("--ring-attention", default=d.ring_attention, choices=RING_ATTENTION,
                   help="with --context C > 1: the ring's per-block attention: cuDNN's fused attention (bf16 compute "
                   "on NVIDIA GPUs; about 9x the blockwise kernel's speed on an H100, more memory at long sequences), "
                   "the blockwise kernel (any backend; the longest sequences), or auto: cuDNN where it applies "
                   "(docs/context-parallel.md)")
    g.add_argument("--async-tp", default=d.async_tp, choices=ASYNC_TP,
                   help="with --tensor T > 1: run each TP all-gather and reduce-scatter as a ring of T-1 transfers, "
                   "each overlapping a block's matmul (a collective matmul; auto: on GPUs)")
    g.add_argument("--strategy", default=d.strategy, help="full_shard (ZeRO-3), shard_grad_op (ZeRO-2), no_shard "
                   "(DDP), hybrid_shard, hybrid_shard_zero2")
    g.add_argument("--model", default=d.model, help="named model config from models/__init__.py: llama-test, "
                   "llama-tiny, llama-small, llama-1b, llama-8b, llama-70b, moe-test, mixtral-8x7b")
    g.add_argument("--precision", default=d.precision, choices=("fp32", "bf16", "fp8", "fp8-rowwise"),
                   help="fp32, or bf16 mixed precision (bf16 gathers and compute, fp32 master weights, "
                   "optimizer state and gradient reduction), or fp8: bf16 plus the units' dense matmuls in "
                   "float8 with their weights all-gathered in float8 (tensorwise scaling), or fp8-rowwise: float8 matmuls "
                   "with a scale per row and column, weights gathered in bf16 (docs/float8.md)")
    g.add_argument("--remat", default=d.remat, choices=("none", "full", "dots"),
                   help="activation checkpointing per unit: none, full (save only the unit input), "
                   "dots (save matmul outputs)")
    g.add_argument("--loss", default=d.loss, choices=("fused", "plain"),
                   help="fused: output head and cross-entropy in chunks of tokens (jfsdp.train.losses."
                   "linear_cross_entropy), the logits of the batch never exist; plain: logits, then log_softmax")
    g.add_argument("--mlp-tile", type=int, default=d.mlp_tile, metavar="N",
                   help="run each unit's MLP over the sequence in tiles of N tokens, each tile rematerialized in its own "
                   "backward, so a unit's backward holds one tile's (N x ffn) intermediates, not the whole sequence's; "
                   "N divides the tokens per device (--seq-len / --context); 0: off (docs/context-parallel.md)")
    g.add_argument("--moe", default=d.moe, choices=("auto", "gather", "ep", "adaptive"),
                   help="MoE models: gather the experts' weights (FSDP) or send the tokens to them (expert "
                   "parallel, all-to-all); auto: per stage by jfsdp's cost model (jfsdp/engine/moe.py); adaptive: "
                   "each step runs the smallest compiled capacity that holds the router's load, in the mode the cost "
                   "model gives it (jfsdp/engine/moe_adaptive.py)")
    g.add_argument("--moe-chunks", default=d.moe_chunks,
                   help="MoE expert-parallel stages: split the tokens into k chunks (an integer, or auto)")
    g.add_argument("--moe-buckets", default=d.moe_buckets,
                   help="--moe adaptive: the capacities (slots per expert per sequence) to compile, e.g. 64,128,256 "
                   "(default: ceil(T*k/E) doubled up to T)")
    g.add_argument("--moe-capacity-cap", type=float, default=d.moe_capacity_cap,
                   help="--moe adaptive: no capacity above this factor x T x k / E (tokens beyond it are dropped)")
    g.add_argument("--moe-calibration", default=d.moe_calibration, metavar="FILE[:PART]",
                   help="--moe adaptive: each capacity runs its fastest measured (mode, chunks) instead of the byte "
                   "model's: a JSON list of {capacity, mode, chunks, seconds}, or an object holding one under "
                   "'calibration' (benchmarks/moe_adaptive.py's parts; jfsdp/planning/moe_calibrate.py)")
    g.add_argument("--moe-switch", default=d.moe_switch, choices=("device", "host"),
                   help="--moe adaptive: device: each MoE layer picks its bucket inside the step (a conditional); "
                   "host: one program per bucket, compiled at the start, the host running the bucket the load of "
                   "the step before the previous one needs (no conditional; a load jump drops, as a static run)")
    g.add_argument("--moe-calibrate", default=d.moe_calibrate, metavar="FILE",
                   help="--moe adaptive: before training, time every (capacity, mode, chunks) variant on this run's "
                   "devices (one compile each), write them to FILE (what --moe-calibration reads) and run with them")


def optimization_flags(p: argparse.ArgumentParser, d: TrainConfig) -> None:
    g = p.add_argument_group("optimization")
    g.add_argument("--steps", type=int, default=d.steps, help="optimizer steps")
    g.add_argument("--batch-size", type=int, default=d.batch_size,
                   help="global batch in sequences; must divide over the mesh's devices")
    g.add_argument("--seq-len", type=int, default=d.seq_len, help="tokens per sequence")
    g.add_argument("--grad-accum", type=int, default=d.grad_accum,
                   help="micro-batches per step (each device's batch is split into this many)")
    g.add_argument("--grad-sync", default=d.grad_sync, choices=("every", "once"),
                   help="with --grad-accum K: reduce-scatter the gradients in every micro-batch, or add them up "
                   "unreduced on each device and reduce once per step (1/K of the gradient traffic; costs an "
                   "unsharded gradient per device in the reduce dtype, two without the prefetch pipeline; not "
                   "with --update-in-backward)")
    g.add_argument("--lr", type=float, default=d.lr, help="peak learning rate (AdamW)")
    g.add_argument("--warmup", type=int, default=d.warmup,
                   help="linear warmup steps, then cosine decay to lr/10 at --steps")
    g.add_argument("--weight-decay", type=float, default=d.weight_decay, help="AdamW weight decay (matrices only)")
    g.add_argument("--clip", type=float, default=d.clip, help="clip the global gradient norm to this; 0 = off")
    g.add_argument("--update-in-backward", action="store_true",
                   help="apply AdamW to each unit inside the backward pass, as soon as its gradient is reduced: "
                   "no whole gradient is held (lower peak where the units' gradient shard is large: few devices); "
                   "same result; needs --grad-accum 1; with --clip the units' backward runs twice (norm, then "
                   "updates)")
    g.add_argument("--freeze", default=d.freeze, metavar="REGEX",
                   help="freeze the parameters whose path (e.g. root/tok_embeddings/embedding, "
                   "units/attention/wq/kernel) the regular expression matches (re.search): gathered for compute, "
                   "but no gradient, reduce-scatter, optimizer state or update; matching nothing is an error")
    g.add_argument("--no-fit-check", action="store_true",
                   help="skip the check before anything is allocated: the planner's memory estimate against the "
                   "devices' memory (GPU memory; on fake CPU devices the host memory available, shared); an "
                   "estimate above it is an error that names the nearest configurations that fit")
    g.add_argument("--seed", type=int, default=d.seed, help="seed of the initialization and the data order")


def data_flags(p: argparse.ArgumentParser, d: TrainConfig) -> None:
    g = p.add_argument_group("data")
    g.add_argument("--data", default=d.data, help="a text file, a folder of text files, a .jsonl file (field "
                   "'text'), or a token array (.bin raw uint16 nanoGPT-style, or .npy); default: the Python "
                   "standard library's source (byte-level, no download)")
    g.add_argument("--data-dtype", default=d.data_dtype, choices=("uint16", "uint32"),
                   help="token dtype of a .bin file (default uint16); .npy files carry their own")


def reporting_flags(p: argparse.ArgumentParser, d: TrainConfig) -> None:
    g = p.add_argument_group("evaluation, logging and sampling")
    g.add_argument("--eval-every", type=int, default=d.eval_every,
                   help="validation loss every N steps (and at step 0 and at the end); 0 = only those two")
    g.add_argument("--eval-iters", type=int, default=d.eval_iters, help="validation batches per evaluation")
    g.add_argument("--log-every", type=int, default=d.log_every,
                   help="steps between logged metrics (the metrics file and the progress line)")
    g.add_argument("--metrics-out", default=d.metrics_out, metavar="FILE",
                   help="JSON lines, one object per logged step; the loss-curve PNG goes next to it; '' = none")
    g.add_argument("--prompt", default=d.prompt, help="text to continue at the end (default: the start of "
                   "a validation document)")
    g.add_argument("--gen-tokens", type=int, default=d.gen_tokens, help="tokens to generate at the end; 0 = none")
    g.add_argument("--temperature", type=float, default=d.temperature, help="sampling temperature; 0 = greedy")


def checkpoint_flags(p: argparse.ArgumentParser, d: TrainConfig) -> None:
    g = p.add_argument_group("checkpoints, profiling, devices")
    g.add_argument("--ckpt-dir", default=d.ckpt_dir, metavar="DIR", help="save checkpoints here (at --save-every, "
                   "at the end, and on Ctrl-C/SIGTERM); a folder that already holds checkpoints needs --resume")
    g.add_argument("--save-every", type=int, default=d.save_every, metavar="N",
                   help="checkpoint every N steps; 0 = only at the end and on Ctrl-C/SIGTERM")
    g.add_argument("--keep", type=int, default=d.keep, metavar="K", help="keep the latest K checkpoints")
    g.add_argument("--resume", action="store_true", help="continue from the latest complete checkpoint in "
                   "--ckpt-dir, data position included (mesh and strategy may differ); none yet: start at step 0")
    g.add_argument("--stop-after", type=int, default=d.stop_after, metavar="N",
                   help="stop this invocation after N steps (saving a checkpoint); --resume continues; 0 = off")
    g.add_argument("--init-from", default=d.init_from, metavar="HF_DIR",
                   help="start from a Hugging Face Llama folder (config.json + *.safetensors; its tokenizer.json, "
                   "if any, tokenizes text data); the model config comes from the folder")
    g.add_argument("--profile", default=d.profile, metavar="DIR",
                   help="write a jax.profiler trace of 3 steps to DIR (view with TensorBoard / XProf)")
    g.add_argument("--cpu-devices", type=int, default=d.cpu_devices, metavar="N",
                   help="on a CPU-only machine, fake N devices instead of the number the mesh needs")


def process_flags(p: argparse.ArgumentParser, d: TrainConfig) -> None:
    g = p.add_argument_group("more than one process (see docs/multi-process.md)")
    g.add_argument("--coordinator", default=d.coordinator, metavar="HOST:PORT",
                   help="address of process 0's coordinator; with --num-processes and --process-id. Without "
                   "them, a SLURM or Open MPI launch is detected; otherwise the run is one process")
    g.add_argument("--num-processes", type=int, default=d.num_processes, metavar="N", help="processes in the run")
    g.add_argument("--process-id", type=int, default=d.process_id, metavar="I", help="this process, 0..N-1")
    g.add_argument("--init-timeout", type=float, default=d.init_timeout, metavar="S",
                   help="seconds to wait for the coordinator and for every process to join")
    g.add_argument("--heartbeat-timeout", type=int, default=d.heartbeat_timeout, metavar="S",
                   help="seconds without a peer's heartbeat before the run is stopped (a process died)")


# ---- before jax: the checks and the devices -----------------------------------------------------

def check_flags(c: TrainConfig) -> int | None:
    """What can be checked before jax is imported (so bad input fails in a fraction of a second).
    Returns the number of devices the mesh needs in this process, or None if the mesh is malformed
    (the run then reports it, with the one authoritative message)."""
    for name in ("steps", "batch_size", "seq_len", "grad_accum", "eval_iters", "log_every"):
        if getattr(c, name) < 1:
            fail(f"--{name.replace('_', '-')} must be positive, got {getattr(c, name)}")
    for name in ("eval_every", "save_every", "gen_tokens", "warmup", "cpu_devices", "stop_after"):
        if getattr(c, name) < 0:
            fail(f"--{name.replace('_', '-')} must not be negative, got {getattr(c, name)}")
    if not c.lr > 0 or not math.isfinite(c.lr):
        fail(f"--lr must be positive, got {c.lr}")
    if c.clip < 0 or c.temperature < 0 or c.weight_decay < 0:
        fail("--clip, --temperature and --weight-decay must not be negative")
    if c.keep < 1:
        fail(f"--keep must be at least 1, got {c.keep}")
    if (c.resume or c.save_every) and not c.ckpt_dir:
        fail(f"{'--resume' if c.resume else '--save-every'} needs --ckpt-dir")
    if c.tensor != 1:
        check_tensor_flags(c)
    if c.context != 1:
        check_context_flags(c)
    if c.ring_sums != "fp32" and (c.context == 1 or c.precision == "fp32"):
        fail(f"--ring-sums {c.ring_sums} applies to --context C > 1 with bf16 compute")
    if c.ring_attention == "cudnn" and (c.context == 1 or c.precision == "fp32"):
        fail("--ring-attention cudnn applies to --context C > 1 with bf16 compute (cuDNN takes 16-bit inputs)")
    if c.ring_attention == "cudnn" and not accelerator_present():
        fail("--ring-attention cudnn needs an NVIDIA GPU (cuDNN); this host has none: use auto or blockwise")
    try:
        async_tp_option(c.async_tp, c.tensor)
        check_mlp_tile(c.mlp_tile, c.seq_len, c.context, c.tensor)
        if c.moe_calibrate:
            check_calibrate(c.moe_calibrate, c.moe, c.moe_calibration)
        if c.moe_switch != "device" and c.moe != "adaptive":
            raise ConfigError(f"--moe-switch {c.moe_switch} applies to --moe adaptive")
        if c.moe_calibration:
            read_calibration(c.moe_calibration)   # read again where the run builds its model
    except ConfigError as e:
        fail(str(e))
    try:
        n = mesh_spec(c.mesh, c.tensor, c.context).devices
    except ConfigError:
        return None
    rows = n // (c.tensor * c.context)   # the batch's rows go over R*S devices; the sequence over C*T
    if c.batch_size % rows:
        fail(f"--batch-size {c.batch_size} does not divide over the {rows} devices of mesh {c.mesh}")
    if (c.batch_size // rows) % c.grad_accum:
        fail(f"per-device batch {c.batch_size // rows} does not divide into --grad-accum {c.grad_accum} micro-batches")
    if c.update_in_backward and c.grad_accum != 1:
        fail("--update-in-backward needs --grad-accum 1 (each unit is updated as soon as its gradient is reduced), "
             f"got --grad-accum {c.grad_accum}")
    if c.grad_sync == "once" and c.update_in_backward:
        fail("--grad-sync once cannot combine with --update-in-backward (the optimizer runs on each unit's reduced "
             "gradient inside the backward pass; 'once' reduces only after the last micro-batch)")
    procs = c.num_processes or 1
    if procs > 1 and n % procs:
        fail(f"mesh {c.mesh} has {n} devices, which do not divide over {procs} processes")
    return n // procs


def check_tensor_flags(c: TrainConfig) -> None:
    """--tensor T: a positive integer dividing --seq-len; what T > 1 does not support yet is refused."""
    if c.tensor < 1:
        fail(f"--tensor must be at least 1, got {c.tensor}")
    if c.seq_len % c.tensor:
        fail(f"--tensor {c.tensor} does not divide --seq-len {c.seq_len} (sequence parallelism splits the sequence)")
    later = [flag for flag, on in [(f"--precision {c.precision}", c.precision == "fp8-rowwise"),
                                   ("--strategy no_shard", c.strategy.strip().lower() == "no_shard")] if on]
    if later:
        fail(f"--tensor {c.tensor}: {', '.join(later)} {'is' if len(later) == 1 else 'are'} not supported with tensor "
             "parallelism yet (docs/tensor-parallel.md)")


def check_context_flags(c: TrainConfig) -> None:
    """--context C: a positive integer whose 2C chunks (times T) divide --seq-len; what C > 1 does not
    support yet is refused (docs/context-parallel.md)."""
    if c.context < 1:
        fail(f"--context must be at least 1, got {c.context}")
    try:
        mesh_spec(c.mesh, max(c.tensor, 1), c.context).check_seq_len(c.seq_len)
    except ConfigError as e:
        fail(str(e))
    later = [flag for flag, on in [(f"--precision {c.precision}", c.precision.startswith("fp8")),
                                   ("--strategy no_shard", c.strategy.strip().lower() == "no_shard"),
                                   ("--update-in-backward", c.update_in_backward),
                                   ("--init-from", bool(c.init_from)),
                                   ("several processes", (c.num_processes or 1) > 1 or bool(c.coordinator))] if on]
    if c.context > 1 and later:
        fail(f"--context {c.context}: {', '.join(later)} {'is' if len(later) == 1 else 'are'} not supported with "
             "context parallelism yet (docs/context-parallel.md)")


def prefetches(c: TrainConfig) -> bool:
    """Whether the plan will run jfsdp's prefetch pipeline on these GPUs (`fully_shard`'s default,
    jfsdp.config.policy.prefetch_by_default), decided before jax starts. Bad input here is reported
    once the run starts."""
    try:
        # the plan's shards: fsdp x context (weights are sharded over both at C > 1)
        return prefetch_by_default(Strategy.parse(c.strategy), c.remat, mesh_spec(c.mesh).shards * max(c.context, 1),
                                   on_gpu=True)
    except ConfigError:
        return False


def setup_devices(c: TrainConfig, n_needed: int | None) -> None:
    """Before jax is imported: on a machine without an accelerator, fake the mesh's devices on the CPU.
    An explicit JAX_PLATFORMS wins; NVIDIA GPUs (and TPUs) are detected without importing jax."""
    requested = os.environ.get("JAX_PLATFORMS", "").strip().lower()
    on_cpu = requested.split(",")[0] == "cpu" if requested else not accelerator_present()
    if not on_cpu:
        if c.cpu_devices:
            fail("--cpu-devices only applies on a machine without an accelerator (or with JAX_PLATFORMS=cpu)")
        # FSDP's prefetch on GPUs: XLA reads the flags when jax starts
        os.environ["XLA_FLAGS"] = gpu_xla_flags(prefetch=prefetches(c) or c.update_in_backward,
                                                async_tp=c.tensor > 1 and c.async_tp != "off", context=c.context > 1)
        return
    if n_needed is None and not c.cpu_devices:
        return  # a malformed mesh: jfsdp.parse_mesh reports it once jax is imported; nothing to fake
    n = c.cpu_devices or n_needed
    flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "", os.environ.get("XLA_FLAGS", ""))
    # XLA:CPU's defaults: its memory-minimizing scheduler (jfsdp.config.xla_flags.CPU_FLAGS) is for
    # compiling only; a run under it mixes up collectives between devices (run_hazard)
    # only where XLA will read these flags: in a process whose jax already started, the step's own guard
    # (jfsdp.train.step) reads the flags XLA started with
    if n > 1 and "jax" not in sys.modules and run_hazard(flags):
        fail(run_hazard(flags))
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")   # don't probe for GPU/TPU plugins
    why = "JAX_PLATFORMS=cpu" if requested else "no accelerator found"
    note(f"{why}: faking {n} CPU devices" + ("" if c.cpu_devices else f" for mesh {c.mesh} (--cpu-devices N overrides)"))


# ---- the run -------------------------------------------------------------------------------------

def main(argv=None) -> int:
    """The whole command: returns the exit status (0, 130, 143; on CPU those of `supervisor.supervise`
    too); bad input exits 2 through `fail`."""
    c = parse_args(argv)
    n_needed = check_flags(c)
    setup_devices(c, n_needed)
    from jfsdp.runtime import distributed, supervisor
    try:
        procs = distributed.detect(c.coordinator, c.num_processes, c.process_id,
                                   init_timeout=c.init_timeout, heartbeat_timeout=c.heartbeat_timeout)
    except ConfigError as e:
        fail(str(e))
    # on CPU the training runs in a child process, so that an abort by XLA still ends with one line
    if supervisor.applies(procs.multi) and (status := supervisor.supervise(c.ckpt_dir)) is not None:
        return status
    try:
        distributed.initialize(procs, cpu=os.environ.get("JAX_PLATFORMS", "").startswith("cpu"))   # jax from here on
    except ConfigError as e:
        fail(str(e))
    try:
        from jfsdp.runtime import run
        return run.train(c)
    except KeyboardInterrupt:          # Ctrl-C before or after the loop (the loop handles its own)
        note("interrupted")
        return EXIT_INTERRUPTED
