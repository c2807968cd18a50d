"""The script debugger's socket, shared by its server (in the controller) and its client (`monarch debug`):
where the socket lives, who may use it, and what travels on it.

A script's controller listens on a Unix socket ``debug-<pid>.sock`` in a private directory:
``$XDG_RUNTIME_DIR/monarch`` where that is set, else ``/tmp/monarch-<uid>``. The directory is made with
mode 0700 and refused (`UnsafeDirError`) when it is a symbolic link, belongs to someone else, or lets
the group or others in: another user on the machine must not be able to pre-create it (and so see or
replace the socket) nor reach the socket, since whoever talks to it runs pdb commands, that is
arbitrary code, in the workers. Both ends also check who is at the other end (``SO_PEERCRED``).

What travels is newline-delimited JSON, one object a line, never pickle: a message from a peer is data,
never code. Nothing here imports torch or zmq (the client must start fast).
"""

from __future__ import annotations

import json
import os
import socket
import stat
import struct
from typing import Any

MAX_LINE = 1 << 20
"""The longest message either end accepts (bytes); a longer one ends the connection."""
STOPPED_WAITING = "you stopped waiting"
"""Why a rank is reported running when the client stopped waiting for it (Ctrl-C) mid-command."""
CONTINUE_LINE = "clear_continue"
"""The pdb command `continue` sends each paused rank: clear its breakpoints, then continue (the worker's pdb,
`worker/stdin.py`, has it)."""
POST_MORTEM = "post-mortem"
"""The word that marks a pause in pdb post-mortem (after an error) in where a rank is paused."""
NOTE_LENGTH = 60
"""The longest error a post-mortem's note quotes (characters)."""


def post_mortem_note(error: str) -> str:
    """What follows where a rank is paused when it is a post-mortem: ``(post-mortem: ValueError: bad rank)``,
    the error cut to `NOTE_LENGTH` characters on one line."""
    error = " ".join(error.split())
    if len(error) > NOTE_LENGTH:
        error = error[: NOTE_LENGTH - 3] + "..."
    return f"({POST_MORTEM}: {error})"


def is_post_mortem(where: str) -> bool:
    """Whether `where` (a paused rank's place, as the worker says it) is a post-mortem's."""
    return f"({POST_MORTEM}: " in where


class UnsafeDirError(PermissionError):
    """The debugger's directory could be reached or replaced by another user: it is not used."""


def socket_dir() -> str:
    """Where debugger sockets live (``$XDG_RUNTIME_DIR/monarch``, else ``/tmp/monarch-<uid>``)."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime:
        return os.path.join(runtime, "monarch")
    return f"/tmp/monarch-{os.getuid()}"


def check_private(path: str) -> None:
    """Raise `UnsafeDirError` unless `path` is a real directory of this user that only this user can open."""
    st = os.lstat(path)
    fix = f"remove it (rm -r {path}) and try again"
    if stat.S_ISLNK(st.st_mode):
        raise UnsafeDirError(f"{path} is a symbolic link, not a directory of yours; {fix}")
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeDirError(f"{path} is not a directory; {fix}")
    if st.st_uid != os.getuid():
        raise UnsafeDirError(f"{path} belongs to uid {st.st_uid}, not to you (uid {os.getuid()}); {fix}")
    if st.st_mode & 0o077:
        mode = oct(st.st_mode & 0o777)
        raise UnsafeDirError(f"{path} has mode {mode}: others can reach it; make it private (chmod 700 {path})")


def private_dir(create: bool) -> str:
    """The debugger's directory, checked (`check_private`); made with mode 0700 if `create`.
    FileNotFoundError when it does not exist and not `create`."""
    path = socket_dir()
    if create:
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass
    check_private(path)
    return path


def socket_path(directory: str, pid: int) -> str:
    return os.path.join(directory, f"debug-{pid}.sock")


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def find_servers(directory: str) -> list[tuple[int, str]]:
    """(pid, socket path) of each debugger socket in `directory` whose process still runs, by pid. The
    sockets of processes that are gone (a script killed with SIGKILL cleans nothing) are removed."""
    found = []
    for name in sorted(os.listdir(directory)):
        if not (name.startswith("debug-") and name.endswith(".sock")):
            continue
        try:
            pid = int(name[len("debug-") : -len(".sock")])
        except ValueError:
            continue
        path = os.path.join(directory, name)
        if pid_alive(pid):
            found.append((pid, path))
        else:
            try:
                os.unlink(path)
            except OSError:
                pass
    return sorted(found)


def peer_uid(sock: socket.socket) -> int:
    """The user id of the process at the other end of a connected Unix socket."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    uid: int
    _pid, uid, _gid = struct.unpack("3i", creds)
    return uid


def encode(message: dict[str, Any]) -> bytes:
    """One message as it travels: a line of JSON."""
    return json.dumps(message, separators=(",", ":")).encode() + b"\n"


class LineReader:
    """Splits what arrives on a socket into messages (JSON objects, one a line)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buffer = b""
        self.closed = False
        """The peer closed the connection (or sent something that is not a message)."""

    def read(self) -> list[dict[str, Any]]:
        """Receive what is there (blocking if the socket blocks) and return the whole messages so far."""
        try:
            data = self.sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            return []
        except OSError:
            data = b""
        if not data:
            self.closed = True
        self.buffer += data
        return self.messages()

    def messages(self) -> list[dict[str, Any]]:
        """The whole messages already received (no I/O)."""
        out: list[dict[str, Any]] = []
        while b"\n" in self.buffer:
            line, self.buffer = self.buffer.split(b"\n", 1)
            try:
                message = json.loads(line)
            except ValueError:
                message = None
            if not isinstance(message, dict):
                self.closed = True
                return out
            out.append(message)
        if len(self.buffer) > MAX_LINE:
            self.closed = True
        return out
