"""torch.distributed groups for mesh dimensions.

The controller names each distinct partition of ranks with a group id and tells every worker of the
spawned mesh to create it, in the same order on all of them (torch.distributed requires that). A
`ProcessGroupRef` passed to a live function unpickles on the worker as that worker's group.
"""

from __future__ import annotations

from typing import Any

WORLD = 0
"""Group id of the mesh's default group."""

# Worker side: group id -> this worker's torch.distributed group (None where it is no member),
# or the exception raised while creating it.
_groups: dict[int, Any] = {}
store: Any = None
"""Worker side: the controller's torch.distributed store (for groups made after start-up)."""
prefix = ""
"""Worker side: this mesh's key prefix in that store."""
timeout: Any = None
"""Worker side: how long collectives wait (a `datetime.timedelta`)."""


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


def _resolve(gid: int, dims: tuple[str, ...], mesh: str):
    if gid not in _groups:
        raise RuntimeError(
            f"process group for dimensions {dims} of mesh {mesh} is unknown on this worker; "
            "groups can only be used on the mesh that made them"
        )
    group = _groups[gid]
    if isinstance(group, BaseException):
        raise RuntimeError(f"creating the process group for dimensions {dims} failed: {group}")
    if group is None:
        raise RuntimeError(f"this worker is not a member of the process group for dimensions {dims} of {mesh}")
    return group


def create(gid: int, rank: int, rank_lists: list[tuple[int, ...]]) -> None:
    """Worker side: create every group of one partition (collectively), keep ours."""
    import torch.distributed as dist

    mine = None
    try:
        for ranks in rank_lists:
            group = dist.new_group(list(ranks))
            if rank in ranks:
                mine = group
    except Exception as e:  # reported when the group is used
        mine = e
    _groups[gid] = mine
