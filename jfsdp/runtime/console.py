"""What a training run tells its user, and how it ends on bad input: one line each.

jax-free: the command line (`jfsdp.cli`) uses it before it has chosen the platform, the run
(`jfsdp.runtime.run`) after. Bad input (and a diverged loss, and an unusable checkpoint) ends with one
line `error: ...` on stderr and exit status 2 (`fail`); notices go to stderr (`note`), from process 0
only in a multi-process run (`set_quiet`). Ctrl-C and SIGTERM end with 128 + the signal number, the
shell's convention.
"""
from __future__ import annotations

import contextlib
import sys

from jfsdp.config.args import EXIT_BAD_INPUT  # noqa: F401  (the one exit status of bad input)
from jfsdp.config.errors import ConfigError

EXIT_INTERRUPTED, EXIT_TERMINATED = 130, 143

_on_fail = []   # what to close before exiting on an error (the checkpointer: its pending save and threads)
_quiet = False  # set in processes other than 0 of a multi-process run: only process 0 reports
_stderr_tty = None  # whether stderr reaches a terminal, where sys.stderr cannot tell (set_stderr_tty)


def on_fail(close) -> None:
    """Have `fail` call `close()` before it exits (the run's checkpointer registers its close)."""
    _on_fail.append(close)


def fail(message: str):
    """End the process on bad input: close what registered with `on_fail`, print `error: message`,
    exit with status 2."""
    for close in _on_fail:
        try:
            close()
        except Exception:   # already failing: the one-line message below is what matters
            pass
    print(f"error: {message}", file=sys.stderr, flush=True)
    sys.exit(EXIT_BAD_INPUT)


def set_quiet(quiet: bool = True) -> None:
    """Silence `note` in this process (the processes other than 0 of a multi-process run)."""
    global _quiet
    _quiet = quiet


def set_stderr_tty(tty: bool) -> None:
    """Say whether this process's stderr ends on a terminal: train.py's watched child writes into a
    pipe that its parent passes through to the terminal (jfsdp.runtime.supervisor)."""
    global _stderr_tty
    _stderr_tty = tty


def stderr_is_tty() -> bool:
    return sys.stderr.isatty() if _stderr_tty is None else _stderr_tty


def note(message: str) -> None:
    """A notice on stderr, unless this process is quiet."""
    if not _quiet:
        print(message, file=sys.stderr, flush=True)


@contextlib.contextmanager
def bad_input(*errors):
    """Within: a ConfigError (or one of `errors`) or an OSError ends the process through `fail`, as
    one line naming the problem (for an OSError, the file and the system's reason)."""
    try:
        yield
    except (ConfigError, *errors) as e:
        fail(str(e))
    except OSError as e:
        fail(f"{e.filename}: {e.strerror}")
