"""The float8 tests' floor, over seeds: how far jfsdp's float8 training lands from the single-device float8
reference (tests/reference.py) when only the data and the initialization change, and how far the other
recipe's reference and the trainer without float8 are.

    python benchmarks/float8_floor.py --json benchmarks/results/float8_floor.json [--seeds 5] [--only CASE]

Each case is one float8 test's own run (the test is this sweep's seed 0), from tests/test_float8_any_model.py
(models given as they are) and tests/test_float8.py / tests/test_float8_rowwise.py (`jfsdp.Stacked`):

- `grad`: the largest per-leaf L2 error of the first-step gradients (the float8 backward) against the same
  recipe's reference; `loss0`, `loss`: the first loss's relative error and the largest over the steps;
  `update`: the largest per-leaf L2 error of the AdamW updates (final - initial parameters);
- `other`: the first-step gradients against the other recipe's reference (what a swapped recipe would
  meet), `plain`: against the trainer without float8; `other_loss0`: the first loss against the other
  recipe's;
- `whole_batch_amax` (Linen, tensorwise): the reference with its activation and gradient scales taken
  over the whole batch instead of each device's rows (a scaling bug), against the right reference.

Per case the JSON keeps every seed's figures, the worst over seeds (largest error, smallest distance), the
bounds the tests use, and the ratios floor / bound and distance / bound. docs/numerics.md's float8 section
keeps the figures. A float8 cast turns a summation-order difference into a whole float8 step on an element
at a rounding boundary, so the floor moves with the seed: that spread is what the bounds are taken from.
"""
from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import platform
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
importlib.import_module("tests.conftest")   # 16 CPU devices and the tests' XLA flags, before jax loads

import jax  # noqa: E402

from tests import reference as ref  # noqa: E402
from tests import test_float8 as ft  # noqa: E402
from tests import test_float8_any_model as fa  # noqa: E402
from tests import test_float8_rowwise as fr  # noqa: E402

MAX_KEYS = ("grad", "grad_all", "loss0", "loss", "update")      # errors: the worst seed is the largest
MIN_KEYS = ("other", "other_all", "plain", "plain_all", "other_loss0")        # distances: the worst seed is the smallest


def whole_batch_amax(c):
    """The tensorwise reference's first-step gradients with each cast scaled over the whole batch (a
    scaling bug: the engine scales activations and gradients by each device's rows), against the right
    reference's: the largest per-leaf L2 distance."""
    import flax.linen as nn
    model = fa.Llama(fa.CFG)

    def loss(p, b):
        with nn.intercept_methods(ref.float8_dense(lambda path: path[0].startswith("layers"))):
            return c["loss_fn"](model.apply({"params": p}, b["inputs"]), b)
    with jax.default_device(jax.devices()[0]):
        grads = jax.jit(jax.grad(loss))(c["init"], c["batches"][0])
    return float(max(ref.leaf_errors(grads, c["grads"]).values())), ref.total_error(grads, c["grads"])


def linen(scanned, recipe):
    def run(seed):
        c = fa.llama_reference(recipe, steps=fa.STEPS if recipe == "tensorwise" else 2, seed=seed)
        m = fa.linen_run(c, scanned, recipe)[1]
        if recipe == "tensorwise" and not scanned:
            m.update(zip(("whole_batch_amax", "whole_batch_amax_all"), whole_batch_amax(c)))
        return m
    return run


