"""train.py as users run it: a subprocess with its own environment (it fakes its own CPU devices). Runs
whose point is the process (Ctrl-C, an XLA abort, the real command's exit status) start train.py themselves;
the others fork from one server process that imported jax and jfsdp once (tests/train_server.py).
Bad input is checked in-process through the same `jfsdp.cli.main` (a subprocess costs a jax import
each), with one subprocess that shows the real command's exit status and single line."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from tests.compile_flags import FAST
from tests.train_server import TrainServer

from jfsdp.config.xla_flags import accelerator_present

REPO = Path(__file__).resolve().parents[1]
TINY = ["--mesh", "2x4", "--model", "llama-test", "--batch-size", "8", "--seq-len", "32"]


def _env():
    env = dict(os.environ)
    # conftest's 16 devices are for in-process tests; its LLVM level (compiles faster, the same HLO) is
    # kept, and train.py adds its own device count to it
    env["XLA_FLAGS"] = FAST
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONUNBUFFERED"] = "1"
    return env


def run_train(*args, timeout=300):
    return subprocess.run([sys.executable, str(REPO / "train.py"), *args], capture_output=True, text=True,
                          env=_env(), timeout=timeout, cwd=REPO)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The module's train.py runs that are not about the process, one start-up for all."""
    s = TrainServer(_env(), tmp_path_factory.mktemp("server"))
    yield s
    s.close()


def test_tiny_run_end_to_end(server, tmp_path):
    metrics = tmp_path / "run" / "metrics.jsonl"
    r = server.run(*TINY, "--steps", "16", "--log-every", "4", "--eval-every", "8", "--lr", "3e-3",
                   "--warmup", "4", "--gen-tokens", "8", "--metrics-out", str(metrics))
    assert r.returncode == 0, r.stderr
    assert "faking 8 CPU devices" in r.stderr and "Traceback" not in r.stderr
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    train = [x for x in records if "loss" in x]
    val = [x for x in records if "val_loss" in x]
    assert [x["step"] for x in train] == [4, 8, 12, 16]
    assert [x["step"] for x in val] == [0, 8, 16]
    for x in train:
        assert {"step", "loss", "lr", "tokens_per_sec", "grad_norm"} <= x.keys()
        assert x["tokens_per_sec"] > 0 and x["mfu"] is None   # no peak FLOP/s on CPU
    assert train[-1]["loss"] < train[0]["loss"]
    assert val[-1]["val_loss"] < 0.9 * val[0]["val_loss"]
    assert (tmp_path / "run" / "metrics.png").stat().st_size > 1000
    assert "summary" in r.stdout and "MFU n/a on CPU" in r.stdout and "== sample" in r.stdout


def test_moe_model_trains_and_logs_its_router(server, tmp_path):
    """train.py --model moe-test in expert-parallel mode: the loss falls, and the metrics carry the
    load-balancing loss, the dropped fraction and the load (measured by the model's own statistics), the
    capacity (ceil(1.25 x 32 x 2 / 8) = 10 slots), the mode and the chunks; the evaluations carry the
    language-model loss, the load-balancing loss and the dropped share of the validation batches."""
    metrics = tmp_path / "metrics.jsonl"
    r = server.run("--mesh", "1x4", "--model", "moe-test", "--moe", "ep", "--batch-size", "8", "--seq-len", "32",
                   "--steps", "8", "--log-every", "4", "--eval-every", "8", "--gen-tokens", "4",
                   "--metrics-out", str(metrics))
    assert r.returncode == 0, r.stderr
    train = [x for x in map(json.loads, metrics.read_text().splitlines()) if "loss" in x]
    assert [x["step"] for x in train] == [4, 8]
    for x in train:
        assert np.isfinite(x["moe_aux_loss"]) and x["moe_aux_loss"] > 0
        assert 0.0 <= x["moe_dropped"] <= 1.0
        assert (x["moe_capacity"], x["moe_mode"], x["moe_chunks"]) == (10, "ep", 1)
        # the load: above the capacity exactly when something dropped; at most T (a token picks an expert once)
        assert (x["moe_load"] > x["moe_capacity"]) == (x["moe_dropped"] > 0) and x["moe_load"] <= 32
    assert train[-1]["loss"] < train[0]["loss"]
    # the evaluation's own MoE figures (same forward pass): the loss is the language-model loss plus
    # aux_coef x the load-balancing loss
    val = [x for x in map(json.loads, metrics.read_text().splitlines()) if "val_loss" in x]
    assert [x["step"] for x in val] == [0, 8] and all(0.0 <= x["val_moe_dropped"] <= 1.0 for x in val)
    for x in val:
        assert x["val_loss"] == pytest.approx(x["val_lm_loss"] + 0.01 * x["val_moe_aux_loss"], rel=1e-5)
        assert x["val_moe_aux_loss"] > 0
    assert "moe_aux_loss" in r.stdout and "moe_mode ep" in r.stdout and "== sample" in r.stdout


