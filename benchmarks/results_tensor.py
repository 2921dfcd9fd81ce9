"""The page of docs/results/ for tensor parallelism: benchmarks/tensor_parallel.py's rows (llama-8b at
T = 1, 2, 4 and Llama 3.1 70B at FSDP 32 x TP 8) and the 70B float8 planner reports. Every figure is
computed from the JSON. Standard library only."""
from __future__ import annotations

from results_source import GIB, g, load, source, table

ROWS = ("tensor_parallel.json", "tensor_parallel_70b.json")
FP8 = ("plan_llama70b_tp8_fp8_async_h100.json", "plan_llama70b_tp8_fp8_h100.json")
TP_KINDS = ("all-gather over tensor", "reduce-scatter over tensor", "collective-permute over tensor")


def _sums(overlap: dict, keys) -> tuple[float, float]:
    """(bytes, exposed bytes) of the overlap entries named in `keys` (absent ones count 0)."""
    got = [overlap[k] for k in keys if k in overlap]
    return (sum(v["hidden_bytes"] + v["exposed_bytes"] for v in got), sum(v["exposed_bytes"] for v in got))


def _pair(overlap: dict, key: str) -> str:
    total, exposed = _sums(overlap, [key])
    return f"{g(total / GIB)} / {g(exposed / GIB)}"


def _tp(overlap: dict) -> tuple[str, str]:
    total, exposed = _sums(overlap, TP_KINDS)
    if not total:
        return "0", "0"
    return g(total / GIB), f"{g(exposed / GIB)} ({100 * exposed / total:.1f}%)"


def _row(r: dict, overlap: dict, memory: float) -> list:
    tp_bytes, tp_exposed = _tp(overlap)
    every = sum(v["exposed_bytes"] for v in overlap.values())
    tokens = r["batch"] * r["seq_len"] // (r["devices"] // r["tensor"])
    return [r["model"], r["mesh"].replace("x", "×"), f"{tokens:,}", r["precision"],
            ("on" if r["async_tp"] else "off") if r["tensor"] > 1 else "–", g(memory / GIB), tp_bytes, tp_exposed,
            _pair(overlap, "all-gather over fsdp"), _pair(overlap, "reduce-scatter over fsdp"), g(every / GIB)]


HEAD = ["model", "R×S×T", "tokens per TP group", "precision", "async TP", "memory (GiB)", "TP bytes",
        "TP exposed", "FSDP all-gathers / exposed", "FSDP reduce-scatters / exposed", "all exposed"]


def tensor_page() -> list[str]:
    out = ["# Tensor parallelism compiled for an H100 target", "",
           "Megatron tensor parallelism with sequence parallelism on the `tensor` axis, FSDP on `fsdp` "
           "([tensor-parallel.md](../tensor-parallel.md)). Remat full, the fused vocabulary-parallel loss, cuDNN "
           "attention, the prefetch pipeline. GiB each device sends per step (ring cost model, loops counted by "
           "trip count); exposed = in flight while no matmul runs on XLA:GPU's schedule "
           "(`jfsdp.planning.hlo.overlap`, by mesh axes). TP bytes are the collectives over `tensor` alone: "
           "all-gathers and reduce-scatters for one-shot TP, the rings' collective-permutes (and the root's "
           "one-shot collectives) for async TP. Memory is XLA's buffer assignment per device.", ""]
    for name in ROWS:
        d = load(name)
        out += source(name, d)
        out += table(HEAD, [_row(r, r["overlap"], r["memory"]["total"]) for r in d["rows"]], "lllll" + "r" * 6)
    out += ["## Llama 3.1 70B in float8 (tensorwise), FSDP 32 × TP 8", "",
            "Async TP first, then one-shot TP (`--async-tp off`). The estimate is the planner's analytic figure, "
            "made before compiling.", ""]
    rows = []
    for name in FP8:
        d = load(name)
        out += source(name, d)
        r = {"model": d["model"], "mesh": f"{d['mesh']}x{d['tensor']}", "devices": d["devices"],
             "tensor": d["tensor"], "batch": d["batch_size"], "seq_len": d["seq_len"], "precision": d["precision"],
             "async_tp": d["async_tp"]}
        rows.append(_row(r, d["overlap_axes"], d["compiled"]["total"]) + [g(d["estimate"]["total"] / GIB)])
    out += table(HEAD + ["estimate (GiB)"], rows, "lllll" + "r" * 7)
    return out
