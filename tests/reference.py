"""A plain single-device trainer written without jfsdp: the reference the engine must match.

It uses only the model modules, jax.grad and optax: embed, a Python loop over the units, head,
loss; global-norm clipping and AdamW on whole parameters; gradient accumulation over micro-batches
(`accumulated`). Mixed precision is modelled the obvious way: parameters cast to param_dtype for the
forward pass, the output cast to output_dtype, gradients taken with respect to the fp32 parameters.
Trees are compared through `paired`, which refuses two trees whose leaves differ.
"""
from __future__ import annotations

import contextlib

import flax.linen as nn
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax

# Adam's eps is 1e-6, not 1e-8: an element whose gradient is below eps gets an update of about
# lr * g / eps, so eps = 1e-8 turns the float noise of a summation order (1e-7 of the leaf's largest
# gradient, measured) into parameter differences above 1e-4. Gradients themselves are compared
# directly in test_gradients_match.
LR, B1, B2, EPS, WD, CLIP = 3e-3, 0.9, 0.95, 1e-6, 0.1, 1.0


def init_params(root, unit, n_units, inputs, seed=0):
    """Independent initialization: root and each unit from their own keys, units stacked on axis 0."""
    keys = jax.random.split(jax.random.key(seed), n_units + 1)
    root_p = root.init(keys[0], inputs, method=lambda m, x: m.head(m.embed(x)))["params"]
    h = root.apply({"params": root_p}, inputs, method="embed")
    units = [unit.init(k, h)["params"] for k in keys[1:]]
    return {"root": root_p, "units": jax.tree.map(lambda *xs: jnp.stack(xs), *units)}


def token_batches(vocab, steps, batch, seq, seed=0):
    """`steps` batches of random tokens: inputs and their next-token targets."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        x = rng.integers(0, vocab, (batch, seq + 1)).astype(np.int32)
        out.append({"inputs": x[:, :-1], "targets": x[:, 1:]})
    return out


def optimizer():
    # decay matrices only: ndim >= 2 per unit (stacked unit leaves carry one more axis)
    mask = lambda p: {"root": jax.tree.map(lambda x: x.ndim >= 2, p["root"]),
                      "units": jax.tree.map(lambda x: x.ndim >= 3, p["units"])}
    return optax.chain(optax.clip_by_global_norm(CLIP), optax.adamw(LR, b1=B1, b2=B2, eps=EPS, weight_decay=WD, mask=mask))


def forward(root, unit, params, inputs, param_dtype=None, output_dtype=None, head="head", unit_interceptor=None):
    """The model's outputs; `unit_interceptor` (a Linen method interceptor such as `float8_dense`) runs
    around every unit's call."""
    p = jax.tree.map(lambda x: x.astype(param_dtype), params) if param_dtype else params
    h = root.apply({"params": p["root"]}, inputs, method="embed")
    n = jax.tree.leaves(p["units"])[0].shape[0]
    for i in range(n):
        with nn.intercept_methods(unit_interceptor) if unit_interceptor else contextlib.nullcontext():
            h = unit.apply({"params": jax.tree.map(lambda x: x[i], p["units"])}, h)
    out = root.apply({"params": p["root"]}, h, method=head)
    return jax.tree.map(lambda x: x.astype(output_dtype), out) if output_dtype else out


def accumulated(loss, chunks):
    """(params, batch) -> (loss, gradients) of gradient accumulation, in plain JAX: the batch's leading
    axis split in order into `chunks` equal micro-batches, each one's loss and gradient taken on its own
    (a `lax.scan`, so each micro-batch is a separate computation: a float8 cast scales by its own
    micro-batch's amax), added up and divided by `chunks`. jfsdp's micro-batch i on device d is rows
    [(d * k + i) * m, (d * k + i + 1) * m) of the global batch (each device's rows split in k), so
    chunks = devices x k gives the same micro-batches."""
    vg = jax.value_and_grad(loss)
    if chunks == 1:
        return vg

    def f(params, batch):
        mbs = jax.tree.map(lambda x: x.reshape(chunks, x.shape[0] // chunks, *x.shape[1:]), batch)

        def add(carry, mb):
            value, grads = vg(params, mb)
            return (carry[0] + value, jax.tree.map(jnp.add, carry[1], grads)), None
        zero = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, params))
        (value, grads), _ = jax.lax.scan(add, zero, mbs)
        return value / chunks, jax.tree.map(lambda g: g / chunks, grads)
    return f