# case -> (run(seed) -> figures, the test, its bounds: grad, first loss, losses, updates)
CASES = {
    "linen-loop-tensorwise": (linen(False, "tensorwise"), "test_float8_any_model::test_linen_as_is_fp8_matches_single_device_fp8[False]",
                              fa.TENSORWISE),
    "linen-scan-tensorwise": (linen(True, "tensorwise"), "test_float8_any_model::test_linen_as_is_fp8_matches_single_device_fp8[True]",
                              fa.TENSORWISE),
    "linen-loop-rowwise": (linen(False, "rowwise"), "test_float8_any_model::test_linen_as_is_rowwise_matches_single_device_rowwise",
                           fa.ROWWISE),
    "nnx-decoder-tensorwise": (lambda seed: fa.nnx_decoder_run(seed)[1], "test_float8_any_model::test_nnx_as_is_fp8_matches_single_device_fp8",
                               fa.NNX),
    "stacked-1x4-tensorwise": (lambda seed: ft.stacked_run(ft.reference_case(seed), "1x4", "full_shard", "full", ft.STEPS),
                               "test_float8::test_fp8_step_matches_single_device_fp8[1x4-full_shard-full-3]", ft.BOUNDS),
    "stacked-1x4-rowwise": (lambda seed: fr.stacked_run(fr.reference_case(seed), "1x4", "full_shard", "full", fr.STEPS),
                            "test_float8_rowwise::test_rowwise_step_matches_single_device_rowwise[1x4-full_shard-full-3]", fr.BOUNDS),
    "nnx-scan-tensorwise": (lambda seed: fa.nnx_scan_run(seed)[1], "test_float8_any_model::test_nnx_scan_fp8_matches_single_device_fp8",
                            fa.NNX_SCAN),
}


def summarize(per_seed, bounds):
    worst = {k: max(m[k] for m in per_seed) for k in MAX_KEYS if k in per_seed[0]}
    worst.update({k: min(m[k] for m in per_seed) for k in MIN_KEYS})
    for k in ("whole_batch_amax", "whole_batch_amax_all"):
        if k in per_seed[0]:
            worst[k] = min(m[k] for m in per_seed)
    ratios = {f"{k}/bound": worst[k] / b for k, b in bounds.items()}
    for k in ("other", "plain", "whole_batch_amax"):
        for suffix, bound in (("", "grad"), ("_all", "grad_all")):
            if k + suffix in worst and bound in bounds:
                ratios[f"{k + suffix}/{bound} bound"] = worst[k + suffix] / bounds[bound]
    ratios["other_loss0/loss0 bound"] = worst["other_loss0"] / bounds["loss0"]
    return worst, ratios


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", required=True)
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--only", action="append", choices=sorted(CASES))
    ap.add_argument("--resummarize", action="store_true",
                    help="read --json's per-seed figures and redo its bounds and ratios from the tests' current bounds")
    args = ap.parse_args(argv)
    if args.resummarize:
        with open(args.json) as f:
            out = json.load(f)
        for name, case in out["cases"].items():
            case["bounds"] = CASES[name][2]
            case["worst"], case["ratios"] = summarize(case["per_seed"], case["bounds"])
        out["resummarized"] = datetime.date.today().isoformat()
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
        return 0
    out = dict(command=" ".join([os.path.basename(sys.argv[0])] + (argv or sys.argv[1:])),
               date=datetime.date.today().isoformat(), machine=platform.processor() or platform.machine(),
               jax=jax.__version__, xla_flags=os.environ.get("XLA_FLAGS", ""), seeds=list(range(args.seeds)), cases={})
    for name in args.only or CASES:
        run, test, bounds = CASES[name]
        t0, per_seed = time.time(), []
        for seed in range(args.seeds):
            per_seed.append(run(seed))
            print(name, seed, {k: (v if isinstance(v, str) else f"{v:.3g}") for k, v in per_seed[-1].items()}, flush=True)
        worst, ratios = summarize(per_seed, bounds)
        out["cases"][name] = dict(test=test, bounds=bounds, per_seed=per_seed, worst=worst, ratios=ratios,
                                  seconds=round(time.time() - t0, 1))
        print(name, "worst", {k: f"{v:.3g}" for k, v in worst.items()}, "ratios",
              {k: f"{v:.3g}" for k, v in ratios.items()}, flush=True)
        with open(args.json, "w") as f:    # after every case: a long sweep keeps what it measured
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
