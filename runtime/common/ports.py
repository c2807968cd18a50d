"""Ports and channels: Monarch's low-level messaging between actors, and between actors and the controller.

    port, receiver = Channel.open()          # in an actor, or in the script/notebook (the controller)
    other.run.call_one(port)                 # a Port pickles: wherever it goes, `port.send(x)` reaches `receiver`
    x = await receiver.recv()                # or receiver.recv().get()

A `Port` names the process holding the receiving end (a worker, by its mesh and rank, with its actor inbox;
or the controller) and a number in that process's table of ports (`_table`). Sending to a port of this process
delivers at once; to another one, the process's `Router` (the worker's, `runtime/worker/ports.py`, or the
controller's, `runtime/actors/ports.py`) carries it over the signed channels that already exist: worker to
worker through the receiver's inbox, worker to controller up the worker's reply connection, controller to
worker down the command connection. What one sender sends one port arrives in the order sent.

A port is also how an endpoint answers when it is declared `@endpoint(explicit_response_port=True)`: the
endpoint gets its caller's response port as its first argument and may answer through it later, from another
endpoint or task, or from another process it hands the port to.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import itertools
import threading
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

R = TypeVar("R")

Deliver = Callable[[int | None, bool, Any], None]
"""What takes a message sent to a port of this process: (the sender's rank, whether it is a value or an
exception, the value)."""

UNRANKED = -1
"""The rank a message carries on the wire when its port had none."""


@dataclass(frozen=True)
class PortRef:
    """Where a port's messages go (plain data: it travels inside pickled `Port`s)."""

    owner: tuple[int, int] | None
    """(mesh id, rank) of the worker that holds the receiving end; None: the controller."""
    inbox: Any
    """That worker's inbox (`wire.actor_end.InboxAddress`), for messages from other workers; None for the
    controller."""
    port_id: int
    """Its number in the owner's table of ports."""
    once: bool
    """It takes one message (a call's response port, `Channel.open(once=True)`)."""


class Router(Protocol):
    """A process's way to ports elsewhere (installed by the worker or the controller as it starts)."""

    def here(self) -> tuple[int, int] | None:
        """This process as a port owner: (mesh id, rank) on a worker, None on the controller."""
        ...

    def inbox(self) -> Any:
        """This process's inbox address (a worker's), or None."""
        ...

    def deliver(self, ref: PortRef, rank: int | None, ok: bool, value: Any) -> None:
        """Send a message to a port of another process."""
        ...

    def block(self, done: Callable[[], bool], timeout: float | None) -> None:
        """Wait on this thread until `done()` (a worker's main thread serves its messages meanwhile)."""
        ...


ROUTER: Router | None = None
"""This process's router; None in a process that is neither a worker nor a controller yet."""

_ids = itertools.count(1)
_table: dict[int, tuple[Deliver, bool]] = {}
"""Port number -> what takes its messages, and whether it takes one only."""
_table_lock = threading.Lock()


def _router() -> Router:
    if ROUTER is None:
        raise RuntimeError(
            "ports work in a monarch controller (a script or notebook, once it spawned a mesh) or on its workers"
        )
    return ROUTER


def register(deliver: Deliver, once: bool = False) -> PortRef:
    """Enter `deliver` in this process's table of ports; a reference other processes can send to."""
    router = _router()
    port_id = next(_ids)
    with _table_lock:
        _table[port_id] = (deliver, once)
    return PortRef(router.here(), router.inbox(), port_id, once)


def unregister(port_id: int) -> None:
    with _table_lock:
        _table.pop(port_id, None)


def take(port_id: int, rank: int | None, ok: bool, value: Any) -> bool:
    """A message for port `port_id` of this process, from another process (or this one); whether the port
    was there (a once-port is gone after its message; a message to a port that is gone is dropped)."""
    with _table_lock:
        got = _table.get(port_id)
        if got is None:
            return False
        deliver, once = got
        if once:
            del _table[port_id]
    deliver(None if rank == UNRANKED else rank, ok, value)
    return True


class Port(Generic[R]):
    """The sending end of a channel: `send(value)` (fire and forget, in order), `exception(e)` (the receiver's
    `recv()` raises it). Picklable: give it to an actor, return it from an endpoint."""

    def __init__(self, ref: PortRef, rank: int | None = None, local: Deliver | None = None) -> None:
        self._ref, self._rank = ref, rank
        self._local = local
        """In the process that opened it: the receiving end itself (no table lookup, nothing pickled)."""
        self._sent = False

    @property
    def rank(self) -> int | None:
        """The rank this port's messages carry (a `RankedPortReceiver` yields it); None if unranked."""
        return self._rank

    def send(self, obj: R) -> None:
        """Send `obj` to the receiving end (pickled when it lives in another process)."""
        self._post(True, obj)

    def exception(self, obj: BaseException) -> None:
        """Make the receiver's `recv()` raise `obj`."""
        if not isinstance(obj, BaseException):
            raise TypeError(f"Port.exception() takes an exception, got {type(obj).__name__}")
        self._post(False, obj)

    def _post(self, ok: bool, value: Any) -> None:
        ref = self._ref
        if ref.once and self._sent:
            raise RuntimeError("this port takes one message (a call's answer, or Channel.open(once=True)): it was sent")
        self._sent = True
        if self._local is not None:
            self._local(self._rank, ok, value)
            return
        router = _router()
        if ref.owner == router.here():
            if not take(ref.port_id, self._rank, ok, value):
                raise RuntimeError("this port's receiving end is gone (a once-port that took its message?)")
            return
        router.deliver(ref, self._rank, ok, value)

    def _ranked(self, rank: int | None) -> Port[R]:
        """This port as a sender at `rank` sends through it (each actor answering a `send(..., port=)`)."""
        return Port(self._ref, rank, self._local)

    def __reduce__(self) -> tuple[Any, ...]:
        return Port, (self._ref, self._rank)

    def __repr__(self) -> str:
        where = "the controller" if self._ref.owner is None else f"mesh {self._ref.owner[0]} rank {self._ref.owner[1]}"
        return f"<Port {self._ref.port_id} of {where}{' (once)' if self._ref.once else ''}>"


