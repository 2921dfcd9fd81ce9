"""`TrainConfig`: every setting of a training run, as `python train.py`'s flags give them (`jfsdp.cli`)
and the run reads them (`jfsdp.runtime.run`). jax-free."""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    # parallelism and model
    mesh: str = "2x8"
    tensor: int = 1                 # tensor-parallel size T (a third mesh axis; docs/tensor-parallel.md)
    context: int = 1                # context-parallel size C (the sequence split over it; docs/context-parallel.md)
    ring_sums: str = "fp32"         # C > 1: the ring backward's sums across hops, fp32 or (bf16 compute) bf16
    ring_attention: str = "auto"    # C > 1: the ring's per-block attention: auto (cuDNN where it applies), cudnn, blockwise
    async_tp: str = "auto"          # T > 1: the TP collectives as rings that overlap the matmuls (auto: on GPUs)
    strategy: str = "full_shard"
    model: str = "llama-tiny"
    precision: str = "fp32"
    remat: str = "none"
    loss: str = "fused"
    mlp_tile: int = 0               # the Llama MLP over the sequence in tiles of this many tokens (0: off)
    moe: str = "auto"               # MoE models: gather / ep / auto per stage (jfsdp/engine/moe.py)
    moe_chunks: str = "auto"
    moe_buckets: str | None = None  # adaptive: capacities to compile, "64,128,256" (default: doubling up to T)
    moe_capacity_cap: float | None = None  # adaptive: no capacity above this factor x T x k / E
    moe_calibration: str | None = None  # adaptive: measured seconds per (capacity, mode, chunks), a JSON file
    moe_calibrate: str | None = None    # adaptive: measure them on this run's devices first, write them to this file
    moe_switch: str = "device"        # adaptive: the bucket chosen in the step (device) or one program a bucket (host)
    # optimization
    steps: int = 300
    batch_size: int = 16            # global, in sequences
    seq_len: int = 256
    grad_accum: int = 1
    grad_sync: str = "every"        # with grad_accum > 1: reduce in every micro-batch, or once per step
    lr: float = 3e-3
    warmup: int = 30
    weight_decay: float = 0.1
    clip: float = 1.0               # global gradient norm; 0 turns clipping off
    update_in_backward: bool = False  # optimizer per unit inside the backward pass (jfsdp/train/update_in_backward.py)
    seed: int = 0
    freeze: str | None = None       # regex over parameter paths ('root/tok_embeddings/embedding'): frozen
    no_fit_check: bool = False      # skip the planner's estimate against the devices' memory (jfsdp/runtime/fit.py)
    # data
    data: str | None = None         # None: the Python standard library (see jfsdp/io/data.py)
    data_dtype: str | None = None   # for .bin token files (default uint16)
    # evaluation, logging, sampling
    eval_every: int = 50
    eval_iters: int = 4
    log_every: int = 10
    metrics_out: str | None = "out/metrics.jsonl"
    prompt: str | None = None
    gen_tokens: int = 100
    temperature: float = 0.8
    # checkpoints (see jfsdp/io/checkpoint.py), profiling, devices
    ckpt_dir: str | None = None
    save_every: int = 0
    keep: int = 3
    resume: bool = False
    stop_after: int = 0
    init_from: str | None = None
    profile: str | None = None
    cpu_devices: int = 0
    # more than one process (jfsdp/runtime/distributed.py); none given and no cluster launcher: one process
    coordinator: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    init_timeout: float = 60.0
    heartbeat_timeout: int = 30
