"""A Linen model whose __call__ is wrapped in flax's nn.jit, given to fully_shard twice in one process on
two meshes (a notebook re-run, another mesh): nn.jit replays the trace jax cached the first time, so the
second plan must not miss its units; both plans train, and their losses equal each other's."""
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jfsdp


class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        return x + nn.Dense(16)(jnp.tanh(x))


class Model(nn.Module):
    @functools.partial(nn.jit, static_argnames=("self",))
    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(32, 16)(tokens)
        x = Block()(Block()(x))
        return nn.Dense(32)(x)


def ce(logits, batch):
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()


def _losses(mesh_spec, batches):
    mesh = jfsdp.make_mesh(mesh_spec, devices=jax.devices()[:8])
    plan = jfsdp.fully_shard(Model(), mesh, batches[0], units=Block, call=lambda m, b: m(b["inputs"]))
    opt = jfsdp.adamw(1e-2)
    state, step, out = jfsdp.init_state(plan, opt, jax.random.key(0)), jfsdp.make_train_step(plan, opt, ce), []
    for b in batches:
        state, m = step(state, plan.put_batch(b))
        out.append(float(m["loss"]))
    return out


def test_second_fully_shard_of_an_nn_jit_model_on_another_mesh_trains_the_same():
    rng = np.random.default_rng(0)
    toks = [jnp.asarray(rng.integers(0, 32, (8, 8)), jnp.int32) for _ in range(3)]
    batches = [{"inputs": t, "targets": t} for t in toks]   # copy the input: learnable in 3 steps
    first, second = _losses("1x8", batches), _losses("2x4", batches)
    assert first[-1] < first[0]
    np.testing.assert_allclose(second, first, rtol=1e-5)
