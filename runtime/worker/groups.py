"""A worker's torch.distributed groups, as one object.

The mesh's default group is made at start through the controller's store (`wire/store.py`).
Groups for mesh dimensions are made on the controller's order (`protocol.MakeGroups`), on every worker
in the same order. Streams other than main get copies of their own (collectives of two streams over one
group would be paired up in whatever order each worker's threads reach them); moves get two-worker
groups; moves between spawned meshes get links that meet through the store.
"""

from __future__ import annotations

import datetime
import math
import os
import re
import socket
import threading
import time
from typing import Any

import torch
import torch.distributed as dist

from monarch.runtime.common import groups as shared
from monarch.runtime.worker import local_reduce

current: Groups | None = None
"""This worker's groups (set when torch is set up: at start, or on the controller's `ReadyTorch`)."""
handed_over = False
"""The mesh's groups were handed over to torchrun-style code before they were set up (`spmd.hand_over`)."""
HANDED_OVER = (
    "this mesh's process groups were handed over to torchrun-style code (monarch.spmd.setup_torch_elastic_env): "
    "use the groups that code makes (torch.distributed's default group, init_device_mesh)"
)


class Groups:
    def __init__(self, store: Any, mesh_id: int, rank: int, sizes: dict, timeout: float, backend: str) -> None:
        self.store = store
        """The controller's store (a `torch.distributed.Store`; each thread has its own connection)."""
        self.mesh_id = mesh_id
        self.rank = rank
        self.world = math.prod(sizes.values())
        self.backend = backend
        self.timeout = datetime.timedelta(seconds=timeout)
        self.partitions: dict[int, tuple] = {}
        """Group id -> its rank partition, in the order made (re-formed in that order)."""
        self.broken = False
        """Torn down to release this worker from a collective: re-formed on the controller's word."""
        self.generation = 0
        """How many times the controller had the groups re-formed (`reform`)."""
        self._reforming = threading.Lock()
        self.handed_over = False
        """The default group was given up to code that makes its own (`setup_torch_elastic_env`)."""
        if handed_over or dist.is_initialized():  # given up to torchrun-style code before torch was set up here
            self.prefix, self.by_id, self.handed_over = "", {}, True
            self._stream_copies, self._pairs, self._links, self._local = {}, {}, {}, {}
        else:
            self._init(0)
        shared.resolver = self.resolve

    def _init(self, generation: int) -> None:
        self.prefix = f"monarch/{self.mesh_id}/" + (f"g{generation}/" if generation else "")
        dist.set_debug_level_from_env()  # TORCH_DISTRIBUTED_DEBUG as this mesh was started with (the fork
        # server read it when it preloaded torch, perhaps before the user set it)
        dist.init_process_group(
            self.backend,
            store=dist.PrefixStore(self.prefix, self.store),
            rank=self.rank,
            world_size=self.world,
            timeout=self.timeout,
        )
        self.by_id: dict[int, Any] = {shared.WORLD: dist.group.WORLD}
        """Group id -> this worker's group (None where it is no member), or the error creating it raised."""
        self._stream_copies: dict[tuple, Any] = {}
        self._pairs: dict[tuple, Any] = {}
        self._links: dict[str, Any] = {}
        self._local: dict[tuple[int, int], local_reduce.LocalReducer | None] = {}

    def create(self, gid: int, partition: tuple) -> None:
        """Create every group of one partition (collectively: every worker of the mesh calls this), keep ours."""
        self.partitions[gid] = partition
        mine = None
        try:
            if self.handed_over:
                raise RuntimeError(HANDED_OVER)
            for ranks in partition:
                group = dist.new_group(list(ranks))
                if self.rank in ranks:
                    mine = group
        except Exception as e:  # reported when the group is used
            mine = e
        self.by_id[gid] = mine

    def resolve(self, gid: int, dims: tuple[str, ...], mesh: str) -> Any:
        """The group a `ProcessGroupRef` names, on this worker; a RuntimeError saying why there is none."""
        if self.handed_over:
            raise RuntimeError(HANDED_OVER)
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

    def local(self, gid: int, sid: int, group: Any) -> local_reduce.LocalReducer | None:
        """The shared-memory reducer of group `gid` on stream `sid` (`group`: `for_stream`'s), met on first
        use (collectively: every member reaches its first reduce in the same order), or None where the
        group's workers are not all on this machine."""
        key = (sid, gid)
        if key not in self._local:
            ranks = dist.get_process_group_ranks(self.by_id[gid])
            name = f"{self.prefix}local/{sid}/{gid}/{'-'.join(map(str, ranks))}/"
            store = dist.PrefixStore(name, self.store)
            self._local[key] = None  # (if meeting raises, this rank asks no more: the reduce fails instead)
            self._local[key] = local_reduce.meet(store, group.rank(), group.size(), self.timeout.total_seconds())
        return self._local[key]

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

    def ours(self) -> list[Any]:
        """The groups this object made (the default one, dimensions', streams', pairs, links)."""
        made = [g for g in self.by_id.values() if g is not None and not isinstance(g, BaseException)]
        return made + [*self._stream_copies.values(), *self._pairs.values(), *self._links.values()]

    def users(self) -> list[Any]:
        """Groups user code made (dist.new_group, init_device_mesh, ...)."""
        mine = {id(g) for g in self.ours()}
        return [g for g in users_groups() if id(g) not in mine]

    def release(self) -> None:
        """Make every collective this worker (and its peers) waits in raise: abort NCCL communicators, shut
        down the connections to the other workers (gloo's). The groups, the user's too, are broken until
        `reform` (which remakes ours)."""
        self.broken = True
        for reducer in list(self._local.values()):
            if reducer is not None:
                reducer.abort()
        shut(self.ours() + self.users())

    def release_generation(self, generation: int) -> None:
        """`release`, if the groups are still those of `generation` (a request that arrives after they were
        re-formed is for groups gone: it must not break the new ones)."""
        if not self._reforming.acquire(timeout=1.0):
            return  # (re-forming now: the request is stale)
        try:
            if self.generation == generation and not self.broken:
                self.release()
        finally:
            self._reforming.release()

    def hand_over(self) -> None:
        """Give up the mesh's groups (the default one too): code written for torchrun makes its own from the
        environment. The mesh's own groups (`mesh.process_group`, the tensor engine's) say so when used."""
        self.destroy()
        self.by_id = {}
        self._stream_copies, self._pairs, self._links, self._local = {}, {}, {}, {}
        self.handed_over = True

    def reform(self, generation: int) -> None:
        """Make the mesh's groups again, after `release` here or on another worker (collectively: every
        worker calls this, in the same order). Groups user code made are not remade."""
        if self.handed_over:  # (the user's groups were broken by the release: theirs to make again)
            self.generation, self.broken = generation, False
            return
        with self._reforming:
            self.destroy()
            self._init(generation)
            for gid, partition in list(self.partitions.items()):
                self.create(gid, partition)
            self.generation = generation
            self.broken = False

    def destroy(self) -> None:
        """Tear the groups down, waiting at most 5 s (a communicator stuck on a dead peer may never let go)."""
        if not dist.is_initialized():
            return
        t = threading.Thread(target=_destroy, name="monarch-destroy", daemon=True)
        t.start()
        t.join(5)


