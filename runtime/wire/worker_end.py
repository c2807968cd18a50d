"""A worker's end of the transport: commands in (XSUB, on its mesh's topic and its own), replies out (PUSH),
or both over one lane (`lanes.py`: a worker on the controller's machine), and one connection per thread to
the controller's store. Everything it takes in is checked (signature, sender, sequence number) before it is
unpickled."""

from __future__ import annotations

import os
import pickle
import threading
import time
from collections.abc import Sequence
from typing import Any

import zmq

from monarch.runtime.common.log import RateLimitedLog
from monarch.runtime.wire import codec, protocol
from monarch.runtime.wire.keys import HELLO, TOPIC, WorkerKeys, curve_client
from monarch.runtime.wire.lanes import LaneClient


class WorkerTransport:
    """A worker's sockets: commands in (XSUB, on its mesh's topic and its own), replies out (PUSH); or its
    lane for both."""

    cmd: Any
    """What a command arrives on, for a poller: the XSUB socket, or the lane's descriptor."""

    def __init__(self, keys: WorkerKeys, spin: float = 0.0) -> None:
        self.keys = keys
        self.ctx = zmq.Context()  # (the store's connections, and actors', use it with a lane too)
        self._lock = threading.Lock()
        self._seq = 0
        self._seen = [0]
        """The last command's sequence number (one slot: `codec.CONTROLLER`, -1, indexes it for `one_sender`)."""
        self.log = RateLimitedLog(f"monarch worker {keys.rank}")
        self.lane = LaneClient(keys.lane_addr, spin) if keys.lane_addr is not None else None
        if self.lane is not None:
            self.cmd = self.lane.fileno()  # (a poller answers with the descriptor: `cmd in events` holds)
            # (each command, in one call: a worker woken for it runs every line cold, 64 of them on two cores)
            self._take = codec.one_sender(keys.key, keys.mesh_id, codec.CONTROLLER, self._seen)
            self._sign = codec.one_signer(keys.key, keys.mesh_id, keys.rank)
            return
        self.cmd = self.ctx.socket(zmq.XSUB)
        self.cmd.setsockopt(zmq.RCVHWM, 0)  # what the controller pipelined waits here, in our memory
        self.cmd.setsockopt(zmq.LINGER, 1000)
        curve_client(self.cmd, keys)
        self.cmd.connect(keys.cmd_addr)
        for topic in (keys.mesh_topic, keys.rank_topic):
            self.cmd.send(b"\x01" + topic)
        self.out = self.ctx.socket(zmq.PUSH)
        self.out.setsockopt(zmq.SNDHWM, 0)  # output is never dropped; it waits here if the controller lags
        self.out.setsockopt(zmq.LINGER, 5000)
        curve_client(self.out, keys)
        self.out.connect(keys.reply_addr)

    def _encode(self, message: Any, body: Sequence[bytes | memoryview] | None) -> list[bytes | memoryview]:
        self._seq += 1
        k = self.keys
        return codec.encode(k.key, k.mesh_id, k.rank, self._seq, protocol.pack(message), body)

    def hello(self, message: Any) -> None:
        """A start-up message (`Ready`, `StartFailed`) up the command connection: behind this worker's
        subscriptions on the same connection, so when it arrives, commands reach the worker. Shaped as a
        subscription (`keys.HELLO`), then taken back (an unsubscription of the same bytes: the controller
        drops it), so it stays in no subscription list. Main thread. (On a lane, the first messages a worker
        sends say whose lane it is: a start-up message is one like any other.)"""
        if self.lane is not None:
            self.send(message)
            return
        with self._lock:
            (frame,) = self._encode(message, None)  # (start-up messages have no body: one frame)
        self.cmd.send(HELLO + frame)
        self.cmd.send(b"\x00" + HELLO[1:] + frame)

    def send(self, message: Any, body: Sequence[bytes | memoryview] | None = None) -> None:
        """Send `message` up (any thread)."""
        with self._lock:
            lane = self.lane
            if lane is not None and (body is None or len(body) == 1):  # (one frame: a reply, a line of output)
                pieces = self._sign(self._seq + 1, protocol.pack(message), body[0] if body else b"")
                if pieces is not None:
                    self._seq += 1
                    lane.send_frame(pieces)
                    return
            frames = self._encode(message, body)
            if lane is not None:
                lane.send(frames)
            elif len(frames) == 1:
                self.out.send(frames[0])
            else:
                self.out.send_multipart(frames, copy=False)

    def reply(self, call_id: int, ok: bool, body: list[Any]) -> None:
        """Send `Reply(call_id, ok)` with `body` (any thread): `send`, in fewer steps on a lane (a reply per call
        per worker, each run cold)."""
        lane = self.lane
        if lane is not None and len(body) == 1:
            with self._lock:
                pieces = self._sign(self._seq + 1, (_REPLY, call_id, ok), body[0])
                if pieces is not None:
                    self._seq += 1
                    lane.send_frame(pieces)
                    return
        self.send(protocol.Reply(call_id, ok), body)

    def recv(self, readable: bool = False) -> codec.Envelope | None:
        """The next command (blocks); None for one that failed its checks (logged). `readable`: a poller on
        `cmd` has just said a command is there."""
        frames: Any
        if self.lane is not None:
            try:
                frames = self.lane.recv_checked(self._take, readable)
                if type(frames) is codec.Envelope:  # (the common case: checked straight off the stream)
                    frames.message = protocol.unpack(frames.message)
                    return frames
                if frames is None:  # the controller closed our lane: it dropped this mesh, or it is gone
                    os._exit(1)
                if len(frames) == 1:  # (cut out by `ready`)
                    env = self._take(memoryview(frames[0]))
                    if env is not None:
                        env.message = protocol.unpack(env.message)
                        return env
            except (pickle.UnpicklingError, ValueError, EOFError, TypeError) as e:
                self.log("a command", str(e))
                return None
            # (anything `_take` did not take: `decode` and the checks below say what is wrong)
        else:
            cmd = self.cmd
            frame = cmd.recv(copy=False)
            frames = [frame.buffer[TOPIC:]]
            while frame.more:
                frame = cmd.recv(copy=False)
                frames.append(frame)
        try:
            env = codec.decode(self.keys.key, frames)  # (our mesh's key: a message signed with it is ours)
            if env.mesh_id != self.keys.mesh_id or env.rank != codec.CONTROLLER:
                raise ValueError(f"it claims to come from ({env.mesh_id}, {env.rank})")
            if env.seq <= self._seen[0]:
                self.log("a replayed command", f"number {env.seq} was already taken")
                return None
            self._seen[0] = env.seq
            env.message = protocol.unpack(env.message)
            return env
        except (codec.BadSignature, ValueError) as e:
            self.log("a command", str(e))
            return None

    def ready(self) -> bool:
        """Whether a command was read already (a poller on `cmd` would not see it)."""
        return self.lane is not None and self.lane.ready()

    def store_client(self) -> StoreConnection:
        """A connection of its own to the controller's store (one per thread: see `wire/store.py`)."""
        return StoreConnection(self)

    def close(self) -> None:
        """Close every socket (the store connections of other threads too), after sending what is queued
        (up to 5 s)."""
        if self.lane is not None:
            self.lane.close()  # (what was sent is in the controller's socket already)
        else:
            self.out.close(linger=5000)
        self.ctx.destroy(linger=0)  # closes the rest, then waits for the output socket


