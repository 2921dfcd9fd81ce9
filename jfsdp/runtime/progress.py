"""What the training loop shows while it runs, and the signals that stop it.

Per-step metrics: the train step returns a dict of scalars. `loss` and `grad_norm` are every step's;
any other scalar in it (an MoE model's auxiliary loss or dropped-token fraction, say) is averaged over
the steps of each logged interval, written to the metrics file under its own name and shown in the
progress line (`extra_metrics`, `progress_line`).
"""
from __future__ import annotations

import math
import shutil
import signal
import sys

import jax
import numpy as np

from jfsdp.runtime import metrics as jm

STEP_METRICS = ("loss", "grad_norm")   # what every train step returns; the rest are a model's own

# the keys of a logged record that are not a model's own metrics
RECORD_KEYS = frozenset(("step", "loss", "lr", "grad_norm", "tokens_per_sec", "tflops_per_device", "mfu",
                         "memory_bytes", "epoch", "time_s"))


def extra_metrics(steps: list[dict], skip=()) -> dict:
    """The scalars a model adds to the train step's metrics (anything but `STEP_METRICS` and `skip`), each
    averaged over the steps of one logged interval: they go into the metrics file and the progress line."""
    names = [k for k in steps[-1] if k not in STEP_METRICS and k not in skip]
    return {k: float(np.mean([np.asarray(s[k], np.float64) for s in steps])) for k in names}


def progress_line(rec: dict, platform: str) -> str:
    """One logged record as the progress line shows it (a model's own metrics after the loss)."""
    mfu = f"MFU {rec['mfu']:.1%}" if rec["mfu"] is not None else f"MFU n/a ({platform.upper()})"
    extra = "".join(f" | {k} {rec[k]:.4g}" if isinstance(rec[k], (int, float)) else f" | {k} {rec[k]}"
                    for k in rec if k not in RECORD_KEYS)
    return (f"loss {rec['loss']:.4f}{extra} | lr {rec['lr']:.2e} | {rec['tokens_per_sec']:,.0f} tok/s | "
            f"{rec['tflops_per_device']:.3g} TFLOP/s/dev | {mfu} | mem {jm.fmt_bytes(rec['memory_bytes'])}/dev")


class Progress:
    """Where the loop reports: a tqdm bar on a terminal (process 0 only), with the latest record as its
    postfix; otherwise printed lines, about 15 per run."""

    def __init__(self, steps: int, initial: int, log_every: int, tty: bool):
        self.steps = steps
        self.print_every = log_every * max(1, math.ceil(steps / log_every / 15))
        self.bar = None
        if tty:
            from tqdm import tqdm
            # a fixed size with a fallback: tqdm hides its bar on a terminal that reports 0 x 0
            size = shutil.get_terminal_size((120, 24))
            self.bar = tqdm(total=steps, initial=initial, desc="train", unit="step", ncols=size.columns,
                            nrows=size.lines, file=sys.stderr,
                            bar_format="{desc} {n_fmt}/{total_fmt} [{elapsed}<{remaining}]{postfix}")

    def say(self, message: str) -> None:
        if self.bar:
            self.bar.write(message, file=sys.stderr)
        else:
            print(message, flush=True)

    def advance(self) -> None:
        if self.bar:
            self.bar.update(1)

    def show(self, step: int, line: str) -> None:
        """A logged step's progress line: the bar's postfix, or a printed line every `print_every` steps."""
        if self.bar:
            self.bar.set_postfix_str(line, refresh=True)
        elif step % self.print_every == 0 or step == self.steps:
            self.say(f"step {step:>5} | {line}")

    def close(self) -> None:
        if self.bar:
            self.bar.close()
            self.bar = None


class StopSignals:
    """Ctrl-C (SIGINT) and SIGTERM while the loop runs: the first asks it to stop after the step in
    flight (true, `signum` says which), a second stops at once (KeyboardInterrupt). The previous
    handlers come back on exit."""

    def __enter__(self):
        self.signum = None
        self._previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
        return self

    def _on_signal(self, signum, frame):
        if self.signum is not None:
            raise KeyboardInterrupt
        self.signum = signum

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        return False

    def __bool__(self) -> bool:
        return self.signum is not None


class Profile:
    """--profile DIR: a jax.profiler trace of 3 steps, starting 2 steps after the first of this run."""

    def __init__(self, out_dir: str | None, first_step: int, steps: int, say):
        self.dir, self.say = out_dir, say
        self.window = range(min(first_step + 2, steps - 1), min(first_step + 5, steps)) if out_dir else range(0)

    def before(self, step: int) -> None:
        if self.dir and step == self.window.start:
            jax.profiler.start_trace(self.dir)

    def after(self, done: int, state) -> None:
        if self.dir and done == self.window.stop:
            jax.block_until_ready(state)
            jax.profiler.stop_trace()
            self.say(f"profile: trace of steps {self.window.start + 1}-{done} written to {self.dir} "
                     f"(view: tensorboard --logdir {self.dir})")
