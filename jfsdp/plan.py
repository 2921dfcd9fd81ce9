"""Will it fit? `python -m jfsdp.plan --model llama-70b --mesh 8x8 --device-memory 80GiB`

Prints the per-device memory of one train step, estimated analytically and measured from the
compiled program (lowered from abstract inputs on fake CPU devices: nothing is allocated), the
communication per step, whether it fits and the largest global batch that fits.

`--target` says what the plan is for:
- `gpu` (default), `tpu`, `cpu`: the estimate is for that backend, and the train step is compiled on
  fake CPU devices. XLA's CPU backend widens bf16 to f32 (see `jfsdp.config.policy.wire_dtype`), so a bf16 plan
  compiled here is bigger than the same plan on a GPU: beside the compiled CPU measurement the
  report shows the estimate for CPU, which is what validates the estimate against XLA. XLA:CPU
  compiles with its memory-minimizing scheduler (`jfsdp.config.xla_flags.CPU_FLAGS`): compile-only,
  safe here; train.py runs under XLA:CPU's defaults (docs/limits.md).
- a named GPU (`h100`, `h200`, `a100`, `b200`; see `jfsdp.planning.targets`): the train step is compiled by
  XLA:GPU for that GPU and topology without one (compile-only devices; needs jax's CUDA plugin), with
  the XLA options jfsdp sets on GPUs. The report shows XLA:GPU's memory and collectives beside the
  GPU estimate, and the overlap of every async collective with compute in the scheduled program.
  The device memory defaults to the GPU's; bf16 attention is cuDNN's fused attention; the estimate
  counts two gathered units (jfsdp's flags pipeline the all-gathers: FSDP's prefetch).

`--as-is loop|scan` plans the named Llama as a Flax model given as it is (its own Python loop, or its own
`nn.scan`; `models.factory.as_is_model`, docs/any-model.md) instead of as `Stacked`.

The work is `jfsdp.planning.report`'s; this module parses the arguments and sets up the fake devices
and XLA's flags before jax starts (it imports jax only then), and prints the report.
"""
from __future__ import annotations

import json
import os
import sys
import time

from jfsdp.config.args import ASYNC_TP, EXIT_BAD_INPUT, RING_ATTENTION, ArgParser, async_tp_option, parse_bytes  # noqa: F401 (jfsdp.plan.parse_bytes)
from jfsdp.config.errors import ConfigError
from jfsdp.config.mesh import mesh_spec
from jfsdp.config.sequence import check_mlp_tile
from jfsdp.config.xla_flags import cpu_xla_flags

BASE_TARGETS = ("gpu", "tpu", "cpu")   # the backends estimated without compiling for them
LOOKUP = {"columns": "by columns, never gathered (two all-to-alls each way; jfsdp/engine/column_embed.py)",
          "gathered": "gathered (this many tokens a device move more by columns; jfsdp/engine/column_embed.py)"}


