"""Meshes of worker processes: `from monarch.actor import this_host`."""

from monarch.runtime.common.context import current_rank, current_size
from monarch.runtime.mesh import HostMesh, MeshTable, ProcMesh, this_host

__all__ = ["this_host", "HostMesh", "ProcMesh", "MeshTable", "current_rank", "current_size"]
