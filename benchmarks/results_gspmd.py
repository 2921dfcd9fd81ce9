"""The page of docs/results/ for benchmarks/gspmd_compare.py: jfsdp beside FSDP by sharding annotations
alone (GSPMD). Every figure is computed from the JSON. Standard library only."""
from __future__ import annotations

from results_source import g, load, source, table

NAME, FUSED = "gspmd_compare.json", "gspmd_compare_fused.json"
KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all")
SHORT = {"all-gather": "AG", "reduce-scatter": "RS", "all-reduce": "AR", "all-to-all": "A2A"}


def _key(r) -> list:
    return [r["model"], r["mesh"], r["remat"], f"{r['batch']} x {r['seq']}"]


def _kinds(side: dict, field: str = "comm_gib") -> str:
    """'AG 3.60, RS 4.03' : the kinds that move more than 0.005 GiB."""
    parts = [f"{SHORT[k]} {g(side[field].get(k, 0.0))}" for k in KINDS if side[field].get(k, 0.0) >= 0.005]
    return ", ".join(parts) or "0"


def _best(r) -> dict:
    return r[f"gspmd-{r['gspmd_best']}"]


def gspmd_page() -> list[str]:
    d = load(NAME)
    out = ["# jfsdp beside FSDP by sharding annotations alone (GSPMD)", ""] + source(NAME, d)
    out += ["Both sides train the same Llama (models/), one row per device, the plain logits loss, `jfsdp.adamw`, "
            "the same remat policy on each unit under `lax.scan`. jfsdp: its train step with its defaults "
            "(FULL_SHARD; on the H100 target the prefetch pipeline for remat full). GSPMD: parameters and Adam "
            "moments as `NamedSharding` over `fsdp`, one `jit`, XLA inserts the collectives; rule `largest` "
            "shards each leaf's largest divisible per-unit dimension, `dim0` its first (FSDP2's Shard(0)); "
            "*best* is the rule with less memory. GiB per device (XLA's buffer assignment); communication = "
            "GiB each device sends per step (ring cost model, loops counted by trip count); exposed / hidden = "
            "bytes with no matmul or loop in flight / with one, on XLA:GPU's schedule "
            "(`jfsdp.planning.hlo.overlap`). [Why not just annotate?](../why-not-annotate.md) reads the table.", ""]
    cpu = [r for r in d["cases"] if r["backend"] == "cpu"]
    gpu = [r for r in d["cases"] if r["backend"] == "h100"]
    if cpu:
        out += ["## XLA:CPU fake devices, fp32", ""]
        rows = [_key(r) + [g(r["jfsdp"]["compiled_gib"]), g(r["gspmd-largest"]["compiled_gib"]),
                           g(r["gspmd-dim0"]["compiled_gib"]), _kinds(r["jfsdp"]), _kinds(_best(r)),
                           " / ".join(f"{r[s]['compile_s']:.0f}" for s in ("jfsdp", "gspmd-largest", "gspmd-dim0"))]
                for r in cpu]
        out += table(["model", "mesh", "remat", "tokens", "jfsdp", "GSPMD largest", "GSPMD dim0",
                      "jfsdp sends", "GSPMD (best) sends", "compile s (jfsdp / largest / dim0)"], rows, "llll" + "rrrllr")
    if gpu:
        out += ["## Compiled for an H100 target on a CPU machine, bf16 (fp32 master weights and moments)", "",
                "jfsdp reduces gradients in fp32 (its bf16 policy, as FSDP2's `reduce_dtype=float32`); the GSPMD "
                "side's reduce-scatter is in bf16, the dtype of the compute, by itself; *jfsdp bf16 RS* is jfsdp "
                "with `MixedPrecision(reduce_dtype=bfloat16)`, the same bytes on the wire.", "",
                "### Memory per device and compile time", ""]
        rows = [_key(r) + [g(r["jfsdp"]["compiled_gib"]), g(r["jfsdp-reduce-bf16"]["compiled_gib"]),
                           g(r["gspmd-largest"]["compiled_gib"]), g(r["gspmd-dim0"]["compiled_gib"]),
                           " / ".join(f"{r[s]['compile_s']:.0f}" for s in ("jfsdp", "gspmd-largest", "gspmd-dim0"))]
                for r in gpu]
        out += table(["model", "mesh", "remat", "tokens", "jfsdp", "jfsdp bf16 RS", "GSPMD largest", "GSPMD dim0",
                      "compile s (jfsdp / largest / dim0)"], rows, "llll" + "rrrrr")
        out += ["### Communication and overlap per step", ""]
        rows = []
        for r in gpu:
            for label, s in (("jfsdp", r["jfsdp"]), ("jfsdp bf16 RS", r["jfsdp-reduce-bf16"]),
                             (f"GSPMD {r['gspmd_best']}", _best(r))):
                rows.append(_key(r) + [label, _kinds(s), g(s["comm_total_gib"]), _kinds(s, "exposed_gib"),
                                       g(s["exposed_total_gib"]), g(s["hidden_total_gib"])])
        out += table(["model", "mesh", "remat", "tokens", "side", "sends by kind", "sends", "exposed by kind",
                      "exposed", "hidden"], rows, "lllll" + "lrlrr")
    return out + fused_section()


def fused_section() -> list[str]:
    """Both sides with jfsdp's fused head + cross-entropy (`--loss fused`): no logits tensor."""
    d = load(FUSED)
    out = ["## Both sides with jfsdp's fused head and cross-entropy", ""] + source(FUSED, d)
    out += ["`jfsdp.lm_loss` (a scan over vocabulary chunks; the logits never exist whole) as the loss of both "
            "sides, train.py's default. jfsdp's column is its default step; GSPMD as above.", ""]
    rows = []
    for r in d["cases"]:
        ex = lambda s: g(s["exposed_total_gib"]) if "exposed_total_gib" in s else "-"
        rows.append(_key(r) + [r["backend"], g(r["jfsdp"]["compiled_gib"]), g(r["gspmd-largest"]["compiled_gib"]),
                               g(r["gspmd-dim0"]["compiled_gib"]), _kinds(r["jfsdp"]), _kinds(_best(r)),
                               f"{ex(r['jfsdp'])} / {ex(_best(r))}"])
    return out + table(["model", "mesh", "remat", "tokens", "backend", "jfsdp", "GSPMD largest", "GSPMD dim0",
                        "jfsdp sends", "GSPMD (best) sends", "exposed (jfsdp / GSPMD)"], rows, "lllll" + "rrrllr")