def run_steps(opt, loss, params, batches, chunks=1):
    """Optimizer steps on one device, `loss(params, batch)` -> scalar; returns (losses, final params,
    first-step gradients). With chunks > 1 each step accumulates the gradients of that many
    micro-batches (`accumulated`). The one training loop of the references."""
    state = opt.init(params)
    vg = accumulated(loss, chunks)

    @jax.jit
    def step(params, state, batch):
        value, grads = vg(params, batch)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state, value, grads

    losses, first = [], None
    for batch in batches:
        params, state, value, grads = step(params, state, batch)
        losses.append(float(value))
        first = grads if first is None else first
    return losses, params, first


def train(root, unit, loss_fn, params, batches, param_dtype=None, output_dtype=None):
    """Steps of AdamW on one device; returns (losses, final params)."""
    loss = lambda p, batch: loss_fn(forward(root, unit, p, batch["inputs"], param_dtype, output_dtype), batch)
    return run_steps(optimizer(), loss, params, batches)[:2]


# ---- models of several stages: {'root': ..., 'stages': [units of stage j stacked on axis 0, ...]}

def init_staged(root, stages, inputs, seed=0):
    """Independent initialization of a staged model: root and every unit from their own keys. The
    root's head is initialized on h as the last stage leaves it (the width may change between stages).
    One jitted program (eager Flax init dispatches op by op, which is slow)."""
    @jax.jit
    def init(key):
        keys = iter(jax.random.split(key, 1 + sum(n for _, n in stages)))
        root_key = next(keys)
        emb = root.init(root_key, inputs, method="embed")["params"]
        h = root.apply({"params": emb}, inputs, method="embed")
        out = []
        for unit, n in stages:
            units = [unit.init(next(keys), h)["params"] for _ in range(n)]
            h = unit.apply({"params": units[0]}, h)
            out.append(jax.tree.map(lambda *xs: jnp.stack(xs), *units))
        root_p = root.init(root_key, inputs, h, method=lambda m, x, h: (m.embed(x), m.head(h)))["params"]
        return {"root": root_p, "stages": out}
    return init(jax.random.key(seed))


def staged_optimizer():
    # decay matrices only: ndim >= 2 per unit, so ndim >= 3 for the stacked stage leaves
    mask = lambda p: {"root": jax.tree.map(lambda x: x.ndim >= 2, p["root"]),
                      "stages": [jax.tree.map(lambda x: x.ndim >= 3, s) for s in p["stages"]]}
    return optax.chain(optax.clip_by_global_norm(CLIP), optax.adamw(LR, b1=B1, b2=B2, eps=EPS, weight_decay=WD, mask=mask))


def forward_staged(root, units, params, inputs, param_dtype=None, output_dtype=None):
    p = jax.tree.map(lambda x: x.astype(param_dtype), params) if param_dtype else params
    h = root.apply({"params": p["root"]}, inputs, method="embed")
    for unit, stacked in zip(units, p["stages"]):
        for i in range(jax.tree.leaves(stacked)[0].shape[0]):
            h = unit.apply({"params": jax.tree.map(lambda x: x[i], stacked)}, h)
    out = root.apply({"params": p["root"]}, h, method="head")
    return out.astype(output_dtype) if output_dtype else out


def train_staged(root, units, loss_fn, params, batches, param_dtype=None, output_dtype=None):
    """Steps of AdamW on one device for a staged model; returns (losses, final params, first-step
    gradients)."""
    loss = lambda p, batch: loss_fn(forward_staged(root, units, p, batch["inputs"], param_dtype, output_dtype), batch)
    return run_steps(staged_optimizer(), loss, params, batches)


def keep_gradients():
    """An optax stage that passes gradients through and keeps the first step's in its state (placed
    like the parameters; `opt_state[k][0]` where it is stage k of a chain): the gradients of jfsdp's
    own train step, read without compiling a second program. Its init returns what it is given
    where that is not an array, so that optax.tree_map_params (with which jfsdp places optimizer
    state) sees a parameter tree there."""
    def init(params):
        return jax.tree.map(lambda x: x * 0 if hasattr(x, "dtype") else x, params), jnp.zeros((), jnp.int32)

    def update(updates, state, params=None):
        kept, count = state
        kept = jax.tree.map(lambda k, u: jnp.where(count == 0, u, k), kept, updates)
        return updates, (kept, count + 1)
    return optax.GradientTransformation(init, update)


# ---- comparing trees: every comparison pairs leaves through `paired`, which first asserts that the trees
# have the same leaves (key paths, in order), so that a leaf one tree lacks is an error, not skipped

