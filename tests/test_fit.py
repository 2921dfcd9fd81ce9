"""train.py checks that its plan fits before it allocates anything (jfsdp/runtime/fit.py): the decision
against a budget set for the test (JFSDP_MEMORY_BUDGET), the command's one error line, and llama-70b
refused before it allocates, on this machine's real host memory (its peak RSS bounded)."""
import dataclasses
import math
import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest

import jfsdp
from jfsdp.runtime import fit
from jfsdp.train import frozen

REPO = Path(__file__).resolve().parents[1]
TINY = ["--mesh", "2x4", "--model", "llama-test", "--batch-size", "32", "--seq-len", "256", "--steps", "1",
        "--metrics-out", "", "--gen-tokens", "0", "--eval-every", "0"]


def _case(remat="none", batch=32, seq=256):
    import models
    from models.factory import language_model
    mesh = jfsdp.make_mesh("2x4", jax.devices()[:8])
    x = jax.ShapeDtypeStruct((1, seq), "int32")

    def shard(remat):
        module, moe, loss_fn = language_model(models.get_config("llama-test"), "fused", "auto", "auto")
        return jfsdp.fully_shard(module, mesh, x, remat=remat), loss_fn
    plan, loss_fn = shard(remat)
    case = fit.Case(plan, loss_fn, jfsdp.adamw(1e-3, mask=plan.decay_mask()), batch, seq, 1, False, "cpu")
    return case, lambda r: shard(r)[0]


def test_the_decision(monkeypatch):
    """Above the budget: ConfigError naming estimate, budget and what fits; within the estimate's
    error below it: a note; well below: nothing."""
    case, reshard = _case()
    est = case.estimate()
    devices = jax.devices()[:8]
    monkeypatch.setenv(fit.BUDGET_ENV, str(int(est * 0.66)))
    with pytest.raises(jfsdp.ConfigError) as e:
        fit.check(case, devices, reshard)
    msg = str(e.value)
    assert "does not fit" in msg and f"{est / 2**20:.1f} MiB" in msg and "budget" in msg
    assert "--remat full" in msg and "--batch-size 16" in msg and "--no-fit-check" in msg
    # the smaller batch proposed is the largest that fits: one more sequence per device would not
    budget = int(est * 0.66)
    assert case.estimate(batch_size=16) <= budget < case.estimate(batch_size=24)
    monkeypatch.setenv(fit.BUDGET_ENV, str(int(est * 1.05)))
    note = fit.check(case, devices, reshard)
    assert note.startswith("fit check:") and "within its error" in note and "proceeding" in note
    monkeypatch.setenv(fit.BUDGET_ENV, str(int(est * 1.5)))
    assert fit.check(case, devices, reshard) is None


