"""The device mesh: `RxS` = R replicas (axis `data`) of S shards (axis `fsdp`).

Parsing and validating a spec needs no jax, so the command lines check `--mesh` and count the devices
it needs before jax starts; `make_mesh` imports jax when it is called."""
from __future__ import annotations

import dataclasses
import re

from jfsdp.config.errors import ConfigError

DATA_AXIS, FSDP_AXIS = "data", "fsdp"
AXES = (DATA_AXIS, FSDP_AXIS)


@dataclasses.dataclass(frozen=True)
class MeshSpec:
    """R replicas x S shards."""
    replicas: int
    shards: int

    @property
    def devices(self) -> int:
        return self.replicas * self.shards

    def describe(self) -> str:
        """'2x8 (2 replicas x 8 shards)': the spec and what its axes are."""
        return f"{self.replicas}x{self.shards} ({self.replicas} replicas x {self.shards} shards)"


def parse_mesh(spec: str) -> tuple[int, int]:
    """'2x8' -> (2, 8). Both sizes must be positive integers."""
    m = re.fullmatch(r"\s*(\d+)\s*[xX]\s*(\d+)\s*", str(spec))
    if not m:
        raise ConfigError(f"mesh '{spec}' is malformed: expected RxS with positive integers, e.g. 2x8")
    r, s = int(m.group(1)), int(m.group(2))
    if r < 1 or s < 1:
        raise ConfigError(f"mesh '{spec}' is malformed: both sizes must be at least 1, e.g. 2x8")
    return r, s


def mesh_spec(spec: str) -> MeshSpec:
    """'2x8' -> MeshSpec(2, 8)."""
    return MeshSpec(*parse_mesh(spec))


def make_mesh(spec: str, devices=None):
    """A `data` x `fsdp` mesh over exactly R*S devices (all of `jax.devices()` unless given)."""
    import jax
    import numpy as np
    from jax.sharding import Mesh

    r, s = parse_mesh(spec)
    devices = list(jax.devices() if devices is None else devices)
    if r * s != len(devices):
        raise ConfigError(f"mesh {r}x{s} needs {r * s} devices but {len(devices)} are present "
                          f"({devices[0].platform if devices else 'none'}); pass devices= to use a subset")
    return Mesh(np.array(devices).reshape(r, s), AXES)


def mesh_shape(mesh) -> tuple[int, int]:
    """(R, S) of a jax mesh made by `make_mesh`."""
    return mesh.shape[DATA_AXIS], mesh.shape[FSDP_AXIS]


def platform(mesh) -> str:
    """The platform of a mesh's devices: 'cpu', 'gpu', 'tpu' (compile-only GPU devices say 'gpu' too)."""
    return mesh.devices.flat[0].platform
