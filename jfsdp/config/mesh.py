"""The device mesh: `RxS` = R replicas (axis `data`) of S shards (axis `fsdp`), and with `tensor=T` > 1 a
third axis `tensor` of size T, innermost, so that a tensor-parallel group is T consecutive devices (one
NVLink node): mesh axes (data, fsdp, tensor), R*S*T devices. A fourth axis, `context`, will go between
`fsdp` and `tensor`. With T = 1 the mesh is the two-axis mesh it always was (the same programs, bit for bit).

Parsing and validating a spec needs no jax, so the command lines check `--mesh` and count the devices
it needs before jax starts; `make_mesh` imports jax when it is called."""
from __future__ import annotations

import dataclasses
import re

from jfsdp.config.errors import ConfigError

DATA_AXIS, FSDP_AXIS, CONTEXT_AXIS, TENSOR_AXIS = "data", "fsdp", "context", "tensor"
AXES = (DATA_AXIS, FSDP_AXIS)   # the axes the batch's rows are split over


@dataclasses.dataclass(frozen=True)
class MeshSpec:
    """R replicas x S shards (x T tensor-parallel ranks)."""
    replicas: int
    shards: int
    tensor: int = 1

    @property
    def devices(self) -> int:
        return self.replicas * self.shards * self.tensor

    @property
    def axes(self) -> tuple:
        """The mesh's axis names: (data, fsdp), and `tensor` last when T > 1."""
        return AXES + ((TENSOR_AXIS,) if self.tensor > 1 else ())

    def describe(self) -> str:
        """'2x8 (2 replicas x 8 shards)': the spec and what its axes are."""
        if self.tensor > 1:
            return (f"{self.replicas}x{self.shards} --tensor {self.tensor} ({self.replicas} replicas x {self.shards} "
                    f"shards x {self.tensor} tensor-parallel ranks)")
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


def check_tensor(tensor) -> int:
    """The tensor-parallel size T: an integer of at least 1 (ConfigError otherwise)."""
    if isinstance(tensor, bool) or not isinstance(tensor, int) or tensor < 1:
        raise ConfigError(f"tensor (the tensor-parallel size) must be an integer of at least 1, got {tensor!r}")
    return tensor


def mesh_spec(spec: str, tensor: int = 1) -> MeshSpec:
    """'2x8' -> MeshSpec(2, 8); with tensor=T, MeshSpec(2, 8, T)."""
    return MeshSpec(*parse_mesh(spec), check_tensor(tensor))


def make_mesh(spec: str, devices=None, tensor: int = 1):
    """A `data` x `fsdp` mesh over exactly R*S devices (all of `jax.devices()` unless given); with
    tensor=T > 1, a `data` x `fsdp` x `tensor` mesh over R*S*T devices, `tensor` innermost (consecutive
    devices). T = 1 is the two-axis mesh."""
    import jax
    import numpy as np
    from jax.sharding import Mesh

    m = mesh_spec(spec, tensor)
    devices = list(jax.devices() if devices is None else devices)
    if m.devices != len(devices):
        what = f"{m.replicas}x{m.shards}" + (f" with tensor {m.tensor}" if m.tensor > 1 else "")
        raise ConfigError(f"mesh {what} needs {m.devices} devices but {len(devices)} are present "
                          f"({devices[0].platform if devices else 'none'}); pass devices= to use a subset")
    if m.tensor == 1:
        return Mesh(np.array(devices).reshape(m.replicas, m.shards), AXES)
    return Mesh(np.array(devices).reshape(m.replicas, m.shards, m.tensor), m.axes)


def mesh_shape(mesh) -> tuple[int, int]:
    """(R, S) of a jax mesh made by `make_mesh`."""
    return mesh.shape[DATA_AXIS], mesh.shape[FSDP_AXIS]


def tensor_size(mesh) -> int:
    """T: the size of the mesh's `tensor` axis (1 on a two-axis mesh)."""
    return mesh.shape.get(TENSOR_AXIS, 1)


def platform(mesh) -> str:
    """The platform of a mesh's devices: 'cpu', 'gpu', 'tpu' (compile-only GPU devices say 'gpu' too)."""
    return mesh.devices.flat[0].platform