_REPLY = protocol.Reply._tag  # type: ignore[attr-defined]
"""`Reply`'s wire tag (`protocol.pack` of a `Reply` is ``(_REPLY, call_id, ok)``)."""


class StoreConnection:
    """One thread's connection to the controller's rendezvous store: a request, then its answer."""

    def __init__(self, transport: WorkerTransport) -> None:
        k = transport.keys
        self.keys = k
        self.sock = transport.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        curve_client(self.sock, k)
        self.sock.connect(k.store_addr)
        self._seq = 0
        self._seen = 0

    def request(self, message: Any, timeout: float) -> protocol.StoreAnswer:
        """Send `message`, wait up to `timeout` seconds for the answer; `TimeoutError` if none came."""
        k = self.keys
        self._seq += 1
        self.sock.send_multipart(codec.encode(k.key, k.mesh_id, k.rank, self._seq, protocol.pack(message)))
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not self.sock.poll(max(1, int(left * 1000))):
                raise TimeoutError(f"the controller's store did not answer within {timeout:.0f} s")
            frames = self.sock.recv_multipart(copy=False)
            try:
                env = codec.decode(k.key, frames)
            except codec.BadSignature:
                continue
            if env.seq <= self._seen or env.mesh_id != k.mesh_id:
                continue
            self._seen = env.seq
            answer: protocol.StoreAnswer = protocol.unpack(env.message)
            if answer.request == self._seq:
                return answer

    def close(self) -> None:
        self.sock.close(0)
