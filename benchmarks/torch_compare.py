"""jfsdp side by side with PyTorch FSDP2: memory per rank and speed, from one command.

    python benchmarks/torch_compare.py --json benchmarks/results/torch_compare.json [--png FILE]
        [--grid default|full] [--only memory|speed] [--jfsdp-target cpu] [--cells N]

Memory, with nothing allocated at full size on either side, for the llama-1b shape, batch 1 x seq per
rank, AdamW, clipping, decay on matrices:
- PyTorch: transformers' LlamaForCausalLM with FSDP2 (benchmarks/torch_fsdp.py, the torchtitan
  recipe) under FakeTensorMode on the fake process group, measured by FSDPMemTracker. The reported
  figure is the peak of the second training step, from what is live when it starts (sharded
  parameters and optimizer state): the first step's peak also counts DTensor's sharding propagation
  and is kept only as `first_iter_peak`. The torch cells run in one subprocess beside the jfsdp
  compiles.
- jfsdp: XLA's buffer assignment of the real compiled train step (`jfsdp.planning.memory.measure`: argument +
  output + temp - alias, per device), lowered from abstract inputs on fake CPU devices. For each cell
  the buffers live at XLA's peak are read from its own dump (`*-live-range.txt`, "Live ranges at N
  (peak)") and grouped by what they are (state, vocabulary-sized, attention TxT, gathered weights,
  other), so every gap is explained by named buffers.
  bf16 on XLA:CPU is marked `xla:cpu (bf16 widened to f32)`: the CPU backend widens bf16 buffers
  and collectives to f32, so the fair bf16 figure is a GPU compile: `--jfsdp-target` selects where
  jfsdp compiles (only `cpu` until the compile-only GPU targets land, see `_target_devices`).

The default grid moves one dimension at a time (24 cells): W = 1..64 (FULL_SHARD, fp32, remat full,
seq 2048); every strategy at W = 8 (HYBRID on a 2x4 mesh); bf16, remat none and seq 8192 at W = 8
and 64; and the memory goal's cells (W = 1, FULL_SHARD at 8 and 64, SHARD_GRAD_OP at 8) in fp32 and
bf16 at 2048 and 8192 tokens. `--grid full` is the cross product (W x strategy x precision x remat x
seq). `--torch-from JSON` takes FSDP2's figures from an earlier run and measures only the cells
that run lacks.

Speed on this machine: tokens/s of one model and global batch, jfsdp on W fake CPU devices against
FSDP2 on W gloo processes, W = 1 and 4 (W = 1 isolates compute from communication). On a GPU host,
`--only speed --device cuda --speed-worlds 1,8 --speed-model llama-1b --speed-seq 2048` runs both
on real GPUs (NCCL for FSDP2).
"""
from __future__ import annotations

import argparse
import atexit
import os
import shutil
import sys
import tempfile

SPEED_WORKER = "--_speed-worker" in sys.argv
USER_XLA_FLAGS = os.environ.get("XLA_FLAGS")  # before the additions below; the speed subprocesses start from it
USER_JAX_PLATFORMS = os.environ.get("JAX_PLATFORMS")  # likewise: this process forces cpu, the speed workers must not
DUMP_DIR = None if SPEED_WORKER else tempfile.mkdtemp(prefix="torch_compare_xla_")
if DUMP_DIR:
    atexit.register(shutil.rmtree, DUMP_DIR, True)
if SPEED_WORKER:
    _n = int(sys.argv[sys.argv.index("--_speed-worker") + 1])
    if not any(a == "cuda" for a in sys.argv):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={_n}").strip()
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
else:
    # 64 fake devices; XLA dumps the train step's buffer assignment and live ranges for the peak
    # analysis; LLVM at -O0 halves compile time and leaves buffer assignment unchanged (tests/conftest.py)
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=64"
                               f" --xla_dump_to={DUMP_DIR} --xla_dump_hlo_module_re=jit_step"
                               " --xla_backend_optimization_level=0").strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from jfsdp.config.xla_flags import cpu_xla_flags  # jax reads XLA_FLAGS when its backend starts
    os.environ["XLA_FLAGS"] = cpu_xla_flags()   # XLA:CPU's memory-minimizing scheduler (jfsdp.config.xla_flags.CPU_FLAGS)

