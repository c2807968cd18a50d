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
from monarch.runtime.common import load, log
from monarch.runtime.common.config import Settings, settings
from monarch.runtime.common.errors import MeshStoppedError, WorkerDiedError
from monarch.runtime.common.shape import Shape, format_ranks
from monarch.runtime.controller.casts import Casts
from monarch.runtime.controller.debugger import DebugServer
from monarch.runtime.controller.output import LineLabeller, OutputEvent
from monarch.runtime.controller.progress import SpawnProgress, TerminalProgress
from monarch.runtime.controller.receiving import Receiver
from monarch.runtime.controller.state import PendingCall, SpawnedMesh
from monarch.runtime.controller.stdin import StdinService
from monarch.runtime.wire import protocol
from monarch.runtime.wire.hold import HOLD

if TYPE_CHECKING:
    from monarch.runtime.backends.base import Backend
    from monarch.runtime.backends.hosts import HostsBackend
    from monarch.runtime.backends.local import LocalBackend
    from monarch.runtime.common.stacks import Frame
    from monarch.runtime.procs.jobfiles import AgentRecord, JobDir
    from monarch.runtime.wire import codec

RELEASE_FIRST = 0.2
"""Seconds after a rank fails (while others still run the call) before the others are asked to leave a
collective they wait in; then every `RELEASE_AGAIN` seconds until the call ends."""
RELEASE_AGAIN = 0.5
HANG_SAMPLES = 5
"""How many times the ranks of a call past `MONARCH_HANG_REPORT` are asked where they are, `HANG_EVERY`
seconds apart, before a picture that stayed the same is reported."""
HANG_EVERY = 0.5

