"""Checkpoints: exact resume, faults (SIGTERM, kill -9 mid-write, NaN, bad checkpoints), resharding.

train.py runs as a subprocess of its own where the process's behaviour is the point (SIGTERM, kill -9); the
other runs fork from one server process that imported jax and jfsdp once (tests/train_server.py);
resharding runs in-process on the 16 fake devices. The reference for resharding is a run on the original mesh that never stopped."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jfsdp
import models
from jfsdp.io import checkpoint as jckpt
from tests.compile_flags import FAST
from tests.train_server import TrainServer

REPO = Path(__file__).resolve().parents[1]
RUN = ["--mesh", "1x2", "--model", "llama-test", "--batch-size", "4", "--seq-len", "16", "--steps", "12",
       "--log-every", "1", "--eval-every", "0", "--gen-tokens", "0", "--lr", "3e-3", "--warmup", "3"]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    e = dict(os.environ)
    e["XLA_FLAGS"] = FAST   # as conftest: compile faster
    e["JAX_PLATFORMS"] = "cpu"
    e["PYTHONUNBUFFERED"] = "1"
    # the same train step is compiled by many runs here: share it through jax's persistent cache
    e["JAX_COMPILATION_CACHE_DIR"] = str(tmp_path_factory.mktemp("jax_cache"))
    e["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    e["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"
    return e


@pytest.fixture(scope="module")
def server(env, tmp_path_factory):
    """The module's plain train.py runs, one start-up for all (tests/train_server.py)."""
    s = TrainServer(env, tmp_path_factory.mktemp("server"))
    yield s
    s.close()


def train(server, *args, timeout=300):
    return server.run(*RUN, *args, timeout=timeout)


def popen(env, *args, python=None):
    cmd = [sys.executable, *(python or [str(REPO / "train.py")]), *RUN, *args]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)


def losses(path) -> dict:
    return {r["step"]: r["loss"] for r in map(json.loads, Path(path).read_text().splitlines()) if "loss" in r}


