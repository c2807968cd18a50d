"""Supervision: what happens when part of an actor mesh fails and no caller is waiting to be told.

Two things fail that way: a process under an actor mesh that dies (kill -9, `os._exit`, the OOM killer; the
controller lets the rest of the mesh go on: `Controller._lose_rank`), and a `broadcast` whose endpoint raised.
Each becomes a `MeshFailure` for each actor mesh concerned, delivered to that mesh's *owner*:

- the `this_proc()` actor whose endpoint spawned the actor mesh: its `__supervise__(failure)` runs on the
  actor's own thread, in order with its messages; a truthy return means handled;
- otherwise (no owner, no `__supervise__`, not handled, or it raised) `monarch.actor.unhandled_fault_hook`
  (looked up on that module when the failure is delivered, so that assigning it there takes effect), run on a
  thread of its own: user code never runs on the controller's monitor or receiving thread.

The default hook prints the failure on stderr; in a notebook (`SHOW`, set by the extension) it is shown in the
cell running when it comes, or, when none runs, at the start of the next cell run.
"""

from __future__ import annotations

import queue
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from monarch.runtime.common.shape import format_ranks

if TYPE_CHECKING:
    from monarch.runtime.actors.local import Mailbox
    from monarch.runtime.common.errors import WorkerDiedError
    from monarch.runtime.controller import SpawnedMesh


class MeshFailure(Exception):
    """Part of an actor mesh failed with no caller waiting: the process under one of its actors died, or a
    `broadcast`'s endpoint raised. Given to the owner's `__supervise__`, else to `unhandled_fault_hook`."""

    def __init__(
        self,
        mesh_name: str,
        rank: int,
        label: str,
        what: str,
        actor_class: str = "",
        procs: str = "",
        error: BaseException | None = None,
    ) -> None:
        self.mesh_name = mesh_name
        """The actor mesh's name (what it was spawned under)."""
        self.rank = rank
        """The failed process's rank in its proc mesh."""
        self.label = label
        """Its coordinates, e.g. ``gpu=1`` (``this_proc`` for a local actor)."""
        self.what = what
        """What happened, e.g. ``was killed by SIGKILL (kill -9, ...)`` or ``raised in step: ValueError: ...``."""
        self.actor_class = actor_class
        self.procs = procs
        """The proc mesh's shape, e.g. ``{gpu: 4}``."""
        self.error = error
        """The underlying error: a `WorkerDiedError`, or the broadcast's `RemoteError`."""
        super().__init__(self.report())

    def report(self) -> str:
        """The failure in words (what `str()` gives)."""
        cls = f" ({self.actor_class})" if self.actor_class else ""
        on = f" on {self.procs}" if self.procs else ""
        text = f"actor mesh {self.mesh_name!r}{cls}{on}: rank {self.rank} ({self.label}) {self.what}"
        if self.error is not None and not _is_death(self.error):
            text += f"\n{self.error}"
        return text

    def __reduce__(self) -> tuple[Any, ...]:
        args = (self.mesh_name, self.rank, self.label, self.what, self.actor_class, self.procs, self.error)
        return type(self), args


@dataclass
class Owner:
    """Who is told of an actor mesh's failures."""

    actor: Mailbox | None
    """The `this_proc()` actor whose endpoint (or constructor) spawned the actor mesh, if one did."""


SHOW: Callable[[MeshFailure], bool] | None = None
"""Set by the notebook extension: show a failure in the running cell, or the next one; whether it did."""


here = threading.local()
"""`.mailbox`: the `this_proc()` actor whose thread this is (set by `local.Mailbox` on its thread)."""


def current_mailbox() -> Mailbox | None:
    """The `this_proc()` actor running on this thread (in an endpoint, constructor or `__supervise__`), if any."""
    return cast("Mailbox | None", getattr(here, "mailbox", None))


def owner_here() -> Owner:
    """The owner of an actor mesh spawned now, on this thread."""
    return Owner(current_mailbox())


def adopt(spawned: SpawnedMesh, name: str, owner: Owner) -> None:
    """Actor mesh `name` was spawned on `spawned` by `owner`: from now on a process of `spawned` that dies is
    reported to the owner of each actor mesh on it."""
    spawned.owners[name] = owner
    if not any(isinstance(fn, _Watcher) for fn in spawned.on_rank_lost):
        spawned.on_rank_lost.append(_Watcher(spawned))


