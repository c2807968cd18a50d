"""The controller: one per process; owns the meshes and the calls in flight.

The user's threads send commands (pipelined, never waiting for an answer) through the backend, which
runs the workers; replies are received by `Receiver`, input requests served by `StdinService`.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import itertools
import logging
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

from monarch.runtime import backends
from monarch.runtime.common import log
from monarch.runtime.common.config import Settings, settings
from monarch.runtime.common.errors import WorkerDiedError
from monarch.runtime.common.shape import Shape
from monarch.runtime.controller.calls import Calls
from monarch.runtime.controller.casts import Casts
from monarch.runtime.controller.debugger import DebugServer
from monarch.runtime.controller.output import LineLabeller, OutputEvent
from monarch.runtime.controller.progress import SpawnProgress, TerminalProgress
from monarch.runtime.controller.receiving import Receiver
from monarch.runtime.controller.state import PendingCall, SpawnedMesh
from monarch.runtime.controller.stdin import StdinService
from monarch.runtime.controller.watchdogs import Watchdogs
from monarch.runtime.wire import protocol
from monarch.runtime.wire.hold import HOLD

if TYPE_CHECKING:
    from monarch.runtime.backends.base import Backend
    from monarch.runtime.backends.hosts import HostsBackend
    from monarch.runtime.backends.local import LocalBackend
    from monarch.runtime.procs.jobfiles import AgentRecord, JobDir

_log = log.get("controller")


_NEEDS_TORCH = (protocol.MakeGroups, protocol.RunOps, protocol.ReformGroups)
"""What a worker that has not set torch up cannot run (a `Call` says so itself: `Controller.call`)."""

STOPPED_BY_USER = "(mesh.exit(), %mesh restart or %mesh shutdown)"
"""What stopped a mesh, unless told otherwise."""


class Controller:
    """Owns this process's meshes. Get it with `get_controller()`."""

    def __init__(self, config: Settings | None = None) -> None:
        log.configure("controller")
        self.settings = config or settings()
        self.meshes: dict[int, SpawnedMesh] = {}
        self.calls = Calls(self)
        """The calls in flight: each one's life is changed there only."""
        self.output: Callable[[OutputEvent], None] = LineLabeller()
        """Where worker output and displays go; the notebook extension routes them per cell."""
        self.stdin = StdinService(self, DebugServer)
        self.spawn_progress: Callable[[str, int], SpawnProgress] = TerminalProgress
        """Makes what shows a mesh's start, from its shape and size (the notebook shows it in the cell)."""
        self.notify: Callable[[str], None] = _print_notice
        """Shows a notice of the runtime's that no call carries (a worker of an idle mesh died): stderr here;
        the notebook shows it in the running cell, or at the top of the next one."""
        self.listeners: list[Callable[[SpawnedMesh], None]] = []
        """Called (on any thread) when a mesh's workers change state: busy, idle, failed, stopped."""
        self._ids = itertools.count(1)
        self._torch_lock = threading.Lock()
        self._mesh_ids = itertools.count(0)
        self._spawn_lock = threading.Lock()
        self._closed = False
        self.backend: Backend = backends.create(self.settings, self._on_lost)
        self.jobs: dict[str, HostsBackend] = {}
        """Job name -> the backend of its host agents, once attached."""
        self.watchdogs = Watchdogs(self)
        """Hang reports, stack reports, and the stacks requests they make."""
        self.receiver = Receiver(self)
        self.casts = Casts(self._send_now)
        """`broadcast()`s to actors not sent yet (batched; sent before anything else to their mesh)."""
        atexit.register(self.shutdown)

    # -- meshes ------------------------------------------------------------------------------------
    def spawn(self, sizes: dict[str, int], backend: Backend | None = None, announce: bool = True) -> SpawnedMesh:
        """Start one worker per point of `sizes` (on this machine, or with `backend`, on a job's hosts);
        return when all are ready. `announce=False`: no progress shown (a simulated mesh starts at once)."""
        shape = Shape.from_sizes(sizes)
        with self._spawn_lock:
            mesh_id = next(self._mesh_ids)
        labels = [shape.label(c) for c, _ in shape.points()]
        mesh = SpawnedMesh(self, mesh_id, shape, labels, backend or self.backend)
        self.meshes[mesh_id] = mesh
        progress = self.spawn_progress(shape.describe(), len(shape)) if announce else SpawnProgress("", 0)
        _log.info("mesh %d %s: starting %d workers", mesh_id, shape.describe(), len(shape))
        started = time.monotonic()
        try:
            mesh.info = mesh.backend.start(mesh_id, shape, labels, progress.update)
            mesh.torch_ready = all(i.get("torch", True) for i in mesh.info)
        except BaseException as e:
            self.meshes.pop(mesh_id, None)
            progress.finish(e)
            _log.info("mesh %d did not start: %s: %s", mesh_id, type(e).__name__, e)
            raise
        progress.finish(None)
        _log.info("mesh %d: %d workers ready in %.2f s", mesh_id, len(shape), time.monotonic() - started)
        mesh.state = "running"
        self.changed(mesh)
        return mesh

    def attach(
        self, job_dir: JobDir, records: list[AgentRecord], why_ended: Callable[[], str] = lambda: ""
    ) -> HostsBackend:
        """The backend of a job's host agents (connected once per job; `records`: its agents; `why_ended`:
        why its hosts went, asked when one is lost)."""
        backend = self.jobs.get(job_dir.name)
        if backend is None or any(h.lost for h in backend.hosts):
            if backend is not None:
                self.detach(job_dir.name)
            from monarch.runtime.backends.hosts import HostsBackend

            local = cast("LocalBackend", self.backend)  # (what `backends.create` makes)
            backend = HostsBackend(local, job_dir, self._on_lost, why_ended)
            backend.attach(records)
            self.jobs[job_dir.name] = backend
        return backend

    def detach(self, name: str) -> None:
        """Stop this controller's meshes on job `name` and close its links (the agents stay)."""
        backend = self.jobs.get(name)
        if backend is None:
            return
        for mesh in [m for m in list(self.meshes.values()) if m.backend is backend]:
            self.stop(mesh, why=f"because its job {name!r} was cleaned up (monarch.notebook.cleanup)")
        if self.jobs.pop(name, None) is not None:
            backend.close()

    def add_listener(self, fn: Callable[[SpawnedMesh], None]) -> None:
        """Call `fn(mesh)` (on any thread) whenever a mesh's workers change state."""
        self.listeners.append(fn)

    def remove_listener(self, fn: Callable[[SpawnedMesh], None]) -> None:
        if fn in self.listeners:
            self.listeners.remove(fn)

    def changed(self, mesh: SpawnedMesh) -> None:
        for fn in list(self.listeners):
            try:
                fn(mesh)
            except Exception:
                traceback.print_exc(file=sys.__stderr__)

    # -- commands ----------------------------------------------------------------------------------
    def send(
        self,
        mesh: SpawnedMesh,
        ranks: tuple[int, ...] | None,
        message: Any,
        body: list[bytes | memoryview] | None = None,
    ) -> None:
        """Send a `protocol` message to `ranks` of `mesh` (None or every rank: all) without waiting (after the
        broadcasts queued for the mesh)."""
        if not mesh.torch_ready and type(message) in _NEEDS_TORCH:
            self.ready_torch(mesh)
        if self.casts.pending and mesh.mesh_id in self.casts.pending:
            self.casts.flush(mesh.mesh_id)
        self._send_now(mesh, ranks, message, body)

    def ready_torch(self, mesh: SpawnedMesh) -> None:
        """Have the workers of `mesh` set torch up, if they have not (a mesh of a program that had not imported
        torch): sent once, before the first message that needs it, and before any other thread's."""
        with self._torch_lock:
            if mesh.torch_ready:
                return
            _log.info("mesh %d: its workers set torch up (first use)", mesh.mesh_id)
            self._send_now(mesh, None, protocol.ReadyTorch(), None)
            mesh.torch_ready = True

    def _send_now(
        self, mesh: SpawnedMesh, ranks: tuple[int, ...] | None, message: Any, body: list[bytes | memoryview] | None
    ) -> None:
        if ranks is not None and len(ranks) == mesh.size:
            ranks = None
        mesh.backend.send(mesh.mesh_id, ranks, message, body)

    def cast(self, mesh: SpawnedMesh, ranks: tuple[int, ...], item: tuple[Any, ...]) -> None:
        """Queue a `broadcast()` to actors (`protocol.Cast`'s item) for `ranks` of `mesh`: it is sent with the
        others made about then, before anything else sent to the mesh (`controller/casts.py`)."""
        self.casts.add(mesh, ranks, item)

    def call(
        self,
        mesh: SpawnedMesh,
        ranks: tuple[int, ...],
        message_for: Callable[[int], tuple[Any, list[bytes | memoryview] | None]],
        no_stdin: str | None = None,
        output: Callable[[OutputEvent], None] | None = None,
        name: str = "",
        torch: bool = True,
    ) -> PendingCall:
        """Start a call on `ranks`: `message_for(call_id)` gives its message and body (`torch`: whether what it
        runs needs torch set up: everything but the runtime's own actor functions). Its future resolves to
        ``{rank: envelope of its Reply}``."""
        mesh.check_usable(ranks)
        if torch and not mesh.torch_ready:
            self.ready_torch(mesh)
        call_id = next(self._ids)
        pending = PendingCall(
            call_id, mesh, ranks, concurrent.futures.Future(), no_stdin=no_stdin, output=output, name=name,
            started=time.monotonic(),
        )  # fmt: skip
        self.calls.register(pending)
        dead = mesh.failure or mesh.lost_among(ranks)
        if dead is not None:  # died between the check and the registration
            self.calls.fail(pending, dead)
        else:
            message, body = message_for(call_id)
            self.send(mesh, ranks, message, body)
            if _log.isEnabledFor(logging.DEBUG):  # (per call: one call, not `debug`'s two)
                _log.debug("call %d (%s) sent to %d ranks of mesh %d", call_id, name, len(ranks), mesh.mesh_id)
        if self.listeners:
            self.changed(mesh)
        return pending

    def wait(
        self, pending: PendingCall, timeout: float | None = None, until: concurrent.futures.Future[Any] | None = None
    ) -> Any:
        """Wait for a call's replies, ``{rank: envelope}`` (this thread receives them; Ctrl-C propagates); with
        `until`, only until that future is done (a point's answer: `values.PointFuture`)."""
        return self.receiver.wait(pending, timeout, until)

    def interrupt(self, pending: PendingCall) -> None:
        """Interrupt `pending` on the workers still busy with it. A worker running another thread's call
        goes on with it and skips `pending` when it comes."""
        busy = tuple(Calls.running_ranks(pending))
        pending.mesh.backend.interrupt(pending.mesh.mesh_id, busy, pending.call_id)

    # -- losing and stopping -------------------------------------------------------------------------
    def _on_lost(self, mesh_id: int, rank: int, cause: str) -> None:
        """The backend lost a worker of a running mesh. SPMD code cannot go on without a rank: fail the mesh,
        its calls, stop the rest. A mesh with actors is supervised instead (`_lose_rank`)."""
        mesh = self.meshes.get(mesh_id)
        if mesh is None or mesh.state != "running":
            return  # stopping, or already failed: expected
        if mesh.actors:
            self._lose_rank(mesh, rank, cause)
            return
        mesh.state = "failed"
        mesh.failure = WorkerDiedError(rank, mesh.labels[rank], cause, mesh.shape.describe(), mesh.size)
        self.casts.drop(mesh_id)
        mesh.backend.kill(mesh_id)
        self._mark_gone(mesh)
        self.calls.fail_mesh(mesh, mesh.failure)
        self.changed(mesh)
        self.notify(f"monarch: {mesh.failure}")

    def _lose_rank(self, mesh: SpawnedMesh, rank: int, cause: str) -> None:
        """One rank of a mesh with actors is gone (monitor thread): fail the calls waiting on it, make later
        calls that include it fail at once (`SpawnedMesh.lost`), and let the rest of the mesh go on. The
        actors' supervision (`mesh.on_rank_lost`) hears of it last; it only queues work, never blocks."""
        if rank in mesh.lost:
            return
        error = WorkerDiedError(rank, mesh.labels[rank], cause, mesh.shape.describe(), mesh.size, kept=True)
        mesh.lost[rank] = error
        _log.info("mesh %d: rank %d %s; the rest of the mesh goes on (it runs actors)", mesh.mesh_id, rank, cause)
        mesh.backend.kill_rank(mesh.mesh_id, rank)  # (one that froze or stopped reading: it must not linger)
        self.calls.fail_rank(mesh, rank, error)
        self.changed(mesh)
        for fn in list(mesh.on_rank_lost):
            try:
                fn(rank, error)
            except Exception:
                traceback.print_exc(file=sys.__stderr__)

    def _mark_gone(self, mesh: SpawnedMesh) -> None:
        try:
            mesh.backend.mark_gone(mesh.mesh_id)
        except Exception:  # the store is ours and local: this is not expected, and not fatal
            traceback.print_exc(file=sys.__stderr__)

    def stop(self, mesh: SpawnedMesh, why: str = STOPPED_BY_USER) -> None:
        """Stop a mesh's workers: ask them to exit, kill those that do not. Idempotent. `why`: what its
        running calls say stopped it."""
        if mesh.state == "stopped":
            return
        was_running = mesh.state == "running"
        mesh.state = "stopping"
        self.calls.stop_mesh(mesh, why)  # (its calls end first, as stopped)
        if was_running:
            self.casts.flush(mesh.mesh_id)  # (broadcasts made before the stop run before the workers exit)
        else:
            self.casts.drop(mesh.mesh_id)
        mesh.exit_codes = mesh.backend.stop(mesh.mesh_id, graceful=was_running)
        mesh.state = "stopped"
        if mesh.logs is not None:
            mesh.logs.close()
        self._mark_gone(mesh)
        self.meshes.pop(mesh.mesh_id, None)
        _log.info("mesh %d stopped (exit codes by rank: %s)", mesh.mesh_id, mesh.exit_codes)
        self.changed(mesh)
        self._detach_unused(mesh.backend)

    def _detach_unused(self, backend: Backend) -> None:
        """A job's last mesh here stopped: let go of its agents, so another controller (a second notebook)
        can attach; attaching again takes milliseconds."""
        for name, b in list(self.jobs.items()):
            if b is backend and not any(m.backend is b for m in self.meshes.values()):
                self.jobs.pop(name, None)
                b.close()

    def stop_all(self) -> list[SpawnedMesh]:
        """Stop every mesh; returns those that were stopped."""
        stopped = [m for m in list(self.meshes.values()) if m.state != "stopped"]
        for mesh in stopped:
            self.stop(mesh)
        return stopped

    def shutdown(self) -> None:
        """Stop every mesh and close the sockets (runs at interpreter exit)."""
        if self._closed:
            return
        _log.info("shutting down: %d meshes to stop", len(self.meshes))
        self.stop_all()
        self.casts.close()
        self.stdin.close()
        for name in list(self.jobs):
            self.detach(name)
        self._closed = True
        self.receiver.close()
        self.backend.close()
        HOLD.uninstall()

    @property
    def closed(self) -> bool:
        """Shut down: a new controller is made on next use."""
        return self._closed


def _print_notice(text: str) -> None:
    print(text, file=sys.stderr)
