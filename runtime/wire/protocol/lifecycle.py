"""A worker's life: how it starts (`WorkerStart`, privately; `Ready` or `StartFailed` up the command
connection), how it is told to stop (`Exit`) and its last word (`Goodbye`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from monarch.runtime.wire.protocol.base import message

if TYPE_CHECKING:
    from monarch.runtime.wire.keys import WorkerKeys


@dataclass
class WorkerStart:
    """Everything a worker needs to start; handed over privately (the fork server's pipe), with its keys."""

    keys: WorkerKeys
    """`wire.keys.WorkerKeys`: mesh id, rank, signing key, addresses."""
    coords: dict[str, int]
    """Coordinates in the spawned mesh."""
    sizes: dict[str, int]
    """Sizes of the spawned mesh."""
    local_rank: int
    """Index among this host's workers (picks the GPU)."""
    label: str
    """The coordinates as text (``"host=0,gpu=3"``)."""
    interrupt_path: str
    """A file of int64 slots, one per rank: the call the controller's next SIGINT is meant for."""
    env: dict[str, str]
    """Environment to run with (the controller's, plus rank variables)."""
    cwd: str
    sys_path: list[str]
    threads: int
    """torch intra-op threads."""
    parent_pid: int | None
    """The process that forked us (the fork server); the worker dies with it."""
    controller_pid: int
    """The controller's process; the worker exits the moment it is gone."""
    group_timeout: float
    """Seconds collectives and the store wait."""
    nice: int
    """How much lower than the controller's this worker's CPU priority is (0: the same); see
    `config.Settings.worker_nice`."""
    spin: float = 0.0
    """Seconds the worker polls its lane for the next command before it sleeps (0: it sleeps at once); see
    `config.Settings.worker_spin`."""
    batch: bool = False
    """Run as `SCHED_BATCH` (a host with fewer CPUs than its workers and the process feeding them): a thread of
    the worker that is woken does not preempt what is running; see `common.processes.batches`."""
    torch: bool = True
    """Set torch up at start (threads, seed, device, the mesh's default process group). False for a mesh of a
    program that has not imported torch: it runs actors at once, and sets torch up when the controller first
    sends it something that needs it (`ReadyTorch`)."""


@message(6)
class Ready:
    """The worker is up: connected, in its process group, serving commands."""

    info: dict[str, Any]
    """``{"pid", "host", "device", "torch"}`` ("torch": whether torch was set up at start)."""


@message(7)
class StartFailed:
    traceback: str


@message(4)
class Exit:
    """Stop serving and exit."""


@message(50)
class Goodbye:
    """Worker -> controller, its last message on the reply connection when it exits as asked: one
    connection keeps its order, so once this has arrived, so has everything the worker printed."""