_log = log.get("controller")
DEBUG = logging.DEBUG


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
        self.calls: dict[int, PendingCall] = {}
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
        self.receiver = Receiver(self)
        self.casts = Casts(self._send_now)
        """`broadcast()`s to actors not sent yet (batched; sent before anything else to their mesh)."""
        self.stack_replies: dict[int, dict[int, list[tuple[str, list[Frame]]]]] = {}
        """Request number -> {rank: its threads' stacks}, while `stacks` waits for them."""
        self._stack_tokens = itertools.count(1)
        if self.settings.hang_report:
            threading.Thread(target=self._watch_hangs, name="monarch-hang-watch", daemon=True).start()
        if self.settings.stack_report:
            threading.Thread(target=self._report_stacks, name="monarch-stack-report", daemon=True).start()
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
        self.calls[call_id] = pending
        dead = mesh.failure or mesh.lost_among(ranks)
        if dead is not None:  # died between the check and the registration
            self._fail(pending, dead)
        else:
            message, body = message_for(call_id)
            self.send(mesh, ranks, message, body)
            if _log.isEnabledFor(DEBUG):  # (per call: one call, not `debug`'s two)
                _log.debug("call %d (%s) sent to %d ranks of mesh %d", call_id, name, len(ranks), mesh.mesh_id)
        if self.listeners:
            self.changed(mesh)
        return pending

    def wait(self, pending: PendingCall, timeout: float | None = None) -> dict[int, codec.Envelope]:
        """Wait for a call's replies (this thread receives them; Ctrl-C propagates)."""
        return self.receiver.wait(pending, timeout)

    def interrupt(self, pending: PendingCall) -> None:
        """Interrupt `pending` on the workers still busy with it. A worker running another thread's call
        goes on with it and skips `pending` when it comes."""
        busy = tuple(r for r in pending.ranks if r not in pending.replies)
        pending.mesh.backend.interrupt(pending.mesh.mesh_id, busy, pending.call_id)

    def busy_with_earlier_calls(self, pending: PendingCall) -> set[int]:
        """Ranks of `pending`'s mesh that have not yet answered a call issued before it (by another thread)."""
        busy: set[int] = set()
        for other in list(self.calls.values()):
            if other is not pending and other.mesh is pending.mesh and other.call_id < pending.call_id:
                busy.update(r for r in other.ranks if r not in other.replies)
        return busy

    # -- one rank failed, others still run ------------------------------------------------------------
    def failed_while_others_run(self, pending: PendingCall) -> None:
        """A rank answered `pending` with an error while others still run it: those waiting in a collective
        for it would wait for ever. Show its traceback and ask them, soon and then twice a second, to leave
        it (a call whose ranks all fail within `RELEASE_FIRST` shows each error once, when it ends)."""
        if pending.failed:
            return
        pending.failed = True
        self._release_later(pending, RELEASE_FIRST)

    def _release_later(self, pending: PendingCall, delay: float) -> None:
        timer = threading.Timer(delay, self._release, (pending,))
        timer.daemon = True
        timer.start()

    def _release(self, pending: PendingCall) -> None:
        if pending.future.done() or self._closed or pending.mesh.state != "running":
            return
        if pending.early_errors:  # the call goes on without the failed ranks: show why now
            self.receiver.show_early_errors(pending)
        busy = tuple(r for r in pending.ranks if r not in pending.replies and r not in pending.released)
        if busy:
            _log.info(
                "call %d failed on a rank: asking ranks %s to leave their collective",
                pending.call_id,
                format_ranks(list(busy)),
            )
            pending.mesh.backend.control(pending.mesh.mesh_id, busy, pending.call_id, protocol.Control.RELEASE)
            # Across hosts a link between two workers is shut by one of its ends only (the one that accepted
            # it, or a sibling's on the same host): the ranks that already answered must shut theirs too.
            mesh = pending.mesh
            answered = tuple(r for r in pending.ranks if r in pending.replies)
            if answered and not pending.disconnected and mesh.backend.spans_hosts(mesh.mesh_id):
                pending.disconnected = True
                mesh.backend.control(mesh.mesh_id, answered, mesh.generation, protocol.Control.DISCONNECT)
        self._release_later(pending, RELEASE_AGAIN)

    def call_done(self, pending: PendingCall) -> None:
        """Every rank answered (receiving thread). If ranks were released from a collective, their groups are
        broken (and the failed rank's, whose peers shut their connections): re-form them before anything
        else runs on the mesh."""
        mesh = pending.mesh
        if _log.isEnabledFor(DEBUG):
            _log.debug("call %d done in %.3f s", pending.call_id, time.monotonic() - pending.started)
        if pending.released and mesh.state == "running":
            mesh.generation += 1
            _log.info("mesh %d: re-forming its groups (generation %d) after a release", mesh.mesh_id, mesh.generation)
            self.send(mesh, None, protocol.ReformGroups(mesh.generation))

    def describe_busy(
        self, mesh: SpawnedMesh, wait: float = load.ASK_WAIT, only: PendingCall | None = None
    ) -> list[tuple[PendingCall, list[int]]]:
        """The calls of `mesh` (or just `only`) still running, with their busy ranks; asks those ranks what
        they are doing (their fresh answers land in each call's `busy`, within `wait` seconds)."""
        calls = [only] if only is not None else [p for p in list(self.calls.values()) if p.mesh is mesh]
        running = [(p, [r for r in p.ranks if r not in p.replies]) for p in calls]
        running = [(p, ranks) for p, ranks in running if ranks]
        for p, ranks in running:
            for r in ranks:
                p.busy.pop(r, None)  # (an earlier answer would pass for this one)
            mesh.backend.control(mesh.mesh_id, tuple(ranks), p.call_id, protocol.Control.REPORT)
        deadline = time.monotonic() + wait
        pause = 0.001
        while (
            time.monotonic() < deadline
            and mesh.state == "running"
            and any(r not in p.busy and r not in p.replies for p, ranks in running for r in ranks)
        ):
            time.sleep(pause)
            pause = min(2 * pause, 0.01)
        return running

    # -- where ranks are ----------------------------------------------------------------------------
    def stacks(
        self, mesh: SpawnedMesh, ranks: tuple[int, ...], wait: float = 1.0
    ) -> dict[int, list[tuple[str, list[Frame]]] | None]:
        """{rank: its threads' stacks (`stacks.thread_stacks`), or None if it did not answer within `wait`}.
        Each worker's control thread answers, whatever its main thread is doing."""
        token = next(self._stack_tokens)
        got = self.stack_replies[token] = {}
        try:
            if mesh.state == "running":
                mesh.backend.control(mesh.mesh_id, ranks, token, protocol.Control.STACKS)
                deadline = time.monotonic() + wait
                while len(got) < len(ranks) and time.monotonic() < deadline:
                    time.sleep(0.01)
            return {r: got.get(r) for r in ranks}
        finally:
            self.stack_replies.pop(token, None)

    def _report_stacks(self) -> None:
        """`CONTROLLER_PYSPY_REPORT_INTERVAL`: every so often, everyone's stacks on the real stderr."""
        while not self._closed:
            time.sleep(self.settings.stack_report)
            try:
                self._print_stacks()
            except Exception:  # (a report is never worth the thread)
                traceback.print_exc(file=sys.__stderr__)

    def _print_stacks(self) -> None:
        from monarch.runtime.common.stacks import StackReport, thread_stacks

        for mesh in list(self.meshes.values()):
            if mesh.state == "running":
                report = StackReport(thread_stacks(), self.stacks(mesh, tuple(range(mesh.size))),
                                     dict(enumerate(mesh.labels)))  # fmt: skip
                stamp = time.strftime("%H:%M:%S")
                print(
                    f"monarch: stacks of mesh {mesh.shape.describe()}, {stamp}\n{report}",
                    file=sys.__stderr__,
                    flush=True,
                )

    def _watch_hangs(self) -> None:
        """Calls that have run `hang_report` seconds while ranks of theirs wait in a collective: say once,
        where the call's output goes, which ranks wait where and for whom."""
        limit = self.settings.hang_report
        while not self._closed:
            time.sleep(min(1.0, limit / 4))
            # In a frame of its own: a loop variable left bound here would keep the last call looked at,
            # and its replies (a large result's frames), alive while this thread sleeps (issue 30).
            self._look_for_hangs(limit)

    def _look_for_hangs(self, limit: float) -> None:
        now = time.monotonic()
        for pending in list(self.calls.values()):
            due = max(pending.started + limit, pending.next_hang_check)
            if not pending.hang_reported and now >= due and not pending.future.done():
                pending.next_hang_check = now + limit  # (a healthy loop is looked at again only later)
                try:
                    self._report_hang(pending)
                except Exception:
                    traceback.print_exc(file=sys.__stderr__)

    def _report_hang(self, pending: PendingCall) -> None:
        """Look HANG_SAMPLES times, HANG_EVERY seconds apart: only a picture that stays the same (the same
        ranks waiting in the same collective at the same line, the others at the same lines) is reported. A
        loop that is merely busy, its ranks meeting in collectives many times a second, is not."""
        mesh = pending.mesh
        first: dict[int, tuple[str, str]] | None = None
        said: dict[int, protocol.Busy] = {}
        busy: list[int] = []
        for i in range(HANG_SAMPLES):
            if i:
                time.sleep(HANG_EVERY)
            if mesh.state != "running" or pending.future.done():
                return
            asked = self.describe_busy(mesh, only=pending)
            if not asked:
                return
            busy = asked[0][1]
            said = {r: pending.busy[r] for r in busy if r in pending.busy}
            picture = {r: (b.collective, b.where) for r, b in said.items()}
            if not any(c for c, _ in picture.values()) or (first is not None and picture != first):
                return  # (nobody waits in a collective, or things move: looked at again later)
            first = picture
        pending.hang_reported = True
        waiting = {r: b for r, b in said.items() if b.collective}
        places: dict[tuple[str, str], list[int]] = {}
        for r, b in waiting.items():
            places.setdefault((b.collective, b.where), []).append(r)
        seconds = time.monotonic() - pending.started
        span = HANG_EVERY * (HANG_SAMPLES - 1)
        lines = [f"monarch: {pending.name or 'this call'} has run {seconds:.0f} s; for the last {span:.0f} s:"]
        for (collective, at), ranks in places.items():
            lines.append(f"  {_ranks(ranks)} {'waits' if len(ranks) == 1 else 'wait'} in {collective} at {at}")
        elsewhere = [r for r in said if r not in waiting]
        done = [r for r in pending.ranks if r in pending.replies]
        for r in elsewhere:
            lines.append(f"  rank {r} ({mesh.labels[r]}) is at {said[r].where}, in no collective")
        if elsewhere:
            one = len(elsewhere) == 1
            lines.append(
                f"  {_ranks(elsewhere)} lag{'s' if one else ''}: the others wait for {'it' if one else 'them'}"
            )
        elif done:
            they = "it" if len(done) == 1 else "they"
            lines.append(
                f"  {_ranks(done)} already finished this call: a collective {they} skipped waits for "
                f"{'it' if len(done) == 1 else 'them'}"
            )
        elif len(places) > 1:
            lines.append("  the ranks wait in different collectives or places: mismatched collectives")
        mute = [r for r in busy if r not in said]
        if mute:
            lines.append(f"  {_ranks(mute)} did not say where {'it is' if len(mute) == 1 else 'they are'}")
        lines.append("  (Interrupt the kernel or press Ctrl-C to stop it; mesh.stacks() shows every stack.)")
        self.receiver.notice(pending, (elsewhere or sorted(waiting))[0], "\n".join(lines) + "\n")

    def busy_ranks(self, mesh: SpawnedMesh) -> set[int]:
        """Ranks of `mesh` with a call in flight."""
        return {
            r for call in list(self.calls.values()) if call.mesh is mesh for r in call.ranks if r not in call.replies
        }

    def _fail(self, pending: PendingCall, error: BaseException) -> None:
        self.calls.pop(pending.call_id, None)
        pending.mesh.abandoned.discard(pending.call_id)
        try:
            pending.future.set_exception(error)
        except concurrent.futures.InvalidStateError:
            pass
        self.backend.replies.poke()  # wake a caller blocked receiving: its call ended
        if self.listeners:
            self.changed(pending.mesh)

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
        for pending in list(self.calls.values()):
            if pending.mesh is mesh:
                self._fail(pending, mesh.failure)
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
        for pending in list(self.calls.values()):
            if pending.mesh is mesh and rank in pending.ranks and rank not in pending.replies:
                self._fail(pending, error)
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
        # Its calls end first, as stopped: what the ranks say as the mesh goes (a collective whose peers exit
        # raises "Connection closed by peer") is not what happened, and arrives for no one.
        for pending in list(self.calls.values()):
            if pending.mesh is mesh:
                self._fail(pending, _stopped_during(pending, why))
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


def _stopped_during(pending: PendingCall, why: str) -> MeshStoppedError:
    mesh = pending.mesh
    running = [r for r in pending.ranks if r not in pending.replies]
    failed = [r for r, env in pending.replies.items() if not env.message.ok and r not in pending.released]
    what = f" ({pending.name})" if pending.name else ""
    text = f"mesh {mesh.shape.describe()} was stopped {why} while {_ranks(running)} still ran this call{what}"
    if failed:
        text += f"; {_ranks(sorted(failed))} had failed before (their tracebacks were shown as they came)"
    return MeshStoppedError(text)


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {format_ranks(ranks)}"
