"""The pages of docs/results/, one builder per family of result JSON files (see results_pages.py).
Each returns the page's lines; every figure is computed from the JSON, never typed in."""
from __future__ import annotations

from results_source import GIB, MIB, g, load, source, table


def memory_page() -> list[str]:
    d = load("memory.json")
    out = ["# Per-device memory: devices, depth, the largest model in 80 GiB", ""] + source("memory.json", d)
    out += [f"llama-1b shape ({d['precision']}, {d['optimizer']}, remat full, {d['per_device_batch']} x {d['seq_len']} "
            "tokens per device). Compiled = XLA:CPU's buffer assignment of the train step as `train.py` runs "
            "it (fused head and loss, `jfsdp.adamw`, `jfsdp.config.xla_flags.CPU_FLAGS`); GiB per device, in "
            "parentheses the persistent state (compiled arguments); estimate = `jfsdp.planning.memory.estimate`.",
            "", "## Against the number of devices", ""]
    by = {(r["devices"], r["strategy"]): r for r in d["vs_devices"]}
    strategies = ("full_shard", "shard_grad_op", "no_shard")
    rows = []
    for n in sorted({r["devices"] for r in d["vs_devices"]}):
        cells = [by[n, s] for s in strategies]
        rows.append([n] + [f"{g(r['compiled_gib'])} ({g(r['state_gib'])})" for r in cells]
                    + [" / ".join(g(r["estimate_gib"] / r["compiled_gib"]) for r in cells)])
    out += table(["devices", "FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "estimate / compiled (FS, ZeRO-2, DDP)"],
                 rows, "rrrrl")
    out += ["## Against depth (FULL_SHARD, 16 devices, llama-1b width)", ""]
    by = {(r["n_layers"], r["remat"]): r for r in d["vs_depth"]}
    rows = [[n, g(by[n, "full"]["compiled_gib"]), g(by[n, "none"]["compiled_gib"]),
             f"{g(by[n, 'full']['estimate_gib'])} / {g(by[n, 'none']['estimate_gib'])}"]
            for n in sorted({r["n_layers"] for r in d["vs_depth"]})]
    out += table(["units", "remat full", "remat none", "estimate (full / none)"], rows, "rrrr")
    out += [f"## The largest Llama that fits in {d['budget_gib']:.0f} GiB per device", "",
            "Search over depth for two Llama 3 widths (4096: the 8B shape; 8192: the 70B shape; untied), "
            "the boundary settled by compiled measurement.", ""]
    rows = [[r["devices"], r["strategy"], f"{r['params'] / 1e9:.1f}B",
             f"w{r['family'][1:]} x {r['n_layers']} layers", f"{r['compiled_gib']:.1f}",
             g(r["estimate_gib"] / r["compiled_gib"]), f"{r['ratio_vs_ddp']:.1f}x" if "ratio_vs_ddp" in r else ""]
            for r in d["largest_models"]]
    return out + table(["devices", "strategy", "largest model", "shape", "compiled GiB/device",
                        "estimate / compiled", "FSDP / DDP"], rows, "rlrlrrr")


def _cells(name: str) -> dict:
    return {r["cell"]["key"]: r for r in load(name)["memory"]}


def _peak(r: dict) -> str:
    """jfsdp's compiled peak of a cell, marked with where it was compiled."""
    j = r["jfsdp"]
    return f"{g(j['peak'] / GIB)}{_mark(j)}"


def _mark(j: dict) -> str:
    return "†" if "h100" in j["backend"] else "*" if "widened" in j["backend"] else ""


FSDP2_MARKS = ("`*`: compiled for XLA:CPU, which widens bf16 to f32 (not the bf16 figure); `†`: compiled for an "
               "H100 target on the CPU machine (XLA:GPU, bf16 as bf16, no GPU ran); other jfsdp figures XLA:CPU. "
               "FSDP2: `FSDPMemTracker` peak of step 2 on the fake process group (FakeTensorMode). GiB per rank; "
               "✓: at or below 0.9 x FSDP2.")


def _goal(x: float) -> str:
    return f"{x:.3f}" + (" ✓" if x <= 0.9 else "")


def fsdp2_memory_page() -> list[str]:
    name = "torch_compare_memory.json"
    d, now, plain = load(name), _cells(name), _cells("torch_compare.json")
    out = ["# Memory per rank against PyTorch FSDP2: the current default", ""] + source(name, d)
    out += ["jfsdp as `train.py` and the planner run it: fused head and loss, blockwise attention on CPU, "
            "clipping fused into AdamW, the root gathered where it is used, XLA:CPU's memory-minimizing "
            f"scheduler. llama-1b shape, batch {d['memory_setup']['per_rank_batch']} x seq per rank, "
            f"{d['memory_setup']['optimizer']}. \"plain head\": the first comparison "
            "([fsdp2-first-run.md](fsdp2-first-run.md)), before the fused head. " + FSDP2_MARKS, ""]
    rows = []
    for key, r in now.items():
        c, old = r["cell"], plain.get(key)
        rows.append([c["world"], c["mesh"], c["strategy"], c["precision"], c["remat"], c["seq"],
                     g(r["torch"]["peak"] / GIB), _peak(old) if old else "—", _peak(r), _goal(r["ratio"])])
    return out + table(["W", "mesh", "strategy", "precision", "remat", "seq", "FSDP2", "jfsdp plain head",
                        "jfsdp now", "now / FSDP2"], rows, "rllllrrrrr")


def fsdp2_in_backward_page() -> list[str]:
    name = "torch_compare_memory_ib.json"
    d, ib, usual = load(name), _cells(name), _cells("torch_compare_memory.json")
    out = ["# Memory per rank against PyTorch FSDP2: the optimizer inside the backward pass", ""] + source(name, d)
    out += ["The goal's FULL_SHARD cells, jfsdp with `update_in_backward=True` beside the usual step (from "
            "[fsdp2-memory.md](fsdp2-memory.md)); the lower of the two in bold. " + FSDP2_MARKS, ""]
    rows = []
    for key, r in sorted(ib.items(), key=lambda kv: (kv[1]["cell"]["world"], kv[1]["cell"]["precision"] != "fp32",
                                                      kv[1]["cell"]["seq"])):
        c, u = r["cell"], usual[key]
        a, b = _peak(u), _peak(r)
        if u["jfsdp"]["peak"] <= r["jfsdp"]["peak"]:
            a = f"**{a}**"
        else:
            b = f"**{b}**"
        rows.append([c["world"], c["precision"], c["seq"], g(r["torch"]["peak"] / GIB), a, b, _goal(r["ratio"])])
    return out + table(["W", "precision", "seq", "FSDP2", "jfsdp usual step", "jfsdp update in backward",
                        "in backward / FSDP2"], rows, "rlrrrrr")


SHORT = {"sharded grads": "grads", "vocab-sized": "vocab", "attention TxT": "TxT", "all-layer activations":
         "all-layer act", "gathered unit": "unit", "gathered units": "all gathered units"}


def _breakdowns(r: dict) -> tuple[str, str]:
    j, b = r["jfsdp"], r["torch"]["breakdown"]
    pb = j["peak_buffers"]
    ours = ", ".join(f"{SHORT.get(k, k)} {g(v / GIB)}" for k, v in pb["groups"].items() if v >= 0.01 * GIB)
    ours += f"; holes {g((j['peak'] - pb['live_total']) / GIB)}"
    theirs = ", ".join(f"{k} {g(v / GIB)}" for k, v in (
        ("param", b["Sharded Param"] + b["Unsharded Param"]), ("grad", b["Sharded Grad"] + b["Unsharded Grad"]),
        ("opt", b["OptState"]), ("act", b["Activation"]), ("temp", b["Temp"]),
        ("AG+RS", b["All Gather"] + b["Reduce Scatter"])))
    return ours, theirs


def fsdp2_first_run_page() -> list[str]:
    name = "torch_compare.json"
    d = load(name)
    out = ["# Against PyTorch FSDP2: the first comparison (plain head, XLA attention)", ""] + source(name, d)
    out += ["The jfsdp of that day: logits materialized, then `log_softmax`; attention as XLA's reference "
            "(T x T scores). Kept because it names the buffers behind every gap, which the later versions "
            "removed. `holes`: the assigned total minus what is live at XLA's peak (packing). " + FSDP2_MARKS, "",
            "## Memory per rank", ""]
    rows = []
    for r in d["memory"]:
        c = r["cell"]
        ours, theirs = _breakdowns(r)
        mark = _mark(r["jfsdp"])
        rows.append([c["world"], c["mesh"], c["strategy"], c["precision"], c["remat"], c["seq"],
                     g(r["torch"]["peak"] / GIB), _peak(r), f"{r['ratio']:.2f}{mark}", ours, theirs])
    out += table(["W", "mesh", "strategy", "precision", "remat", "seq", "FSDP2", "jfsdp", "jfsdp / FSDP2",
                  "live at jfsdp's peak (XLA)", "FSDP2 at its peak"], rows, "rllllrrrrll")
    sp = d["speed"]
    out += ["## Speed", "", f"`{sp['model']}` ({sp['params'] / 1e6:.1f}M parameters), global batch "
            f"{sp['global_batch'][0]} x {sp['global_batch'][1]} tokens, {sp['precision']}, remat {sp['remat']}, "
            f"{sp['strategy']}, mean of {sp['timed_steps']} steps after {sp['warmup_steps']} warm-up steps; jfsdp "
            "on W fake XLA:CPU devices, FSDP2 on W gloo processes. Not a stable measurement: the two cores "
            "were shared with other jobs (see [../pytorch-fsdp2.md](../pytorch-fsdp2.md)).", ""]
    rows = [[w["world"], f"{w['jfsdp_tokens_per_sec']:,.0f}", f"{w['torch_tokens_per_sec']:,.0f}", g(w["ratio"])]
            for w in sp["worlds"]]
    return out + table(["W", "jfsdp tokens/s", "FSDP2 tokens/s", "jfsdp / FSDP2"], rows, "rrrr")


def throughput_page() -> list[str]:
    out = ["# Throughput on CPU", "", "`benchmarks/throughput.py` on synthetic tokens: tokens/s and ms per step "
           "over the timed steps after warm-up, memory = the compiled train step (CPU devices keep no "
           "allocator statistics). CPU timings on a shared 2-core machine are noisy: compare rows of one "
           "run only.", "", "## Strategies", ""]
    d = load("throughput_cpu.json")
    out += source("throughput_cpu.json", d)
    r0 = d["rows"][0]
    out += [f"Mesh {r0['mesh']}, {r0['batch_size']} x {r0['seq_len']} tokens, {r0['precision']}, remat "
            f"{r0['remat']}, {r0['warmup_steps']} warm-up + {r0['timed_steps']} timed steps.", ""]
    rows = [[r["model"], r["strategy"], f"{r['tokens_per_sec']:,.0f}", f"{r['step_s'] * 1e3:.0f}",
             f"{r['peak_memory_bytes'] / MIB:.1f}"] for r in d["rows"]]
    out += table(["model", "strategy", "tokens/s", "ms/step", "MiB/device (compiled)"], rows, "llrrr")
    out += ["## The optimizer inside the backward pass", ""]
    for name, title in (("throughput_update_in_backward_cpu.json", "clipped (`--clip 1.0`)"),
                        ("throughput_update_in_backward_noclip_cpu.json", "unclipped (`--clip 0`)")):
        d = load(name)
        out += [f"### {title}", ""] + source(name, d)
        usual = {r["model"]: r for r in d["rows"] if not r["update_in_backward"]}
        rows = [[r["model"], f"{usual[r['model']]['step_s'] * 1e3:.1f}", f"{r['step_s'] * 1e3:.1f}",
                 f"{(r['step_s'] / usual[r['model']]['step_s'] - 1) * 100:+.0f}%",
                 f"{usual[r['model']]['peak_memory_bytes'] / MIB:.1f} / {r['peak_memory_bytes'] / MIB:.1f}"]
                for r in d["rows"] if r["update_in_backward"]]
        out += table(["model", "usual step, ms", "in backward, ms", "change", "MiB/device (usual / in backward)"],
                     rows, "lrrrr")
    return out


def checkpoint_page() -> list[str]:
    d = load("checkpoint.json")
    out = ["# Checkpoint cost", ""] + source("checkpoint.json", d)
    out += [f"Median of {d['repeats']} after a warm-up save; local disk; logical on-disk layout. The state is "
            "freshly initialized (AdamW moments zero, which orbax's compressed format stores in almost "
            "nothing), so the size on disk is about the parameters' alone.", ""]
    rows = [[r["model"], f"{r['params'] / 1e6:.1f}M", f"{r['state_bytes'] / 1e6:,.0f} MB",
             f"{r['size_bytes'] / 1e6:,.0f} MB"] + [f"{r[k]:.2f} s" for k in (
                 "async_save_blocked_s", "async_save_total_s", "sync_save_blocked_s", "restore_1x8_s",
                 "restore_2x4_s", "restore_1x3_s")] for r in d["results"]]
    return out + table(["model", "params", "state in memory", "on disk", "async save: loop blocked",
                        "async save: until on disk", "sync save (loop blocked)", "restore onto 1x8", "onto 2x4",
                        "onto 1x3"], rows, "lrrrrrrrrr")


def moe_page() -> list[str]:
    d = load("moe.json")
    c = d["config"]
    out = ["# Mixture of Experts: gather or expert parallel, and chunked all-to-alls", ""] + source("moe.json", d)
    out += ["## Gather against ep, XLA:CPU", "", f"Mesh {d['mesh']}, fp32, FULL_SHARD, remat full, AdamW; dim "
            f"{c['dim']}, {c['n_layers']} MoE layers of {c['n_experts']} experts, top-{c['top_k']}, capacity "
            f"{c['capacity_factor']}. \"model\" = the cost model's MoE bytes per device per step, \"HLO\" = every "
            "collective of the compiled step, \"mem\" = compiled per-device total.", ""]
    rows = []
    for r in d["grid"]:
        ga, ep = r["gather"], r["ep"]
        rows.append([r["tokens_per_device"], r["expert_dim"],
                     f"{g(ga['model_mib'])} / {g(ga['compiled_comm_mib']['total'])}",
                     g(ga["compiled_memory_mib"]["total"]),
                     f"{g(ep['model_mib'])} / {g(ep['compiled_comm_mib']['total'])}",
                     g(ep["compiled_memory_mib"]["total"]), r["auto"]["chosen"], r["cheaper_compiled"]])
    out += table(["tokens / device", "expert hidden", "gather: model / HLO MiB", "gather: mem MiB",
                  "ep: model / HLO MiB", "ep: mem MiB", "chosen (`auto`)", "cheaper in the compiled step"],
                 rows, "rrrrrrll")
    gpu = d["gpu"]
    ks = sorted({int(k) for s in gpu["shapes"] for k in s["by_k"]})
    out += [f"## Exposed all-to-all by chunk count, {gpu['target'].upper()} target", "",
            f"{gpu['note']}. Mesh {d['mesh']}, bf16, `ep`, remat full, {gpu['shapes'][0]['config']['n_layers']} "
            "MoE layers, width = expert hidden. MiB of all-to-all per step with no matmul or loop in flight "
            "(`jfsdp.planning.hlo.overlap`), by chunk count k; the bytes sent do not change with k.", ""]
    rows = []
    for s in gpu["shapes"]:
        by = s["by_k"]
        rows.append([s["config"]["dim"], s["tokens_per_device"], g(by["1"]["a2a_mib"])]
                    + [g(by[str(k)]["exposed_a2a_mib"]) for k in ks]
                    + [s["chosen"]["chunks"],
                       f"{by['1']['compiled_memory_mib']:.1f} / {s['chosen']['compiled_memory_mib']:.1f}"])
    return out + table(["width", "tokens / device", "all-to-all MiB / step"] + [f"k = {k}" for k in ks]
                       + ["`auto` picks", "compiled MiB, k = 1 / picked"], rows, "r" * (5 + len(ks)))


def _gpu_rows(rows: list[dict], key) -> list[list]:
    return [[key(r), g(r["compiled_gib"]), g(r["temp_gib"]), g(r["state_gib"]), g(r["estimate_gib"]),
             g(r["comm_gib"]), g(r["contract_gib"]), g(r["exposed_gib"]), g(r["hidden_gib"])] for r in rows]


GPU_HEAD = ["compiled (XLA:GPU)", "temp", "state", "estimate", "communication (HLO)", "contract formula",
            "exposed AG+RS", "hidden"]


def gpu_target_page() -> list[str]:
    d = load("gpu_target_h100.json")
    out = ["# Compiled for an H100 without one", ""] + source("gpu_target_h100.json", d)
    out += ["bf16 mixed precision, AdamW, cuDNN attention, plain logits loss, jfsdp's GPU defaults: FULL_SHARD runs "
            "the prefetch pipeline with `PREFETCH_GPU_FLAGS` (under every remat policy since 2026-11-24; the "
            "'path' column says which ran), the other rows the plain scan with `GPU_FLAGS` "
            "(`jfsdp.config.xla_flags`). GiB per device; communication = bytes sent per device per step; "
            "exposed / hidden = all-gather and reduce-scatter bytes with no matmul or loop in flight / with one "
            "(`jfsdp.planning.hlo.overlap`).", ""]
    r0 = d["strategies"][0]
    out += [f"## llama-1b, {r0['batch']} x {r0['seq']} tokens, remat {r0['remat']}, per strategy", ""]
    out += table(["strategy", "mesh"] + GPU_HEAD, [[r["strategy"]] + row for r, row in zip(
        d["strategies"], _gpu_rows(d["strategies"], lambda r: r["mesh"]))], "ll" + "r" * 8)
    out += ["## FULL_SHARD against depth (llama-1b width, 1x8)", ""]
    out += table(["units"] + GPU_HEAD, _gpu_rows(d["depth"], lambda r: r["n_layers"]), "r" * 9)
    out += ["## Overlap: prefetch pipeline, plain scan, XLA defaults (llama-1b 1x8 FULL_SHARD, remat full)", ""]
    out += table(["path"] + GPU_HEAD, _gpu_rows(d["overlap"], lambda r: r["options"]), "l" + "r" * 8)
    r0 = d["torchtitan_8b"][0]
    out += [f"## The torchtitan Llama 3.1 8B configuration ({r0['mesh']}, global batch {r0['batch']} x {r0['seq']})",
            "", "`remat_collectives`: all-gathers XLA's rematerialization pass recomputed next to their use.", ""]
    rows = [[r["remat"], "prefetch pipeline" if r["prefetch"] else "plain scan", r["remat_collectives"]] + row[1:]
            for r, row in zip(d["torchtitan_8b"], _gpu_rows(d["torchtitan_8b"], lambda r: r["remat"]))]
    return out + table(["remat", "path", "remat_collectives"] + GPU_HEAD, rows, "llr" + "r" * 8)


PLANS = (("plan_llama1b_h100.json", "llama-1b on an H100 target",
          "Written before the prefetch pipeline became the GPU default: the plain scan with `GPU_FLAGS` (the "
          "`XLA options` below), the same step as the \"plain scan + flags\" row of [gpu-target.md](gpu-target.md). "
          "The current planner's text output for this command (prefetch pipeline) is "
          "[`benchmarks/results/plan_llama1b_h100.txt`](../../benchmarks/results/plan_llama1b_h100.txt)."),
         ("torchtitan_8b_h100.json", "The torchtitan Llama 3.1 8B configuration, H100 target", ""),
         ("torchtitan_8b_h200.json", "The same on an H200 target", ""),
         ("llama8b_local1_h100.json", "The same at local batch 1, H100 target", ""))


def plans_page() -> list[str]:
    out = ["# Planner reports for GPU targets", "", "`python -m jfsdp.plan --target NAME --json FILE` compiles the "
           "train step for a named GPU on a machine without one and writes the estimate, XLA:GPU's memory and "
           "collectives, and the overlap of the scheduled program. GiB per device.", ""]
    for name, title, note in PLANS:
        d = load(name)
        out += [f"## {title}", ""] + source(name, d) + ([note, ""] if note else [])
        out += [f"`{d['model']}` ({d['params'] / 1e9:.2f}B parameters), mesh {d['mesh']}, {d['strategy']}, "
                f"{d['precision']}, remat {d['remat']}, global batch {d['batch_size']} x {d['seq_len']}, attention "
                f"{d['attention']}; compiled in {d['compile_s']} s.", ""]
        e, c = d["estimate"], d["compiled"]
        out += table(["", "estimate", f"compiled ({c['backend']})"], [
            ["state between steps", g(e["persistent"] / GIB), g(c["argument"] / GIB)],
            ["peak of the step", g(e["total"] / GIB), g(c["total"] / GIB)]], "lrr")
        f, m, o = d["comm_formula"], d["comm_compiled"], d["overlap"]
        rows = [[k, g(f[k] / GIB), g(m[k] / GIB), g(o[k]["hidden_bytes"] / GIB), g(o[k]["exposed_bytes"] / GIB)]
                for k in ("all-gather", "reduce-scatter", "all-reduce")]
        rows.append(["total", g(f["total"] / GIB), g(m["total"] / GIB), "", ""])
        out += table(["bytes sent per device per step", "formula", "compiled HLO", "hidden", "exposed"], rows, "lrrrr")
        dtypes = ", ".join(f"{k} {t}" for k, t in d["collective_dtypes"])
        options = " ".join(f"{k}={v}" for k, v in d["xla_options"].items())
        out += [f"Contract 3Ψ·b·(S−1)/S: {g(f['contract'] / GIB)} GiB. Dtypes on the wire: {dtypes}. XLA options: "
                f"`{options}`. Fits in {d['device_memory'] / GIB:.2f} GiB: {'yes' if d['fits'] else 'no'}; largest "
                f"global batch that fits: {d['largest_global_batch']}.", "", "```", d["overlap_table"].rstrip(), "```", ""]
    return out
