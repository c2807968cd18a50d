"""The script debugger's server: in a plain script, workers paused in pdb wait here for `monarch debug`.

A terminal can serve one prompt at a time, and a script's terminal is busy with the script's own output;
so in a script (when `StdinService.prompt` is still the terminal) a worker's pdb prompt is handed to this
server instead. It starts when the first rank pauses: it listens on a Unix socket in a private directory
(`wire/debug.py`), says once on stderr how to attach, and serves one client at a time from its own thread.
The client lists the paused ranks (with the call each serves, and those stopped post-mortem, after an error,
marked so), sends a pdb command to one or several of them, and sees their output (the terminal keeps getting
all output too: the server taps the receiver's output delivery) until each rank is paused again, or runs on
(`c`, or its call ended). The Jupyter kernel keeps its in-notebook pdb:
it replaces `StdinService.prompt`, and nothing comes here.

A paused rank is an `InputRequest`; it drops out of the list when its call ended on that rank (an
interrupt, or the mesh stopped). The server stops, and removes its socket, when no mesh of its
controller runs any more, when the controller shuts down, and at interpreter exit. A client that goes
away mid-command leaves the ranks as they are, for the next client.
"""

from __future__ import annotations

import atexit
import os
import select
import socket
import sys
import threading
import time
from typing import TYPE_CHECKING, Any

from monarch.runtime.common import log
from monarch.runtime.controller.output import OutputEvent
from monarch.runtime.controller.stdin import RESUME_COMMANDS, InputRequest
from monarch.runtime.wire import debug as debugwire

if TYPE_CHECKING:
    from monarch.runtime.controller.core import Controller
    from monarch.runtime.controller.state import SpawnedMesh

_log = log.get("debugger")

Key = tuple[int, int]
"""(mesh id, rank): one paused rank."""

HINT_AFTER = 2.0
"""Seconds a command waits for its ranks before the client is told they are running (Ctrl-C stops it)."""
SEND_TIMEOUT = 5.0
"""Seconds a write to the client may block; a client that reads nothing for longer is dropped."""


