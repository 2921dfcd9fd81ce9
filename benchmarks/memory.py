"""The FSDP paper's memory claims, reproduced by measuring the compiled train step.

    python benchmarks/memory.py --json benchmarks/results/memory.json [--png benchmarks/results/memory.png]

Every number is XLA's buffer assignment (`compiled.memory_analysis()`, argument + output + temp −
alias) of jfsdp's real train step (AdamW, fp32, donated state, the fused head + cross-entropy of
train.py), lowered from abstract inputs on 64
fake CPU devices: nothing is allocated. fp32 because XLA's CPU backend widens bf16 to f32 anyway
(jfsdp.config.policy.wire_dtype), so an fp32 plan is what this machine can measure faithfully.

1. per-device memory against devices (1..64) for each strategy, fixed model (llama-1b shape);
2. per-device memory against depth for FULL_SHARD with and without remat;
3. the largest Llama (a width x depth family around the Llama 3 shapes) that fits in 80 GiB per
   device with NO_SHARD (DDP) and with FULL_SHARD on 8, 16 and 64 devices.
"""
from __future__ import annotations

import argparse
import os
import sys

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=64").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# `models` is the repository's own package, imported from the repository root (pip installs only jfsdp)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from jfsdp.config.xla_flags import cpu_xla_flags  # noqa: E402  (jax reads XLA_FLAGS when its backend starts)

os.environ["XLA_FLAGS"] = cpu_xla_flags()   # XLA:CPU's memory-minimizing scheduler, as jfsdp trains on CPU

import dataclasses  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import jfsdp  # noqa: E402
import models  # noqa: E402
from jfsdp.planning import memory  # noqa: E402
from jfsdp.train import losses  # noqa: E402

GiB = 2**30
SEQ = 2048
BUDGET = 80 * GiB
# Llama 3 shapes with free depth: the 8B width (4096) and the 70B width (8192).
FAMILIES = {"w4096": models.get_config("llama-8b"), "w8192": models.get_config("llama-70b")}


def setup(cfg, mesh_spec, strategy, remat="full", per_device_batch=1):
    r, s = jfsdp.parse_mesh(mesh_spec)
    mesh = jfsdp.make_mesh(mesh_spec, jax.devices()[: r * s])
    x = jax.ShapeDtypeStruct((per_device_batch * r * s, SEQ), jnp.int32)
    root, unit, n = models.parts(cfg)
    # as train.py and the planner run it: the fused, chunked head + cross-entropy (no full logits)
    plan = jfsdp.fully_shard(jfsdp.Stacked(root, unit, n, head_method="head_features"), mesh, x, strategy=strategy,
                             remat=remat, mp_policy=jfsdp.MixedPrecision.parse("fp32"))
    return plan, jfsdp.adamw(1e-4), losses.lm_loss(vocab_major=cfg.tie_embeddings), {"inputs": x, "targets": x}


def measure(cfg, mesh_spec, strategy, remat="full") -> dict:
    plan, opt, loss, batch = setup(cfg, mesh_spec, strategy, remat)
    t = time.time()
    m = memory.measure(memory.compile_step(plan, opt, loss, batch))
    est = memory.estimate(plan, opt, loss, batch).total
    return {"params": cfg.num_params(), "n_layers": cfg.n_layers, "mesh": mesh_spec, "strategy": strategy,
            "remat": remat, "compiled_gib": m["total"] / GiB, "state_gib": m["argument"] / GiB,
            "estimate_gib": est / GiB, "compile_s": round(time.time() - t, 1)}


def estimate_fits(cfg, mesh_spec, strategy) -> bool:
    plan, opt, loss, batch = setup(cfg, mesh_spec, strategy)
    return memory.estimate(plan, opt, loss, batch).total <= BUDGET


def vs_devices(log):
    cfg = models.get_config("llama-1b")
    rows = []
    for n in (1, 2, 4, 8, 16, 32, 64):
        for strategy in ("full_shard", "shard_grad_op", "no_shard"):
            mesh = f"{n}x1" if strategy == "no_shard" else f"1x{n}"
            rows.append(measure(cfg, mesh, strategy) | {"devices": n})
            log(rows[-1])
    return rows


def vs_depth(log):
    base = models.get_config("llama-1b")
    rows = []
    for depth in (2, 4, 8, 16, 32):
        for remat in ("full", "none"):
            rows.append(measure(dataclasses.replace(base, n_layers=depth), "1x16", "full_shard", remat))
            log(rows[-1])
    return rows


