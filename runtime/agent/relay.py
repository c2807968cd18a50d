"""The agent's relays between the controller's connection (TCP, CURVE) and its host's workers (IPC in a
private directory).

- Commands: the controller sends each one once per host on the command link; the relay puts it on the
  local command socket, which reaches every worker subscribed to its (secret) topic. Workers' subscriptions
  and start-up messages go the other way: a subscription to a topic the agent was given is applied here and
  passed up (so the controller sends this host the mesh's commands), the start-up message after it.
- Replies, output, input requests: straight up (a ZeroMQ proxy, no Python per message), for meshes of up to
  `Settings.bundle_above` ranks. A larger mesh's workers send to a socket of their own, whose messages are
  checked, held for a moment and sent up in bundles, one per mesh, each distinct message once with the ranks that
  sent it (`wire/fanin.py`; anything it does not bundle goes up as it came, after what its mesh's ranks sent
  before it); the bundles join the proxy's stream in-process. A mesh of few ranks gains nothing from bundles and
  would pay the Python hop on every reply.
- The store: each request goes up with the worker's identity and an empty frame before it, each answer
  comes back the same way and goes to that worker.

Messages that are not bundled pass unchanged: they are signed with their mesh's key, which the controller checks
(a worker's start-up message is read only to learn it is up). A bundle is signed by the agent with the same key,
after it checked each message in it.
"""

from __future__ import annotations

import os
import threading
import time
import traceback
from typing import Any

import zmq

from monarch.runtime.wire.fanin import FanIn
from monarch.runtime.wire.keys import TOPIC, UPSTREAM, AgentCurve
from monarch.runtime.wire.links import HEARTBEAT_TIMEOUT, heartbeat

_NOBLOCK = int(zmq.NOBLOCK)


