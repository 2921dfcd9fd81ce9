"""A checkpoint saved before every leaf was sharded evenly (tests/fixtures/old_layout_ckpt, written by
jfsdp at b6d5e94 with tests/fixtures/make_old_checkpoint.py: every leaf padded on dimension 0, 1x8)
restores onto meshes where some leaves are now flat (1x16: the 20-row embedding and the 24-row w2; 1x3),
and resumes exactly: the next two losses and the final parameters are those of the run that never
stopped (written by that commit beside the checkpoint)."""
import json
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest

import jfsdp
import models
from jfsdp.io import checkpoint as jckpt
from tests.fixtures.make_old_checkpoint import CFG, batches, plan_for

FIXTURE = Path(__file__).parent / "fixtures" / "old_layout_ckpt"


@pytest.mark.parametrize("mesh,flat", [("1x16", 2), ("1x3", 7)])
def test_checkpoint_of_the_old_layout_restores_and_resumes_exactly(tmp_path, mesh, flat):
    shutil.copytree(FIXTURE / "ckpt", tmp_path / "ckpt")
    ref = json.loads((FIXTURE / "reference.json").read_text())
    final = dict(np.load(FIXTURE / "final.npz"))
    plan, opt = plan_for(mesh)
    # leaves stored flat now: the embedding, and per unit its kernels whose rows S does not divide
    is_l = lambda x: isinstance(x, jfsdp.Layout)   # noqa: E731
    assert sum(l.is_flat for l in jax.tree.leaves(plan.layouts, is_leaf=is_l)) == flat
    c = jckpt.Checkpointer(tmp_path / "ckpt")
    c.check_compatible(2, c.read_meta(2), {}, plan)
    state = c.restore(2, jfsdp.abstract_state(plan, opt))
    step = jfsdp.make_train_step(plan, opt, models.loss_fn(CFG))
    losses = []
    for b in batches()[2:]:
        state, m = step(state, jax.device_put(b, plan.batch_sharding))
        losses.append(float(m["loss"]))
    np.testing.assert_allclose(losses, ref["losses"], rtol=1e-5)
    got = {jax.tree_util.keystr(p): np.asarray(x) for p, x in
           jax.tree_util.tree_flatten_with_path(plan.gather(state.params))[0]}
    assert set(got) == set(final)
    for k, want in final.items():   # 2 AdamW steps at lr 1e-2: the parameter floor of docs/numerics.md
        np.testing.assert_allclose(got[k], want, rtol=1e-4, atol=1e-2 * 2 * 1e-2, err_msg=k)
    c.close()
