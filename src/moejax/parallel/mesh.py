"""Device meshes from ``--mesh pipe=P,data=D,expert=E[,tensor=T]``.

The mesh always has the four axes, outermost first. Devices are ordered by (process, id)
and laid out row-major, so the innermost axes (tensor, expert) vary fastest and stay on
one host's fast links, while the outer axes (data, pipe) cross hosts.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from moejax.config import ConfigError

AXES = ("pipe", "data", "expert", "tensor")


@dataclasses.dataclass(frozen=True)
class MeshSpec:
    pipe: int = 1
    data: int = 1
    expert: int = 1
    tensor: int = 1

    def __post_init__(self) -> None:
        for axis in AXES:
            size = getattr(self, axis)
            if not isinstance(size, int) or isinstance(size, bool) or size < 1:
                raise ConfigError(f"mesh.{axis}={size!r}: must be a positive integer")

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(getattr(self, axis) for axis in AXES)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def __str__(self) -> str:
        return ",".join(f"{axis}={getattr(self, axis)}" for axis in AXES)

    @classmethod
    def parse(cls, text: str) -> "MeshSpec":
        """Parses 'data=2,expert=4'; axes left out have size 1."""
        sizes: dict[str, int] = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            name, sep, value = part.partition("=")
            name = name.strip()
            if not sep or name not in AXES:
                raise ConfigError(f"--mesh {text!r}: {part!r} must be AXIS=N with AXIS one of "
                                  f"{AXES}")
            if name in sizes:
                raise ConfigError(f"--mesh {text!r}: axis {name!r} given twice")
            try:
                sizes[name] = int(value)
            except ValueError:
                raise ConfigError(f"--mesh {text!r}: {name}={value!r} is not an integer") from None
        return cls(**sizes)

    def as_overrides(self) -> list[str]:
        """``--set`` strings that put this layout in a config's ``mesh`` section (where
        the config checks it against the model and the batch)."""
        return [f"mesh.{axis}={getattr(self, axis)}" for axis in AXES]


def ordered_devices(devices: Sequence[jax.Device] | None = None) -> list[jax.Device]:
    """Devices sorted so that one process's (one node's) devices are contiguous."""
    devices = list(jax.devices() if devices is None else devices)
    return sorted(devices, key=lambda d: (d.process_index, d.id))


def build_mesh(spec: MeshSpec, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A mesh with axes ``AXES`` over all devices (or ``devices``)."""
    devices = ordered_devices(devices)
    if spec.size != len(devices):
        raise ConfigError(f"--mesh {spec}: the axis sizes multiply to {spec.size}, but there "
                          f"are {len(devices)} devices; the product must equal the device count")
    grid = np.array(devices, dtype=object).reshape(spec.shape)
    return Mesh(grid, AXES, axis_types=(AxisType.Auto,) * len(AXES))


def expert_axis_nodes(mesh: Mesh) -> tuple[int, ...]:
    """Node (process) index of each position along the ``expert`` axis.

    Read at the first position of the other axes; the layout puts one node's devices next
    to each other, so the same holds at every other position.
    """
    line = mesh.devices[0, 0, :, 0]
    return tuple(int(d.process_index) for d in line)
