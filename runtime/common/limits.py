"""The system's limits on what one controller holds open: file descriptors and ZeroMQ sockets.

A controller holds a few file descriptors per local worker and per host agent (its connections, pipes, process
handles) and two ZeroMQ sockets per host agent. Linux starts a process with a soft limit of open files (often
1,024) below the hard limit any process may raise it to, and ZeroMQ allows 1,023 sockets per context unless told
more: near 256 hosts both run out, and what fails then is a socket or a pipe deep in the runtime. So the
controller raises its soft limit to the hard one as it starts (`raise_open_files`), gives its ZeroMQ context room
for as many sockets as it may open files (`size_context`), and a mesh or a job too big for what is left fails at
once, before anything starts, naming the limit and the number it needs (`check`).
"""

from __future__ import annotations

import os
from typing import Any

FDS_PER_WORKER = 5
"""File descriptors the controller holds per local worker (measured: 4; its lane, sentinel, pipes), rounded up."""
FDS_PER_HOST = 8
"""File descriptors the controller holds per host agent (a DEALER and its monitor, three connections, ZeroMQ's
own), rounded up."""
ZMQ_SOCKETS_PER_HOST = 2
"""ZeroMQ sockets the controller opens per host agent (a DEALER and its monitor)."""
SPARE = 64
"""File descriptors kept free for everything else (the user's files, a kernel's sockets)."""


class LimitError(RuntimeError):
    """A mesh or job needs more of something than the system lets this process have."""


def raise_open_files() -> tuple[int, int]:
    """Raise this process's soft limit of open files to its hard limit (allowed to any process); returns (soft,
    hard) after, -1 for no limit."""
    try:
        import resource
    except ImportError:  # (not a Unix)
        return -1, -1
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else _kernel_most()
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):  # (refused: keep the soft limit)
            pass
    return soft, hard


def _kernel_most() -> int:
    """The most open files Linux lets a process have (the hard limit's ceiling where that is unlimited)."""
    try:
        with open("/proc/sys/fs/nr_open") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 1 << 20


def size_context(ctx: Any) -> int:
    """Let a fresh ZeroMQ context open as many sockets as this process may open files (ZeroMQ's default is
    1,023, fixed once the context's first socket exists); returns the number it may open."""
    import zmq

    soft, _ = raise_open_files()
    most = ctx.get(zmq.SOCKET_LIMIT)
    want = most if soft < 0 else max(1023, min(most, soft))
    ctx.set(zmq.MAX_SOCKETS, want)
    return want


def open_files() -> int:
    """File descriptors this process has open now."""
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return 0


def check(what: str, workers: int = 0, hosts: int = 0, zmq_sockets: tuple[Any, int] | None = None) -> None:
    """Raise `LimitError` if `what` (a mesh, a job) with `workers` local workers and `hosts` host agents needs more
    open files than this process has left, or more ZeroMQ sockets than its context allows (`zmq_sockets`: the
    context and how many it has open)."""
    soft, hard = raise_open_files()
    need = workers * FDS_PER_WORKER + hosts * FDS_PER_HOST
    if soft >= 0 and open_files() + need + SPARE > soft:
        raise LimitError(
            f"{what} needs about {need:,} more open files in this process ({FDS_PER_WORKER} per local worker, "
            f"{FDS_PER_HOST} per host); it has {open_files():,} open and may have {soft:,} (RLIMIT_NOFILE; hard "
            f"limit {hard:,}). Raise the limit (`ulimit -n` in the shell that starts it, or LimitNOFILE for a "
            "service), or use fewer workers per controller."
        )
    if zmq_sockets is not None and hosts:
        import zmq

        ctx, opened = zmq_sockets
        most = ctx.get(zmq.MAX_SOCKETS)
        if opened + hosts * ZMQ_SOCKETS_PER_HOST > most:
            raise LimitError(
                f"{what} needs {hosts * ZMQ_SOCKETS_PER_HOST:,} more ZeroMQ sockets ({ZMQ_SOCKETS_PER_HOST} per host); "
                f"this controller's context has {opened:,} and allows {most:,} (ZMQ_MAX_SOCKETS, sized from "
                "RLIMIT_NOFILE): raise the open-files limit (`ulimit -n`)."
            )
