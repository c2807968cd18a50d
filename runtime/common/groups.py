"""Naming torch.distributed groups across the process boundary.

The controller names each distinct partition of a mesh's ranks with a group id and has every worker
create it (`protocol.MakeGroups`). A `ProcessGroupRef` passed to a live function unpickles on a worker
as that worker's group, looked up through the resolver the worker installs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

WORLD = 0
"""Group id of the mesh's default group."""

resolver: Callable[[int, tuple[str, ...], str], Any] | None = None
"""Set by a worker at start: group id -> that worker's group (raises if it has none)."""


def gone_key(mesh_id: int) -> str:
    """The store key the controller sets once a mesh has stopped or failed (so that workers of other
    meshes waiting to meet one of its workers give up)."""
    return f"monarch/gone/{mesh_id}"


class ProcessGroupRef:
    """Names a process group on the controller; becomes the group itself on a worker."""

    def __init__(self, gid: int, dims: tuple[str, ...], mesh: str):
        self.gid = gid
        self.dims = dims
        self.mesh = mesh

    def __repr__(self) -> str:
        return f"ProcessGroupRef(dims={self.dims}, mesh={self.mesh})"

    def __reduce__(self):
        return _resolve, (self.gid, self.dims, self.mesh)


def _resolve(gid: int, dims: tuple[str, ...], mesh: str) -> Any:
    if resolver is None:
        raise RuntimeError(f"process group for dimensions {dims} of mesh {mesh} is only usable on its workers")
    return resolver(gid, dims, mesh)
