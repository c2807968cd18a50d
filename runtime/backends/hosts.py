"""The hosts backend: a job's meshes, run by the host agents of a Slurm job (one per host).

The controller's own transport connects to every agent (CURVE, the job's keys): a command for a mesh
is signed and sent once, and ZeroMQ copies it once per host whose agent subscribed to its topic (never
once per worker); each agent relays it to its host's workers and their replies back, so replies of every
mesh, local or remote, arrive on the controller's one reply socket. A link of its own to each agent
(signed with the job's key) starts, signals and stops workers and reports the ones lost. ZeroMQ's
heartbeats notice a host whose link went down within `Settings.heartbeat_timeout` seconds.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.utils.monitor

from monarch.runtime.backends.base import Backend, LostCallback
from monarch.runtime.backends.local import LocalBackend, await_ready, drain_output, take_startup
from monarch.runtime.common import groups, limits
from monarch.runtime.common.log import RateLimitedLog
from monarch.runtime.common.shape import Shape
from monarch.runtime.procs.jobfiles import AgentRecord, JobDir, Manifest
from monarch.runtime.wire import codec, protocol
from monarch.runtime.wire.controller_end import PeerStalled
from monarch.runtime.wire.links import LinkEnd, heartbeat
from monarch.runtime.wire.protocol import Control

_NOBLOCK = int(zmq.NOBLOCK)
_FORWARDED_ENV = ("MONARCH_LOG",)
"""The controller's variables its workers on other hosts get too (the agents' own environment is theirs)."""
ATTACH_TIMEOUT = 10.0
"""Seconds an agent gets to answer a controller that attaches."""
LEAD_TIMEOUT = 20.0
"""Seconds a rack's leader gets to say it leads: longer than it waits for its members' connections (10 s, naming
those it could not reach)."""


@dataclass
class Host:
    """One agent, as the controller sees it."""

    record: AgentRecord
    sock: zmq.Socket
    monitor: zmq.Socket
    link: LinkEnd
    info: Any = None
    """Its `AgentInfo`."""
    lost: str = ""
    """Why it is lost ("" while it answers)."""
    leader: int = -1
    """The host whose agent relays this one's commands and replies (its rack's leader, perhaps itself); -1: not
    racked, or no longer (its leader was lost): the controller's sockets connect to its own relay."""
    leading: dict[str, str] = field(default_factory=dict)
    """Where its rack's commands go in and replies come out ("cmd", "reply"), when it leads one (`agent/rack.py`)."""
    connected: dict[str, str] = field(default_factory=dict)
    """The addresses the controller's command, reply and store sockets connected to for this host."""

    @property
    def name(self) -> str:
        return f"{self.record.host} ({self.record.addr})"


@dataclass
class _Mesh:
    shape: Shape
    labels: list[str]
    hosts: dict[int, list[int]]
    """Host index -> the ranks it runs."""
    ready: dict[int, dict] = field(default_factory=dict)
    start_error: tuple[int, str] | None = None
    exited: dict[int, str] = field(default_factory=dict)
    """Rank -> cause, for workers lost while the mesh started."""
    running: bool = False
    stopped: dict[int, dict] = field(default_factory=dict)
    """Host index -> exit statuses it reported (`WorkersStopped`)."""
    here: tuple[list[int], ...] | None = None
    """The ranks of each of its hosts that is this machine (`workers_here`, asked at each call's wait: found once)."""


@dataclass
class _Sync:
    want: dict[int, list[str]] = field(default_factory=dict)
    done: dict[int, list[str]] = field(default_factory=dict)


