"""The mutation check of the test suite (issue 33): deliberate bugs, applied one at a time to a copy of the
repository, each run against the tests that should catch it. A mutant is killed when a test fails on it.

    python benchmarks/mutants.py --json benchmarks/results/mutants.json [--only NAME]

Each mutant is a text replacement that must match exactly once in the current sources (the script fails
otherwise, so a mutant cannot silently stop applying after a refactor). The copy is `git ls-files` of the
working tree; the tests run in it with `python -m pytest -x`, in a process of their own (16 fake CPU
devices from tests/conftest.py). Per mutant the JSON records the tests run, whether one failed, the first
failing test and its assertion message (how far beyond its tolerance the bug lands). It is not part of the
suite: run it before a release and keep its output in the repository (docs/tests.md has the table).
Results: benchmarks/results/mutants.json, table in docs/tests.md."""
from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# name -> (file, old text, new text, tests that should catch it, what it breaks)
MUTANTS = {
    "no-mean-scale": (
        "jfsdp/engine/fsdp.py", "    return g.astype(layout.dtype) * comm.scale\n",
        "    return g.astype(layout.dtype)\n",
        ["tests/test_equivalence.py::test_gradients_match"],
        "the reduce-scatter's 1/N scale dropped: gradients N times too large"),
    "no-replica-sum": (
        "jfsdp/engine/fsdp.py", "    if comm.reduce_axes:\n        g = lax.psum(g, comm.reduce_axes)\n",
        "    if False and comm.reduce_axes:\n        g = lax.psum(g, comm.reduce_axes)\n",
        ["tests/test_equivalence.py::test_gradients_match"],
        "on a 2D mesh the gradient is reduce-scattered over fsdp but not summed over the data axis"),
    "fp32-compute-under-bf16": (
        "jfsdp/engine/fsdp.py", "        x = lax.all_gather(x, layout.gather_axes, axis=0, tiled=True)\n    return layout.unpad(x)\n",
        "        x = lax.all_gather(x, layout.gather_axes, axis=0, tiled=True)\n    return layout.unpad(x).astype('float32')\n",
        ["tests/test_collectives.py", "tests/test_equivalence.py::test_bf16_policy_matches_single_device_bf16"],
        "the unit gathered in bf16 as the policy says, then computed in fp32"),
    "fp32-compute-under-bf16-numerics": (
        "jfsdp/engine/fsdp.py", "        x = lax.all_gather(x, layout.gather_axes, axis=0, tiled=True)\n    return layout.unpad(x)\n",
        "        x = lax.all_gather(x, layout.gather_axes, axis=0, tiled=True)\n    return layout.unpad(x).astype('float32')\n",
        ["tests/test_equivalence.py::test_bf16_policy_matches_single_device_bf16"],
        "the same, against the numerical guard alone: outputs nearer the fp32 reference than the bf16 one"),
    "skip-a-unit-gradient": (
        "jfsdp/engine/sharded.py", "            return lax.psum(loss, self.loss_axes) / self.n_devices, grads\n",
        "            grads = {**grads, 'units': jax.tree.map(lambda g: g.at[0].set(0), grads['units'])}\n"
        "            return lax.psum(loss, self.loss_axes) / self.n_devices, grads\n",
        ["tests/test_equivalence.py::test_gradients_match"],
        "the first unit's gradient dropped (set to zero) before the optimizer"),
    "swap-float8-recipes": (
        "jfsdp/engine/float8.py", 'cls = RowwiseLayout if recipe == "rowwise" else Float8Layout',
        'cls = Float8Layout if recipe == "rowwise" else RowwiseLayout',
        ["tests/test_float8_rowwise.py", "tests/test_float8.py"],
        "the tensorwise and rowwise float8 recipes swapped"),
    "rowwise-scales-one-per-tensor": (
        "jfsdp/engine/float8_rowwise.py",
        "s = pow2_scale(jnp.max(jnp.abs(x.astype(jnp.float32)), axis=axis, keepdims=True), dtype)",
        "s = pow2_scale(jnp.broadcast_to(jnp.max(jnp.abs(x.astype(jnp.float32))), "
        "jnp.max(jnp.abs(x.astype(jnp.float32)), axis=axis, keepdims=True).shape), dtype)",
        ["tests/test_float8_rowwise.py"],
        "a scaling bug: the rowwise recipe takes one scale for the whole tensor instead of one per row (the "
        "step tests alone let it live: their rows' amaxes share a power of two; the outlier-row test kills it)"),
    "float8-weight-scale-per-shard": (
        "jfsdp/engine/float8.py", "        amax = lax.pmax(amax, FSDP_AXIS) if layout.shards > 1 else amax\n",
        "        amax = amax\n",
        ["tests/test_float8.py", "-k", "matches_single_device"],
        "a scaling bug: each device scales a float8 weight by its own shard's amax, not the whole tensor's"),
    "zip-away-a-leaf": (
        "tests/reference.py", "        if names != paths:\n",
        "        n = min(len(names), len(paths))   # zip's way: the longer tree's last leaves are dropped\n"
        "        rows, paths, got, names = rows[:n], paths[:n], got[:n], names[:n]\n        if names != paths:\n",
        ["tests/test_reference.py"],
        "tree comparisons zip the leaves, so a leaf missing at the end is never compared"),
}


