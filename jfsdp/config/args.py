"""The command lines' argument parser: a bad flag is one `error: ...` line and exit status 2, like every
other bad input (argparse's own prints the usage and the error). jax-free."""
from __future__ import annotations

import argparse
import sys

EXIT_BAD_INPUT = 2   # the exit status of every bad input (a ConfigError at the command line)


class ArgParser(argparse.ArgumentParser):
    """argparse's parser; a bad flag ends like every other bad input."""

    def error(self, message):
        print(f"error: {message} (see --help)", file=sys.stderr, flush=True)
        sys.exit(EXIT_BAD_INPUT)
