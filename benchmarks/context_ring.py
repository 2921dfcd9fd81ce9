"""Ring attention (jfsdp/engine/parallel/ring.py) on C fake CPU devices: its error against the whole
sequence's causal GQA attention in float64, beside one device's blockwise attention's (the fp32 floor),
and the collective-permutes of the compiled forward + backward program against the ring's formula.

    python benchmarks/context_ring.py [--contexts 2,4,8] [--seq-len 64] [--dtype bfloat16] [--ring-sums bf16] [--json FILE]
    python benchmarks/context_ring.py --memory llama-small --seq-len 8192 --contexts 1,2,4 [--json FILE]

The second form: the compiled train step's per-device memory (XLA's buffer assignment, fp32, remat full)
of one model on the same N = max(contexts) devices, mesh 1x(N/C) with context C and N/C sequences, so
that every device holds T/C tokens of one sequence while the state stays sharded over all N.

    python benchmarks/context_ring.py --h100 --contexts 4 --seq-len 16384 [--no-context-flags] [--json FILE]

The third form: the ring's forward + backward (bf16, 32 query and 8 K/V heads of 128, one sequence; the
cotangent computed from the output, as in a layer) compiled for an H100 without one
(jfsdp.planning.targets) with jfsdp's GPU flags for C > 1 (`--no-context-flags`: without them), and which
of its collective-permutes XLA's schedule runs while attention computes (jfsdp.planning.hlo.overlap);
"beyond the first hops": exposed ops other than the forward's and the backward's first K/V hop.

Run it also with XLA_FLAGS=--xla_cpu_max_isa=SSE4_2 (docs/numerics.md): the floor must hold on both
sides of an ISA change. docs/context-parallel.md keeps the figures."""
from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--contexts", default="2,4,8")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--block", type=int, default=4, help="the blockwise kernel's block")
    p.add_argument("--memory", default=None, metavar="MODEL", help="the train step's memory instead (a models/ name)")
    p.add_argument("--h100", action="store_true", help="the ring's schedule compiled for an H100 instead")
    p.add_argument("--no-context-flags", action="store_true", help="--h100 without jfsdp's XLA flags for C > 1")
    p.add_argument("--ring-sums", default="fp32", choices=["fp32", "bf16"],
                   help="the ring backward's sums across hops (train.py's --ring-sums)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="q, k, v and the cotangent in this dtype (the float64 reference from the same values)")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    contexts = [int(c) for c in a.contexts.split(",")]
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + f" --xla_force_host_platform_device_count={max(contexts)}").strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    if a.memory:
        return memory(a, contexts)
    if a.h100:
        return h100(a, contexts)
    import jax
    import numpy as np
    from jax.sharding import Mesh, PartitionSpec as P

    from jfsdp.config.sequence import unzigzag, zigzag
    from jfsdp.engine.parallel.context import ring_attention
    from jfsdp.planning import hlo
    from models.attention import blockwise_attention
    from models.factory import context_kernel
    from tests.test_context_parallel import attention64   # the test's float64 reference, without jfsdp

    def inputs(t, b=2, h=4, kv=2, d=8):
        ks = jax.random.split(jax.random.key(0), 4)
        return (jax.random.normal(ks[0], (b, t, h, d)), jax.random.normal(ks[1], (b, t, kv, d)),
                jax.random.normal(ks[2], (b, t, kv, d)), jax.random.normal(ks[3], (b, t, h, d)))

    q, k, v, do = (x.astype(a.dtype) for x in inputs(a.seq_len))
    want = attention64(q, k, v, do)
    rel = lambda got: [float(np.max(np.abs(np.asarray(g, np.float64) - w)) / np.max(np.abs(w)))
                       for g, w in zip(got, want)]

    def single(q, k, v, do):
        o, vjp = jax.vjp(lambda *x: blockwise_attention(*x, block=a.block), q, k, v)
        return (o, *vjp(do))
    rows = [{"C": 1, "mode": "one device, blockwise", "errors": rel(jax.jit(single)(q, k, v, do))}]
    kernel = context_kernel(block=a.block, ring_sums=a.ring_sums)
    for c in contexts:
        mesh = Mesh(np.array(jax.devices()[:c]), ("context",))
        for zz in (True, False):
            ring = jax.shard_map(functools.partial(ring_attention, kernel=kernel, zigzag=zz), mesh=mesh,
                                 in_specs=(P(None, "context"),) * 3, out_specs=P(None, "context"), check_vma=False)
            there, back = ((lambda x: zigzag(x, c)), (lambda x: unzigzag(x, c))) if zz else ((lambda x: x),) * 2

            def run(q, k, v, do):
                o, vjp = jax.vjp(lambda *x: back(ring(*map(there, x))), q, k, v)
                return (o, *vjp(do))
            t0 = time.perf_counter()
            compiled = jax.jit(run).lower(q, k, v, do).compile()
            seconds = time.perf_counter() - t0
            perms = [x for x in hlo.collectives(compiled.as_text()) if x.kind == "collective-permute"]
            block = k.size // c * k.dtype.itemsize
            rows.append({"C": c, "mode": "zigzag" if zz else "contiguous", "errors": rel(compiled(q, k, v, do)),
                         "permutes": len(perms), "permute_bytes": sum(x.result_bytes for x in perms),
                         "formula_permutes": 6 * c - 6, "formula_bytes": (6 * c - 6) * block,
                         "compile_s": round(seconds, 2)})
    print(f"B, T, H, K, D = {q.shape[0]}, {q.shape[1]}, {q.shape[2]}, {k.shape[2]}, {q.shape[3]}; {a.dtype} against float64, "
          f"max |error| / max |float64| of out, dq, dk, dv; XLA_FLAGS={os.environ['XLA_FLAGS']}")
    for r in rows:
        extra = (f"  permutes {r['permutes']} ({r['permute_bytes']:,} B), formula {r['formula_permutes']} "
                 f"({r['formula_bytes']:,} B), compile {r['compile_s']} s" if "permutes" in r else "")
        print(f"C={r['C']} {r['mode']:22} " + " ".join(f"{e:.2e}" for e in r["errors"]) + extra)
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"shape": [*q.shape, k.shape[2]], "dtype": a.dtype, "xla_flags": os.environ["XLA_FLAGS"], "rows": rows}, fh, indent=2)
    return 0


