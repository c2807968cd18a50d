"""What another user on the machine tries against our sockets. tests/test_hardening.py runs each in a fresh
interpreter started as root, which imports what it needs (this Python lives where `nobody` cannot read),
then becomes uid/gid `nobody`. Each prints ``ready`` once it is in place, then returns what it got."""

from __future__ import annotations

import os
import select
import socket
import sys
import time

import zmq

from monarch.runtime.wire import codec, protocol

NOBODY = 65534


def become_nobody() -> None:
    os.setgroups([])
    os.setgid(NOBODY)
    os.setuid(NOBODY)


def ready() -> None:
    print("ready", flush=True)


def local_mesh(socket_dir: str, store_path: str) -> dict:
    """List the controller's socket directory and connect to the store's socket."""
    ready()
    out = {}
    try:
        os.listdir(socket_dir)
        out["listdir"] = "allowed"
    except PermissionError:
        out["listdir"] = "refused"
    s = socket.socket(socket.AF_UNIX)
    try:
        s.connect(store_path)
        out["connect"] = "allowed"
    except PermissionError:
        out["connect"] = "refused"
    finally:
        s.close()
    return out


def lane(path: str) -> dict:
    """Connect to a controller's lane socket and write a message's worth of bytes; is the connection closed?"""
    ready()
    s = socket.socket(socket.AF_UNIX)
    try:
        s.connect(path)
    except PermissionError:
        return {"connect": "refused"}
    s.settimeout(60)
    try:
        s.sendall(b"\x01\x00\x00\x00" + (64).to_bytes(8, "little") + bytes(64))
        closed = s.recv(1) == b""
    except (ConnectionResetError, BrokenPipeError):
        closed = True
    except TimeoutError:
        closed = False
    finally:
        s.close()
    return {"connect": "allowed", "closed": closed}


def shared_memory(pid: int) -> dict:
    """Open the memory a worker shares with its peers for reduces, through any path /proc offers (its mappings,
    its open files), and look for it under /dev/shm."""
    ready()
    out = {"dev_shm": sorted(n for n in os.listdir("/dev/shm") if "monarch" in n)}
    for where in ("map_files", "fd"):
        try:
            names = os.listdir(f"/proc/{pid}/{where}")
        except PermissionError:
            out[where] = "refused"
            continue
        opened = 0
        for name in names:
            try:
                os.close(os.open(f"/proc/{pid}/{where}/{name}", os.O_RDONLY))
                opened += 1
            except OSError:
                pass
        out[where] = f"listed, {opened} opened"
    return out


def tcp_mesh(server_public: str, topic_hex: str, cmd_addr: str, store_addr: str, secret_hex: str) -> dict:
    """With the server's public key and the mesh's topic (leaked to it), subscribe to the command socket with a
    key pair of its own and without CURVE, and ask the store for its keys; listen until its standard input ends
    (the test sends its commands meanwhile)."""
    topic, secret = bytes.fromhex(topic_hex), bytes.fromhex(secret_hex)
    ctx = zmq.Context()
    public, private = zmq.curve_keypair()
    sub = ctx.socket(zmq.XSUB)
    sub.curve_serverkey, sub.curve_publickey, sub.curve_secretkey = server_public.encode(), public, private
    sub.connect(cmd_addr)
    for t in (b"", topic):
        sub.send(b"\x01" + t)
    plain = ctx.socket(zmq.SUB)  # no CURVE at all
    plain.setsockopt(zmq.SUBSCRIBE, b"")
    plain.connect(cmd_addr)
    store = ctx.socket(zmq.DEALER)
    store.curve_serverkey, store.curve_publickey, store.curve_secretkey = server_public.encode(), public, private
    store.connect(store_addr)
    store.send_multipart(codec.encode(os.urandom(32), 0, 0, 1, protocol.pack(protocol.StoreNumKeys())))
    ready()
    got, seen_secret, answered = 0, False, False
    poller = zmq.Poller()
    for s in (sub, plain, store, sys.stdin):
        poller.register(s, zmq.POLLIN)
    listening = True
    while listening:
        listening = sys.stdin.fileno() not in dict(poller.poll())  # (its end: the pipe hung up)
        for s in (sub, plain):
            while s.poll(0):
                got += 1
                seen_secret = seen_secret or secret in b"".join(s.recv_multipart())
        while store.poll(0):
            answered = bool(store.recv_multipart())
    ctx.destroy(0)
    return {"received": got, "saw_secret": seen_secret, "store_answered": answered}


