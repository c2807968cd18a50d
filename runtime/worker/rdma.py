"""`RDMABuffer`'s worker half (the buffer itself is `runtime/common/rdma.py`).

The owner: a worker's first buffer registers the hidden actor ``__monarch_rdma__`` in the process's actor table
(`actors.system_actor`), and every buffer it makes carries the process's inbox address, so that another
worker reaches it with an actor reference built here (`_ref`): its reads and writes are signed messages to
that inbox, answered by `RdmaServer` on the owner's main thread (between its messages, or while it waits for
anything). The controller reaches the same memory through the live functions below (`read_for_controller`,
`write_for_controller`, `drop_for_controller`), called by name on the owner's rank (`runtime/actors/rdma.py`).

The reader: `start_read` / `start_write` / `start_drop` send through the reference and return a `Pending`
that waits for the answer (``get()`` serving this process's inbox meanwhile, or ``await`` on the actors'
event loop), looking every `POLL` seconds whether an owner on this host is still alive.
"""

from __future__ import annotations

import time
from typing import Any

from monarch.runtime.common import rdma
from monarch.runtime.common.actors import Actor, endpoint
from monarch.runtime.common.shape import Shape
from monarch.runtime.wire.actor_end import InboxAddress
from monarch.runtime.worker import actors
from monarch.runtime.worker.actor_ref import ActorRef

SYSTEM = "__monarch_rdma__"
"""The hidden actor's name in each worker that made a buffer."""
ENDPOINTS = ["drop", "read", "write"]


class RdmaServer(Actor):
    """The owner's side of the transport: the bytes of a buffer this process registered, or why not."""

    @endpoint
    def read(self, buffer_id: str) -> Any:
        return rdma.serve_read(buffer_id)

    @endpoint
    def write(self, buffer_id: str, data: Any) -> str | None:
        return rdma.serve_write(buffer_id, data)

    @endpoint
    def drop(self, buffer_id: str) -> bool:
        return rdma.unregister(buffer_id)


def register() -> tuple[tuple[str, bytes | None, bytes], int, int]:
    """For a buffer made in this worker: the inbox that serves it (address, CURVE key, signing key), and this
    worker's mesh id and rank (where the controller calls it)."""
    address = actors.system_actor(SYSTEM, RdmaServer)
    mesh_id, rank = actors.mailbox().me
    return (address.addr, address.public, address.key), mesh_id, rank


# -- the controller's transport: live functions called by name on the owner's rank -------------------------
def read_for_controller(buffer_id: str) -> Any:
    """The bytes of buffer `buffer_id` (a flat uint8 tensor, out of band in the reply), or why not."""
    return rdma.serve_read(buffer_id)


def write_for_controller(buffer_id: str, data: Any) -> str | None:
    """Copy `data` into buffer `buffer_id`; None, or why not."""
    return rdma.serve_write(buffer_id, data)


def drop_for_controller(buffer_id: str) -> bool:
    return rdma.unregister(buffer_id)


# -- a worker reading or writing another process's buffer --------------------------------------------------
_refs: dict[str, ActorRef] = {}


def _ref(h: rdma.Handle) -> ActorRef:
    """A reference to the owner's hidden actor (one per owner process)."""
    assert h.inbox is not None and h.rank is not None
    ref = _refs.get(h.inbox[0])
    if ref is None:
        addr, public, key = h.inbox
        inboxes = {h.rank: InboxAddress(addr, public, key)}
        ref = _refs[addr] = ActorRef(SYSTEM, "RdmaServer", ENDPOINTS, Shape((), (), (h.rank,)), inboxes)
    return ref


class _Sent(rdma.Pending):
    """One message to the owner's hidden actor (a `RefFuture` of its answer), then `finish(value)`."""

    def wait(self, deadline: float) -> None:
        if self.ended:
            return
        while not self.future.done():
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(self.what)
            try:
                self.future.get(timeout=min(rdma.POLL, left))
            except TimeoutError:
                rdma.check_alive(self.h, self.what)
        self._end(self.future.get())

    async def wait_async(self, deadline: float) -> None:
        if self.ended:
            return
        import asyncio

        async def answer() -> Any:
            return await self.future

        task = asyncio.ensure_future(answer())
        value = await rdma.wait_polling(task, deadline, lambda: rdma.check_alive(self.h, self.what))
        self._end(value)

    def _end(self, value: Any) -> None:
        self.ended = True
        self.finish(value)


def start_read(h: rdma.Handle, dst: Any, size: int) -> rdma.Pending:
    """Ask the owner for the buffer's bytes; they are copied into `dst` when the answer is taken."""
    return _Sent(h, rdma.READ, _ref(h).read.call_one(h.id), rdma.read_finisher(h, dst, size))


def start_write(h: rdma.Handle, src: Any, size: int) -> rdma.Pending:
    """Send `src`'s bytes to the owner, which copies them into the buffer."""
    data = rdma._as_tensor(src)[:size]
    return _Sent(h, rdma.WRITE, _ref(h).write.call_one(h.id, data), rdma.write_finisher(h))


def start_drop(h: rdma.Handle) -> rdma.Pending:
    what = "RDMABuffer.drop"
    return _Sent(h, what, _ref(h).drop.call_one(h.id), lambda value: None)
