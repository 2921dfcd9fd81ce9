"""The page of docs/results/ for long sequences with context parallelism: benchmarks/context_long.py's points
(llama-8b on 8 GPUs at C = 1, 2, 4, 8; llama-70b on 64), compiled for an H100 target. Every figure is
computed from the JSON. Standard library only."""
from __future__ import annotations

from results_source import GIB, g, load, source, table

NAME = "context_long.json"
PARTS = (("params", "parameters"), ("grads", "gradient shards"), ("optimizer", "optimizer state"),
         ("gathered", "gathered units"), ("grad_buffers", "gradient buffers"), ("activations", "activations"))


def _points(d: dict) -> list:
    return d.get("probes", []) + d.get("points", [])


def _longest(d: dict) -> list[list]:
    """Per (model, C): the longest compiled sequence that fits and the shortest that does not."""
    budget, rows, seen = d["device_memory"], [], {}
    for p in _points(d):
        if "compiled" in p:
            seen.setdefault((p["model"], p["devices"], p["context"]), []).append(p)
    for (model, devices, c), ps in sorted(seen.items()):
        fit = [p["seq_len"] for p in ps if p["compiled"]["total"] <= budget]
        over = [p["seq_len"] for p in ps if p["compiled"]["total"] > budget]
        rows.append([model, devices, c, f"1x{devices // c}", f"{max(fit):,}" if fit else "none compiled",
                     f"{min(over):,}" if over else "none compiled", len(ps)])
    return rows


def context_page() -> list[str]:
    d = load(NAME)
    budget = d["device_memory"]
    out = ["# Long sequences with context parallelism, compiled for an H100 target", "",
           "Compiled for an H100 target on a CPU machine, no GPU: XLA:GPU's buffer assignment "
           "(`memory_analysis()`) of jfsdp's train step, bf16, remat full, the fused loss, one sequence per "
           "data x fsdp rank (mesh 1x(N/C) with `--context C`: N/C sequences, T/C tokens per device, the state "
           "sharded over all N) ([context-parallel.md](../context-parallel.md)). Near the target's memory "
           "XLA:GPU's own rematerialization pass recomputes values to fit, so compiled figures above about 60 "
           "GiB are after it. The estimate is the planner's (`--target gpu`), made before compiling.", ""]
    out += source(NAME, d)
    out += [f"## Longest sequence in {g(budget / GIB, 0)} GiB per device, from the compiled points", ""]
    out += table(["model", "GPUs", "C", "mesh", "longest that fits", "shortest that does not", "points compiled"],
                 _longest(d), "lrrlrrr")
    rows = []
    for p in _points(d):
        if "compiled" not in p:
            continue
        e, m = p["estimate"], p["compiled"]["total"]
        rows.append([p["model"], p["context"], f"{p['seq_len']:,}", f"{p['tokens_per_device']:,}", g(m / GIB),
                     "yes" if m <= budget else "no", g(e["total"] / GIB), g(e["total"] / m, 3)]
                    + [g(e[k] / GIB) for k, _ in PARTS])
    out += ["## Every compiled point", "",
            "The estimate's breakdown per device (GiB) beside the compiled total: what holds the memory.", ""]
    out += table(["model", "C", "sequence", "tokens per device", "compiled (GiB)", "fits", "estimate (GiB)",
                  "estimate / compiled"] + [label for _, label in PARTS], rows, "lrrrrlrr" + "r" * len(PARTS))
    return out