import dataclasses  # noqa: E402
import glob  # noqa: E402
import itertools  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

# `models` is the repository's own package, imported from the repository root (pip installs only jfsdp)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import jfsdp  # noqa: E402
import models  # noqa: E402
from models.factory import language_model  # noqa: E402
from jfsdp.train import update_in_backward as in_backward  # noqa: E402
from jfsdp.io import hf
from jfsdp.planning import memory
from jfsdp.runtime import metrics as jm

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch_fsdp  # noqa: E402

GiB = 2**30
HERE = os.path.dirname(os.path.abspath(__file__))


# ---------------------------------------------------------------- the grid

@dataclasses.dataclass(frozen=True)
class Cell:
    world: int
    strategy: str = "full_shard"
    precision: str = "fp32"
    remat: str = "full"
    seq: int = 2048

    @property
    def mesh(self) -> str:
        """jfsdp's mesh: 1xW (full sharding), Wx1 (no_shard), 2x(W/2) (hybrid)."""
        if self.strategy == "no_shard":
            return f"{self.world}x1"
        if self.strategy.startswith("hybrid"):
            return f"2x{self.world // 2}"
        return f"1x{self.world}"

    @property
    def key(self) -> str:
        return f"W{self.world}-{self.strategy}-{self.precision}-remat_{self.remat}-seq{self.seq}"


def grid(kind: str) -> list[Cell]:
    if kind == "full":
        cells = [Cell(w, s, p, r, t) for w, s, p, r, t in itertools.product(
            (1, 2, 4, 8, 16, 32, 64), ("full_shard", "shard_grad_op", "no_shard", "hybrid_shard"), ("fp32", "bf16"),
            ("full", "none"), (2048, 8192)) if not (s == "hybrid_shard" and w < 4)]
    else:
        cells = [Cell(w) for w in (1, 2, 4, 8, 16, 32, 64)]
        cells += [Cell(8, s) for s in ("shard_grad_op", "no_shard", "hybrid_shard")]
        for w in (8, 64):
            cells += [Cell(w, precision="bf16"), Cell(w, remat="none"), Cell(w, seq=8192)]
        # the goal's cells (one rank, 8 and 64 ranks FULL_SHARD, 8 ranks SHARD_GRAD_OP) at 8192 tokens
        # and in bf16 as well
        for c in (Cell(1), Cell(8), Cell(64), Cell(8, "shard_grad_op")):
            cells += [dataclasses.replace(c, precision=p, seq=t) for p in ("fp32", "bf16") for t in (2048, 8192)]
    return list(dict.fromkeys(cells))


# ---------------------------------------------------------------- jfsdp side

def _target_devices(target: str, mesh: str):
    """Devices jfsdp compiles for. 'cpu': fake XLA:CPU devices. A named GPU (h100, ...): compile-only
    devices of jfsdp.planning.targets (no GPU needed; XLA:GPU's buffer assignment, bf16 kept as bf16)."""
    if target == "cpu":
        r, s = jfsdp.parse_mesh(mesh)
        return jax.devices()[: r * s]
    from jfsdp.planning import targets
    return targets.devices(target, mesh)


