"""The controller's way to ports (`common/ports.py`): a port of a worker is reached through that worker's actor
inbox (`PortSend`, signed with the inbox's key, as another worker's would be: a worker busy in a long call still
serves its inbox, not its command connection); what workers send the controller's own ports comes up their
reply connections and is handed over by the receiver (`controller/receiving.py`)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from monarch.runtime.common import context, ports


class ControllerRouter:
    """`ports.Router` of the controller's process (a script, a notebook's kernel, its `this_proc()` actors)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._outboxes: dict[str, Any] = {}
        """Inbox address -> this process's connection to it (any thread sends, one at a time)."""

    def here(self) -> tuple[int, int] | None:
        return None

    def inbox(self) -> Any:
        return None

    def deliver(self, ref: ports.PortRef, rank: int | None, ok: bool, value: Any) -> None:
        from monarch.runtime.controller import get_controller  # (here: `import monarch.actor` imports no zmq)
        from monarch.runtime.wire import codec, protocol
        from monarch.runtime.wire.actor_end import Outbox

        assert ref.owner is not None and ref.inbox is not None
        mesh_id, owner_rank = ref.owner
        controller = get_controller()
        spawned = controller.meshes.get(mesh_id)
        if spawned is None or spawned.state != "running" or owner_rank in spawned.lost:
            raise RuntimeError(
                f"this port's receiving end (rank {owner_rank} of mesh {mesh_id}) is gone: its process stopped"
            )
        try:
            body = codec.dumps(value)
        except Exception as e:
            if ok:
                raise TypeError(f"port.send({type(value).__name__}): the value cannot be pickled: {e}") from e
            body = codec.dumps(RuntimeError(f"{type(value).__qualname__}: {value}"))
        message = protocol.PortSend(ref.port_id, ports.UNRANKED if rank is None else rank, ok)
        with self._lock:
            box = self._outboxes.get(ref.inbox.addr)
            if box is None:
                box = self._outboxes[ref.inbox.addr] = Outbox(_context(), ref.inbox, (0, codec.CONTROLLER))
            box.send(message, body)

    def block(self, done: Callable[[], bool], timeout: float | None) -> None:
        return  # (the receiving thread delivers: the caller waits on the future itself)


def _context() -> Any:
    import zmq

    return zmq.Context.instance()


if ports.ROUTER is None and context.worker is None:
    ports.ROUTER = ControllerRouter()
