"""The training loop of a run (`jfsdp.runtime.run.Run`): train to --steps (or --stop-after, or a
signal), evaluating, logging and saving on the way; then the last checkpoint.

Ctrl-C and SIGTERM finish the step in flight, then stop and save (a second one stops at once, without
saving). A non-finite loss ends the run as bad input (`fail`), after the last good save is on disk.
"""
from __future__ import annotations

import dataclasses
import signal
import time

import jax
import numpy as np

from jfsdp.runtime import metrics as jm
from jfsdp.runtime.console import EXIT_INTERRUPTED, EXIT_TERMINATED, fail, note, stderr_is_tty
from jfsdp.runtime.progress import Profile, Progress, StopSignals, extra_metrics, progress_line


@dataclasses.dataclass
class Outcome:
    """How the loop ended and what it measured, for the summary."""
    last: dict                # the last logged record ("loss" None if no step was logged), "mem" at least
    step0: int                # the step the loop started at
    timed: float              # seconds spent in train steps only
    train_s: float            # seconds of the whole loop (training and evaluation)
    interrupted: bool
    signum: int | None = None   # the signal that stopped it

    @property
    def exit_status(self) -> int:
        if not self.interrupted:
            return 0
        return EXIT_TERMINATED if self.signum == signal.SIGTERM else EXIT_INTERRUPTED


class Meter:
    """The logged intervals: each step's metrics since the last logged step, and the time spent in
    train steps (evaluation excluded), for the throughput."""

    def __init__(self, run):
        self.run, self.pending, self.timed = run, [], 0.0
        self.last = {"loss": None, "tokens_per_sec": None, "mem": run.mem}

    def mark(self, step: int) -> None:
        self.t_mark, self.mark_step = time.perf_counter(), step

    def pause(self, seconds: float) -> None:
        """Time that is not training (an evaluation) is left out of the interval."""
        self.t_mark += seconds

    def log(self, done: int, batch) -> dict:
        """The record of the interval that ends at step `done`: written to the metrics file, kept as
        `last`, and returned. A non-finite loss in it ends the run."""
        run = self.run
        got, self.pending = jax.device_get(self.pending), []
        losses = np.array([g["loss"] for g in got], dtype=np.float64)
        now = time.perf_counter()
        if not np.all(np.isfinite(losses)):
            diverged(run, done - len(losses) + int(np.argmin(np.isfinite(losses))) + 1,
                     losses[~np.isfinite(losses)][0])
        tps = (done - self.mark_step) * run.tokens_per_step / (now - self.t_mark)
        self.timed += now - self.t_mark
        if run.platform != "cpu":
            run.mem, _ = jm.device_memory(run.mesh.local_devices)
        # a model's metrics are the logged step's own: returned by the step, or (--update-in-backward) one
        # forward pass with the updated parameters on that step's batch
        own = list(run.metric_fns) if not run.model_metrics else []   # in the model's order
        model = ({k: float(v) for k, v in run.model_metrics(run.state.params, batch).items()}
                 if run.model_metrics else {k: float(got[-1][k]) for k in own})
        model.update(build_moe_variant(run, model))
        rec = {"step": done, "loss": float(losses.mean()), "lr": float(run.schedule(done - 1)),
               "grad_norm": float(got[-1]["grad_norm"]), **extra_metrics(got, skip=own), **model,
               **run.throughput(tps), "memory_bytes": run.mem, "epoch": round(run.loader.epoch(), 4),
               "time_s": round(now - run.t_launch, 3)}
        run.out.write(**rec)
        self.last.update(rec)
        self.mark(done)
        return rec


def build_moe_variant(run, metrics: dict) -> dict:
    """An MoE run's mode and chunks at the logged step's capacity (jfsdp.runtime.build.moe_variant)."""
    fn = getattr(run, "moe_variant", None)
    return fn(metrics) if fn else {}


def diverged(run, step: int, loss: float):
    """A non-finite loss: finish the last good save (this state is never saved), then fail."""
    run.out.close()
    if run.ckpt:
        run.ckpt.wait()
    if step == 1:   # the loss of the initial parameters: no update, so no learning rate, has acted yet
        fail(f"loss is {loss} at step 1, before any update, so not the learning rate: suspect the initial "
             "weights (--init-from), the data (token ids beyond the model's vocabulary), the precision "
             "(--precision fp32 tells), or the XLA flags given in XLA_FLAGS (docs/limits.md)")
    fail(f"loss is {loss} at step {step}: training diverged (try a lower --lr, or --clip)")


def train_loop(run) -> Outcome:
    """Train from the loader's step to --steps (or --stop-after, or a signal); then the last checkpoint."""
    c, loader, ckpt = run.c, run.loader, run.ckpt
    progress = Progress(c.steps, loader.step, c.log_every, tty=stderr_is_tty() and run.lead)
    profile = Profile(c.profile, loader.step, c.steps, progress.say)
    meter = Meter(run)
    stop_at = min(c.steps, loader.step + c.stop_after) if c.stop_after else c.steps
    saved_at, interrupted, step0 = None, False, loader.step
    t_train0 = time.perf_counter()
    with StopSignals() as stop:
        try:
            progress.say(f"step {loader.step:>5} | val loss {run.evaluate(loader.step):.4f}")
            meter.mark(loader.step)
            while loader.step < stop_at and not stop:
                saved_at = one_step(run, meter, progress, profile) or saved_at
        except KeyboardInterrupt:   # a second signal, or one before the loop: no step is complete, nothing saved
            interrupted = True
            progress.close()
            note(f"interrupted at step {loader.step}/{c.steps}: stopping now, without saving a checkpoint")
            if ckpt:
                ckpt.close()   # a save already under way still completes (or stays an unfinished tmp folder)
    progress.close()
    if ckpt and not interrupted:
        if saved_at is None or not saved_at.endswith(f"/{loader.step}"):
            saved_at = run.save(loader.step)
        ckpt.wait()   # the last save is on disk before this process says so or exits
        ckpt.close()
    if stop:
        interrupted = True
        name, how = ("interrupted", "Ctrl-C") if stop.signum == signal.SIGINT else ("terminated", "SIGTERM")
        note(f"{name} at step {loader.step}/{c.steps} ({how}): stopping; "
             + (f"checkpoint saved to {saved_at}" if ckpt else "no checkpoint saved (no --ckpt-dir)"))
    elif ckpt:
        note(f"checkpoint saved to {saved_at}")
    train_s = time.perf_counter() - t_train0
    run.out.close()
    return Outcome(meter.last, step0, meter.timed, train_s, interrupted, stop.signum)


def one_step(run, meter: Meter, progress: Progress, profile: Profile) -> str | None:
    """One train step, then what is due at the step it reaches: the logged record, an evaluation, a
    checkpoint (returns where it is saved, or None)."""
    c, loader = run.c, run.loader
    profile.before(loader.step)
    batch = run.put(next(loader))
    run.state, m = run.step(run.state, batch)
    meter.pending.append(m)
    done = loader.step
    profile.after(done, run.state)
    progress.advance()
    if done % c.log_every == 0 or done == c.steps:
        progress.show(done, progress_line(meter.log(done, batch), run.platform))
    if (c.eval_every and done % c.eval_every == 0) or done == c.steps:
        t_eval = time.perf_counter()
        progress.say(f"step {done:>5} | val loss {run.evaluate(done):.4f}")
        meter.pause(time.perf_counter() - t_eval)   # evaluation is not training throughput
    if run.ckpt and c.save_every and done % c.save_every == 0:
        return run.save(done)
    return None