def jfsdp_cell(cfg, cell: Cell, target: str = "cpu", loss: str = "fused", update_in_backward: bool = False) -> dict:
    t = time.time()
    r, s = jfsdp.parse_mesh(cell.mesh)
    gpu = target != "cpu"
    if gpu:   # cuDNN's fused attention where it applies (bf16), as on a real GPU
        cfg = dataclasses.replace(cfg, attention="cudnn")
    mesh = jfsdp.make_mesh(cell.mesh, _target_devices(target, cell.mesh))
    x = jax.ShapeDtypeStruct((r * s, cell.seq), jnp.int32)  # 1 x seq per device
    # train.py's model, head and loss (fused by default: chunked head + cross-entropy, no full logits)
    model, _, loss_fn = language_model(cfg, loss)
    plan = jfsdp.fully_shard(model, mesh, x, strategy=cell.strategy, remat=cell.remat,
                             mp_policy=jfsdp.MixedPrecision.parse(cell.precision))
    opt = jfsdp.adamw(1e-4, mask=plan.decay_mask())
    if update_in_backward and in_backward.unsupported(plan, 1):
        update_in_backward = False   # (shard_grad_op, remat none/dots): the usual step, and the row says so
    for f in glob.glob(os.path.join(DUMP_DIR, "*")):  # one cell's dump at a time
        shutil.rmtree(f) if os.path.isdir(f) else os.remove(f)
    if gpu:
        from jfsdp.planning import targets
        with targets.tracing_for(target):
            compiled = memory.compile_step(plan, opt, loss_fn, {"inputs": x, "targets": x},
                                           compiler_options=targets.compiler_options(None, update_in_backward),
                                           update_in_backward=update_in_backward)
    else:
        compiled = memory.compile_step(plan, opt, loss_fn, {"inputs": x, "targets": x},
                                       update_in_backward=update_in_backward)
    m = memory.measure(compiled)
    out = {"peak": m["total"], "argument": m["argument"], "temp": m["temp"], "output": m["output"],
           "alias": m["alias"], "compile_s": round(time.time() - t, 1),
           "backend": f"xla:{target}" + (" (bf16 widened to f32)" if target == "cpu" and cell.precision == "bf16" else ""),
           "loss": loss, "update_in_backward": update_in_backward}
    try:
        out["peak_buffers"] = peak_buffers(compiled.as_text(), cfg, cell)
    except Exception as e:  # the analysis is an aid; the measurement stands without it
        out["peak_buffers"] = {"error": f"{type(e).__name__}: {e}"[:300]}
    return out


_LIVE = re.compile(r"^\s+([\w.\-]+)\{([\d,]*)\}: (\d+) bytes")
_ARRAY = re.compile(r"\b(?:f64|f32|bf16|f16|s64|s32|u32|pred|s8|u8)\[([\d,]*)\]")
GROUPS = ("state", "sharded grads", "vocab-sized", "attention TxT", "all-layer activations", "gathered units",
          "gathered unit", "other")


def _dims(shape_text: str) -> list[tuple[int, ...]]:
    return [tuple(int(d) for d in m.split(",") if d) for m in _ARRAY.findall(shape_text)]


def peak_buffers(hlo_text: str, cfg, cell: Cell, top: int = 8) -> dict:
    """The buffers live at XLA's peak, read from XLA's own dump of the compiled step
    (`*-live-range.txt`, "Live ranges at N (peak)"), each named by its HLO instruction, shape and the
    jax operation that made it (op_name), and grouped:
      state              the step's arguments: sharded parameters, AdamW moments, batch
      sharded grads      buffers shaped like a sharded parameter (the gradient shards being filled)
      vocab-sized        a vocabulary dimension: gathered embedding/head, logits, their gradients
      attention TxT      scores / probabilities (B x H x T x T), of one layer or stacked for all
      all-layer activations  other scan-stacked activations (n_layers x ...): the unit inputs that
                         remat keeps, or everything without remat
      gathered units     all-gathered weights stacked for every layer (kept from forward to backward)
      gathered unit      all-gathered weights of one unit, their full gradients
      other              the rest (one unit's activations and temporaries)
    `largest`: the biggest buffers other than the state.
    `live_total` is what is live at once at the peak; XLA's assigned total (memory_analysis) can be
    larger: its heap packing leaves holes (`packing`)."""
    (path,) = glob.glob(os.path.join(DUMP_DIR, "*jit_step*live-range.txt"))[-1:]
    live, in_peak = [], False
    with open(path) as f:
        for line in f:
            if "(peak):" in line:
                in_peak = True
                continue
            if in_peak:
                m = _LIVE.match(line)
                if not m:
                    break
                live.append((m.group(1), m.group(2), int(m.group(3))))
    info, entry, arg_shapes = {}, False, set()
    for line in hlo_text.splitlines():
        if line.startswith("ENTRY"):
            entry = True
        elif line and not line.startswith(" "):
            entry = False
        m = re.match(r"\s*(?:ROOT\s+)?%?([\w.\-]+) = (\(.*?\)|\S+) ", line)
        if m:
            op = re.search(r'op_name="([^"]*)"', line)
            is_arg = entry and " parameter(" in line
            info[m.group(1)] = (m.group(2), op.group(1) if op else "", is_arg)
            if is_arg:
                arg_shapes.update(_dims(m.group(2)))
    V, T, L = cfg.vocab_size, cell.seq, cfg.n_layers
    D, F, KV = cfg.dim, cfg.ffn_dim, cfg.n_kv_heads * cfg.head_dim
    unit_weights = {(D, D), (D, KV), (D, F), (F, D)}  # a Llama unit's matrices, unsharded
    groups = dict.fromkeys(GROUPS, 0)
    named = []
    for name, index, size in live:
        shape, op, is_arg = info.get(name, ("", "", False))
        arrays, texts = _dims(shape), re.findall(r"\b(?:f64|f32|bf16|f16|s64|s32|u32|pred|s8|u8)\[[\d,]*\]", shape)
        i = int(index.split(",")[0]) if index else 0
        if len(arrays) > 1 and i < len(arrays):  # an element of a tuple (a loop's state)
            arrays, texts = [arrays[i]], [texts[i]]
        dims = arrays[0] if len(arrays) == 1 else ()
        if is_arg:
            g = "state"
        elif any(d >= V and d - V < max(cell.world, 64) for d in dims):
            g = "vocab-sized"
        elif dims in arg_shapes and len(dims) >= 2:
            g = "sharded grads"
        elif len(dims) >= 3 and dims[-2:] == (T, T) and cfg.n_heads in dims:
            g = "attention TxT"
        elif len(dims) == 3 and dims[0] == L and dims[1:] in unit_weights:
            g = "gathered units"
        elif len(dims) >= 3 and dims[0] == L and T in dims:
            g = "all-layer activations"
        elif "all_gather" in op or "reduce_scatter" in op or "psum_scatter" in op:
            g = "gathered unit"
        else:
            g = "other"
        groups[g] += size
        named.append({"name": name + (f"{{{index}}}" if index else ""), "bytes": size, "group": g,
                      "shape": (texts[0] if len(texts) == 1 else shape.split("{")[0])[:80],
                      "op": re.sub(r"^jit\(step\)/(shard_map/)?", "", op)[:140]})
    named = sorted((b for b in named if b["group"] != "state"), key=lambda b: -b["bytes"])
    return {"live_total": sum(b for *_, b in live), "groups": groups, "largest": named[:top]}