def one_line_error(r, *needles):
    assert r.returncode == 2, (r.returncode, r.stderr[-3000:])
    errors = [l for l in r.stderr.splitlines() if l.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
    for n in needles:
        assert n in errors[0], errors[0]
    return errors[0]


def wait_for(pred, p, timeout=120):
    deadline = time.time() + timeout
    while time.time() < deadline and p.poll() is None and not pred():
        time.sleep(0.05)
    assert pred(), f"timed out (exit {p.poll()})"


@pytest.fixture(scope="module")
def straight(server, tmp_path_factory):
    """12 steps in one go, saving every 3: the reference losses and a checkpoint folder."""
    d = tmp_path_factory.mktemp("straight")
    r = train(server, "--metrics-out", str(d / "m.jsonl"), "--ckpt-dir", str(d / "ck"), "--save-every", "3",
              "--keep", "2")
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"checkpoint saved to {d / 'ck' / '12'}" in r.stderr
    assert sorted(os.listdir(d / "ck")) == ["12", "9"]       # --keep 2
    ref = losses(d / "m.jsonl")
    assert sorted(ref) == list(range(1, 13))
    return d, ref


def test_resume_is_exact_and_existing_checkpoints_need_resume(server, straight, tmp_path):
    _, ref = straight
    m, ck = tmp_path / "m.jsonl", tmp_path / "ck"
    r = train(server, "--metrics-out", str(m), "--ckpt-dir", str(ck), "--stop-after", "6")
    assert r.returncode == 0, r.stderr[-3000:]
    assert os.listdir(ck) == ["6"]
    # without --resume, a folder that holds checkpoints is refused and left as it was
    one_line_error(train(server, "--ckpt-dir", str(ck), "--metrics-out", ""), "already holds checkpoints",
                   "step 6", "--resume")
    assert os.listdir(ck) == ["6"]
    r = train(server, "--metrics-out", str(m), "--ckpt-dir", str(ck), "--resume")
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"resumed from {ck / '6'} (step 6" in r.stderr
    assert losses(m) == ref           # bit for bit: the JSON floats are the float32 losses exactly


# Run train.py so that a step boundary waits for the signal: the metrics record of step 6 holds the loop
# (after writing a marker) until train.py's own signal handler has run, so SIGTERM lands mid-run on
# every machine, however fast its steps.
HOLD_AT_STEP_6 = """
import runpy, signal, sys, threading
from pathlib import Path
import jfsdp.runtime.metrics
got = threading.Event()
real_signal = signal.signal
def wrapping_signal(sig, handler):
    if sig == signal.SIGTERM and callable(handler):
        def h(*a):
            got.set()
            return handler(*a)
        return real_signal(sig, h)
    return real_signal(sig, handler)
signal.signal = wrapping_signal
real_write = jfsdp.runtime.metrics.MetricsFile.write
def write(self, **rec):
    real_write(self, **rec)
    if rec.get("step") == 6 and "loss" in rec:
        Path(marker).write_text("at 6")
        got.wait(120)
jfsdp.runtime.metrics.MetricsFile.write = write
marker = sys.argv.pop(1)
sys.argv[0] = "train.py"
runpy.run_path("train.py", run_name="__main__")
"""


def test_sigterm_saves_and_resume_is_exact(env, server, straight, tmp_path):
    _, ref = straight
    m, ck, marker = tmp_path / "m.jsonl", tmp_path / "ck", tmp_path / "marker"
    p = popen(env, "--metrics-out", str(m), "--ckpt-dir", str(ck), python=["-c", HOLD_AT_STEP_6, str(marker)])
    try:
        wait_for(marker.exists, p)
        p.send_signal(signal.SIGTERM)
        out, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 143, err[-3000:]
    assert max(losses(m)) == 6
    assert f"terminated at step 6/12 (SIGTERM): stopping; checkpoint saved to {ck / '6'}" in err
    assert "Traceback" not in err and os.listdir(ck) == ["6"]
    r = train(server, "--metrics-out", str(m), "--ckpt-dir", str(ck), "--resume")
    assert r.returncode == 0, r.stderr[-3000:]
    assert losses(m) == ref


# Run train.py with orbax's finalizing rename of step 6 replaced by a wait: the files of checkpoint 6
# are being written (its tmp folder exists) when the test kills the process with SIGKILL.
HANG_IN_FINALIZE = """
import asyncio, runpy, sys
from pathlib import Path
from orbax.checkpoint._src.path import atomicity
real = atomicity.AtomicRenameTemporaryPath.finalize
async def finalize(self):
    if self._final_path.name == "6":
        Path(marker).write_text("writing 6")
        await asyncio.sleep(3600)
    return await real(self)
atomicity.AtomicRenameTemporaryPath.finalize = finalize
marker = sys.argv.pop(1)
sys.argv[0] = "train.py"
runpy.run_path("train.py", run_name="__main__")
"""


def test_kill_9_while_saving_resumes_from_the_previous_checkpoint(env, server, straight, tmp_path):
    _, ref = straight
    from orbax.checkpoint._src.path import atomicity   # the hook below relies on this orbax internal
    assert "_final_path" in atomicity.AtomicRenameTemporaryPath.finalize.__code__.co_names, \
        "orbax's finalizing rename moved: update HANG_IN_FINALIZE"
    m, ck, marker = tmp_path / "m.jsonl", tmp_path / "ck", tmp_path / "marker"
    p = popen(env, "--metrics-out", str(m), "--ckpt-dir", str(ck), "--save-every", "3",
              python=["-c", HANG_IN_FINALIZE, str(marker)])
    try:
        wait_for(marker.exists, p)
        p.kill()                                   # SIGKILL: no handler runs
        p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == -signal.SIGKILL
    left = sorted(os.listdir(ck))
    assert "3" in left and "6" not in left and any(n.startswith("6.orbax-checkpoint-tmp") for n in left), left
    r = train(server, "--metrics-out", str(m), "--ckpt-dir", str(ck), "--resume", "--save-every", "3")
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"resumed from {ck / '3'} (step 3" in r.stderr and "ignoring unfinished checkpoint write" in r.stderr
    assert losses(m) == ref
    assert "12" in os.listdir(ck)


def test_nan_loss_stops_and_keeps_the_last_good_checkpoint(server, tmp_path):
    ck = tmp_path / "ck"
    # warmup from lr 0: the first steps are finite, then an absurd lr blows the weights up; the log
    # interval is long, so the checkpointer's own check is what meets the non-finite state first
    r = train(server, "--lr", "1e30", "--clip", "0", "--warmup", "3", "--log-every", "12", "--save-every", "1",
              "--ckpt-dir", str(ck), "--metrics-out", "")
    err = one_line_error(r, "NaN or inf", "not saved", "last good checkpoint is")
    good = int(err.rsplit("/", 1)[1])
    c = jckpt.Checkpointer(ck)
    assert c.latest_step() == good and not c.partial_writes()
    meta = c.read_meta(good)
    plan, opt = _plan(meta["model_config"], "1x2", "full_shard", clip=None)   # as --clip 0
    state = c.restore(good, jfsdp.abstract_state(plan, opt))
    assert int(state.step) == good
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(state))
    c.close()


