"""Where each measured table comes from: the result JSON files, what they do not record themselves
(PROVENANCE), and the small helpers every results page uses. Standard library only."""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
GIB, MIB = 2 ** 30, 2 ** 20
CPU_VM = "CPU, 2-core x86 VM (no GPU)"
H100_ON_CPU = ("compiled for an H100 target (`jfsdp.planning.targets`, 8 GPUs) on the 2-core x86 CPU "
               "machine: XLA:GPU's compile-time plan, nothing ran on a GPU")

# What a JSON does not record itself. Each entry cites the README section (before docs/ existed,
# README.md at commit dc09fbc) where the command, device and date were written beside the figures.
PROVENANCE = {
    # README "Will it fit?", the paragraph after "The largest Llama that fits in 80 GiB per device"
    "memory.json": {
        # the second run recomputes the estimate columns only (the estimate changed while the compiles ran)
        "command": ["python benchmarks/memory.py --json benchmarks/results/memory.json",
                    "python benchmarks/memory.py --json benchmarks/results/memory.json --reestimate"],
        "date": "2026-11-22", "jax": "0.10.2"},
    # README "On GPUs", "Compiled for an H100 without one": the command under the tables
    "gpu_target_h100.json": {"command": "python benchmarks/gpu_target.py --json benchmarks/results/gpu_target_h100.json"},
    # README "On GPUs", "Compiled for an H100 without one": the command before the llama-1b tables; the
    # date of commit f58e8c5 that wrote the file
    "plan_llama1b_h100.json": {
        "command": "python -m jfsdp.plan --model llama-1b --mesh 1x8 --batch-size 8 --seq-len 2048 --target h100 "
                   "--json benchmarks/results/plan_llama1b_h100.json",
        "device": H100_ON_CPU, "date": "2026-11-22", "jax": "0.10.2"},
    # README "On GPUs", the torchtitan Llama 3.1 8B paragraph (h100, h200 and local batch 1 commands)
    "torchtitan_8b_h100.json": {
        "command": "python -m jfsdp.plan --model llama-8b --mesh 1x8 --batch-size 16 --seq-len 8192 --remat dots "
                   "--target h100 --json benchmarks/results/torchtitan_8b_h100.json",
        "device": H100_ON_CPU, "date": "2026-11-22", "jax": "0.10.2"},
    "torchtitan_8b_h200.json": {
        "command": "python -m jfsdp.plan --model llama-8b --mesh 1x8 --batch-size 16 --seq-len 8192 --remat dots "
                   "--target h200 --json benchmarks/results/torchtitan_8b_h200.json",
        "device": H100_ON_CPU.replace("H100", "H200"), "date": "2026-11-22", "jax": "0.10.2"},
    "llama8b_local1_h100.json": {
        "command": "python -m jfsdp.plan --model llama-8b --mesh 1x8 --batch-size 8 --seq-len 8192 --remat dots "
                   "--target h100 --json benchmarks/results/llama8b_local1_h100.json",
        "device": H100_ON_CPU, "date": "2026-11-22", "jax": "0.10.2"},
    # docs/tensor-parallel.md, "Async TP": the commands, device and date written beside the figures
    "tensor_parallel.json": {"device": H100_ON_CPU},
    "tensor_parallel_70b.json": {"device": H100_ON_CPU.replace("8 GPUs", "256 GPUs")},
    "plan_llama70b_tp8_fp8_async_h100.json": {
        "command": "python -m jfsdp.plan --model llama-70b --mesh 1x32 --tensor 8 --batch-size 512 --seq-len 8192 "
                   "--target h100 --precision fp8 --json benchmarks/results/plan_llama70b_tp8_fp8_async_h100.json",
        "device": H100_ON_CPU.replace("8 GPUs", "256 GPUs"), "date": "2026-11-26", "jax": "0.10.2"},
    "plan_llama70b_tp8_fp8_h100.json": {
        "command": "python -m jfsdp.plan --model llama-70b --mesh 1x32 --tensor 8 --batch-size 512 --seq-len 8192 "
                   "--target h100 --precision fp8 --async-tp off "
                   "--json benchmarks/results/plan_llama70b_tp8_fp8_h100.json",
        "device": H100_ON_CPU.replace("8 GPUs", "256 GPUs"), "date": "2026-11-26", "jax": "0.10.2"},
    # docs/any-model.md and the session note of 2026-11-26: the command that wrote it
    "any_model_llama1b.json": {
        "command": "python benchmarks/any_model.py --model llama-1b --depths 16 --batch 8 --seq 2048 --attention auto "
                   "--no-compile-time --target h100 --own-scan --json benchmarks/results/any_model_llama1b.json",
        "device": CPU_VM + "; the h100 rows " + H100_ON_CPU},
    "any_model_llama8b.json": {
        "command": "python benchmarks/any_model.py --model llama-8b --depths 32 --batch 8 --seq 2048 --attention auto "
                   "--no-compile-time --target h100 --own-scan --json benchmarks/results/any_model_llama8b.json",
        "device": CPU_VM.replace("2-core x86 VM", "2-core Intel Xeon VM") + "; the h100 rows "
                  + H100_ON_CPU.replace("2-core x86", "2-core Intel Xeon")},
    # README "On GPUs", "Throughput": the machine the CPU rows ran on
    "throughput_cpu.json": {"device": CPU_VM + ", 8 fake XLA devices, shared with three other jobs"},
    # README "The optimizer inside the backward pass", the cost paragraph
    "throughput_update_in_backward_cpu.json": {"device": CPU_VM + ", 8 fake XLA devices"},
    "throughput_update_in_backward_noclip_cpu.json": {"device": CPU_VM + ", 8 fake XLA devices"},
    # README "Checkpoints", "Cost"
    "checkpoint.json": {"command": "python benchmarks/checkpoint.py --json benchmarks/results/checkpoint.json "
                                   "--repeats 2"},
}