# ---------------------------------------------------------------- PyTorch side (a subprocess)

def start_torch(cells: list[Cell], hf_config: dict, workdir: str):
    spec = [{"key": c.key, "hf_config": hf_config, "world": c.world, "strategy": c.strategy, "precision": c.precision,
             "remat": c.remat, "seq": c.seq, "torch_mesh": list(torch_fsdp.mesh_shape(*jfsdp.parse_mesh(c.mesh), c.strategy)),
             "iters": 2} for c in cells]
    cells_path, out_path = os.path.join(workdir, "cells.json"), os.path.join(workdir, "torch.jsonl")
    with open(cells_path, "w") as f:
        json.dump(spec, f)
    log = open(os.path.join(workdir, "torch.log"), "w")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    proc = subprocess.Popen([sys.executable, os.path.join(HERE, "torch_fsdp.py"), "memory", cells_path, out_path],
                            stdout=log, stderr=subprocess.STDOUT, env=env)
    return proc, out_path


def read_torch(out_path: str) -> dict:
    if not os.path.exists(out_path):
        return {}
    with open(out_path) as f:
        return {r["key"]: r for r in map(json.loads, f)}


def explain(cell: Cell, j: dict, t: dict) -> str:
    """One line: where jfsdp's peak goes and what FSDP2 holds instead (from the two breakdowns)."""
    if "error" in t or "peak" not in j:
        return t.get("error", "")
    pb = j.get("peak_buffers", {})
    g = pb.get("groups")
    b = t["breakdown"]
    theirs = (f"FSDP2 at its peak: params {(b.get('Sharded Param', 0) + b.get('Unsharded Param', 0)) / GiB:.2f}, "
              f"grads {(b.get('Sharded Grad', 0) + b.get('Unsharded Grad', 0)) / GiB:.2f}, "
              f"opt {b.get('OptState', 0) / GiB:.2f}, act {b.get('Activation', 0) / GiB:.2f}, "
              f"temp {b.get('Temp', 0) / GiB:.2f}, AG/RS {(b.get('All Gather', 0) + b.get('Reduce Scatter', 0)) / GiB:.2f}")
    if not g:
        return theirs
    ours = ("jfsdp live at XLA's peak: " + ", ".join(f"{k} {v / GiB:.2f}" for k, v in g.items() if v > 0.005 * GiB)
            + f"; packing {(j['peak'] - pb['live_total']) / GiB:.2f}")
    return f"{ours} | {theirs} (GiB)"


