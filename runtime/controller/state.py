"""What the controller keeps per spawned mesh and per call in flight."""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol

from monarch.runtime.common.errors import WorkerDiedError
from monarch.runtime.common.shape import Shape
from monarch.runtime.controller.output import OutputEvent

if TYPE_CHECKING:
    from monarch.runtime.backends.base import Backend
    from monarch.runtime.controller.aggregate import MeshLogs
    from monarch.runtime.controller.core import Controller
    from monarch.runtime.wire import codec, protocol


class TensorEngine(Protocol):
    """The tensor engine's controller half (`tensor.engine.Engine`), as the controller and live functions use it."""

    def flush(self) -> None:
        """Send the tensor commands queued so far (they run before whatever is sent next)."""


@dataclass
class SpawnedMesh:
    """The workers of one spawned mesh; every view of it refers to this."""

    controller: Controller
    """The controller that spawned it."""
    mesh_id: int
    shape: Shape
    labels: list[str]
    backend: Backend
    """What runs its workers: the local backend, a job's host agents, or the simulator."""
    info: list[dict[str, Any]] = field(default_factory=list)
    """Per rank: ``{"pid", "host", "device", "torch"}``."""
    torch_ready: bool = True
    """Whether its workers have set torch up (they did at start, or were sent `ReadyTorch`); False for a mesh
    of a program that had not imported torch, until something needs it (`Controller.ready_torch`)."""
    state: str = "starting"
    """starting, running, failed, stopping or stopped."""
    failure: WorkerDiedError | None = None
    fns: dict[bytes, tuple[int, set[int]]] = field(default_factory=dict)
    """Pickled function -> (function id, ranks that have it)."""
    order_lock: threading.Lock = field(default_factory=threading.Lock)
    """Held from deciding what the workers lack (a function, a group) until the message that brings it
    is sent, so that no message relying on it, from another thread, overtakes it."""
    groups: dict[tuple[tuple[int, ...], ...], int] = field(default_factory=dict)
    """Rank partition -> group id."""
    engine: TensorEngine | None = None
    """The tensor engine's controller half, once `activate()` was used."""
    exit_codes: dict[int, int | None] = field(default_factory=dict)
    """Once stopped: each worker's exit status (0 when it exited as asked)."""
    abandoned: set[int] = field(default_factory=set)
    """Calls whose caller was interrupted and gave up on them while some ranks still ran them."""
    generation: int = 0
    """How many times its process groups were re-formed (after ranks were released from a collective)."""
    actors: dict[str, tuple[str, frozenset[int]]] = field(default_factory=dict)
    """Actor name -> (its class's name, the ranks it runs on): what `ProcMesh.spawn` started here."""
    logs: MeshLogs | None = None
    """Its logging options (`ProcMesh.logging_option`), once set: where its output goes, lines collapsed."""
    lost: dict[int, WorkerDiedError] = field(default_factory=dict)
    """Rank -> how it died, for ranks lost while the rest of the mesh went on (a mesh with actors is
    supervised: see `Controller._on_lost`)."""
    on_rank_lost: list[Callable[[int, WorkerDiedError], None]] = field(default_factory=list)
    """Called (on the backend's monitor thread: quick, never blocking) when a rank of this mesh is lost while
    the rest goes on; `monarch.runtime.actors` hands the failure to the actor meshes' owners from here."""
    owners: dict[str, Any] = field(default_factory=dict)
    """Actor name -> who supervises that actor mesh (kept by `monarch.runtime.actors`, opaque here)."""

    @property
    def size(self) -> int:
        return len(self.shape)

    def check_usable(self, ranks: tuple[int, ...] | None = None) -> None:
        """Raise if the mesh cannot take a call (on `ranks`, when given: one of them lost raises how it died;
        None checks the mesh only)."""
        if self.failure is not None:
            raise self.failure
        if self.state != "running":
            raise RuntimeError(f"mesh {self.shape.describe()} is {self.state}; spawn a new one (mesh.respawn())")
        dead = self.lost_among(ranks) if ranks is not None else None
        if dead is not None:
            raise dead

    def lost_among(self, ranks: tuple[int, ...] | None) -> WorkerDiedError | None:
        """How the first lost rank of `ranks` (None: any rank) died, or None when all of them live."""
        if not self.lost:
            return None
        for rank in sorted(self.lost) if ranks is None else ranks:
            if rank in self.lost:
                return self.lost[rank]
        return None


CallState = Literal["running", "failing", "done", "failed"]


@dataclass
class PendingCall:
    call_id: int
    mesh: SpawnedMesh
    ranks: tuple[int, ...]
    future: concurrent.futures.Future[dict[int, codec.Envelope]]
    replies: dict[int, codec.Envelope] = field(default_factory=dict)
    """Rank -> its `Reply`'s envelope (the body not yet unpickled)."""
    no_stdin: str | None = None
    """Why this call cannot be given input (workers asking get an error saying so), or None."""
    output: Callable[[OutputEvent], None] | None = None
    """Where this call's output goes, instead of the controller's `output`."""
    name: str = ""
    """What the call runs, for people: ``"%%mesh cell"``, a live function's name."""
    started: float = 0.0
    """`time.monotonic()` when it was sent."""
    state: CallState = "running"
    """running; failing (a rank answered with an error while others still run it: they are being released
    from any collective that waits for it); done; failed. Changed by `controller.calls.Calls` only."""
    released: dict[int, protocol.Released] = field(default_factory=dict)
    """Rank -> `protocol.Released`: ranks taken out of a collective the failed rank never reached."""
    hang_reported: bool = False
    """Its ranks waiting in a collective were reported (`MONARCH_HANG_REPORT`)."""
    next_hang_check: float = 0.0
    """`time.monotonic()` before which the hang watchdog does not look at it again."""
    disconnected: bool = False
    """The ranks that had answered were asked to shut their groups' connections (`protocol.Control.DISCONNECT`)."""
    busy: dict[int, protocol.Busy] = field(default_factory=dict)
    """Rank -> its latest `protocol.Busy` report."""
    on_reply: Callable[[int], None] | None = None
    """Told each rank as its reply is recorded (the receiving thread; quick, waits for nothing): `stream()`'s
    per-point futures."""
    early_errors: list[tuple[codec.Envelope, protocol.ErrorInfo]] = field(default_factory=list)
    """(envelope, error) of ranks that failed while others ran: shown at once if the call goes on."""
    errors_shown: set[int] = field(default_factory=set)
    """Ranks whose tracebacks went to the call's output as they came (`early_errors`, once shown)."""