class DebugServer:
    """Holds the paused ranks of this controller's meshes and serves `monarch debug` clients."""

    def __init__(self, controller: Controller) -> None:
        self.controller = controller
        """The `core.Controller` (not named as a type: it imports this module)."""
        self.closed = False
        self.failed = False
        """The directory or socket could not be used (it was said why): the terminal serves pdb instead."""
        self.path = ""
        """The socket, once listening."""
        self.paused: dict[Key, InputRequest] = {}
        self._cond = threading.Condition()  # guards paused, _heard, _driving
        self._heard: list[OutputEvent] = []
        """Output of the ranks a command waits on, in arrival order, not yet sent to the client."""
        self._driving: set[Key] = set()
        """Ranks a client's command was sent to and that have not paused again (their pauses are news
        to the client only, not announced on stderr)."""
        self._start_lock = threading.Lock()
        self._listener: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._wake_r = self._wake_w = -1
        self._announced = False

    # -- called by the receiving thread ------------------------------------------------------------
    def add(self, req: InputRequest) -> bool:
        """A rank paused in pdb: keep it for a client. False if the server cannot run (the caller falls
        back to the terminal)."""
        with self._start_lock:
            if self.failed or self.closed or (self._thread is None and not self._start()):
                return False
        key = (req.mesh.mesh_id, req.rank)
        with self._cond:
            driven = key in self._driving
            self.paused[key] = req
            self._cond.notify_all()
        if not driven:
            self._announce(req)
        return True

    def _tap(self, event: OutputEvent) -> None:
        if (event.mesh_id, event.rank) in self._driving:
            with self._cond:
                self._heard.append(event)
                self._cond.notify_all()

    def _mesh_changed(self, mesh: SpawnedMesh) -> None:
        """A mesh changed state (any thread): waiting commands look again; no mesh running, we stop."""
        with self._cond:
            self._cond.notify_all()
        meshes = list(self.controller.meshes.values())
        if mesh.state in ("stopped", "failed") and not any(m.state == "running" for m in meshes):
            self.close()

    # -- starting and stopping ---------------------------------------------------------------------
    def _start(self) -> bool:
        try:
            directory = debugwire.private_dir(create=True)
            debugwire.find_servers(directory)  # (removes sockets of scripts that are gone)
            path = debugwire.socket_path(directory, os.getpid())
            if os.path.lexists(path):
                os.unlink(path)
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                listener.bind(path)
                os.chmod(path, 0o600)
                listener.listen(4)
            except OSError:
                listener.close()
                raise
        except OSError as e:
            self.failed = True
            print(
                f"monarch: the script debugger cannot start: {e}; this terminal serves pdb prompts instead",
                file=sys.stderr,
                flush=True,
            )
            return False
        self.path, self._listener = path, listener
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self.controller.receiver.taps.append(self._tap)
        self.controller.add_listener(self._mesh_changed)
        atexit.register(self.close)
        self._thread = threading.Thread(target=self._serve, name="monarch-debug-server", daemon=True)
        self._thread.start()
        _log.info("debug server listening on %s", path)
        return True

    def close(self) -> None:
        """Stop serving and remove the socket (idempotent; any thread but the server's own)."""
        with self._start_lock:
            if self.closed:
                return
            self.closed = True
        with self._cond:
            self._cond.notify_all()
        atexit.unregister(self.close)
        if self._thread is None:
            return
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass
        if self._thread is not threading.current_thread():
            self._thread.join(2)
        if self._tap in self.controller.receiver.taps:
            self.controller.receiver.taps.remove(self._tap)
        self.controller.remove_listener(self._mesh_changed)
        if self._listener is not None:
            self._listener.close()
        try:
            os.unlink(self.path)
        except OSError:
            pass
        if not self._thread.is_alive():
            os.close(self._wake_r)
            os.close(self._wake_w)
        _log.info("debug server stopped")

    def _announce(self, req: InputRequest) -> None:
        where = f" at {req.where}" if req.where else ""
        line = f"monarch: rank {req.rank} ({req.label}) paused in pdb{where}"
        if not self._announced:
            self._announced = True
            line += "; attach with: python -m monarch debug"
        break_line = getattr(self.controller.output, "break_line", None)
        if break_line is not None:
            break_line()
        print(line, file=sys.stderr, flush=True)

    # -- which ranks are paused --------------------------------------------------------------------
    def _still_paused(self, req: InputRequest) -> str | None:
        """Why `req` no longer waits for an answer (its mesh stopped, its call ended there), or None."""
        if req.mesh.state != "running":
            return "its mesh stopped"
        if req.call_id is None:
            return None
        pending = self.controller.calls.get(req.call_id)
        if pending is None or req.rank in pending.replies:
            return "its call ended"
        return None

    def entries(self) -> list[dict[str, Any]]:
        """The paused ranks, by mesh and rank, as the client lists them."""
        with self._cond:
            for key, req in list(self.paused.items()):
                if self._still_paused(req) is not None:
                    del self.paused[key]
            reqs = sorted(self.paused.values(), key=lambda r: (r.mesh.mesh_id, r.rank))
        return [self._describe(r) for r in reqs]

    def _describe(self, req: InputRequest) -> dict[str, Any]:
        """One paused rank as the client lists it: its mesh, rank, coordinates, host, the controller's call it
        serves (``debugee.to_debug``, a live function's name; for an actor called by an actor, the call that
        started it all), the actors living on it (`attach <actor> <rank>` names one), where it is paused, its
        prompt."""
        pending = self.controller.calls.get(req.call_id) if req.call_id is not None else None
        info = req.mesh.info[req.rank] if req.rank < len(req.mesh.info) else {}
        actors = sorted(name for name, (_, ranks) in list(req.mesh.actors.items()) if req.rank in ranks)
        return {
            **_entry(req),
            "call": pending.name if pending is not None else "",
            "actors": actors,
            "host": str(info.get("host", "")),
        }

    # -- the server's thread -----------------------------------------------------------------------
    def _serve(self) -> None:
        client: _Client | None = None
        assert self._listener is not None
        listener = self._listener
        while not self.closed:
            fds: list[Any] = [listener, self._wake_r] + ([client.sock] if client is not None else [])
            try:
                ready, _, _ = select.select(fds, [], [], 1.0)
            except (OSError, ValueError):
                break  # (closed under us)
            if self._wake_r in ready:
                os.read(self._wake_r, 64)
            if listener in ready:
                client = self._accept(listener, client)
            if client is not None and client.sock in ready:
                try:
                    for message in client.reader.read():
                        self._handle(client, message)
                        if client.gone:
                            break
                except OSError:
                    client.gone = True
                if client.gone or client.reader.closed:
                    _log.info("debug client disconnected")
                    client.sock.close()
                    client = None
        if client is not None:
            client.sock.close()

    def _accept(self, listener: socket.socket, client: _Client | None) -> _Client | None:
        try:
            conn, _ = listener.accept()
        except OSError:
            return client
        try:
            uid = debugwire.peer_uid(conn)
        except OSError:
            uid = -1
        if uid != os.getuid():
            _log.warning("refused a debug client of uid %d (only uid %d may attach)", uid, os.getuid())
            conn.close()
            return client
        conn.settimeout(SEND_TIMEOUT)
        new = _Client(conn)
        if client is not None:
            new.send({"ev": "error", "message": "another monarch debug client is attached to this script"})
            conn.close()
            return client
        _log.info("debug client attached")
        new.send({"ev": "hello", "pid": os.getpid(), "script": " ".join(sys.argv), "paused": len(self.entries())})
        return new

    def _handle(self, client: _Client, message: dict[str, Any]) -> None:
        op = message.get("op")
        if op == "list":
            client.send({"ev": "list", "ranks": self.entries()})
        elif op == "send":
            targets, line = message.get("targets"), message.get("line")
            keys = _keys(targets)
            if keys is None or not isinstance(line, str) or "\n" in line:
                client.send({"ev": "error", "message": "send needs targets [[mesh, rank], ...] and one line"})
            else:
                self._command(client, keys, line)
        elif op == "stop":
            pass  # (a Ctrl-C that crossed its command's end: nothing waits, and no answer is expected)
        else:
            client.send({"ev": "error", "message": f"unknown request {op!r}; one of: list, send, stop"})

    def _command(self, client: _Client, keys: list[Key], line: str) -> None:
        """Send `line` to each paused rank of `keys`; stream their output to the client until each is paused
        again or runs on (the client can stop waiting). Ranks are answered all at once: a command such as
        `n` over a collective only returns when every rank involved has stepped."""
        resume = line.strip().split(" ")[0] in RESUME_COMMANDS | {debugwire.CONTINUE_LINE}
        refused: list[str] = []
        with self._cond:
            reqs: dict[Key, InputRequest] = {}
            for key in keys:
                req = self.paused.pop(key, None)
                why = "it is not paused" if req is None else self._still_paused(req)
                if why is None and req is not None:  # (why is None only for a paused req)
                    reqs[key] = req
                else:
                    refused.append(f"rank {key[1]} is no longer paused: {why}")
            if not resume:  # (a rank that runs on and pauses again later is news: announced)
                self._driving.update(reqs)
        for message in refused:
            client.send({"ev": "error", "message": message})
        waiting = dict(reqs)
        for req in reqs.values():
            self.controller.stdin.answer(req, True, line)
        if resume:
            why = "quit pdb" if line.strip()[:1] in ("q", "e") else "continued"
            for req in reqs.values():
                client.send(_running(req, why))
            waiting = {}
        started = time.monotonic()
        hinted = False
        try:
            while waiting and not self.closed and not client.gone:
                with self._cond:
                    settled = self._settled(waiting)
                    if not settled and not self._heard:
                        self._cond.wait(0.1)  # (replies to single ranks notify nobody: look again soon)
                        settled = self._settled(waiting)
                    heard, self._heard = self._heard, []  # (after: all a rank wrote before it paused again)
                    for key, _ in settled:
                        self._driving.discard(key)
                for ev in heard:
                    if (ev.mesh_id, ev.rank) in reqs:
                        client.send(_output(ev))
                for key, reply in settled:
                    waiting.pop(key)
                    client.send(reply)
                if waiting and not hinted and time.monotonic() - started > HINT_AFTER:
                    hinted = True
                    client.send({"ev": "waiting", "labels": [r.label for r in waiting.values()]})
                if waiting and self._stop_asked(client):
                    for req in waiting.values():
                        client.send(_running(req, debugwire.STOPPED_WAITING))
                    waiting = {}
        finally:
            with self._cond:
                self._driving.difference_update(reqs)
                self._heard = [ev for ev in self._heard if (ev.mesh_id, ev.rank) in self._driving]
        client.send({"ev": "done"})

    def _settled(self, waiting: dict[Key, InputRequest]) -> list[tuple[Key, dict[str, Any]]]:
        """Ranks of `waiting` paused again (with their new prompt) or no longer paused (and why); under
        `_cond`."""
        settled = []
        for key, req in waiting.items():
            again = self.paused.get(key)
            if again is not None:
                settled.append((key, {"ev": "paused", **self._describe(again)}))
            elif (why := self._still_paused(req)) is not None:
                settled.append((key, _running(req, why)))
        return settled

    def _stop_asked(self, client: _Client) -> bool:
        """Did the client ask to stop waiting (Ctrl-C), or go away? (Without blocking.)"""
        try:
            ready, _, _ = select.select([client.sock], [], [], 0)
        except (OSError, ValueError):
            client.gone = True
            return True
        if not ready:
            return False
        messages = client.reader.read()
        if client.reader.closed:
            client.gone = True
            return True
        return any(m.get("op") == "stop" for m in messages)


