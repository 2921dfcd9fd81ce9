"""jfsdp beside FSDP by sharding annotations alone (GSPMD): the same train step, compiled both ways.

    python benchmarks/gspmd_compare.py --json benchmarks/results/gspmd_compare.json [--full]

The GSPMD side is written here the way the JAX documentation and MaxText do FSDP: the parameters and
Adam's moments are `NamedSharding`s over the `fsdp` axis (replicated over `data`), the batch is split
over both axes, the units run under one `lax.scan` whose body is `jax.checkpoint`ed with the same remat
policy, and the whole step is one `jit`: XLA's SPMD partitioner inserts every collective. Two sharding
rules, each leaf's per-unit dimension:
  - `largest`: the largest dimension that divides by S (the JAX docs' and MaxText's choice);
  - `dim0`: the first dimension (FSDP2's Shard(0)), or the first that divides by S where it does not.
Same model (models/ Llama, as `models.parts` gives it), batch (one row per device), precision (fp32 on
XLA:CPU; bf16 params/compute with fp32 master weights, moments and gradient reduction on the H100 target),
remat, optimizer (`jfsdp.adamw`) and loss (the plain logits loss, `models.loss_fn`) as the jfsdp side,
which is jfsdp's real train step with its defaults (the prefetch pipeline on GPUs for remat full).

Everything is compiled from abstract inputs (nothing allocated at full size): XLA:CPU fake devices
(fp32), and XLA:GPU for an H100 target on this CPU machine (bf16, jfsdp.planning.targets). Per
configuration: per-device memory (memory_analysis), collective bytes sent per device per step by kind
(jfsdp.planning.hlo.per_step), on the GPU schedule the exposed and hidden bytes (hlo.overlap), and the
compile time. `tests/test_gspmd.py` trains a small Llama with `gspmd_train_step` from this file and checks
that it gives jfsdp's losses, so both sides compute the same thing.

The default grid (DEFAULT_GRID, 13 cases) runs in under 20 minutes on a 2-core machine; `--full` runs the
issue's whole grid (llama-1b and -8b x 1x8, 2x4, 1x64 x remat full, dots x XLA:CPU fp32, H100 bf16 x 2048,
8192 tokens: 48 cases), about an hour here. `--only TEXT` keeps the cases whose
"model mesh remat backend seq" contains TEXT.
"""
from __future__ import annotations

import os
import sys

if __name__ == "__main__":   # before jax starts (XLA reads XLA_FLAGS once); imported by the tests as it is
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=64").strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from jfsdp.config.xla_flags import cpu_xla_flags
    os.environ["XLA_FLAGS"] = cpu_xla_flags()   # XLA:CPU's memory-minimizing scheduler, as jfsdp trains on CPU

import argparse  # noqa: E402
import contextlib  # noqa: E402
import dataclasses  # noqa: E402
import datetime  # noqa: E402
import itertools  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import jfsdp  # noqa: E402
import models  # noqa: E402
from jfsdp.config.mesh import AXES, FSDP_AXIS  # noqa: E402
from jfsdp.config.policy import REMAT_POLICIES  # noqa: E402
from jfsdp.planning import hlo, memory, targets  # noqa: E402
from models import factory  # noqa: E402

GiB = 2**30
RULES = ("largest", "dim0")
SIDES = ("jfsdp", "jfsdp-reduce-bf16") + tuple(f"gspmd-{r}" for r in RULES)
KINDS = hlo.KINDS


# ---------------------------------------------------------------- the GSPMD side: annotations alone