def users_groups() -> list[Any]:
    """Every process group of this process torch knows (on a worker without the mesh's own: the user's)."""
    pg_map = getattr(getattr(dist.distributed_c10d, "_world", None), "pg_map", {})
    return list(pg_map)


def shut(made: list[Any]) -> None:
    """Make the collectives of `made` (and any other of this worker's connections to its peers) raise, here and
    on the peers: abort NCCL communicators, shut gloo's connections down. Also for a worker that never set the
    mesh's groups up (it ran only actors): code there (torchrun-style) made its own."""
    for group in made:
        try:
            if dist.get_backend(group) == "nccl":
                dist.distributed_c10d._abort_process_group(group)
        except Exception:
            pass
    for fd in peer_sockets():
        try:
            s = socket.socket(fileno=os.dup(fd))
            try:
                s.shutdown(socket.SHUT_RDWR)
            finally:
                s.close()
        except OSError:
            pass


def _destroy() -> None:
    try:
        dist.destroy_process_group()
    except Exception:
        pass


def _socket_inodes(pid: int | str) -> dict[str, int]:
    """Socket inode -> fd, for process `pid`."""
    out = {}
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return out
    for fd in fds:
        try:
            m = re.fullmatch(r"socket:\[(\d+)\]", os.readlink(f"/proc/{pid}/fd/{fd}"))
        except OSError:
            continue
        if m:
            out[m.group(1)] = int(fd)
    return out


def _tcp_tables() -> tuple[dict[str, tuple[str, str]], dict[str, str]]:
    """TCP sockets on this machine, read once: established ones, inode -> (local, remote address); and
    listening ones, inode -> local address."""
    established: dict[str, tuple[str, str]] = {}
    listening: dict[str, str] = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            if len(cols) > 9 and cols[3] == "01":  # ESTABLISHED
                established[cols[9]] = (cols[1], cols[2])
            elif len(cols) > 9 and cols[3] == "0A":  # LISTEN
                listening[cols[9]] = cols[1]
    return established, listening


def peer_sockets() -> list[int]:
    """This worker's file descriptors of its process groups' and links' TCP connections: those whose other
    end belongs to a sibling (another worker forked by the same parent, on this host), and those accepted by
    its own listeners bound to one address (gloo's; workers on other hosts connected to them). A rank on
    another host whose connection to this one was accepted there is shut by that rank (every rank of the
    call is asked: `protocol.Control.DISCONNECT`). A user's connections elsewhere and a server on all interfaces
    are left alone."""
    parent, me = os.getppid(), os.getpid()
    siblings = []
    for name in os.listdir("/proc"):
        if name.isdigit() and int(name) != me:
            try:
                with open(f"/proc/{name}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == parent:
                        siblings.append(name)
            except (OSError, ValueError, IndexError):
                pass
    theirs = set()
    for pid in siblings:
        theirs.update(_socket_inodes(pid))
    table, listeners = _tcp_tables()
    by_ends = {ends: inode for inode, ends in table.items()}
    mine = _socket_inodes(me)
    # (our own listeners bound to one address: not 0.0.0.0 nor ::)
    listening = {local for inode, local in listeners.items() if inode in mine and local.split(":")[0].strip("0")}
    out = []
    for inode, fd in mine.items():
        ends = table.get(inode)
        if ends is not None and (by_ends.get((ends[1], ends[0])) in theirs or ends[0] in listening):
            out.append(fd)
    return out
