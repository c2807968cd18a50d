"""The sockets between a controller and its workers, both ends, and what keeps them safe.

- Commands go down one XPUB socket (one send reaches every worker of a mesh) on secret topics: each
  mesh has one, each worker one, handed over privately at start. Subscriptions are applied by hand
  (manual mode), only for those topics, so a stranger's subscription matches nothing and it receives
  nothing. A worker's full queue is backpressure (never a silent drop); one that stays full fails the
  mesh, saying so.
- Replies, output and input requests come up a PULL socket with a bounded queue.
- Every message is signed with its mesh's key (`codec`: keyed BLAKE2b or HMAC-SHA256) and checked before anything is unpickled;
  it names its sender and carries a sequence number, and a receiver refuses any number it has seen.
- Local sockets live in a directory only this user can open. TCP sockets bind one interface and use
  ZeroMQ's CURVE encryption; a client is admitted only with the key pair of a running mesh.
- Whatever fails these checks is dropped and logged, at most one line per kind every few seconds.

This module is the controller's end; `worker_end` is the workers'. Only the `wire` package calls
`codec.encode` / `codec.decode`.
"""

from __future__ import annotations

import contextlib
import os
import select
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import zmq
import zmq.utils.monitor

from monarch.runtime.common import limits
from monarch.runtime.common.config import Settings
from monarch.runtime.common.log import RateLimitedLog
from monarch.runtime.wire import codec, fanin, lanes, protocol
from monarch.runtime.wire.hold import HOLD, _Swap
from monarch.runtime.wire.keys import HELLO, TOPIC, UPSTREAM, AgentCurve, ServerCurve, WorkerKeys
from monarch.runtime.wire.lanes import Lane, LaneServer
from monarch.runtime.wire.links import heartbeat

_NOBLOCK = int(zmq.NOBLOCK)
_STARTUP = (protocol.Ready, protocol.StartFailed)
_SNDMORE = int(zmq.SNDMORE)
REPLY_HWM = 10_000
"""Messages the controller queues per worker connection on the reply socket (past this, the worker
holds its output until the controller reads; its memory, not ours)."""
JUNK_HWM = 16
"""Messages queued from one connection on sockets where only start-up messages are expected."""
AGENTS = fanin.AGENTS
"""Sender ranks at or below this are host agents (`wire/fanin.py`) or racks (`agent/rack.py`): `Bundle`s."""
_INT = {int}
POKE = object()
"""`ControllerTransport.recv`'s answer for a poke: an empty message that wakes a blocked receiver."""
DROPPED = object()
"""`ControllerTransport.recv`'s answer for a message that failed its checks (already logged)."""


def _send_whole(sock: zmq.Socket[bytes], topic: bytes, frames: list[bytes | memoryview]) -> None:
    """One message on `topic`, all its frames or (zmq.Again: a subscriber's queue is full) none."""
    if len(frames) == 1:
        sock.send(topic + frames[0], _NOBLOCK)
        return
    sock.send(topic + frames[0], _NOBLOCK | _SNDMORE)  # a full queue refuses the first frame; the rest then go
    sock.send_multipart(frames[1:], _NOBLOCK, copy=False)


@dataclass
class _Mesh:
    key: bytes
    topic: bytes
    rank_topics: list[bytes]
    client_public: bytes | None
    seq: int = 0
    """Sequence number of the last message sent to this mesh's workers."""
    seen: list[int] = field(default_factory=list)
    """Per rank: sequence number of the last message taken from that worker (on the reply socket)."""
    hello_seen: list[int] = field(default_factory=list)
    """The same for start-up messages, which come up the command socket: the two sockets' messages are numbered
    from one counter but may arrive in either order (output sent just after `Ready` can overtake it)."""
    goodbyes: set[int] = field(default_factory=set)
    """Ranks whose `Goodbye` arrived: all they sent before it has arrived too."""
    agents_seen: dict[int, int] = field(default_factory=dict)
    """Per host agent (its sender rank, `fanin.agent_sender`): the sequence number of its last `Bundle`."""
    lanes: list[Lane | None] | None = None
    """Per rank, the worker's lane once its first message came (`wire/lanes.py`); None: the mesh's workers
    use the command and reply sockets."""


