"""Measuring a training run: analytic FLOPs and MFU, memory per device, the metrics file, the loss plot.

MaxText's discipline: throughput is reported as model FLOPs per second per device, from an analytic
count of the model's FLOPs (not from what the compiled program happens to execute, so remat's
recomputation does not inflate it), and MFU is that over the device's peak.
"""
from __future__ import annotations

import json
import math
import os

# Dense peak FLOP/s per device, (bf16, fp32) as the matmul units run them (fp32 on tensor cores = TF32).
# Matched by substring of jax's device_kind, most specific first.
PEAK_FLOPS = {
    "H200": (989e12, 494e12),
    "H100": (989e12, 494e12),
    "A100": (312e12, 156e12),
    "L40S": (362e12, 183e12),
    "A10G": (70e12, 35e12),
    "TPU v5p": (459e12, 459e12),
    "TPU v5 lite": (197e12, 197e12),
    "TPU v4": (275e12, 275e12),
}


def llama_flops_per_token(cfg, seq_len: int) -> float:
    """Training FLOPs per token of a Llama-style decoder (forward + backward = 3 x forward):

        6 * N_matmul + 6 * n_layers * dim * seq_len

    N_matmul counts every weight that takes part in a matmul: the blocks' projections and the output
    head (d x vocab, also when tied to the embedding), but not the embedding lookup or the norms.
    Attention's two score matmuls (QK^T and PV) cost 2 * 2 * T * d per token per layer forward for a
    full T x T square; causal attention needs half of it, so it is counted once: 2 * T * d forward,
    6 * T * d for training. Activation recomputation (remat) is not counted: this is model FLOPs.
    `cfg` needs dim, n_layers, n_heads, n_kv_heads, ffn_dim, vocab_size (duck-typed: jfsdp does not
    import models)."""
    d, L, f, v = cfg.dim, cfg.n_layers, cfg.ffn_dim, cfg.vocab_size
    kv = cfg.n_kv_heads * (d // cfg.n_heads)
    n_matmul = L * (2 * d * d + 2 * d * kv + 3 * d * f) + d * v
    return 6.0 * n_matmul + 6.0 * L * d * seq_len


def moe_flops_per_token(cfg, seq_len: int) -> float:
    """`llama_flops_per_token` for a Mixture-of-Experts decoder: the active matmul weights only (the
    router, and top_k of the n_experts SwiGLU experts of each MoE layer; the dense layers as Llama's).
    `cfg` needs dim, n_layers (MoE), n_dense_layers, n_heads, n_kv_heads, ffn_dim, expert_dim,
    n_experts, top_k, vocab_size (duck-typed)."""
    d, v = cfg.dim, cfg.vocab_size
    kv = cfg.n_kv_heads * (d // cfg.n_heads)
    L = cfg.n_layers + cfg.n_dense_layers
    attn = 2 * d * d + 2 * d * kv
    n_matmul = (L * attn + cfg.n_dense_layers * 3 * d * cfg.ffn_dim
                + cfg.n_layers * (d * cfg.n_experts + cfg.top_k * 3 * d * cfg.expert_dim) + d * v)
    return 6.0 * n_matmul + 6.0 * L * d * seq_len

def peak_flops(device, precision: str = "bf16") -> float | None:
    """The device's dense peak FLOP/s for the precision, or None when unknown (e.g. CPU). fp8 counts
    against the bf16 peak (as torchtitan reports MFU for float8): the gain shows as MFU above bf16's."""
    if device.platform == "cpu":
        return None
    kind = getattr(device, "device_kind", "")
    for key, (bf16, fp32) in PEAK_FLOPS.items():
        if key.lower() in kind.lower():
            return bf16 if precision in ("bf16", "fp8", "fp8-rowwise") else fp32  # fp8: MFU against the bf16 peak
    return None


def device_memory(devices, compiled=None) -> tuple[int | None, str]:
    """(peak bytes per device, where the figure comes from). Accelerators report their allocator's
    peak; CPU devices report nothing, so the compiled train step's buffer assignment stands in."""
    from jfsdp.planning.memory import device_peak
    peaks = [p for p in map(device_peak, devices) if p is not None]
    if peaks:
        return max(peaks), "allocator peak"
    if compiled is not None:
        from jfsdp.planning.hlo import memory
        return memory(compiled)["total"], "compiled train step"
    return None, "unknown"


def forward_metrics(plan, fns: dict):
    """(params, batch) -> {name: metric}: several forward-only metrics from one forward pass.

    `fns` maps names to functions with `plan.loss`'s contract (`fn(outputs, batch)` gets the head's
    outputs and the batch rows of one device and returns a scalar), or to `(fn, 'mean'|'max')`
    (jfsdp/engine/step_metrics.py); each metric is that scalar in float32 averaged over the devices,
    exactly as `plan.loss(fn)` computes it (or their largest), but every function reads the same
    forward pass (a trainer's per-step model metrics, e.g. an MoE router's auxiliary loss and dropped
    fraction, cost one forward instead of one each). Call under jit. It is `FSDP.loss` generalised to a
    dict of scalars and uses the plan's own forward and shard_map; a train step returns the same from
    its own forward pass with make_train_step's `metrics=`."""
    from jax.sharding import PartitionSpec as P

    from jfsdp.config.mesh import AXES
    from jfsdp.engine import step_metrics

    fns = step_metrics.check(fns) or {}

    def local(params, batch):
        values = step_metrics.local(fns, plan.forward(params, batch["inputs"]), batch)
        return step_metrics.over_devices(fns, values, plan)

    # at T > 1 the batch's sequence lies over `tensor` too, and the sum runs over it (the plan's loss_axes,
    # as FSDP.loss's)
    spec = getattr(plan, "batch_spec", P(AXES))
    sharded = plan.shard_map(local, (plan.param_specs, spec), {name: P() for name in fns})

    def fn(params, batch):
        plan.check_batch(batch)
        return sharded(params, batch)
    return fn


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "n/a"
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1000
    return f"{n}"


def fmt_count(n: float) -> str:
    for unit in ("", "K", "M", "B", "T"):
        if abs(n) < 1000 or unit == "T":
            return f"{n:.0f}{unit}" if unit == "" else f"{n:.1f}{unit}"
        n /= 1000
    return f"{n}"


class MetricsFile:
    """JSON lines, one object per logged step (train: step, loss, lr, tokens_per_sec, ...; eval: step,
    val_loss). Flushed per line so a crash or Ctrl-C loses nothing. Records are kept for the plot."""

    def __init__(self, path: str | None, append: bool = False):
        self.path, self.records = path, []
        self._f = None
        if path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            self._f = open(path, "a" if append else "w")

    def write(self, **record) -> None:
        record = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        self.records.append(record)
        if self._f:
            self._f.write(json.dumps(record) + "\n")
            self._f.flush()

    def close(self) -> None:
        if self._f:
            self._f.close()
            self._f = None


def plot_loss(records: list[dict], png_path: str, title: str = "") -> str | None:
    """Train and validation loss against step, written to `png_path` (Agg: no display needed)."""
    train = [(r["step"], r["loss"]) for r in records if r.get("loss") is not None]
    val = [(r["step"], r["val_loss"]) for r in records if r.get("val_loss") is not None]
    if not train and not val:
        return None
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    if train:
        ax.plot(*zip(*train), label="train loss", lw=1.4)
    if val:
        ax.plot(*zip(*val), "o-", label="val loss", lw=1.4, ms=4)
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png_path)
    plt.close(fig)
    return png_path
