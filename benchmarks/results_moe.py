"""docs/results/moe-adaptive.md from benchmarks/results/moe_adaptive.json (benchmarks/moe_adaptive.py): adaptive
MoE against every static (mode, chunks, capacity) over a load trace, on CPU and on the H100 target.
Every figure is computed from the JSON."""
from __future__ import annotations

from results_source import g, load, source, table

NAME = "moe_adaptive.json"


def name(r) -> str:
    return f"{r['mode']} k={r['chunks']} c={r['capacity']}"


def verdict(statics, adaptive, points) -> list[str]:
    """The issue's goal, point by point: adaptive drops nothing and is within 5% of the fastest static
    that drops nothing there; each static drops somewhere or is slower than adaptive somewhere.
    statics: (name, [(seconds, dropped) per point]); adaptive: [(seconds, dropped) per point]."""
    ratios = []
    for i in range(points):
        clean = [t[i][0] for _, t in statics if t[i][1] == 0]
        ratios.append(adaptive[i][0] / min(clean) if clean else float("nan"))
    within = sum(r <= 1.05 for r in ratios)
    beaten = [n for n, t in statics if any(d > 0 for _, d in t) or any(s > 1.05 * a[0] for (s, _), a in zip(t, adaptive))]
    return [f"- Adaptive drops nothing at {sum(a[1] == 0 for a in adaptive)} of {points} points; its time is within 5% of "
            f"the fastest static choice that drops nothing at {within} of {points} points (ratios "
            f"{', '.join(g(r) for r in ratios)}).",
            f"- {len(beaten)} of {len(statics)} static choices drop tokens or are more than 5% slower than adaptive "
            f"somewhere on the trace" + ("." if len(beaten) == len(statics) else
                                         f"; not: {', '.join(n for n, _ in statics if n not in beaten)}."), ""]


def cpu_section(d, which: str = "") -> list[str]:
    out = [f"## moe-test on 8 fake CPU devices (measured step times){which}", ""] + source(NAME, d)
    out += [f"{d['model']}, mesh {d['mesh']}, {d['rows']} x {d['seq']} tokens, fp32, FULL_SHARD, remat none, AdamW, "
            "embeddings scaled 10x. Point q: a share q of every row's tokens is one token of the row's own (q = 1: "
            f"every choice of a sequence on two experts), the rest random. Buckets {tuple(d['buckets'])}. Step time: "
            f"median of {d['rounds']} x {d['steps']} timed steps on XLA:CPU, interleaved (each round: at each point, every "
            "program in a fresh random order, from a fresh state, after one warm-up step; CPU collectives are "
            "synchronous, so chunks cannot overlap anything here); capacity and dropped share of the routed choices: "
            "one forward pass.",
            "", f"Calibration (each static program's median step time over the trace in {d['calibration_rounds']} rounds of "
            "their own, before the adaptive program is built) and the choice per bucket:", ""]
    chosen = {(v["capacity"], v["mode"], v["chunks"]) for v in d["variants"]}
    out += table(["capacity", "mode", "chunks", "s / step", "chosen"],
                 [[c["capacity"], c["mode"], c["chunks"], g(c["seconds"], 3),
                   "yes" if (c["capacity"], c["mode"], c["chunks"]) in chosen else ""] for c in d["calibration"]], "rlrrl")
    q = d["q"]
    a = d["adaptive"]
    rows = [[r["program"], g(r["compile_s"], 1), g(r["total_mib"], 1)]
            + [f"{g(t['step_s'], 3)} / {t['capacity']:.0f} / {g(t['dropped'], 3)}" for t in r["trace"]]
            for r in d["static"] + [a, d["adaptive_one_bucket"]]]
    out += ["Every program over the trace (step s / capacity / dropped):", ""]
    out += table(["program", "compile s", "MiB/device"] + [f"q={x}" for x in q], rows, "lrr" + "r" * len(q))
    statics = [(r["program"], [(t["step_s"], t["dropped"]) for t in r["trace"]]) for r in d["static"]]
    one = d["adaptive_one_bucket"]
    same = next(r for r in d["static"] if name(r) == name(one))
    ratio = [t["step_s"] / u["step_s"] for t, u in zip(one["trace"], same["trace"])]
    out += [f"The switch's own cost: {one['program']} (the largest bucket alone: the load, its all-reduce and the "
            f"branch's forward again in the backward pass, no conditional) against {same['program']}: "
            f"{g(min(ratio), 3)}-{g(max(ratio), 3)}x its step time over the trace, {g(one['total_mib'], 1)} against "
            f"{g(same['total_mib'], 1)} MiB/device.", ""]
    return out + verdict(statics, [(t["step_s"], t["dropped"]) for t in a["trace"]], len(q))