def _args(argv):
    p = ArgParser(prog="python -m jfsdp.plan", description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="a name from models.CONFIGS, e.g. llama-8b, llama-70b")
    p.add_argument("--mesh", required=True, help="RxS: R replicas (data) x S shards (fsdp)")
    p.add_argument("--tensor", type=int, default=1, metavar="T",
                   help="tensor-parallel size (train.py's --tensor): mesh RxS x T devices, Megatron TP with sequence "
                   "parallelism over the innermost T (docs/tensor-parallel.md)")
    p.add_argument("--ring-sums", choices=("fp32", "bf16"), default="fp32",
                   help="with --context C > 1 (train.py's --ring-sums): the ring backward's sums across hops in fp32, "
                   "or in bf16 for bf16 compute (half their memory and bytes, less accurate: docs/context-parallel.md)")
    p.add_argument("--ring-attention", choices=RING_ATTENTION, default="auto",
                   help="with --context C > 1 (train.py's --ring-attention): the ring's per-block attention, cuDNN's "
                   "(bf16 on a GPU target), blockwise, or auto: cuDNN where it applies")
    p.add_argument("--context", type=int, default=1, metavar="C",
                   help="context-parallel size (train.py's --context): mesh RxS x C (x T) devices, each sequence "
                   "split over C, attention as a ring (docs/context-parallel.md)")
    p.add_argument("--mlp-tile", default="0", metavar="N|auto",
                   help="train.py's --mlp-tile: the MLP over the sequence in tiles of N tokens (0: off); auto: the "
                   "largest tile (tokens per device halved until it fits) whose estimate fits the device memory, off "
                   "when the untiled plan fits (docs/context-parallel.md)")
    p.add_argument("--as-is", default=None, choices=("loop", "scan"),
                   help="plan the Llama given as it is (fully_shard(model, ..., units=LlamaBlock); docs/any-model.md) "
                   "instead of as Stacked: loop, models.llama.Llama (its own Python loop); scan, ScannedLlama (its own "
                   "nn.scan)")
    p.add_argument("--strategy", default="full_shard")
    p.add_argument("--precision", default="bf16", help="fp32, bf16 (fp32 master, bf16 compute, fp32 reduce) or fp8 "
                   "(bf16 plus float8 unit matmuls and unit gathers at 1 byte per parameter) or fp8-rowwise (float8 "
                   "unit matmuls with rowwise scales, unit gathers in bf16)")
    p.add_argument("--remat", default="full", help="none, full or dots (activation checkpointing per unit)")
    p.add_argument("--loss", default="fused", choices=("fused", "plain"),
                   help="fused (train.py's default): head and cross-entropy in chunks, no full logits; plain: logits")
    p.add_argument("--batch-size", type=int, default=None, help="global batch (default: one sequence per device)")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--device-memory", default=None, help="per device, e.g. 80GiB (default: the named "
                   "GPU's memory, else 80GiB)")
    p.add_argument("--target", default="gpu", help="gpu, tpu or cpu: the backend the estimate is for "
                   "(fits / largest batch use it), compiled on fake CPU devices; or a named GPU (h100, h200, "
                   "a100, b200): compiled by XLA:GPU for it, without one")
    p.add_argument("--xla-option", action="append", default=[], metavar="NAME=VALUE",
                   help="with a named GPU: override one of jfsdp's XLA:GPU options (VALUE none drops it)")
    p.add_argument("--moe", default="auto", choices=("auto", "gather", "ep", "adaptive"),
                   help="MoE models: gather the experts' weights, send tokens to them (ep), or let the cost model "
                   "choose per stage (auto; see jfsdp/engine/moe.py); adaptive: list the capacity buckets it compiles with "
                   "each one's mode and modelled bytes (jfsdp/engine/moe_adaptive.py)")
    p.add_argument("--moe-chunks", default="auto", help="MoE expert-parallel stages: chunks k (or auto)")
    p.add_argument("--moe-buckets", default=None, help="--moe adaptive: the capacities to plan, e.g. 64,128,256 "
                   "(train.py's --moe-buckets)")
    p.add_argument("--moe-calibration", default=None, metavar="FILE[:PART]",
                   help="--moe adaptive: measured seconds per (capacity, mode, chunks) that choose each capacity's "
                   "variant (train.py's --moe-calibration; jfsdp/planning/moe_calibrate.py)")
    p.add_argument("--prefetch", action="store_true", help="count two gathered units (prefetching the next)")
    p.add_argument("--async-tp", default="auto", choices=ASYNC_TP,
                   help="train.py's --async-tp: the TP collectives as rings of transfers that overlap the matmuls "
                   "(auto: on GPUs, the named GPU targets included)")
    p.add_argument("--update-in-backward", action="store_true",
                   help="plan train.py --update-in-backward: the optimizer applied to each unit inside the backward "
                        "pass (no whole gradient held; needs --grad-accum 1)")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per step (the batch divides into them)")
    p.add_argument("--grad-sync", default="every", choices=("every", "once"),
                   help="with --grad-accum K: reduce the gradients in every micro-batch (every), or add them up "
                   "unreduced and reduce once per step (once: 1/K of the reduce-scatter bytes, one unsharded gradient "
                   "per device in the reduce dtype)")
    p.add_argument("--freeze", default=None, metavar="REGEX",
                   help="plan train.py --freeze REGEX: the parameters whose path (e.g. root/tok_embeddings/embedding, "
                   "units/feed_forward/w1/kernel; re.search) matches are frozen: no gradient, reduce-scatter or "
                   "optimizer state")
    p.add_argument("--no-compile", action="store_true", help="estimate only (skip the compiled measurement)")
    p.add_argument("--json", default=None, help="also write the report as JSON to this file")
    return p.parse_args(argv)


