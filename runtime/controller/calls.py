"""The calls in flight: one book owns each call's life.

A call is registered when it is sent and ends `done` (every rank answered) or `failed` (a rank's worker died,
the mesh stopped). In between, replies land; a rank may answer with an error while others still run the call
(`failing`: those waiting for it in a collective are asked to leave it, the release); busy ranks say where they
are. All of it is changed here and only here, `PendingCall.state` included; the receiver decodes a message and
hands it over; the controller, the mesh views and the watchdogs ask (`running_ranks`, `running`,
`busy_ranks`) instead of working it out.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from typing import TYPE_CHECKING

from monarch.runtime.common import load, log
from monarch.runtime.common.errors import MeshStoppedError, peer_gone
from monarch.runtime.common.shape import format_ranks
from monarch.runtime.wire import codec, protocol

if TYPE_CHECKING:
    from monarch.runtime.common.errors import WorkerDiedError
    from monarch.runtime.controller.core import Controller
    from monarch.runtime.controller.state import PendingCall, SpawnedMesh

RELEASE_FIRST = 0.2
"""Seconds after a rank fails (while others still run the call) before the others are asked to leave a
collective they wait in; then every `RELEASE_AGAIN` seconds until the call ends."""
RELEASE_AGAIN = 0.5

_log = log.get("controller")


class Calls:
    """The calls in flight of one controller, by call id."""

    def __init__(self, controller: Controller) -> None:
        self.controller = controller
        self._calls: dict[int, PendingCall] = {}

    # -- asking --------------------------------------------------------------------------------------
    def get(self, call_id: int) -> PendingCall | None:
        return self._calls.get(call_id)

    def __len__(self) -> int:
        return len(self._calls)

    def all(self) -> list[PendingCall]:
        """A copy (any thread may register or end a call meanwhile)."""
        return list(self._calls.values())

    def of_mesh(self, mesh: SpawnedMesh) -> list[PendingCall]:
        return [p for p in list(self._calls.values()) if p.mesh is mesh]

    @staticmethod
    def running_ranks(pending: PendingCall) -> list[int]:
        """The ranks of `pending` that have not answered it yet."""
        replies = pending.replies
        return [r for r in pending.ranks if r not in replies]

    def running(self, mesh: SpawnedMesh) -> list[tuple[PendingCall, list[int]]]:
        """The calls of `mesh` some ranks still run, with those ranks."""
        running = [(p, self.running_ranks(p)) for p in self.of_mesh(mesh)]
        return [(p, ranks) for p, ranks in running if ranks]

    def busy_ranks(self, mesh: SpawnedMesh) -> set[int]:
        """Ranks of `mesh` with a call in flight."""
        return {r for p in self.of_mesh(mesh) for r in self.running_ranks(p)}

    def busy_before(self, pending: PendingCall) -> set[int]:
        """Ranks of `pending`'s mesh that have not yet answered a call issued before it (by another thread)."""
        return {
            r
            for other in self.of_mesh(pending.mesh)
            if other is not pending and other.call_id < pending.call_id
            for r in self.running_ranks(other)
        }

    def ask_busy(
        self, mesh: SpawnedMesh, wait: float = load.ASK_WAIT, only: PendingCall | None = None
    ) -> list[tuple[PendingCall, list[int]]]:
        """`running(mesh)` (or just `only`), having asked the busy ranks what they are doing: their fresh
        answers land in each call's `busy` (`busy_report`) within `wait` seconds."""
        running = self.running(mesh) if only is None else [(only, self.running_ranks(only))]
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

    # -- a call's life -------------------------------------------------------------------------------
    def register(self, pending: PendingCall) -> None:
        """A call about to be sent (or, if its mesh died meanwhile, failed at once by the caller)."""
        self._calls[pending.call_id] = pending

    def reply(self, env: codec.Envelope) -> None:
        """A rank's `Reply` (the receiving thread; once per rank per call: kept lean)."""
        pending = self._calls.get(env.message.call_id)
        if pending is None or pending.mesh.mesh_id != env.mesh_id:
            return  # its caller already gave up on it
        pending.replies[env.rank] = env
        if pending.on_reply is not None:
            pending.on_reply(env.rank)
        if len(pending.replies) == len(pending.ranks):
            self._done(pending)
            return
        if not env.message.ok and env.rank not in pending.released:
            self._keep_early_error(pending, env)
            if pending.state == "running":
                pending.state = "failing"
                self._release_later(pending, RELEASE_FIRST)
        c = self.controller
        if c.listeners:  # this rank is idle again while others still run the call
            c.changed(pending.mesh)

    def reply_group(self, env: codec.Envelope, ranks: tuple[int, ...]) -> None:
        """The same `Reply` from each of `ranks` (a host's bundle): one envelope shared by them all."""
        pending = self._calls.get(env.message.call_id)
        if pending is None or pending.mesh.mesh_id != env.mesh_id:
            return
        replies = pending.replies
        if env.message.ok:
            replies.update(dict.fromkeys(ranks, env))
            if pending.on_reply is not None:
                for rank in ranks:
                    pending.on_reply(rank)
            if len(replies) == len(pending.ranks):
                self._done(pending)
            elif self.controller.listeners:
                self.controller.changed(pending.mesh)
            return
        for rank in ranks:  # (an error: each rank's own envelope, as its early error names it)
            self.reply(codec.Envelope(env.mesh_id, rank, env.seq, env.message, env.body, env.buffers))
            if pending.state in ("done", "failed"):
                return

    def _done(self, pending: PendingCall) -> None:
        """Every rank answered. If ranks were released from a collective, their groups are broken (and the
        failed rank's, whose peers shut their connections): re-form them before anything else runs on the
        mesh."""
        c, mesh = self.controller, pending.mesh
        self._calls.pop(pending.call_id, None)
        pending.state = "done"
        mesh.abandoned.discard(pending.call_id)
        if mesh.logs is not None:  # lines held for collapsing: shown before the result
            mesh.logs.let_go(c.receiver.sink(pending), ended=True)
        if _log.isEnabledFor(logging.DEBUG):
            _log.debug("call %d done in %.3f s", pending.call_id, time.monotonic() - pending.started)
        if pending.released and mesh.state == "running":
            mesh.generation += 1
            _log.info("mesh %d: re-forming its groups (generation %d) after a release", mesh.mesh_id, mesh.generation)
            c.send(mesh, None, protocol.ReformGroups(mesh.generation))
        if not pending.future.done():
            pending.future.set_result(pending.replies)
        if c.listeners:
            c.changed(mesh)

    def released(self, env: codec.Envelope) -> None:
        """A rank says it was taken out of a collective (`protocol.Released`; its error reply follows)."""
        pending = self._calls.get(env.message.call_id)
        if pending is not None and pending.mesh.mesh_id == env.mesh_id:
            pending.released[env.rank] = env.message

    def busy_report(self, env: codec.Envelope) -> None:
        """A busy rank says where it is (`protocol.Busy`, asked by `ask_busy`)."""
        pending = self._calls.get(env.message.call_id)
        if pending is not None and pending.mesh.mesh_id == env.mesh_id:
            pending.busy[env.rank] = env.message

    def abandon(self, pending: PendingCall) -> None:
        """The caller was interrupted and gives up on `pending` while ranks still run it: the next call on
        its mesh says so instead of waiting behind it (`remote.py`)."""
        if not pending.future.done():
            pending.mesh.abandoned.add(pending.call_id)

    def fail(self, pending: PendingCall, error: BaseException) -> None:
        """End `pending` with `error` (its ranks' answers, if any come, are dropped)."""
        self._calls.pop(pending.call_id, None)
        pending.state = "failed"
        pending.mesh.abandoned.discard(pending.call_id)
        try:
            pending.future.set_exception(error)
        except concurrent.futures.InvalidStateError:
            pass
        c = self.controller
        c.backend.replies.poke()  # wake a caller blocked receiving: its call ended
        if c.listeners:
            c.changed(pending.mesh)

    def fail_mesh(self, mesh: SpawnedMesh, error: WorkerDiedError) -> None:
        """The mesh failed (a worker died): every call of it fails so."""
        for pending in self.of_mesh(mesh):
            self.fail(pending, error)

    def fail_rank(self, mesh: SpawnedMesh, rank: int, error: WorkerDiedError) -> None:
        """A rank of a mesh that goes on without it (actors) is gone: the calls still waiting on it fail."""
        for pending in self.of_mesh(mesh):
            if rank in pending.ranks and rank not in pending.replies:
                self.fail(pending, error)

    def stop_mesh(self, mesh: SpawnedMesh, why: str) -> None:
        """The mesh is being stopped (`why`): its calls end first, as stopped. What the ranks say as the mesh
        goes (a collective whose peers exit raises "Connection closed by peer") is not what happened."""
        for pending in self.of_mesh(mesh):
            self.fail(pending, _stopped_during(pending, why))

    # -- one rank failed, others still run -----------------------------------------------------------
    def _keep_early_error(self, pending: PendingCall, env: codec.Envelope) -> None:
        """A rank failed while others still run: if they go on (waiting for it in a collective, say), its
        traceback goes to the call's output, as `"error"` (the call's error shows it again when it ends)."""
        try:
            info = codec.loads(env.body, env.buffers)
        except Exception:
            return
        # A collective's "Connection reset by peer" is what another rank's death did to this one: that death
        # is told (a WorkerDiedError) a moment later, and this would only bury it.
        if info.exc_type != protocol.RELEASED and not peer_gone(info):
            pending.early_errors.append((env, info))

    def take_early_errors(self, pending: PendingCall) -> list[tuple[codec.Envelope, protocol.ErrorInfo]]:
        """The early errors not shown yet (the caller shows them)."""
        errors, pending.early_errors = pending.early_errors, []
        return errors

    def _release_later(self, pending: PendingCall, delay: float) -> None:
        """Show the failed ranks' tracebacks and ask those waiting in a collective, `delay` from now and then
        twice a second, to leave it (a call whose ranks all fail within `RELEASE_FIRST` shows each error
        once, when it ends)."""
        timer = threading.Timer(delay, self._release, (pending,))
        timer.daemon = True
        timer.start()

    def _release(self, pending: PendingCall) -> None:
        c, mesh = self.controller, pending.mesh
        if pending.future.done() or c.closed or mesh.state != "running":
            return
        if pending.early_errors:  # the call goes on without the failed ranks: show why now
            c.receiver.show_early_errors(pending)
        busy = tuple(r for r in self.running_ranks(pending) if r not in pending.released)
        if busy:
            _log.info(
                "call %d failed on a rank: asking ranks %s to leave their collective",
                pending.call_id,
                format_ranks(list(busy)),
            )
            mesh.backend.control(mesh.mesh_id, busy, pending.call_id, protocol.Control.RELEASE)
            # Across hosts a link between two workers is shut by one of its ends only (the one that accepted
            # it, or a sibling's on the same host): the ranks that already answered must shut theirs too.
            answered = tuple(r for r in pending.ranks if r in pending.replies)
            if answered and not pending.disconnected and mesh.backend.spans_hosts(mesh.mesh_id):
                pending.disconnected = True
                mesh.backend.control(mesh.mesh_id, answered, mesh.generation, protocol.Control.DISCONNECT)
        self._release_later(pending, RELEASE_AGAIN)


def say_ranks(ranks: list[int]) -> str:
    """``rank 3`` or ``ranks 0-2, 5``."""
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {format_ranks(ranks)}"


def _stopped_during(pending: PendingCall, why: str) -> MeshStoppedError:
    mesh = pending.mesh
    running = Calls.running_ranks(pending)
    failed = [r for r, env in pending.replies.items() if not env.message.ok and r not in pending.released]
    what = f" ({pending.name})" if pending.name else ""
    text = f"mesh {mesh.shape.describe()} was stopped {why} while {say_ranks(running)} still ran this call{what}"
    if failed:
        text += f"; {say_ranks(sorted(failed))} had failed before (their tracebacks were shown as they came)"
    return MeshStoppedError(text)