def test_moe_switch_host_runs_the_bucket_the_load_two_steps_before_asks_for(server, tmp_path):
    """--moe-switch host: one program per bucket (8, 31, 32 slots; a sequence's load on this text is 27-32),
    the host running at step t the smallest bucket that holds step t-2's load (the largest for the first
    two steps): the logged capacities follow that rule, a step drops exactly when its own load is above its
    bucket, and until the first drop the losses are the device-side switch's (which never drops)."""
    args = ["--mesh", "1x4", "--model", "moe-test", "--moe", "adaptive", "--moe-buckets", "8,31,32", "--batch-size",
            "8", "--seq-len", "32", "--steps", "8", "--log-every", "1", "--eval-every", "0", "--gen-tokens", "0"]
    runs = {}
    for switch in ("host", "device"):
        out = tmp_path / f"{switch}.jsonl"
        r = server.run(*args, "--moe-switch", switch, "--metrics-out", str(out))
        assert r.returncode == 0, r.stderr
        runs[switch] = [x for x in map(json.loads, out.read_text().splitlines()) if "loss" in x]
    host, device = runs["host"], runs["device"]
    assert [x["step"] for x in host] == list(range(1, 9)) and all(x["moe_dropped"] == 0 for x in device)
    buckets = (8, 31, 32)
    for t, x in enumerate(host):
        want = 32 if t < 2 else next((b for b in buckets if b >= host[t - 2]["moe_load"]), 32)
        assert x["moe_capacity"] == want, (t, host)
        assert (x["moe_dropped"] > 0) == (x["moe_load"] > x["moe_capacity"]), (t, host)
    first_drop = next((t for t, x in enumerate(host) if x["moe_dropped"] > 0), len(host))
    assert first_drop < len(host) and len({x["moe_capacity"] for x in host}) > 1, host   # it switched, and dropped
    for x, y in zip(host[:first_drop], device):
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-5)


def test_moe_calibrate_times_each_variant_and_runs_the_fastest(server, tmp_path):
    """train.py --moe adaptive --moe-calibrate FILE: before training, every variant of the one bucket (gather,
    and ep with one chunk) is timed on the run's devices and written to FILE, which --moe-calibration reads;
    the run then takes the faster one at that capacity (its logged mode)."""
    cal, metrics = tmp_path / "cal.json", tmp_path / "m.jsonl"
    r = server.run("--mesh", "1x4", "--model", "moe-test", "--moe", "adaptive", "--moe-buckets", "16", "--moe-chunks",
                   "1", "--batch-size", "4", "--seq-len", "32", "--steps", "2", "--log-every", "2", "--eval-every", "0",
                   "--gen-tokens", "0", "--moe-calibrate", str(cal), "--metrics-out", str(metrics))
    assert r.returncode == 0, r.stderr
    from jfsdp.config.moe_calibration import read
    table = read(str(cal))
    assert sorted(table) == [(16, "ep", 1), (16, "gather", 1)] and all(v > 0 for v in table.values())
    fastest = min(table, key=table.get)[1]
    logged = [json.loads(line) for line in metrics.read_text().splitlines() if '"loss"' in line]
    assert logged and all((x["moe_capacity"], x["moe_mode"]) == (16, fastest) for x in logged), (table, logged)


