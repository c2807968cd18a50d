"""A worker's torch.distributed groups, as one object.

The mesh's default group is made at start through the controller's store (`backends/store.py`).
Groups for mesh dimensions are made on the controller's order (`protocol.MakeGroups`), on every worker
in the same order. Streams other than main get copies of their own (collectives of two streams over one
group would be paired up in whatever order each worker's threads reach them); moves get two-worker
groups; moves between spawned meshes get links that meet through the store.
"""

from __future__ import annotations

import datetime
import math
import threading
import time
from typing import Any

import torch
import torch.distributed as dist

from monarch.runtime import groups as shared

current: Groups | None = None
"""This worker's groups (set at start)."""


class Groups:
    def __init__(self, store: Any, mesh_id: int, rank: int, sizes: dict, timeout: float, backend: str) -> None:
        self.store = store
        """The controller's store (a `torch.distributed.Store`; each thread has its own connection)."""
        self.prefix = f"monarch/{mesh_id}/"
        self.rank = rank
        self.timeout = datetime.timedelta(seconds=timeout)
        dist.init_process_group(
            backend,
            store=dist.PrefixStore(self.prefix, store),
            rank=rank,
            world_size=math.prod(sizes.values()),
            timeout=self.timeout,
        )
        self.by_id: dict[int, Any] = {shared.WORLD: dist.group.WORLD}
        """Group id -> this worker's group (None where it is no member), or the error creating it raised."""
        self._stream_copies: dict[tuple, Any] = {}
        self._pairs: dict[tuple, Any] = {}
        self._links: dict[str, Any] = {}
        shared.resolver = self.resolve

    def create(self, gid: int, partition: tuple) -> None:
        """Create every group of one partition (collectively: every worker of the mesh calls this), keep ours."""
        mine = None
        try:
            for ranks in partition:
                group = dist.new_group(list(ranks))
                if self.rank in ranks:
                    mine = group
        except Exception as e:  # reported when the group is used
            mine = e
        self.by_id[gid] = mine

    def resolve(self, gid: int, dims: tuple[str, ...], mesh: str) -> Any:
        """The group a `ProcessGroupRef` names, on this worker; a RuntimeError saying why there is none."""
        if gid not in self.by_id:
            raise RuntimeError(
                f"process group for dimensions {dims} of mesh {mesh} is unknown on this worker; "
                "groups can only be used on the mesh that made them"
            )
        group = self.by_id[gid]
        if isinstance(group, BaseException):
            raise RuntimeError(f"creating the process group for dimensions {dims} failed: {group}")
        if group is None:
            raise RuntimeError(f"this worker is not a member of the process group for dimensions {dims} of {mesh}")
        return group

    def for_stream(self, gid: int, sid: int, dev_type: str = "cpu") -> Any:
        """Group `gid` for stream `sid`: the group itself on main; elsewhere the stream's own copy, per
        device type (made on first use: gloo for CPU tensors, NCCL for CUDA ones)."""
        group = self.by_id[gid]
        if sid == 0 or group is None or isinstance(group, BaseException):
            return group
        copy = self._stream_copies.get((sid, gid, dev_type))
        if copy is None:
            ranks = dist.get_process_group_ranks(group)
            name = f"{self.prefix}stream/{sid}/{gid}/{dev_type}/{'-'.join(map(str, ranks))}/"
            copy = self._stream_copies[(sid, gid, dev_type)] = self._make(name, group.rank(), ranks, dev_type)
        return copy

    def pair(self, peer: int, sid: int, dev_type: str) -> tuple[Any, int]:
        """(backend, the peer's rank in it) for sends between this worker and global rank `peer` on stream
        `sid`: the default group on main; elsewhere a two-worker group of the stream's own, made by the two
        alone (a copy of the whole group would wait for workers the move skips)."""
        me = self.rank
        if sid == 0:
            return self.by_id[shared.WORLD]._get_backend(torch.device(dev_type)), peer
        lo, hi = sorted((me, peer))
        pg = self._pairs.get((sid, lo, hi, dev_type))
        if pg is None:
            name = f"{self.prefix}stream/{sid}/pair/{lo}-{hi}/{dev_type}/"
            pg = self._pairs[(sid, lo, hi, dev_type)] = self._make(name, 0 if me == lo else 1, [lo, hi], dev_type)
        return pg, 1 if me == lo else 0

    def link(self, name: str, rank: int, peer_mesh: int) -> Any:
        """The link `name` to a worker of another spawned mesh (sender rank 0, receiver rank 1). The first
        use waits for the other side to arrive, or for the controller to mark the other mesh gone (then it
        raises: nobody waits for a mesh that is not coming)."""
        pg = self._links.get(name)
        if pg is None:
            store = dist.PrefixStore(f"monarch/link/{name}/", self.store)
            store.set(f"here/{rank}", b"1")
            other, gone = f"here/{1 - rank}", shared.gone_key(peer_mesh)
            pause, deadline = 0.0005, time.monotonic() + self.timeout.total_seconds()
            while not store.check([other]):  # check, not wait: a wait cannot also watch for `gone`
                if self.store.check([gone]):
                    raise RuntimeError("the other mesh stopped or failed before it took its side of the move")
                if time.monotonic() > deadline:  # alive but never there, as long as a collective would wait
                    raise TimeoutError(f"the other mesh did not take its side of the move in {self.timeout}")
                time.sleep(pause)
                pause = min(2 * pause, 0.02)
            pg = self._links[name] = dist.ProcessGroupGloo(store, rank, 2, self.timeout)
        return pg

    def _make(self, name: str, rank: int, ranks: list[int], dev_type: str) -> Any:
        """A group of `ranks` meeting under `name` in the store: gloo, or NCCL for CUDA tensors."""
        store = dist.PrefixStore(name, self.store)
        if dev_type == "cuda":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = self.timeout
            opts.global_ranks_in_group = ranks
            return dist.ProcessGroupNCCL(store, rank, len(ranks), opts)  # its communicator is made on first use
        return dist.ProcessGroupGloo(store, rank, len(ranks), self.timeout)

    def destroy(self) -> None:
        """Tear the groups down, waiting at most 5 s (a communicator stuck on a dead peer may never let go)."""
        if not dist.is_initialized():
            return
        t = threading.Thread(target=_destroy, name="monarch-destroy", daemon=True)
        t.start()
        t.join(5)


def _destroy() -> None:
    try:
        dist.destroy_process_group()
    except Exception:
        pass
