"""The ring's cuDNN per-block kernel (models/attention_cudnn.py) on one NVIDIA GPU: its numbers and its speed.

    python benchmarks/context_cudnn.py [--contexts 2,4,8] [--seq-len 1024] [--speed-seq 32768] [--json FILE]

One GPU holds one device, so the ring's C ranks run as a `vmap` axis named `context` (ring.py's
`ppermute` and `axis_index` batched over it): the same per-rank program, its forward and backward, with
every hop a permutation of the batched blocks. What it measures:
- errors: out, dq, dk, dv of the ring (GQA 8:2, head dim 64, bf16 inputs; zigzag and contiguous) against the
  whole sequence's causal attention in float64 from the same bf16 values, max |error| / max |float64|, with
  the cuDNN kernel and with the blockwise kernel (block 64), beside one device's cuDNN attention
  (jax.nn.dot_product_attention, implementation "cudnn") and one device's blockwise attention: the bf16 floors.
  A wrong log-sum-exp (a base or scale other than the merge's) or a backward that used the block's own
  statistics instead of the merged ones is an error of order 1.
- speed: forward + backward of the ring at llama-8b's heads (32 query, 8 K/V, 128), one sequence of
  --speed-seq tokens over C = 4 on the one GPU (so each rank's work runs one after the other: a time per
  step of all ranks, not a multi-GPU step), cuDNN kernel against blockwise, and one device's cuDNN attention
  over the whole sequence; XLA's temporaries of each program.
Needs a CUDA device (run by benchmarks/one_gpu.sh's context part); docs/context-parallel.md keeps the figures."""
from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def ranks_program(c, zz, kernel):
    """jit of (q, k, v, do), whole sequences (B, T, ...) -> ring output and (dq, dk, dv), in sequence order,
    the C ranks as a vmap axis."""
    import jax
    import jax.numpy as jnp

    from jfsdp.config.sequence import unzigzag, zigzag
    from jfsdp.engine.parallel.ring import ring_attention

    def split(x):   # (B, T, ...) -> (C, B, T/C, ...)
        return jnp.moveaxis(x.reshape(x.shape[0], c, x.shape[1] // c, *x.shape[2:]), 1, 0)

    def join(x):
        return jnp.moveaxis(x, 0, 1).reshape(x.shape[1], -1, *x.shape[3:])
    there = (lambda x: zigzag(x, c)) if zz else (lambda x: x)
    back = (lambda x: unzigzag(x, c)) if zz else (lambda x: x)

    def rank(q, k, v, do):
        o, vjp = jax.vjp(functools.partial(ring_attention, kernel=kernel, zigzag=zz), q, k, v)
        return (o, *vjp(do))
    ranks = jax.vmap(rank, axis_name="context")
    return jax.jit(lambda *a: tuple(back(join(x)) for x in ranks(*(split(there(x)) for x in a))))


def one_device_program(impl):
    import jax
    from models.attention import blockwise_attention

    def f(q, k, v):
        if impl == "blockwise":
            return blockwise_attention(q, k, v, causal=True, block=64)
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")

    def run(q, k, v, do):
        o, vjp = jax.vjp(f, q, k, v)
        return (o, *vjp(do))
    return jax.jit(run)


def inputs(t, b, h, kv, d, dtype):
    """The ring test's q, k, v, do (tests/test_context_parallel.py `inputs`) in `dtype`."""
    from tests.test_context_parallel import inputs as fp32_inputs
    return tuple(x.astype(dtype) for x in fp32_inputs(t, b, h, kv, d))


def errors(a, contexts, blockwise_contexts) -> list:
    import jax.numpy as jnp
    import numpy as np

    from models.factory import context_kernel
    from tests.test_context_parallel import attention64   # the test's float64 reference, without jfsdp
    q, k, v, do = inputs(a.seq_len, 2, 8, 2, 64, jnp.bfloat16)
    want = attention64(q, k, v, do)
    rel = lambda got: [float(np.max(np.abs(np.asarray(g, np.float64) - w)) / np.max(np.abs(w)))
                       for g, w in zip(got, want)]
    rows = [{"C": 1, "kernel": impl, "mode": "one device", "errors": rel(one_device_program(impl)(q, k, v, do))}
            for impl in ("cudnn", "blockwise")]
    for impl, cs in (("cudnn", contexts), ("blockwise", blockwise_contexts)):
        kernel = context_kernel(block=64, attention=impl)
        for c in cs:
            for zz in (True, False):
                row = {"C": c, "kernel": impl, "mode": "zigzag" if zz else "contiguous"}
                try:
                    row["errors"] = rel(ranks_program(c, zz, kernel)(q, k, v, do))
                except Exception as e:   # reported, not hidden: the other rows still run
                    row["failed"] = f"{type(e).__name__}: {e}"[:2000]
                    print(f"C={c} {impl} {row['mode']} FAILED: {row['failed']}", flush=True)
                rows.append(row)
    floor = {r["kernel"]: r["errors"] for r in rows if r["C"] == 1}
    for r in (r for r in rows if "errors" in r):
        r["times_floor"] = [e / f for e, f in zip(r["errors"], floor[r["kernel"]])]
        print(f"C={r['C']} {r['kernel']:9} {r['mode']:10} out, dq, dk, dv: "
              + " ".join(f"{e:.2e}" for e in r["errors"]) + "   x one device's: "
              + " ".join(f"{x:.2f}" for x in r["times_floor"]), flush=True)
    return rows


def timed(fn, args, reps):
    import jax
    compiled = fn.lower(*args).compile()
    jax.block_until_ready(compiled(*args))
    t0 = time.perf_counter()
    for _ in range(reps):
        out = compiled(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / reps, compiled.memory_analysis().temp_size_in_bytes


def speed(a) -> list:
    import jax.numpy as jnp

    from models.factory import context_kernel
    args = inputs(a.speed_seq, 1, 32, 8, 128, jnp.bfloat16)
    rows = []
    for name, fn in (("one device, cuDNN", one_device_program("cudnn")),
                     ("ring C=4 on one GPU, cuDNN kernel", ranks_program(4, True, context_kernel(attention="cudnn"))),
                     ("ring C=4 on one GPU, blockwise kernel", ranks_program(4, True, context_kernel()))):
        seconds, temp = timed(fn, args, a.reps)
        t = a.speed_seq
        # causal attention's matmul flops, forward (2) + backward (5 incl. the recomputed scores): 7 of 2*T^2/2*H*D
        flops = 7 * 2 * t * t / 2 * 32 * 128
        rows.append({"program": name, "seq_len": t, "seconds": seconds, "tflops": flops / seconds / 1e12,
                     "temp_bytes": temp})
        print(f"{name:40} T={t}: {seconds * 1e3:8.2f} ms  {flops / seconds / 1e12:6.1f} TFLOP/s (causal)  "
              f"temp {temp / 2**20:8.1f} MiB", flush=True)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--contexts", default="2,4,8")
    p.add_argument("--blockwise-contexts", default="4", help="the blockwise kernel's rows (its ring is checked on "
                   "CPU by tests/test_context_parallel.py; here it is the comparison)")
    p.add_argument("--seq-len", type=int, default=1024, help="tokens of the error check's sequences")
    p.add_argument("--speed-seq", type=int, default=32768, help="tokens of the speed check's sequence (0: skip)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    import jax
    if jax.default_backend() != "gpu":
        print("error: benchmarks/context_cudnn.py needs a CUDA device (cuDNN's attention); "
              f"this machine's backend is {jax.default_backend()}", file=sys.stderr)
        return 2
    print(jax.__version__, jax.devices(), flush=True)
    def save():   # after each part: the errors survive a speed part that fails or runs out of time
        if a.json:
            with open(a.json, "w") as fh:
                json.dump(out, fh, indent=2)
    contexts = ([int(c) for c in x.split(",") if c] for x in (a.contexts, a.blockwise_contexts))
    out = {"device": str(jax.devices()[0].device_kind), "jax": jax.__version__,
           "date": time.strftime("%Y-%m-%d"), "errors": errors(a, *contexts)}
    save()
    if a.speed_seq:
        out["speed"] = speed(a)
        save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