def lane_flood(path: str) -> dict:
    """As a process of the same user (it can reach the controller's private directory): connect to the lanes
    socket and claim huge messages, a message of many huge frames, an endless message and endless junk
    messages, then reconnect 200 times with a claim of nearly 1 TiB. Each connection waits until the
    controller closes it; what it got for each (`closed`, or `open` if it was not closed within 60 s). An
    idle connection with half a header stays open meanwhile (it must stall nothing)."""
    huge = (1 << 40) - 13  # (with the 12-byte header: just under what any lane may claim)
    attacks = {
        "claim_512_mib": b"\x01\x00\x00\x00" + ((512 << 20) + 1).to_bytes(8, "little"),
        "claim_1_tib": b"\x01\x00\x00\x00" + huge.to_bytes(8, "little"),
        "many_frames": (4096).to_bytes(4, "little") + (1 << 28).to_bytes(8, "little") * 4096,
        "endless_message": b"\x01\x00\x00\x00" + ((1 << 20) - 100).to_bytes(8, "little"),
        "endless_junk": b"\x01\x00\x00\x00" + (64).to_bytes(8, "little") + bytes(64),
    }
    idle = socket.socket(socket.AF_UNIX)
    idle.connect(path)
    idle.sendall(b"\x01\x00\x00")
    ready()
    junk = attacks["endless_junk"] * 50
    out = {
        name: _until_closed(path, head, junk if name == "endless_junk" else bytes(65536))
        for name, head in attacks.items()
    }
    out["reconnects"] = [_until_closed(path, attacks["claim_1_tib"], b"") for _ in range(200)].count("closed")
    idle.close()
    return out


def _until_closed(path: str, head: bytes, more: bytes) -> str:
    """Connect, send `head`, then keep sending `more` (the rest of an endless message, or more junk messages)
    until the other end closes the connection."""
    s = socket.socket(socket.AF_UNIX)
    s.connect(path)
    s.setblocking(False)
    deadline = time.monotonic() + 60
    try:
        s.sendall(head[:4096])  # (a socket's buffer takes this much at once)
        while time.monotonic() < deadline:
            if select.select([s], [s] if more else [], [], 1)[0] and s.recv(1) == b"":
                return "closed"
            try:
                if more:
                    s.send(more)
            except BlockingIOError:
                pass  # (the controller reads no more of it: is it closed?)
        return "open"
    except (BrokenPipeError, ConnectionResetError):
        return "closed"
    finally:
        s.close()


def zmq_claims(path: str) -> dict:
    """As a process of the same user: speak ZeroMQ's handshake (ZMTP 3, NULL) to a socket of the controller's
    at `path` as a PUSH peer, claim a message of 512 MiB and a byte on one connection, then one of nearly 1 TiB
    on another, and wait until that one is closed. Then it is in place (the first connection still waits for
    its bytes) until its standard input ends. Whether each connection was closed by the other end."""
    conns = {
        name: _zmtp_claim(path, size)
        for name, size in (("claim_512_mib", (512 << 20) + 1), ("claim_1_tib", (1 << 40) - 13))
    }
    closed = _closed(conns["claim_1_tib"], 60)
    ready()
    sys.stdin.read()
    out = {
        "claim_512_mib": "closed" if _closed(conns["claim_512_mib"], 0) else "open",
        "claim_1_tib": "closed" if closed else "open",
    }
    for s in conns.values():
        s.close()
    return out


def _zmtp_claim(path: str, size: int) -> socket.socket:
    s = socket.socket(socket.AF_UNIX)
    s.connect(path)
    s.sendall(b"\xff" + bytes(8) + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\0") + b"\0" + bytes(31))
    ready_cmd = b"\x05READY" + bytes([11]) + b"Socket-Type" + (4).to_bytes(4, "big") + b"PUSH"
    s.sendall(bytes([0x04, len(ready_cmd)]) + ready_cmd + b"\x02" + size.to_bytes(8, "big"))
    s.setblocking(False)
    return s


def _closed(s: socket.socket, within: float) -> bool:
    """Whether the other end closes `s` within `within` seconds (what it sends meanwhile is read and dropped)."""
    deadline = time.monotonic() + within
    while True:
        try:
            if select.select([s], [], [], max(0.0, min(1.0, deadline - time.monotonic())))[0] and s.recv(65536) == b"":
                return True
        except ConnectionResetError:
            return True
        if time.monotonic() >= deadline:
            return False
