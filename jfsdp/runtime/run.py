"""One training run of the command line (`jfsdp.cli`, `python train.py`), after its flags are checked
and its devices set up: a named (or Hugging Face) Llama, data and a sharded model (`Run.__init__`,
from the pieces in `jfsdp.runtime.build`), the state and the compiled step (`Run.start`), the loop with
evaluation, checkpoints and signals (`jfsdp.runtime.loop`), then a summary, a loss-curve PNG and a
sample (`jfsdp.runtime.report`).

Imported by `jfsdp.cli.main` only once the devices are set up: it imports jax.
"""
from __future__ import annotations

import dataclasses
import time

import jax
import numpy as np

import jfsdp
from jfsdp.config.mesh import MeshSpec
from jfsdp.io import checkpoint as jckpt
from jfsdp.io import data as jdata
from jfsdp.io import hf as jhf
from jfsdp.runtime import build, calibrate, distributed, fit
from jfsdp.runtime import metrics as jm
from jfsdp.runtime.config import TrainConfig
from jfsdp.runtime.console import bad_input, fail, note
from jfsdp.runtime.loop import train_loop
from jfsdp.runtime.moe_switch import HostSwitch
from jfsdp.runtime.report import report


def train(c: TrainConfig) -> int:
    """The run; returns its exit status (0, or 130 / 143 after Ctrl-C / SIGTERM). Bad input, a
    diverged loss and an unusable checkpoint end the process through `jfsdp.runtime.console.fail`
    (status 2)."""
    run = Run(c, time.perf_counter())
    run.describe()
    if not c.no_fit_check:
        run.check_fit()
    run.start()
    return report(run, train_loop(run))


