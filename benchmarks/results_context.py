"""The page of docs/results/ for long sequences with context parallelism: benchmarks/context_long.py's points
(llama-8b on 8 GPUs at C = 1, 2, 4, 8; llama-70b on 64), compiled for an H100 target. Every figure is
computed from the JSON. Standard library only."""
from __future__ import annotations

from results_source import GIB, g, load, source, table

NAME = "context_long.json"   # the first searches (before the two fixes below), kept as history
# The newest measurement of each part, oldest first, and the code each was compiled with (the last four: C = 8 with
# fp32 and bf16 sums, the searches at C = 2, 4 and the two single points, llama-70b's included, after the ring's
# dQ accumulator; C = 1 runs no ring and was not compiled again; then C = 8's edge of the fit after wo's weight
# gradient was moved before the ring's backward, fp32 and bf16 sums, the searches at C = 4, 2 and the two points).
_BLOCKWISE = "after the blockwise kernel's fix, before the ring's"
_RING = "after the ring's fix (per-hop buffers removed)"
_BF16 = "after the tiled MLP's VJP and the ring's bf16 sums"
_NOW = "after the tiled MLP's VJP, the ring's sums fp32 (the default)"
_INTO = "after the ring's dQ accumulator in the kernel's layout (ring.py `Into`)"
_WO = "after wo's weight gradient before the ring's backward (context.py `_weight_grad_first`)"
NEWEST = {"context_long_search_after_fix_tile4096.json": _BLOCKWISE,
          "context_long_points_after_fix_tile4096.json": _BLOCKWISE,
          "context_long_c8_ring_tile4096.json": _RING, "context_long_c8_256k_ring_tile4096.json": _RING,
          "context_long_c8_ring2_tile4096.json": _BF16, "context_long_c8_256k_ring2_tile4096.json": _BF16,
          "context_long_c8_fp32sums_tile4096.json": _NOW, "context_long_search_c1_now_tile4096.json": _NOW,
          "context_long_search_c24_now_tile4096.json": _NOW,
          "context_long_c8_into_tile4096.json": _INTO, "context_long_c8_into_bf16_tile4096.json": _INTO,
          "context_long_search_c24_into_tile4096.json": _INTO, "context_long_points_into_tile4096.json": _INTO,
          "context_long_c8_wo_tile4096.json": _WO, "context_long_c8_wo_1605632_tile4096.json": _WO,
          "context_long_c8_wo_bf16_tile4096.json": _WO, "context_long_search_c4_wo_tile4096.json": _WO,
          "context_long_search_c2_wo_tile4096.json": _WO, "context_long_points_wo_tile4096.json": _WO}
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


def _point_rows(d: dict, label: str | None = None) -> list[list]:
    rows = []
    for p in _points(d):
        if "compiled" not in p:
            continue
        e, m = p["estimate"], p["compiled"]["total"]
        rows.append(([label] if label else []) +
                    [p["model"], p["context"], f"{p['seq_len']:,}", f"{p['tokens_per_device']:,}", g(m / GIB),
                     "yes" if m <= d["device_memory"] else "no", g(e["total"] / GIB), g(e["total"] / m, 3)]
                    + [g(e[k] / GIB) for k, _ in PARTS])
    return rows


POINT_HEAD = ["model", "C", "sequence", "tokens per device", "compiled (GiB)", "fits", "estimate (GiB)",
              "estimate / compiled"] + [label for _, label in PARTS]


def newest_section() -> list[str]:
    """The longest sequence per (model, C) from the newest file that compiled it, and every newest point."""
    out = ["## Now: the newest compile of each point", "",
           "Each row from the newest file that compiled it (the code after the fix named). Tiles of 4,096 "
           "(`--model-option mlp_tile=4096`). Ring sums: the ring backward's sums across hops, fp32 (the default) "
           "or bf16 (`--ring-sums bf16`, less accurate: [context-parallel.md](../context-parallel.md)).", ""]
    newest = {}   # (model, devices, C, sequence) -> (file, point): a later file's compile of a point replaces an earlier one
    for name in NEWEST:
        for p in _points(load(name)):
            if "compiled" in p:
                newest[(p["model"], p["devices"], p["context"], p["seq_len"], p.get("ring_sums", "fp32"))] = (name, p)
    order, groups = list(NEWEST), {}   # (model, devices, C, ring sums) -> [(file, point)]
    for name, p in newest.values():
        groups.setdefault((p["model"], p["devices"], p["context"], p.get("ring_sums", "fp32")), []).append((name, p))
    budget = load(order[0])["device_memory"]
    rows = []
    for key, items in sorted(groups.items()):   # the points of the newest code that compiled any of them
        code = NEWEST[max((n for n, _ in items), key=order.index)]
        mine = [(n, p) for n, p in items if NEWEST[n] == code]
        rows += [row + [key[3], ", ".join(sorted({f"`{n}`" for n, _ in mine})), code]
                 for row in _longest({"device_memory": budget, "points": [p for _, p in mine]})]
    out += table(["model", "GPUs", "C", "mesh", "longest that fits", "shortest that does not", "points compiled",
                  "ring sums", "from", "code"], rows, "lrrlrrrlll")
    points = [_point_rows({"device_memory": budget, "points": [p]}, f"`{name}`")[0]
              for name, p in sorted(newest.values(), key=lambda t: (t[1]["model"], t[1]["context"], t[1]["seq_len"]))]
    out += ["Every newest point; the estimate's breakdown per device (GiB) beside the compiled total:", ""]
    out += table(["file"] + POINT_HEAD, points, "l" + "lrrrrlrr" + "r" * len(PARTS))
    for name in NEWEST:
        out += [f"### `{name}`", ""] + source(name, load(name))
    return out


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
    out += newest_section()
    out += ["## History: the first searches, before both fixes", ""]
    out += source(NAME, d)
    out += [f"### Longest sequence in {g(budget / GIB, 0)} GiB per device, from the compiled points", ""]
    out += table(["model", "GPUs", "C", "mesh", "longest that fits", "shortest that does not", "points compiled"],
                 _longest(d), "lrrlrrr")
    out += ["### Every compiled point", "",
            "The estimate's breakdown per device (GiB) beside the compiled total: what holds the memory.", ""]
    out += table(POINT_HEAD, _point_rows(d), "lrrrrlrr" + "r" * len(PARTS))
    return out