@dataclass(slots=True)
class _Held:
    """A lane's message checked as it was read that the transport acts on itself (start-up, `Goodbye`): queued
    with the rest and acted on in its turn, when the receiver gets to it (`_deliverable`), so that a
    `Goodbye` counts only once everything sent before it was handled."""

    env: codec.Envelope
    mesh: _Mesh
    lane: Lane


class PeerStalled(Exception):
    """A worker has not taken its commands for `send_stall` seconds while its queue was full."""

    def __init__(self, mesh_id: int, ranks: tuple[int, ...] | None, seconds: float):
        self.mesh_id, self.ranks, self.seconds = mesh_id, ranks, seconds
        super().__init__(f"a worker of mesh {mesh_id} took no commands for {seconds:.0f} s")


class ControllerTransport:
    """The controller's sockets: commands down (XPUB), replies up (PULL), the store's (ROUTER).

    Thread use (a ZeroMQ socket used by two threads at once can abort the process): the command socket
    is used under `send_lock` (any thread sends; the backend's monitor reads start-up messages under it);
    the reply socket under `recv_lock` (held by the one thread that receives); the store's socket only
    by the store's thread (`store_owner` runs anything else on it there).
    """

    def __init__(self, settings: Settings, directory: str) -> None:
        self.settings = settings
        self.ctx = zmq.Context()
        limits.size_context(self.ctx)  # (before its first socket: fixed from then on)
        self.curve = ServerCurve(self.ctx) if settings.transport == "tcp" else None
        self.cmd = self._socket(zmq.XPUB, sndhwm=settings.send_hwm, rcvhwm=JUNK_HWM)
        self.cmd.setsockopt(zmq.XPUB_MANUAL, 1)  # we apply subscriptions: only to topics we handed out
        self.cmd.setsockopt(zmq.XPUB_NODROP, 1)  # a full queue is an error (backpressure), not a silent drop
        self.reply = self._socket(zmq.PULL, rcvhwm=REPLY_HWM)
        # (not `send_hwm`: a store answer that finds its queue full is dropped, and its worker waits for it;
        # each client has one request at a time, so the queue stays short anyway)
        self.store = self._socket(zmq.ROUTER, sndhwm=REPLY_HWM, rcvhwm=REPLY_HWM)
        self.store.setsockopt(zmq.ROUTER_MANDATORY, 1)
        if settings.transport == "ipc":
            for sock, name in ((self.cmd, "cmd"), (self.reply, "reply"), (self.store, "store")):
                sock.bind(f"ipc://{directory}/{name}")
        else:
            for sock in (self.cmd, self.reply, self.store):
                sock.bind(f"tcp://{settings.bind_addr}:0")
        self.cmd_addr, self.reply_addr, self.store_addr = (
            s.getsockopt_string(zmq.LAST_ENDPOINT) for s in (self.cmd, self.reply, self.store)
        )
        # An empty message on the reply socket wakes whoever receives (a call failed on another thread).
        wake = f"inproc://monarch-wake-{id(self)}"
        self.reply.bind(wake)
        self._waker = self.ctx.socket(zmq.PUSH)
        self._waker.setsockopt(zmq.LINGER, 0)
        self._waker.connect(wake)
        self._waker_lock = threading.Lock()
        self.send_lock = threading.Lock()
        self.recv_lock = threading.RLock()
        """Held by whoever uses the reply socket (the controller's receive lock: see `Replies`)."""
        self.store_owner: Callable[[Callable[[], None]], None] | None = None
        """Runs a function on the thread that owns the store's socket, and waits for it (set by the store)."""
        self._meshes: dict[int, _Mesh] = {}
        self._topics: dict[bytes, tuple[int, int]] = {}
        """Topic -> (mesh id, rank), rank -1 for a mesh's own topic."""
        self._store_seen: dict[tuple[bytes, ...], tuple[int, int]] = {}
        """Store connection -> (its mesh, the sequence number of its last request)."""
        self._rcvtimeo = -1
        self.goodbyes = threading.Condition()
        """Notified when a worker's `Goodbye` arrives (`await_goodbyes`)."""
        self.log = RateLimitedLog("monarch")
        self.closed = False
        self.lanes = (
            LaneServer(f"{directory}/lanes", self.log) if settings.transport == "ipc" and settings.lanes else None
        )
        """Local workers' connections (`wire/lanes.py`); its epoll also watches the reply socket."""
        if self.lanes is not None:
            self.lanes.watch(cast(int, self.reply.getsockopt(zmq.FD)))
        self._zmq_maybe = True
        """Whether the reply socket may hold a message (lanes: it is read until empty before the epoll waits)."""
        self.bundles = 0
        self.bundled = 0
        """Host agents' bundles taken, and the items in them (for tests and benchmarks: how replies came)."""
        self.on_startup: Callable[[codec.Envelope], None] | None = None
        """Takes start-up messages (`Ready`, `StartFailed`) that came over a lane (set by the local backend)."""

    def _socket(self, kind: int, sndhwm: int = 1000, rcvhwm: int = 1000) -> zmq.Socket[bytes]:
        s = self.ctx.socket(kind)
        s.setsockopt(zmq.SNDHWM, sndhwm)
        s.setsockopt(zmq.RCVHWM, rcvhwm)
        s.setsockopt(zmq.LINGER, 0)
        if self.curve is not None:
            self.curve.serve(s)
        return s

    # -- host agents ------------------------------------------------------------------------------
    def connect_agent(self, endpoints: dict[str, str], curve: AgentCurve) -> None:
        """Connect the command, reply and store sockets to a host agent's (which relays them to its host's
        workers), as a CURVE client of the job's key pair; ZeroMQ heartbeats watch each connection. Each
        socket is touched under its owner's lock or on its owner's thread, never while another thread uses it.
        Only the sockets `endpoints` names ("cmd", "reply", "store"): a racked host's commands and replies go
        through its rack's leader, whose own addresses are given for them (`agent/rack.py`)."""

        def connect(sock: zmq.Socket[bytes], name: str) -> None:
            # (options are taken at connect or bind time: the binds made before keep serving CURVE)
            if name in endpoints:
                curve.client(sock)
                heartbeat(sock, self.settings.heartbeat_timeout)
                sock.connect(endpoints[name])

        self._on_each_socket(connect)

    def connect_agents(self, agents: list[dict[str, str]], curve: AgentCurve, timeout: float) -> list[int]:
        """`connect_agent` to each of `agents`, then wait up to `timeout` seconds until each command connection
        is made (its handshake done). Until then an agent's relay has no connection to send up on: a worker's
        start-up message sent meanwhile would be lost, its relay keeping only subscriptions for a connection
        that comes later (workers that start within milliseconds of an attach). Returns the indexes of the
        agents whose connection was not made in time."""
        with self.send_lock:
            monitor = self.cmd.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
        try:
            for endpoints in agents:
                self.connect_agent(endpoints, curve)
            waiting = {endpoints["cmd"]: i for i, endpoints in enumerate(agents) if "cmd" in endpoints}
            deadline = time.monotonic() + timeout
            while waiting:
                left = deadline - time.monotonic()
                if left <= 0 or not monitor.poll(max(1, int(left * 1000))):
                    break
                event = zmq.utils.monitor.recv_monitor_message(monitor)
                waiting.pop(event["endpoint"].decode(), None)
            return sorted(waiting.values())
        finally:
            with self.send_lock:
                with contextlib.suppress(zmq.ZMQError):
                    self.cmd.disable_monitor()
            monitor.close(0)

    def disconnect_agent(self, endpoints: dict[str, str]) -> None:
        def disconnect(sock: zmq.Socket[bytes], name: str) -> None:
            try:
                sock.disconnect(endpoints[name])
            except (zmq.ZMQError, KeyError):
                pass  # never connected, or closed

        self._on_each_socket(disconnect)

    def _on_each_socket(self, do: Callable[[zmq.Socket[bytes], str], None]) -> None:
        with self.send_lock:
            if self.closed:
                return
            do(self.cmd, "cmd")
        with self.recv_lock:
            if self.closed:
                return
            do(self.reply, "reply")
        # Not under send_lock: the store's thread takes it to answer (it would wait for us, we for it).
        owner = self.store_owner
        if owner is None:
            do(self.store, "store")
        else:
            owner(lambda: do(self.store, "store"))

    # -- meshes ------------------------------------------------------------------------------------
    def add_mesh(self, mesh_id: int, n: int, lanes: bool = False) -> list[WorkerKeys]:
        """New keys for a mesh of `n` workers: its signing key, each worker's address, and (TCP) a CURVE
        key pair of its own, admitted until `remove_mesh`. With `lanes` (workers on this machine), each
        worker talks over a lane of its own when this transport has them (IPC, `MONARCH_LANES`)."""
        key = os.urandom(32)
        topic = os.urandom(TOPIC)
        rank_topics = [os.urandom(TOPIC) for _ in range(n)]
        public = secret = None
        if self.curve is not None:
            public, secret = zmq.curve_keypair()
            self.curve.clients.add(public)
        with self.send_lock:
            mesh = _Mesh(key, topic, rank_topics, public, seen=[0] * n, hello_seen=[0] * n)
            if lanes and self.lanes is not None:
                mesh.lanes = [None] * n
            self._meshes[mesh_id] = mesh
            self._topics[topic] = (mesh_id, -1)
            for r, t in enumerate(rank_topics):
                self._topics[t] = (mesh_id, r)
        server = self.curve.public if self.curve is not None else None
        addrs = (self.cmd_addr, self.reply_addr, self.store_addr)
        lane = self.lanes.path if mesh.lanes is not None and self.lanes is not None else None
        return [
            WorkerKeys(mesh_id, r, key, topic, rank_topics[r], *addrs, server, public, secret, lane) for r in range(n)
        ]

    def await_goodbyes(self, mesh_id: int, ranks: list[int], timeout: float) -> list[int]:
        """Wait up to `timeout` seconds until each of `ranks` (workers that exited when asked) said `Goodbye`,
        that is, until everything they sent has been received (by whichever thread receives); returns the
        ranks that did not. Call it before `remove_mesh`, which drops whatever comes later."""
        mesh = self._meshes.get(mesh_id)
        if mesh is None:
            return list(ranks)
        deadline = time.monotonic() + timeout
        with self.goodbyes:
            while True:
                missing = [r for r in ranks if r not in mesh.goodbyes]
                left = deadline - time.monotonic()
                if not missing or left <= 0:
                    return missing
                self.goodbyes.wait(min(left, 0.05))

    def remove_mesh(self, mesh_id: int) -> None:
        """Forget a mesh: its messages are dropped from now on and its CURVE key no longer admitted."""
        with self.send_lock:
            mesh = self._meshes.pop(mesh_id, None)
            if mesh is not None:
                for t in (mesh.topic, *mesh.rank_topics):
                    self._topics.pop(t, None)
                for ident, (m, _) in list(self._store_seen.items()):
                    if m == mesh_id:
                        del self._store_seen[ident]
                for lane in mesh.lanes or ():
                    if lane is not None:
                        lane.shut()  # (the receiving thread sees it end and closes it)
        if mesh is not None and self.curve is not None:
            self.curve.clients.discard(mesh.client_public)

    # -- sending -----------------------------------------------------------------------------------
    def send(
        self,
        mesh_id: int,
        ranks: tuple[int, ...] | None,
        message: Any,
        body: Sequence[bytes | memoryview] | None = None,
    ) -> None:
        """Sign `message` once and send it to `ranks` of the mesh (None: every worker, in one send).

        A worker whose queue is full makes the sender wait for it (backpressure); after `send_stall`
        seconds without progress, `PeerStalled` says so. A worker that is gone is skipped (its exit
        is reported by the backend's monitor)."""
        mesh = self._meshes.get(mesh_id)
        if mesh is None:
            return
        with self.send_lock:
            if self.closed:
                return
            mesh.seq += 1
            frames = codec.encode(mesh.key, mesh_id, codec.CONTROLLER, mesh.seq, protocol.pack(message), body)
            held = HOLD.enter()
            try:
                if not held and _Swap.needed():
                    with _Swap():
                        self._send_all(mesh_id, mesh, ranks, frames)
                else:
                    self._send_all(mesh_id, mesh, ranks, frames)
            finally:
                if held:
                    HOLD.leave()

    def _send_all(
        self, mesh_id: int, mesh: _Mesh, ranks: tuple[int, ...] | None, frames: list[bytes | memoryview]
    ) -> None:
        if mesh.lanes is not None:
            self._send_lanes(mesh_id, mesh, ranks, frames)
            return
        for topic in (mesh.topic,) if ranks is None else [mesh.rank_topics[r] for r in ranks]:
            try:
                _send_whole(self.cmd, topic, frames)
            except zmq.Again:
                self._wait_for(mesh_id, mesh, ranks, topic, frames)

    def _wait_for(
        self, mesh_id: int, mesh: _Mesh, ranks: tuple[int, ...] | None, topic: bytes, frames: list[bytes | memoryview]
    ) -> None:
        """Backpressure: a worker's queue is full. Wait for it to take commands, while its mesh lives."""
        deadline = time.monotonic() + self.settings.send_stall
        pause = 0.00002
        while time.monotonic() < deadline:
            time.sleep(pause)
            pause = min(pause * 2, 0.01)
            if self._meshes.get(mesh_id) is not mesh or self.closed:
                return  # the mesh was stopped or failed meanwhile: nothing to deliver
            try:
                _send_whole(self.cmd, topic, frames)
                return
            except zmq.Again:
                continue
        raise PeerStalled(mesh_id, ranks, self.settings.send_stall)

    def _send_lanes(self, mesh_id: int, mesh: _Mesh, ranks: tuple[int, ...] | None, frames: list[Any]) -> None:
        parts = lanes.pack(frames)
        size, hwm = lanes.size(parts), self.settings.send_hwm
        assert mesh.lanes is not None
        for lane in mesh.lanes if ranks is None else [mesh.lanes[r] for r in ranks]:
            # (a worker whose lane has not come yet has not said Ready: as an unsubscribed one, it misses this)
            if lane is not None and lane.send(parts, size) > hwm:
                self._wait_for_lane(mesh_id, mesh, lane)

    def _wait_for_lane(self, mesh_id: int, mesh: _Mesh, lane: Lane) -> None:
        """Backpressure: more than `send_hwm` commands wait for this worker. Wait until it takes some, while
        its mesh lives; after `send_stall` seconds in which it took nothing, `PeerStalled`."""
        hwm, stall = self.settings.send_hwm, self.settings.send_stall
        poller = select.poll()
        poller.register(lane.fd, select.POLLOUT)
        seen, deadline = lane.progress, time.monotonic() + stall
        while len(lane.out) > hwm and not lane.closed and self._meshes.get(mesh_id) is mesh and not self.closed:
            poller.poll(10)
            lane.flush()
            if lane.progress != seen:
                seen, deadline = lane.progress, time.monotonic() + stall
            elif time.monotonic() > deadline:
                rank = lane.owner[1] if lane.owner is not None else None
                raise PeerStalled(mesh_id, None if rank is None else (rank,), stall)

    # -- receiving replies -------------------------------------------------------------------------
    def set_timeout(self, ms: int) -> None:
        if ms != self._rcvtimeo:
            if self.lanes is None:
                self.reply.setsockopt(zmq.RCVTIMEO, ms)
            self._rcvtimeo = ms

    def recv(self, block: bool) -> Any:
        """The next reply as an `Envelope` (signature and sequence checked, message unpacked), `POKE`,
        `DROPPED`, or None (nothing within the timeout, or nothing at all when not blocking)."""
        lanes = self.lanes
        if lanes is not None:
            messages = lanes.messages
            if messages:  # (the common case while replies come: one taken by the last read, checked already)
                got = messages.popleft()
                if type(got) is codec.Envelope:
                    return got
                messages.appendleft(got)
            return self._recv_any(block)
        try:
            first = self.reply.recv(0 if block else _NOBLOCK, copy=False)
        except zmq.Again:
            return None
        return self._whole(first)

    def _recv_any(self, block: bool) -> Any:
        """`recv` from the lanes and the reply socket (host agents, pokes) together."""
        lanes = self.lanes
        assert lanes is not None
        messages = lanes.messages
        deadline = None
        while True:
            if messages:
                got = messages.popleft()
                if type(got) is tuple:
                    return self._verify(got[1], lane=got[0])
                if type(got) is _Held:  # (checked as it was read; acted on only now, in its turn)
                    return self._deliverable(got.env, got.mesh, got.lane)
                return got  # (checked already: `Lane.take`)
            if self._zmq_maybe:
                try:
                    first = self.reply.recv(_NOBLOCK, copy=False)
                except zmq.Again:
                    self._zmq_maybe = False  # (until the epoll says its descriptor is readable)
                else:
                    return self._whole(first)
            timeout = 0.0
            if block:
                if deadline is None:
                    deadline = time.monotonic() + self._rcvtimeo / 1000 if self._rcvtimeo >= 0 else -1.0
                timeout = -1.0 if deadline < 0 else max(0.0, deadline - time.monotonic())
            happened, zmq_ready = lanes.pump(timeout)
            if zmq_ready:
                self._zmq_maybe = True
            elif not happened and timeout >= 0:
                return None

    def poll_briefly(self, seconds: float) -> Any:
        """Like `recv(block=False)`, trying for up to `seconds` (yielding the CPU between tries)."""
        reply = self.reply
        end = time.perf_counter() + seconds
        while True:
            if self.lanes is not None:
                got = self._recv_any(False)
                if got is not None:
                    return got
            else:
                try:
                    return self._whole(reply.recv(_NOBLOCK, copy=False))
                except zmq.Again:
                    pass
            if time.perf_counter() > end:
                return None
            os.sched_yield()  # anyone runnable here goes first

    def _whole(self, first: zmq.Frame) -> Any:
        if not first.more:
            if not len(first):
                return POKE
            return self._verify([first])
        frames = [first]
        while frames[-1].more:
            frames.append(self.reply.recv(copy=False))
        return self._verify(frames)

    def _key_of(self, mesh_id: int, rank: int) -> bytes | None:
        mesh = self._meshes.get(mesh_id)
        return mesh.key if mesh is not None and (0 <= rank < len(mesh.seen) or rank <= AGENTS) else None

    def _verify(
        self, frames: Sequence[zmq.Frame | memoryview | bytes], upstream: bool = False, lane: Lane | None = None
    ) -> Any:
        try:
            env = codec.decode(self._key_of, frames)
            mesh = self._meshes.get(env.mesh_id)
            if mesh is None:
                return DROPPED  # stopped meanwhile
            if env.rank <= AGENTS:
                return self._bundle(env, mesh, upstream or lane is not None)
            if lane is not None and lane.owner != (env.mesh_id, env.rank) and not self._bind(lane, mesh, env):
                return DROPPED
            seen = mesh.hello_seen if upstream else mesh.seen
            if env.seq <= seen[env.rank]:
                self.log("a replayed message", f"rank {env.rank} of mesh {env.mesh_id} already sent number {env.seq}")
                return DROPPED
            seen[env.rank] = env.seq
            env.message = protocol.unpack(env.message)
            return self._deliverable(env, mesh, lane)
        except codec.UnknownSender as e:
            why = str(e)
        except (codec.BadSignature, ValueError) as e:
            why = f"it failed its checks: {e}"
        except Exception as e:  # a header that is not ours (it was signed, so this is a bug)
            why = f"its header could not be read: {type(e).__name__}: {e}"
        if lane is not None and lane.owner is None:  # (not a worker of ours: nothing more is read from it)
            if not lane.closed and self.lanes is not None:
                self.lanes.misbehaved(lane, f"a message that is not a worker's ({why})")
        else:
            self.log("a message", why)
        return DROPPED

    def _bundle(self, env: codec.Envelope, mesh: _Mesh, misplaced: bool) -> Any:
        """A host agent's `Bundle` (signature checked): its number is new, it is a bundle, each of its items names
        ranks of the mesh and a message a worker sends up; the receiver acts on each."""
        who = f"{fanin.sender_name(env.rank)} (mesh {env.mesh_id})"
        if misplaced:
            self.log("a message", f"{who} sent a bundle where only workers' messages come")
            return DROPPED
        if env.seq <= mesh.agents_seen.get(env.rank, 0):
            self.log("a replayed message", f"{who} already sent number {env.seq}")
            return DROPPED
        mesh.agents_seen[env.rank] = env.seq
        message = env.message
        if type(message) is tuple and len(message) == 2:  # (an agent of a version before: no `now`)
            message = (*message, False)
        bundle = protocol.unpack(message)
        n = len(mesh.seen)
        if type(bundle) is not protocol.Bundle or type(bundle.items) is not tuple:
            raise ValueError(f"{who} sent a {type(bundle).__name__} where only bundles come")
        items = []
        for ranks, message, body in bundle.items:
            message = protocol.unpack(message)
            if type(message) not in fanin.BUNDLED or type(body) is not bytes or type(ranks) is not tuple:
                raise ValueError(f"{who} bundled a {type(message).__name__}, which is never bundled")
            if not ranks or {*map(type, ranks)} != _INT or min(ranks) < 0 or max(ranks) >= n:  # (C loops: 64 ranks)
                raise ValueError(f"{who} bundled a message from ranks {ranks!r}, not all of the mesh's {n}")
            items.append((ranks, message, body))
        env.message = protocol.Bundle(tuple(items))
        self.bundles += 1
        self.bundled += len(items)
        return env

    def _deliverable(self, env: codec.Envelope, mesh: _Mesh, lane: Lane | None) -> Any:
        """A checked message, or `DROPPED` for one that the transport takes itself (start-up, `Goodbye`)."""
        if lane is not None and type(env.message) in _STARTUP:
            if self.on_startup is not None:
                self.on_startup(env)
            return DROPPED  # (taken by whoever starts the mesh)
        if type(env.message) is protocol.Goodbye:
            with self.goodbyes:
                mesh.goodbyes.add(env.rank)
                self.goodbyes.notify_all()
            return DROPPED  # (nothing for the receiver to do)
        return env

    def _take_for(self, lane: Lane, mesh_id: int, mesh: _Mesh, rank: int) -> Callable[[memoryview], Any]:
        """`Lane.take` for a lane bound to (`mesh_id`, `rank`): its one-frame messages checked in one call each
        (`codec.one_sender`); whatever that does not take goes through `_verify`, which says what is wrong."""
        special = (*_STARTUP, protocol.Goodbye)
        check, meshes, unpack = codec.one_sender(mesh.key, mesh_id, rank, mesh.seen), self._meshes, protocol.unpack

        def take(first: memoryview) -> Any:
            try:
                env = check(first)
            except Exception:  # (a header that does not unpickle: `_verify` says so)
                env = None
            if env is None:
                got = self._verify([bytes(first)], lane=lane)
            elif meshes.get(mesh_id) is not mesh:
                return None  # stopped meanwhile
            else:
                try:
                    env.message = unpack(env.message)
                except ValueError as e:
                    self.log("a message", f"it failed its checks: {e}")
                    return None
                if type(env.message) not in special:
                    return env
                return _Held(env, mesh, lane)  # (in its turn: a Goodbye says all before it was handled)
            return None if got is DROPPED else got

        return take

    def _bind(self, lane: Lane, mesh: _Mesh, env: codec.Envelope) -> bool:
        """A lane's first message (its signature checked) says whose lane it is: bind it to that worker, if
        that worker has no lane yet. Anything else is dropped, and a lane of someone else's is closed."""
        who = f"rank {env.rank} of mesh {env.mesh_id}"
        if lane.owner is not None:
            self.log("a message", f"{who} wrote on the lane of rank {lane.owner[1]} of mesh {lane.owner[0]}")
            return False
        if mesh.lanes is None or mesh.lanes[env.rank] is not None:
            self.log("a lane", f"{who} has {'no lanes' if mesh.lanes is None else 'a lane already'}; closed")
            lane.shut()
            return False
        lane.owner = (env.mesh_id, env.rank)
        lane.reader.prove()
        mesh.lanes[env.rank] = lane
        lane.take = self._take_for(lane, env.mesh_id, mesh, env.rank)
        return True

    def poke(self) -> None:
        """Wake a thread blocked in `recv`."""
        with self._waker_lock:
            if not self.closed:
                try:
                    self._waker.send(b"", _NOBLOCK)
                except zmq.Again:
                    pass  # plenty of pokes already queued

    # -- start-up messages on the command socket ---------------------------------------------------
    def read_cmd(self) -> list[codec.Envelope]:
        """What came up the command socket: subscriptions to our topics are applied (others ignored),
        start-up messages (`Ready`, `StartFailed`) returned, anything else dropped. Call it when `cmd_fd`
        is readable, and now and then (any send may consume the fd's edge); it re-arms the fd. Returns
        nothing at once when a sender holds the socket (one waiting for a full queue, say): call again."""
        out: list[codec.Envelope] = []
        if not self.send_lock.acquire(timeout=0.05):
            return out
        try:
            if self.closed:
                return out
            cmd = self.cmd
            while True:
                try:
                    frames: list[Any] = cmd.recv_multipart(_NOBLOCK, copy=False)  # (the first becomes a view below)
                except zmq.Again:
                    return out
                first = frames[0].buffer
                kind = bytes(first[:1])
                if bytes(first[:2]) == HELLO and len(first) > 1 + TOPIC and len(frames) == 1:
                    # a worker's start-up message (keys.HELLO; longer than any subscription, whose topic may
                    # start with the same byte)
                    kind, frames[0] = UPSTREAM, first[1:]
                    first = frames[0]
                if kind != UPSTREAM:  # a subscription (\x01 + topic), an unsubscription (\x00), or junk
                    if kind == b"\x00" and len(frames) == 1:
                        continue  # an unsubscription: libzmq makes them when a worker's connection closes, and a
                        # worker takes its hello back with one
                    if len(frames) != 1 or kind != b"\x01" or len(first) > 1 + TOPIC:
                        self.log("junk", f"{len(first)} bytes came up the command socket")
                        continue
                    topic = bytes(first[1:])
                    if topic not in self._topics:
                        self.log("a subscription", f"a {len(topic)}-byte topic that is not one of a running mesh's")
                    else:
                        cmd.setsockopt(zmq.SUBSCRIBE, topic)  # (applies to the connection it came on)
                    continue
                frames[0] = first[1:]
                env = self._verify(frames, upstream=True)
                if env is not DROPPED:
                    out.append(env)
        finally:
            self.send_lock.release()

    @property
    def cmd_fd(self) -> int:
        return cast(int, self.cmd.getsockopt(zmq.FD))  # (pyzmq types every option as int | bytes)

    @property
    def reply_fd(self) -> int:
        if self.lanes is not None:
            return self.lanes.fileno()  # (level-triggered: readable while a lane or the socket has something)
        return cast(int, self.reply.getsockopt(zmq.FD))

    # -- the store's socket (its thread only) ------------------------------------------------------
    def store_recv(self) -> Any:
        """The next store request ``(route, envelope)``; `DROPPED` for one that failed its checks (logged);
        None when there is none. The route is the connection's identity, or for a worker behind a host agent
        the agent's connection and the worker's identity there (the agent puts an empty frame after it)."""
        try:
            frames = self.store.recv_multipart(_NOBLOCK, copy=False)
        except zmq.Again:
            return None
        ident: tuple[bytes, ...]
        if len(frames) > 3 and not len(frames[2]):  # through a host agent: [agent, worker, b"", *message]
            ident, frames = (frames[0].bytes, frames[1].bytes), frames[3:]
        else:
            ident, frames = (frames[0].bytes,), frames[1:]
        try:
            if not frames:
                raise codec.BadSignature("an empty message")
            env = codec.decode(self._key_of, frames)
            if env.seq <= self._store_seen.get(ident, (env.mesh_id, 0))[1]:
                self.log("a replayed store request", f"number {env.seq} from rank {env.rank} of mesh {env.mesh_id}")
                return DROPPED
            self._store_seen[ident] = (env.mesh_id, env.seq)
            env.message = protocol.unpack(env.message)
            return ident, env
        except (codec.BadSignature, ValueError) as e:
            self.log("a store request", f"it failed its checks: {e}")
            return DROPPED

    def store_send(self, ident: tuple[bytes, ...], mesh_id: int, message: Any) -> None:
        mesh = self._meshes.get(mesh_id)
        if mesh is None:
            return
        with self.send_lock:  # the mesh's sequence numbers
            mesh.seq += 1
            seq = mesh.seq
        frames = codec.encode(mesh.key, mesh_id, codec.CONTROLLER, seq, protocol.pack(message))
        route = list(ident) if len(ident) == 1 else [*ident, b""]
        try:
            self.store.send_multipart([*route, *frames], _NOBLOCK)
        except zmq.Again:  # a client not reading: it times out on its side
            self.log("a store answer", f"a client of mesh {mesh_id} left {REPLY_HWM} answers unread")
        except zmq.ZMQError:
            pass  # a client that is gone

    def close(self) -> None:
        with self.send_lock:
            self.closed = True
        with self._waker_lock:
            self._waker.close(0)
        self.cmd.close(0)
        with self.recv_lock:
            self.reply.close(0)
            if self.lanes is not None:
                self.lanes.close()

    def close_store(self) -> None:
        self.store.close(0)

    def terminate(self) -> None:
        if self.curve is not None:
            self.curve.stop()
        self.ctx.term()