def leaf_spec(shape, shards: int, rule: str, stacked: bool) -> P:
    """The PartitionSpec of one parameter (or Adam moment) of `shape`: one per-unit dimension over
    `fsdp` (`rule`: 'largest' divisible dimension, or 'dim0' = FSDP2's Shard(0), falling back to the
    first divisible dimension); replicated where no dimension divides by `shards`. `stacked`: axis 0 is
    the units' stack axis, never sharded (the scan slices it)."""
    off = 1 if stacked else 0
    dims = list(shape[off:])
    ok = [i for i, d in enumerate(dims) if d % shards == 0 and d >= shards]
    spec = [None] * len(shape)
    if shards > 1 and ok:
        if rule == "largest":
            pick = max(ok, key=lambda i: (dims[i], -i))
        elif rule == "dim0":
            pick = ok[0]
        else:
            raise ValueError(f"unknown sharding rule '{rule}'; choose from {', '.join(RULES)}")
        spec[pick + off] = FSDP_AXIS
    return P(*spec)


def abstract_params(cfg):
    """Parameter shapes {'root': ..., 'units': stacked on axis 0}: the tree jfsdp's plan uses (unpadded).
    Traced only (nothing allocated); the shapes do not depend on the batch."""
    root, unit, n = models.parts(cfg)

    def init(k):
        x, h = jnp.zeros((1, 8), jnp.int32), jnp.zeros((1, 8, cfg.dim), jnp.float32)
        k_root, k_units = jax.random.split(k)
        both = lambda m, x, h: (m.embed(x), m.head(h))
        r = root.init(k_root, x, h, method=both)["params"]
        u = jax.vmap(lambda kk: unit.init(kk, h)["params"])(jax.random.split(k_units, n))
        return {"root": r, "units": u}
    return jax.eval_shape(init, jax.random.key(0))


def param_shardings(mesh, shapes, rule: str):
    shards = mesh.shape[FSDP_AXIS]
    spec = lambda stacked: (lambda x: NamedSharding(mesh, leaf_spec(x.shape, shards, rule, stacked)))
    return {"root": jax.tree.map(spec(False), shapes["root"]), "units": jax.tree.map(spec(True), shapes["units"])}


@dataclasses.dataclass(frozen=True)
class GspmdStep:
    """What `gspmd_train_step` returns: the jitted step and the shardings it was made for."""
    step: object          # jitted (state, batch) -> (state, {'loss', 'grad_norm'}), state donated
    state_shardings: object
    batch_sharding: object
    shapes: object        # parameter shapes

    def abstract_state(self, optimizer):
        params = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), self.shapes,
                              self.state_shardings.params)
        opt = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                           jax.eval_shape(optimizer.init, params), self.state_shardings.opt_state)
        return jfsdp.TrainState(jax.ShapeDtypeStruct((), jnp.int32, sharding=self.state_shardings.step), params, opt)

    def place(self, optimizer, params):
        """A train state from full parameters (host or device arrays in the {'root', 'units'} tree)."""
        params = jax.device_put(params, self.state_shardings.params)
        opt = jax.jit(optimizer.init, out_shardings=self.state_shardings.opt_state)(params)
        return jfsdp.TrainState(jax.device_put(jnp.zeros((), jnp.int32), self.state_shardings.step), params, opt)