def test_the_decision_at_context_2(monkeypatch):
    """At C > 1 (1x2 --context 2, 4 devices) the check runs on the estimate of T/C tokens per device
    (jfsdp/planning/context_plan.py; tests/test_context_planner.py checks it against the compiled step):
    above the budget, the smaller batch it proposes is the largest that fits, in rows over the 2 devices
    that hold them (data x fsdp, not all 4), and the larger mesh it proposes keeps --context."""
    import models
    from models.factory import context_kernel, language_model
    module, _, loss_fn = language_model(models.get_config("llama-test"), "fused", "auto", "auto")
    x = jax.ShapeDtypeStruct((2, 256), "int32")
    plan = jfsdp.fully_shard(module, jfsdp.make_mesh("1x2", jax.devices()[:4], context=2), x, remat="full",
                             context_attention=context_kernel())
    case = fit.Case(plan, loss_fn, jfsdp.adamw(1e-3, mask=plan.decay_mask()), 8, 256, 1, False, "cpu")
    est = case.estimate()
    budget = int(est * 0.8)
    monkeypatch.setenv(fit.BUDGET_ENV, str(budget))
    with pytest.raises(jfsdp.ConfigError) as e:
        fit.check(case, jax.devices()[:4], lambda r: plan)
    msg = str(e.value)
    k = int(msg.split("--batch-size ")[1].split()[0])
    assert case.estimate(batch_size=k) <= budget < case.estimate(batch_size=k + 2), msg
    # more devices: twice the shards (fsdp x context) hold half the state; the mesh keeps --context 2
    b = case.breakdown()
    state = b.params + b.grads + b.optimizer + b.padding
    more = fit.more_devices(case, b.total - state // 2 + 1, plan)
    assert more.startswith("8 devices (--mesh 1x4 --context 2,"), more


@pytest.mark.parametrize("tensor", [1, 2])
def test_command_refuses_with_one_line(monkeypatch, train_main, tensor):
    """Refused before the state or the step exist, at T = 1 and with tensor parallelism (2x2 --tensor 2: the
    planner's T > 1 estimate), with the nearest configuration that fits."""
    monkeypatch.setenv(fit.BUDGET_ENV, "20MiB")
    mesh = [] if tensor == 1 else ["--mesh", "2x2", "--tensor", "2"]
    r = train_main([*TINY, *mesh])
    code, out, err = r.returncode, r.stdout, r.stderr
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(errors) == 1 and "Traceback" not in err, err
    assert "does not fit" in errors[0] and "budget is 20.0 MiB per device (JFSDP_MEMORY_BUDGET=20MiB)" in errors[0]
    assert "compiled the train step" not in out
    if tensor > 1:
        assert "nearest that fit: --batch-size 8" in errors[0], err


def test_no_fit_check_runs_anyway(monkeypatch, train_main):
    monkeypatch.setenv(fit.BUDGET_ENV, "20MiB")
    r = train_main([*TINY, "--no-fit-check", "--batch-size", "8", "--seq-len", "32"])
    code, out, err = r.returncode, r.stdout, r.stderr
    assert code == 0 and "error" not in err, err
    assert "compiled the train step" in out and "fit check" not in err


def test_frozen_parameters_are_not_counted(monkeypatch, train_main):
    """--freeze: the estimate has no gradient shards or optimizer state for the frozen leaves (the
    planner's, jfsdp/planning/estimate.py), so a fine-tune that fits only without them runs, and the
    same run training everything is refused."""
    case, _ = _case(batch=8, seq=32)
    trainable, hit = frozen.freeze(case.sharded, "tok_emb|feed_forward")
    whole, frozen_est = case.estimate(), dataclasses.replace(case, trainable=trainable).estimate()
    # at least the frozen leaves' gradient shard and two AdamW moments (fp32, over 4 shards) go
    layouts = dict(zip(frozen.param_paths(case.sharded),
                       jax.tree.leaves(case.sharded.layouts, is_leaf=lambda x: isinstance(x, jfsdp.Layout))))
    units = sum(case.sharded.stage_sizes)
    dropped = sum((1 if p.startswith("root") else units) * math.prod(layouts[p].stored_shape) * 4 * 3 // 4 for p in hit)
    assert whole - frozen_est >= dropped, (whole, frozen_est, dropped)
    monkeypatch.setenv(fit.BUDGET_ENV, str((whole + frozen_est) // 2))
    args = [*TINY, "--batch-size", "8", "--seq-len", "32"]
    r = train_main([*args, "--freeze", "tok_emb|feed_forward"])
    code, out, err = r.returncode, r.stdout, r.stderr
    assert code == 0 and "error" not in err, err
    assert "compiled the train step" in out
    r = train_main(args)
    code, out, err = r.returncode, r.stdout, r.stderr
    assert code == 2 and "does not fit" in err and "compiled the train step" not in out, err


def test_llama_70b_is_refused_before_allocating():
    """`python train.py --model llama-70b` on this machine's real host memory (no budget set): one
    error line, exit status 2, and the process never grows past 3 GiB (nothing of the model is
    allocated; before the check it was killed by the kernel after 39 s). The time it takes is not
    asserted (a loaded machine is slow without a bug); the 300 s timeout only catches a hang."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", fit.BUDGET_ENV)}
    env["JAX_PLATFORMS"] = "cpu"
    code = ("import resource, subprocess, sys; "
            "r = subprocess.run([sys.executable, 'train.py', '--model', 'llama-70b', '--metrics-out', ''], "
            "capture_output=True, text=True); "
            "print(r.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); "
            "print(r.stderr, file=sys.stderr)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
    rc, maxrss_kib = r.stdout.split()
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert int(rc) == 2 and len(errors) == 1 and "does not fit" in errors[0], r.stderr
    assert "GiB per device" in errors[0] and "Traceback" not in r.stderr
    assert int(maxrss_kib) < 3 * 2**20, maxrss_kib