def run_memory(args, log) -> list[dict]:
    cfg = models.get_config(args.model)
    hf_config = hf.to_hf_config(dataclasses.asdict(cfg))
    cells = [c for c in grid(args.grid) if re.search(args.match, c.key)][: args.cells or None]
    work = tempfile.mkdtemp(prefix="torch_compare_")
    earlier = {}
    if args.torch_from:   # FSDP2's figures of an earlier run (the torch side does not change with jfsdp)
        with open(args.torch_from) as f:
            earlier = {r["cell"]["key"]: r["torch"] for r in json.load(f)["memory"] if "peak" in r["torch"]}
    missing = [c for c in cells if c.key not in earlier]   # measured now, beside the jfsdp compiles
    proc, out_path = (None, None) if args.no_torch or not missing else start_torch(missing, hf_config, work)
    rows = []
    for c in cells:
        target = args.jfsdp_target
        if args.bf16_target and c.precision == "bf16":
            target = args.bf16_target   # XLA:CPU widens bf16 to f32: compile bf16 cells for a GPU instead
        j = jfsdp_cell(cfg, c, target, args.jfsdp_loss, args.update_in_backward)
        rows.append({"cell": dataclasses.asdict(c) | {"mesh": c.mesh, "key": c.key}, "jfsdp": j})
        log(f"jfsdp {c.key}: {j['peak'] / GiB:.2f} GiB (compile {j['compile_s']} s)")
    if proc is not None:
        proc.wait()
        with open(os.path.join(work, "torch.log")) as f:
            tail = f.read()[-2000:]
        if proc.returncode:
            log(f"FSDP2 memory subprocess exited {proc.returncode}:\n{tail}")
    torch_rows = earlier | (read_torch(out_path) if out_path else {})
    for row in rows:
        t = torch_rows.get(row["cell"]["key"], {"error": "not measured"})
        row["torch"] = t
        c = Cell(**{k: row["cell"][k] for k in ("world", "strategy", "precision", "remat", "seq")})
        row["ratio"] = row["jfsdp"]["peak"] / t["peak"] if "peak" in t else None
        row["explanation"] = explain(c, row["jfsdp"], t)
        log(f"{row['cell']['key']}: FSDP2 {t.get('peak', float('nan')) / GiB:.2f} GiB "
            f"(trace {t.get('trace_s')} s), jfsdp {row['jfsdp']['peak'] / GiB:.2f} GiB, ratio "
            f"{row['ratio'] if row['ratio'] is None else round(row['ratio'], 3)}")
    shutil.rmtree(work, ignore_errors=True)
    return rows


# ---------------------------------------------------------------- speed

def speed_jfsdp(args) -> dict:
    """Runs in a subprocess with W devices (fake CPU devices, or the GPUs present)."""
    world = int(args._speed_worker)
    if args.device == "cuda" and jax.default_backend() != "gpu":   # both sides on the GPUs, or no comparison
        raise SystemExit(f"error: --device cuda, but jax's backend is {jax.default_backend()}")
    cfg = models.get_config(args.speed_model)
    root, unit, n = models.parts(cfg)
    B, T = args.speed_batch, args.speed_seq
    mesh = jfsdp.make_mesh(f"1x{world}", jax.devices()[:world])
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (args.speed_warmup + args.speed_steps, B, T + 1))
    x = jax.ShapeDtypeStruct((B, T), jnp.int32)
    plan = jfsdp.fully_shard(jfsdp.Stacked(root, unit, n), mesh, x, strategy="full_shard", remat=args.speed_remat,
                             mp_policy=jfsdp.MixedPrecision.parse(args.speed_precision))
    opt = jfsdp.adamw(3e-4, mask=plan.decay_mask())
    state = jfsdp.init_state(plan, opt, jax.random.key(0))
    step = jfsdp.make_train_step(plan, opt, models.loss_fn(cfg))
    times = []
    for b in tokens:
        batch = jax.device_put({"inputs": jnp.asarray(b[:, :-1], jnp.int32), "targets": jnp.asarray(b[:, 1:], jnp.int32)},
                               plan.batch_sharding)
        t0 = time.perf_counter()
        state, m = step(state, batch)
        jax.block_until_ready(m["loss"])
        times.append(time.perf_counter() - t0)
    timed = times[args.speed_warmup:]
    peak, source = jm.device_memory(jax.devices()[:world])
    return {"tokens_per_sec": B * T * len(timed) / sum(timed), "step_times": times,
            "devices": f"{world} x {jax.devices()[0].platform}", "peak_memory_bytes": peak, "memory_source": source}


