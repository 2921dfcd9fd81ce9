"""Context parallelism (jfsdp/engine/parallel/context.py): ring attention over a `context` axis against
the whole sequence's causal grouped-query attention computed in float64 without jfsdp, the zigzag load
balance counted, and the ring's collective-permutes read from the compiled program."""
import functools

import jax
import jfsdp
import models
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jfsdp.config.errors import ConfigError
from jfsdp.io import checkpoint as jckpt
from jfsdp.config.sequence import unzigzag, zigzag, zigzag_order
from jfsdp.engine.parallel.context import Kernel, ring_attention
from jfsdp.planning import hlo
from models.attention import blockwise_attention_bwd, blockwise_attention_fwd

# ring (fp32) against float64, relative to the largest magnitude. Floor, the worst of out/dq/dk/dv over
# C = 2, 4, 8 with and without zigzag, native (AVX2) and --xla_cpu_max_isa=SSE4_2: 4.7e-7 (one device's
# blockwise attention: 3.4e-7), 2026-11-26; docs/context-parallel.md. A wrong mask, a lost hop or a
# gradient left on the wrong rank is an error of order 1.
RTOL = 2e-6
BLOCK = 4
KERNEL = Kernel(lambda q, k, v, causal: blockwise_attention_fwd(q, k, v, causal=causal, block=BLOCK),
                lambda q, k, v, o, lse, do, causal: blockwise_attention_bwd(q, k, v, o, lse, do, causal=causal,
                                                                             block=BLOCK))


