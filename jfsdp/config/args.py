"""The command lines' argument parser. jax-free."""
from __future__ import annotations

import argparse
import sys


class ArgParser(argparse.ArgumentParser):
    """argparse's parser, but bad arguments end like every other bad input: one line `error: ...` on
    stderr and exit status 2 (argparse prints the usage first)."""

    def error(self, message):
        print(f"error: {message}", file=sys.stderr)
        sys.exit(2)