def run_speed(args, log) -> dict:
    cfg = models.get_config(args.speed_model)
    out = {"model": args.speed_model, "params": cfg.num_params(), "global_batch": [args.speed_batch, args.speed_seq],
           "precision": args.speed_precision, "remat": args.speed_remat, "strategy": "full_shard",
           "warmup_steps": args.speed_warmup, "timed_steps": args.speed_steps, "device": args.device, "worlds": [],
           "load_average_at_start": os.getloadavg()[0]}  # other jobs on the same cores change these figures
    for world in [int(w) for w in args.speed_worlds.split(",")]:
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            cmd = [sys.executable, os.path.abspath(__file__), "--json", f.name, "--_speed-worker", str(world),
                   "--device", args.device] + [a for k in ("speed_model", "speed_batch", "speed_seq", "speed_steps",
                                                           "speed_warmup", "speed_precision", "speed_remat")
                                              for a in (f"--{k.replace('_', '-')}", str(getattr(args, k)))]
            env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
            if USER_XLA_FLAGS:
                env["XLA_FLAGS"] = USER_XLA_FLAGS
            if USER_JAX_PLATFORMS:
                env["JAX_PLATFORMS"] = USER_JAX_PLATFORMS
            subprocess.run(cmd, check=True, env=env)  # optimized code, no dumps, W devices
            with open(f.name) as g:
                ours = json.load(g)
        job = {"hf_config": hf.to_hf_config(dataclasses.asdict(cfg)), "lr": 3e-4, "weight_decay": 0.1, "b1": 0.9,
               "b2": 0.95, "eps": 1e-8, "clip": 1.0, "device": args.device,
               "runs": [{"mesh": [1, world], "strategy": "full_shard", "precision": args.speed_precision,
                         "remat": args.speed_remat}],
               "batch_shape": [args.speed_batch, args.speed_seq + 1], "warmup": args.speed_warmup,
               "timed_steps": args.speed_steps}
        theirs = torch_fsdp.run_workers(world, job, timeout=1800)["runs"][0]
        row = {"world": world, "jfsdp_tokens_per_sec": ours["tokens_per_sec"], "jfsdp_devices": ours["devices"],
               "torch_tokens_per_sec": theirs["tokens_per_sec"], "torch_step_times": theirs["step_times"],
               "jfsdp_step_times": ours["step_times"], "jfsdp_peak_memory_bytes": ours.get("peak_memory_bytes"),
               "torch_peak_memory_bytes": theirs.get("peak_memory_bytes"),
               "torch_peak_reserved_bytes": theirs.get("peak_reserved_bytes")}
        row["ratio"] = row["jfsdp_tokens_per_sec"] / row["torch_tokens_per_sec"]
        row["load_average_after"] = os.getloadavg()[0]
        out["worlds"].append(row)
        log(f"speed W={world}: jfsdp {row['jfsdp_tokens_per_sec']:.0f} tok/s, FSDP2 {row['torch_tokens_per_sec']:.0f} "
            f"tok/s, jfsdp/FSDP2 {row['ratio']:.2f}")
    return out


# ---------------------------------------------------------------- output