def gspmd_train_step(cfg, mesh, optimizer, loss_fn, *, rule="largest", remat="full", precision="fp32",
                     head_method="head", donate=True) -> GspmdStep:
    """FSDP by annotations alone: jit(step) with the state sharded by `rule` (`leaf_spec`) over `fsdp`,
    the batch over ('data', 'fsdp'); units under `lax.scan` with `jax.checkpoint(policy=remat)`.
    precision 'bf16': fp32 master parameters and moments; each unit's parameters cast to bf16 inside the
    scan body where it computes (the root's where it is used), the head's outputs cast back to fp32."""
    root, unit, n = models.parts(cfg)
    compute = jnp.bfloat16 if precision == "bf16" else None
    cast = (lambda t: jax.tree.map(lambda x: x.astype(compute), t)) if compute else (lambda t: t)
    batch_sharding = NamedSharding(mesh, P(AXES))
    act = NamedSharding(mesh, P(AXES))   # activations: rows over every device, as the batch
    shapes = abstract_params(cfg)
    policy = getattr(jax.checkpoint_policies, REMAT_POLICIES[remat])

    def forward(params, tokens):
        r = cast(params["root"])
        h = lax.with_sharding_constraint(root.apply({"params": r}, tokens, method="embed"), act)

        def body(h, u):
            return lax.with_sharding_constraint(unit.apply({"params": cast(u)}, h), act)
        body = jax.checkpoint(body, policy=policy, prevent_cse=False)
        h = lax.scan(lambda h, u: (body(h, u), None), h, params["units"])[0]
        out = root.apply({"params": r}, h, method=head_method)
        return jax.tree.map(lambda o: o.astype(jnp.float32), out) if compute and head_method == "head" else out

    def step(state, batch):
        loss, grads = jax.value_and_grad(lambda p: loss_fn(forward(p, batch["inputs"]), batch).astype(jnp.float32))(
            state.params)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        return jfsdp.TrainState(state.step + 1, params, opt_state), {"loss": loss, "grad_norm": optax.tree.norm(grads)}

    p_shard = param_shardings(mesh, shapes, rule)
    replicated = NamedSharding(mesh, P())
    opt_shard = optax.tree_map_params(optimizer, lambda _, s: s, jax.eval_shape(optimizer.init, shapes), p_shard,
                                      transform_non_params=lambda _: replicated)
    shardings = jfsdp.TrainState(replicated, p_shard, opt_shard)
    jitted = jax.jit(step, in_shardings=(shardings, batch_sharding), out_shardings=(shardings, replicated),
                     donate_argnums=(0,) if donate else ())
    return GspmdStep(jitted, shardings, batch_sharding, shapes)


# ---------------------------------------------------------------- compiling both sides

def _mesh(backend, mesh_spec):
    r, s = jfsdp.parse_mesh(mesh_spec)
    devs = targets.devices("h100", mesh_spec) if backend == "h100" else jax.devices()[: r * s]
    return jfsdp.make_mesh(mesh_spec, devs)


def _summary(compiled, n_devices, backend, compile_s) -> dict:
    text = compiled.as_text()
    m = memory.measure(compiled)
    per = hlo.per_step(text, n_devices)
    row = {"compiled_gib": m["total"] / GiB, "argument_gib": m["argument"] / GiB, "temp_gib": m["temp"] / GiB,
           "comm_gib": {k: per.get(k, {}).get("wire_bytes", 0.0) / GiB for k in KINDS},
           "comm_ops": {k: per.get(k, {}).get("count", 0) for k in KINDS},
           "comm_dtypes": {k: sorted({d for c in hlo.collectives(text, n_devices) if c.kind == k
                                      and c.result_bytes > 64 for d in c.dtypes}) for k in KINDS},
           "compile_s": round(compile_s, 1)}
    row["comm_total_gib"] = sum(row["comm_gib"].values())
    if per.get("unknown_loops"):
        row["unknown_loops"] = per["unknown_loops"]
    if backend == "h100":
        ov = hlo.overlap_summary(hlo.overlap(text, n_devices))
        row["exposed_gib"] = {k: v["exposed_bytes"] / GiB for k, v in ov.items()}
        row["hidden_gib"] = {k: v["hidden_bytes"] / GiB for k, v in ov.items()}
        row["exposed_total_gib"] = sum(row["exposed_gib"].values())
        row["hidden_total_gib"] = sum(row["hidden_gib"].values())
    return row


def case_config(model, backend):
    cfg = models.get_config(model)
    return dataclasses.replace(cfg, attention="cudnn") if backend == "h100" else cfg