@pytest.fixture(scope="module")
def saved(straight, tmp_path_factory):
    return straight[0] / "ck"


def _damage_data_file(ck: Path):
    files = [f for f in (ck / "state").rglob("*") if f.is_file() and f.stat().st_size > 1000 and "/d/" in str(f)]
    assert files, list((ck / "state").rglob("*"))
    for f in files:
        f.write_bytes(b"\0garbage" * (f.stat().st_size // 8))


BAD = {
    "other-model": (["--model", "llama-tiny"], lambda ck: None, ["meta/metadata", "model_config", "incompatible"]),
    "other-dtype": (["--precision", "bf16"], lambda ck: None, ["meta/metadata", "precision='fp32'", "'bf16'"]),
    "other-data": (["--seq-len", "32"], lambda ck: None, ["meta/metadata", "seq_len=16", "incompatible"]),
    "corrupt-data": ([], _damage_data_file, ["12/state", "corrupt"]),
    "corrupt-meta": ([], lambda ck: (ck / "meta" / "metadata").write_text("{not json"), ["12/meta/metadata",
                                                                                           "corrupt"]),
    "partial": ([], lambda ck: shutil.rmtree(ck / "state"), ["12/state", "partial"]),
}


@pytest.fixture(scope="module")
def bad_runs(server, saved, tmp_path_factory):
    """{case: (its checkpoint folder, the folder's listing before the run, the finished run)} for BAD: each
    case on its own copy of the straight run's checkpoints, damaged as the case says (the module's server
    runs them: train.py's own set-up before the error stays)."""
    root, runs = tmp_path_factory.mktemp("bad"), {}
    for case, (args, damage, _) in BAD.items():
        ck = root / case / "ck"
        shutil.copytree(saved, ck)
        damage(ck / "12")
        before = sorted(p.relative_to(ck).as_posix() for p in ck.rglob("*"))
        runs[case] = (ck, before, train(server, "--ckpt-dir", str(ck), "--resume", "--metrics-out", "", *args))
    return runs


@pytest.mark.parametrize("case", BAD)
def test_bad_checkpoint_is_one_line_error(bad_runs, case):
    """train.py --resume on a checkpoint that another run's flags do not match, or that is damaged: one
    `error:` line naming the file and what is wrong, exit status 2, and the folder left as it was."""
    ck, before, run = bad_runs[case]
    one_line_error(run, *BAD[case][2])
    assert sorted(p.relative_to(ck).as_posix() for p in ck.rglob("*")) == before   # nothing deleted or written


# ---- resharding, in-process on the 16 fake devices ------------------------------------------------

BATCH, SEQ = 48, 16   # 48 divides over 16, 4, 3 and 1 devices


def _plan(model_config, mesh, strategy, clip=1.0):
    cfg = models.LlamaConfig(**model_config) if isinstance(model_config, dict) else model_config
    r, s = jfsdp.parse_mesh(mesh)
    root, unit, n = models.parts(cfg)
    plan = jfsdp.fully_shard(jfsdp.Stacked(root, unit, n), jfsdp.make_mesh(mesh, devices=jax.devices()[: r * s]),
                             jax.ShapeDtypeStruct((1, SEQ), jnp.int32), strategy=strategy)
    return plan, jfsdp.adamw(jfsdp.warmup_cosine(3e-3, 20, 2), clip_norm=clip, mask=plan.decay_mask())


def _batches(cfg, n):
    rng = np.random.default_rng(0)
    out = []
    for _ in range(n):
        t = rng.integers(0, cfg.vocab_size, (BATCH, SEQ + 1), dtype=np.int32)
        out.append({"inputs": t[:, :-1], "targets": t[:, 1:]})
    return out


def _logical(plan, state):
    """Parameters and Adam moments in the full layout (host), for comparison across meshes."""
    mu = [s for s in jax.tree.leaves(state.opt_state, is_leaf=lambda x: hasattr(x, "mu")) if hasattr(s, "mu")][0]
    return {"params": plan.gather(state.params), "mu": plan.gather(mu.mu), "nu": plan.gather(mu.nu),
            "step": int(state.step)}


def _step(plan, opt):
    cfg = models.get_config("llama-test")
    return jfsdp.make_train_step(plan, opt, models.loss_fn(cfg), donate=False)


def _stored_shapes(step_dir: Path, names) -> dict:
    """The shapes of the arrays as the files hold them, read with tensorstore itself (zarr arrays in
    orbax's OCDBT store, one per state leaf, named by its dotted path), not through jfsdp or orbax."""
    import tensorstore as ts
    base = f"file://{step_dir / 'state'}"
    return {n: tuple(ts.open({"driver": "zarr", "kvstore": {"driver": "ocdbt", "base": base, "path": n}},
                             open=True).result().shape) for n in names}


def _logical_shapes(target) -> dict:
    """{dotted leaf path: shape} of an abstract state."""
    return {".".join(str(getattr(k, "name", getattr(k, "idx", getattr(k, "key", k)))) for k in path): tuple(x.shape)
            for path, x in jax.tree_util.tree_flatten_with_path(target)[0]}


def test_reshard_across_meshes_and_strategies(tmp_path):
    cfg = models.get_config("llama-test")
    batches = _batches(cfg, 5)
    plan, opt = _plan(cfg, "2x8", "full_shard")
    step = _step(plan, opt)
    state = jfsdp.init_state(plan, opt, jax.random.key(0))
    for b in batches[:3]:
        state, _ = step(state, jax.device_put(b, plan.batch_sharding))
    saved = _logical(plan, state)
    # the reference: the original mesh, never stopped
    ref_state, ref_losses = state, []
    for b in batches[3:]:
        ref_state, m = step(ref_state, jax.device_put(b, plan.batch_sharding))
        ref_losses.append(float(m["loss"]))

    c = jckpt.Checkpointer(tmp_path / "hop0")
    c.save(3, state, {"hop": "2x8 full_shard"}, plan=plan)
    c.wait()
    # the files hold every array with its logical shape: those of the unpadded one-device state (in
    # memory, the 259-row embedding is 264 rows on 8 shards, 260 on 4, 261 on 3, and the 200-row w2
    # 201 rows on 3); every hop below writes the same shapes
    logical = _logical_shapes(jfsdp.abstract_state(*_plan(cfg, "1x1", "no_shard")))
    assert logical["params.root.tok_embeddings.embedding"] == (259, 96)
    assert _stored_shapes(tmp_path / "hop0" / "3", logical) == logical
    # written on 8 shards, restored onto 3 directly (the chain below restores it onto 4)
    plan3, opt3 = _plan(cfg, "1x3", "full_shard")
    jax.tree.map(np.testing.assert_array_equal, _logical(plan3, c.restore(3, jfsdp.abstract_state(plan3, opt3))), saved)
    # two chains: meshes (2x8 -> 1x4 -> 4x1 -> 1x3 -> 1x1) and strategies (FULL -> NO_SHARD -> SHARD_GRAD_OP),
    # each hop restoring the previous hop's checkpoint, checking it, and saving it again
    for chain in ([("1x4", "full_shard"), ("4x1", "full_shard"), ("1x3", "full_shard"), ("1x1", "full_shard")],
                  [("2x8", "no_shard"), ("2x8", "shard_grad_op")]):
        src = c
        for i, (mesh, strategy) in enumerate(chain):
            plan2, opt2 = _plan(cfg, mesh, strategy)
            src.check_compatible(3, src.read_meta(3), {}, plan2)
            restored = src.restore(3, jfsdp.abstract_state(plan2, opt2))
            abstract = jfsdp.abstract_state(plan2, opt2)
            assert jax.tree.structure(restored) == jax.tree.structure(abstract)
            for leaf, want in zip(jax.tree.leaves(restored), jax.tree.leaves(abstract)):
                assert leaf.sharding == want.sharding and leaf.shape == want.shape
            got = _logical(plan2, restored)
            jax.tree.map(np.testing.assert_array_equal, got, saved)
            # padding rows are zeros on the new shard count (what the next reduce-scatters assume)
            padded = plan2.shard(saved["params"])
            jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
                         restored.params, padded)
            dst = jckpt.Checkpointer(tmp_path / f"{mesh}-{strategy}")
            dst.save(3, restored, {"hop": f"{mesh} {strategy}"}, plan=plan2)
            dst.wait()
            assert _stored_shapes(tmp_path / f"{mesh}-{strategy}" / "3", logical) == logical
            src = dst
            if i == len(chain) - 1:   # train on: the loss of the original mesh
                step2, s2, got_losses = _step(plan2, opt2), restored, []
                for b in batches[3:]:
                    s2, m = step2(s2, jax.device_put(b, plan2.batch_sharding))
                    got_losses.append(float(m["loss"]))
                np.testing.assert_allclose(got_losses, ref_losses, rtol=1e-5)
                jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-6),
                             plan2.gather(s2.params), plan.gather(ref_state.params))


