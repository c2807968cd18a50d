"""The controller's side of the runtime: meshes, calls in flight, receiving, stdin.

`get_controller()` gives this process's controller (made on first use); `current()` the one that runs,
if any, without making one.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from monarch.runtime.controller.core import Controller
from monarch.runtime.controller.output import LineLabeller, OutputEvent
from monarch.runtime.controller.progress import SpawnProgress
from monarch.runtime.controller.state import PendingCall, SpawnedMesh
from monarch.runtime.controller.stdin import InputRequest

__all__ = [
    "Controller",
    "InputRequest",
    "LineLabeller",
    "OutputEvent",
    "PendingCall",
    "SpawnProgress",
    "SpawnedMesh",
    "current",
    "get_controller",
    "on_create",
    "prewarm",
]

_controller: Controller | None = None
_lock = threading.Lock()
on_create: list[Callable[[Controller], None]] = []
"""Called with each new controller (the notebook extension installs its output and stdin here)."""


def get_controller() -> Controller:
    """This process's controller, created on first use (and again after a shutdown)."""
    global _controller
    with _lock:
        if _controller is None or _controller.closed:
            _controller = Controller()
            for fn in on_create:
                fn(_controller)
        return _controller


def current() -> Controller | None:
    """This process's running controller, or None (nothing was spawned yet, or it was shut down)."""
    c = _controller
    return c if c is not None and not c.closed else None


def prewarm() -> None:
    """Start this machine's fork server now, in the background (it imports torch; the first mesh's workers
    are forked from it), unless `MONARCH_PREWARM=0`: the Monarch kernel calls it as it starts, so the first
    `%%mesh` cell does not wait for torch's import. Never raises (a bad setting says so at the first spawn)."""
    from monarch.runtime.common.config import settings
    from monarch.runtime.procs.workers import fork_server

    try:
        if settings().prewarm:
            fork_server()
    except Exception:  # (a bad MONARCH_* value, an unusable multiprocessing setup: the first spawn says why)
        pass
