"""The worker of tests/test_cpu_schedule.py (issue 27): run as `python -m tests.schedule_sweep` in a process of its
own, whose XLA_FLAGS the test sets before jax starts. It trains llama-test a few steps on each configuration of
the sweep (with `--unguarded`, also on one device for each sequence length: the reference, no collectives),
and prints one JSON line per configuration: {"config": ..., "losses": [...]} or {"config": ..., "error": "..."}.

`--unguarded` runs the issue's two reproductions (ISSUE) and calls the jitted step behind make_train_step's guard
(jfsdp.config.xla_flags.run_hazard): that is how they were shown to fail under the memory-minimizing scheduler
(docs/tests.md, docs/limits.md)."""
import json
import sys

import jax
import numpy as np

import jfsdp
import models

STEPS, BATCH = 2, 8
# (mesh, strategy, remat, tokens): every mesh of the issue once; each remat policy and each sequence length at
# least once (1x4, remat none, 512 tokens: the shape of the issue's first reproduction); ZeRO-2 once. Kept small
# for the suite's time budget.
SWEEP = [("1x4", "full_shard", "none", 512), ("2x4", "full_shard", "full", 128), ("1x8", "shard_grad_op", "dots", 128),
         ("4x2", "hybrid_shard", "full", 128)]
# The single-device references (no collectives): tests/test_cpu_schedule.py runs them in its own process.
REFERENCE = [("1x1", "full_shard", "none", t) for t in (128, 512)]
# The issue's reproductions, run by --unguarded: 1x4 / 512 / remat none gave NaN from the first step under the
# memory-minimizing scheduler, 1x4 / 1024 / remat full aborted in XLA's rendezvous (docs/limits.md).
ISSUE = [("1x4", "full_shard", "none", 512), ("1x4", "full_shard", "full", 1024)]
ISSUE_REFERENCE = [("1x1", "full_shard", "none", t) for t in (512, 1024)]


def batches(vocab, tokens):
    x = np.random.default_rng(tokens).integers(0, vocab, (STEPS, BATCH, tokens + 1)).astype(np.int32)
    return [{"inputs": b[:, :-1], "targets": b[:, 1:]} for b in x]


def losses(mesh_spec, strategy, remat, tokens, unguarded=False):
    cfg = models.get_config("llama-test")
    root, unit, n = models.parts(cfg)
    r, s = jfsdp.parse_mesh(mesh_spec)
    mesh = jfsdp.make_mesh(mesh_spec, devices=jax.devices()[:r * s])
    plan = jfsdp.fully_shard(jfsdp.Stacked(root, unit, n), mesh, jax.ShapeDtypeStruct((BATCH, tokens), "int32"),
                             strategy=strategy, mp_policy=jfsdp.MixedPrecision.parse("fp32"), remat=remat)
    opt = jfsdp.adamw(3e-3)
    state = jfsdp.init_state(plan, opt, jax.random.key(0))
    step = jfsdp.make_train_step(plan, opt, models.loss_fn(cfg))
    run = step._jitted if unguarded else step
    out = []
    for b in batches(cfg.vocab_size, tokens):
        state, m = run(state, plan.put_batch(b))
        out.append(float(m["loss"]))
    return out


def main(argv):
    unguarded = "--unguarded" in argv
    for config in (ISSUE_REFERENCE + ISSUE) if unguarded else SWEEP:
        try:
            rec = {"config": config, "losses": losses(*config, unguarded=unguarded)}
        except Exception as e:   # reported, so that the test names the configuration
            rec = {"config": config, "error": f"{type(e).__name__}: {e}"}
        print(json.dumps(rec), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