BAD = {
    "mesh-missing-size": (["--mesh", "2x"], "mesh"),
    "mesh-zero": (["--mesh", "0x8"], "mesh"),
    "mesh-letters": (["--mesh", "axb"], "mesh"),
    "batch-not-divisible": (["--mesh", "2x4", "--batch-size", "12"], "does not divide"),
    "unknown-model": (["--model", "llama-nope"], "unknown model"),
    "not-a-language-model": (["--model", "resmlp-test"], "not a language model"),
    "unknown-strategy": (["--strategy", "zero9"], "unknown strategy"),
    "moe-chunks-not-a-number": (["--model", "moe-test", "--moe-chunks", "two"], "must be an integer"),
    "missing-data": (["--data", "/nonexistent/corpus.txt"], "does not exist"),
    "zero-steps": (["--steps", "0"], "--steps must be positive"),
    "negative-steps": (["--steps", "-3"], "--steps must be positive"),
    "steps-not-a-number": (["--steps", "ten"], "invalid int"),
    "resume-without-ckpt-dir": (["--resume"], "--resume needs --ckpt-dir"),
    "grad-sync-once-with-update-in-backward": (["--grad-sync", "once", "--update-in-backward", "--remat", "full"],
                                               "--grad-sync once cannot combine with --update-in-backward"),
    "grad-sync-unknown": (["--grad-sync", "never"], "invalid choice"),
    "freeze-matches-nothing": (["--model", "llama-test", "--freeze", "no_such_param"], "matches no parameter"),
    "freeze-not-a-regex": (["--model", "llama-test", "--freeze", "(unclosed"], "is not a regular expression"),
    "fp8-with-expert-parallel": (["--model", "moe-test", "--precision", "fp8", "--moe", "ep"], "expert-parallel"),
    "moe-buckets-not-increasing": (["--model", "moe-test", "--moe", "adaptive", "--moe-buckets", "128,64"],
                                   "strictly increasing"),
    "moe-buckets-without-adaptive": (["--model", "moe-test", "--moe-buckets", "64,128"], "apply to --moe adaptive"),
    "moe-switch-without-adaptive": (["--model", "moe-test", "--moe-switch", "host"], "applies to --moe adaptive"),
    "moe-calibration-missing": (["--model", "moe-test", "--moe", "adaptive", "--moe-calibration", "/nonexistent/c.json"],
                                "moe calibration /nonexistent/c.json: No such file"),
    "moe-calibrate-without-adaptive": (["--model", "moe-test", "--moe-calibrate", "c.json"],
                                       "--moe-calibrate applies to --moe adaptive"),
    "moe-calibrate-and-calibration": (["--model", "moe-test", "--moe", "adaptive", "--moe-calibrate", "c.json",
                                       "--moe-calibration", "c.json"], "give one of them"),
    "moe-calibrate-unwritable": (["--model", "moe-test", "--moe", "adaptive", "--moe-calibrate", "/nonexistent/c.json"],
                                 "cannot write to /nonexistent"),
    "ring-sums-without-context": (["--ring-sums", "bf16"], "--ring-sums bf16 applies to --context C > 1"),
    "ring-sums-fp32-compute": (["--mesh", "1x2", "--context", "2", "--seq-len", "64", "--ring-sums", "bf16"],
                               "with bf16 compute"),
    "ring-attention-cudnn-fp32": (["--mesh", "1x2", "--context", "2", "--seq-len", "64", "--ring-attention", "cudnn"],
                                  "cuDNN takes 16-bit inputs"),
    "context-zero": (["--context", "0"], "--context must be at least 1"),
    "context-seq-len": (["--mesh", "1x2", "--context", "3", "--seq-len", "64"], "2*C = 6 equal chunks"),
    "context-tensor-seq-len": (["--mesh", "1x2", "--context", "2", "--tensor", "2", "--seq-len", "36"],
                               "each split over T = 2, so it must be a multiple of 8"),
    "context-fp8": (["--mesh", "1x2", "--context", "2", "--precision", "fp8"],
                    "--precision fp8 is not supported with context parallelism yet"),
    "mlp-tile-not-dividing": (["--mesh", "1x2", "--context", "2", "--seq-len", "64", "--mlp-tile", "12"],
                              "does not divide the 32 tokens per device"),
    "mlp-tile-moe": (["--model", "moe-test", "--mlp-tile", "16"], "--mlp-tile applies to the Llama models"),
}
if not accelerator_present():   # on a GPU host cuDNN is there and the option is taken
    BAD["ring-attention-cudnn-no-gpu"] = (["--mesh", "1x2", "--context", "2", "--seq-len", "64", "--precision", "bf16",
                                           "--ring-attention", "cudnn"], "needs an NVIDIA GPU")