def exception_of(future: Any, timeout: float | None = None) -> BaseException | None:
    """A future's `exception()`: what its `get(timeout)` raises (a `TimeoutError` is raised, not returned)."""
    try:
        future.get(timeout)
    except TimeoutError:
        raise
    except BaseException as e:
        return e
    return None


class PortFuture(Generic[R]):
    """A value that will come (a port's next message): `get(timeout=)` (alias `result`) waits for it,
    `await` it in async code, `exception()` asks without waiting long."""

    def __init__(self, what: str = "the message") -> None:
        self._inner: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._what = what

    def _set(self, ok: bool, value: Any) -> None:
        if self._inner.done():
            return
        if ok:
            self._inner.set_result(value)
        else:
            self._inner.set_exception(value)

    def done(self) -> bool:
        return self._inner.done()

    def get(self, timeout: float | None = None) -> R:
        """Wait for the value (or raise its exception); `TimeoutError` after `timeout` seconds."""
        if not self._inner.done() and ROUTER is not None:
            ROUTER.block(self._inner.done, timeout)
        try:
            return self._inner.result(timeout if not self._inner.done() else 0)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(f"{self._what}: nothing came within {timeout} s") from None

    result = get

    def exception(self, timeout: float | None = None) -> BaseException | None:
        return exception_of(self, timeout)

    def add_done_callback(self, fn: Callable[[PortFuture[R]], None]) -> None:
        self._inner.add_done_callback(lambda _: fn(self))

    def __await__(self) -> Generator[Any, None, R]:
        return asyncio.wrap_future(self._inner).__await__()


class PortReceiver(Generic[R]):
    """The receiving end of a channel: `recv()` is a future of the next message, in the order sent."""

    def __init__(self, once: bool = False) -> None:
        self._lock = threading.Lock()
        self._items: collections.deque[tuple[int | None, bool, Any]] = collections.deque()
        self._waiting: collections.deque[tuple[PortFuture[Any], bool]] = collections.deque()
        self._once = once
        self._ref = register(self._deliver, once)

    def _deliver(self, rank: int | None, ok: bool, value: Any) -> None:
        with self._lock:
            if not self._waiting:
                self._items.append((rank, ok, value))
                return
            future, ranked = self._waiting.popleft()
        future._set(ok, (rank, value) if ranked and ok else value)

    def _recv(self, ranked: bool) -> PortFuture[Any]:
        future: PortFuture[Any] = PortFuture("PortReceiver.recv()")
        with self._lock:
            if not self._items:
                self._waiting.append((future, ranked))
                return future
            rank, ok, value = self._items.popleft()
        future._set(ok, (rank, value) if ranked and ok else value)
        return future

    def recv(self) -> PortFuture[R]:
        """A future of the next message (`.get()`, or `await`); a message sent with `Port.exception(e)` raises
        `e` there."""
        return self._recv(False)

    def ranked(self) -> RankedPortReceiver[R]:
        """This receiver, giving ``(rank, value)``: the rank of the actor that sent each message."""
        return RankedPortReceiver(self)

    def __del__(self) -> None:
        try:
            unregister(self._ref.port_id)
        except Exception:
            pass


class RankedPortReceiver(Generic[R]):
    """A receiver whose `recv()` gives ``(rank, value)``."""

    def __init__(self, inner: PortReceiver[R]) -> None:
        self._inner = inner

    def recv(self) -> PortFuture[tuple[int | None, R]]:
        return self._inner._recv(True)


class Channel(Generic[R]):
    """Opens ports: ``port, receiver = Channel.open()`` (``once=True``: one message)."""

    @staticmethod
    def open(once: bool = False) -> tuple[Port[R], PortReceiver[R]]:
        """A new port and its receiving end, in this process (an actor's, or the controller's)."""
        receiver: PortReceiver[R] = PortReceiver(once)
        return Port(receiver._ref, None, receiver._deliver), receiver

    @staticmethod
    def open_ranked(once: bool = False) -> tuple[Port[R], RankedPortReceiver[R]]:
        """As `open`, the receiver giving ``(rank, value)``."""
        port, receiver = Channel.open(once)
        return port, receiver.ranked()