def report(result) -> str:
    """The README's tables from a result JSON."""
    out = []
    if result.get("memory"):
        out.append("| W | mesh | strategy | precision | remat | seq | FSDP2 | jfsdp | jfsdp / FSDP2 | live at jfsdp's peak (XLA) | FSDP2 at its peak |")
        out.append("| ---: | --- | --- | --- | --- | ---: | ---: | ---: | ---: | --- | --- |")
        short = {"sharded grads": "grads", "vocab-sized": "vocab", "attention TxT": "TxT",
                 "all-layer activations": "all-layer act", "gathered unit": "unit",
                 "gathered units": "all gathered units", "state": "state", "other": "other"}
        for r in result["memory"]:
            c, t, j = r["cell"], r["torch"], r["jfsdp"]
            pb = j.get("peak_buffers", {})
            ours = ", ".join(f"{short.get(k, k)} {v / GiB:.2f}" for k, v in pb.get("groups", {}).items() if v >= 0.01 * GiB)
            if "live_total" in pb:
                ours += f"; holes {(j['peak'] - pb['live_total']) / GiB:.2f}"
            b = t.get("breakdown", {})
            theirs = (f"param {(b.get('Sharded Param', 0) + b.get('Unsharded Param', 0)) / GiB:.2f}, "
                      f"grad {(b.get('Sharded Grad', 0) + b.get('Unsharded Grad', 0)) / GiB:.2f}, "
                      f"opt {b.get('OptState', 0) / GiB:.2f}, act {b.get('Activation', 0) / GiB:.2f}, "
                      f"temp {b.get('Temp', 0) / GiB:.2f}, AG+RS {(b.get('All Gather', 0) + b.get('Reduce Scatter', 0)) / GiB:.2f}"
                      if b else t.get("error", ""))
            mark = "*" if "widened" in j.get("backend", "") else ""
            tp = f"{t['peak'] / GiB:.2f}" if "peak" in t else "error"
            ratio = f"{r['ratio']:.2f}" if r.get("ratio") else "n/a"
            out.append(f"| {c['world']} | {c['mesh']} | {c['strategy']} | {c['precision']} | {c['remat']} | {c['seq']} | "
                       f"{tp} | {j['peak'] / GiB:.2f}{mark} | {ratio}{mark} | {ours} | {theirs} |")
    if result.get("speed"):
        sp = result["speed"]
        out.append("")
        out.append(f"| W | jfsdp tokens/s | FSDP2 tokens/s | jfsdp / FSDP2 |  ({sp['model']}, global batch "
                   f"{sp['global_batch'][0]} x {sp['global_batch'][1]}, {sp['precision']}, remat {sp['remat']}, "
                   f"{sp['timed_steps']} timed steps after {sp['warmup_steps']}) |")
        out.append("| ---: | ---: | ---: | ---: | --- |")
        for w in sp["worlds"]:
            out.append(f"| {w['world']} | {w['jfsdp_tokens_per_sec']:,.0f} | {w['torch_tokens_per_sec']:,.0f} | "
                       f"{w['ratio']:.2f} | |")
    return "\n".join(out)


