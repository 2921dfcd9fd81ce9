"""One training run of the command line (`jfsdp.cli`, `python train.py`), after its flags are checked
and its devices set up: a named (or Hugging Face) Llama, data and an FSDP plan (`Run.__init__`), the
state and the compiled step (`Run.start`), the loop with evaluation, checkpoints and signals
(`Run.loop`), then a summary, a loss-curve PNG and a sample (`Run.report`, `sample`).

Imported by `jfsdp.cli.main` only once the devices are set up: it imports jax. The model
definitions come from the repository's `models` package, imported when a run builds its model
(`jfsdp` never imports `models` at import time; pip installs only `jfsdp`).

Per-step metrics: the train step returns a dict of scalars. `loss` and `grad_norm` are every step's;
any other scalar in it (an MoE model's auxiliary loss or dropped-token fraction, say) is averaged over
the steps of each logged interval, written to the metrics file under its own name and shown in the
progress line (`extra_metrics`, `progress_line`).
"""
from __future__ import annotations

import dataclasses
import math
import os
import shutil
import signal
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import jfsdp

import jfsdp.runtime.metrics
from jfsdp.io import checkpoint as jckpt
from jfsdp import cli
from jfsdp.io import data as jdata
from jfsdp.runtime import distributed
from jfsdp.io import hf as jhf
from jfsdp.runtime import metrics as jm
from jfsdp.config.zoo import repo_models
from jfsdp.cli import EXIT_INTERRUPTED, EXIT_TERMINATED, TrainConfig, fail, note

STEP_METRICS = ("loss", "grad_norm")   # what every train step returns; the rest are a model's own


def train(c: TrainConfig) -> int:
    """The run; returns its exit status (0, or 130 / 143 after Ctrl-C / SIGTERM). Bad input, a
    diverged loss and an unusable checkpoint end the process through `jfsdp.cli.fail` (status 2)."""
    t_launch = time.perf_counter()
    run = Run(c, t_launch)
    run.describe()
    run.start()
    run.loop()
    return run.report()


def load_models():
    """The repository's model definitions, imported when a run needs them."""
    return repo_models("train.py")


