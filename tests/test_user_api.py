"""What a user meets when bringing their own model and weights (issue 12's friction points 1-7):
each bad input is a ConfigError that names the expected thing, and the natural usage is right."""
import os
import pathlib
import shutil
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jfsdp
import models
from tests import reference as ref

CFG = models.get_config("llama-test")
ROOT = pathlib.Path(__file__).resolve().parents[1]


class Dense(nn.Module):
    width: int = 24

    @nn.compact
    def __call__(self, x):
        return x + nn.Dense(x.shape[-1], name="fc")(nn.LayerNorm(name="norm")(x))


class Widen(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(32, name="fc")(x)


class Root(nn.Module):
    def setup(self):
        self.emb = nn.Embed(50, 24)
        self.out = nn.Dense(50)

    def embed(self, x):
        return self.emb(x)

    def head(self, h):
        return self.out(h)


def loss(logits, batch):
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()


@pytest.fixture(scope="module")
def llama():
    root, unit, n = models.parts(CFG)
    return jfsdp.fully_shard(jfsdp.Stacked(root, unit, n), jfsdp.make_mesh("1x16"),
                             jax.ShapeDtypeStruct((16, 16), jnp.int32), remat="full")


@pytest.fixture(scope="module")
def staged():
    model = jfsdp.Staged(Root(), [(Dense(), 2), (Widen(), 1), jfsdp.Stage(Dense(), 3)])
    return jfsdp.fully_shard(model, jfsdp.make_mesh("2x4", jax.devices()[:8]), jax.ShapeDtypeStruct((8, 6), jnp.int32))


# ---- 1: weights of one's own, the layout, and the errors that name it

def test_layouts_one_stage_unchanged_and_stages_as_a_list(llama, staged):
    assert set(llama.layouts) == {"root", "units"} and set(llama.param_specs) == {"root", "units"}
    assert llama.layouts["units"]["attention"]["wq"]["kernel"].shape == (96, 96)  # per unit, no stack axis
    assert set(staged.layouts) == {"root", "stages"} and len(staged.layouts["stages"]) == 3
    assert staged.stage_sizes == (2, 1, 3)
    assert staged.layouts["stages"][1]["fc"]["kernel"].shape == (24, 32)
    assert staged.layouts["stages"][2]["fc"]["kernel"].shape == (32, 32)  # after the width change
    assert staged.layouts["root"]["out"]["kernel"].shape == (32, 50)      # the head sees the last width
    shards = staged.abstract_params()
    assert shards["stages"][2]["fc"]["kernel"].shape == (3, 32, 32)


def test_stack_units_and_from_layers_round_trip(llama):
    full = llama.gather(llama.init(jax.random.key(1)))
    root, layers = llama.to_layers(full)
    assert len(layers) == CFG.n_layers
    w = full["units"]["attention"]["wq"]["kernel"]
    np.testing.assert_array_equal(layers[1]["attention"]["wq"]["kernel"], w[1])  # unit i is row i
    again = llama.from_layers(root, layers)
    for path, b, a in ref.paired(full, again):
        np.testing.assert_array_equal(a, b, err_msg=path)
    stacked = jfsdp.stack_units([{"w": np.full((2, 3), i)} for i in range(4)])
    assert stacked["w"].shape == (4, 2, 3) and np.all(stacked["w"][2] == 2)
    assert [u["w"][0, 0] for u in jfsdp.unstack_units(stacked)] == [0, 1, 2, 3]
    with pytest.raises(jfsdp.ConfigError, match=r"unit 1\['w'\] has shape \(3,\), unit 0 has \(2, 3\)"):
        jfsdp.stack_units([{"w": np.zeros((2, 3))}, {"w": np.zeros(3)}])


def test_shard_refuses_per_layer_params_naming_units(llama):
    full = llama.gather(llama.init(jax.random.key(1)))
    root, layers = llama.to_layers(full)
    with pytest.raises(jfsdp.ConfigError, match=r"parameters\['units'\] must be one tree with every leaf stacked on "
                                                 r"axis 0 \(2 rows\), got a list of 2 per-unit trees.*stack_units"):
        llama.shard({"root": root, "units": layers})
    with pytest.raises(jfsdp.ConfigError, match=r"must be a dict \{'root': \.\.\., 'units': .*got \['layers', 'root'\]"):
        llama.shard({"root": root, "layers": full["units"]})
    with pytest.raises(jfsdp.ConfigError, match=r"must be a dict .*'units'.*got list"):
        llama.shard([root])  # not a dict at all
    bad = dict(full, units=layers[0])  # one unit, not stacked
    with pytest.raises(jfsdp.ConfigError, match=r"parameters\['units'\]\['attention'\]\['w\w'\]\['kernel'\] has shape "
                                                 r"\(96, (\d+)\), expected \(2, 96, \1\); stack the 2 units"):
        llama.shard(bad)
    missing = {"root": {}, "units": full["units"]}
    with pytest.raises(jfsdp.ConfigError, match=r"parameters\['root'\] does not match .*missing \['norm'\]\['scale'\]"):
        llama.shard(missing)


def test_staged_layout_errors_name_stages(staged):
    full = staged.gather(staged.init(jax.random.key(0)))
    with pytest.raises(jfsdp.ConfigError, match=r"'stages': \[<tree stacked on axis 0, 2 rows>, <tree stacked on axis "
                                                 r"0, 1 rows>, <tree stacked on axis 0, 3 rows>\]\}.*jfsdp.Staged"):
        staged.shard({"root": full["root"], "units": full["stages"][0]})
    with pytest.raises(jfsdp.ConfigError, match=r"\['stages'\] must be a list of 3 trees, one per stage.*list of 2"):
        staged.shard({"root": full["root"], "stages": full["stages"][:2]})
    root, layers = staged.to_layers(full)
    assert [len(g) for g in layers] == [2, 1, 3]
    with pytest.raises(jfsdp.ConfigError, match=r"stage 2: expected a list of 3 per-unit parameter trees, got 2"):
        staged.from_layers(root, [layers[0], layers[1], layers[2][:2]])
    np.testing.assert_array_equal(staged.from_layers(root, layers)["stages"][2]["fc"]["kernel"], full["stages"][2]["fc"]["kernel"])


def test_init_state_takes_full_weights_or_shards_and_keeps_yours(staged):
    """Friction points 1 and 5: init_state(params=full weights) places them; shards passed in are
    copied, so the caller's arrays survive the donating step."""
    opt = jfsdp.adamw(1e-2)
    with pytest.raises(jfsdp.ConfigError, match=r"init_state needs rng \(deferred initialization\) or params="):
        jfsdp.init_state(staged, opt)
    full = staged.gather(staged.init(jax.random.key(0)))
    shards = staged.shard(full)
    a = jfsdp.init_state(staged, opt, params=full)
    b = jfsdp.init_state(staged, opt, params=shards)
    step = jfsdp.make_train_step(staged, opt, loss)
    tok = np.random.default_rng(0).integers(0, 50, (8, 7)).astype(np.int32)
    batch = {"inputs": tok[:, :-1], "targets": tok[:, 1:]}
    a, ma = step(a, staged.put_batch(batch))
    b, mb = step(b, staged.put_batch(batch))
    assert float(ma["loss"]) == float(mb["loss"])
    assert not any(x.is_deleted() for x in jax.tree.leaves(shards))  # still yours
    np.testing.assert_array_equal(staged.gather(shards)["stages"][0]["fc"]["kernel"], full["stages"][0]["fc"]["kernel"])
    # donated state reused: a ConfigError that says what to do, not a buffer error
    with pytest.raises(jfsdp.ConfigError, match=r"donated to an earlier step.*use the state that step returned"):
        old = a
        a, _ = step(a, staged.put_batch(batch))
        step(old, staged.put_batch(batch))


# ---- 2 and 3: the batch and the loss contract

def test_batch_contract_errors(staged):
    opt = jfsdp.adamw(1e-2)
    state = jfsdp.init_state(staged, opt, jax.random.key(0))
    step = jfsdp.make_train_step(staged, opt, loss)
    tok = np.zeros((8, 6), np.int32)
    with pytest.raises(jfsdp.ConfigError, match=r"a batch must be a dict with key 'inputs'.*got keys \['targets', 'x'\]"):
        step(state, {"x": tok, "targets": tok})
    with pytest.raises(jfsdp.ConfigError, match=r"batch size 6 does not divide over the 8 devices"):
        staged.put_batch({"inputs": tok[:6], "targets": tok[:6]})
    with pytest.raises(jfsdp.ConfigError, match=r"batch size 12 does not divide over the 8 devices"):
        step(state, {"inputs": np.zeros((12, 6), np.int32), "targets": np.zeros((12, 6), np.int32)})  # host arrays too
    bad_loss = jfsdp.make_train_step(staged, opt, lambda out, b: optax.softmax_cross_entropy_with_integer_labels(out, b["targets"]))
    with pytest.raises(jfsdp.ConfigError, match=r"loss_fn must return a scalar .* got shape \(1, 6\)"):
        bad_loss(state, staged.put_batch({"inputs": tok, "targets": tok}))
    placed = staged.put_batch({"inputs": tok, "targets": tok})
    assert placed["inputs"].sharding == staged.batch_sharding


# ---- 4: weight decay is right by default

@pytest.mark.parametrize("which", ["llama", "staged"])
def test_default_and_ndim_masks_spare_stacked_biases_and_norms(which, llama, staged):
    """With zero gradients AdamW's update is weight decay alone: the default mask and the natural
    `x.ndim >= 2` callable decay exactly the matrices (per unit), as plan.decay_mask() says, never a
    stacked bias or norm scale. Plain optax with the same callable would decay those too."""
    plan = llama if which == "llama" else staged
    # all ones (not the init, whose biases are zero and would hide a decay), in the full layout
    params = jax.tree.map(lambda s: np.ones(s.shape, s.dtype), jax.eval_shape(plan.init_full, jax.random.key(0)))
    zeros = jax.tree.map(np.zeros_like, params)
    want = plan.decay_mask()
    ndim2 = lambda p: jax.tree.map(lambda x: x.ndim >= 2, p)
    for opt in (jfsdp.adamw(0.1, clip_norm=None), jfsdp.adamw(0.1, clip_norm=None, mask=ndim2)):
        upd, _ = jax.jit(opt.update)(zeros, jax.jit(opt.init)(params), params)  # jitted: eager optax is slow
        decayed = jax.tree.map(lambda u: bool(np.any(np.asarray(u) != 0)), upd)
        assert decayed == want
    assert not all(jax.tree.leaves(want)) and any(jax.tree.leaves(want))
    plain = optax.adamw(0.1, mask=ndim2)
    upd, _ = jax.jit(plain.update)(zeros, jax.jit(plain.init)(params), params)
    assert jax.tree.map(lambda u: bool(np.any(np.asarray(u) != 0)), upd) != want  # the trap jfsdp.adamw avoids


# ---- 6: models whose units are not all alike

def test_unlike_units_get_a_config_error_pointing_to_staged():
    root, unit, _ = models.parts(CFG)
    mesh = jfsdp.make_mesh("1x8", jax.devices()[:8])
    x = jax.ShapeDtypeStruct((8, 16), jnp.int32)
    with pytest.raises(jfsdp.ConfigError, match=r"Stacked's unit must be one flax Module.*got list.*jfsdp.Staged"):
        jfsdp.fully_shard(jfsdp.Stacked(root, [unit, unit], 2), mesh, x)
    with pytest.raises(jfsdp.ConfigError, match=r"stage 0: its unit maps h of shape \(8, 6, 24\) to \(8, 6, 32\), "
                                                 r"but a unit repeated 2 times must keep the shape"):
        jfsdp.fully_shard(jfsdp.Staged(Root(), [(Widen(), 2)]), mesh, jax.ShapeDtypeStruct((8, 6), jnp.int32))
    with pytest.raises(jfsdp.ConfigError, match=r"stage 1 must be a jfsdp.Stage\(unit, n_units\)"):
        jfsdp.Staged(Root(), [(Dense(), 2), Dense()])
    with pytest.raises(jfsdp.ConfigError, match=r"stage 0: n_units must be an integer of at least 1, got 0"):
        jfsdp.fully_shard(jfsdp.Staged(Root(), [(Dense(), 0)]), mesh, x)
    with pytest.raises(jfsdp.ConfigError, match=r"has no method 'embed'"):
        jfsdp.fully_shard(jfsdp.Stacked(Dense(), Dense(), 2), mesh, x)


# ---- 7: pip puts only jfsdp on the import path

def test_installed_jfsdp_does_not_shadow_a_users_models(tmp_path):
    """Install the project (a copy of its sources, so the worktree stays clean) with pip into a target
    directory; that directory must hold `jfsdp` and no top-level `models`, and a user's own `models`
    package placed AFTER it on the path must be the one imported."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for pkg in ("jfsdp", "models"):
        shutil.copytree(ROOT / pkg, src / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    target = tmp_path / "site"
    # pip's build isolation: the build gets a fresh environment with pyproject.toml's [build-system]
    # requirements from pip's configured index, so it sees nothing else of the venv it runs from
    # (the venv's own setuptools may be too old to build a wheel, issue 28).
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(src)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    top = {d.name for d in target.iterdir() if not d.name.endswith((".dist-info", ".egg-info")) and d.name != "bin"}
    assert "jfsdp" in top and "models" not in top, top
    (dist,) = target.glob("jfsdp-*.dist-info")
    assert not any(line.startswith("models/") for line in (dist / "RECORD").read_text().splitlines())
    user = tmp_path / "user"
    (user / "models").mkdir(parents=True)
    (user / "models" / "__init__.py").write_text("WHOSE = 'mine'\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "XLA_FLAGS")}
    env["PYTHONPATH"] = f"{target}{os.pathsep}{user}"  # the installed jfsdp comes first on the path
    code = "import jfsdp, models; print(models.WHOSE, jfsdp.__file__)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert r.returncode == 0, r.stderr
    whose, where = r.stdout.split()
    assert whose == "mine" and where.startswith(str(target))