def copy_repo(dest: Path) -> None:
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True,
                           text=True, check=True).stdout.splitlines()
    for f in files:
        src = ROOT / f
        if src.is_file():
            (dest / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / f)


def apply(dest: Path, path: str, old: str, new: str) -> None:
    p = dest / path
    text = p.read_text()
    n = text.count(old)
    if n != 1:
        raise SystemExit(f"error: mutant text found {n} times in {path}, not once: update benchmarks/mutants.py")
    p.write_text(text.replace(old, new))


def run_mutant(name: str, timeout: int) -> dict:
    path, old, new, tests, what = MUTANTS[name]
    with tempfile.TemporaryDirectory(prefix=f"mutant-{name}-") as tmp:
        dest = Path(tmp)
        copy_repo(dest)
        apply(dest, path, old, new)
        env = {**os.environ, "PYTHONPATH": str(dest), "JAX_PLATFORMS": "cpu"}
        t0 = time.perf_counter()
        r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *tests],
                           cwd=dest, env=env, capture_output=True, text=True, timeout=timeout)
        seconds = time.perf_counter() - t0
    out = r.stdout + r.stderr
    failed = re.findall(r"^FAILED (\S+)", out, re.M)
    errors = [line.strip() for line in out.splitlines() if line.lstrip().startswith("E ")]
    return {"mutant": name, "file": path, "what": what, "tests": tests, "killed": r.returncode == 1,
            "exit": r.returncode, "killed_by": failed[:1], "message": errors[:4], "seconds": round(seconds, 1)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--only", action="append", choices=sorted(MUTANTS), help="run only this mutant (repeatable)")
    ap.add_argument("--timeout", type=int, default=1800, help="seconds per mutant")
    a = ap.parse_args(argv)
    rows = []
    for name in a.only or MUTANTS:
        row = run_mutant(name, a.timeout)
        rows.append(row)
        print(f"{name:26} {'KILLED' if row['killed'] else 'SURVIVED (exit ' + str(row['exit']) + ')':10} "
              f"{row['seconds']:7.1f} s  {(row['killed_by'] or ['-'])[0]}", flush=True)
        for line in row["message"][:2]:
            print(f"{'':28}{line[:150]}")
    if a.json:
        Path(a.json).write_text(json.dumps({"date": datetime.date.today().isoformat(), "machine": os.uname().machine,
                                            "cpus": os.cpu_count(), "results": rows}, indent=1) + "\n")
    return 0 if all(r["killed"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
