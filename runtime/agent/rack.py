"""A rack's leader: the second level of the fan-in and of the fan-out, on one host agent of each rack.

Beyond a few hundred hosts the controller's cost grows with the connections it reads (ZeroMQ's I/O thread pays
each host's bundle a read and a CURVE decryption, and a Python receive follows): 512 hosts of 8 ranks cost it 45 ms
of CPU a no-op call. Racked (`Settings.rack_above`), each host's relay sends up to its rack's leader instead: the
leader's socket connects to every member's reply address (its own host's too), so each host's messages still
travel one connection, in the order they were sent. The leader checks each member's bundle, merges a mesh's bundles from
its members and signs the merge as this rack (`wire/rack_merge.py`), on one connection to the controller: 512 hosts,
32 messages a call.

Commands come down the same way: the controller's command socket connects to the leader's (an XSUB, as a host's
relay has), whose XPUB connects to every member's relay, so that the controller encrypts and writes each command
once a rack, not once a host (at 512 hosts that was most of its I/O thread's 30 ms a no-op call). Members'
subscriptions come up through it (a topic once a rack; taken back when no member holds it), and their workers'
start-up messages after them, in the order each host sent them. The leader says it leads (`Leading`) only once its
connections to its members are made: a start-up message sent up before would be lost.

What it merges and when a merge goes up: `wire/rack_merge.py` (`RackMerge`, used by this leader's thread).
"""

from __future__ import annotations

import collections
import contextlib
import os
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import zmq
import zmq.utils.monitor

from monarch.runtime.wire.keys import TOPIC, UPSTREAM, AgentCurve
from monarch.runtime.wire.links import heartbeat
from monarch.runtime.wire.rack_merge import RackMerge

_NOBLOCK = int(zmq.NOBLOCK)
CONNECT_TIMEOUT = 10.0
"""Seconds a leader waits for its connections to its members before it says it leads (naming those missing)."""