def compile_jfsdp(model, mesh_spec, remat, backend, seq, reduce_bf16=False, loss="plain") -> dict:
    """jfsdp's train step (FULL_SHARD, its defaults). `reduce_bf16`: gradients reduce-scattered in bf16,
    as the GSPMD side does on its own (the reduction happens in the dtype of the compute there)."""
    cfg, mesh = case_config(model, backend), _mesh(backend, mesh_spec)
    x = jax.ShapeDtypeStruct((mesh.size, seq), jnp.int32)
    precision = "bf16" if backend == "h100" else "fp32"
    stacked, _, loss = factory.language_model(cfg, loss=loss)
    opt, b = jfsdp.adamw(1e-4), {"inputs": x, "targets": x}
    target = "h100" if backend == "h100" else None
    with (targets.tracing_for(target) if target else contextlib.nullcontext()):
        mp = jfsdp.MixedPrecision.parse(precision)
        if reduce_bf16:
            mp = jfsdp.MixedPrecision(param_dtype=jnp.bfloat16, reduce_dtype=jnp.bfloat16, output_dtype=jnp.float32)
        plan = jfsdp.fully_shard(stacked, mesh, x, strategy="full_shard", remat=remat,
                                 mp_policy=mp)
        t = time.time()
        compiled = (targets.compile_step(target, plan, opt, loss, b) if target
                    else memory.compile_step(plan, opt, loss, b))
        compile_s = time.time() - t
    row = _summary(compiled, mesh.size, backend, compile_s)
    row["contract_gib"] = memory.comm_formula(plan, "gpu" if target else "cpu")["contract"] / GiB
    row["prefetch"] = bool(plan.prefetch)
    return row


def compile_gspmd(model, mesh_spec, remat, backend, seq, rule, loss="plain") -> dict:
    cfg, mesh = case_config(model, backend), _mesh(backend, mesh_spec)
    x = jax.ShapeDtypeStruct((mesh.size, seq), jnp.int32)
    stacked, _, loss_fn = factory.language_model(cfg, loss=loss)   # the same loss and head as jfsdp's
    opt = jfsdp.adamw(1e-4)
    precision = "bf16" if backend == "h100" else "fp32"
    target = "h100" if backend == "h100" else None
    with (targets.tracing_for(target) if target else contextlib.nullcontext()):
        g = gspmd_train_step(cfg, mesh, opt, loss_fn, rule=rule, remat=remat, precision=precision,
                             head_method=stacked.head_method)
        b = {k: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=g.batch_sharding) for k in ("inputs", "targets")}
        t = time.time()
        lowered = g.step.lower(g.abstract_state(opt), b)
        # the same XLA:GPU options as jfsdp's plain scan (its collective pipelining flags)
        compiled = lowered.compile(compiler_options=targets.compiler_options()) if target else lowered.compile()
        compile_s = time.time() - t
    return _summary(compiled, mesh.size, backend, compile_s)


# ---------------------------------------------------------------- the grid

@dataclasses.dataclass(frozen=True)
class Case:
    model: str
    mesh: str
    remat: str
    backend: str   # 'cpu' (XLA:CPU fake devices, fp32) or 'h100' (compiled for an H100 target, bf16)
    seq: int
    loss: str = "plain"   # 'plain' (logits, models.loss_fn) or 'fused' (jfsdp.lm_loss: no logits), both sides


def grid(models_, meshes, remats, backends, seqs):
    return [Case(*c) for c in itertools.product(models_, meshes, remats, backends, seqs)]


FULL_GRID = grid(("llama-1b", "llama-8b"), ("1x8", "2x4", "1x64"), ("full", "dots"), ("cpu", "h100"), (2048, 8192))
# What fits in 20 minutes on 2 shared cores (each case is three compiles on XLA:CPU, four on the H100
# target; about a minute a case): every mesh and remat policy of llama-1b on the H100 target at 2048
# tokens, its 8192 tokens on both backends, the torchtitan-like llama-8b at 8192 tokens on 1x8 (remat
# full and dots) and 1x64, and the 8B in fp32 on XLA:CPU once. `--full` runs FULL_GRID (48 cases).
DEFAULT_GRID = (grid(("llama-1b",), ("1x8", "2x4", "1x64"), ("full", "dots"), ("h100",), (2048,))
                + grid(("llama-1b",), ("1x8",), ("full",), ("cpu",), (2048, 8192))
                + grid(("llama-1b",), ("1x8",), ("full",), ("h100",), (8192,))
                + grid(("llama-8b",), ("1x8",), ("full", "dots"), ("h100",), (8192,))
                + grid(("llama-8b",), ("1x64",), ("full",), ("h100",), (8192,))
                + grid(("llama-8b",), ("1x8",), ("full",), ("cpu",), (2048,)))


