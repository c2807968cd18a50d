"""The keys that make our sockets private: a worker's keys (signing key, secret topics, addresses), CURVE for
TCP (the controller's server keys and a ZAP handler admitting live meshes' client keys; a job's agent keys)."""

from __future__ import annotations

from dataclasses import dataclass

import zmq

from monarch.runtime.common.log import RateLimitedLog


@dataclass(frozen=True)
class WorkerKeys:
    """What one worker needs to talk to its controller. Travels only through private channels (the fork
    server's pipe; a file of mode 0600), never a command line or the environment."""

    mesh_id: int
    rank: int
    key: bytes
    """The mesh's signing key (`codec`'s MACs)."""
    mesh_topic: bytes
    """The mesh's secret topic on the command socket (commands to every worker)."""
    rank_topic: bytes
    """This worker's secret topic (commands to it alone)."""
    cmd_addr: str
    reply_addr: str
    store_addr: str
    server_public: bytes | None = None
    """CURVE (TCP only): the controller's public key and this mesh's client key pair."""
    client_public: bytes | None = None
    client_secret: bytes | None = None
    lane_addr: str | None = None
    """The controller's lane socket (`wire/lanes.py`): commands and replies go over one connection to it
    instead of the command and reply sockets. None: the sockets (host agents, TCP)."""


TOPIC = 16
"""Bytes in a topic."""
UPSTREAM = b"\x02"
"""First byte of a message that workers send up the command socket (0 and 1 mean (un)subscribe)."""
HELLO = b"\x01" + UPSTREAM
"""First bytes of a worker's start-up message up the command socket: shaped as a subscription. libzmq's
XPUB_MANUAL pairs each message it hands over with the connection it came on only for (un)subscriptions, yet
takes the next pairing at every receive: a plain upstream message read before two subscriptions made the first
of them apply to the second's connection (one worker never got its commands, another got them). With every
message up the command socket subscription-shaped, the pairing holds. A hello is told from a subscription by
its length (a signed message is longer than `1 + TOPIC`: a topic may start with this byte too). (A plain
`UPSTREAM` hello is still taken, from an agent of a job reserved before.)"""


class ServerCurve:
    """CURVE for TCP: the server key pair, and a ZAP handler admitting the client keys of live meshes."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
        from zmq.auth.thread import ThreadAuthenticator

        self.public, self.secret = zmq.curve_keypair()
        self.clients: set[bytes] = set()
        self.auth = ThreadAuthenticator(ctx, log=_QuietLog())
        self.auth.start()
        self.auth.configure_curve_callback(domain="monarch", credentials_provider=self)

    def callback(self, domain: str, key: bytes) -> bool:
        return key in self.clients

    def serve(self, sock: zmq.Socket[bytes]) -> None:
        sock.curve_secretkey = self.secret
        sock.curve_publickey = self.public
        sock.curve_server = True
        sock.zap_domain = b"monarch"

    def stop(self) -> None:
        self.auth.stop()


class _QuietLog:
    """ZAP refusals are expected under attack; one rate-limited line instead of a log record each."""

    _log = RateLimitedLog("monarch")

    def debug(self, *a: object, **k: object) -> None:
        pass

    info = debug

    def warning(self, msg: object, *args: object, **k: object) -> None:
        self._log("a connection", "its CURVE key is not one of a running mesh's")

    error = warning
    exception = warning


@dataclass(frozen=True)
class AgentCurve:
    """A job's CURVE keys: the agents' server key pair (all agents of a job share it) and the one client
    key pair they admit. Kept in the job's secret file (mode 0600), never on a command line."""

    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes

    def client(self, sock: zmq.Socket[bytes]) -> None:
        sock.setsockopt(zmq.CURVE_SERVER, 0)
        sock.curve_serverkey = self.server_public
        sock.curve_publickey = self.client_public
        sock.curve_secretkey = self.client_secret

    def serve(self, sock: zmq.Socket[bytes]) -> None:
        sock.curve_secretkey = self.server_secret
        sock.curve_publickey = self.server_public
        sock.curve_server = True
        sock.zap_domain = b"monarch-agent"

    @classmethod
    def new(cls) -> AgentCurve:
        server_public, server_secret = zmq.curve_keypair()
        client_public, client_secret = zmq.curve_keypair()
        return cls(server_public, server_secret, client_public, client_secret)


def curve_client(sock: zmq.Socket[bytes], keys: WorkerKeys) -> None:
    if keys.server_public is not None:
        sock.curve_serverkey = keys.server_public
        sock.curve_publickey = keys.client_public
        sock.curve_secretkey = keys.client_secret