def set_fake_cpu_devices(n: int):
    """Ask for n fake CPU devices, before jax starts its backend. A count already forced in XLA_FLAGS
    wins (the mesh must then fit it). XLA:CPU compiles with its memory-minimizing scheduler
    (jfsdp.config.xla_flags.CPU_FLAGS; XLA reads it from XLA_FLAGS only): with the default scheduler
    the units' stacked gradient buffers and the embedding's gradient are made at the start of the
    step, and the compiled peak is higher. The planner never runs the step, which under this flag
    would mix up collectives between devices (docs/limits.md); train.py runs under the defaults."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        flags = f"{flags} --xla_force_host_platform_device_count={n}".strip()
    os.environ["XLA_FLAGS"] = cpu_xla_flags(flags)


def _gib(x):
    return f"{x / 2**30:9.2f} GiB"


def render(r: dict) -> str:
    """The report as the command line prints it: tables of memory and communication, then the verdict."""
    e, tgt = r["estimate"], r["target"]
    here = r.get("compiled", {}).get("backend")
    e_here = r.get(f"estimate_{here}", e if here == tgt else None) if here else None
    tp = f" --tensor {r['tensor']}" if r.get("tensor", 1) > 1 else ""
    cp = f" --context {r['context']}" if r.get("context", 1) > 1 else ""
    form = {"loop": " as it is (its own Python loop)", "scan": " as it is (its own nn.scan)"}.get(r.get("as_is"), "")
    lines = [f"{r['model']}{form} ({r['params'] / 1e9:.2f}B parameters) on mesh {r['mesh']}{cp}{tp} ({r['devices']} devices), "
             f"{r['strategy']}, {r['precision']}, remat {r['remat']}, batch {r['batch_size']} x {r['seq_len']} tokens"
             + (f", MLP in tiles of {r['mlp_tile']} tokens" if r.get("mlp_tile") else "")
             + (", optimizer inside the backward pass" if r.get("update_in_backward") else "")
             + (", async TP (collective matmuls)" if r.get("async_tp") else "")
             + (f", {len(r['frozen'])} parameters frozen (--freeze '{r['freeze']}')" if r.get("frozen") else "")
             + (f", {r['grad_accum']} micro-batches, gradients reduced "
                + ("once per step" if r.get("grad_sync") == "once" else "in every micro-batch")
                if r.get("grad_accum", 1) > 1 else ""),
             "", "memory per device"]
    same = here == tgt  # a named GPU: the estimate for it is beside its own compilation
    cols = [f"estimate ({tgt})"] + (([] if same else [f"estimate ({here})"]) + [f"compiled ({here})"] if here else [])
    lines.append(f"  {'':26}" + "".join(f"{c:>20}" for c in cols))
    rows = [("parameters (fp32 shard)", "params"), ("gradients (shard)", "grads"), ("optimizer state", "optimizer"),
            ("padding", "padding"), ("gathered (root + units)", "gathered"), ("gradient buffers", "grad_buffers"),
            ("activations", "activations"), ("batch", "batch")]
    for label, k in rows:
        vals = [e[k]] + ([e_here[k]] if here and not same else [])
        lines.append(f"  {label:26}" + "".join(f"{_gib(v):>20}" for v in vals))
    c = r.get("compiled")
    mid = (lambda v: "") if same else (lambda v: f"{_gib(v):>20}")
    lines.append(f"  {'state between steps':26}{_gib(e['persistent']):>20}"
                 + (f"{mid(e_here['persistent'])}{_gib(c['argument']):>20}  (arguments)" if c else ""))
    lines.append(f"  {'peak of the step':26}{_gib(e['total']):>20}"
                 + (f"{mid(e_here['total'])}{_gib(c['total']):>20}  (arg+temp+out-alias)" if c else ""))
    if c:
        lines.append(f"  estimate / compiled on {here}: {e_here['total'] / c['total']:.3f}; compiled in {r['compile_s']} s")
    lines += ["", f"communication per step, bytes sent per device ({tgt} formula"
              + ((" and compiled HLO" if same else f"; {here} formula and compiled HLO") if c else "") + ")"]
    f, fh, m = r["comm_formula"], r.get(f"comm_formula_{here}", r["comm_formula"]), r.get("comm_compiled")
    for k in ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute", "total"):
        if k in ("all-to-all", "collective-permute") and not f.get(k) and not (m or {}).get(k):
            continue
        lines.append(f"  {k:26}{_gib(f.get(k, 0.0)):>20}" + (f"{mid(fh.get(k, 0.0))}{_gib(m.get(k, 0.0)):>20}" if m else ""))
    if r.get("ring_compiled") is not None:
        lines.append(f"  {'of which ring (`context`)':26}{_gib(f.get('collective-permute', 0.0)):>20}"
                     + ("" if same else f"{_gib(fh.get('collective-permute', 0.0)):>20}")
                     + f"{_gib(r['ring_compiled']):>20}  (collective-permutes over context)")
    if tp:
        lines.append(f"  {'FSDP part (not `tensor`)':26}{_gib(f['contract']):>20}")
        lines += _axes_rows(r, here, same)
    else:
        lines.append(f"  contract (3Ψ·b·(S−1)/S or 2Ψ·b·(N−1)/N){_gib(f['contract']):>14}")
    if r.get("layouts"):
        lines += ["", "parameter layout (jfsdp/engine/layout.py; every leaf per unit, in --json): "
                  + r["layouts"]["summary"]]
    if r.get("embedding_lookup"):
        lines.append(f"embedding lookup (untied nn.Embed table): {LOOKUP[r['embedding_lookup']]}")
    if r.get("moe"):
        lines += ["", "MoE stages (mode per stage; gather = all-gather + reduce-scatter of the experts' weights, "
                  "ep = all-to-all of the tokens; jfsdp/engine/moe.py)"] + [f"  {x}" for x in r["moe"]]
    if r.get("overlap"):
        lines += ["", f"overlap in the scheduled {here} program (per step; hidden = a matmul or loop runs while "
                  "it is in flight)", f"  units run by {r['schedule']}", r["overlap_table"]]
        for k, o in r["overlap"].items():
            lines.append(f"  {k:26}hidden {_gib(o['hidden_bytes'])}   exposed {_gib(o['exposed_bytes'])}")
        for k, o in sorted(r.get("overlap_axes", {}).items()):
            if o["hidden_bytes"] + o["exposed_bytes"] >= 2**20:
                lines.append(f"  {k:38}hidden {_gib(o['hidden_bytes'])}   exposed {_gib(o['exposed_bytes'])}")
        lines.append("  dtypes on the wire: " + ", ".join(f"{k} {d}" for k, d in r["collective_dtypes"]))
        lines.append("  XLA options: " + " ".join(f"{k}={v}" for k, v in r["xla_options"].items()))
    verdict = "fits" if r["fits"] else "does NOT fit"
    lines += ["", f"{verdict} in {_gib(r['device_memory']).strip()} per device "
              f"({100 * e['total'] / r['device_memory']:.0f}% of it, {tgt} estimate)",
              f"largest global batch that fits: {r['largest_global_batch']} sequences of {r['seq_len']} tokens"]
    return "\n".join(lines)


def _axes_rows(r: dict, here, same: bool) -> list:
    """The communication by mesh axes under tensor parallelism: the formula (jfsdp.planning.tensor_comm)
    and the compiled HLO's (hlo.per_axes); collectives the formula leaves out (scalars) show as 0."""
    f = r["comm_formula_axes"]
    fh = r.get(f"comm_formula_axes_{here}", f)
    m = r.get("comm_compiled_axes")
    lines = ["  by mesh axes" + (" (formula, compiled HLO)" if m else " (formula)")]
    for k in sorted(set(f) | set(m or {})):
        lines.append(f"    {k:34}{_gib(f.get(k, 0.0)):>14}" + ("" if same or not m else f"{_gib(fh.get(k, 0.0)):>20}")
                     + (f"{_gib(m.get(k, 0.0)):>20}" if m else ""))
    return lines