def run_case(c: Case, log) -> dict:
    row = {"model": c.model, "mesh": c.mesh, "remat": c.remat, "backend": c.backend, "seq": c.seq,
           "batch": jfsdp.parse_mesh(c.mesh)[0] * jfsdp.parse_mesh(c.mesh)[1],
           "precision": "bf16" if c.backend == "h100" else "fp32"}
    row["loss"] = c.loss
    row["jfsdp"] = compile_jfsdp(c.model, c.mesh, c.remat, c.backend, c.seq, loss=c.loss)
    if c.backend == "h100":   # the GSPMD side reduces bf16 gradients: jfsdp doing the same, for the bytes
        row["jfsdp-reduce-bf16"] = compile_jfsdp(c.model, c.mesh, c.remat, c.backend, c.seq, True, c.loss)
    for rule in RULES:
        row[f"gspmd-{rule}"] = compile_gspmd(c.model, c.mesh, c.remat, c.backend, c.seq, rule, c.loss)
    # the better GSPMD rule: the lower per-device memory (the figure FSDP is for)
    row["gspmd_best"] = min(RULES, key=lambda r: row[f"gspmd-{r}"]["compiled_gib"])
    log(row)
    return row


def show(row):
    print(f"\n{row['model']} {row['mesh']} remat {row['remat']} {row['backend']} {row['precision']} "
          f"{row['batch']} x {row['seq']} tokens")
    cols = ["compiled_gib", "comm_total_gib", "exposed_total_gib", "hidden_total_gib", "compile_s"]
    print(f"  {'side':>16}" + "".join(f"{c:>18}" for c in cols) + "   comm by kind (GiB)")
    for side in (s for s in SIDES if s in row):
        r = row[side]
        kinds = ", ".join(f"{k} {v:.2f}" for k, v in r["comm_gib"].items() if v)
        print(f"  {side:>16}" + "".join(f"{r[c]:>18.2f}" if c in r else f"{'-':>18}" for c in cols) + f"   {kinds}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", required=True)
    p.add_argument("--full", action="store_true", help="the issue's whole grid (48 cases; about an hour on 2 cores)")
    p.add_argument("--only", default=None, help="run only cases whose 'model mesh remat backend seq' contains this")
    p.add_argument("--loss", choices=("plain", "fused"), default="plain",
                   help="both sides: the logits loss, or jfsdp's fused head + cross-entropy (models/factory.py)")
    a = p.parse_args(argv)
    t0 = time.time()
    cases = FULL_GRID if a.full else DEFAULT_GRID
    if a.only:
        cases = [c for c in cases if a.only in f"{c.model} {c.mesh} {c.remat} {c.backend} {c.seq}"]
    cases = [dataclasses.replace(c, loss=a.loss) for c in cases]
    out = {"date": datetime.date.today().isoformat(), "jax": jax.__version__,
           "device": f"fp32 rows: XLA:CPU, {jax.device_count()} fake devices; bf16 rows: compiled for an H100 target "
                     "(jfsdp.planning.targets) on a CPU machine, no GPU",
           "command": f"python benchmarks/gspmd_compare.py --json {a.json}" + (" --full" if a.full else "")
                      + (f" --only '{a.only}'" if a.only else "") + (f" --loss {a.loss}" if a.loss != "plain" else ""),
           "optimizer": "jfsdp.adamw(1e-4)", "loss": a.loss,
           "gspmd_rules": {"largest": "largest divisible per-unit dimension over fsdp",
                           "dim0": "first per-unit dimension over fsdp (FSDP2 Shard(0))"},
           "xla_options_h100": targets.compiler_options(), "cases": []}

    def save():
        out["wall_s"] = round(time.time() - t0, 1)
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        with open(a.json, "w") as fh:
            json.dump(out, fh, indent=2, default=float)
    for c in cases:
        out["cases"].append(run_case(c, show))
        save()
    save()
    print(f"\n(wall {out['wall_s']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
