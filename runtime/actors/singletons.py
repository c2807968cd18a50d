"""Process-wide actors and the client's end: `get_or_spawn_controller` (one actor per name, made once, found by
every later caller), `shutdown_context` (stop everything this controller started), `debug_controller`."""

from __future__ import annotations

import threading
from typing import Any

from monarch.runtime.values import Done

_controllers: dict[str, Any] = {}
_lock = threading.Lock()


def get_or_spawn_controller(name: str, cls: type, *args: Any, **kwargs: Any) -> Done[Any]:
    """The actor mesh of singleton actor `name`, spawned (``cls(*args, **kwargs)``, in this process, on a thread
    of its own: `this_proc()`) by the first caller and returned to every later one; a done future of it.
    Called from an actor on a worker it is refused: singletons live in the controller's process."""
    from monarch.runtime.actors.local import this_proc
    from monarch.runtime.common import context

    if context.worker is not None:
        raise RuntimeError(
            f"get_or_spawn_controller({name!r}) on a worker: singleton actors live in the controller's process; "
            "get the actor mesh there and pass it to this actor (an argument of its constructor or endpoint)"
        )
    with _lock:
        mesh = _controllers.get(name)
        if mesh is None:
            mesh = _controllers[name] = this_proc().spawn(name, cls, *args, **kwargs)
        elif not isinstance(mesh._box.actor, cls):
            raise TypeError(
                f"get_or_spawn_controller({name!r}, {cls.__name__}): {name!r} is a {type(mesh._box.actor).__name__}"
            )
    return Done(mesh)


def shutdown_context() -> Done[None]:
    """Stop every mesh this controller started and every singleton actor; a done future. Idempotent."""
    from monarch.runtime.controller import current

    with _lock:
        meshes = list(_controllers.values())
        _controllers.clear()
    for mesh in meshes:
        mesh.stop()
    controller = current()
    if controller is not None:
        controller.stop_all()
    return Done(None)


def debug_controller() -> Any:
    """Monarch's debugger actor; here the debugger of a script's workers is `monarch debug` (a terminal
    command: docs/features/debugging.md)."""
    raise NotImplementedError(
        "debug_controller(): here a script's workers paused in pdb are driven from a terminal with "
        "`monarch debug` (list, attach, cast, continue), and a notebook shows each rank's pdb in its cell"
    )


def returns_future(fn: Any) -> Any:
    """Monarch 0.7's decorator marking a function whose result is a future: kept as is here."""
    return fn
