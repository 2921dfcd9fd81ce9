"""examples/gpt2.py, a user-written GPT-2-style model (not from models/), trained with jfsdp exactly as
the example does it, against a plain single-device trainer (tests/reference.py) on 1x8, 2x4, 8x1, with
FULL_SHARD, SHARD_GRAD_OP and NO_SHARD."""
import importlib.util
import pathlib
import sys

import jax
import numpy as np
import optax
import pytest

import jfsdp
from tests import reference as ref

spec = importlib.util.spec_from_file_location("gpt2_example", pathlib.Path(__file__).parents[1] / "examples" / "gpt2.py")
gpt2 = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # dataclasses look it up
spec.loader.exec_module(gpt2)

STEPS, BATCH, SEQ = 3, 16, 24
CFG = gpt2.Config()


@pytest.fixture(scope="module")
def reference():
    batches = [{k: jax.numpy.asarray(v) for k, v in b.items()} for b in gpt2.data(CFG, STEPS, BATCH, SEQ)]
    root_p, layers = gpt2.init_layers(CFG, SEQ, seed=3)
    root, unit = gpt2.GPT(CFG), gpt2.Block(CFG)
    with jax.default_device(jax.devices()[0]):
        # stacked by hand; the reference's staged form with one stage, which also returns the first
        # step's gradients
        params = {"root": root_p, "stages": [jax.tree.map(lambda *xs: jax.numpy.stack(xs), *layers)]}
        losses, final, grads = ref.train_staged(root, [unit], gpt2.loss_fn, params, batches)
    as_stacked = lambda p: jax.device_get({"root": p["root"], "units": p["stages"][0]})
    return dict(weights=(root_p, layers), losses=losses, grads=as_stacked(grads), final=as_stacked(final))


# every mesh and every strategy once: the mesh x strategy grid itself is test_stages' and
# test_equivalence's; what is the example's own here is its model and its train()
@pytest.mark.parametrize("mesh,strategy", [("1x8", "full_shard"), ("2x4", "shard_grad_op"), ("8x1", "no_shard"),
                                           ("2x4", "full_shard")])
def test_example_matches_single_device(reference, mesh, strategy):
    """The example's own train(): losses within 1e-5 relative, first-step gradients within 1e-5 of each
    leaf's largest, parameters after 3 steps close (ref.PARAM_ATOL); the reference decays matrices only, which
    the example gets from jfsdp.adamw's default mask."""
    adamw = jfsdp.adamw(ref.LR, b1=ref.B1, b2=ref.B2, eps=ref.EPS, weight_decay=ref.WD, clip_norm=ref.CLIP)
    plan, state, losses = gpt2.train(mesh, strategy, steps=STEPS, batch=BATCH, seq=SEQ, weights=reference["weights"],
                                     optimizer=optax.chain(ref.keep_gradients(), adamw))
    np.testing.assert_allclose(losses, reference["losses"], rtol=1e-5)
    ref.close(plan.gather(state.opt_state[0][0]), reference["grads"], 1e-5, "grad")  # kept from the first step
    ref.close(plan.gather(state.params), reference["final"], 1e-4, "param", ref.PARAM_ATOL)