def _assert_one_line_error(r, expect):
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and expect in errors[0], r.stderr
    assert len(r.stderr.strip().splitlines()) <= 2   # the error, and at most the fake-devices notice


@pytest.mark.parametrize("name", BAD)
def test_bad_input(name, train_main):
    args, expect = BAD[name]
    _assert_one_line_error(train_main([*args, "--metrics-out", ""]), expect)


@pytest.mark.parametrize("name", ["empty", "beyond-vocab"])
def test_bad_data_file(tmp_path, name, train_main):
    if name == "empty":
        p, expect = tmp_path / "empty.txt", "is empty"
        p.write_text("")
    else:
        p, expect = tmp_path / "tokens.npy", "token 1000 is outside the model's vocabulary of 259"
        np.save(p, np.arange(1001, dtype=np.uint32))
    _assert_one_line_error(train_main([*TINY, "--data", str(p), "--metrics-out", ""]), expect)


def test_bad_input_as_a_command():
    """The real process: a flag refused before jax is imported, and a model refused after."""
    for name in ("zero-steps", "unknown-model"):
        args, expect = BAD[name]
        _assert_one_line_error(run_train(*args, "--metrics-out", ""), expect)


def test_cli_imports_no_jax():
    """train.py's flags are checked and XLA's device count set before jax starts: importing the
    command line (and jfsdp, whose names load on first use) must not import jax."""
    code = "import sys, jfsdp, jfsdp.cli; print(sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib')))"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(), cwd=REPO, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "[]", (r.stdout, r.stderr)


def test_a_models_own_step_metrics_are_logged():
    """Scalars a train step returns beside loss and grad_norm (an MoE auxiliary loss, say) are
    averaged over the logged steps and shown after the loss; without them the line is unchanged."""
    from jfsdp.runtime import metrics, progress
    steps = [{"loss": 2.0, "grad_norm": 1.0, "aux_loss": 0.25, "dropped": 0.0},
             {"loss": 1.0, "grad_norm": 0.5, "aux_loss": 0.75, "dropped": 0.5}]
    assert progress.extra_metrics(steps) == {"aux_loss": 0.5, "dropped": 0.25}
    assert progress.extra_metrics([{"loss": 1.0, "grad_norm": 1.0}]) == {}
    rec = {"step": 2, "loss": 1.5, "lr": 1e-3, "grad_norm": 0.5, "tokens_per_sec": 1000.0, "tflops_per_device": 1e-3,
           "mfu": None, "memory_bytes": 2e6, "epoch": 0.1, "time_s": 1.0}
    plain = progress.progress_line(rec, "cpu")
    assert plain == ("loss 1.5000 | lr 1.00e-03 | 1,000 tok/s | 0.001 TFLOP/s/dev | MFU n/a (CPU) | "
                     f"mem {metrics.fmt_bytes(2e6)}/dev")
    extra = progress.progress_line({**rec, "aux_loss": 0.5, "dropped": 0.25}, "cpu")
    assert extra == plain.replace("loss 1.5000 |", "loss 1.5000 | aux_loss 0.5 | dropped 0.25 |")


def test_nan_loss_is_an_error(server):
    # an absurd learning rate blows the weights up within a few steps
    r = server.run(*TINY, "--steps", "6", "--log-every", "3", "--lr", "1e30", "--warmup", "0", "--clip", "0",
                   "--metrics-out", "")
    _assert_one_line_error(r, "training diverged")