def paired(want, *others):
    """[(path string, want's leaf, each other tree's leaf), ...] after asserting that every tree in
    `others` has exactly want's key paths in want's order (dicts, FrozenDicts and NNX pure dicts
    compare by their keys)."""
    flat = jax.tree_util.tree_flatten_with_path(want)[0]
    paths = [jax.tree_util.keystr(p) for p, _ in flat]
    rows = [[leaf] for _, leaf in flat]
    for i, other in enumerate(others):
        got = jax.tree_util.tree_flatten_with_path(other)[0]
        names = [jax.tree_util.keystr(p) for p, _ in got]
        if names != paths:
            missing, extra = sorted(set(paths) - set(names)), sorted(set(names) - set(paths))
            raise AssertionError(f"tree {i + 1} does not have the reference's leaves: missing {missing[:5]}, "
                                 f"extra {extra[:5]}" + ("" if missing or extra else ", order differs"))
        for row, (_, leaf) in zip(rows, got):
            row.append(leaf)
    return [(p, *row) for p, row in zip(paths, rows)]


def close(got, want, rtol, what, atol=0.0):
    """Every leaf of `got` within rtol of `want`'s largest magnitude (+ atol), named on failure; the
    two trees must have the same leaves."""
    for path, w, g in paired(want, got):
        assert np.shape(g) == np.shape(w), path
        err = np.max(np.abs(np.asarray(g, np.float64) - w))
        assert err <= rtol * np.max(np.abs(w)) + atol, f"{what}{path}: max error {err:.3g}"


# ---- the parameters' tolerance. docs/numerics.md says how each of the tests' tolerances was derived
# from a measured noise floor (the reference against itself with the batch split into micro-batches,
# natively and under --xla_cpu_max_isa), how far above that floor it sits and how far below the error
# of a real bug; `python -m tests.noise_floor` re-measures both.
# Parameters after n AdamW steps: PARAM_RTOL of each leaf's largest magnitude, plus param_atol(n).
# Adam divides each gradient element by its own running magnitude (+ EPS), so an element whose
# gradient is near EPS turns summation-order noise in the gradient into an update difference that
# is a fraction of lr, whatever the leaf's scale: that part of the floor is measured in units of
# n x lr. Worst floor measured: 2.8e-3 n lr (the untied embedding of test_fused_head, whose rows get
# gradient only from the tokens that occur), so PARAM_ATOL_LR is 1e-2.
PARAM_RTOL, PARAM_ATOL_LR = 1e-4, 1e-2


def param_atol(steps, lr=LR):
    """The absolute part of the parameter tolerance after `steps` AdamW steps of learning rate lr."""
    return PARAM_ATOL_LR * steps * lr


PARAM_ATOL = param_atol(3)   # the 3-step tests


def assert_params_close(got, want, before, rtol=PARAM_RTOL):
    """Per leaf: max |got - want| <= rtol * max |want| + PARAM_ATOL (the Adam-amplified part of the noise
    floor after 3 steps); and the steps moved the parameters (so the comparison is not between two
    untouched initializations)."""
    moved = 0.0
    for path, w, g, b in paired(want, got, before):   # the same leaves in all three, or an error
        err = np.max(np.abs(np.asarray(g, np.float64) - w))
        assert err <= rtol * np.max(np.abs(w)) + PARAM_ATOL, f"{path}: max error {err:.3g}"
        moved = max(moved, np.max(np.abs(w - b)))
    assert moved > 1e-3, "reference parameters did not move; the comparison would prove nothing"


def assert_updates_close(got, want, before, rtol, label=""):
    """Per leaf: the update (after - before) of `got` within `rtol` of `want`'s in L2 (the bf16 checks:
    docs/numerics.md); the same leaves in all three, or an error."""
    for path, w, g, b in paired(want, got, before):
        du, dw = np.asarray(g, np.float64) - b, np.asarray(w, np.float64) - b
        err = np.linalg.norm(du - dw) / np.linalg.norm(dw)
        assert err <= rtol, f"{label}{path}: update differs by {err:.3f} in L2"


# ---- float8 (docs/float8.md's recipe: tensorwise dynamic scaling, e4m3 forward, e5m2 gradients), written
# without jfsdp: a matmul whose operands are rounded to float8 with their own amax scale and computed in fp32

def float8_round(x, dtype):
    """x rounded to `dtype` (a float8 type) with the tensorwise scale fmax / amax(x), back in fp32."""
    m = float(jnp.finfo(dtype).max)
    s = m / jnp.maximum(jnp.max(jnp.abs(x)).astype(jnp.float32), 1e-12)
    return jnp.clip(x.astype(jnp.float32) * s, -m, m).astype(dtype).astype(jnp.float32) / s


