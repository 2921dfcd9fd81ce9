"""The PyTorch reference: Hugging Face transformers' LlamaForCausalLM trained with FSDP2.

Not part of jfsdp. This is what a PyTorch user would run, set up the way torchtitan sets it up:
activation checkpointing wrapped around each decoder layer, `fully_shard` on each decoder layer and
then on the root (embedding, final norm and head, tied or not, stay in the root's group and, as the
root, stay unsharded from forward to backward), a `MixedPrecisionPolicy`, AdamW in two parameter
groups (weight decay on matrices only) after global-norm clipping. jfsdp's choices map one to one:

| jfsdp                         | here                                                                 |
| ----------------------------- | -------------------------------------------------------------------- |
| mesh 1xS, full_shard          | 1D DeviceMesh of S ranks, reshard_after_forward=True per layer       |
| shard_grad_op                 | the same with reshard_after_forward=False                            |
| mesh RxS, R > 1 (hybrid)      | 2D DeviceMesh ("data", "fsdp") = (R, S): Replicate() x Shard(0)      |
| no_shard on N devices         | 2D DeviceMesh (N, 1): replicated, gradients all-reduced (DDP)        |
| MixedPrecision bf16/fp32/fp32 | MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32), fp32 loss |
| remat full / none             | checkpoint_wrapper on every decoder layer / nothing                  |
| adamw(mask=plan.decay_mask()) | AdamW groups: ndim >= 2 decayed, norms not                           |

The loss is the mean cross-entropy of each rank's batch; FSDP2 averages gradients over all
data-parallel ranks, so with equal batches per rank the gradient is that of the global mean, which
is jfsdp's loss.

Nothing here imports jax or jfsdp: the workers stay light, and the weights come in and go out as
{Hugging Face tensor name: numpy array}; `jfsdp.hf` converts to and from jfsdp's layout.

Three uses:
- `run_workers(world, job)`: real training on `world` processes (gloo on CPU over 127.0.0.1, NCCL on
  GPUs), one process per rank, each started as `python benchmarks/torch_fsdp.py worker ...`; the
  parity test and the speed comparison use it.
- `memory_cell(...)`: per-rank memory with nothing allocated: FakeTensorMode, the fake process group
  and FSDPMemTracker (see its docstring for how the steady state is read).
- `python benchmarks/torch_fsdp.py worker JOB RANK WORLD PORT`: one rank (internal).
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time

import numpy as np

STRATEGIES = ("full_shard", "shard_grad_op", "no_shard", "hybrid_shard", "hybrid_shard_zero2")
REMATS = ("none", "full")


def mesh_shape(replicas: int, shards: int, strategy: str) -> tuple[int, int]:
    """jfsdp's RxS mesh and strategy -> the (replicate, shard) shape of FSDP2's mesh. NO_SHARD
    replicates over every rank, like jfsdp's no_shard on any mesh."""
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy '{strategy}'")
    return (replicas * shards, 1) if strategy == "no_shard" else (replicas, shards)


def build_model(hf_config: dict, attn: str = "sdpa"):
    """LlamaForCausalLM from a config.json dict (`jfsdp.io.hf.to_hf_config`), fp32, training mode.
    Attention is PyTorch's scaled_dot_product_attention, transformers' default and torchtitan's."""
    import torch
    import transformers
    cfg = transformers.LlamaConfig(**{**hf_config, "use_cache": False})
    cfg._attn_implementation = attn
    with torch.device("cpu"):
        model = transformers.LlamaForCausalLM(cfg)
    return model.train()


def make_mesh(shape: tuple[int, int], device_type: str = "cpu"):
    from torch.distributed.device_mesh import init_device_mesh
    r, s = shape
    if r == 1:
        return init_device_mesh(device_type, (s,), mesh_dim_names=("fsdp",))
    return init_device_mesh(device_type, (r, s), mesh_dim_names=("data", "fsdp"))


def apply_fsdp(model, mesh, strategy: str = "full_shard", precision: str = "fp32", remat: str = "none"):
    """torchtitan's recipe: checkpoint each decoder layer (remat full), fully_shard each decoder layer,
    then the root."""
    import torch
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    if remat not in REMATS:
        raise ValueError(f"remat '{remat}': FSDP2 side has {REMATS}")
    if precision == "bf16":
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    elif precision == "fp32":
        mp = MixedPrecisionPolicy()
    else:
        raise ValueError(f"unknown precision '{precision}'")
    reshard = strategy in ("full_shard", "hybrid_shard", "no_shard")
    layers = model.model.layers
    for i in range(len(layers)):
        layer = layers[i]
        if remat == "full":
            layer = checkpoint_wrapper(layer, preserve_rng_state=False)
            layers[i] = layer
        fully_shard(layer, mesh=mesh, reshard_after_forward=reshard, mp_policy=mp)
    # the root: embedding, final norm and (tied) head; reshard_after_forward=None means False for
    # the root, which is needed again as soon as backward starts
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model