def test_incompatible_vocabulary_is_named(tmp_path):
    cfg = models.get_config("llama-test")
    plan, opt = _plan(cfg, "1x4", "full_shard")
    c = jckpt.Checkpointer(tmp_path / "ck")
    c.save(1, jfsdp.init_state(plan, opt, jax.random.key(0)), {"model_config": {"vocab_size": 259}}, plan=plan)
    c.wait()
    import dataclasses
    other, _ = _plan(dataclasses.replace(cfg, vocab_size=300), "1x4", "full_shard")
    with pytest.raises(jckpt.CheckpointError, match=r"1/meta/metadata: checkpoint has model_config vocab_size=259, "
                                                    r"this run vocab_size=300"):
        c.check_compatible(1, c.read_meta(1), {"model_config": {"vocab_size": 300}}, other)
    with pytest.raises(jckpt.CheckpointError, match=r"parameter root/tok_embeddings/embedding is \[259, 96\] float32, "
                                                    r"this run expects \[300, 96\]"):
        c.check_compatible(1, c.read_meta(1), {}, other)


def test_padded_checkpoints_of_format_1_stay_readable(tmp_path):
    """A checkpoint of the earlier layout (jfsdp-checkpoint/1: arrays stored padded for the writer's
    mesh, written here with plain orbax) restores onto other shard counts and exports."""
    import orbax.checkpoint as ocp
    cfg = models.get_config("llama-test")
    plan, opt = _plan(cfg, "1x8", "full_shard")
    state = jfsdp.init_state(plan, opt, jax.random.key(1))
    mgr = ocp.CheckpointManager(tmp_path / "ck", item_handlers={"state": ocp.StandardCheckpointHandler(),
                                                                 "meta": ocp.JsonCheckpointHandler()})
    import dataclasses
    meta = {"format": "jfsdp-checkpoint/1", "step": 1, "model_config": dataclasses.asdict(cfg),
            "params": jckpt.param_signature(plan)}
    from jfsdp.io.relayout import to_rows    # that layout: every leaf padded on its rows (flat leaves turned)
    old_state, _ = to_rows(plan, state)
    mgr.save(1, args=ocp.args.Composite(state=ocp.args.StandardSave(old_state), meta=ocp.args.JsonSave(meta)))
    mgr.wait_until_finished()
    mgr.close()
    assert _stored_shapes(tmp_path / "ck" / "1", ["params.root.tok_embeddings.embedding"]) == {
        "params.root.tok_embeddings.embedding": (264, 96)}
    c = jckpt.Checkpointer(tmp_path / "ck")
    for mesh in ("1x3", "1x1"):
        plan2, opt2 = _plan(cfg, mesh, "full_shard")
        c.check_compatible(1, c.read_meta(1), {}, plan2)
        jax.tree.map(np.testing.assert_array_equal, _logical(plan2, c.restore(1, jfsdp.abstract_state(plan2, opt2))),
                     _logical(plan, state))
    c.close()
    from jfsdp.export import read_params
    full, _, _ = read_params(str(tmp_path / "ck"))
    jax.tree.map(np.testing.assert_array_equal, full, plan.gather(state.params))


