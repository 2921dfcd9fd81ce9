"""The device mesh: `RxS` = R replicas (axis `data`) of S shards (axis `fsdp`), and with `tensor=T` > 1 a
third axis `tensor` of size T, innermost, so that a tensor-parallel group is T consecutive devices (one
NVLink node): mesh axes (data, fsdp, tensor), R*S*T devices. With `context=C` > 1 an axis `context` of size
C goes between `fsdp` and `tensor` (context parallelism: the sequence split over it, docs/context-parallel.md):
(data, fsdp, context[, tensor]), R*S*C*T devices. An axis of size 1 is left out, so with T = C = 1 the mesh
is the two-axis mesh it always was (the same programs, bit for bit).

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
    """R replicas x S shards (x C context-parallel ranks) (x T tensor-parallel ranks)."""
    replicas: int
    shards: int
    tensor: int = 1
    context: int = 1

    @property
    def devices(self) -> int:
        return self.replicas * self.shards * self.context * self.tensor

    @property
    def axes(self) -> tuple:
        """The mesh's axis names: (data, fsdp), then `context` when C > 1 and `tensor` when T > 1."""
        return AXES + ((CONTEXT_AXIS,) if self.context > 1 else ()) + ((TENSOR_AXIS,) if self.tensor > 1 else ())

    @property
    def shape(self) -> tuple:
        """The sizes of `axes`, in their order."""
        return ((self.replicas, self.shards) + ((self.context,) if self.context > 1 else ())
                + ((self.tensor,) if self.tensor > 1 else ()))

    def describe(self) -> str:
        """'2x8 (2 replicas x 8 shards)': the spec and what its axes are."""
        flags = "".join(f" --{n} {v}" for n, v in (("context", self.context), ("tensor", self.tensor)) if v > 1)
        parts = [f"{self.replicas} replicas", f"{self.shards} shards"] + [
            f"{v} {what} ranks" for v, what in ((self.context, "context-parallel"), (self.tensor, "tensor-parallel"))
            if v > 1]
        return f"{self.replicas}x{self.shards}{flags} ({' x '.join(parts)})"

    def check_seq_len(self, seq_len: int) -> None:
        """ConfigError unless the sequence splits over `context` (2C equal chunks, for the zigzag load balance)
        and `tensor` (sequence parallelism): seq_len a multiple of 2C*T when C > 1, of T otherwise."""
        if self.context > 1 and seq_len % (2 * self.context * self.tensor):
            raise ConfigError(f"--seq-len {seq_len} does not split over --context {self.context}"
                              + (f" and --tensor {self.tensor}" if self.tensor > 1 else "")
                              + f": context parallelism cuts each sequence into 2*C = {2 * self.context} equal chunks"
                              + (f", each split over T = {self.tensor}" if self.tensor > 1 else "")
                              + f", so it must be a multiple of {2 * self.context * self.tensor}")
        if seq_len % self.tensor:
            raise ConfigError(f"--tensor {self.tensor} does not divide --seq-len {seq_len} (sequence parallelism "
                              "splits the sequence)")


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


def check_context(context) -> int:
    """The context-parallel size C: an integer of at least 1 (ConfigError otherwise)."""
    if isinstance(context, bool) or not isinstance(context, int) or context < 1:
        raise ConfigError(f"context (the context-parallel size) must be an integer of at least 1, got {context!r}")
    return context


def mesh_spec(spec: str, tensor: int = 1, context: int = 1) -> MeshSpec:
    """'2x8' -> MeshSpec(2, 8); with tensor=T and context=C, MeshSpec(2, 8, T, C)."""
    return MeshSpec(*parse_mesh(spec), check_tensor(tensor), check_context(context))


def make_mesh(spec: str, devices=None, tensor: int = 1, context: int = 1):
    """A `data` x `fsdp` mesh over exactly R*S devices (all of `jax.devices()` unless given); with
    context=C > 1 and/or tensor=T > 1, the `context` and `tensor` axes after them, `tensor` innermost
    (consecutive devices): R*S*C*T devices. An axis of size 1 is left out: T = C = 1 is the two-axis mesh."""
    import jax
    import numpy as np
    from jax.sharding import Mesh

    m = mesh_spec(spec, tensor, context)
    devices = list(jax.devices() if devices is None else devices)
    if m.devices != len(devices):
        what = f"{m.replicas}x{m.shards}" + "".join(f" with {n} {v}" for n, v in (("context", m.context),
                                                                                  ("tensor", m.tensor)) if v > 1)
        raise ConfigError(f"mesh {what} needs {m.devices} devices but {len(devices)} are present "
                          f"({devices[0].platform if devices else 'none'}); pass devices= to use a subset")
    return Mesh(np.array(devices).reshape(m.shape), m.axes)


def mesh_shape(mesh) -> tuple[int, int]:
    """(R, S) of a jax mesh made by `make_mesh`."""
    return mesh.shape[DATA_AXIS], mesh.shape[FSDP_AXIS]


def tensor_size(mesh) -> int:
    """T: the size of the mesh's `tensor` axis (1 on a two-axis mesh)."""
    return mesh.shape.get(TENSOR_AXIS, 1)


def context_size(mesh) -> int:
    """C: the size of the mesh's `context` axis (1 on a mesh without one)."""
    return mesh.shape.get(CONTEXT_AXIS, 1)


def platform(mesh) -> str:
    """The platform of a mesh's devices: 'cpu', 'gpu', 'tpu' (compile-only GPU devices say 'gpu' too)."""
    return mesh.devices.flat[0].platform
