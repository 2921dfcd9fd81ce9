"""The calibration file of an adaptive MoE stage (train.py's and jfsdp.plan's --moe-calibration): measured seconds
per step per (capacity, mode, chunks), which jfsdp.planning.moe_calibrate measures and `jfsdp.MoE(calibration=...)`
takes. jax-free, so that train.py refuses a bad file before it starts jax."""
from __future__ import annotations

import json
import math
import os

from jfsdp.config.errors import ConfigError


def table(rows) -> dict:
    """{(capacity, mode, chunks): seconds} from rows of dicts with those keys: `MoE.calibration`."""
    return {(r["capacity"], r["mode"], r["chunks"]): r["seconds"] for r in rows}


def read(path: str) -> dict:
    """`table` of a calibration file (train.py's and jfsdp.plan's --moe-calibration): JSON, either a list of
    rows {"capacity", "mode", "chunks", "seconds"} or an object holding that list under "calibration", as
    benchmarks/moe_adaptive.py writes each of its parts. `FILE:PART` reads the object's entry PART (that
    benchmark's file: `benchmarks/results/moe_adaptive.json:cpu`); a file with one part that holds a
    calibration needs no PART. Anything else is a ConfigError naming the file and what is wrong."""
    part = None
    if not os.path.exists(path) and ":" in path:
        path, part = path.rsplit(":", 1)
    try:
        with open(path) as f:
            data = json.load(f)
    except OSError as e:
        raise ConfigError(f"moe calibration {path}: {e.strerror or e}") from None
    except ValueError as e:
        raise ConfigError(f"moe calibration {path}: not JSON ({e})") from None
    if part is not None:
        if not isinstance(data, dict) or not isinstance(data.get(part), dict):
            raise ConfigError(f"moe calibration {path}: no part '{part}'"
                              + (f" (it has {', '.join(sorted(data))})" if isinstance(data, dict) else ""))
        data = data[part]
    if isinstance(data, dict) and "calibration" not in data:
        parts = [k for k, v in data.items() if isinstance(v, dict) and "calibration" in v]
        if len(parts) != 1:
            raise ConfigError(f"moe calibration {path}: " + (f"several parts hold a calibration ({', '.join(parts)}): "
                              f"name one as {path}:PART" if parts else "no \"calibration\" list in it"))
        data = data[parts[0]]
    rows = data["calibration"] if isinstance(data, dict) else data
    if not isinstance(rows, list) or not rows:
        raise ConfigError(f"moe calibration {path}: expected a non-empty list of {{capacity, mode, chunks, seconds}} rows")
    for i, r in enumerate(rows):
        ok = (isinstance(r, dict) and all(isinstance(r.get(k), int) and not isinstance(r.get(k), bool) and r[k] >= 1
                                          for k in ("capacity", "chunks"))
              and r.get("mode") in ("gather", "ep") and isinstance(r.get("seconds"), (int, float))
              and not isinstance(r.get("seconds"), bool) and math.isfinite(r["seconds"]) and r["seconds"] > 0)
        if not ok:
            raise ConfigError(f"moe calibration {path}: row {i} {json.dumps(r)[:120]} is not {{capacity: int >= 1, mode: "
                              "gather|ep, chunks: int >= 1, seconds: > 0}")
    return table(rows)


def check_calibrate(path: str, moe: str, calibration: str | None) -> None:
    """train.py's --moe-calibrate FILE (measure the calibration on the run's devices, then write it): only with
    --moe adaptive, not beside --moe-calibration, and FILE's folder must exist and be writable."""
    if moe != "adaptive":
        raise ConfigError("--moe-calibrate applies to --moe adaptive")
    if calibration:
        raise ConfigError("--moe-calibrate measures what --moe-calibration reads: give one of them")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
        raise ConfigError(f"--moe-calibrate {path}: cannot write to {folder}")