def test_ctrl_c_stops_cleanly(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    p = subprocess.Popen([sys.executable, str(REPO / "train.py"), *TINY, "--steps", "100000", "--log-every", "1",
                          "--metrics-out", str(metrics)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, env=_env(), cwd=REPO)
    try:
        deadline = time.time() + 120
        while time.time() < deadline and p.poll() is None:   # wait until training steps are running
            if metrics.exists() and '"loss"' in metrics.read_text():
                break
            time.sleep(0.2)
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 130, err
    assert "interrupted at step" in err and "Traceback" not in err
    assert "summary" in out and metrics.exists()


# train.py's training (the child it forks on CPU, jfsdp/runtime/supervisor.py) runs, after step 4 and
# once checkpoint 4 is on disk, a program in which half of the devices wait in an all-gather that the
# others skip, as the mis-scheduled steps of issue 27 did: XLA:CPU's rendezvous gives up after the
# timeout that XLA_FLAGS sets and aborts the process. Installed in the child (os.register_at_fork):
# the parent never imports jax.
ABORT_AFTER_STEP_4 = """
import os, runpy, sys
def install():
    import jax, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from jfsdp.runtime import loop
    real = loop.one_step
    def one_step(run, *args):
        saved = real(run, *args)
        if run.loader.step == 4:
            run.ckpt.wait()
            mesh = Mesh(np.array(run.mesh.devices).reshape(-1), ("d",))
            half = mesh.devices.size // 2
            gather_on_half = lambda x: jax.lax.cond(jax.lax.axis_index("d") < half,
                                                    lambda v: jax.lax.all_gather(v, "d", tiled=True)[:1],
                                                    lambda v: v, x)
            f = jax.jit(jax.shard_map(gather_on_half, mesh=mesh, in_specs=P("d"), out_specs=P("d"),
                                      check_vma=False))
            jax.block_until_ready(f(jax.device_put(np.zeros(mesh.devices.size, np.float32),
                                                   NamedSharding(mesh, P("d")))))
        return saved
    loop.one_step = one_step
os.register_at_fork(after_in_child=install)
sys.argv[0] = "train.py"
runpy.run_path("train.py", run_name="__main__")
"""


def test_an_xla_abort_is_one_line_and_the_checkpoint_survives(tmp_path):
    env = {**_env(), "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "jax_cache"),
           "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0", "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
           "XLA_FLAGS": FAST + " --xla_cpu_collective_call_warn_stuck_timeout_seconds=1 "
                        "--xla_cpu_collective_call_terminate_timeout_seconds=2"}
    ck = tmp_path / "ck"
    args = ["--mesh", "1x4", "--model", "llama-test", "--batch-size", "4", "--seq-len", "16", "--steps", "6",
            "--eval-iters", "1", "--gen-tokens", "0", "--metrics-out", "", "--ckpt-dir", str(ck), "--save-every", "2"]
    r = subprocess.run([sys.executable, "-c", ABORT_AFTER_STEP_4, *args], capture_output=True, text=True, env=env,
                       timeout=300, cwd=REPO)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and lines[-1].startswith("error:"), (r.returncode, r.stderr[-3000:])
    assert [line for line in lines if line.startswith("error:")] == [lines[-1]] and "Traceback" not in r.stderr
    assert "rendezvous.cc" in r.stderr and "Termination timeout" in r.stderr   # XLA's own lines, passed through
    assert lines[-1] == ("error: XLA:CPU aborted the run: devices waited in a collective that not all of them "
                         "reached (all gather, op_id 1; 2 of 4 devices arrived); no checkpoint was lost: the last "
                         f"saved is {ck / '4'} (--resume continues from it)"), lines[-1]
    # the checkpoint named is whole: the run resumes from it, here under context parallelism (1x2 --context 2,
    # the same 4 devices), and saves checkpoint 5 at C = 2 (tests/test_context_parallel.py checks losses
    # resumed across C against the straight run's)
    r = subprocess.run([sys.executable, str(REPO / "train.py"), "--mesh", "1x2", "--context", "2", *args[2:], "--resume",
                        "--stop-after", "1"], capture_output=True, text=True, env=env, timeout=300, cwd=REPO)
    assert r.returncode == 0 and f"resumed from {ck / '4'} (step 4, saved on mesh 1x4, " in r.stderr, r.stderr[-3000:]
    assert f"checkpoint saved to {ck / '5'}" in r.stderr
    meta = json.loads((ck / "5" / "meta" / "metadata").read_text())
    assert (meta["mesh"], meta["context"]) == ("1x2", 2)


def test_help_documents_every_flag():
    r = run_train("--help")
    assert r.returncode == 0
    for flag in ("--mesh", "--tensor", "--context", "--strategy", "--model", "--precision", "--remat", "--steps", "--batch-size",
                 "--seq-len", "--grad-accum", "--lr", "--warmup", "--clip", "--seed", "--data", "--eval-every",
                 "--metrics-out", "--ckpt-dir", "--save-every", "--resume", "--profile", "--cpu-devices"):
        assert flag in r.stdout, flag
