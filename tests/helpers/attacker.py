"""What another user on the machine tries against our sockets. tests/test_hardening.py runs each in a fresh
interpreter started as root, which imports what it needs (this Python lives where `nobody` cannot read),
then becomes uid/gid `nobody`. Each prints ``ready`` once it is in place, then returns what it got."""

from __future__ import annotations

import os
import socket
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
    s.settimeout(20)
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
    key pair of its own and without CURVE, and ask the store for its keys; listen for 3 seconds."""
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
    got, seen_secret, deadline = 0, False, time.monotonic() + 3
    while time.monotonic() < deadline:
        for s in (sub, plain):
            if s.poll(50):
                got += 1
                seen_secret = seen_secret or secret in b"".join(s.recv_multipart())
    answered = bool(store.poll(500))
    ctx.destroy(0)
    return {"received": got, "saw_secret": seen_secret, "store_answered": answered}