def main(argv=None) -> int:
    a = _args(argv)
    try:
        rep = _plan(a)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(render(rep))
    print(f"(planned in {rep['wall_s']} s)")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(rep, fh, indent=2, default=float)
    return 0


def mlp_tile_option(text: str, seq_len: int, context: int = 1, tensor: int = 1):
    """--mlp-tile: 'auto', or tokens (0: off) that divide the tokens per device."""
    if str(text).strip().lower() == "auto":
        check_mlp_tile(0, seq_len, context, tensor)
        return "auto"
    try:
        tile = int(text)
    except ValueError:
        raise ConfigError(f"--mlp-tile '{text}' must be a number of tokens or auto") from None
    check_mlp_tile(tile, seq_len, context, tensor)
    return tile


def check_as_is(a) -> None:
    """--as-is: what the planner cannot do for a model given as it is, refused before jax starts."""
    if not a.as_is:
        return
    why = [(a.tensor > 1, "--tensor (the planner does not model XLA's collectives over 'tensor' for it)"),
           (a.context > 1, "--context (context parallelism takes jfsdp.Stacked)"),
           (a.mlp_tile not in (0, "0"), "--mlp-tile (a transform inside the unit: not planned for it)"),
           (a.update_in_backward, "--update-in-backward (refused for a model given as it is)")]
    for refused, flag in why:
        if refused:
            raise ConfigError(f"--as-is {a.as_is} cannot combine with {flag}; plan it as Stacked (without --as-is)")


