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
import sys
from typing import Any

from monarch.runtime import memory as _memory
from monarch.runtime.memory import Allocation, MemorySnapshots, RankMemory

__all__ = ["record_memory_history", "dump_memory_snapshot", "MemorySnapshots", "RankMemory", "Allocation"]


def record_memory_history(enabled: str | None = "all", max_entries: int = 100_000, *, mesh: Any = None) -> None:
    """Start recording each worker's allocations: `enabled="all"` keeps their history and live state,
    `"state"` the live allocations only, None stops; at most `max_entries` events per worker."""
    _memory.record_memory_history(enabled, max_entries, mesh=_mesh(mesh))


def dump_memory_snapshot(dir_snapshots: str | os.PathLike = "./snapshots/", *, mesh: Any = None) -> MemorySnapshots:
    """Write ``DIR/snapshot_rank{N}.pickle`` for each worker (after the tensor commands issued so far ran)
    and return them, each summarized."""
    return _memory.dump_memory_snapshot(dir_snapshots, mesh=_mesh(mesh))


def _mesh(mesh: Any) -> Any:
    """`mesh`, else None where `mesh.activate()` or a worker decides, else the notebook's `%%mesh` mesh."""
    if mesh is not None or _on_worker():
        return mesh
    from monarch.runtime.mesh import active_mesh

    return None if active_mesh() is not None else _notebook_mesh()


def _on_worker() -> bool:
    from monarch.runtime import context

    return context.worker is not None


def _notebook_mesh() -> Any:
    """The mesh the notebook's last `%%mesh` cell ran on (what `%mesh` commands act on), if it runs."""
    magics = sys.modules.get("monarch.extension.magics")
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    if magics is None or shell is None:
        return None
    loaded = getattr(magics, "_loaded", {}).get(id(shell))
    for view in (getattr(loaded, "current", None), getattr(loaded, "implicit", None)):
        if view is not None and view.state == "running":
            return view
    return None


def _html(snapshots: MemorySnapshots) -> str:
    from monarch.widgets.memory_view import memory_html

    return memory_html(snapshots)


_memory.html_view = _html
