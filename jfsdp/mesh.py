"""The device mesh: `RxS` = R replicas (axis `data`) of S shards (axis `fsdp`)."""
from __future__ import annotations

import re

import jax
import numpy as np
from jax.sharding import Mesh

DATA, FSDP = "data", "fsdp"
AXES = (DATA, FSDP)


class ConfigError(ValueError):
    """Bad user input (mesh, strategy, batch, model...): the message names the problem."""


def parse_mesh(spec: str) -> tuple[int, int]:
    """'2x8' -> (2, 8). Both sizes must be positive integers."""
    m = re.fullmatch(r"\s*(\d+)\s*[xX]\s*(\d+)\s*", str(spec))
    if not m:
        raise ConfigError(f"mesh '{spec}' is malformed: expected RxS with positive integers, e.g. 2x8")
    r, s = int(m.group(1)), int(m.group(2))
    if r < 1 or s < 1:
        raise ConfigError(f"mesh '{spec}' is malformed: both sizes must be at least 1, e.g. 2x8")
    return r, s


def make_mesh(spec: str, devices=None) -> Mesh:
    """A `data` x `fsdp` mesh over exactly R*S devices (all of `jax.devices()` unless given)."""
    r, s = parse_mesh(spec)
    devices = list(jax.devices() if devices is None else devices)
    if r * s != len(devices):
        raise ConfigError(f"mesh {r}x{s} needs {r * s} devices but {len(devices)} are present "
                          f"({devices[0].platform if devices else 'none'}); pass devices= to use a subset")
    return Mesh(np.array(devices).reshape(r, s), AXES)


def mesh_shape(mesh: Mesh) -> tuple[int, int]:
    return mesh.shape[DATA], mesh.shape[FSDP]