class Run:
    """What the loop and the report share: the config, the model, the mesh, the sharded model, the
    data, the checkpoints, the metrics file; after `start`, the train state and the compiled step."""

    def __init__(self, c: TrainConfig, t_launch: float):
        self.t_launch = t_launch
        with bad_input(ValueError):
            self.models = models = build.load_models()
            self.r, self.s = r, s = jfsdp.parse_mesh(c.mesh)
            self.strategy = jfsdp.Strategy.parse(c.strategy)
            self.mp = mp = jfsdp.MixedPrecision.parse(c.precision)
            self.model = model = build.choose_model(c, models)
            self.corpus = jdata.load_tokens(c.data, model.config.vocab_size, dtype=c.data_dtype,
                                            tokenizer=model.tokenizer)
            if c.prompt is not None and not self.corpus.can_decode:
                raise jfsdp.ConfigError("--prompt needs text data; a token file has no tokenizer here")
            c, self.lead = build.report_from_lead(c)
            devices = build.take_devices(c, r, s * c.context * c.tensor)
            self.mesh = (distributed.make_mesh(c.mesh, devices=devices, tensor=c.tensor) if c.context == 1
                         else jfsdp.make_mesh(c.mesh, devices=devices, tensor=c.tensor, context=c.context))
            if c.moe_calibrate and not model.is_moe:
                raise jfsdp.ConfigError(f"--moe-calibrate applies to MoE models, not {c.model}")
            self.sharded, self.logits_model, self.loss_fn = build.shard_model(c, models, model, self.mesh,
                                                                                self.strategy, mp)
            self.metric_fns = build.model_metrics(models, model)
            self.moe_variant = lambda metrics: build.moe_variant(self.sharded, metrics)
            self.trainable = build.trainable(c, self.sharded)
            rows = jdata.process_rows(self.sharded.batch_sharding, c.batch_size, c.seq_len)
            self.loader = jdata.Loader(self.corpus, c.batch_size, c.seq_len, seed=c.seed, rows=rows, context=c.context)
            self.ckpt, self.resume_step = build.open_checkpoints(c)
            self.identity = build.identity(c, model)
            # an unwritable path is bad input
            self.out = jm.MetricsFile(c.metrics_out or None, append=self.resume_step is not None)
        self.c = c
        self.n_units = sum(self.sharded.stage_sizes)
        self.n_dev = r * s * c.context * c.tensor
        self.platform = devices[0].platform
        self.tokens_per_step = c.batch_size * c.seq_len
        flops = jm.moe_flops_per_token if model.is_moe else jm.llama_flops_per_token
        self.flops_per_token = flops(model.config, c.seq_len)
        self.peak = jm.peak_flops(devices[0], c.precision)

    def put(self, batch):
        return jdata.to_global(batch, self.sharded.batch_sharding, self.c.batch_size)

    def describe(self) -> None:
        """The run's first lines: model and mesh, processes, data, batch and schedule."""
        c, mcfg = self.c, self.model.config
        print(f"model {self.model.name}: {mcfg.num_params() / 1e6:.2f}M params, {self.n_units} units | mesh "
              f"{MeshSpec(self.r, self.s, self.c.tensor, self.c.context).describe()} on {self.n_dev} {self.platform} devices | "
              f"{self.strategy.value}, {c.precision}, remat {c.remat}"
              + (" | async TP (collective matmuls)" if getattr(self.sharded, "async_tp", False) else ""))
        if jax.process_count() > 1:
            print(f"processes {jax.process_count()}, {len(self.mesh.local_devices)} devices each | "
                  + "\n      ".join(distributed.describe_mesh(self.mesh)))
        print(f"data  {self.corpus.describe()}")
        print(f"batch {c.batch_size} x {c.seq_len} = {self.tokens_per_step:,} tokens/step, grad accum "
              f"{c.grad_accum}{', gradients reduced once per step' if c.grad_sync == 'once' and c.grad_accum > 1 else ''} | {c.steps} steps = {jm.fmt_count(c.steps * self.tokens_per_step)} tokens "
              f"({c.steps * c.batch_size / self.loader.n_windows:.3g} epochs) | lr {c.lr:g}, "
              f"warmup {min(c.warmup, c.steps - 1)}, cosine to {c.lr / 10:g}",
              flush=True)

    def check_fit(self) -> None:
        """Before anything is allocated: the planner's estimate against the devices' memory
        (jfsdp.runtime.fit); does not fit: one `error:` line with what would, exit status 2."""
        c = self.c
        case = fit.Case(self.sharded, self.loss_fn, build.make_optimizer(c, self.sharded)[1], c.batch_size,
                        c.seq_len, c.grad_accum, c.update_in_backward, self.platform, c.grad_sync, self.trainable)

        def reshard(remat):
            return build.shard_model(dataclasses.replace(c, remat=remat), self.models, self.model, self.mesh,
                                     self.strategy, self.mp)[0]
        with bad_input():
            message = fit.check(case, self.mesh.local_devices, reshard)
        if message:
            note(message)

    # -- state, optimizer, compiled programs
    def start(self) -> None:
        """The train state (resumed, from Hugging Face weights, or initialized), the compiled step,
        the evaluation function and its fixed validation batches."""
        c = self.c
        if c.moe_calibrate:   # after the fit check: the adaptive stage's variants timed here, then the model again
            with bad_input():
                shard = lambda **kw: build.shard_model(c, self.models, self.model, self.mesh, self.strategy, self.mp, **kw)
                table = calibrate.measure(c, self.sharded, lambda v: shard(moe_variant=v),
                                          self.model.config.vocab_size, self.lead)
                self.sharded, self.logits_model, self.loss_fn = shard(calibration=table)
        sharded = self.sharded
        self.schedule, opt = build.make_optimizer(c, sharded)
        t0 = time.perf_counter()
        with bad_input():
            self.state = self.initial_state(opt)
            # the model's metrics come from the step's own forward pass (before its update), except with
            # --update-in-backward, whose fused step returns none: there one extra forward at logged steps
            in_step = None if c.update_in_backward else self.metric_fns
            make_step = lambda plan, loss_fn: jfsdp.make_train_step(   # noqa: E731
                plan, opt, loss_fn, grad_accum=c.grad_accum, update_in_backward=c.update_in_backward,
                grad_sync=c.grad_sync, trainable=self.trainable, metrics=in_step)
            batch = self.put(self.loader.batch(self.loader.step))
            if c.moe_switch == "host":   # one program per bucket, the host choosing (jfsdp/runtime/moe_switch.py)
                shard = lambda v: build.shard_model(c, self.models, self.model, self.mesh, self.strategy,  # noqa: E731
                                                    self.mp, moe_variant=v)
                self.step = HostSwitch(sharded, shard, make_step, opt, self.trainable, self.state, batch)
                self.compiled = self.step.programs[-1]   # the largest bucket's: the memory figure
            else:
                self.compiled = self.step = make_step(sharded, self.loss_fn).lower(self.state, batch).compile()
        # the loss, and a model's evaluation metrics (build.eval_metrics) from the same forward pass
        extra = build.eval_metrics(self.models, self.model, self.loss_fn)
        if extra:
            self.eval_fn = jax.jit(jm.forward_metrics(sharded, {"loss": self.loss_fn, **extra}))
        else:
            loss = sharded.loss(self.loss_fn)
            self.eval_fn = jax.jit(lambda params, batch: {"loss": loss(params, batch)})
        # one forward pass for all of them (jfsdp.runtime.metrics.forward_metrics), None without any or
        # where the step returns them
        self.model_metrics = (jax.jit(jm.forward_metrics(sharded, self.metric_fns))
                              if self.metric_fns and not in_step else None)
        self.val_set = [self.put(b) for b in self.loader.val_batches(c.eval_iters)]
        self.mem, self.mem_src = jm.device_memory(self.mesh.local_devices, self.compiled)
        self.compile_s = time.perf_counter() - t0
        print(f"compiled the train step in {self.compile_s:.1f}s | memory per device {jm.fmt_bytes(self.mem)} "
              f"({self.mem_src})" + ("" if self.peak else f" | MFU n/a on {self.platform.upper()}"), flush=True)
        self.history = {"val": []}

    def initial_state(self, opt):
        """Resumed from --ckpt-dir (the data position too), from --init-from's weights, or initialized."""
        c, sharded, ckpt, step = self.c, self.sharded, self.ckpt, self.resume_step
        if step is None and c.init_from:
            return jfsdp.init_state(sharded, opt, params=jhf.load_params(sharded, c.init_from),
                                    trainable=self.trainable)
        if step is None:
            return jfsdp.init_state(sharded, opt, jax.random.key(c.seed), trainable=self.trainable)
        meta = ckpt.read_meta(step)
        ckpt.check_compatible(step, meta, self.identity, sharded)
        state = ckpt.restore(step, jfsdp.abstract_state(sharded, opt, trainable=self.trainable), plan=sharded)
        if not isinstance(meta.get("loader"), dict) or "step" not in meta["loader"]:
            raise jckpt.CheckpointError(f"{ckpt.step_dir(step) / 'meta/metadata'}: no data position")
        self.loader.restore(meta["loader"])
        tensor = "".join(f" --{k} {meta[k]}" for k in ("tensor", "context") if meta.get(k, 1) > 1)
        note(f"resumed from {ckpt.step_dir(step)} (step {self.loader.step}, saved on mesh "
             f"{meta['mesh']}{tensor}, {meta['strategy']})")
        return state

    def save(self, step: int) -> str:
        """Start an asynchronous save of the current state (a non-finite state is never saved)."""
        c, ckpt = self.c, self.ckpt
        meta = {**self.identity, "loader": self.loader.state(), "mesh": c.mesh, "tensor": c.tensor,
                "context": c.context, "strategy": self.strategy.value, "model": self.model.name, "run": dataclasses.asdict(c),
                "jax": jax.__version__}
        try:
            return str(ckpt.save(step, self.state, meta, plan=self.sharded))
        except jckpt.NonFiniteState as e:
            self.out.close()
            ckpt.wait()   # the previous save, still being written, is the last good one: finish it
            last_good = ckpt.latest_step()
            fail(f"{e}: training diverged (try a lower --lr, or --clip); "
                 + (f"the last good checkpoint is {ckpt.step_dir(last_good)}" if last_good is not None
                    else "no checkpoint was saved"))

    def evaluate(self, step: int) -> float:
        got = jax.device_get([self.eval_fn(self.state.params, b) for b in self.val_set])
        means = {k: float(np.mean([float(g[k]) for g in got])) for k in got[0]}
        loss = means.pop("loss")
        self.history["val"].append((step, loss))
        self.out.write(step=step, val_loss=loss, **{f"val_{k}": v for k, v in means.items()})
        return loss

    def throughput(self, tps: float) -> dict:
        tflops = tps * self.flops_per_token / self.n_dev / 1e12
        return {"tokens_per_sec": tps, "tflops_per_device": tflops,
                "mfu": tflops * 1e12 / self.peak if self.peak else None}