class Relay:
    """The six sockets and the three threads that move messages between them."""

    def __init__(
        self,
        ctx: zmq.Context,
        bind_addr: str,
        curve: AgentCurve,
        directory: str,
        log: Any,
        index: int = 0,
        bundle_wait: float = 0.002,
        heartbeat_timeout: float = HEARTBEAT_TIMEOUT,
    ) -> None:
        self.ctx = ctx
        self.log = log
        self.heartbeat_timeout = heartbeat_timeout
        self.topics: set[bytes] = set()
        """Topics of the meshes this host runs (workers may subscribe to these only)."""
        self.mesh_of: dict[bytes, int] = {}
        """Topic -> the mesh it is of (commands on it are looked at by the fan-in)."""
        self._lock = threading.Lock()
        # toward the controller: bound on this host's address, CURVE servers admitting the job's client key
        self.up_cmd = self._socket(zmq.XSUB, curve)
        self.up_reply = self._socket(zmq.PUSH, curve)
        self.up_store = self._socket(zmq.DEALER, curve)
        self.endpoints = {}
        for sock, name in ((self.up_cmd, "cmd"), (self.up_reply, "reply"), (self.up_store, "store")):
            sock.bind(f"tcp://{bind_addr}:0")
            self.endpoints[name] = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        # toward the workers: IPC in a directory only this user can open
        self.cmd = self._socket(zmq.XPUB)
        self.cmd.setsockopt(zmq.XPUB_MANUAL, 1)
        self.reply = self._socket(zmq.PULL)
        self.bundle = self._socket(zmq.PULL)
        self.store = self._socket(zmq.ROUTER)
        self.local = {}
        for sock, name in ((self.cmd, "cmd"), (self.reply, "reply"), (self.bundle, "bundle"), (self.store, "store")):
            sock.bind(f"ipc://{directory}/{name}")
            self.local[name] = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        # the fan-in's output joins the proxy's input: one thread only ever sends on `up_reply`
        self.reply.bind(f"inproc://monarch-relay-bundles-{id(self)}")
        self._bundled = self._socket(zmq.PUSH)
        self._bundled.connect(f"inproc://monarch-relay-bundles-{id(self)}")
        self.fanin = FanIn(index, self._send_up, log, bundle_wait)
        self._stop_r, self._stop_w = os.pipe()
        self._wake_r, self._wake_w = os.pipe()
        self._unsubscribe: list[bytes] = []
        self._upstream: set[bytes] = set()
        """Topics this host subscribed to upstream, once each (the controller's side counts subscriptions)."""
        self._threads = [
            threading.Thread(target=self._commands, name="monarch-relay-cmd", daemon=True),
            threading.Thread(target=self._replies, name="monarch-relay-reply", daemon=True),
            threading.Thread(target=self._bundles, name="monarch-relay-bundle", daemon=True),
            threading.Thread(target=self._store, name="monarch-relay-store", daemon=True),
        ]
        for t in self._threads:
            t.start()

    def _socket(self, kind: int, curve: AgentCurve | None = None) -> zmq.Socket:
        s = self.ctx.socket(kind)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.SNDHWM, 0)  # (the controller's sends are bounded by its own queue and backpressure)
        s.setsockopt(zmq.RCVHWM, 0)
        if curve is not None:
            curve.serve(s)
            heartbeat(s, self.heartbeat_timeout)
        return s

    def allow(self, topics: list[bytes]) -> None:
        with self._lock:
            self.topics.update(topics)

    def add_mesh(
        self, mesh_id: int, key: bytes, ranks: list[int], topics: list[bytes], bundled: bool, size: int = 0
    ) -> str:
        """This host runs `ranks` of mesh `mesh_id` (of `size` ranks in all; signed with `key`; commands come on
        `topics`); `bundled`: their replies are bundled. The address its workers send their replies to."""
        if bundled:
            self.fanin.add_mesh(mesh_id, key, ranks, size)
        for topic in topics:
            self.mesh_of[topic] = mesh_id
        self.allow(topics)
        return self.local["bundle" if bundled else "reply"]

    def forbid(self, topics: list[bytes]) -> None:
        """The mesh of `topics` is gone: this host unsubscribes from them (a controller that connects later
        would otherwise be told of them again)."""
        with self._lock:
            self.topics.difference_update(topics)
            self._unsubscribe.extend(topics)
            mesh_ids = {self.mesh_of.pop(t) for t in topics if t in self.mesh_of}
        for mesh_id in mesh_ids:
            self.fanin.remove_mesh(mesh_id)
        os.write(self._wake_w, b"u")

    # -- the threads -------------------------------------------------------------------------------------
    def _commands(self) -> None:
        poller = zmq.Poller()
        poller.register(self.up_cmd, zmq.POLLIN)
        poller.register(self.cmd, zmq.POLLIN)
        poller.register(self._stop_r, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        while True:
            try:
                ready = dict(poller.poll())
                if self._stop_r in ready:
                    return
                if self._wake_r in ready:
                    os.read(self._wake_r, 4096)
                    with self._lock:
                        gone, self._unsubscribe = self._unsubscribe, []
                    for topic in gone:
                        if topic in self._upstream:
                            self._upstream.discard(topic)
                            self.up_cmd.send(b"\x00" + topic)
                if self.up_cmd in ready:
                    while True:  # down: as it came, topic and all
                        try:
                            frames = self.up_cmd.recv_multipart(_NOBLOCK, copy=False)
                        except zmq.Again:
                            break
                        if len(frames) == 1:
                            self._look_at(frames[0].buffer)
                        self.cmd.send_multipart(frames, copy=False)
                if self.cmd in ready:
                    while True:
                        try:
                            frames = self.cmd.recv_multipart(_NOBLOCK, copy=False)
                        except zmq.Again:
                            break
                        self._up(frames)
            except zmq.ContextTerminated:
                return
            except Exception:
                self.log("the command relay", traceback.format_exc(limit=3))

    def _up(self, frames: list) -> None:
        first = frames[0].buffer
        kind = bytes(first[:1])
        if kind == b"\x01" and len(frames) == 1 and len(first) == 1 + TOPIC:
            topic = bytes(first[1:])
            if topic in self.topics:
                self.cmd.setsockopt(zmq.SUBSCRIBE, topic)  # (applies to the worker's connection)
                if topic not in self._upstream:  # and this host to the controller's commands on it, once
                    self._upstream.add(topic)
                    self.up_cmd.send(b"\x01" + topic)
            return
        if bytes(first[1:2]) == UPSTREAM and kind in (b"\x01", b"\x00") and len(first) > 1 + TOPIC and len(frames) == 1:
            # a worker's start-up message (`keys.HELLO`, behind its subscriptions), or its taking it back:
            # up as it came (subscription-shaped on every hop, so each XPUB_MANUAL keeps its pairings)
            self.up_cmd.send(first)
        # (an unsubscription of a topic, made when a worker's connection closes, stays here)

    def _look_at(self, frame: memoryview) -> None:
        """A command on its way down: the fan-in learns from a `Call` how many replies it brings."""
        mesh_id = self.mesh_of.get(bytes(frame[:TOPIC]))
        if mesh_id is not None:
            self.fanin.saw_command(mesh_id, frame[TOPIC:])

    def _send_up(self, frames: Any) -> None:
        self._bundled.send_multipart(frames, copy=False)

    def _replies(self) -> None:
        try:
            zmq.proxy(self.reply, self.up_reply)
        except zmq.ZMQError:  # the sockets were closed: the agent is ending
            pass

    def _bundles(self) -> None:
        """The workers of large meshes: their replies, output and the rest through the fan-in, which bundles them."""
        poller = zmq.Poller()
        poller.register(self.bundle, zmq.POLLIN)
        poller.register(self._stop_r, zmq.POLLIN)
        fanin = self.fanin
        while True:
            try:
                due = fanin.due()
                timeout = None if due is None else max(0.0, due - time.monotonic()) * 1000
                ready = dict(poller.poll(timeout))
                if self._stop_r in ready:
                    return
                if self.bundle in ready:
                    for _ in range(4096):  # (then the held messages' time is looked at)
                        try:
                            frames = self.bundle.recv_multipart(_NOBLOCK, copy=False)
                        except zmq.Again:
                            break
                        fanin.take(frames)
                fanin.flush_due(time.monotonic())
            except zmq.ContextTerminated:
                return
            except zmq.ZMQError:
                if self.bundle.closed or self._bundled.closed:
                    return  # the agent is ending
                self.log("the reply relay", traceback.format_exc(limit=3))
            except Exception:
                self.log("the reply relay", traceback.format_exc(limit=3))

    def _store(self) -> None:
        poller = zmq.Poller()
        poller.register(self.store, zmq.POLLIN)
        poller.register(self.up_store, zmq.POLLIN)
        poller.register(self._stop_r, zmq.POLLIN)
        while True:
            try:
                ready = dict(poller.poll())
                if self._stop_r in ready:
                    return
                if self.store in ready:  # a worker's request: up, behind its identity and an empty frame
                    while True:
                        try:
                            ident, *rest = self.store.recv_multipart(_NOBLOCK, copy=False)
                        except zmq.Again:
                            break
                        self.up_store.send_multipart([ident, b"", *rest], copy=False)
                if self.up_store in ready:  # an answer: to the worker it names
                    while True:
                        try:
                            ident, empty, *rest = self.up_store.recv_multipart(_NOBLOCK, copy=False)
                        except zmq.Again:
                            break
                        except ValueError:
                            continue
                        if not len(empty):
                            try:
                                self.store.send_multipart([ident, *rest], _NOBLOCK, copy=False)
                            except zmq.ZMQError:
                                pass  # that worker is gone
            except zmq.ContextTerminated:
                return
            except Exception:
                self.log("the store relay", traceback.format_exc(limit=3))

    def close(self) -> None:
        os.write(self._stop_w, b"x")
        for t in self._threads:
            if t.name != "monarch-relay-reply":  # (the proxy ends when the context does)
                t.join(2)