class RackLeader:
    """A rack leader's four sockets (replies in from members and out to the controller, commands in from it and out
    to them) and the one thread that moves messages between them."""

    def __init__(
        self, ctx: zmq.Context, bind_addr: str, curve: AgentCurve, index: int, log: Callable[[str, str], None],
        wait: float, heartbeat_timeout: float, led: Callable[[dict[str, str], list[str]], None],
    ) -> None:  # fmt: skip
        self.index = index
        self.log = log
        self.led = led
        """Called (from the thread) once the members asked for are connected, with where the rack's commands go in
        and its replies come out, and the members that did not connect in time."""

        def socket(kind: int, server: bool) -> zmq.Socket:
            sock = ctx.socket(kind)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.setsockopt(zmq.RCVHWM, 0)
            if server:
                curve.serve(sock)
            else:
                curve.client(sock)  # (members' relays admit the job's client key)
            heartbeat(sock, heartbeat_timeout)
            return sock

        self.down = socket(zmq.PULL, False)
        """Members' replies."""
        self.up = socket(zmq.PUSH, True)
        """The rack's replies, to the controller."""
        self.cmd_in = socket(zmq.XSUB, True)
        """Commands from the controller (and subscriptions up to it)."""
        self.cmd_out = socket(zmq.XPUB, False)
        """Commands to the members (and their subscriptions and start-up messages up from them)."""
        self.cmd_out.setsockopt(zmq.XPUB_MANUAL, 1)
        self.handshakes = self.cmd_out.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
        self.up.bind(f"tcp://{bind_addr}:0")
        self.cmd_in.bind(f"tcp://{bind_addr}:0")
        self.merge = RackMerge(index, self._send_up, log, wait)
        """Checks and merges the members' bundles (`wire/rack_merge.py`)."""
        self.endpoints = {
            "reply": self.up.getsockopt_string(zmq.LAST_ENDPOINT),
            "cmd": self.cmd_in.getsockopt_string(zmq.LAST_ENDPOINT),
        }
        self._want: dict[str, dict[str, str]] = {}
        """Members' relays' addresses ("reply", "cmd") to be connected to (the thread does)."""
        self._wanted = False
        self.members: dict[str, dict[str, str]] = {}
        """Members' addresses connected to, by reply address (once each: two connections to one member would
        reorder its messages)."""
        self._waiting: set[str] = set()
        """Command addresses whose connections are not made yet; `led` is called when none is left."""
        self._deadline = 0.0
        self._subscribed: dict[bytes, int] = {}
        """Topic -> how many members' connections subscribed to it (up once, taken back at 0)."""
        self._lock = threading.Lock()
        self._wake_r, self._wake_w = os.pipe()
        self._stop = False
        self._leading = False
        """Whether a controller has this rack: its replies wait for its connection (`_backlog`); else they are
        dropped (what its workers sent as they were killed)."""
        self._backlog: collections.deque[Any] = collections.deque()
        """Messages up that the controller's connection did not take yet (it connects as the leader says it leads),
        in order; the thread sends them when `up` can take them, never blocking."""
        self._thread = threading.Thread(target=self._serve, name="monarch-rack", daemon=True)
        self._thread.start()

    def lead(self, members: dict[int, dict[str, str]]) -> None:
        """Take these members' replies and give them their commands (their relays' "reply" and "cmd" addresses),
        and no others': a controller that attaches again leads again, perhaps other members. `led` says when
        it is done. The sockets are the thread's to touch."""
        with self._lock:
            self._want = {m["reply"]: m for m in members.values()}
            self._wanted = True
            self._leading = bool(members)
        os.write(self._wake_w, b"c")

    def stop_leading(self) -> None:
        """The controller is gone: its meshes' merges are dropped and the members let go (the next may rack
        the hosts otherwise)."""
        self.merge.clear()
        self.lead({})

    def set_mesh(self, mesh_id: int, key: bytes, ranks: dict[int, tuple[int, ...]]) -> None:
        """Merge mesh `mesh_id`'s bundles from these members (no ranks: the mesh is gone)."""
        self.merge.set_mesh(mesh_id, key, ranks)

    def _send_up(self, frames: Any) -> None:
        """Up to the controller, after what waits for its connection; dropped when no controller has the rack."""
        if not self._leading:
            self._backlog.clear()
            return
        if not self._backlog:
            try:
                self.up.send_multipart(frames, _NOBLOCK, copy=False)
                return
            except zmq.Again:
                pass
        self._backlog.append(frames)

    def _send_backlog(self) -> None:
        """What waits, as far as `up` takes it (the thread's loop drops it when no controller has the rack)."""
        backlog = self._backlog
        while backlog and self._leading:
            try:
                self.up.send_multipart(backlog[0], _NOBLOCK, copy=False)
            except zmq.Again:
                return
            backlog.popleft()

    def close(self) -> None:
        self._stop = True
        os.write(self._wake_w, b"x")
        self._thread.join(2)
        if not self._thread.is_alive():
            with contextlib.suppress(zmq.ZMQError):
                self.cmd_out.disable_monitor()
            for sock in (self.handshakes, self.down, self.up, self.cmd_in, self.cmd_out):
                sock.close(0)
            for fd in (self._wake_r, self._wake_w):
                os.close(fd)

    # -- the thread --------------------------------------------------------------------------------------
    def _serve(self) -> None:
        poller = zmq.Poller()
        for sock in (self.down, self.cmd_in, self.cmd_out, self.handshakes, self._wake_r):
            poller.register(sock, zmq.POLLIN)
        while not self._stop:
            try:
                due = self.merge.due()
                if self._waiting:
                    due = self._deadline if due is None else min(due, self._deadline)
                timeout = None if due is None else max(0.0, due - time.monotonic()) * 1000
                if not self._leading:
                    self._backlog.clear()
                poller.register(self.up, zmq.POLLOUT if self._backlog else 0)  # (0: not watched)
                ready = dict(poller.poll(timeout))
                if self._wake_r in ready:
                    os.read(self._wake_r, 4096)
                    self._connect()
                if self.up in ready:
                    self._send_backlog()
                if self.handshakes in ready:
                    while self.handshakes.poll(0):
                        event = zmq.utils.monitor.recv_monitor_message(self.handshakes)
                        self._waiting.discard(event["endpoint"].decode())
                if self.cmd_in in ready:
                    self._commands()
                if self.cmd_out in ready:
                    self._subscriptions()
                if self.down in ready:
                    for _ in range(4096):  # (then the held merges' time is looked at)
                        try:
                            frames = self.down.recv_multipart(_NOBLOCK, copy=False)
                        except zmq.Again:
                            break
                        self.merge.take(frames)
                now = time.monotonic()
                self.merge.flush_due(now)
                if self._deadline and (not self._waiting or now >= self._deadline):
                    self._deadline = 0.0
                    slow, self._waiting = sorted(self._waiting), set()
                    self.led(self.endpoints, slow)
            except zmq.ContextTerminated:
                return
            except zmq.ZMQError:
                if self.down.closed or self.up.closed:
                    return
                self.log("the rack's relay", traceback.format_exc(limit=3))
            except Exception:
                self.log("the rack's relay", traceback.format_exc(limit=3))

    def _connect(self) -> None:
        """Connect to the members asked for (those already connected stay as they are), let the others go."""
        with self._lock:
            want, wanted, self._wanted = self._want, self._wanted, False
        if not wanted:
            return
        for reply, m in list(self.members.items()):
            if reply not in want:
                del self.members[reply]
                for sock, name in ((self.down, "reply"), (self.cmd_out, "cmd")):
                    with contextlib.suppress(zmq.ZMQError):
                        sock.disconnect(m[name])
        fresh = [m for reply, m in want.items() if reply not in self.members]
        for m in fresh:
            self.down.connect(m["reply"])
            self.cmd_out.connect(m["cmd"])
            self.members[m["reply"]] = m
        wanted = {m["cmd"] for m in want.values()}
        self._waiting = {m["cmd"] for m in fresh} | (self._waiting & wanted)  # (and those still unanswered)
        self._deadline = time.monotonic() + CONNECT_TIMEOUT if want else 0.0

    def _commands(self) -> None:
        """Down: each command to the members, topic and all (each member's relay takes its own topics)."""
        while True:
            try:
                frames = self.cmd_in.recv_multipart(_NOBLOCK, copy=False)
            except zmq.Again:
                return
            self.cmd_out.send_multipart(frames, copy=False)

    def _subscriptions(self) -> None:
        """Up: members' (un)subscriptions, applied to the connection each came on and passed on once a rack; their
        workers' start-up messages (subscription-shaped: `keys.HELLO`) passed on as they came."""
        while True:
            try:
                frames = self.cmd_out.recv_multipart(_NOBLOCK, copy=False)
            except zmq.Again:
                return
            first = frames[0].buffer
            if len(frames) != 1 or not len(first):
                continue
            kind = bytes(first[:1])
            if len(first) == 1 + TOPIC and kind in (b"\x01", b"\x00"):
                topic = bytes(first[1:])
                count = self._subscribed.get(topic, 0)
                if kind == b"\x01":
                    self.cmd_out.setsockopt(zmq.SUBSCRIBE, topic)  # (applies to the connection it came on)
                    self._subscribed[topic] = count + 1
                    if not count:
                        self.cmd_in.send(first)
                elif count:
                    self.cmd_out.setsockopt(zmq.UNSUBSCRIBE, topic)
                    if count == 1:
                        del self._subscribed[topic]
                        self.cmd_in.send(first)
                    else:
                        self._subscribed[topic] = count - 1
            elif bytes(first[1:2]) == UPSTREAM and kind in (b"\x01", b"\x00") and len(first) > 1 + TOPIC:
                self.cmd_in.send(first)  # a worker's start-up message, or its taking it back