def _plan(a) -> dict:
    """Check what needs no jax, set up the devices, then start jax and make the report."""
    spec = mesh_spec(a.mesh, a.tensor, a.context)
    n = spec.devices
    if a.context > 1:
        spec.check_seq_len(a.seq_len)
    if a.tensor > 1 and a.seq_len % a.tensor:
        raise ConfigError(f"--tensor {a.tensor} does not divide --seq-len {a.seq_len} (sequence parallelism splits "
                          "the sequence)")
    async_tp_option(a.async_tp, a.tensor)   # ConfigError for --async-tp on at T = 1
    a.mlp_tile = mlp_tile_option(a.mlp_tile, a.seq_len, a.context, a.tensor)
    check_as_is(a)
    budget = parse_bytes(a.device_memory) if a.device_memory else None
    set_fake_cpu_devices(n)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax   # only now that the device count and XLA's flags are set
    if not jax.config.jax_platforms:  # `python -m jfsdp.plan` imported jax before main ran
        jax.config.update("jax_platforms", os.environ["JAX_PLATFORMS"])
    from jfsdp.planning import report, targets
    if a.target not in (*BASE_TARGETS, *targets.TARGETS):
        raise ConfigError(f"unknown target '{a.target}'; choose from {', '.join((*BASE_TARGETS, *targets.TARGETS))}")
    t = time.time()
    try:
        rep = report.report(a, budget)
    except ValueError as e:   # ConfigError included
        raise ConfigError(str(e)) from None
    rep["wall_s"] = round(time.time() - t, 1)
    return rep


if __name__ == "__main__":
    sys.exit(main())