def memory(a, contexts) -> int:
    import jax
    import jax.numpy as jnp

    import jfsdp
    import models
    from jfsdp.planning import hlo
    from models import factory
    n, cfg = max(contexts), models.get_config(a.memory)
    rows = []
    for c in contexts:
        model, _, loss_fn = factory.language_model(cfg, "fused")
        mesh = jfsdp.make_mesh(f"1x{n // c}", context=c)
        tok = jax.ShapeDtypeStruct((n // c, a.seq_len), jnp.int32)
        plan = jfsdp.fully_shard(model, mesh, tok, remat="full",
                                 context_attention=factory.context_kernel() if c > 1 else None)
        opt = jfsdp.adamw(1e-3, mask=plan.decay_mask())
        batch = {k: jax.ShapeDtypeStruct(tok.shape, tok.dtype, sharding=plan.batch_sharding) for k in ("inputs", "targets")}
        compiled = jfsdp.make_train_step(plan, opt, loss_fn).lower(jfsdp.abstract_state(plan, opt), batch).compile()
        m = hlo.memory(compiled)
        rows.append({"C": c, "mesh": f"1x{n // c}", "tokens_per_device": a.seq_len // c, **m})
        print(f"{a.memory} T={a.seq_len} C={c} mesh 1x{n // c} --context {c}: {a.seq_len // c} tokens/device | "
              f"argument {m['argument'] / 2**20:.1f} MiB, temp {m['temp'] / 2**20:.1f} MiB, total {m['total'] / 2**20:.1f} MiB")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"model": a.memory, "seq_len": a.seq_len, "rows": rows}, fh, indent=2)
    return 0


def h100(a, contexts) -> int:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from jfsdp.engine.parallel.context import ring_attention
    from jfsdp.planning import hlo, targets
    from models.factory import context_kernel
    from tests.test_context_parallel import first_hops   # the test's reading of each pass's first hop
    rows, options = [], targets.compiler_options(context=not a.no_context_flags)
    for c in contexts:
        mesh = Mesh(np.array(targets.devices("h100", (1, c))), ("context",))
        ring = jax.shard_map(functools.partial(ring_attention, kernel=context_kernel(block=512)), mesh=mesh,
                             in_specs=(P(None, "context"),) * 3, out_specs=P(None, "context"), check_vma=False)

        def grads(q, k, v, do):
            o, vjp = jax.vjp(ring, q, k, v)
            return vjp(o * do)   # the cotangent exists once the output does, as in a layer
        sh = NamedSharding(mesh, P(None, "context"))
        q = jax.ShapeDtypeStruct((1, a.seq_len, 32, 128), jnp.bfloat16, sharding=sh)
        kv = jax.ShapeDtypeStruct((1, a.seq_len, 8, 128), jnp.bfloat16, sharding=sh)
        with targets.tracing_for("h100"):
            compiled = jax.jit(grads).lower(q, kv, kv, q).compile(compiler_options=options)
        text = compiled.as_text()
        ov = [o for o in hlo.overlap(text, c) if o.collective.kind == "collective-permute"]
        s = hlo.overlap_summary(ov).get("collective-permute", {})
        first = first_hops(text)
        late = [o for o in ov if not o.hidden and o.collective.name not in first]
        rows.append({"C": c, "seq_len": a.seq_len, **s, "exposed_beyond_first_hops_ops": len(late),
                     "exposed_beyond_first_hops_bytes": sum(o.wire_bytes_per_step for o in late), "memory": hlo.memory(compiled)})
        print(f"C={c} T={a.seq_len}: collective-permute ops (XLA:GPU combines some) hidden {s.get('hidden_ops')} "
              f"({s.get('hidden_bytes', 0) / 2**20:.0f} MiB), exposed {s.get('exposed_ops')} "
              f"({s.get('exposed_bytes', 0) / 2**20:.0f} MiB), beyond the first hops {len(late)} "
              f"({rows[-1]['exposed_beyond_first_hops_bytes'] / 2**20:.0f} MiB)")
        print(hlo.render_overlap(ov))
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"target": "h100", "xla_options": options, "rows": rows}, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
