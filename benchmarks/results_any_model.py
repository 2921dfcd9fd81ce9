"""The page of docs/results/ for benchmarks/any_model.py at llama-1b and llama-8b: a Llama given as it is
(its own Python loop, its own nn.scan) beside the same model as `jfsdp.Stacked`, on XLA:CPU and compiled
for an H100 target, with the exposed collectives where the target schedules them. One section per JSON;
every figure is computed from it. Standard library only."""
from __future__ import annotations

from results_source import GIB, g, load, source, table

NAMES = ("any_model_llama1b.json", "any_model_llama8b.json")
KINDS = ("all-gather", "reduce-scatter", "all-to-all")   # all-to-all: an embedding looked up by columns


def _comm(r: dict, kind: str) -> str:
    sent = r["collectives"].get(kind, {}).get("wire_bytes", 0) / GIB
    if "exposed" not in r or kind not in r["exposed"]:
        return f"{g(sent)} sent"
    e = r["exposed"][kind]
    return f"{g(e['exposed_bytes'] / GIB)} of {g(sent)} ({e['exposed_ops']} of {e['exposed_ops'] + e['hidden_ops']} ops)"


def _section(name: str) -> list[str]:
    d = load(name)
    m = d["model"]
    out = [f"## {name.removeprefix('any_model_').removesuffix('.json').replace('llama', 'llama-')}", ""]
    out += source(name, d)
    out += [f"Llama with {m['n_layers']} blocks, width {m['dim']}, vocabulary {m['vocab_size']}, "
            f"{'tied' if m['tie_embeddings'] else 'untied'} embeddings; global batch {d['batch']} x {d['seq']}, "
            f"{d['loss']} loss.", ""]
    model = lambda r: "as it is, own nn.scan" if r["as_is"] == "scan" else "as it is" if r["as_is"] else "Stacked"
    rows = [[model(r), r["target"], r["mesh"], r["strategy"], r["remat"],
             "on" if r["prefetch"] else "off", g(r["total_bytes"] / GIB)] + [_comm(r, k) for k in KINDS]
            + [g(r["estimate_ratio"], 3)] for r in d["rows"]]
    head = ["model", "target", "mesh", "strategy", "remat", "prefetch", "memory",
            "all-gathers (H100: exposed of sent)", "reduce-scatters (H100: exposed of sent)",
            "all-to-alls (H100: exposed of sent)", "estimate / compiled"]
    return out + table(head, rows, "llllllrrrrr")


def any_model_page() -> list[str]:
    out = ["# A model given as it is beside jfsdp.Stacked (llama-1b, llama-8b)", "",
           "*As it is*: `models.llama.Llama` with its own Python loop, "
           "`fully_shard(model, ..., units=LlamaBlock)`; *own nn.scan*: `models.llama.ScannedLlama` given as it is; "
           "*Stacked*: the same blocks as `jfsdp.Stacked`. "
           "Memory: XLA's buffer assignment per device (GiB). Collectives: GiB each device sends per step; on "
           "the H100 target, exposed = in flight while no matmul runs on XLA:GPU's schedule "
           "(`jfsdp.planning.hlo.overlap`). Estimate: the planner's analytic figure over the compiled one. "
           "The H100 rows are compiled for an H100 target on the CPU machine: nothing ran on a GPU.", ""]
    for name in NAMES:
        out += _section(name)
    return out
