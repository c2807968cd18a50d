"""Actors calling actors, worker to worker: each worker that runs actors has an inbox (a ROUTER), and a
worker calling another's actors connects an outbox (a DEALER) to it. Nothing goes through the controller.

Privacy is the other sockets': on one machine the inbox is an IPC socket in the mesh's private directory;
across hosts (a job's workers, or `MONARCH_TRANSPORT=tcp`) it is TCP with CURVE, its server key made by the
worker. Every message is signed with the inbox's own key and carries a sequence number per sender; both are
checked before anything is unpickled. The address, CURVE key and signing key travel only inside an actor
mesh reference, which only our own processes receive (over the controller's signed, private channels).
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import zmq

from monarch.runtime.common.log import RateLimitedLog
from monarch.runtime.common.net import interface_addr
from monarch.runtime.wire import codec, protocol
from monarch.runtime.wire.keys import WorkerKeys


@dataclass(frozen=True)
class InboxAddress:
    """How to reach one worker's inbox."""

    addr: str
    """``ipc://...`` or ``tcp://host:port``."""
    public: bytes | None
    """Its CURVE server key (TCP only)."""
    key: bytes
    """The signing key it checks (and signs its answers with)."""


_seq = itertools.count(1)
"""Sequence numbers of what this process sends to inboxes (one counter: a receiver checks it per sender)."""


class Inbox:
    """A worker's ROUTER for actor messages from other workers (and from its own actors): endpoint calls
    (`ActorSend`) and messages to its ports (`PortSend`)."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], keys: WorkerKeys) -> None:
        self.keys = keys
        self.key = os.urandom(32)
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 0)  # an answer to a caller that left is dropped
        public = None
        interface = os.environ.get("GLOO_SOCKET_IFNAME")  # a job's host: the interface its groups use
        if keys.cmd_addr.startswith("ipc://") and not interface:
            directory = os.path.dirname(keys.cmd_addr[len("ipc://") :])
            self.sock.bind(f"ipc://{directory}/actors-{keys.mesh_id}-{keys.rank}")
        else:
            public, secret = zmq.curve_keypair()
            self.sock.curve_secretkey = secret
            self.sock.curve_publickey = public
            self.sock.curve_server = True
            host = (interface_addr(interface) if interface else None) or "127.0.0.1"
            self.sock.bind(f"tcp://{host}:0")
        self.address = InboxAddress(self.sock.getsockopt_string(zmq.LAST_ENDPOINT), public, self.key)
        self._seen: dict[tuple[int, int], int] = {}
        self._log = RateLimitedLog(f"monarch worker {keys.rank}")

    def recv(self) -> tuple[bytes, codec.Envelope] | None:
        """The next message and who to answer (blocks: poll first); None for one that failed its checks."""
        identity, *frames = self.sock.recv_multipart(copy=False)
        try:
            env = codec.decode(self.key, frames)
            sender = (env.mesh_id, env.rank)
            if env.seq <= self._seen.get(sender, 0):
                raise ValueError(f"number {env.seq} from {sender} was already taken (a replay)")
            self._seen[sender] = env.seq
            env.message = protocol.unpack(env.message)
            if type(env.message) not in (protocol.ActorSend, protocol.PortSend):
                raise ValueError(f"an inbox takes ActorSend and PortSend, not {type(env.message).__name__}")
            return identity.bytes, env
        except (codec.BadSignature, ValueError) as e:
            self._log("an actor message", str(e))
            return None

    def answer(self, identity: bytes, message: Any, body: Sequence[bytes | memoryview]) -> None:
        k = self.keys
        frames = codec.encode(self.key, k.mesh_id, k.rank, next(_seq), protocol.pack(message), body)
        self.sock.send_multipart([identity, *frames], copy=False)

    def close(self) -> None:
        self.sock.close(0)


class Outbox:
    """This process's connection to one worker's inbox: messages out, answers back."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], to: InboxAddress, me: tuple[int, int]) -> None:
        self.to, self.me = to, me
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 1000)  # a broadcast just sent still leaves when the caller ends
        if to.public is not None:
            self.sock.curve_serverkey = to.public
            self.sock.curve_publickey, self.sock.curve_secretkey = zmq.curve_keypair()
        self.sock.connect(to.addr)
        self._seen = 0
        self._log = RateLimitedLog(f"monarch actors {me}")

    def send(self, message: Any, body: Sequence[bytes | memoryview]) -> None:
        frames = codec.encode(self.to.key, self.me[0], self.me[1], next(_seq), protocol.pack(message), body)
        self.sock.send_multipart(frames, copy=False)

    def recv(self) -> codec.Envelope | None:
        """An answer (blocks: poll first); None for one that failed its checks."""
        frames = self.sock.recv_multipart(copy=False)
        try:
            env = codec.decode(self.to.key, frames)
            if env.seq <= self._seen:
                raise ValueError(f"number {env.seq} was already taken (a replay)")
            self._seen = env.seq
            env.message = protocol.unpack(env.message)
            if type(env.message) is not protocol.ActorAnswer:
                raise ValueError(f"an outbox takes ActorAnswer, not {type(env.message).__name__}")
            return env
        except (codec.BadSignature, ValueError) as e:
            self._log("an actor answer", str(e))
            return None

    def close(self) -> None:
        self.sock.close()
