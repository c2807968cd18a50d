"""What a worker knows about itself, for code running on it.

Live functions can call `current_rank()` / `current_size()` to learn their coordinates in the mesh
they were called on (a slice or a renamed view has its own coordinates).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from monarch.runtime.common.mesh_trait import Point


@dataclass
class WorkerInfo:
    """Set once when a worker starts."""

    rank: int
    """Global rank in the spawned mesh (also the torch.distributed rank)."""
    coords: dict[str, int]
    """Coordinates in the spawned mesh."""
    sizes: dict[str, int]
    """Sizes of the spawned mesh."""
    local_rank: int
    """Index among the workers on this host; picks the GPU."""
    device: Any
    """The `torch.device` this worker owns."""
    mesh_id: int = -1
    """The spawned mesh it belongs to (its controller's number for it)."""


@dataclass
class CallView:
    """The mesh view the current call was made on."""

    coords: dict[str, int] = field(default_factory=dict)
    sizes: dict[str, int] = field(default_factory=dict)


worker: WorkerInfo | None = None
view = CallView()
cell_namespace: dict[str, Any] | None = None
"""The `%%mesh` cells' namespace on this worker, once a cell ran (errors name the user's objects by it)."""
live_functions = False
"""Whether this (controller's) process made a live function (`@monarch.remote`): a program of live functions
gets workers that set torch up at start (`WorkerStart.torch`), as one that imported torch does."""


def _need_worker() -> WorkerInfo:
    if worker is None:
        raise RuntimeError("not on a monarch worker: current_rank() is for code running on a mesh")
    return worker


def current_rank() -> Point:
    """Where this worker is in the mesh view the running call (or actor message) was sent to: a `Point`,
    ``point["gpu"]`` its index along ``gpu``, ``point.rank`` its row-major index, ``point.extent`` the view's
    sizes; ``mesh.slice(**point)`` picks it."""
    _need_worker()
    return Point.of(view.coords, view.sizes)


def current_size() -> dict[str, int]:
    """Sizes of the mesh view the running call was made on."""
    _need_worker()
    return dict(view.sizes)