class Run:
    def __init__(self, c: TrainConfig, t_launch: float):
        self.t_launch = t_launch
        # -- configuration that needs jfsdp/models: every ConfigError/ValueError here is bad input
        try:
            models = load_models()
            r, s = jfsdp.parse_mesh(c.mesh)
            self.strategy = strategy = jfsdp.Strategy.parse(c.strategy)
            mp = jfsdp.MixedPrecision.parse(c.precision)
            if c.init_from:
                mcfg = models.LlamaConfig(**jhf.read_config(c.init_from))
                self.model_name = f"{c.init_from} (Hugging Face)"
            else:
                mcfg, self.model_name = models.get_config(c.model), c.model
            self.is_moe = isinstance(mcfg, models.MoEConfig)
            if not isinstance(mcfg, models.LlamaConfig) and not self.is_moe:
                raise jfsdp.ConfigError(f"model '{c.model}' is not a language model; train.py trains the llama-* "
                                        "and MoE models")
            if c.seq_len > mcfg.max_seq_len:
                raise jfsdp.ConfigError(f"--seq-len {c.seq_len} exceeds the model's max_seq_len {mcfg.max_seq_len}")
            tokenizer = jhf.tokenizer_path(c.init_from) if c.init_from else None
            self.corpus = jdata.load_tokens(c.data, mcfg.vocab_size, dtype=c.data_dtype, tokenizer=tokenizer)
            if c.prompt is not None and not self.corpus.can_decode:
                raise jfsdp.ConfigError("--prompt needs text data; a token file has no tokenizer here")
            devices = jax.devices()
            self.lead = jax.process_index() == 0
            if not self.lead:   # one process reports: the others print nothing but errors and write no files
                cli.QUIET = True
                sys.stdout = open(os.devnull, "w")
                c = dataclasses.replace(c, metrics_out=None)
            if len(devices) < r * s:
                raise jfsdp.ConfigError(f"mesh {c.mesh} needs {r * s} devices but {len(devices)} "
                                        f"{devices[0].platform.upper()} device(s) are present")
            if len(devices) > r * s:
                note(f"using {r * s} of the {len(devices)} {devices[0].platform} devices")
            self.mesh = mesh = distributed.make_mesh(c.mesh, devices=devices[: r * s])
            # an MoE plan's cost model reads the tokens per device from the example: one micro-batch
            rows = max(1, c.batch_size // c.grad_accum) if self.is_moe else 1
            example = jax.ShapeDtypeStruct((rows, c.seq_len), jnp.int32)

            def shard(head):
                model, moe, self.loss_fn = models.factory.language_model(mcfg, c.loss, c.moe, c.moe_chunks, head=head)
                return jfsdp.fully_shard(model, mesh, example, strategy=strategy, mp_policy=mp, remat=c.remat,
                                         moe=moe)
            # the fused loss takes (hidden, head weight) from the root; sampling needs logits: a second
            # plan over the same parameters with the plain head (nothing is compiled until it is used)
            self.logits_plan = shard("head")
            self.plan = plan = shard(None) if c.loss == "fused" else self.logits_plan
            self.n_units = sum(plan.stage_sizes)
            # a model's own metrics, measured at each logged step on that step's batch (a forward pass)
            self.model_metrics = ({"moe_aux_loss": models.moe.aux_loss, "moe_dropped": models.moe.dropped_fraction}
                                  if self.is_moe else {})
            rows = jdata.process_rows(plan.batch_sharding, c.batch_size, c.seq_len)
            self.loader = jdata.Loader(self.corpus, c.batch_size, c.seq_len, seed=c.seed, rows=rows)
            self.ckpt, self.resume_step = None, None
            if c.ckpt_dir:
                self.ckpt = ckpt = jckpt.Checkpointer(c.ckpt_dir, keep=c.keep)
                cli.on_fail(ckpt.close)
                self.resume_step = ckpt.latest_step()
                if self.resume_step is not None and not c.resume:
                    raise jfsdp.ConfigError(f"--ckpt-dir {c.ckpt_dir} already holds checkpoints (latest: step "
                                            f"{self.resume_step}); pass --resume to continue from it, or use "
                                            "another folder")
                if ckpt.partial_writes():
                    note(f"{c.ckpt_dir}: ignoring unfinished checkpoint write(s) "
                         f"{', '.join(ckpt.partial_writes())} (a save that was killed)")
                if c.resume and self.resume_step is None:
                    note(f"--resume: no checkpoint in {c.ckpt_dir} yet: starting at step 0")
            # what a checkpoint must share with this run to be resumed by it (mesh and strategy may differ)
            self.identity = {"model_config": dataclasses.asdict(mcfg), "precision": c.precision,
                             "data": c.data or "stdlib", "data_dtype": c.data_dtype, "tokenizer": tokenizer,
                             "batch_size": c.batch_size, "seq_len": c.seq_len, "seed": c.seed}
            # an unwritable path is bad input
            self.out = jm.MetricsFile(c.metrics_out or None, append=self.resume_step is not None)
        except (jfsdp.ConfigError, ValueError) as e:
            fail(str(e))
        except OSError as e:
            fail(f"{e.filename}: {e.strerror}")

        self.c, self.mcfg, self.r, self.s = c, mcfg, r, s
        self.n_dev = r * s
        self.platform = devices[0].platform
        self.tokens_per_step = c.batch_size * c.seq_len
        self.flops_per_token = (jm.moe_flops_per_token if self.is_moe else jm.llama_flops_per_token)(mcfg, c.seq_len)
        self.peak = jm.peak_flops(devices[0], c.precision)

    def put(self, batch):
        return jdata.to_global(batch, self.plan.batch_sharding, self.c.batch_size)

    def describe(self) -> None:
        """The run's first lines: model and mesh, processes, data, batch and schedule."""
        c, mcfg = self.c, self.mcfg
        print(f"model {self.model_name}: {mcfg.num_params() / 1e6:.2f}M params, {self.n_units} units | mesh {c.mesh} "
              f"({self.r} replicas x {self.s} shards) on {self.n_dev} {self.platform} devices | "
              f"{self.strategy.value}, {c.precision}, remat {c.remat}")
        if jax.process_count() > 1:
            print(f"processes {jax.process_count()}, {len(self.mesh.local_devices)} devices each | "
                  + "\n      ".join(distributed.describe_mesh(self.mesh)))
        print(f"data  {self.corpus.describe()}")
        print(f"batch {c.batch_size} x {c.seq_len} = {self.tokens_per_step:,} tokens/step, grad accum "
              f"{c.grad_accum} | {c.steps} steps = {jm.fmt_count(c.steps * self.tokens_per_step)} tokens "
              f"({c.steps * c.batch_size / self.loader.n_windows:.3g} epochs) | lr {c.lr:g}, "
              f"warmup {min(c.warmup, c.steps - 1)}, cosine to {c.lr / 10:g}",
              flush=True)

    # -- state, optimizer, compiled programs
    def start(self) -> None:
        """The train state (resumed, from Hugging Face weights, or initialized), the compiled step,
        the evaluation function and its fixed validation batches."""
        c, plan, ckpt, loader, resume_step = self.c, self.plan, self.ckpt, self.loader, self.resume_step
        self.schedule = jfsdp.warmup_cosine(c.lr, c.steps, c.warmup)
        opt = jfsdp.adamw(self.schedule, weight_decay=c.weight_decay, clip_norm=c.clip or None,
                          mask=plan.decay_mask())
        t0 = time.perf_counter()
        try:
            if resume_step is not None:
                meta = ckpt.read_meta(resume_step)
                ckpt.check_compatible(resume_step, meta, self.identity, plan)
                self.state = ckpt.restore(resume_step, jfsdp.abstract_state(plan, opt))
                if not isinstance(meta.get("loader"), dict) or "step" not in meta["loader"]:
                    raise jckpt.CheckpointError(f"{ckpt.step_dir(resume_step) / 'meta/metadata'}: no data position")
                loader.restore(meta["loader"])
                note(f"resumed from {ckpt.step_dir(resume_step)} (step {loader.step}, saved on mesh "
                     f"{meta['mesh']}, {meta['strategy']})")
            elif c.init_from:
                self.state = jfsdp.init_state(plan, opt, params=jhf.load_params(plan, c.init_from))
            else:
                self.state = jfsdp.init_state(plan, opt, jax.random.key(c.seed))
            train_step = jfsdp.make_train_step(plan, opt, self.loss_fn, grad_accum=c.grad_accum,
                                               update_in_backward=c.update_in_backward)
            batch = self.put(loader.batch(loader.step))
            self.compiled = train_step.lower(self.state, batch).compile()
        except jfsdp.ConfigError as e:
            fail(str(e))
        except OSError as e:
            fail(f"{e.filename}: {e.strerror}")
        self.eval_loss = jax.jit(plan.loss(self.loss_fn))
        # one forward pass for all of them (jfsdp.runtime.metrics.forward_metrics), None without any
        self.model_metrics = jax.jit(jm.forward_metrics(plan, self.model_metrics)) if self.model_metrics else None
        self.val_set = [self.put(b) for b in loader.val_batches(c.eval_iters)]
        self.mem, self.mem_src = jm.device_memory(self.mesh.local_devices, self.compiled)
        self.compile_s = time.perf_counter() - t0
        print(f"compiled the train step in {self.compile_s:.1f}s | memory per device {jm.fmt_bytes(self.mem)} "
              f"({self.mem_src})" + ("" if self.peak else f" | MFU n/a on {self.platform.upper()}"), flush=True)
        self.history = {"val": []}

    def save(self, step: int) -> str:
        """Start an asynchronous save of the current state (a non-finite state is never saved)."""
        c, ckpt = self.c, self.ckpt
        meta = {**self.identity, "loader": self.loader.state(), "mesh": c.mesh, "strategy": self.strategy.value,
                "model": self.model_name, "run": dataclasses.asdict(c), "jax": jax.__version__}
        try:
            return str(ckpt.save(step, self.state, meta, plan=self.plan))
        except jckpt.NonFiniteState as e:
            self.out.close()
            ckpt.wait()   # the previous save, still being written, is the last good one: finish it
            last_good = ckpt.latest_step()
            fail(f"{e}: training diverged (try a lower --lr, or --clip); "
                 + (f"the last good checkpoint is {ckpt.step_dir(last_good)}" if last_good is not None
                    else "no checkpoint was saved"))

    def evaluate(self, step: int) -> float:
        loss = float(np.mean([float(self.eval_loss(self.state.params, b)) for b in self.val_set]))
        self.history["val"].append((step, loss))
        self.out.write(step=step, val_loss=loss)
        return loss

    def throughput(self, tps: float) -> dict:
        tflops = tps * self.flops_per_token / self.n_dev / 1e12
        return {"tokens_per_sec": tps, "tflops_per_device": tflops,
                "mfu": tflops * 1e12 / self.peak if self.peak else None}

    # -- the loop
    def loop(self) -> None:
        """Train to --steps (or --stop-after, or a signal), evaluating, logging and saving on the way;
        then the last checkpoint."""
        c, loader, ckpt, out, platform = self.c, self.loader, self.ckpt, self.out, self.platform
        tty = sys.stderr.isatty() and self.lead
        print_every = c.log_every * max(1, math.ceil(c.steps / c.log_every / 15))   # ~15 lines when not a TTY
        bar = None
        if tty:
            from tqdm import tqdm
            # a fixed size with a fallback: tqdm hides its bar on a terminal that reports 0 x 0
            size = shutil.get_terminal_size((120, 24))
            bar = tqdm(total=c.steps, initial=loader.step, desc="train", unit="step", ncols=size.columns,
                       nrows=size.lines, file=sys.stderr,
                       bar_format="{desc} {n_fmt}/{total_fmt} [{elapsed}<{remaining}]{postfix}")
        say = (lambda msg: bar.write(msg, file=sys.stderr)) if bar else (lambda msg: print(msg, flush=True))

        pending = []   # the step's metrics since the last logged step
        self.last = {"loss": None, "tokens_per_sec": None, "mem": self.mem}
        profile_window = (range(min(loader.step + 2, c.steps - 1), min(loader.step + 5, c.steps)) if c.profile
                          else range(0))
        self.interrupted = False
        # Ctrl-C and SIGTERM: finish the step in flight, then stop and save (a second one stops at once)
        self.stop = stop = {}

        def on_signal(signum, frame):
            if stop:
                raise KeyboardInterrupt
            stop["signal"] = signum
        handlers = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
        stop_at = min(c.steps, loader.step + c.stop_after) if c.stop_after else c.steps
        saved_at = None
        t_train0 = time.perf_counter()
        self.step0, self.timed = loader.step, 0.0   # timed: seconds spent in train steps only
        try:
            v0 = self.evaluate(loader.step)
            say(f"step {loader.step:>5} | val loss {v0:.4f}")
            t_mark = time.perf_counter()
            mark_step = loader.step
            while loader.step < stop_at and not stop:
                step = loader.step
                if c.profile and step == profile_window.start:
                    jax.profiler.start_trace(c.profile)
                batch = self.put(next(loader))
                self.state, m = self.compiled(self.state, batch)
                pending.append(m)
                done = loader.step
                if c.profile and done == profile_window.stop:
                    jax.block_until_ready(self.state)
                    jax.profiler.stop_trace()
                    say(f"profile: trace of steps {profile_window.start + 1}-{done} written to {c.profile} "
                        f"(view: tensorboard --logdir {c.profile})")
                if bar:
                    bar.update(1)
                if done % c.log_every == 0 or done == c.steps:
                    got = jax.device_get(pending)
                    pending = []
                    losses = np.array([g["loss"] for g in got], dtype=np.float64)
                    now = time.perf_counter()
                    if not np.all(np.isfinite(losses)):
                        bad = done - len(losses) + int(np.argmin(np.isfinite(losses))) + 1
                        out.close()
                        if ckpt:
                            ckpt.wait()   # finish the last good save; this state is never saved
                        fail(f"loss is {losses[~np.isfinite(losses)][0]} at step {bad}: training diverged "
                             f"(try a lower --lr, or --clip)")
                    tps = (done - mark_step) * self.tokens_per_step / (now - t_mark)
                    self.timed += now - t_mark
                    if platform != "cpu":
                        self.mem, _ = jm.device_memory(self.mesh.local_devices)
                    rec = {"step": done, "loss": float(losses.mean()), "lr": float(self.schedule(done - 1)),
                           "grad_norm": float(m["grad_norm"]), **extra_metrics(got),
                           **({k: float(v) for k, v in self.model_metrics(self.state.params, batch).items()}
                              if self.model_metrics else {}),
                           **self.throughput(tps),
                           "memory_bytes": self.mem, "epoch": round(loader.epoch(), 4),
                           "time_s": round(now - self.t_launch, 3)}
                    out.write(**rec)
                    self.last.update(rec)
                    line = progress_line(rec, platform)
                    if bar:
                        bar.set_postfix_str(line, refresh=True)
                    elif done % print_every == 0 or done == c.steps:
                        say(f"step {done:>5} | {line}")
                    t_mark, mark_step = time.perf_counter(), done
                if (c.eval_every and done % c.eval_every == 0) or done == c.steps:
                    t_eval = time.perf_counter()
                    v = self.evaluate(done)
                    say(f"step {done:>5} | val loss {v:.4f}")
                    t_mark += time.perf_counter() - t_eval   # evaluation is not training throughput
                if ckpt and c.save_every and done % c.save_every == 0:
                    saved_at = self.save(done)
        except KeyboardInterrupt:   # a second signal, or one before the loop: no step is complete, nothing saved
            self.interrupted = True
            if bar:
                bar.close()
                bar = None
            note(f"interrupted at step {loader.step}/{c.steps}: stopping now, without saving a checkpoint")
            if ckpt:
                ckpt.close()   # a save already under way still completes (or stays an unfinished tmp folder)
        for sig, h in handlers.items():
            signal.signal(sig, h)
        if bar:
            bar.close()
        if ckpt and not self.interrupted:
            if saved_at is None or not saved_at.endswith(f"/{loader.step}"):
                saved_at = self.save(loader.step)
            ckpt.wait()   # the last save is on disk before this process says so or exits
            ckpt.close()
        if stop:
            self.interrupted = True
            name = "interrupted" if stop["signal"] == signal.SIGINT else "terminated"
            how = "Ctrl-C" if stop["signal"] == signal.SIGINT else "SIGTERM"
            note(f"{name} at step {loader.step}/{c.steps} ({how}): stopping; "
                 + (f"checkpoint saved to {saved_at}" if ckpt else "no checkpoint saved (no --ckpt-dir)"))
        elif ckpt:
            note(f"checkpoint saved to {saved_at}")
        self.train_s = time.perf_counter() - t_train0
        out.close()

    # -- summary, plot, sample
    def report(self) -> int:
        """The summary, the loss curve and (after a complete run) the sample; returns the exit status."""
        c, last, platform, vals = self.c, self.last, self.platform, self.history["val"]
        print(f"\n== summary: {self.loader.step}/{c.steps} steps in {time.perf_counter() - self.t_launch:.1f}s "
              f"(compile {self.compile_s:.1f}s, training + eval {self.train_s:.1f}s)")
        if last["loss"] is not None:
            tp = self.throughput((last["step"] - self.step0) * self.tokens_per_step / max(self.timed, 1e-9))
            print(f"   train loss {last['loss']:.4f} | {tp['tokens_per_sec']:,.0f} tokens/s (train steps only) | "
                  f"{tp['tflops_per_device']:.3g} TFLOP/s per device | "
                  + (f"MFU {tp['mfu']:.1%}" if self.peak else f"MFU n/a on {platform.upper()}"))
        if len(vals) > 1:
            print(f"   val loss {vals[0][1]:.4f} (step {vals[0][0]}) -> {vals[-1][1]:.4f} (step {vals[-1][0]}): "
                  f"{vals[-1][1] / vals[0][1]:.3f}x")
        print(f"   peak memory per device {jm.fmt_bytes(self.mem)} "
              f"({self.mem_src if platform == 'cpu' else 'allocator peak'})")
        if c.metrics_out:
            png = jm.plot_loss(self.out.records, os.path.splitext(c.metrics_out)[0] + ".png",
                               f"{c.model} on {c.mesh} ({self.strategy.value}, {c.precision}): {self.corpus.name}")
            print(f"   metrics {c.metrics_out}" + (f" | loss curve {png}" if png else ""))
        if self.interrupted:
            return EXIT_TERMINATED if self.stop.get("signal") == signal.SIGTERM else EXIT_INTERRUPTED
        if c.gen_tokens and self.loader.step == c.steps:
            sample(self.logits_plan, self.state.params, self.corpus, c)
        return 0


def extra_metrics(steps: list[dict]) -> dict:
    """The scalars a model adds to the train step's metrics (anything but `STEP_METRICS`), each averaged
    over the steps of one logged interval: they go into the metrics file and the progress line."""
    names = [k for k in steps[-1] if k not in STEP_METRICS]
    return {k: float(np.mean([np.asarray(s[k], np.float64) for s in steps])) for k in names}


def progress_line(rec: dict, platform: str) -> str:
    mfu = f"MFU {rec['mfu']:.1%}" if rec["mfu"] is not None else f"MFU n/a ({platform.upper()})"
    extra = "".join(f" | {k} {rec[k]:.4g}" for k in rec if k not in _RECORD_KEYS)
    return (f"loss {rec['loss']:.4f}{extra} | lr {rec['lr']:.2e} | {rec['tokens_per_sec']:,.0f} tok/s | "
            f"{rec['tflops_per_device']:.3g} TFLOP/s/dev | {mfu} | mem {jm.fmt_bytes(rec['memory_bytes'])}/dev")


# the keys of a logged record that are not a model's own metrics
_RECORD_KEYS = frozenset(("step", "loss", "lr", "grad_norm", "tokens_per_sec", "tflops_per_device", "mfu",
                          "memory_bytes", "epoch", "time_s"))


def sample(plan, params, corpus, c: TrainConfig) -> None:
    """A short continuation of a prompt, so a person sees what the model learned. The whole window is
    run through the model for every new token (no KV cache): at this size that is a few seconds.
    Every device gets a copy of the row, since the batch is split over all of them."""
    T = c.seq_len
    if c.prompt is not None:
        prompt = corpus.encode(c.prompt)
    else:   # the start of a validation document, up to a line break: text the model has not trained on
        head = np.asarray(corpus.val[: min(64, T // 2)], dtype=np.int32)
        breaks = np.nonzero(head == ord("\n"))[0] if corpus.is_bytes else []
        prompt = head[: breaks[-1] + 1] if len(breaks) and breaks[-1] > 8 else head
    tokens = [int(t) for t in prompt][-(T - 1):] or [corpus.eos if corpus.eos is not None else 0]
    replicated = jax.sharding.NamedSharding(plan.mesh, jax.sharding.PartitionSpec())   # readable by every process
    def logits(p, x):   # a head that returns a dict (MoE: with its statistics) has the logits under 'out'
        out = plan.apply(p, x)
        return out["out"] if isinstance(out, dict) else out
    fwd = jax.jit(lambda p, x, i: jax.lax.dynamic_index_in_dim(logits(p, x)[0], i, keepdims=False),
                  out_shardings=replicated)
    rng = np.random.default_rng(c.seed)
    buf = np.full((plan.n_devices, T), jdata.PAD if corpus.is_bytes else 0, np.int32)
    n_prompt = len(tokens)
    for _ in range(c.gen_tokens):
        ctx = tokens[-T:]
        buf[:, : len(ctx)] = ctx
        logits = np.asarray(fwd(params, jax.device_put(buf, plan.batch_sharding), len(ctx) - 1), np.float64)
        if corpus.is_bytes:
            logits[[jdata.BOS, jdata.PAD]] = -np.inf   # never seen as targets; EOS ends the sample
        if c.temperature == 0:
            nxt = int(np.argmax(logits))
        else:
            z = (logits - logits.max()) / c.temperature
            p = np.exp(z) / np.exp(z).sum()
            nxt = int(rng.choice(len(p), p=p))
        tokens.append(nxt)
        if nxt == corpus.eos:
            break
    how = "greedy" if c.temperature == 0 else f"temperature {c.temperature}"
    print(f"\n== sample ({how}, {len(tokens) - n_prompt} tokens after the prompt) ==")
    if corpus.can_decode:
        print(f"[prompt]{corpus.decode(tokens[:n_prompt])}[model]{corpus.decode(tokens[n_prompt:])}")
    else:
        print(f"prompt token ids {tokens[:n_prompt]}\ngenerated token ids {tokens[n_prompt:]} (no tokenizer here)")