def h100_section(d) -> list[str]:
    out = ["## mixtral-8x7b shapes on the H100 target (modelled from compiled programs)", ""] + source(NAME, d)
    out += [f"{d['model']}, mesh {d['mesh']}, {d['rows']} x {d['seq']} tokens (one sequence per device), bf16, remat "
            "full, compiled for an H100 without a GPU. Modelled s / step = matmul FLOPs at the dense bf16 peak "
            "(989 TFLOP/s) + the wire bytes of the collectives the compiled schedule leaves exposed at 450 GB/s "
            "(`jfsdp/planning/moe_calibrate.py`): a model of XLA's schedule, not a measurement on a GPU. The static "
            "programs' times are the adaptive plan's calibration.", ""]
    chosen = {(v["capacity"], v["mode"], v["chunks"]) for v in d["variants"]}
    rows = [[name(s), g(s["compile_s"], 0), g(s["total_gib"], 2), g(s["compute_s"] * 1e3, 1),
             g(sum(s["exposed_bytes"].values()) / 2**30, 2), g(s["exposed_comm_s"] * 1e3, 1), g(s["seconds"] * 1e3, 1),
             "yes" if (s["capacity"], s["mode"], s["chunks"]) in chosen else ""] for s in d["static"]]
    out += table(["static program", "compile s", "GiB/device", "compute ms", "exposed GiB", "exposed ms", "ms / step",
                  "adaptive's choice"], rows, "lrrrrrrl")
    b, w = d["branch_program"], d["adaptive_program"]
    same = next(s for s in d["static"] if (s["capacity"], s["mode"], s["chunks"]) == (b["capacity"], b["mode"], b["chunks"]))
    out += [f"The adaptive program's branch {name(b)} compiled as its own program (one bucket): "
            f"{g(b['seconds'] * 1e3, 1)} ms / step modelled, {g(sum(b['exposed_bytes'].values()) / 2**30, 2)} GiB exposed, "
            f"{g(b['total_gib'])} GiB/device, against {g(same['seconds'] * 1e3, 1)} ms, "
            f"{g(sum(same['exposed_bytes'].values()) / 2**30, 2)} GiB and {g(same['total_gib'])} GiB for the static "
            f"program. The whole adaptive program (every bucket, one switch per MoE layer call): "
            f"{g(w['total_gib'])} GiB/device, compiled in {g(w['compile_s'], 0)} s.", "",
            "The trace: per routing group, expert e gets T·k·((1−a)/E + a·[e<2]/2) of the choices. A static program "
            "runs at its capacity whatever the load and drops what is above it; adaptive runs the smallest bucket "
            "holding the largest load, at that branch's modelled time.", ""]
    statics = [(name(s), [(s["seconds"], p["static_dropped"][name(s)]) for p in d["trace"]]) for s in d["static"]]
    rows = []
    for i, p in enumerate(d["trace"]):
        ad = p["adaptive"]
        clean = [(t[i][0], n) for n, t in statics if t[i][1] == 0]
        fast = min((t[i][0], t[i][1], n) for n, t in statics)
        best = min(clean)
        rows.append([g(p["a"], 2), f"{p['max_load']:.0f}", f"{name(ad)}: {g(ad['seconds'] * 1e3, 1)} ms, dropped {g(ad['dropped'], 3)}",
                     f"{best[1]}: {g(best[0] * 1e3, 1)} ms", g(ad["seconds"] / best[0], 3),
                     f"{fast[2]}: {g(fast[0] * 1e3, 1)} ms, dropped {g(fast[1], 3)}"])
    out += table(["a", "largest load", "adaptive", "fastest static without drops", "adaptive / it", "fastest static"],
                 rows, "rrllrl")
    return out + verdict(statics, [(p["adaptive"]["seconds"], p["adaptive"]["dropped"]) for p in d["trace"]],
                         len(d["trace"]))


def moe_adaptive_page() -> list[str]:
    d = load(NAME)
    out = ["# Adaptive MoE against every static (mode, chunks, capacity) over a load trace", ""]
    if "h100" in d:
        out += h100_section(d["h100"])
    for key in sorted(k for k in d if k.startswith("cpu")):   # cpu, then its repeats (cpu_repeat, ...)
        out += cpu_section(d[key], "" if key == "cpu" else f" ({key})")
    return out