# ---- models of several stages (jfsdp.Staged): {'root', 'stages': [...]} -----------------------------

def _staged_plan(mesh, sizes=(2, 3)):
    from tests.test_stages import BATCH as B, SEQ as T, GLUBlock, MLPBlock, Root
    r, s = jfsdp.parse_mesh(mesh)
    model = jfsdp.Staged(Root(), [(MLPBlock(), sizes[0]), (GLUBlock(), sizes[1])])
    plan = jfsdp.fully_shard(model, jfsdp.make_mesh(mesh, devices=jax.devices()[: r * s]),
                             jax.ShapeDtypeStruct((B, T), jnp.int32))
    return plan, jfsdp.adamw(1e-3, mask=plan.decay_mask())


def test_staged_model_saves_logical_arrays_restores_onto_other_meshes_and_does_not_export(tmp_path, capsys):
    """A two-stage model (tests/test_stages.py's: vocabulary 53, MLP hidden 72, GLU hidden 56, width
    40: padded on 8, 4 and 3 shards) saved on 1x8 with non-zero Adam moments, restored onto 2x4 and
    1x3: parameters and moments equal those saved, padding rows zero, files in the logical shapes.
    Export (Llama only) refuses it with one `error:` line, as it does another model's config."""
    plan, opt = _staged_plan("1x8")
    rng = np.random.default_rng(0)
    rand = lambda: jax.tree.map(lambda x: rng.standard_normal(x.shape, np.float32) + 1,  # noqa: E731
                                jax.eval_shape(plan.init_full, jax.random.key(0)))   # the full layout
    params, mu, nu = rand(), rand(), jax.tree.map(np.abs, rand())
    state = jfsdp.init_state(plan, opt, params=params)
    state = state._replace(opt_state=jax.tree.map(
        lambda s: s._replace(mu=plan.shard(mu), nu=plan.shard(nu)) if hasattr(s, "mu") else s,
        state.opt_state, is_leaf=lambda s: hasattr(s, "mu")))
    saved = _logical(plan, state)
    jax.tree.map(np.testing.assert_array_equal, saved["mu"], mu)   # really the moments we set
    c = jckpt.Checkpointer(tmp_path / "ck")
    c.save(1, state, {"run": "staged"}, plan=plan)
    c.wait()
    assert c.read_meta(1)["params"]["stages/1/w2/kernel"] == [[3, 56, 40], "float32"]
    logical = _logical_shapes(jfsdp.abstract_state(*_staged_plan("1x1")))
    assert logical["params.stages.1.w2.kernel"] == (3, 56, 40) and logical["params.root.tok.embedding"] == (53, 40)
    assert _stored_shapes(tmp_path / "ck" / "1", logical) == logical
    for mesh in ("2x4", "1x3"):
        plan2, opt2 = _staged_plan(mesh)
        c.check_compatible(1, c.read_meta(1), {}, plan2)
        restored = c.restore(1, jfsdp.abstract_state(plan2, opt2))
        jax.tree.map(np.testing.assert_array_equal, _logical(plan2, restored), saved)
        jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),   # zero padding
                     restored.params, plan2.shard(saved["params"]))
    assert plan2.layouts["stages"][1]["w2"]["kernel"].stored_shape == (2241, 1)   # 1x3 really padded (flat, 56*40+1)
    other, _ = _staged_plan("1x3", sizes=(2, 2))
    with pytest.raises(jckpt.CheckpointError, match=r"parameter stages/1/norm/scale is \[3, 40\] float32, this run "
                                                    r"expects \[2, 40\]"):
        c.check_compatible(1, c.read_meta(1), {}, other)
    c.close()
    # export: no model_config; another model's config; a Llama config over these parameters
    from jfsdp.export import main as export_main
    meta_file = tmp_path / "ck" / "1" / "meta" / "metadata"
    meta = json.loads(meta_file.read_text())
    import dataclasses
    for model_config, why in [(None, "has no model_config"),
                              (dataclasses.asdict(models.get_config("resmlp-test")), "model_config"),
                              (dataclasses.asdict(models.get_config("llama-test")), "parameters differ")]:
        if model_config is not None:
            meta_file.write_text(json.dumps({**meta, "model_config": model_config}))
        assert export_main([str(tmp_path / "ck"), str(tmp_path / "hf")]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: ") and "Traceback" not in err[0], err
        assert "does not hold jfsdp's Llama model" in err[0] and why in err[0] and "LlamaForCausalLM" in err[0], err
    assert not (tmp_path / "hf").exists()

