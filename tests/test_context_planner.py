"""The planner under context parallelism (C > 1; docs/planner.md, docs/context-parallel.md): on the same 4
devices, one sequence of T tokens per data x fsdp rank (mesh 1x(4/C), --context C, 4/C sequences), so that
every device holds T/C tokens and the state stays sharded over all 4. Against XLA's compiled train step:
the units' kept activations (the forward scan's stacked unit inputs) hold T/C tokens and fall as 1/C, the
step's temporaries fall with C, the planner's estimate is within 10% of the compiled total at C = 1, 2 and
4, and the ring's collective-permutes over `context` carry exactly the bytes of its formula
(jfsdp/planning/context_plan.py: 2(C - 1) K/V blocks forward, again in remat's recompute, 2(C - 1) K/V and
2C fp32 gradient blocks backward per unit)."""
import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

import jfsdp
import models
from jfsdp.planning import context_plan, memory, report
from jfsdp.config.xla_flags import cpu_xla_flags
from models import factory
from tests.compile_flags import FAST

REPO = Path(__file__).resolve().parents[1]

# 2 units, wide enough that a unit's activations outweigh the state (1.5 MiB of unit input per 1,024
# tokens); blockwise attention at every C (XLA's reference keeps T x T scores); the ring's per-block kernel
# in blocks of 64 so that a hop loops over several tiles, as at long sequences
CFG = dataclasses.replace(models.get_config("llama-test"), dim=384, ffn_dim=1024, n_layers=2, n_heads=6,
                          n_kv_heads=2, attention="blockwise")
SEQ, DEVICES = 1024, 4


def _plan(context: int):
    model, _, loss_fn = factory.language_model(CFG, "fused")
    rows = DEVICES // context
    mesh = jfsdp.make_mesh(f"1x{rows}", jax.devices()[:DEVICES], context=context)
    x = jax.ShapeDtypeStruct((rows, SEQ), jnp.int32)
    plan = jfsdp.fully_shard(model, mesh, x, remat="full", mp_policy=jfsdp.MixedPrecision.parse("fp32"),
                             context_attention=factory.context_kernel(64) if context > 1 else None)
    return plan, jfsdp.adamw(1e-3), loss_fn, {"inputs": x, "targets": x}


def _kept(hlo_text: str, tokens: int) -> bool:
    """Whether the program holds a stacked buffer of every unit's input, (units, 1 row, tokens, dim) fp32."""
    return re.search(rf"f32\[{CFG.n_layers},1,{tokens},{CFG.dim}\]", hlo_text) is not None


def measure() -> list:
    """[{context, kept (T/C, T), estimate, total, temp, ring compiled, ring formula}] at C = 1, 2, 4, compiled
    with the planner's XLA:CPU flags (its memory-minimizing scheduler: jfsdp.config.xla_flags.CPU_FLAGS)."""
    out = []
    for c in (1, 2, 4):
        plan, opt, loss_fn, batch = _plan(c)
        compiled = memory.compile_step(plan, opt, loss_fn, batch)
        text, m = compiled.as_text(), memory.measure(compiled)
        formula = memory.comm_formula(plan, backend="cpu", batch=batch)
        out.append({"context": c, "kept": [_kept(text, SEQ // c), _kept(text, SEQ)], "total": m["total"],
                    "temp": m["temp"], "estimate": memory.estimate(plan, opt, loss_fn, batch, backend="cpu").total,
                    "ring": report.ring_compiled(text, plan), "formula": formula.get("collective-permute"),
                    "ring_bytes": context_plan.ring_bytes(plan, batch, "cpu")})
        jax.clear_caches()
    return out


def test_kept_activations_fall_as_1_over_c_and_the_estimate_and_ring_formula_hold():
    # the planner's compile flags must be set before jax starts: in a process of its own
    flags = cpu_xla_flags(f"--xla_force_host_platform_device_count={DEVICES} {FAST}")
    r = subprocess.run([sys.executable, "-c", "import json, tests.test_context_planner as t; print(json.dumps(t.measure()))"],
                       capture_output=True, text=True, cwd=REPO, timeout=600,
                       env={**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO)})
    assert r.returncode == 0, r.stderr[-3000:]
    rows = {x["context"]: x for x in json.loads(r.stdout.strip().splitlines()[-1])}
    for c, x in rows.items():
        # the units' kept inputs: T/C tokens per device, never the whole sequence
        assert x["kept"] == [True, c == 1], x
        assert x["estimate"] == pytest.approx(x["total"], rel=0.10), x
        if c == 1:
            assert x["ring"] == 0 and x["formula"] is None, x
        else:   # the ring's collective-permutes over `context`: exactly the formula's bytes
            assert x["ring"] > 0 and x["ring"] == x["formula"] == x["ring_bytes"], x
    temps = {c: x["temp"] for c, x in rows.items()}
    # the temporaries fall with C; the part that does not (gathered units, gradient shards: the same 4
    # shards at every C) is at most a third of C = 1's
    assert temps[1] > temps[2] > temps[4]
    fixed = 2 * temps[4] - temps[2]      # temp = fixed + A / C, from C = 2 and 4
    assert 0 <= fixed < temps[1] / 3, temps
    assert temps[1] - fixed == pytest.approx(2 * (temps[2] - fixed), rel=0.10), temps


def test_the_gpu_ring_term_leaves_out_the_hidden_states_fp32_copies():
    """On XLA:GPU the ring's part of the estimate (context_plan.ring_buffers) is two (B, T/C, H, D) buffers in the
    sums' dtype and 1.25 in fp32, less the fp32 copies of the hidden state that the traced working set counts
    (`widened_bytes`). Counted by hand for a bf16 Llama unit: its two RMSNorms each keep their input widened
    to fp32 and its product with the rsqrt, four (B, T/C, dim) fp32 arrays; fp32 compute widens nothing."""
    from jfsdp.config.policy import MixedPrecision
    c, rows = 2, DEVICES // 2
    model, _, _ = factory.language_model(CFG, "fused")
    mesh = jfsdp.make_mesh(f"1x{rows}", jax.devices()[:DEVICES], context=c)
    x = jax.ShapeDtypeStruct((rows, SEQ), jnp.int32)
    for sums, itemsize in (("fp32", 4), ("bf16", 2)):
        plan = jfsdp.fully_shard(model, mesh, x, remat="full", mp_policy=MixedPrecision.parse("bf16"),
                                 context_attention=factory.context_kernel(64, ring_sums=sums))
        local = {"inputs": jax.ShapeDtypeStruct((1, SEQ // c), jnp.int32)}
        hidden = SEQ // c * CFG.dim          # one row of T/C tokens per device
        assert context_plan.widened_bytes(plan, local, jnp.bfloat16) == 4 * hidden * 4
        assert context_plan.widened_bytes(plan, local, jnp.float32) == 0
        assert context_plan.ring_buffers(plan, local, "gpu") == (2 * itemsize + 5 - 16) * hidden
