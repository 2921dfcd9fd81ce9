"""Models of several stages (`jfsdp.Staged`): different unit types and widths per stage, every unit
an FSDP unit. Checked against a plain single-device trainer (tests/reference.py) on 1x8, 2x4, 8x1
for FULL_SHARD, SHARD_GRAD_OP and NO_SHARD, and against XLA's compiled memory for depth."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jfsdp
from jfsdp import hlo, memory
from tests import reference as ref

VOCAB, WIDTH, STEPS, BATCH, SEQ = 53, 40, 3, 16, 12


class Root(nn.Module):
    """Token embedding in, LayerNorm + biased head out (the head takes whatever width h has)."""
    vocab: int = VOCAB
    width: int = WIDTH

    def setup(self):
        self.tok = nn.Embed(self.vocab, self.width)
        self.norm = nn.LayerNorm()
        self.out = nn.Dense(self.vocab)

    def embed(self, x):
        return self.tok(x)

    def head(self, h):
        return self.out(self.norm(h))


class MLPBlock(nn.Module):
    """Stage A: pre-norm residual MLP with biases (hidden 72)."""
    hidden: int = 72

    @nn.compact
    def __call__(self, x):
        y = nn.gelu(nn.Dense(self.hidden, name="fc1")(nn.LayerNorm(name="norm")(x)))
        return x + nn.Dense(x.shape[-1], name="fc2")(y)


class GLUBlock(nn.Module):
    """Stage B: pre-RMSNorm residual SwiGLU (hidden 56), no biases."""
    hidden: int = 56

    @nn.compact
    def __call__(self, x):
        y = nn.RMSNorm(name="norm")(x)
        g = nn.silu(nn.Dense(self.hidden, use_bias=False, name="w1")(y)) * nn.Dense(self.hidden, use_bias=False, name="w3")(y)
        return x + nn.Dense(x.shape[-1], use_bias=False, name="w2")(g)


class Narrow(nn.Module):
    """A one-unit stage that changes the width (40 -> 24)."""
    width: int = 24

    @nn.compact
    def __call__(self, x):
        return nn.Dense(self.width, name="proj")(x)


def lm_loss(logits, batch):
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), -1)
    return -jnp.mean(jnp.take_along_axis(logp, batch["targets"][..., None], -1))


TWO_STAGES = [(MLPBlock(), 2), (GLUBlock(), 3)]
NARROWING = [(MLPBlock(), 2), (Narrow(), 1), (GLUBlock(hidden=40), 2)]
MESHES, STRATEGIES, REMATS = ["1x8", "2x4", "8x1"], ["full_shard", "shard_grad_op", "no_shard"], ["none", "full", "dots"]


def _batches(seed=0):
    rng = np.random.default_rng(seed)
    tok = [rng.integers(0, VOCAB, (BATCH, SEQ + 1)) for _ in range(STEPS)]
    return [{"inputs": jnp.asarray(t[:, :-1], jnp.int32), "targets": jnp.asarray(t[:, 1:], jnp.int32)} for t in tok]


def _reference(stages):
    root, batches = Root(), _batches()
    units = [u for u, _ in stages]
    with jax.default_device(jax.devices()[0]):
        params = ref.init_staged(root, stages, batches[0]["inputs"])
        losses, final, grads = ref.train_staged(root, units, lm_loss, params, batches)
    return dict(stages=stages, batches=batches, init=jax.device_get(params), grads=jax.device_get(grads),
                losses=losses, final=jax.device_get(final))


@pytest.fixture(scope="module")
def two():
    return _reference(TWO_STAGES)


def _plan(stages, mesh_spec, strategy, remat, mp=None):
    r, s = jfsdp.parse_mesh(mesh_spec)
    mesh = jfsdp.make_mesh(mesh_spec, devices=jax.devices()[: r * s])
    model = jfsdp.Staged(Root(), [jfsdp.Stage(u, n) for u, n in stages])
    return jfsdp.fully_shard(model, mesh, jax.ShapeDtypeStruct((BATCH, SEQ), jnp.int32), strategy=strategy,
                             remat=remat, mp_policy=mp)


def _close(got, want, rtol, what):
    for path, g, w in zip(jax.tree_util.tree_leaves_with_path(want), jax.tree.leaves(got), jax.tree.leaves(want)):
        assert np.shape(g) == np.shape(w), jax.tree_util.keystr(path)
        err = np.max(np.abs(np.asarray(g, np.float64) - w))
        assert err <= rtol * np.max(np.abs(w)), f"{what}{jax.tree_util.keystr(path)}: max error {err:.3g}"


def keep_gradients():
    """An optax stage that passes gradients through and keeps the last ones in its state (placed
    like the parameters): the train step's own gradients, read without compiling a second program."""
    # init returns what it is given where that is not an array: optax.tree_map_params (which places
    # optimizer state) then sees a copy of the parameter tree here
    init = lambda params: jax.tree.map(lambda x: x * 0 if hasattr(x, "dtype") else x, params)
    return optax.GradientTransformation(init, lambda updates, state, params=None: (updates, updates))


def _run(case, mesh_spec, strategy, remat, mp=None):
    """jfsdp's train step for the case's batches -> (plan, final state, losses, first-step gradients)."""
    plan = _plan(case["stages"], mesh_spec, strategy, remat, mp)
    adamw = jfsdp.adamw(ref.LR, b1=ref.B1, b2=ref.B2, eps=ref.EPS, weight_decay=ref.WD, clip_norm=ref.CLIP)  # default mask
    opt = optax.chain(keep_gradients(), adamw)
    state = jfsdp.init_state(plan, opt, params=case["init"])
    step = jfsdp.make_train_step(plan, opt, lm_loss)
    losses, grads = [], None
    for b in case["batches"]:
        state, m = step(state, plan.put_batch(b))
        losses.append(float(m["loss"]))
        grads = plan.gather(state.opt_state[0]) if grads is None else grads
    return plan, state, losses, grads


@pytest.mark.parametrize("mesh_spec", MESHES)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_two_stages_match_single_device(two, mesh_spec, strategy):
    """Losses of 3 AdamW steps within 1e-5 relative, first-step gradients within 1e-5 of each leaf's
    largest, final parameters within 1e-4; with jfsdp.adamw's default weight-decay mask."""
    remat = REMATS[(MESHES.index(mesh_spec) + STRATEGIES.index(strategy)) % 3]
    plan, state, losses, grads = _run(two, mesh_spec, strategy, remat)
    np.testing.assert_allclose(losses, two["losses"], rtol=1e-5)
    _close(grads, two["grads"], 1e-5, "grad")
    _close(plan.gather(state.params), two["final"], 1e-4, "param")