class _Watcher:
    """`SpawnedMesh.on_rank_lost` of a mesh with actors (monitor thread): one `MeshFailure` per actor mesh on
    the lost rank, queued to its owner."""

    def __init__(self, spawned: SpawnedMesh) -> None:
        self.spawned = spawned

    def __call__(self, rank: int, error: WorkerDiedError) -> None:
        sp = self.spawned
        for name, (cls_name, ranks) in list(sp.actors.items()):
            if rank in ranks:
                failure = MeshFailure(name, rank, error.label, error.cause, cls_name, sp.shape.describe(), error)
                deliver(failure, sp.owners.get(name))


def endpoint_failed(mesh_name: str, cls_name: str, procs: str, endpoint: str, error: BaseException) -> MeshFailure:
    """The `MeshFailure` of a broadcast to `endpoint` that failed with `error` (its first failed rank)."""
    failures = getattr(error, "failures", None) or []
    rank, label = (failures[0].ranks[0], failures[0].labels[0]) if failures else (0, "")
    if failures:
        ranks = sorted(r for f in failures for r in f.ranks)
        also = f" (ranks {format_ranks(ranks)} did)" if len(ranks) > 1 else ""
        what = f"raised in {endpoint} (a broadcast){also}: {failures[0].exc_type}: {failures[0].message}"
    else:
        what = f"failed in {endpoint} (a broadcast): {type(error).__name__}: {error}"
    return MeshFailure(mesh_name, rank, label, what, cls_name, procs, error)


def deliver(failure: MeshFailure, owner: Owner | None) -> None:
    """Hand `failure` to `owner` without blocking: its actor's `__supervise__` (on the actor's thread), else the
    unhandled-fault hook (on the hook's thread)."""
    if owner is not None and owner.actor is not None:
        owner.actor.supervise(failure, unhandled)
        return
    unhandled(failure)


def _is_death(error: BaseException) -> bool:
    return type(error).__name__ == "WorkerDiedError"


# -- the unhandled-fault hook's thread ---------------------------------------------------------------------
_queue: queue.SimpleQueue[MeshFailure] = queue.SimpleQueue()
_pending = 0
delivered = 0
"""How many failures the hook has been given (and returned from) in this process."""
_changed = threading.Condition()
_thread: threading.Thread | None = None


def unhandled(failure: MeshFailure) -> None:
    """Queue `failure` for `monarch.actor.unhandled_fault_hook` (run on its own thread, one at a time)."""
    global _pending, _thread
    with _changed:
        _pending += 1
        if _thread is None:
            _thread = threading.Thread(target=_run_hooks, name="monarch-fault-hook", daemon=True)
            _thread.start()
    _queue.put(failure)


def flush(timeout: float | None = None) -> bool:
    """Wait until every failure queued for the hook was handed to it; whether that happened in time."""
    deadline = None if timeout is None else time.monotonic() + timeout
    with _changed:
        while _pending:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return False
            _changed.wait(left)
    return True


def _run_hooks() -> None:
    global _pending, delivered
    while True:
        failure = _queue.get()
        try:
            current_hook()(failure)
        except BaseException:  # (a hook's own error must not end the thread, nor the process)
            print("monarch: unhandled_fault_hook raised:", file=sys.__stderr__)
            traceback.print_exc(file=sys.__stderr__)
        finally:
            with _changed:
                _pending -= 1
                delivered += 1
                _changed.notify_all()


def current_hook() -> Callable[[MeshFailure], Any]:
    """`monarch.actor.unhandled_fault_hook` as it is now (a user may have replaced it), else the default."""
    face = sys.modules.get("monarch.actor")
    hook = getattr(face, "unhandled_fault_hook", None)
    return hook if callable(hook) else default_hook


def default_hook(failure: MeshFailure) -> None:
    """Show an unhandled failure: in the notebook's cell (`SHOW`), else on stderr. Never exits the process."""
    if SHOW is not None:
        try:
            if SHOW(failure):
                return
        except Exception:
            traceback.print_exc(file=sys.__stderr__)
    stream = sys.stderr or sys.__stderr__
    if stream is not None:
        print(f"monarch: unhandled MeshFailure: {failure}", file=stream, flush=True)