@jax.custom_vjp
def float8_matmul(x, k):
    """x (..., K) @ k (K, N): both operands in e4m3, the product in x's dtype."""
    return (float8_round(x, jnp.float8_e4m3fn) @ float8_round(k, jnp.float8_e4m3fn)).astype(x.dtype)


def _float8_matmul_fwd(x, k):
    return float8_matmul(x, k), (x, k)


def _float8_matmul_bwd(res, g):
    x, k = res
    g8, x8, k8 = (float8_round(g, jnp.float8_e5m2), float8_round(x, jnp.float8_e4m3fn),
                  float8_round(k, jnp.float8_e4m3fn))
    dk = x8.reshape(-1, x.shape[-1]).T @ g8.reshape(-1, g.shape[-1])
    return (g8 @ k8.T).astype(x.dtype), dk.astype(x.dtype).astype(k.dtype)   # dk in the compute dtype


float8_matmul.defvjp(_float8_matmul_fwd, _float8_matmul_bwd)


# ---- float8, rowwise (docs/float8.md, rowwise scaling): e4m3 everywhere, a power-of-two scale per slice
# along each product's contracted axis, fp32 accumulation, output and dX in x's dtype, dW in k's
def rowwise_round(a, axis):
    """a rounded to e4m3 with a power-of-two scale per slice along `axis` (the largest not above 448/amax)."""
    fmax = 448.0
    amax = jnp.max(jnp.abs(a.astype(jnp.float32)), axis=axis, keepdims=True)
    s = 2.0 ** jnp.floor(jnp.log2(fmax / jnp.maximum(amax, 1e-12)))
    s = jnp.where(s * amax > fmax, s / 2, jnp.where(2 * s * amax <= fmax, 2 * s, s))   # log2's own rounding
    return jnp.clip(a.astype(jnp.float32) * s, -fmax, fmax).astype(jnp.float8_e4m3fn).astype(jnp.float32) / s


@jax.custom_vjp
def rowwise_matmul(x, k):
    """x (..., K) @ k (K, N): x scaled per row, k per column."""
    return (rowwise_round(x, -1) @ rowwise_round(k, 0)).astype(x.dtype)


def _rowwise_matmul_fwd(x, k):
    return rowwise_matmul(x, k), (x, k)


def _rowwise_matmul_bwd(res, g):
    x, k = res
    dx = rowwise_round(g, -1) @ rowwise_round(k, 1).T
    x2, g2 = x.reshape(-1, x.shape[-1]), g.reshape(-1, g.shape[-1])
    return dx.astype(x.dtype), (rowwise_round(x2, 0).T @ rowwise_round(g2, 0)).astype(k.dtype)


rowwise_matmul.defvjp(_rowwise_matmul_fwd, _rowwise_matmul_bwd)


def float8_dense(in_unit, matmul=None):
    """A Linen method interceptor: every `nn.Dense` whose module path satisfies `in_unit` (a predicate on
    the path tuple) runs `matmul` (`float8_matmul`, tensorwise, by default; `rowwise_matmul`) plus its
    bias; everything else as written."""
    matmul = matmul or float8_matmul

    def intercept(next_fun, args, kwargs, context):
        mod = context.module
        if context.method_name == "__call__" and isinstance(mod, nn.Dense) and in_unit(mod.path):
            y = matmul(args[0], mod.get_variable("params", "kernel"))
            return y + mod.get_variable("params", "bias").astype(y.dtype) if mod.use_bias else y
        return next_fun(*args, **kwargs)
    return intercept


def float8_linear(self, x, matmul=None):
    """`nnx.Linear.__call__` in float8, tensorwise (`matmul`, default float8_matmul); a test patches it in
    with monkeypatch for the reference."""
    y = (matmul or float8_matmul)(x, self.kernel[...])
    return y + self.bias[...].astype(y.dtype) if self.bias is not None else y


def leaf_errors(got, want):
    """{path: L2 of got - want over L2 of want} per leaf (float64)."""
    return {p: np.linalg.norm(np.asarray(g, np.float64) - w) / np.linalg.norm(w) for p, w, g in paired(want, got)}


def total_error(got, want):
    """L2 of got - want over L2 of want, over all leaves together (float64)."""
    pairs = [(np.asarray(g, np.float64), np.asarray(w, np.float64)) for _, w, g in paired(want, got)]
    return float(np.sqrt(sum(np.sum((g - w) ** 2) for g, w in pairs) / sum(np.sum(w ** 2) for _, w in pairs)))


