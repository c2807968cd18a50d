"""`monarch.memory`: memory snapshots of every worker of a mesh, one file per rank.

    with mesh.activate():
        monarch.memory.record_memory_history()
        for step in range(2):
            loss = net(torch.randn(8, DIM)); loss.backward()
        monarch.memory.dump_memory_snapshot(dir_snapshots="./snapshots/")   # snapshot_rank{N}.pickle

CUDA workers write torch's own snapshot; CPU workers record with torch's profiler and write the same
format (`monarch.runtime.worker.memory` documents it). Open a file in pytorch.org/memory_viz; in a notebook
the returned `MemorySnapshots` draws each rank's memory over time and its largest allocations. Which mesh:
`mesh=`, else the one of the innermost `mesh.activate()`, else the notebook's `%%mesh` mesh. On a worker
(inside a live function or a `%%mesh` cell) they act on that worker alone.
"""

from __future__ import annotations

import os
from typing import Any

from monarch._default_mesh import default_mesh
from monarch.runtime.tools import memory as _memory
from monarch.runtime.tools.memory import Allocation, MemorySnapshots, RankMemory

__all__ = ["record_memory_history", "dump_memory_snapshot", "MemorySnapshots", "RankMemory", "Allocation"]


def record_memory_history(enabled: str | None = "all", max_entries: int = 100_000, *, mesh: Any = None) -> None:
    """Start recording each worker's allocations: `enabled="all"` keeps their history and live state,
    `"state"` the live allocations only, None stops; at most `max_entries` events per worker."""
    _memory.record_memory_history(enabled, max_entries, mesh=default_mesh(mesh))


def dump_memory_snapshot(dir_snapshots: str | os.PathLike = "./snapshots/", *, mesh: Any = None) -> MemorySnapshots:
    """Write ``DIR/snapshot_rank{N}.pickle`` for each worker (after the tensor commands issued so far ran)
    and return them, each summarized."""
    return _memory.dump_memory_snapshot(dir_snapshots, mesh=default_mesh(mesh))


def _html(snapshots: MemorySnapshots) -> str:
    from monarch.widgets.memory_view import memory_html

    return memory_html(snapshots)


_memory.html_view = _html
