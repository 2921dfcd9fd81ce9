"""cuDNN's fused attention (forward + backward, causal, bf16) compiled here: the workspace of each cuDNN call
and XLA's temporaries, on a GPU or for an H100 target on a machine without one.

    python benchmarks/cudnn_workspace.py [--target h100] [--json FILE]

On a GPU, XLA asks cuDNN to build each attention graph while it compiles and sizes the call's workspace
(the last, u8[N], element of the custom call's result). Compiled for a GPU target on a CPU machine no
graph is built and the workspace is u8[0]: that compile does not see it, and neither does the compiled
memory figure read from it. The planner's estimate adds it for the ring's cuDNN kernel only
(`Kernel.workspace`, jfsdp/planning/context_plan.py; models/attention_cudnn.py `backward_workspace`).
docs/context-parallel.md keeps the figures and the formula they fit."""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SHAPES = {"llama-1b 8 x 2048": (8, 2048, 32, 8, 64), "llama-8b 1 x 8192": (1, 8192, 32, 8, 128),
          "llama-8b heads 1 x 32768": (1, 32768, 32, 8, 128)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target", default=None, help="a GPU target to compile for without one (h100)")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    if a.target:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    import jax.numpy as jnp

    def run(q, k, v, do):
        o, vjp = jax.vjp(lambda *x: jax.nn.dot_product_attention(*x, is_causal=True, implementation="cudnn"), q, k, v)
        return (o, *vjp(do))
    sharding, tracing = None, contextlib.nullcontext
    if a.target:
        from jfsdp.planning import targets
        sharding = jax.sharding.SingleDeviceSharding(targets.devices(a.target, (1, 1))[0])
        tracing = lambda: targets.tracing_for(a.target)
    elif jax.default_backend() != "gpu":
        print("error: no GPU here: pass --target h100 to compile for one", file=sys.stderr)
        return 2
    rows = []
    for name, (b, t, h, kv, d) in SHAPES.items():
        sds = lambda n: jax.ShapeDtypeStruct((b, t, n, d), jnp.bfloat16, sharding=sharding)
        with tracing():
            compiled = jax.jit(run).lower(sds(h), sds(kv), sds(kv), sds(h)).compile()
        calls = [(re.findall(r"u8\[(\d+)\]", line.split("custom-call(")[0])[-1],
                  re.search(r'custom_call_target="(__cudnn[^"]*)"', line).group(1))
                 for line in compiled.as_text().splitlines() if "custom-call(" in line and "__cudnn" in line]
        row = {"shape": name, "B_T_H_K_D": [b, t, h, kv, d], "temp_bytes": compiled.memory_analysis().temp_size_in_bytes,
               "calls": [{"target": tgt, "workspace_bytes": int(ws)} for ws, tgt in calls]}
        rows.append(row)
        print(f"{name}: temp {row['temp_bytes'] / 2**20:.1f} MiB; "
              + ", ".join(f"{c['target']} workspace {c['workspace_bytes']:,} B" for c in row["calls"]), flush=True)
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"device": a.target or str(jax.devices()[0].device_kind), "jax": jax.__version__, "rows": rows},
                      fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
