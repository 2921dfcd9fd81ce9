"""Issue 27: multi-device steps on XLA:CPU give the single-device losses, with no NaN and no hang, the way
train.py runs them; and the XLA:CPU scheduler whose programs mixed up collectives between devices is refused
for runs (jfsdp.config.xla_flags.run_hazard; the cause: docs/limits.md).

The sweep (tests/schedule_sweep.py) runs in a process of its own under exactly the XLA flags train.py sets on
a CPU-only machine (jfsdp.cli.setup_devices), with the LLVM level of tests/conftest.py. Under the
memory-minimizing scheduler the same sweep gave NaN and aborted (docs/tests.md)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from jfsdp import cli
from jfsdp.config.xla_flags import CPU_FLAGS, cpu_xla_flags, run_hazard
from tests import schedule_sweep
from tests.compile_flags import FAST

ROOT = Path(__file__).resolve().parents[1]
RTOL = 1e-5   # the bound; fp32 reassociation across meshes measured 1e-7 relative here


def train_py_flags(monkeypatch, devices):
    """XLA_FLAGS as train.py sets them on a machine without an accelerator, for `devices` fake devices."""
    monkeypatch.setenv("XLA_FLAGS", "")
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    c = cli.parse_args(["--mesh", f"1x{devices}"])
    cli.setup_devices(c, devices)
    return os.environ["XLA_FLAGS"]


def sweep(xla_flags, *args, timeout=900):
    env = {**os.environ, "XLA_FLAGS": xla_flags, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-m", "tests.schedule_sweep", *args], capture_output=True, text=True,
                       env=env, cwd=ROOT, timeout=timeout)   # a hang fails here, named
    return r, [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]


def test_train_py_runs_under_xla_cpu_defaults(monkeypatch):
    flags = train_py_flags(monkeypatch, 8)
    assert run_hazard(flags) is None
    assert flags.split() == ["--xla_force_host_platform_device_count=8"]


def test_sweep_matches_one_device_under_train_py_flags(monkeypatch):
    flags = train_py_flags(monkeypatch, 8) + " --xla_backend_optimization_level=0"
    r, recs = sweep(flags)
    assert r.returncode == 0, r.stderr[-3000:]
    assert [tuple(x["config"]) for x in recs] == schedule_sweep.SWEEP, r.stderr[-3000:]
    errors = [x for x in recs if "error" in x]
    assert not errors, errors
    # the references: one device (no collectives), in this process (the suite's flags: compiled faster,
    # fp32 reassociation apart, far below RTOL)
    ref = {c[3]: schedule_sweep.losses(*c) for c in schedule_sweep.REFERENCE}
    assert sorted(ref) == sorted({c[3] for c in schedule_sweep.SWEEP})
    for x in recs:
        got, want = np.array(x["losses"]), np.array(ref[x["config"][3]])
        assert np.all(np.isfinite(got)), x
        np.testing.assert_allclose(got, want, rtol=RTOL, err_msg=str(x["config"]))


def test_memory_scheduler_is_refused_for_runs(tmp_path):
    # the library: make_train_step's step refuses to run on several CPU devices under it
    flags = cpu_xla_flags("--xla_force_host_platform_device_count=4")
    assert run_hazard(flags) and run_hazard("--xla_cpu_enable_concurrency_optimized_scheduler=0")
    assert run_hazard("--xla_cpu_enable_concurrency_optimized_scheduler=true") is None
    code = ("import jax, jfsdp, models\n"
            "cfg = models.get_config('llama-test'); root, unit, n = models.parts(cfg)\n"
            "plan = jfsdp.fully_shard(jfsdp.Stacked(root, unit, n), jfsdp.make_mesh('1x4'), "
            "jax.ShapeDtypeStruct((4, 16), 'int32'))\n"
            "opt = jfsdp.adamw(1e-3); state = jfsdp.init_state(plan, opt, jax.random.key(0))\n"
            "step = jfsdp.make_train_step(plan, opt, models.loss_fn(cfg))\n"
            "b = plan.put_batch({'inputs': jax.numpy.zeros((4, 16), 'int32'), 'targets': jax.numpy.zeros((4, 16), 'int32')})\n"
            "try:\n    step(state, b)\nexcept jfsdp.ConfigError as e:\n    print('refused:', e)\n")
    # the child compiles init_state's program before the step refuses: with the suite's fast flags beside the
    # memory-minimizing scheduler's (the hazard is that flag alone; 22 -> 15 s, 2026-11-26)
    child = cpu_xla_flags("--xla_force_host_platform_device_count=4 " + FAST)
    assert run_hazard(child) == run_hazard(flags)
    env = {**os.environ, "XLA_FLAGS": child, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "refused: XLA_FLAGS sets --xla_cpu_enable_concurrency_optimized_scheduler=false" in r.stdout
    # train.py: one error line and status 2, before jax starts
    env["XLA_FLAGS"] = "--" + "=".join(next(iter(CPU_FLAGS.items())))
    r = subprocess.run([sys.executable, str(ROOT / "train.py"), "--model", "llama-test", "--mesh", "1x4", "--steps", "1"],
                       capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert r.returncode == 2 and len(errors) == 1 and "concurrency_optimized_scheduler" in errors[0], r.stderr


def test_first_step_nan_does_not_blame_the_learning_rate(capsys):
    from jfsdp.runtime import loop

    class Run:   # what `diverged` reads of a run
        ckpt = None

        class out:
            @staticmethod
            def close():
                pass

    for step, blames_lr in ((1, False), (7, True)):
        with pytest.raises(SystemExit) as e:
            loop.diverged(Run, step, float("nan"))
        assert e.value.code == 2
        err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
        assert len(err) == 1 and ("--lr" in err[0]) == blames_lr, err
        assert blames_lr or "before any update" in err[0]
