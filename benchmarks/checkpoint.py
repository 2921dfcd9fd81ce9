"""Checkpoint cost: save and restore time, size on disk, and how long the training loop is blocked.

    python benchmarks/checkpoint.py --json benchmarks/results/checkpoint.json [--dir /tmp/jfsdp-ckpt-bench]

For each model, on 8 fake CPU devices (mesh 1x8, FULL_SHARD, fp32 params + AdamW moments):
- async save: `Checkpointer.save` returns after the device-to-host copy (blocked_s, what the loop
  waits), the files are written in the background (total_s: until `wait()` returns);
- sync save: the same with asynchronous checkpointing off (the loop waits for all of it);
- restore onto the same mesh (1x8), onto another one (2x4: every array re-placed) and onto 3 devices
  (1x3: the stored logical rows padded to a multiple of 3 instead of 8);
- size on disk of one checkpoint (params + optimizer state + JSON).
Models: llama-small (byte-level, ~11M params) and the llama-1b shape (Llama 3.2 1B widths: vocabulary
128256, dim 2048, ffn 8192, 32/8 heads) cut to 2 of its 16 layers, ~0.38B params (4.6 GB of state),
because the whole 1.24B model's state (15 GB) and its host copy would not fit in this machine's memory.
Each figure is the median of `--repeats` runs (after one warm-up save that also compiles).
"""
from __future__ import annotations

import argparse
import os
import sys

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import dataclasses  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import platform  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import jfsdp  # noqa: E402
import models  # noqa: E402
from jfsdp.io import checkpoint as jckpt  # noqa: E402

MODELS = {
    "llama-small": models.get_config("llama-small"),
    "llama-1b-2layers": dataclasses.replace(models.get_config("llama-1b"), n_layers=2),
}


def plan_for(cfg, mesh):
    root, unit, n = models.parts(cfg)
    devices = jax.devices()[:math.prod(jfsdp.parse_mesh(mesh))]
    plan = jfsdp.fully_shard(jfsdp.Stacked(root, unit, n), jfsdp.make_mesh(mesh, devices=devices),
                             jax.ShapeDtypeStruct((1, 128), jnp.int32))
    return plan, jfsdp.adamw(1e-3, mask=plan.decay_mask())


def du(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def measure(name, cfg, root: Path, repeats: int) -> dict:
    plan, opt = plan_for(cfg, "1x8")
    state = jfsdp.init_state(plan, opt, jax.random.key(0))
    jax.block_until_ready(state)
    n_params = cfg.num_params()
    rec = {"model": name, "params": n_params, "state_bytes": sum(x.nbytes for x in jax.tree.leaves(state))}
    for mode in ("async", "sync"):
        d = root / f"{mode}"
        shutil.rmtree(d, ignore_errors=True)
        c = jckpt.Checkpointer(d, keep=1, async_save=(mode == "async"))
        blocked, total = [], []
        for i in range(repeats + 1):
            jax.block_until_ready(state)
            t0 = time.perf_counter()
            c.save(i + 1, state, {"bench": name}, plan=plan)
            t1 = time.perf_counter()
            c.wait()
            t2 = time.perf_counter()
            if i:   # the first save compiles the finiteness check and sets orbax up
                blocked.append(t1 - t0)
                total.append(t2 - t0)
        rec[f"{mode}_save_blocked_s"] = statistics.median(blocked)
        rec[f"{mode}_save_total_s"] = statistics.median(total)
        if mode == "async":
            rec["size_bytes"] = du(d / str(c.latest_step()))
            for mesh in ("1x8", "2x4", "1x3"):
                p2, o2 = plan_for(cfg, mesh)
                target = jfsdp.abstract_state(p2, o2)
                times = []
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    restored = c.restore(c.latest_step(), target)
                    jax.block_until_ready(restored)
                    times.append(time.perf_counter() - t0)
                    del restored
                rec[f"restore_{mesh}_s"] = statistics.median(times)
        c.close()
        shutil.rmtree(d, ignore_errors=True)
    del state
    return rec


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", required=True, metavar="FILE")
    p.add_argument("--dir", default="/tmp/jfsdp-ckpt-bench", help="scratch folder for the checkpoints (deleted)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--models", default=",".join(MODELS), help="comma-separated subset of: " + ", ".join(MODELS))
    a = p.parse_args(argv)
    root = Path(a.dir)
    rows = []
    for name in a.models.split(","):
        rows.append(measure(name, MODELS[name], root, a.repeats))
        r = rows[-1]
        print(f"{r['model']:<32} {r['params'] / 1e6:7.1f}M params | {r['size_bytes'] / 1e6:8.1f} MB on disk | "
              f"async save: loop blocked {r['async_save_blocked_s']:.3f}s of {r['async_save_total_s']:.2f}s | "
              f"sync save {r['sync_save_blocked_s']:.2f}s | restore 1x8 {r['restore_1x8_s']:.2f}s, "
              f"2x4 {r['restore_2x4_s']:.2f}s, 1x3 {r['restore_1x3_s']:.2f}s", flush=True)
    shutil.rmtree(root, ignore_errors=True)
    out = {"device": f"CPU, {os.cpu_count()}-core {platform.machine()} VM, 8 fake XLA devices (mesh 1x8, full_shard)",
           "date": time.strftime("%Y-%m-%d", time.gmtime()), "jax": jax.__version__,
           "orbax": __import__("orbax.checkpoint").checkpoint.__version__, "repeats": a.repeats, "results": rows}
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