class ScanBlock(nnx.Module):
    """A residual layer norm + linear block, for NNX models that scan their layers."""

    def __init__(self, rngs, width=16):
        self.norm, self.linear = nnx.LayerNorm(width, rngs=rngs), nnx.Linear(width, width, rngs=rngs)

    def __call__(self, x):
        return x + self.linear(self.norm(x))


class ScanModel(nnx.Module):
    """An NNX model whose layers are made with nnx.vmap (parameters stacked on a layer axis) and run by
    nnx.scan: what jfsdp must take as it is, scan kept (tests/test_any_model.py, test_float8_any_model.py)."""

    def __init__(self, n, rngs, width=16, gated=False):
        self.embed = nnx.Embed(13, width, rngs=rngs)

        @nnx.split_rngs(splits=n)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make(rngs):
            return ScanBlock(rngs, width)
        self.layers = make(rngs)
        # gated: a root parameter that the scan's body reads from outside it (a value it closes over)
        self.gate = nnx.Param(jax.random.normal(rngs.params(), (width,))) if gated else None

    def __call__(self, tokens):
        gate = None if self.gate is None else jnp.tanh(self.gate[...])

        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def body(h, layer):
            return layer(h) if gate is None else layer(h) * gate
        return self.embed.attend(body(self.embed(tokens), self.layers))


# ---- bf16 compute, seen in the model's outputs (docs/numerics.md, "bf16 compute"). The engine's forward
# pass (`plan.apply`) from the initial parameters against the reference's forward in bf16 and in fp32,
# elementwise over all outputs: no gradient summed in another order, no Adam to amplify a difference, and
# thousands of elements rather than one loss whose rounding errors may cancel. Both programs are compiled
# with every bf16 rounding they ask for kept (`run_exact`): by default XLA:CPU drops some inside its
# fusions (excess precision), differently in every program, and that alone moved llama-test's bf16
# outputs by 0.5% and the two-stage model's by 0.9%, as far as bf16 is from fp32. With the roundings
# kept, the engine's bf16 outputs equal the bf16 reference's bit for bit (llama-test on 2x8, the
# two-stage model on 1x8: 0.0), and lie 0.27-1.0% in L2 from the fp32 ones; the fp32 reference against
# itself on 2 to 16 row splits moves them by at most 5.0e-7. An engine that gathered in bf16 and
# computed in fp32 lands 0.50% (llama-test) and 0.93% (two stages) from the bf16 reference, 50 and 90
# tolerances. Models whose inputs or ops promote bf16 weights to fp32 (resmlp-test's float inputs, the
# examples' Linen and NNX decoders) compute in fp32 under the policy in the reference as in the engine:
# there the check sees the weights' bf16 rounding (0.27-0.5%), not the compute dtype.
EXACT_BF16 = {"xla_allow_excess_precision": False}
FP32_OUT_FLOOR = 1e-6         # fp32 outputs, L2: measured 2.5-5.0e-7 (python -m tests.noise_floor bf16-compute)
BF16_OUT_RTOL = 1e-4          # the bf16 engine's outputs against the bf16 reference's, L2
BF16_SEPARATION = 10          # the bf16 reference's outputs lie this many tolerances from the fp32 ones


def run_exact(f, *args):
    """f(*args), jitted and compiled with every bf16 rounding it asks for kept (EXACT_BF16)."""
    return jax.device_get(jax.jit(f).lower(*args).compile(EXACT_BF16)(*args))


def rel_l2(got, want):
    """L2 of got - want over L2 of want, over all leaves together (float64)."""
    flat = lambda t: np.concatenate([np.asarray(x, np.float64).ravel() for x in jax.tree.leaves(t)])
    g, w = flat(got), flat(want)
    assert g.shape == w.shape, (g.shape, w.shape)
    return float(np.linalg.norm(g - w) / np.linalg.norm(w))


def assert_bf16_outputs(got, want, fp32, what=""):
    """`got`: the engine's outputs under the bf16 policy; `want`: the single-device bf16 reference's;
    `fp32`: the fp32 reference's, for the same parameters and inputs, each from `run_exact`. The two
    references must lie more than 10 fp32 floors and BF16_SEPARATION tolerances apart (else the
    comparison could not tell bf16 from fp32), and the engine within BF16_OUT_RTOL of the bf16 one."""
    gap, err = rel_l2(want, fp32), rel_l2(got, want)
    assert gap > max(10 * FP32_OUT_FLOOR, BF16_SEPARATION * BF16_OUT_RTOL), f"{what}: bf16 and fp32 only {gap:.2e} apart"
    assert err <= BF16_OUT_RTOL, f"{what}: outputs {err:.2e} from the bf16 reference's ({gap:.2e} from fp32's)"