# Where a JSON's record cannot be rerun as it stands: the benchmark writes its argv joined by spaces,
# which drops the shell quotes around a regular expression (the README gave it quoted).
CORRECTIONS = {
    "torch_compare_memory_ib.json": {
        "command": "python benchmarks/torch_compare.py --only memory --torch-from "
                   "benchmarks/results/torch_compare_memory.json --bf16-target h100 --update-in-backward --match "
                   "'^W(1|8|64)-full_shard-(fp32|bf16)-remat_full-seq(2048|8192)$' "
                   "--json benchmarks/results/torch_compare_memory_ib.json"},
}


def load(name: str) -> dict:
    data = json.loads((RESULTS / name).read_text())
    return {**PROVENANCE.get(name, {}), **data, **CORRECTIONS.get(name, {})}


def source(name: str, d: dict) -> list[str]:
    """The lines that say where a table comes from: file, command, device, date, versions, wall time."""
    commands = d["command"] if isinstance(d["command"], list) else [d["command"]]
    when = f"Device: {d['device']}. Date: {d['date']}."
    versions = ", ".join(f"{k} {d[k]}" for k in ("jax", "torch", "orbax") if k in d)
    if versions:
        when += f" Versions: {versions}."
    if "wall_s" in d:
        when += f" Wall time of the command: {d['wall_s']:.0f} s."
    out = [f"Source: [`benchmarks/results/{name}`](../../benchmarks/results/{name}), written by",
           ", then ".join(f"`{c}`" for c in commands) + ".", when]
    if d.get("note"):
        out.append(f"Note recorded in the file: {d['note']}")
    return out + [""]


def table(head: list[str], rows: list[list], align: str) -> list[str]:
    """A markdown table; `align` has one letter per column, l or r."""
    out = ["| " + " | ".join(head) + " |", "| " + " | ".join("---:" if a == "r" else "---" for a in align) + " |"]
    return out + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows] + [""]


def g(x: float, d: int = 2) -> str:
    return f"{x:.{d}f}"
