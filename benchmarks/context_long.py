"""Long sequences with context parallelism, compiled for H100s on a machine without a GPU
(docs/context-parallel.md, docs/results/context-long.md; issue 34).

llama-8b on 8 GPUs, mesh 1x(8/C) with --context C (C = 1, 2, 4, 8), bf16, remat full, the fused loss:
one sequence per data x fsdp rank (8/C sequences of T tokens: every device holds T/C tokens, and the state
is sharded over all 8). For each C, the longest T (a multiple of 2C) whose compiled step fits in the
device memory (80 GiB), searched on XLA:GPU's buffer assignment (`memory_analysis()`): the estimate's
largest T gives a start, T = 2^k from the power of two below it goes up (fits) or down (does not) by
doubling until the answer is bracketed, then one refinement at the bracket's midpoint. Then single
points: llama-8b at 256k tokens with C = 8, and llama-70b at 128k tokens on 64 GPUs (1x8 --context 8:
8 sequences, 16k tokens per device). Each point records the compiled memory and the planner's estimate
with its breakdown (what holds the memory where a goal is missed). Nothing runs: XLA:GPU compiles for
the target's topology (25-90 s a compile on a 2-core CPU machine).

    python benchmarks/context_long.py --json benchmarks/results/context_long.json
    python benchmarks/context_long.py --contexts 8 --points none --json /tmp/c8.json
    python benchmarks/context_long.py --contexts none --points 8b --seq-lens 262144,1572864 ...   # llama-8b, C = 8
    python benchmarks/context_long.py --model-option mlp_tile=4096 ...   # a config field (e.g. a tiled MLP)
    python benchmarks/context_long.py --reuse FILE ...   # compiled figures of identical points taken from FILE
    python benchmarks/context_long.py --ring-attention cudnn ...   # cuDNN's per-block attention (default: blockwise)
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("JAX_PLATFORMS", "cpu")   # the CUDA plugin compiles for the target; no GPU is looked for

GIB = 2**30


def _value(text: str):
    for conv in (int, float):
        try:
            return conv(text)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(text.lower(), text)


def _cpu() -> str:
    """This machine, as the JSON records it (it was a fixed string, wrong once the machine changed)."""
    try:
        name = next(l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name"))
    except (OSError, StopIteration):
        name = "CPU"
    return f"{os.cpu_count()}-core {name} VM"


def options(items) -> dict:
    out = {}
    for item in items:
        k, _, v = item.partition("=")
        if not k or not v:
            raise SystemExit(f"error: --model-option '{item}' is not NAME=VALUE")
        out[k] = _value(v)
    return out


RING_SUMS = "fp32"   # --ring-sums: the ring backward's sums across hops (models.factory.context_kernel)
RING_ATTENTION = "blockwise"   # --ring-attention: the ring's per-block attention (this benchmark's default: blockwise)


def cache_key(model, devices, context, seq, overrides, target, ring_sums="fp32", ring_attention="blockwise") -> str:
    """A point's identity in --reuse's cache (the ring's sums and per-block attention named only where not the
    default, so that files written before the options stay reusable)."""
    return json.dumps([model, devices, context, seq, overrides, target] + ([ring_sums] if ring_sums != "fp32" else [])
                      + ([ring_attention] if ring_attention != "blockwise" else []), sort_keys=True)


def point(model: str, devices: int, context: int, seq: int, overrides: dict, target: str, compile_: bool,
          cache: dict) -> dict:
    """One plan: `devices` GPUs of `target`, mesh 1x(devices/C) --context C, devices/C sequences of `seq`."""
    import jax

    from jfsdp.planning import memory, report, targets

    rows = devices // context
    key = cache_key(model, devices, context, seq, overrides, target, RING_SUMS, RING_ATTENTION)
    out = {"model": model, "devices": devices, "mesh": f"1x{rows}", "context": context, "seq_len": seq,
           "sequences": rows, "tokens_per_device": seq // context, "overrides": overrides, "ring_sums": RING_SUMS,
           "ring_attention": RING_ATTENTION}
    devs = targets.devices(target, (1, rows), 1, context)
    with targets.tracing_for(target):
        cfg, plan, opt, loss_fn, batch = report.build(model, f"1x{rows}", "full_shard", "bf16", "full", rows, seq,
                                                      devs, "cudnn", context=context, overrides=overrides,
                                                      ring_sums=RING_SUMS, ring_attention=RING_ATTENTION)
        est = memory.estimate(plan, opt, loss_fn, batch, prefetch=True, backend="gpu")
        out["estimate"] = est.as_dict()
        if compile_ and key in cache:
            out.update({k: cache[key][k] for k in ("compiled", "compile_s", "ring_permute_bytes",
                                                   "ring_formula_bytes") if k in cache[key]})
            out["reused"] = True
        elif compile_:
            t = time.time()
            compiled = targets.compile_step(target, plan, opt, loss_fn, batch)
            out["compile_s"] = round(time.time() - t, 1)
            out["compiled"] = memory.measure(compiled)
            out["ring_permute_bytes"] = memory.comm_measured(compiled, plan.n_devices).get("collective-permute", 0.0)
            out["ring_formula_bytes"] = memory.comm_formula(plan, backend="gpu", batch=batch).get(
                "collective-permute", 0.0)
    jax.clear_caches()
    total = out.get("compiled", {}).get("total")
    print(f"  {model} C={context} T={seq:,}: estimate {est.total / GIB:.2f} GiB"
          + (f", compiled {total / GIB:.2f} GiB ({out['compile_s']} s)" if total else ""), flush=True)
    return out


def longest(model: str, devices: int, context: int, budget: int, overrides: dict, target: str, cache: dict,
            probes: list, save=lambda: None) -> dict:
    """The longest sequence (a multiple of 2C) whose compiled step fits `budget`: from the estimate's
    largest T (bisected on the estimate, which compiles nothing), doubling on compiled memory until
    bracketed, then one refinement at the midpoint (a multiple of 2C)."""
    unit = 2 * context
    est = lambda t: point(model, devices, context, t, overrides, target, False, cache)["estimate"]["total"]
    lo, hi = unit, unit
    while est(hi) <= budget:
        lo, hi = hi, hi * 2
    while hi - lo > max(unit, lo // 16):
        mid = (lo + hi) // 2 // unit * unit
        lo, hi = (mid, hi) if est(mid) <= budget else (lo, mid)
    guess = lo
    fits = {}

    def compiled(t):
        p = point(model, devices, context, t, overrides, target, True, cache)
        probes.append(p)
        save()
        fits[t] = p["compiled"]["total"] <= budget
        return fits[t]

    t = 1 << max(guess.bit_length() - 1, unit.bit_length() - 1)
    if compiled(t):
        while compiled(t * 2):
            t *= 2
        good, bad = t, t * 2
    else:
        while t > unit and not compiled(t // 2):
            t //= 2
        good, bad = t // 2, t
    if good >= unit:
        mid = (good + bad) // 2 // unit * unit
        if mid not in (good, bad) and compiled(mid):
            good = mid
        elif mid not in (good, bad):
            bad = mid
    return {"context": context, "estimate_longest": guess, "longest_fitting": good if fits.get(good) else 0,
            "smallest_failing": bad, "compiled_points": sorted(fits)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--contexts", default="1,2,4,8", help="C values for the longest-sequence search (none: skip)")
    p.add_argument("--points", default="all", choices=("all", "8b", "none"),
                   help="all: also llama-8b 256k C = 8 and llama-70b 128k on 64; 8b: only the first; none")
    p.add_argument("--seq-lens", default="262144",
                   help="the llama-8b C = 8 single points' sequence lengths, comma-separated (default: 256k)")
    p.add_argument("--device-memory-gib", type=float, default=80.0)
    p.add_argument("--target", default="h100")
    p.add_argument("--model-option", action="append", default=[], metavar="NAME=VALUE",
                   help="replace a field of the models' configs (e.g. a tiled MLP's tile size, once it exists)")
    p.add_argument("--ring-sums", default="fp32", choices=("fp32", "bf16"),
                   help="the ring backward's sums across hops (train.py's --ring-sums)")
    p.add_argument("--ring-attention", default="blockwise", choices=("blockwise", "cudnn"),
                   help="the ring's per-block attention (train.py's --ring-attention; this benchmark's figures are "
                   "the blockwise kernel's unless cudnn is named)")
    p.add_argument("--reuse", default=None, help="a JSON of an earlier run: its compiled figures for identical points")
    p.add_argument("--seed-log", default=None, help="an earlier run's printed log: its compiled totals for identical "
                   "points (the breakdown is recomputed; argument/temp not known)")
    p.add_argument("--from-logs", nargs="+", default=None, metavar="LOG",
                   help="compile nothing: assemble the JSON from earlier runs' printed logs (their compiled totals), "
                   "with the estimate's breakdown recomputed at each point; for a run stopped before its end")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    global RING_SUMS, RING_ATTENTION
    RING_SUMS, RING_ATTENTION = a.ring_sums, a.ring_attention
    overrides = options(a.model_option)
    budget = int(a.device_memory_gib * GIB)
    cache = {}
    if a.reuse:
        with open(a.reuse) as fh:
            old = json.load(fh)
        for q in old.get("probes", []) + old.get("points", []):
            if "compiled" in q:
                cache[cache_key(q["model"], q["devices"], q["context"], q["seq_len"], q["overrides"], old["target"],
                                q.get("ring_sums", "fp32"), q.get("ring_attention", "blockwise"))] = q
    for log in ([a.seed_log] if a.seed_log else []) + (a.from_logs or []):
        import re
        for line in open(log):
            m = re.match(r"\s+(\S+) C=(\d+) T=([\d,]+): estimate [\d.]+ GiB, compiled ([\d.]+) GiB \(([\d.]+) s\)", line)
            if m:
                model, c, t = m.group(1), int(m.group(2)), int(m.group(3).replace(",", ""))
                devices = 64 if model == "llama-70b" else 8
                cache[cache_key(model, devices, c, t, overrides, a.target, a.ring_sums, a.ring_attention)] = {   # the log's own setting
                    "compiled": {"total": int(float(m.group(4)) * GIB)}, "compile_s": float(m.group(5))}
    import jax
    t0 = time.time()
    out = {"command": "python benchmarks/context_long.py " + " ".join(sys.argv[1:] if argv is None else argv),
           "device": f"{_cpu()}, no GPU: XLA:GPU compiled for the target's topology",
           "target": a.target, "device_memory": budget, "precision": "bf16", "remat": "full", "loss": "fused",
           "model_options": overrides, "jax": jax.__version__, "date": time.strftime("%Y-%m-%d"),
           "machine": "compiled for an H100 target on a CPU machine, no GPU", "longest": [], "probes": [], "points": []}
    contexts = [] if a.contexts == "none" else [int(c) for c in a.contexts.split(",")]

    def save():   # after every point: a long run's partial results survive
        out["wall_s"] = round(time.time() - t0, 1)
        if a.json:
            with open(a.json, "w") as fh:
                json.dump(out, fh, indent=2)
    if a.from_logs:   # every point the logs compiled, in their order, with today's estimate beside it
        out["note"] = ("compiled totals and compile times from the printed lines of earlier runs of this benchmark "
                       "(" + ", ".join(a.from_logs) + "); the estimates recomputed by this command")
        for key in cache:
            model, devices, c, t, _, _ = json.loads(key)
            out["probes"].append(point(model, devices, c, t, overrides, a.target, True, cache))
        save()
        return 0
    if a.points in ("all", "8b"):
        print("single points", flush=True)
        for seq in (int(t) for t in a.seq_lens.split(",")):
            out["points"].append(point("llama-8b", 8, 8, seq, overrides, a.target, True, cache))
            save()
    if a.points == "all":
        out["points"].append(point("llama-70b", 64, 8, 131072, overrides, a.target, True, cache))
        save()
    for c in contexts:
        print(f"llama-8b, 8 GPUs, --context {c}: longest sequence in {a.device_memory_gib:g} GiB", flush=True)
        out["longest"].append(longest("llama-8b", 8, c, budget, overrides, a.target, cache, out["probes"], save))
        save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