def make_optimizer(model, lr: float, *, weight_decay: float = 0.1, b1: float = 0.9, b2: float = 0.95,
                   eps: float = 1e-8):
    """AdamW, decay on matrices (the embedding and projections), not on norm scales: jfsdp's
    `plan.decay_mask()`. A tied embedding is one parameter, listed once. The fused implementation
    (torchtitan's default) updates in place, like XLA's fused elementwise update of donated state;
    `foreach` would add a parameter-sized temporary during the step."""
    import torch
    params = list(model.parameters())
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(b1, b2), eps=eps, fused=True)


def train_step(model, opt, inputs, targets, clip: float | None = 1.0):
    """One step; returns this rank's loss (mean over its batch) as a tensor."""
    import torch
    import torch.nn.functional as F
    # the logits are not kept in a variable: only what autograd saves stays alive through backward
    # (torchtitan deletes its `pred` for the same reason)
    loss = F.cross_entropy(model(input_ids=inputs, use_cache=False).logits.flatten(0, 1).float(), targets.flatten())
    loss.backward()
    if clip:
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip, foreach=True)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


def full_state(model) -> dict:
    """{HF tensor name: full numpy array} (every rank must call it: it all-gathers DTensors)."""
    out = {}
    for name, t in model.state_dict().items():
        if hasattr(t, "full_tensor"):
            t = t.full_tensor()
        out[name] = t.detach().float().cpu().numpy()
    return out


# ---------------------------------------------------------------- real runs, one process per rank

def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_workers(world: int, job: dict, weights: dict | None = None, batches=None, timeout: float = 300) -> dict:
    """Run `job` on `world` ranks and return rank 0's result.

    job: {"hf_config", "runs": [{"mesh": [R, S], "strategy", "precision", "remat", ...}], "lr",
    "weight_decay", "b1", "b2", "eps", "clip", "threads", "device" ("cpu"/"cuda"), "warmup",
    "timed_steps"}. weights: {HF name: array}, loaded before sharding (else transformers' own init,
    seed 0). batches: (steps, global batch, seq + 1) int tokens; each rank takes its contiguous rows,
    the same rows jfsdp's batch sharding gives device `rank`. Every run starts from the same weights.
    Result: {"runs": [{"losses": [...], "final": {name: array} if job["return_params"], "tokens_per_sec"}]}."""
    with tempfile.TemporaryDirectory(prefix="torch_fsdp_") as tmp:
        np.savez(os.path.join(tmp, "weights.npz"), **(weights or {}))
        if batches is not None:
            np.save(os.path.join(tmp, "batches.npy"), np.asarray(batches))
        with open(os.path.join(tmp, "job.json"), "w") as f:
            json.dump(job, f)
        port = _free_port()
        env = dict(os.environ)
        env.setdefault("GLOO_SOCKET_IFNAME", "lo" if sys.platform.startswith("linux") else "lo0")
        logs = [open(os.path.join(tmp, f"rank{r}.log"), "w+") for r in range(world)]
        if job.get("device", "cpu") == "cpu":
            codes = _forked_ranks(tmp, world, port, env, timeout)
        else:
            procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "worker", tmp, str(r), str(world), str(port)],
                                      stdout=logs[r], stderr=subprocess.STDOUT, env=env) for r in range(world)]
            deadline = time.time() + timeout
            try:
                for p in procs:
                    p.wait(timeout=max(1.0, deadline - time.time()))
            except subprocess.TimeoutExpired:
                pass
            finally:
                for p in procs:
                    if p.poll() is None:
                        p.kill()
                        p.wait()
            codes = [p.returncode for p in procs]
        failed = [r for r, code in enumerate(codes) if code != 0]
        if failed:
            logs[failed[0]].seek(0)
            tail = logs[failed[0]].read()[-3000:]
            raise RuntimeError(f"FSDP2 rank {failed[0]} of {world} failed (exit {codes[failed[0]]}, "
                               f"timeout {timeout:.0f}s):\n{tail}")
        with open(os.path.join(tmp, "result.json")) as f:
            result = json.load(f)
        for i, run in enumerate(result["runs"]):
            path = os.path.join(tmp, f"final{i}.npz")
            if os.path.exists(path):
                with np.load(path) as z:
                    run["final"] = {k: z[k] for k in z.files}
        return result


