"""`RDMABuffer`'s controller half: a script or notebook holding a buffer that an endpoint returned reads and
writes it through shared memory when its owner is on this host (`runtime/common/rdma.py`), else through a
live-function call by name on the owner's rank (`monarch.runtime.worker.rdma`'s `read_for_controller`, ...),
found by its mesh id among this controller's meshes. A buffer made in this process (a `this_proc()` actor)
needs no transport here, and reaches this host's workers through shared memory.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from monarch.runtime.common import rdma
from monarch.runtime.common.errors import WorkerDiedError
from monarch.runtime.mesh import ProcMesh
from monarch.runtime.values import Future

WORKER = "monarch.runtime.worker.rdma"


def register() -> tuple[None, None, None]:
    """A buffer made in the controller's process has no transport (no inbox): other processes of this host
    reach it through shared memory."""
    return None, None, None


def _owner_view(h: rdma.Handle, what: str) -> ProcMesh:
    """The one-rank view of the owner's mesh (a clear `RDMAError` when this controller has no such mesh)."""
    from monarch.runtime.controller import current

    controller = current()
    spawned = controller.meshes.get(h.mesh_id) if controller is not None and h.mesh_id is not None else None
    if spawned is None or h.rank is None:
        raise rdma.RDMAError(
            f"{what}: {rdma.buffer_name(h)}: its owner's mesh is not one of this controller's running meshes "
            "(it was stopped, or the buffer came from another program)"
        )
    shape = spawned.shape
    coords = shape.coords(shape.ranks.index(h.rank))
    return ProcMesh(spawned, shape.slice(**{dim: range(c, c + 1) for dim, c in coords.items()}))


class _Called(rdma.Pending):
    """One live-function call on the owner's rank, then `finish(value)`."""

    def wait(self, deadline: float) -> None:
        if self.ended:
            return
        left = deadline - time.monotonic()
        if left <= 0 and not self.future.done():
            raise TimeoutError(self.what)
        try:
            values = self.future.result(max(left, 0))
        except WorkerDiedError as e:
            raise rdma.RDMAError(f"{self.what}: {rdma.buffer_name(self.h)}: its owner process died ({e})") from None
        self._end(values)

    async def wait_async(self, deadline: float) -> None:
        if self.ended:
            return
        done = asyncio.Event()
        loop = asyncio.get_running_loop()
        self.future.add_done_callback(lambda _: loop.call_soon_threadsafe(done.set))
        try:
            await asyncio.wait_for(done.wait(), max(deadline - time.monotonic(), 0))
        except asyncio.TimeoutError:
            raise TimeoutError(self.what) from None
        self.wait(deadline)

    def _end(self, values: Any) -> None:
        self.ended = True
        (value,) = values.values()
        self.finish(value)


def _call(h: rdma.Handle, what: str, name: str, args: tuple) -> Future:
    view = _owner_view(h, what)
    try:
        return _start(view, name, args, what)
    except WorkerDiedError as e:
        raise rdma.RDMAError(f"{what}: {rdma.buffer_name(h)}: its owner process died ({e})") from e
    except RuntimeError as e:  # (the mesh stopped)
        raise rdma.RDMAError(f"{what}: {rdma.buffer_name(h)}: {e}") from e


def _start(view: ProcMesh, name: str, args: tuple, what: str) -> Future:
    """Start `monarch.runtime.worker.rdma.<name>(*args)` on `view` (imported here: `import monarch.rdma` stays
    light)."""
    from monarch.runtime.remote import RemoteFunction

    return RemoteFunction.by_name(WORKER, name, view).start(args, {}, name=what)


def start_read(h: rdma.Handle, dst: Any, size: int) -> rdma.Pending:
    """Ask the owner's rank for the buffer's bytes; copied into `dst` when the reply is taken."""
    future = _call(h, rdma.READ, "read_for_controller", (h.id,))
    return _Called(h, rdma.READ, future, rdma.read_finisher(h, dst, size))


def start_write(h: rdma.Handle, src: Any, size: int) -> rdma.Pending:
    """Send `src`'s bytes to the owner's rank, which copies them into the buffer."""
    future = _call(h, rdma.WRITE, "write_for_controller", (h.id, rdma._as_tensor(src)[:size]))
    return _Called(h, rdma.WRITE, future, rdma.write_finisher(h))


def start_drop(h: rdma.Handle) -> rdma.Pending:
    what = "RDMABuffer.drop"
    return _Called(h, what, _call(h, what, "drop_for_controller", (h.id,)), lambda value: None)