class HostsBackend(Backend):
    """The meshes of one job's hosts. Made by `attach` (which raises, naming the host, if one does not
    answer); `close` detaches, leaving the agents running."""

    def __init__(
        self, local: LocalBackend, job: JobDir, on_lost: LostCallback, why_ended: Callable[[], str] = lambda: ""
    ) -> None:
        self.local = local
        self.job = job
        self.why_ended = why_ended
        """Says why the job's hosts went (e.g. 'Slurm job 12 was cancelled'), or "" (given by `slurm.jobs`)."""
        self.on_lost = on_lost
        self.settings = local.settings
        self.transport = local.transport
        self.replies = local.transport
        self.secret = job.secret()
        self.here = socket.gethostname()
        """This machine's host name (workers on an agent of that host share the controller's CPUs)."""
        self.ctx = self.transport.ctx
        self.hosts: list[Host] = []
        self.meshes: dict[int, _Mesh] = {}
        self.changed = local.procs.changed
        self.log = RateLimitedLog(f"monarch job {job.name}")
        self._lock = threading.Lock()  # the link sockets: any thread sends
        self._closed = False
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._thread: threading.Thread | None = None
        self._sync: _Sync | None = None
        self._sync_lock = threading.Lock()
        self._manifest: Manifest | None = None
        self.workspace: str | None = None
        """The job's workspace on this machine (the source of `sync_workspace`), if it has one."""

    # -- attaching ---------------------------------------------------------------------------------------
    def attach(self, records: list[AgentRecord]) -> None:
        """Connect to every agent and say hello; raise (nothing left connected) if one refuses or does not
        answer within `ATTACH_TIMEOUT`."""
        me = f"{socket.gethostname()}:{os.getpid()}"
        opened = len(getattr(self.ctx, "_sockets", ()))
        limits.check(
            f"job {self.job.name} ({len(records):,} hosts)", hosts=len(records), zmq_sockets=(self.ctx, opened)
        )
        try:
            for i, rec in enumerate(records):
                sock = self.ctx.socket(zmq.DEALER)
                sock.setsockopt(zmq.LINGER, 0)
                self.secret.curve.client(sock)
                heartbeat(sock, self.settings.heartbeat_timeout)
                monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED)
                sock.connect(rec.endpoints["ctl"])
                self.hosts.append(Host(rec, sock, monitor, LinkEnd(self.secret.key, codec.CONTROLLER, rec.index)))
                self._send(i, protocol.AgentHello(me))
            deadline = time.monotonic() + ATTACH_TIMEOUT
            for i, host in enumerate(self.hosts):
                poller = zmq.Poller()
                poller.register(host.sock, zmq.POLLIN)
                poller.register(host.monitor, zmq.POLLIN)
                while host.info is None:
                    left = deadline - time.monotonic()
                    ready = dict(poller.poll(max(1, int(left * 1000)))) if left > 0 else {}
                    if host.monitor in ready:
                        event = zmq.utils.monitor.recv_monitor_message(host.monitor)
                        if event["event"] == zmq.EVENT_CONNECT_RETRIED:
                            raise ConnectionError(
                                f"job {self.job.name}: the agent on {host.name} is not listening (its job ended, or "
                                "it was killed); monarch.notebook.list_jobs() shows the job's state"
                            )
                        continue
                    if host.sock not in ready:
                        raise ConnectionError(
                            f"job {self.job.name}: the agent on {host.name} did not answer within "
                            f"{ATTACH_TIMEOUT:.0f} s (is the job still running? monarch.notebook.list_jobs())"
                        )
                    msg = self._recv(i)
                    if type(msg) is protocol.AgentInfo:
                        if msg.refused:
                            raise ConnectionError(
                                f"job {self.job.name}: the agent on {host.name} refused: {msg.refused}"
                            )
                        host.info = msg
            if len(self.hosts) > max(1, self.settings.rack_above):
                self._rack(time.monotonic() + LEAD_TIMEOUT)
            for host in self.hosts:
                racked = host.leader >= 0
                host.connected = (
                    {"store": host.record.endpoints["store"], **host.leading} if racked else host.record.endpoints
                )
            left = max(1.0, deadline - time.monotonic())
            slow = self.transport.connect_agents([h.connected for h in self.hosts], self.secret.curve, left)
            if slow:
                names = ", ".join(self.hosts[i].name for i in slow)
                raise ConnectionError(
                    f"job {self.job.name}: the command connection to the agent on {names} was not made within "
                    f"{ATTACH_TIMEOUT:.0f} s (is the job still running? monarch.notebook.list_jobs())"
                )
        except BaseException:
            self._close_links()
            self._close_wake()
            raise
        self._thread = threading.Thread(target=self._serve, name=f"monarch-job-{self.job.name}", daemon=True)
        self._thread.start()

    def _rack(self, deadline: float) -> None:
        """Make every `Settings.rack_size` consecutive hosts a rack, led by its first host's agent, which relays
        their commands and replies (`agent/rack.py`); wait until each leader says where they go in and come out."""
        size = self.settings.rack_size
        leaders = range(0, len(self.hosts), size)
        for first in leaders:
            members = range(first, min(first + size, len(self.hosts)))
            for m in members:
                self.hosts[m].leader = first
            relays = {m: {name: self.hosts[m].record.endpoints[name] for name in ("cmd", "reply")} for m in members}
            self._send(first, protocol.Lead(relays))
        for first in leaders:
            host = self.hosts[first]
            while not host.leading:
                left = deadline - time.monotonic()
                if left <= 0 or not host.sock.poll(max(1, int(left * 1000))):
                    raise ConnectionError(
                        f"job {self.job.name}: the agent on {host.name} did not take the lead of its rack within "
                        f"{LEAD_TIMEOUT:.0f} s (an agent of an older version? MONARCH_RACK_ABOVE=0 racks no job)"
                    )
                msg = self._recv(first)
                if type(msg) is not protocol.Leading:
                    continue
                if msg.missing:
                    raise ConnectionError(
                        f"job {self.job.name}: the agent on {host.name}, leading its rack, could not reach the relays "
                        f"at {', '.join(msg.missing)}"
                    )
                host.leading = dict(msg.endpoints)

    def _rack_mesh(self, mesh_id: int, key: bytes, placement: dict[int, list[int]]) -> None:
        """Tell each rack's leader which of its hosts run the mesh and their ranks (no `key`: the mesh is gone)."""
        racks: dict[int, dict[int, tuple[int, ...]]] = {}
        for i, ranks in placement.items():
            leader = self.hosts[i].leader
            if leader >= 0 and not self.hosts[leader].lost:
                racks.setdefault(leader, {})[i] = tuple(ranks) if key else ()
        for leader, ranks in racks.items():
            self._send(leader, protocol.RackMesh(mesh_id, key, ranks if key else {}))

    # -- the links ---------------------------------------------------------------------------------------
    def _send(self, i: int, message: Any, body: list | None = None) -> None:
        host = self.hosts[i]
        with self._lock:
            frames = host.link.encode(message, body)
            with contextlib.suppress(zmq.ZMQError):
                host.sock.send_multipart(frames, _NOBLOCK)

    def _recv(self, i: int) -> Any:
        """One message from agent `i` (checked), or None for one that failed its checks."""
        host = self.hosts[i]
        with self._lock:
            try:
                frames = host.sock.recv_multipart(_NOBLOCK, copy=False)
            except zmq.Again:
                return None
        try:
            env = host.link.decode(frames)
            host.link.accept(env)
            return env.message
        except (codec.BadSignature, ValueError) as e:
            self.log("a message", f"from {host.name}: {e}")
            return None

    def _serve(self) -> None:
        poller = zmq.Poller()
        for h in self.hosts:
            poller.register(h.sock, zmq.POLLIN)
            poller.register(h.monitor, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        by_sock = {h.sock: i for i, h in enumerate(self.hosts)}
        by_monitor = {h.monitor: i for i, h in enumerate(self.hosts)}
        while not self._closed:
            try:
                for sock, _ in poller.poll(1000):
                    if self._closed:
                        return
                    if sock in by_sock:
                        i = by_sock[sock]
                        while True:
                            with self._lock:
                                more = self.hosts[i].sock.poll(0)
                            if not more:
                                break
                            msg = self._recv(i)
                            if msg is not None:
                                self._handle(i, msg)
                    elif sock in by_monitor:
                        i = by_monitor[sock]
                        event = zmq.utils.monitor.recv_monitor_message(sock)
                        if event["event"] == zmq.EVENT_DISCONNECTED:
                            self._host_lost(
                                i,
                                f"stopped answering (no heartbeat for {self.settings.heartbeat_timeout:g} s, or its agent died)",
                            )
            except zmq.ContextTerminated:
                return
            except Exception:
                if self._closed:
                    return
                self.log("a message", traceback.format_exc(limit=4))

    def _handle(self, i: int, msg: Any) -> None:
        if type(msg) is protocol.WorkerLost:
            mesh = self.meshes.get(msg.mesh_id)
            if mesh is None:
                return
            if mesh.running:
                self.on_lost(msg.mesh_id, msg.rank, msg.cause)
            else:
                with self.changed:
                    mesh.exited[msg.rank] = msg.cause
                    self.changed.notify_all()
        elif type(msg) in (protocol.SyncWant, protocol.Synced) and self._sync is not None:
            with self.changed:
                if type(msg) is protocol.SyncWant:
                    self._sync.want[i] = list(msg.paths)
                else:
                    self._sync.done[i] = list(msg.changed)
                self.changed.notify_all()
        elif type(msg) is protocol.WorkersStopped:
            mesh = self.meshes.get(msg.mesh_id)
            if mesh is not None:
                with self.changed:
                    mesh.stopped[i] = msg.codes
                    self.changed.notify_all()

    def _host_lost(self, i: int, why: str) -> None:
        host = self.hosts[i]
        if host.lost:
            return
        ended = self.why_ended()
        if ended:
            why = ended
        host.lost = why
        members = [m for m, h in enumerate(self.hosts) if h.leader == i and m != i and not h.lost and not ended]
        if members and host.leading:  # (its agent may live on behind a silent link: two paths would reorder)
            self.transport.disconnect_agent(host.leading)
        for m in members:  # its rack's other hosts: their commands and replies go directly from now on
            member = self.hosts[m]
            member.leader = -1
            direct = {name: member.record.endpoints[name] for name in ("cmd", "reply")}
            self.transport.connect_agent(direct, self.secret.curve)
            member.connected = {**member.connected, **direct}
        self._lose_ranks(i, f"{'whose' if ended else 'which'} {why}")
        for m in members:  # what they sent through the leader that it had not passed on is lost with it
            self._lose_ranks(
                m, f"whose replies came through the agent of host {host.name} (its rack's leader), which {why}"
            )

    def _lose_ranks(self, i: int, why: str) -> None:
        """Host `i`'s ranks are lost to every mesh they are of, `why`."""
        host = self.hosts[i]
        for mesh_id, mesh in list(self.meshes.items()):
            ranks = mesh.hosts.get(i)
            if not ranks:
                continue
            cause = f"is on host {host.name}, {why}"
            if mesh.running:
                for rank in ranks:  # (each: a mesh with actors goes on without them; one without stops at the first)
                    if mesh.running:
                        self.on_lost(mesh_id, rank, cause)
            else:
                with self.changed:
                    mesh.exited.update(dict.fromkeys(ranks, cause))
                    self.changed.notify_all()

    # -- the workspace -----------------------------------------------------------------------------------
    def sync_workspace(self, directory: str, timeout: float = 120.0) -> dict[str, list[str]]:
        """Make every host's copy of the workspace match `directory`: each agent says which files its copy
        lacks or has otherwise (by content hash), and only those travel. Returns host -> files changed."""
        with self._sync_lock:
            if self._manifest is None or str(self._manifest.root) != str(directory):
                self._manifest = Manifest(directory)
            files = self._manifest.files()
            live = [i for i, h in enumerate(self.hosts) if not h.lost]
            self._sync = sync = _Sync()
            try:
                for i in live:
                    self._send(i, protocol.SyncOffer(files))
                self._await(lambda: all(i in sync.want or self.hosts[i].lost for i in live), timeout, "its files")
                for i in live:
                    paths = sync.want.get(i) or []
                    if paths:
                        body = codec.dumps([self._manifest.read(p) for p in paths])
                        self._send(i, protocol.SyncFiles(paths), body)
                self._await(lambda: all(i in sync.done or self.hosts[i].lost for i in live), timeout, "the copy")
            finally:
                self._sync = None
            lost = [self.hosts[i].name for i in live if self.hosts[i].lost]
            if lost:
                raise ConnectionError(f"job {self.job.name}: host {', '.join(lost)} was lost during the sync")
            return {self.hosts[i].name: sync.done[i] for i in live}

    def _await(self, done: Callable[[], bool], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        with self.changed:
            while not done():
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(
                        f"job {self.job.name}: the agents did not answer about {what} in {timeout:.0f} s"
                    )
                self.changed.wait(min(left, 0.1))

    # -- the Backend seam --------------------------------------------------------------------------------
    def start(
        self, mesh_id: int, shape: Shape, labels: list[str], progress: Callable[[int], None] | None = None
    ) -> list[dict]:
        if "host" not in shape.names or shape.size("host") != len(self.hosts):
            raise ValueError(
                f"a mesh of job {self.job.name} has a 'host' dimension of size {len(self.hosts)}; got {shape.describe()}"
            )
        lost = [h.name for h in self.hosts if h.lost]
        if lost:
            raise ConnectionError(f"job {self.job.name}: host {', '.join(lost)} is lost; reserve the job again")
        n = len(shape)
        keys = self.transport.add_mesh(mesh_id, n)
        placement: dict[int, list[int]] = {}
        points = list(shape.points())
        for coords, rank in points:
            placement.setdefault(coords["host"], []).append(rank)
        mesh = _Mesh(shape, labels, placement)
        self.meshes[mesh_id] = mesh
        self.local.expect_startup(mesh_id, lambda env: take_startup(mesh, env))
        ok = False
        try:
            if keys:
                self._rack_mesh(mesh_id, keys[0].key, placement)
            by_rank = {rank: coords for coords, rank in points}
            for i in range(len(self.hosts)):
                starts = []
                for local_rank, rank in enumerate(placement.get(i, [])):
                    k = keys[rank]
                    starts.append((rank, by_rank[rank], labels[rank], local_rank, (k.key, k.mesh_topic, k.rank_topic)))
                env = {name: os.environ[name] for name in _FORWARDED_ENV if name in os.environ}
                start = protocol.StartWorkers(
                    mesh_id, n, shape.size_dict, starts, self.settings.group_timeout, env, list(sys.path), os.getcwd()
                )
                self._send(i, start)
            await_ready(self.changed, mesh, n, self.settings.spawn_timeout, progress, lambda: dict(mesh.exited))
            ok = True
        except BaseException:
            self.stop(mesh_id, graceful=False)
            raise
        finally:
            self.local.expect_startup(mesh_id, None)
        mesh.running = ok
        return [mesh.ready[r] for r in range(n)]

    def send(self, mesh_id: int, ranks: tuple[int, ...] | None, message: Any, body: list | None = None) -> None:
        try:
            self.transport.send(mesh_id, ranks, message, body)
        except PeerStalled as e:
            mesh = self.meshes.get(mesh_id)
            if mesh is not None:
                rank = min(e.ranks) if e.ranks else 0
                self.on_lost(
                    mesh_id,
                    rank,
                    f"took no commands for {e.seconds:.0f} s while {self.settings.send_hwm} were queued for it; "
                    "it was dropped (MONARCH_SEND_STALL, MONARCH_SEND_HWM)",
                )

    def _by_host(self, mesh_id: int, ranks: tuple[int, ...]) -> dict[int, tuple[int, ...]]:
        mesh = self.meshes.get(mesh_id)
        if mesh is None:
            return {}
        wanted = set(ranks)
        return {i: tuple(r for r in rs if r in wanted) for i, rs in mesh.hosts.items() if wanted.intersection(rs)}

    def interrupt(self, mesh_id: int, ranks: tuple[int, ...], call_id: int) -> None:
        for i, rs in self._by_host(mesh_id, ranks).items():
            self._send(i, protocol.SignalWorkers(mesh_id, rs, call_id, int(protocol.Control.INTERRUPT)))

    def spans_hosts(self, mesh_id: int) -> bool:
        mesh = self.meshes.get(mesh_id)
        return mesh is not None and len(mesh.hosts) > 1

    def workers_here(self, mesh_id: int, ranks: tuple[int, ...]) -> int:
        mesh = self.meshes.get(mesh_id)
        if mesh is None:
            return 0
        here = mesh.here
        if here is None:
            here = mesh.here = tuple(rs for i, rs in mesh.hosts.items() if self.hosts[i].record.host == self.here)
        if not here:
            return 0
        if len(ranks) == len(mesh.shape):  # (the whole mesh, asked at each wait)
            return sum(len(rs) for rs in here)
        wanted = set(ranks)
        return sum(len(wanted.intersection(rs)) for rs in here)

    def control(self, mesh_id: int, ranks: tuple[int, ...], call_id: int, kind: Control) -> None:
        for i, rs in self._by_host(mesh_id, ranks).items():
            self._send(i, protocol.SignalWorkers(mesh_id, rs, call_id, int(kind)))

    def mark_gone(self, mesh_id: int) -> None:
        self.local.store.set(groups.gone_key(mesh_id), b"1")

    def kill(self, mesh_id: int) -> None:
        mesh = self.meshes.get(mesh_id)
        if mesh is None:
            return
        mesh.running = False
        for i in mesh.hosts:
            self._send(i, protocol.StopWorkers(mesh_id, 0.0))

    def stop(self, mesh_id: int, graceful: bool) -> dict[int, int | None]:
        mesh = self.meshes.get(mesh_id)
        if mesh is None:
            return {}
        mesh.running = False
        grace = self.settings.exit_grace if graceful else 0.0
        if graceful:
            self.send(mesh_id, None, protocol.Exit())
        live = [i for i in mesh.hosts if not self.hosts[i].lost]
        for i in live:
            self._send(i, protocol.StopWorkers(mesh_id, grace))
        deadline = time.monotonic() + grace + 5
        with self.changed:
            while any(i not in mesh.stopped and not self.hosts[i].lost for i in live):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self.changed.wait(min(left, 0.1))
        codes: dict[int, int | None] = {}
        for c in mesh.stopped.values():
            codes.update({int(r): v for r, v in c.items()})
        if graceful:
            drain_output(self.transport, mesh_id, codes)
        self.meshes.pop(mesh_id, None)
        self._rack_mesh(mesh_id, b"", mesh.hosts)
        self.transport.remove_mesh(mesh_id)
        self.local.store.forget_mesh(mesh_id)
        return codes

    def close(self) -> None:
        """Detach: the agents stay (and kill what this controller left running, when its links close)."""
        for mesh_id in list(self.meshes):
            self.stop(mesh_id, graceful=False)
        self._closed = True
        os.write(self._wake_w, b"x")
        if self._thread is not None:
            self._thread.join(2)
        self._close_links()
        if self._thread is None or not self._thread.is_alive():
            self._close_wake()

    def _close_wake(self) -> None:
        """The wake-up pipe: two descriptors per attach, left open by every detach before issue 30."""
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)

    def _close_links(self) -> None:
        for host in self.hosts:
            self.transport.disconnect_agent(host.connected or host.record.endpoints)
            with self._lock:
                with contextlib.suppress(zmq.ZMQError):
                    host.sock.disable_monitor()
                host.monitor.close(0)
                host.sock.close(0)