def plot(result, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = result.get("memory", [])
    fig, (a, b) = plt.subplots(1, 2, figsize=(15, 4.8), gridspec_kw={"width_ratios": [1, 2]})
    sweep = [r for r in rows if r["cell"]["strategy"] == "full_shard" and r["cell"]["precision"] == "fp32"
             and r["cell"]["remat"] == "full" and r["cell"]["seq"] == 2048 and "peak" in r["torch"]]
    ws = [r["cell"]["world"] for r in sweep]
    a.plot(ws, [r["torch"]["peak"] / GiB for r in sweep], "o-", label="PyTorch FSDP2 (FSDPMemTracker, step 2)")
    a.plot(ws, [r["jfsdp"]["peak"] / GiB for r in sweep], "s-", label="jfsdp (XLA:CPU buffer assignment)")
    a.set(xscale="log", xlabel="ranks", ylabel="GiB per rank", title="llama-1b, FULL_SHARD, fp32, remat full, 1x2048/rank")
    a.set_xticks(ws, labels=[str(w) for w in ws])
    a.legend(fontsize=8)
    others = [r for r in rows if r not in sweep and "peak" in r["torch"]]
    labels = [f"W{r['cell']['world']} {r['cell']['strategy'].replace('_shard', '').replace('shard_grad_op', 'zero2')}\n"
              f"{r['cell']['precision']} {r['cell']['remat']} {r['cell']['seq']}" for r in others]
    x = np.arange(len(others))
    b.bar(x - 0.2, [r["torch"]["peak"] / GiB for r in others], 0.4, label="PyTorch FSDP2")
    b.bar(x + 0.2, [r["jfsdp"]["peak"] / GiB for r in others], 0.4, label="jfsdp (bf16: XLA:CPU, widened)")
    b.set_xticks(x, labels=labels, fontsize=6)
    b.set(ylabel="GiB per rank", title="one dimension at a time (llama-1b)")
    b.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", required=True)
    p.add_argument("--png", default=None, help="plot (default: the --json path with .png)")
    p.add_argument("--only", choices=("memory", "speed"), default=None)
    p.add_argument("--grid", choices=("default", "full"), default="default")
    p.add_argument("--cells", type=int, default=0, help="only the first N cells of the grid (development)")
    p.add_argument("--match", default="", help="only cells whose key matches this regex (development)")
    p.add_argument("--model", default="llama-1b")
    p.add_argument("--jfsdp-target", default="cpu", help="where jfsdp compiles: cpu (fake XLA:CPU devices) or a "
                   "compile-only GPU target of jfsdp.planning.targets (h100, h200, a100, b200)")
    p.add_argument("--no-torch", action="store_true", help="jfsdp's side only")
    p.add_argument("--torch-from", default=None, metavar="JSON",
                   help="take FSDP2's memory figures from an earlier run's --json instead of measuring them again")
    p.add_argument("--jfsdp-loss", choices=("fused", "plain"), default="fused",
                   help="jfsdp's head + loss: fused (train.py's default) or plain logits")
    p.add_argument("--update-in-backward", action="store_true",
                   help="compile jfsdp's step with the optimizer inside the backward pass "
                        "(make_train_step(update_in_backward=True)) where the cell allows it (remat full, "
                        "full_shard/hybrid); other cells use the usual step (each row records which)")
    p.add_argument("--bf16-target", default=None, metavar="GPU",
                   help="compile jfsdp's bf16 cells for this compile-only GPU target (e.g. h100): XLA:CPU widens bf16")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="speed: where both sides run")
    p.add_argument("--speed-worlds", default="1,4")
    p.add_argument("--speed-model", default="llama-small")
    p.add_argument("--speed-batch", type=int, default=8)
    p.add_argument("--speed-seq", type=int, default=256)
    p.add_argument("--speed-steps", type=int, default=4)
    p.add_argument("--speed-warmup", type=int, default=3)
    p.add_argument("--speed-precision", default="fp32")
    p.add_argument("--speed-remat", default="none")
    p.add_argument("--report", action="store_true", help="print the README tables of an existing --json file")
    p.add_argument("--_speed-worker", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.report:
        with open(a.json) as f:
            print(report(json.load(f)))
        return
    if a._speed_worker:
        with open(a.json, "w") as f:
            json.dump(speed_jfsdp(a), f)
        return
    log = lambda s: print(s, flush=True)
    t = time.time()
    import torch
    result = {"date": time.strftime("%Y-%m-%d"), "command": "python " + " ".join([os.path.relpath(__file__)] + sys.argv[1:]),
              "device": (f"CPU ({os.cpu_count()} cores): jfsdp on fake XLA devices, FSDP2 on the fake process group "
                         f"(memory) / gloo processes (speed)" if a.device != "cuda" else
                         f"{torch.cuda.get_device_name(0)}: jfsdp and FSDP2 (speed) on the GPU"),
              "jax": jax.__version__, "torch": torch.__version__}
    if a.only in (None, "memory"):
        result["memory_setup"] = {"model": a.model, "per_rank_batch": 1, "optimizer": "AdamW + clip 1.0, decay on matrices",
                                  "torch": "FSDPMemTracker peak of step 2 (FakeTensorMode, fake process group)",
                                  "jfsdp": f"compiled memory_analysis total, xla:{a.jfsdp_target}"
                                           + (f" (bf16 cells: xla:{a.bf16_target})" if a.bf16_target else "")
                                           + f", loss {a.jfsdp_loss}",
                                  "torch_from": a.torch_from, "grid": a.grid}
        result["memory"] = run_memory(a, log)
        result["memory_wall_s"] = round(time.time() - t, 1)
        log(report({"memory": result["memory"]}))
    if a.only in (None, "speed"):
        t1 = time.time()
        result["speed"] = run_speed(a, log)
        result["speed_wall_s"] = round(time.time() - t1, 1)
    result["wall_s"] = round(time.time() - t, 1)
    with open(a.json, "w") as f:
        json.dump(result, f, indent=1)
    if result.get("memory"):
        plot(result, a.png or os.path.splitext(a.json)[0] + ".png")
    log(f"done in {result['wall_s']} s")


if __name__ == "__main__":
    sys.exit(main())
