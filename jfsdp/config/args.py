"""The command lines' argument parser: a bad flag is one `error: ...` line and exit status 2, like every
other bad input (argparse's own prints the usage and the error). jax-free."""
from __future__ import annotations

import argparse
import re
import sys

from jfsdp.config.errors import ConfigError

EXIT_BAD_INPUT = 2   # the exit status of every bad input (a ConfigError at the command line)


ASYNC_TP = ("auto", "on", "off")   # --async-tp, train.py's and the planner's
RING_ATTENTION = ("auto", "cudnn", "blockwise")   # --ring-attention, train.py's and the planner's (C > 1)


def async_tp_option(value: str, tensor: int) -> bool | None:
    """fully_shard's `async_tp` for --async-tp auto / on / off at --tensor T: None (auto: on GPUs), True,
    False; ConfigError for on at T = 1, where there is nothing to overlap."""
    if value == "on" and tensor == 1:
        raise ConfigError("--async-tp on needs --tensor T > 1: it overlaps the tensor-parallel collectives")
    return None if value == "auto" or tensor == 1 else value == "on"


class ArgParser(argparse.ArgumentParser):
    """argparse's parser; a bad flag ends like every other bad input."""

    def error(self, message):
        print(f"error: {message} (see --help)", file=sys.stderr, flush=True)
        sys.exit(EXIT_BAD_INPUT)


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str) -> int:
    """A size as people write it: '80GiB' -> 85899345920, '80GB' -> 80e9, '1024' -> 1024 (ConfigError
    otherwise). `python -m jfsdp.plan --device-memory` and train.py's JFSDP_MEMORY_BUDGET read it."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS or float(m.group(1)) <= 0:
        raise ConfigError(f"device memory '{text}' does not parse: expected a size such as 80GiB, 40GB or 1024MiB")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])