def attention64(q, k, v, do):
    """Causal GQA attention and its gradients for cotangent do, in float64 numpy."""
    q, k, v, do = (np.asarray(x, np.float64) for x in (q, k, v, do))
    b, t, h, d = q.shape
    g = h // k.shape[2]
    kr, vr = np.repeat(k, g, 2), np.repeat(v, g, 2)
    s = np.where(np.tril(np.ones((t, t), bool)), np.einsum("bqhd,bkhd->bhqk", q, kr) / np.sqrt(d), -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    dp = np.einsum("bqhd,bkhd->bhqk", do, vr)
    ds = p * (dp - np.sum(dp * p, -1, keepdims=True)) / np.sqrt(d)
    per_kv = lambda x: x.reshape(b, t, k.shape[2], g, d).sum(3)
    return (np.einsum("bhqk,bkhd->bqhd", p, vr), np.einsum("bhqk,bkhd->bqhd", ds, kr),
            per_kv(np.einsum("bhqk,bqhd->bkhd", ds, q)), per_kv(np.einsum("bhqk,bqhd->bkhd", p, do)))


def ring_program(context, zz, grads=True):
    """jit of (q, k, v, do) -> ring output and (dq, dk, dv), all in sequence order, on `context` devices."""
    mesh = Mesh(np.array(jax.devices()[:context]), ("context",))
    ring = jax.shard_map(functools.partial(ring_attention, kernel=KERNEL, zigzag=zz), mesh=mesh,
                         in_specs=(P(None, "context"),) * 3, out_specs=P(None, "context"), check_vma=False)
    there = (lambda x: zigzag(x, context)) if zz else (lambda x: x)
    back = (lambda x: unzigzag(x, context)) if zz else (lambda x: x)

    def run(q, k, v, do):
        o, vjp = jax.vjp(lambda *a: back(ring(*map(there, a))), q, k, v)
        return (o, *vjp(do)) if grads else o
    return jax.jit(run)


def inputs(t, b=2, h=4, kv=2, d=8):
    ks = jax.random.split(jax.random.key(0), 4)
    return (jax.random.normal(ks[0], (b, t, h, d)), jax.random.normal(ks[1], (b, t, kv, d)),
            jax.random.normal(ks[2], (b, t, kv, d)), jax.random.normal(ks[3], (b, t, h, d)))


@pytest.mark.parametrize("context, zz", [(2, True), (4, True), (2, False)], ids=["zigzag-2", "zigzag-4", "contiguous-2"])
def test_ring_attention_equals_full_causal_attention(context, zz):
    """Output and dq, dk, dv of ring attention (GQA 4:2) equal the full sequence's in float64; the
    compiled program's collective-permutes are the ring's: forward C - 1 hops of the K and V blocks,
    backward C - 1 hops of K, V, dK, dV and one of dK, dV home, each one local K (or V) block."""
    q, k, v, do = inputs(8 * context)
    compiled = ring_program(context, zz).lower(q, k, v, do).compile()
    for name, got, want in zip(("out", "dq", "dk", "dv"), compiled(q, k, v, do), attention64(q, k, v, do)):
        err = np.max(np.abs(np.asarray(got, np.float64) - want)) / np.max(np.abs(want))
        assert err < RTOL, (name, err)
    block = k.size // context * k.dtype.itemsize                 # one rank's K (or V) block, bytes
    perms = [c for c in hlo.collectives(compiled.as_text()) if c.kind == "collective-permute"]
    assert len(perms) == 2 * (context - 1) + 4 * (context - 1) + 2
    assert all(c.result_bytes == block for c in perms)


def test_ring_forward_collective_permutes():
    """Forward alone: exactly (C - 1) hops of the K and V blocks, at C = 4."""
    q, k, v, do = inputs(16)
    text = ring_program(4, True, grads=False).lower(q, k, v, do).compile().as_text()
    perms = [c for c in hlo.collectives(text) if c.kind == "collective-permute"]
    assert [c.result_bytes for c in perms] == [k.size // 4 * 4] * (2 * 3)


def _unmasked_pairs(order, context):
    """Unmasked (query, key) pairs of a causal mask that each rank computes when rank r holds the tokens
    order[r*n:(r+1)*n] (their positions)."""
    pos = order.reshape(context, -1)
    return [int((pos[r][:, None] >= order[None, :]).sum()) for r in range(context)]


@pytest.mark.parametrize("context", [2, 4, 8])
def test_zigzag_balances_the_causal_work(context):
    """With zigzag every rank has the same number of unmasked pairs; in contiguous blocks the last rank
    has (2C - 1) / C^2 of them (C = 8: 23%, where 1/C = 12.5% would be balanced); counted over positions."""
    t = 16 * context
    z, plain = _unmasked_pairs(zigzag_order(t, context), context), _unmasked_pairs(np.arange(t), context)
    total = t * (t + 1) // 2
    assert sum(z) == sum(plain) == total and len(set(z)) == 1
    n = t // context
    assert plain[-1] == n * n * (context - 1) + n * (n + 1) // 2 and plain[-1] > 1.4 * total / context
    x = np.arange(3 * t).reshape(3, t)
    assert (unzigzag(zigzag(x, context), context) == x).all() and not (zigzag(x, context) == x).all()
    with pytest.raises(ConfigError, match="2\\*C"):
        zigzag_order(t + 2, context)


def test_mesh_context_axis():
    """make_mesh(spec, context=C): axes (data, fsdp, context[, tensor]), `tensor` innermost; C = 1 is the mesh
    made without it (the same devices in the same places, so the same programs); bad sizes refused."""
    from jfsdp import plan
    devs = jax.devices()
    for spec, t in (("2x8", 1), ("2x4", 2)):
        base, same = jfsdp.make_mesh(spec, tensor=t), jfsdp.make_mesh(spec, tensor=t, context=1)
        assert base == same and base.axis_names == same.axis_names and (base.devices == same.devices).all()
    m = jfsdp.make_mesh("2x2", devices=devs[:16], tensor=2, context=2)
    assert m.axis_names == ("data", "fsdp", "context", "tensor") and dict(m.shape) == {
        "data": 2, "fsdp": 2, "context": 2, "tensor": 2}
    assert (m.devices.reshape(-1) == np.array(devs[:16])).all() and jfsdp.context_size(m) == 2
    assert jfsdp.make_mesh("1x4", devices=devs[:8], context=2).axis_names == ("data", "fsdp", "context")
    spec = jfsdp.MeshSpec(2, 2, tensor=2, context=2)
    assert spec.devices == 16 and spec.describe() == (
        "2x2 --context 2 --tensor 2 (2 replicas x 2 shards x 2 context-parallel ranks x 2 tensor-parallel ranks)")
    spec.check_seq_len(64)
    with pytest.raises(ConfigError, match="multiple of 8"):
        spec.check_seq_len(36)
    with pytest.raises(ConfigError, match="needs 12 devices but 16"):
        jfsdp.make_mesh("1x2", context=3, tensor=2)
    with pytest.raises(ConfigError, match="context-parallel size"):
        jfsdp.make_mesh("1x2", context=0)
    assert plan.main(["--model", "llama-test", "--mesh", "1x2", "--context", "2", "--seq-len", "66"]) == 2
    assert plan.main(["--model", "llama-test", "--mesh", "1x2", "--context", "3", "--seq-len", "64"]) == 2


def test_training_on_1x2_context_2_equals_the_single_device_trainer(tmp_path):
    """jfsdp's Llama (llama-test, GQA 4:2) on mesh 1x2 with context 2 (4 devices; weights sharded over fsdp
    x context, sequences of 16 tokens split in zigzag order, attention as a ring), fp32: 3 AdamW steps give
    the single-device reference's losses (1e-5) and final parameters (the noise floor of
    tests/reference.py); the reference is test_equivalence's, computed once per worker. The data
    loader's part, the zigzag permutation of inputs and targets, is applied here once per batch (without
    it the losses are 2e-3 off and the parameters 0.2). After step 1 the state goes through checkpoints
    saved under C = 2 and C = 1 (round_trip), and steps 2 and 3 run from what was read back, each with 2
    gradient-accumulation micro-batches of 4 rows a device (of 8), reduced once (grad_sync 'once')."""
    from models import factory
    from tests import reference as ref
    from tests.test_equivalence import get_case
    case = get_case("llama")
    model, _, loss_fn = factory.language_model(case["cfg"], "plain")
    batch = case["batches"][0]["inputs"]
    mesh = jfsdp.make_mesh("1x2", devices=jax.devices()[:4], context=2)
    plan = jfsdp.fully_shard(model, mesh, jax.ShapeDtypeStruct(batch.shape, batch.dtype),
                             context_attention=factory.context_kernel(block=4))
    assert plan.layouts["units"]["attention"]["wq"]["kernel"].gather_axes == ("fsdp", "context")
    opt = jfsdp.adamw(ref.LR, b1=ref.B1, b2=ref.B2, eps=ref.EPS, weight_decay=ref.WD, clip_norm=ref.CLIP,
                      mask=plan.decay_mask())
    # step 1 plain, steps 2 and 3 with 2 gradient-accumulation micro-batches reduced once ('every' runs the
    # plain step's program per micro-batch: a train.py run in docs/context-parallel.md, not a compile here)
    accumulating = jfsdp.make_train_step(plan, opt, loss_fn, grad_accum=2, grad_sync="once")
    steps = [jfsdp.make_train_step(plan, opt, loss_fn), accumulating, accumulating]
    state = jfsdp.init_state(plan, opt, params=plan.shard(case["init"]))
    losses = []
    for step, b in zip(steps, case["batches"], strict=True):
        state, m = step(state, jax.device_put({k: zigzag(x, 2) for k, x in b.items()}, plan.batch_sharding))
        losses.append(float(m["loss"]))
        if len(losses) == 1:   # resumed from there: saved at C = 2, read at C = 1, saved at C = 1, read at C = 2
            state = round_trip(tmp_path, plan, state, opt, case, model)
    np.testing.assert_allclose(losses, case["ref_losses"], rtol=1e-5)
    ref.assert_params_close(jax.device_get(plan.gather(state.params)), case["ref_final"], case["init"])


def round_trip(tmp_path, plan, state, opt, case, model):
    """Saved at C = 2 (mesh 1x2 --context 2): the checkpoint holds the parameters and Adam's moments in
    their usual layout, so a plan without a context axis (1x4 on the same devices, C = 1) reads the
    saving plan's gathered state back bit for bit. That state, saved again at C = 1, is read back at
    C = 2: the state to resume from, whose further steps the caller checks against the straight run."""
    from tests import reference as ref
    flat = jfsdp.fully_shard(model, jfsdp.make_mesh("1x4", devices=jax.devices()[:4]), case["batches"][0]["inputs"])
    c = jckpt.Checkpointer(tmp_path, async_save=False)
    c.save(1, state, {"model_config": "llama-test"}, plan=plan)
    c.wait()
    back = c.restore(1, jfsdp.abstract_state(flat, opt), plan=flat)
    saved = jax.device_get(plan.gather(state.params))
    for path, want, got in ref.paired(saved, jax.device_get(flat.gather(back.params))):
        np.testing.assert_array_equal(got, want, err_msg=path)
    # Adam's moments: both plans cut every row range into the same 4 shards, so the arrays compare as they are
    moments = [jax.tree.leaves(jax.device_get(s.opt_state)) for s in (state, back)]
    assert len(moments[0]) == len(moments[1]) > 2 * len(jax.tree.leaves(saved))
    for want, got in zip(*moments):
        np.testing.assert_array_equal(got, want)
    c.save(2, back, {"model_config": "llama-test"}, plan=flat)
    c.wait()
    state = c.restore(2, jfsdp.abstract_state(plan, opt), plan=plan)
    c.close()
    return state


def test_what_context_parallelism_refuses():
    """At C > 1, a one-line ConfigError for what is not supported yet, and for a unit whose attention the ring
    cannot reach (no positions/attend methods: here the residual MLP's)."""
    from models import factory
    cfg = models.get_config("llama-test")
    mesh, kernel = jfsdp.make_mesh("1x2", devices=jax.devices()[:4], context=2), factory.context_kernel(block=4)
    model, _, loss_fn = factory.language_model(cfg, "plain")
    tok = jax.ShapeDtypeStruct((2, 16), np.int32)
    refused = {"needs context_attention=": dict(),
               "strategy no_shard is not supported with context": dict(strategy="no_shard", context_attention=kernel),
               "the prefetch pipeline is not supported with context": dict(prefetch=True, context_attention=kernel)}
    for message, kw in refused.items():
        with pytest.raises(ConfigError, match=message):
            jfsdp.fully_shard(model, mesh, tok, **kw)
    plan = jfsdp.fully_shard(model, mesh, tok, context_attention=kernel)   # 2 rows: one per data x fsdp device
    plan.check_batch({"inputs": np.zeros((2, 16), np.int32)})
    with pytest.raises(ConfigError, match="2\\*C = 4 equal chunks"):
        plan.check_batch({"inputs": np.zeros((2, 18), np.int32)})
    with pytest.raises(ConfigError, match="needs a mesh with a context axis"):
        jfsdp.fully_shard(model, jfsdp.make_mesh("1x2", devices=jax.devices()[:2]), tok, context_attention=kernel)
    with pytest.raises(ConfigError, match="a model given as it is is not supported"):
        jfsdp.fully_shard(model.unit, mesh, {"inputs": tok}, units=type(model.unit), context_attention=kernel)
    mlp_cfg = models.get_config("resmlp-test")
    root, unit, n = models.parts(mlp_cfg)
    x = jax.ShapeDtypeStruct((4, 16, mlp_cfg.in_dim), np.float32)
    plan = jfsdp.fully_shard(jfsdp.Stacked(root, unit, n), mesh, x, context_attention=kernel)
    with pytest.raises(ConfigError, match="attention reachable"):
        jax.eval_shape(plan.apply, plan.abstract_params(), x)


def test_the_data_loader_gives_zigzag_order():
    """Loader(context=C): each batch (training and validation) is the C = 1 batch with every sequence's
    inputs and targets permuted by zigzag_order, so each target stays its input's next token."""
    from jfsdp.io.corpus import Corpus
    from jfsdp.io.data import Loader
    tokens = np.arange(4000, dtype=np.int32)
    corpus = Corpus(tokens[:3000], tokens[3000:], "count", False, 1)
    plain, cp = Loader(corpus, 4, 16, seed=1), Loader(corpus, 4, 16, seed=1, context=2)
    for a, b in [(plain.batch(3), cp.batch(3)), (plain.val_batches(1)[0], cp.val_batches(1)[0])]:
        assert set(a) == set(b) == {"inputs", "targets"}
        for k in a:
            assert (b[k] == zigzag(a[k], 2)).all() and (b[k] != a[k]).any()
        assert (b["targets"] == b["inputs"] + 1).all()
