"""Train a byte-level Llama with jfsdp: flags -> TrainConfig -> data + FSDP plan -> loop -> summary.

    python train.py --mesh 2x8                      # the default run: 16 fake CPU devices if no GPU
    python train.py --mesh 1x8 --model llama-small --precision bf16 --steps 2000 --data my_text/

Without an accelerator the devices the mesh needs are faked on the CPU (XLA's host device count,
which has to be set before jax is imported: that is why this file parses its flags first and imports
jax afterwards). Bad input (and a diverged loss, and an unusable checkpoint) ends with one line
`error: ...` and exit status 2. Ctrl-C (SIGINT) and SIGTERM finish the current step, save a checkpoint if
--ckpt-dir is set, and exit with 130 and 143 (128 + the signal number, the shell's convention).
See README.md (Training, Checkpoints) for every flag, the data formats and what the progress line shows.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import os
import re
import shutil
import signal
import sys
import time

EXIT_BAD_INPUT, EXIT_INTERRUPTED, EXIT_TERMINATED = 2, 130, 143


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    # parallelism and model
    mesh: str = "2x8"
    strategy: str = "full_shard"
    model: str = "llama-tiny"
    precision: str = "fp32"
    remat: str = "none"
    loss: str = "fused"
    # optimization
    steps: int = 300
    batch_size: int = 16            # global, in sequences
    seq_len: int = 256
    grad_accum: int = 1
    lr: float = 3e-3
    warmup: int = 30
    weight_decay: float = 0.1
    clip: float = 1.0               # global gradient norm; 0 turns clipping off
    seed: int = 0
    # data
    data: str | None = None         # None: the Python standard library (see jfsdp/data.py)
    data_dtype: str | None = None   # for .bin token files (default uint16)
    # evaluation, logging, sampling
    eval_every: int = 50
    eval_iters: int = 4
    log_every: int = 10
    metrics_out: str | None = "out/metrics.jsonl"
    prompt: str | None = None
    gen_tokens: int = 100
    temperature: float = 0.8
    # checkpoints (see jfsdp/checkpoint.py), profiling, devices
    ckpt_dir: str | None = None
    save_every: int = 0
    keep: int = 3
    resume: bool = False
    stop_after: int = 0
    init_from: str | None = None
    profile: str | None = None
    cpu_devices: int = 0
    # more than one process (jfsdp/distributed.py); none given and no cluster launcher: one process
    coordinator: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    init_timeout: float = 60.0
    heartbeat_timeout: int = 30


class ArgParser(argparse.ArgumentParser):
    def error(self, message):  # one line, like every other bad input (argparse prints usage + error)
        fail(f"{message} (see --help)")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    def _get_help_string(self, action):  # no "(default: None)", and no second default where help names one
        if action.default is None or action.default is False or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def parse_args(argv=None) -> TrainConfig:
    d = TrainConfig()
    p = ArgParser(description="Train a language model with Fully Sharded Data Parallel (jfsdp).",
                  formatter_class=HelpFormatter)
    g = p.add_argument_group("parallelism and model")
    g.add_argument("--mesh", default=d.mesh, help="device mesh RxS: R replicas (data axis) of S shards (fsdp axis); "
                   "1xN = full sharding, Nx1 = data parallel, both > 1 = hybrid sharding")
    g.add_argument("--strategy", default=d.strategy, help="full_shard (ZeRO-3), shard_grad_op (ZeRO-2), no_shard "
                   "(DDP), hybrid_shard, hybrid_shard_zero2")
    g.add_argument("--model", default=d.model, help="named model config from models/__init__.py: llama-test, "
                   "llama-tiny, llama-small, llama-1b, llama-8b, llama-70b")
    g.add_argument("--precision", default=d.precision, choices=("fp32", "bf16"),
                   help="fp32, or bf16 mixed precision (bf16 gathers and compute, fp32 master weights, "
                   "optimizer state and gradient reduction)")
    g.add_argument("--remat", default=d.remat, choices=("none", "full", "dots"),
                   help="activation checkpointing per unit: none, full (save only the unit input), "
                   "dots (save matmul outputs)")
    g.add_argument("--loss", default=d.loss, choices=("fused", "plain"),
                   help="fused: output head and cross-entropy in chunks of tokens (jfsdp.ops.linear_cross_entropy), "
                   "the logits of the batch never exist; plain: logits, then log_softmax")
    g = p.add_argument_group("optimization")
    g.add_argument("--steps", type=int, default=d.steps, help="optimizer steps")
    g.add_argument("--batch-size", type=int, default=d.batch_size,
                   help="global batch in sequences; must divide over the mesh's devices")
    g.add_argument("--seq-len", type=int, default=d.seq_len, help="tokens per sequence")
    g.add_argument("--grad-accum", type=int, default=d.grad_accum,
                   help="micro-batches per step (each device's batch is split into this many)")
    g.add_argument("--lr", type=float, default=d.lr, help="peak learning rate (AdamW)")
    g.add_argument("--warmup", type=int, default=d.warmup,
                   help="linear warmup steps, then cosine decay to lr/10 at --steps")
    g.add_argument("--weight-decay", type=float, default=d.weight_decay, help="AdamW weight decay (matrices only)")
    g.add_argument("--clip", type=float, default=d.clip, help="clip the global gradient norm to this; 0 = off")
    g.add_argument("--seed", type=int, default=d.seed, help="seed of the initialization and the data order")
    g = p.add_argument_group("data")
    g.add_argument("--data", default=d.data, help="a text file, a folder of text files, a .jsonl file (field "
                   "'text'), or a token array (.bin raw uint16 nanoGPT-style, or .npy); default: the Python "
                   "standard library's source (byte-level, no download)")
    g.add_argument("--data-dtype", default=d.data_dtype, choices=("uint16", "uint32"),
                   help="token dtype of a .bin file (default uint16); .npy files carry their own")
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
    g = p.add_argument_group("more than one process (see README: Multi-process runs)")
    g.add_argument("--coordinator", default=d.coordinator, metavar="HOST:PORT",
                   help="address of process 0's coordinator; with --num-processes and --process-id. Without "
                   "them, a SLURM or Open MPI launch is detected; otherwise the run is one process")
    g.add_argument("--num-processes", type=int, default=d.num_processes, metavar="N", help="processes in the run")
    g.add_argument("--process-id", type=int, default=d.process_id, metavar="I", help="this process, 0..N-1")
    g.add_argument("--init-timeout", type=float, default=d.init_timeout, metavar="S",
                   help="seconds to wait for the coordinator and for every process to join")
    g.add_argument("--heartbeat-timeout", type=int, default=d.heartbeat_timeout, metavar="S",
                   help="seconds without a peer's heartbeat before the run is stopped (a process died)")
    return TrainConfig(**vars(p.parse_args(argv)))


# ---- failing and noticing: one line each ---------------------------------------------------------

_ON_FAIL = []   # what to close before exiting on an error (the checkpointer: its pending save and threads)


def fail(message: str):
    for close in _ON_FAIL:
        try:
            close()
        except Exception:   # already failing: the one-line message below is what matters
            pass
    print(f"error: {message}", file=sys.stderr, flush=True)
    sys.exit(EXIT_BAD_INPUT)


QUIET = False   # set in processes other than 0 of a multi-process run: only process 0 reports


def note(message: str):
    if not QUIET:
        print(message, file=sys.stderr, flush=True)


def check_flags(c: TrainConfig) -> int | None:
    """What can be checked before jax is imported (so bad input fails in a fraction of a second).
    Returns the number of devices the mesh needs in this process, or None if the mesh is malformed
    (jfsdp then reports it, with the one authoritative message)."""
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
    m = re.fullmatch(r"\s*(\d+)\s*[xX]\s*(\d+)\s*", c.mesh)
    if not m or int(m.group(1)) < 1 or int(m.group(2)) < 1:
        return None
    n = int(m.group(1)) * int(m.group(2))
    if c.batch_size % n:
        fail(f"--batch-size {c.batch_size} does not divide over the {n} devices of mesh {c.mesh}")
    if (c.batch_size // n) % c.grad_accum:
        fail(f"per-device batch {c.batch_size // n} does not divide into --grad-accum {c.grad_accum} micro-batches")
    procs = c.num_processes or 1
    if procs > 1 and n % procs:
        fail(f"mesh {c.mesh} has {n} devices, which do not divide over {procs} processes")
    return n // procs


def setup_devices(c: TrainConfig, n_needed: int | None) -> None:
    """Before jax is imported: on a machine without an accelerator, fake the mesh's devices on the CPU.
    An explicit JAX_PLATFORMS wins; NVIDIA GPUs (and TPUs) are detected without importing jax."""
    requested = os.environ.get("JAX_PLATFORMS", "").strip().lower()
    has_accel = bool(shutil.which("nvidia-smi")) or os.path.exists("/dev/nvidia0") or os.path.exists("/dev/accel0")
    on_cpu = requested.split(",")[0] == "cpu" if requested else not has_accel
    if not on_cpu:
        if c.cpu_devices:
            fail("--cpu-devices only applies on a machine without an accelerator (or with JAX_PLATFORMS=cpu)")
        from jfsdp.targets import gpu_xla_flags  # FSDP prefetch on GPUs; XLA reads the flags when jax starts
        os.environ["XLA_FLAGS"] = gpu_xla_flags()
        return
    if n_needed is None and not c.cpu_devices:
        return  # a malformed mesh: jfsdp.parse_mesh reports it once jax is imported; nothing to fake
    n = c.cpu_devices or n_needed
    flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "", os.environ.get("XLA_FLAGS", ""))
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")   # don't probe for GPU/TPU plugins
    why = "JAX_PLATFORMS=cpu" if requested else "no accelerator found"
    note(f"{why}: faking {n} CPU devices" + ("" if c.cpu_devices else f" for mesh {c.mesh} (--cpu-devices N overrides)"))


# ---- the run -------------------------------------------------------------------------------------

def main(argv=None) -> int:
    c = parse_args(argv)
    n_needed = check_flags(c)
    setup_devices(c, n_needed)
    from jfsdp import distributed
    try:
        procs = distributed.detect(c.coordinator, c.num_processes, c.process_id,
                                   init_timeout=c.init_timeout, heartbeat_timeout=c.heartbeat_timeout)
        distributed.initialize(procs, cpu=os.environ.get("JAX_PLATFORMS", "").startswith("cpu"))
    except distributed.ConfigError as e:
        fail(str(e))
    try:
        return train(c)
    except KeyboardInterrupt:          # Ctrl-C before or after the loop (the loop handles its own)
        note("interrupted")
        return EXIT_INTERRUPTED


def train(c: TrainConfig) -> int:
    import jax
    import jax.numpy as jnp
    import numpy as np

    import jfsdp
    import models
    from jfsdp import checkpoint as jckpt
    from jfsdp import data as jdata
    from jfsdp import distributed
    from jfsdp import hf as jhf
    from jfsdp import metrics as jm

    t_launch = time.perf_counter()
    # -- configuration that needs jfsdp/models: every ConfigError/ValueError here is bad input
    try:
        r, s = jfsdp.parse_mesh(c.mesh)
        strategy = jfsdp.Strategy.parse(c.strategy)
        mp = jfsdp.MixedPrecision.parse(c.precision)
        if c.init_from:
            mcfg = models.LlamaConfig(**jhf.read_config(c.init_from))
            model_name = f"{c.init_from} (Hugging Face)"
        else:
            mcfg, model_name = models.get_config(c.model), c.model
        if not isinstance(mcfg, models.LlamaConfig):
            raise jfsdp.ConfigError(f"model '{c.model}' is not a language model; train.py trains the llama-* models")
        if c.seq_len > mcfg.max_seq_len:
            raise jfsdp.ConfigError(f"--seq-len {c.seq_len} exceeds the model's max_seq_len {mcfg.max_seq_len}")
        tokenizer = jhf.tokenizer_path(c.init_from) if c.init_from else None
        corpus = jdata.load_tokens(c.data, mcfg.vocab_size, dtype=c.data_dtype, tokenizer=tokenizer)
        if c.prompt is not None and not corpus.can_decode:
            raise jfsdp.ConfigError("--prompt needs text data; a token file has no tokenizer here")
        devices = jax.devices()
        lead = jax.process_index() == 0
        if not lead:   # one process reports: the others print nothing but errors and write no files
            global QUIET
            QUIET = True
            sys.stdout = open(os.devnull, "w")
            c = dataclasses.replace(c, metrics_out=None)
        if len(devices) < r * s:
            raise jfsdp.ConfigError(f"mesh {c.mesh} needs {r * s} devices but {len(devices)} "
                                    f"{devices[0].platform.upper()} device(s) are present")
        if len(devices) > r * s:
            note(f"using {r * s} of the {len(devices)} {devices[0].platform} devices")
        mesh = distributed.make_mesh(c.mesh, devices=devices[: r * s])
        root, unit, n_units = models.parts(mcfg)
        shard = lambda head: jfsdp.fully_shard(jfsdp.Stacked(root, unit, n_units, head_method=head), mesh,
                                               jax.ShapeDtypeStruct((1, c.seq_len), jnp.int32),
                                               strategy=strategy, mp_policy=mp, remat=c.remat)
        # the fused loss takes (hidden, head weight) from the root; sampling needs logits: a second
        # plan over the same parameters with the plain head (nothing is compiled until it is used)
        logits_plan = shard("head")
        plan = shard("head_features") if c.loss == "fused" else logits_plan
        rows = jdata.process_rows(plan.batch_sharding, c.batch_size, c.seq_len)
        loader = jdata.Loader(corpus, c.batch_size, c.seq_len, seed=c.seed, rows=rows)
        ckpt, resume_step = None, None
        if c.ckpt_dir:
            ckpt = jckpt.Checkpointer(c.ckpt_dir, keep=c.keep)
            _ON_FAIL.append(ckpt.close)
            resume_step = ckpt.latest_step()
            if resume_step is not None and not c.resume:
                raise jfsdp.ConfigError(f"--ckpt-dir {c.ckpt_dir} already holds checkpoints (latest: step "
                                        f"{resume_step}); pass --resume to continue from it, or use another folder")
            if ckpt.partial_writes():
                note(f"{c.ckpt_dir}: ignoring unfinished checkpoint write(s) {', '.join(ckpt.partial_writes())} "
                     "(a save that was killed)")
            if c.resume and resume_step is None:
                note(f"--resume: no checkpoint in {c.ckpt_dir} yet: starting at step 0")
        # what a checkpoint must share with this run to be resumed by it (mesh and strategy may differ)
        identity = {"model_config": dataclasses.asdict(mcfg), "precision": c.precision, "data": c.data or "stdlib",
                    "data_dtype": c.data_dtype, "tokenizer": tokenizer, "batch_size": c.batch_size,
                    "seq_len": c.seq_len, "seed": c.seed}
        out = jm.MetricsFile(c.metrics_out or None, append=resume_step is not None)   # an unwritable path is bad input
    except (jfsdp.ConfigError, ValueError) as e:
        fail(str(e))
    except OSError as e:
        fail(f"{e.filename}: {e.strerror}")

    n_dev = r * s
    platform = devices[0].platform
    loss_fn = jfsdp.ops.lm_loss(vocab_major=mcfg.tie_embeddings) if c.loss == "fused" else models.loss_fn(mcfg)
    tokens_per_step = c.batch_size * c.seq_len
    flops_per_token = jm.llama_flops_per_token(mcfg, c.seq_len)
    peak = jm.peak_flops(devices[0], c.precision)
    put = lambda b: jdata.to_global(b, plan.batch_sharding, c.batch_size)

    print(f"model {model_name}: {mcfg.num_params() / 1e6:.2f}M params, {n_units} units | mesh {c.mesh} "
          f"({r} replicas x {s} shards) on {n_dev} {platform} devices | {strategy.value}, {c.precision}, "
          f"remat {c.remat}")
    if jax.process_count() > 1:
        print(f"processes {jax.process_count()}, {len(mesh.local_devices)} devices each | "
              + "\n      ".join(distributed.describe_mesh(mesh)))
    print(f"data  {corpus.describe()}")
    print(f"batch {c.batch_size} x {c.seq_len} = {tokens_per_step:,} tokens/step, grad accum {c.grad_accum} | "
          f"{c.steps} steps = {jm.fmt_count(c.steps * tokens_per_step)} tokens "
          f"({c.steps * c.batch_size / loader.n_windows:.3g} epochs) | lr {c.lr:g}, "
          f"warmup {min(c.warmup, c.steps - 1)}, cosine to {c.lr / 10:g}",
          flush=True)

    # -- state, optimizer, compiled programs
    schedule = jfsdp.warmup_cosine(c.lr, c.steps, c.warmup)
    opt = jfsdp.adamw(schedule, weight_decay=c.weight_decay, clip_norm=c.clip or None, mask=plan.decay_mask())
    t0 = time.perf_counter()
    try:
        if resume_step is not None:
            meta = ckpt.read_meta(resume_step)
            ckpt.check_compatible(resume_step, meta, identity, plan)
            state = ckpt.restore(resume_step, jfsdp.abstract_state(plan, opt))
            if not isinstance(meta.get("loader"), dict) or "step" not in meta["loader"]:
                raise jckpt.CheckpointError(f"{ckpt.step_dir(resume_step) / 'meta/metadata'}: no data position")
            loader.restore(meta["loader"])
            note(f"resumed from {ckpt.step_dir(resume_step)} (step {loader.step}, saved on mesh {meta['mesh']}, "
                 f"{meta['strategy']})")
        elif c.init_from:
            state = jfsdp.init_state(plan, opt, params=jhf.load_params(plan, c.init_from))
        else:
            state = jfsdp.init_state(plan, opt, jax.random.key(c.seed))
        train_step = jfsdp.make_train_step(plan, opt, loss_fn, grad_accum=c.grad_accum)
        batch = put(loader.batch(loader.step))
        compiled = train_step.lower(state, batch).compile()
    except jfsdp.ConfigError as e:
        fail(str(e))
    except OSError as e:
        fail(f"{e.filename}: {e.strerror}")

    def save(step: int) -> str:
        """Start an asynchronous save of the current state (a non-finite state is never saved)."""
        meta = {**identity, "loader": loader.state(), "mesh": c.mesh, "strategy": strategy.value, "model": model_name,
                "run": dataclasses.asdict(c), "jax": jax.__version__}
        try:
            return str(ckpt.save(step, state, meta, plan=plan))
        except jckpt.NonFiniteState as e:
            out.close()
            ckpt.wait()   # the previous save, still being written, is the last good one: finish it
            last_good = ckpt.latest_step()
            fail(f"{e}: training diverged (try a lower --lr, or --clip); "
                 + (f"the last good checkpoint is {ckpt.step_dir(last_good)}" if last_good is not None
                    else "no checkpoint was saved"))
    eval_loss = jax.jit(plan.loss(loss_fn))
    val_set = [put(b) for b in loader.val_batches(c.eval_iters)]
    mem, mem_src = jm.device_memory(mesh.local_devices, compiled)
    compile_s = time.perf_counter() - t0
    print(f"compiled the train step in {compile_s:.1f}s | memory per device {jm.fmt_bytes(mem)} ({mem_src})"
          + ("" if peak else f" | MFU n/a on {platform.upper()}"), flush=True)

    history = {"val": []}

    def evaluate(step: int) -> float:
        loss = float(np.mean([float(eval_loss(state.params, b)) for b in val_set]))
        history["val"].append((step, loss))
        out.write(step=step, val_loss=loss)
        return loss

    def throughput(tps: float) -> dict:
        tflops = tps * flops_per_token / n_dev / 1e12
        return {"tokens_per_sec": tps, "tflops_per_device": tflops, "mfu": tflops * 1e12 / peak if peak else None}

    # -- the loop
    tty = sys.stderr.isatty() and lead
    print_every = c.log_every * max(1, math.ceil(c.steps / c.log_every / 15))   # ~15 lines when not a TTY
    bar = None
    if tty:
        from tqdm import tqdm
        # a fixed size with a fallback: tqdm hides its bar on a terminal that reports 0 x 0
        size = shutil.get_terminal_size((120, 24))
        bar = tqdm(total=c.steps, initial=loader.step, desc="train", unit="step", ncols=size.columns, nrows=size.lines,
                   file=sys.stderr, bar_format="{desc} {n_fmt}/{total_fmt} [{elapsed}<{remaining}]{postfix}")
    say = (lambda msg: bar.write(msg, file=sys.stderr)) if bar else (lambda msg: print(msg, flush=True))

    pending, last = [], {"loss": None, "tokens_per_sec": None, "mem": mem}
    profile_window = range(min(loader.step + 2, c.steps - 1), min(loader.step + 5, c.steps)) if c.profile else range(0)
    interrupted = False
    # Ctrl-C and SIGTERM: finish the step in flight, then stop and save (a second one stops at once)
    stop = {}

    def on_signal(signum, frame):
        if stop:
            raise KeyboardInterrupt
        stop["signal"] = signum
    handlers = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    stop_at = min(c.steps, loader.step + c.stop_after) if c.stop_after else c.steps
    saved_at = None
    t_train0 = time.perf_counter()
    try:
        v0 = evaluate(loader.step)
        say(f"step {loader.step:>5} | val loss {v0:.4f}")
        t_mark = time.perf_counter()
        mark_step, step0, timed = loader.step, loader.step, 0.0   # timed: seconds spent in train steps only
        while loader.step < stop_at and not stop:
            step = loader.step
            if c.profile and step == profile_window.start:
                jax.profiler.start_trace(c.profile)
            batch = put(next(loader))
            state, m = compiled(state, batch)
            pending.append(m["loss"])
            done = loader.step
            if c.profile and done == profile_window.stop:
                jax.block_until_ready(state)
                jax.profiler.stop_trace()
                say(f"profile: trace of steps {profile_window.start + 1}-{done} written to {c.profile} "
                    f"(view: tensorboard --logdir {c.profile})")
            if bar:
                bar.update(1)
            if done % c.log_every == 0 or done == c.steps:
                losses = np.array(jax.device_get(pending), dtype=np.float64)
                pending = []
                now = time.perf_counter()
                if not np.all(np.isfinite(losses)):
                    bad = done - len(losses) + int(np.argmin(np.isfinite(losses))) + 1
                    out.close()
                    if ckpt:
                        ckpt.wait()   # finish the last good save; this state is never saved
                    fail(f"loss is {losses[~np.isfinite(losses)][0]} at step {bad}: training diverged "
                         f"(try a lower --lr, or --clip)")
                tps = (done - mark_step) * tokens_per_step / (now - t_mark)
                timed += now - t_mark
                if platform != "cpu":
                    mem, _ = jm.device_memory(mesh.local_devices)
                rec = {"step": done, "loss": float(losses.mean()), "lr": float(schedule(done - 1)),
                       "grad_norm": float(m["grad_norm"]), **throughput(tps), "memory_bytes": mem,
                       "epoch": round(loader.epoch(), 4), "time_s": round(now - t_launch, 3)}
                out.write(**rec)
                last.update(rec)
                line = progress_line(rec, platform, jm)
                if bar:
                    bar.set_postfix_str(line, refresh=True)
                elif done % print_every == 0 or done == c.steps:
                    say(f"step {done:>5} | {line}")
                t_mark, mark_step = time.perf_counter(), done
            if (c.eval_every and done % c.eval_every == 0) or done == c.steps:
                t_eval = time.perf_counter()
                v = evaluate(done)
                say(f"step {done:>5} | val loss {v:.4f}")
                t_mark += time.perf_counter() - t_eval   # evaluation is not training throughput
            if ckpt and c.save_every and done % c.save_every == 0:
                saved_at = save(done)
    except KeyboardInterrupt:   # a second signal, or one before the loop: no step is complete, nothing saved
        interrupted = True
        if bar:
            bar.close()
            bar = None
        note(f"interrupted at step {loader.step}/{c.steps}: stopping now, without saving a checkpoint")
        if ckpt:
            ckpt.close()   # a save already under way still completes (or stays an unfinished tmp folder)
    for sig, h in handlers.items():
        signal.signal(sig, h)
    if bar:
        bar.close()
    if ckpt and not interrupted:
        if saved_at is None or not saved_at.endswith(f"/{loader.step}"):
            saved_at = save(loader.step)
        ckpt.wait()   # the last save is on disk before this process says so or exits
        ckpt.close()
    if stop:
        interrupted = True
        name = "interrupted" if stop["signal"] == signal.SIGINT else "terminated"
        how = "Ctrl-C" if stop["signal"] == signal.SIGINT else "SIGTERM"
        note(f"{name} at step {loader.step}/{c.steps} ({how}): stopping; "
             + (f"checkpoint saved to {saved_at}" if ckpt else "no checkpoint saved (no --ckpt-dir)"))
    elif ckpt:
        note(f"checkpoint saved to {saved_at}")
    train_s = time.perf_counter() - t_train0
    out.close()

    # -- summary, plot, sample
    steps_done = loader.step
    vals = history["val"]
    print(f"\n== summary: {steps_done}/{c.steps} steps in {time.perf_counter() - t_launch:.1f}s "
          f"(compile {compile_s:.1f}s, training + eval {train_s:.1f}s)")
    if last["loss"] is not None:
        tp = throughput((last["step"] - step0) * tokens_per_step / max(timed, 1e-9))
        print(f"   train loss {last['loss']:.4f} | {tp['tokens_per_sec']:,.0f} tokens/s (train steps only) | "
              f"{tp['tflops_per_device']:.3g} TFLOP/s per device | "
              + (f"MFU {tp['mfu']:.1%}" if peak else f"MFU n/a on {platform.upper()}"))
    if len(vals) > 1:
        print(f"   val loss {vals[0][1]:.4f} (step {vals[0][0]}) -> {vals[-1][1]:.4f} (step {vals[-1][0]}): "
              f"{vals[-1][1] / vals[0][1]:.3f}x")
    print(f"   peak memory per device {jm.fmt_bytes(mem)} ({mem_src if platform == 'cpu' else 'allocator peak'})")
    if c.metrics_out:
        png = jm.plot_loss(out.records, os.path.splitext(c.metrics_out)[0] + ".png",
                           f"{c.model} on {c.mesh} ({strategy.value}, {c.precision}): {corpus.name}")
        print(f"   metrics {c.metrics_out}" + (f" | loss curve {png}" if png else ""))
    if interrupted:
        return EXIT_TERMINATED if stop.get("signal") == signal.SIGTERM else EXIT_INTERRUPTED
    if c.gen_tokens and loader.step == c.steps:
        sample(logits_plan, state.params, corpus, c, jdata)
    return 0


def progress_line(rec: dict, platform: str, jm) -> str:
    mfu = f"MFU {rec['mfu']:.1%}" if rec["mfu"] is not None else f"MFU n/a ({platform.upper()})"
    return (f"loss {rec['loss']:.4f} | lr {rec['lr']:.2e} | {rec['tokens_per_sec']:,.0f} tok/s | "
            f"{rec['tflops_per_device']:.3g} TFLOP/s/dev | {mfu} | mem {jm.fmt_bytes(rec['memory_bytes'])}/dev")


def sample(plan, params, corpus, c: TrainConfig, jdata) -> None:
    """A short continuation of a prompt, so a person sees what the model learned. The whole window is
    run through the model for every new token (no KV cache): at this size that is a few seconds.
    Every device gets a copy of the row, since the batch is split over all of them."""
    import jax
    import numpy as np

    T = c.seq_len
    if c.prompt is not None:
        prompt = corpus.encode(c.prompt)
    else:   # the start of a validation document, up to a line break: text the model has not trained on
        head = np.asarray(corpus.val[: min(64, T // 2)], dtype=np.int32)
        breaks = np.nonzero(head == ord("\n"))[0] if corpus.is_bytes else []
        prompt = head[: breaks[-1] + 1] if len(breaks) and breaks[-1] > 8 else head
    tokens = [int(t) for t in prompt][-(T - 1):] or [corpus.eos if corpus.eos is not None else 0]
    replicated = jax.sharding.NamedSharding(plan.mesh, jax.sharding.PartitionSpec())   # readable by every process
    fwd = jax.jit(lambda p, x, i: jax.lax.dynamic_index_in_dim(plan.apply(p, x)[0], i, keepdims=False),
                  out_shardings=replicated)
    rng = np.random.default_rng(c.seed)
    buf = np.full((plan.n_devices, T), jdata.PAD if corpus.is_bytes else 0, np.int32)
    n_prompt = len(tokens)
    for _ in range(c.gen_tokens):
        ctx = tokens[-T:]
        buf[:, : len(ctx)] = ctx
        logits = np.asarray(fwd(params, jax.device_put(buf, plan.batch_sharding), len(ctx) - 1), np.float64)
        if corpus.is_bytes:
            logits[[jdata.BOS, jdata.PAD]] = -np.inf   # never seen as targets; EOS ends the sample
        if c.temperature == 0:
            nxt = int(np.argmax(logits))
        else:
            z = (logits - logits.max()) / c.temperature
            p = np.exp(z) / np.exp(z).sum()
            nxt = int(rng.choice(len(p), p=p))
        tokens.append(nxt)
        if nxt == corpus.eos:
            break
    how = "greedy" if c.temperature == 0 else f"temperature {c.temperature}"
    print(f"\n== sample ({how}, {len(tokens) - n_prompt} tokens after the prompt) ==")
    if corpus.can_decode:
        print(f"[prompt]{corpus.decode(tokens[:n_prompt])}[model]{corpus.decode(tokens[n_prompt:])}")
    else:
        print(f"prompt token ids {tokens[:n_prompt]}\ngenerated token ids {tokens[n_prompt:]} (no tokenizer here)")


if __name__ == "__main__":
    sys.exit(main())