def largest_fitting(family, mesh_spec, strategy, log):
    """Largest depth of `family` whose compiled step fits in BUDGET: the estimate brackets it,
    then compiled measurements settle the boundary (the answer is by measurement)."""
    fits_est = lambda L: estimate_fits(dataclasses.replace(family, n_layers=L), mesh_spec, strategy)
    if not fits_est(1):
        lo = 0
    else:
        lo, hi = 1, 2
        while fits_est(hi):
            lo, hi = hi, hi * 2
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits_est(mid) else (lo, mid)
    def fits(L):
        return L >= 1 and measure(dataclasses.replace(family, n_layers=L), mesh_spec, strategy)["compiled_gib"] * GiB <= BUDGET
    # bisection on compiled measurements inside [0.8, 1.25] x the estimate's answer (the estimate
    # is within 10% of the compiled total; widened if the bracket does not hold)
    lo, hi = int(lo * 0.8), int(lo * 1.25) + 2
    while lo >= 1 and not fits(lo):
        lo //= 2
    while fits(hi):
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    L = lo
    row = measure(dataclasses.replace(family, n_layers=L), mesh_spec, strategy)
    log(row)
    return row


def largest_models(log):
    rows = []
    for n in (8, 16, 64):
        for strategy, mesh in (("no_shard", f"{n}x1"), ("full_shard", f"1x{n}")):
            best = None
            for name, fam in FAMILIES.items():
                r = largest_fitting(fam, mesh, strategy, log)
                if r and (best is None or r["params"] > best["params"]):
                    best = r | {"family": name}
            rows.append({"devices": n, "strategy": strategy, **(best or {"params": 0})})
    for n in (8, 16, 64):
        ddp = next(r for r in rows if r["devices"] == n and r["strategy"] == "no_shard")["params"]
        fsdp = next(r for r in rows if r["devices"] == n and r["strategy"] == "full_shard")
        fsdp["ratio_vs_ddp"] = fsdp["params"] / ddp if ddp else None
    return rows


def plot(result, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(16, 4.5))
    for strategy in ("full_shard", "shard_grad_op", "no_shard"):
        rows = [r for r in result["vs_devices"] if r["strategy"] == strategy]
        a.plot([r["devices"] for r in rows], [r["compiled_gib"] for r in rows], "o-", label=strategy)
    a.set(xscale="log", xlabel="devices", ylabel="GiB per device (compiled)", title="llama-1b shape, per device vs devices")
    a.set_xticks([1, 2, 4, 8, 16, 32, 64], labels=["1", "2", "4", "8", "16", "32", "64"])
    a.legend()
    for remat in ("full", "none"):
        rows = [r for r in result["vs_depth"] if r["remat"] == remat]
        b.plot([r["n_layers"] for r in rows], [r["compiled_gib"] for r in rows], "o-", label=f"remat {remat}")
    b.set(xlabel="units (layers)", ylabel="GiB per device (compiled)", title="FULL_SHARD on 16 devices vs depth")
    b.legend()
    rows = result["largest_models"]
    labels = [f"{r['strategy']}\n{r['devices']} dev" for r in rows]
    c.bar(range(len(rows)), [r["params"] / 1e9 for r in rows], color=["tab:gray" if r["strategy"] == "no_shard" else "tab:blue" for r in rows])
    c.set_xticks(range(len(rows)), labels=labels, fontsize=7)
    c.set(ylabel="billion parameters", title="largest Llama fitting 80 GiB/device")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", required=True)
    p.add_argument("--png", default=None, help="plot (default: the --json path with .png)")
    p.add_argument("--only", choices=("devices", "depth", "largest"), default=None)
    p.add_argument("--reestimate", action="store_true",
                   help="recompute estimate_gib of every row of an existing --json with the current estimate (no compiles)")
    a = p.parse_args(argv)
    log = lambda r: print(json.dumps(r), flush=True)
    if a.reestimate:
        with open(a.json) as f:
            result = json.load(f)
        base = models.get_config("llama-1b")
        for part in ("vs_devices", "vs_depth", "largest_models"):
            for r in result.get(part, []):
                if "mesh" not in r:
                    continue
                cfg = FAMILIES[r["family"]] if part == "largest_models" else base
                plan, opt, loss, batch = setup(dataclasses.replace(cfg, n_layers=r["n_layers"]), r["mesh"], r["strategy"], r["remat"])
                r["estimate_gib"] = memory.estimate(plan, opt, loss, batch).total / GiB
        with open(a.json, "w") as f:
            json.dump(result, f, indent=2)
        return
    t = time.time()
    result = {"device": f"CPU, {jax.device_count()} fake XLA devices", "seq_len": SEQ, "precision": "fp32",
              "optimizer": "AdamW", "per_device_batch": 1, "budget_gib": BUDGET / GiB}
    def save():   # after every part: a long run interrupted keeps what it measured
        result["wall_s"] = round(time.time() - t, 1)
        with open(a.json, "w") as f:
            json.dump(result, f, indent=2)
    if a.only in (None, "devices"):
        result["vs_devices"] = vs_devices(log)
        save()
    if a.only in (None, "depth"):
        result["vs_depth"] = vs_depth(log)
        save()
    if a.only in (None, "largest"):
        result["largest_models"] = largest_models(log)
    save()
    if a.only is None:
        plot(result, a.png or os.path.splitext(a.json)[0] + ".png")
    print(f"done in {result['wall_s']} s")


if __name__ == "__main__":
    sys.exit(main())