class _Client:
    """One connected `monarch debug` client."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.reader = debugwire.LineReader(sock)
        self.gone = False

    def send(self, message: dict[str, Any]) -> None:
        if self.gone:
            return
        try:
            self.sock.sendall(debugwire.encode(message))
        except OSError:  # (a timeout too: a client that reads nothing is dropped)
            self.gone = True


def _keys(targets: Any) -> list[Key] | None:
    if not isinstance(targets, list):
        return None
    keys = []
    for t in targets:
        if not (isinstance(t, list) and len(t) == 2 and all(type(x) is int for x in t)):
            return None
        keys.append((t[0], t[1]))
    return keys


def _entry(req: InputRequest) -> dict[str, Any]:
    coords = {}
    for part in req.label.split(","):
        name, _, value = part.partition("=")
        coords[name] = int(value) if value.isdigit() else value
    return {
        "mesh": req.mesh.mesh_id,
        "rank": req.rank,
        "label": req.label,
        "coords": coords,
        "where": req.where,
        "post_mortem": debugwire.is_post_mortem(req.where),
        "prompt": req.prompt,
    }


def _running(req: InputRequest, why: str) -> dict[str, Any]:
    return {"ev": "running", "mesh": req.mesh.mesh_id, "rank": req.rank, "label": req.label, "why": why}


def _output(ev: OutputEvent) -> dict[str, Any]:
    text = ev.text if ev.stream != "display" else (ev.data or {}).get("text/plain", "") + "\n"
    return {"ev": "output", "mesh": ev.mesh_id, "rank": ev.rank, "label": ev.label, "stream": ev.stream, "text": text}
