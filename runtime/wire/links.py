"""A controller's links to host agents across hosts: heartbeats that notice a silent peer, and `LinkEnd`,
which signs and checks every message on a link."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import zmq

from monarch.runtime.common.config import Settings
from monarch.runtime.wire import codec, protocol

HEARTBEAT_TIMEOUT: float = Settings.heartbeat_timeout
"""Seconds without a sign of the other end before a link across hosts is taken as lost, by default
(`Settings.heartbeat_timeout`'s default, MONARCH_HEARTBEAT_TIMEOUT). (3 s took a host that was only slow for lost: on a
loaded 2-core VM, with 30-45% steal, a link went 3 s without a beat.)"""
PINGS_PER_TIMEOUT = 3
"""Heartbeats sent per timeout. A silent peer is noticed within a ping's interval plus the timeout (the timeout
runs from a ping that nothing answered), whatever the interval; each ping costs both ends' I/O threads, on
every link (a controller of 512 hosts has 2,048 links: at 1 s, 30 ms of its CPU a second per 128 hosts)."""


def heartbeat(sock: zmq.Socket[bytes], timeout: float) -> None:
    """ZeroMQ's own heartbeats on `sock`'s next connections: a peer that stops answering (a host whose link
    went down, with no RST) is disconnected after `timeout` seconds (`Settings.heartbeat_timeout`)."""
    timeout_ms = int(timeout * 1000)
    sock.setsockopt(zmq.HEARTBEAT_IVL, timeout_ms // PINGS_PER_TIMEOUT)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, timeout_ms)
    sock.setsockopt(zmq.HEARTBEAT_TTL, timeout_ms)


class LinkEnd:
    """One end of a controller's link to a host agent: signs what it sends with the job's key and checks
    what it receives (the sender it claims, its sequence number) before anything is unpickled."""

    def __init__(self, key: bytes, me: int, peer: int) -> None:
        self.key, self.me, self.peer = key, me, peer
        self.seq = 0
        self.seen = 0

    def encode(self, message: Any, body: Sequence[bytes | memoryview] | None = None) -> list[bytes | memoryview]:
        self.seq += 1
        return codec.encode(self.key, protocol.LINK, self.me, self.seq, protocol.pack(message), body)

    def decode(self, frames: Sequence[zmq.Frame | bytes | memoryview], fresh: bool = False) -> codec.Envelope:
        """The envelope, its message unpacked; ValueError (or `wire.BadSignature`) for one that fails the
        checks. `fresh`: the first message of a new connection (its numbers start again)."""
        env = codec.decode(self.key, frames)
        if env.mesh_id != protocol.LINK or env.rank != self.peer:
            raise ValueError(f"it claims to come from ({env.mesh_id}, {env.rank}), not this link's other end")
        if not fresh and env.seq <= self.seen:
            raise ValueError(f"number {env.seq} was already taken (a replay)")
        env.message = protocol.unpack(env.message)
        return env

    def accept(self, env: codec.Envelope) -> None:
        """Take `env`'s number as the last seen (after `decode` and the caller's own checks)."""
        self.seen = env.seq

    @staticmethod
    def body(env: codec.Envelope) -> Any:
        """The envelope's body, unpickled (it was checked with the envelope)."""
        return codec.loads(env.body, env.buffers)