def _forked_ranks(tmp: str, world: int, port: int, env: dict, timeout: float) -> list:
    """CPU ranks: one process imports torch and transformers (about 6 s of CPU) and forks the `world` ranks
    (`_ranks`), instead of each rank importing them again. -> each rank's exit status (None: not known, e.g.
    the timeout ended them all)."""
    with open(os.path.join(tmp, "ranks.log"), "w") as log:
        p = subprocess.Popen([sys.executable, os.path.abspath(__file__), "ranks", tmp, str(world), str(port)], env=env,
                             stdout=subprocess.DEVNULL, stderr=log,
                             start_new_session=True)   # its own process group: a timeout ends the ranks with it
    try:
        p.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, 9)
        p.wait()
        return [None] * world
    try:
        with open(os.path.join(tmp, "ranks.json")) as f:
            return json.load(f)
    except FileNotFoundError:
        with open(os.path.join(tmp, "ranks.log")) as f:
            raise RuntimeError(f"FSDP2 ranks did not start (exit {p.returncode}):\n{f.read()[-3000:]}")


def _ranks(tmp: str, world: int, port: int) -> None:
    """The forking parent of `_forked_ranks`: rank r's output goes to rank{r}.log as a process of its own
    would write it; the ranks' exit statuses go to ranks.json. Nothing has started a thread pool or a
    process group before the fork (imports only)."""
    import torch  # noqa: F401
    import torch.distributed  # noqa: F401
    import torch.distributed.fsdp  # noqa: F401
    import transformers  # noqa: F401
    from transformers import LlamaConfig, LlamaForCausalLM  # noqa: F401
    sys.stdout.flush()
    sys.stderr.flush()
    pids = []
    for r in range(world):
        pid = os.fork()
        if pid == 0:
            fd = os.open(os.path.join(tmp, f"rank{r}.log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            code = 0
            try:
                _worker(tmp, r, world, port)
            except BaseException:
                import traceback
                traceback.print_exc()
                code = 1
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        pids.append(pid)
    codes = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in pids]
    with open(os.path.join(tmp, "ranks.json"), "w") as f:
        json.dump(codes, f)


def _worker(tmp: str, rank: int, world: int, port: int) -> None:
    import torch
    import torch.distributed as dist
    with open(os.path.join(tmp, "job.json")) as f:
        job = json.load(f)
    device = job.get("device", "cpu")
    torch.set_num_threads(int(job.get("threads") or max(1, (os.cpu_count() or 1) // world)))
    if device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=world)
    try:
        with np.load(os.path.join(tmp, "weights.npz")) as z:
            weights = {k: torch.from_numpy(z[k]) for k in z.files}
        bpath = os.path.join(tmp, "batches.npy")
        batches = np.load(bpath) if os.path.exists(bpath) else None
        results = []
        for i, run in enumerate(job["runs"]):
            if device == "cuda":
                torch.cuda.reset_peak_memory_stats()
            torch.manual_seed(0)
            model = build_model(job["hf_config"])
            if weights:
                missing, unexpected = model.load_state_dict(weights, strict=False)
                assert not unexpected, unexpected
                assert all(k == "lm_head.weight" and job["hf_config"].get("tie_word_embeddings") for k in missing), missing
            model.to(device)
            mesh = make_mesh(tuple(run["mesh"]), device)
            apply_fsdp(model, mesh, run["strategy"], run.get("precision", "fp32"), run.get("remat", "none"))
            opt = make_optimizer(model, job["lr"], weight_decay=job["weight_decay"], b1=job["b1"], b2=job["b2"],
                                 eps=job["eps"])
            if batches is None:  # speed runs: random tokens of the given shape
                g = np.random.default_rng(0)
                steps = job.get("warmup", 0) + job["timed_steps"]
                batches = g.integers(0, job["hf_config"]["vocab_size"], (steps, *job["batch_shape"]))
            rows = batches.shape[1] // world
            losses, times = [], []
            for step, b in enumerate(batches):
                local = torch.from_numpy(np.ascontiguousarray(b[rank * rows:(rank + 1) * rows])).long().to(device)
                t0 = time.perf_counter()
                loss = train_step(model, opt, local[:, :-1], local[:, 1:], job.get("clip"))
                loss = loss.detach()
                dist.all_reduce(loss)  # sum (gloo has no average); every rank has the same batch size
                loss = loss.item() / world
                times.append(time.perf_counter() - t0)
                losses.append(loss)
            warm = job.get("warmup", 0)
            timed = times[warm:]
            tokens = (batches.shape[1] * (batches.shape[2] - 1)) * len(timed)
            out = {"losses": losses, "step_times": times,
                   "tokens_per_sec": tokens / sum(timed) if timed else None}
            if device == "cuda":  # the caching allocator's peaks over the whole run, this rank
                out["peak_memory_bytes"] = int(torch.cuda.max_memory_allocated())
                out["peak_reserved_bytes"] = int(torch.cuda.max_memory_reserved())
            if job.get("return_params"):
                final = full_state(model)
                if rank == 0:
                    np.savez(os.path.join(tmp, f"final{i}.npz"), **final)
            results.append(out)
            del model, opt
        if rank == 0:
            with open(os.path.join(tmp, "result.json"), "w") as f:
                json.dump({"runs": results, "torch": torch.__version__}, f)
        dist.barrier()
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------- memory with nothing allocated

def memory_cell(hf_config: dict, world: int, mesh: tuple[int, int], strategy: str, precision: str, remat: str,
                seq: int, per_rank_batch: int = 1, iters: int = 2) -> dict:
    """Per-rank memory of one training step of FSDP2, with nothing allocated at full size.

    The model, the batch, the optimizer and every collective are fake: FakeTensorMode for tensors, the
    fake process group (`world` ranks, this process is rank 0, collectives return without moving
    data) for communication. FSDPMemTracker counts every live tensor storage op by op, by kind.

    Steady state: the tracker is entered once per iteration and its peak restarts from what is live
    at entry (the sharded parameters and, from the second iteration on, the optimizer state). The
    first iteration also counts DTensor's sharding propagation and creates the optimizer state
    inside the step; the peak of the last iteration (`iters` >= 2) is the one reported; the first
    is returned too, as `first_iter_peak`."""
    import torch
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.testing._internal.distributed.fake_pg import FakeStore

    t0 = time.time()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        device_mesh = make_mesh(mesh)  # outside the fake mode: the mesh's rank table is real
        with FakeTensorMode():
            torch.manual_seed(0)
            model = build_model(hf_config)
            apply_fsdp(model, device_mesh, strategy, precision, remat)
            opt = make_optimizer(model, 1e-4)
            tokens = torch.randint(0, hf_config["vocab_size"], (per_rank_batch, seq + 1))
            inputs, targets = tokens[:, :-1], tokens[:, 1:]
            tracker = FSDPMemTracker(model, opt)
            tracker.track_inputs((inputs, targets))
            peaks = []
            for _ in range(iters):
                tracker.reset_mod_stats()  # per-module stats are per iteration; the global peak restarts at entry
                with tracker:
                    train_step(model, opt, inputs, targets)
                peaks.append(_snapshot(tracker.get_tracker_snapshot("peak")))
                after = _snapshot(tracker.get_tracker_snapshot("current"))
        return {"peak": peaks[-1]["Total"], "breakdown": peaks[-1], "first_iter_peak": peaks[0]["Total"],
                "iteration_peaks": [p["Total"] for p in peaks],
                "between_steps": after, "iterations": iters, "trace_s": round(time.time() - t0, 1)}
    finally:
        dist.destroy_process_group()


def _snapshot(snap: dict) -> dict:
    """{device: {kind: bytes}} -> {kind: bytes} (one device, CPU under the fake mode)."""
    (dev_snap,) = snap.values()
    return {getattr(k, "value", str(k)): int(v) for k, v in dev_snap.items()}


def _memory_cells(cells_path: str, out_path: str) -> None:
    """Every cell of a JSON list, one after the other in this process; one JSON line per cell."""
    with open(cells_path) as f:
        cells = json.load(f)
    with open(out_path, "a") as out:
        for c in cells:
            try:
                r = memory_cell(c["hf_config"], c["world"], tuple(c["torch_mesh"]), c["strategy"], c["precision"],
                                c["remat"], c["seq"], c.get("per_rank_batch", 1), c.get("iters", 2))
            except Exception as e:  # one failing cell is reported, not the end of the grid
                r = {"error": f"{type(e).__name__}: {e}"[:500]}
            out.write(json.dumps({"key": c["key"], **r}) + "\n")
            out.flush()


if __name__ == "__main__":
    if len(sys.argv) == 6 and sys.argv[1] == "worker":
        _worker(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))
    elif len(sys.argv) == 5 and sys.argv[1] == "ranks":
        _ranks(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
    elif len(sys.argv) == 4 and sys.argv[1] == "memory":
        _memory_cells(sys.argv[2], sys.argv[3])
    else:
        sys.exit("usage: python benchmarks/torch_fsdp.py worker JOBDIR RANK WORLD PORT | ranks JOBDIR WORLD PORT | memory CELLS.json OUT.jsonl "
                 "(internal: see run_workers and benchmarks/torch_compare.py)")
