"""Actors in the controller's own process: `this_proc().spawn(name, cls, *args, **kwargs)`.

`this_proc()` is this process as a proc mesh of one point and no dimensions (Monarch's getting-started code
spawns on it). Each actor spawned there gets a thread of its own (its `Mailbox`) that runs its messages one at
a time, in the order they were posted, so one local actor waiting on another never blocks the other; an
`async def` endpoint runs to completion on that thread's event loop. The actor mesh has the adverbs of a worker
actor mesh (`call`, `call_one`, `broadcast`, `choose`, `stream`); an endpoint's error reaches the caller as a
`RemoteError` like a worker's, its traceback without our frames. An actor that would wait for its own answer
(directly, or around a cycle of local actors waiting on each other) gets a `RuntimeError` instead of a hang.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import inspect
import os
import queue
import sys
import threading
import traceback
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, cast

from monarch.runtime.actors import ActorEndpoint, ActorMesh, check_spawn
from monarch.runtime.actors import supervision as sup
from monarch.runtime.common import actors as shared
from monarch.runtime.common.errors import ErrorInfo, RemoteError, group_failures
from monarch.runtime.common.shape import Shape
from monarch.runtime.mesh import Extent
from monarch.runtime.values import ValueMesh

if TYPE_CHECKING:
    from monarch.runtime.mesh import ProcMesh

LABEL = "this_proc"
"""A local actor's coordinates, as errors and failures name them."""
_SHAPE = Shape((), (), (0,))
_actors: dict[str, Mailbox] = {}
_actors_lock = threading.Lock()
_waits_lock = threading.Lock()


current_mailbox = sup.current_mailbox


def context() -> shared.Context:
    """`monarch.actor.context()`: a local actor's context on its own thread, else the worker-side one."""
    box = current_mailbox()
    return box.context if box is not None else shared.context()


class Mailbox:
    """One local actor: its object, its thread and the queue of messages that thread runs in order."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.actor: Any = None
        self.context = shared.Context(shared.ActorInstance(name, {}), {})
        self.closed = False
        self.waiting_for: Mailbox | None = None
        """The local actor this one's thread waits for an answer from (to refuse a wait that would never end)."""
        self._queue: queue.SimpleQueue[tuple[concurrent.futures.Future[Any], Callable[[], Any]] | None] = (
            queue.SimpleQueue()
        )
        threading.Thread(target=self._serve, name=f"monarch-actor-{name}", daemon=True).start()

    def post(self, fn: Callable[[], Any]) -> concurrent.futures.Future[Any]:
        """Run `fn()` on the actor's thread after the messages posted before; a future of its result (awaited
        on the actor's event loop when it is a coroutine)."""
        if self.closed:
            raise RuntimeError(f"this_proc() actor {self.name!r} was stopped")
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._queue.put((future, fn))
        return future

    def close(self) -> None:
        """Stop taking messages; the thread ends after those already posted."""
        self.closed = True
        self._queue.put(None)

    def supervise(self, failure: sup.MeshFailure, unhandled: Callable[[sup.MeshFailure], None]) -> None:
        """Ask the actor's `__supervise__(failure)`, in order with its messages; `unhandled(failure)` when it
        has none, returns something falsy, or raises."""
        method = getattr(self.actor, "__supervise__", None)
        if method is None or self.closed:
            unhandled(failure)
            return
        try:
            future = self.post(lambda: method(failure))
        except RuntimeError:  # (stopped meanwhile)
            unhandled(failure)
            return

        def done(f: concurrent.futures.Future[Any]) -> None:
            error = f.exception()
            if error is not None:
                print(f"monarch: {self.name}.__supervise__ raised (the failure goes on to unhandled_fault_hook):",
                      file=sys.__stderr__)  # fmt: skip
                traceback.print_exception(error, file=sys.__stderr__)
            if error is not None or not f.result():
                unhandled(failure)

        future.add_done_callback(done)

    def _serve(self) -> None:
        sup.here.mailbox = self
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        try:
            while (item := self._queue.get()) is not None:
                future, fn = item
                if future.set_running_or_notify_cancel():
                    _run(loop, future, fn)
        finally:
            loop.close()


def _run(loop: asyncio.AbstractEventLoop, future: concurrent.futures.Future[Any], fn: Callable[[], Any]) -> None:
    try:
        result = fn()
        if inspect.isawaitable(result):
            result = loop.run_until_complete(_awaited(result))
    except BaseException as e:  # (the caller gets it; the actor goes on with its next message)
        future.set_exception(e)
    else:
        future.set_result(result)


async def _awaited(awaitable: Any) -> Any:
    return await awaitable


@contextlib.contextmanager
def _waiting_for(target: Mailbox, what: str) -> Iterator[None]:
    """Around a wait for `target`'s answer: refuse it when the waiting thread is a local actor that `target`
    (or the actor it waits for, and so on) waits for: that answer would never come."""
    me = current_mailbox()
    if me is None:
        yield
        return
    with _waits_lock:
        chain, box = [], target
        while box is not None and box is not me:
            chain.append(box.name)
            box = box.waiting_for
        if box is me:
            raise RuntimeError(_deadlock(me.name, chain, what))
        me.waiting_for = target
    try:
        yield
    finally:
        me.waiting_for = None


def _deadlock(me: str, chain: list[str], what: str) -> str:
    if not chain:
        how = f"{what} is a message to actor {me!r} itself"
    else:
        how = f"{what} waits for {' -> '.join(repr(n) for n in chain)}, which waits for {me!r}"
    return (
        f"this_proc() actor {me!r} would wait for ever: {how}, and an actor runs its messages one at a time, in "
        "order, so the answer cannot come while this endpoint waits for it. Call the method directly "
        "(self.method(...)), or send it without waiting (.broadcast(...))."
    )


class LocalFuture:
    """The answer of a local actor's endpoint: `get(timeout=)` (or `await`) gives a `ValueMesh` of one value;
    an error raises as a `RemoteError` like a worker's."""

    def __init__(self, box: Mailbox, inner: concurrent.futures.Future[Any], what: str) -> None:
        self._box, self._inner, self._what = box, inner, what
        self._error: RemoteError | None = None

    def done(self) -> bool:
        return self._inner.done()

    def add_done_callback(self, fn: Callable[[LocalFuture], None]) -> None:
        """Call `fn(self)` once answered, on the actor's thread (or at once if it was)."""
        self._inner.add_done_callback(lambda _: fn(self))

    def result(self, timeout: float | None = None) -> ValueMesh[Any]:
        """Wait for the answer (`TimeoutError` after `timeout` seconds)."""
        if not self._inner.done():
            with _waiting_for(self._box, self._what):
                concurrent.futures.wait([self._inner], timeout)
            if not self._inner.done():
                raise TimeoutError(f"{self._what}: no answer within {timeout} s")
        return self._value()

    get = result

    def exception(self) -> BaseException | None:
        """For an answered call: the error `result()` raises, or None. Never waits."""
        if not self._inner.done():
            raise RuntimeError(f"{self._what}: the call has not ended; exception() is for one that has")
        return self._remote_error()

    def __await__(self) -> Any:
        return self._await().__await__()

    async def _await(self) -> ValueMesh[Any]:
        if not self._inner.done():
            with _waiting_for(self._box, self._what):
                await asyncio.wait([asyncio.wrap_future(self._inner)])
        return self._value()

    def _value(self) -> ValueMesh[Any]:
        error = self._remote_error()
        if error is not None:
            raise error from self._inner.exception()
        return ValueMesh(_SHAPE, [self._inner.result()])

    def _remote_error(self) -> RemoteError | None:
        e = self._inner.exception()
        if e is not None and self._error is None:
            self._error = remote_error(self._what, e)
        return self._error


_PLUMBING = (os.path.dirname(__file__) + os.sep, contextlib.__file__)
"""Where our frames come from (this package, the context managers around a wait): left out of tracebacks."""


def remote_error(what: str, e: BaseException) -> RemoteError:
    """`e`, raised by a local actor, as a worker actor's error reaches its caller (our frames left out)."""
    te = traceback.TracebackException.from_exception(e)
    for t in _chain(te):
        t.stack = traceback.StackSummary.from_list([f for f in t.stack if not f.filename.startswith(_PLUMBING)])
    info = ErrorInfo(type(e).__qualname__, str(e), "".join(te.format()))
    return RemoteError(what, group_failures([(0, LABEL, info)]), 1)


def _chain(te: traceback.TracebackException) -> list[traceback.TracebackException]:
    out: list[traceback.TracebackException] = []
    todo: list[traceback.TracebackException | None] = [te]
    while todo:
        t = todo.pop()
        if t is None or any(t is o for o in out):
            continue
        out.append(t)
        todo += [t.__cause__, t.__context__]
    return out


class LocalProc:
    """`this_proc()`: the controller's own process as a proc mesh of one point and no dimensions."""

    _shape = _SHAPE

    @property
    def sizes(self) -> dict[str, int]:
        return {}

    @property
    def extent(self) -> Extent:
        return Extent()

    @property
    def names(self) -> tuple[str, ...]:
        return ()

    def size(self, dim: str | None = None) -> int:
        return _SHAPE.size(dim)

    def __len__(self) -> int:
        return 1

    def describe(self) -> str:
        return LABEL

    def label(self, coords: dict[str, int]) -> str:
        return LABEL

    def slice(self, **index: int | range | slice) -> LocalProc:
        """`this_proc()` has no dimensions: only the empty slice (itself)."""
        if index:
            raise ValueError(f"slice({', '.join(index)}=...): this_proc() has no dimensions (it is one process)")
        return self

    def spawn(self, name: str, cls: type, *args: Any, **kwargs: Any) -> LocalActorMesh:
        """Construct `cls(*args, **kwargs)` in this process, on a thread of its own, under `name`; waits (a
        constructor's error raises here)."""
        check_spawn(name, cls)
        owner = sup.owner_here()
        box = Mailbox(name)
        with _actors_lock:
            if name in _actors:
                box.close()
                raise ValueError(f"a this_proc() actor named {name!r} already runs (spawn it under another name)")
            _actors[name] = box
        try:
            box.actor = LocalFuture(box, box.post(lambda: cls(*args, **kwargs)), f"{name}.__init__").get().values()[0]
        except BaseException:
            _forget(box)
            raise
        return LocalActorMesh(self, name, cls, shared.endpoints_of(cls), box, owner)

    def __repr__(self) -> str:
        return "<this_proc(): the controller's own process>"


_this_proc = LocalProc()


def this_proc() -> LocalProc:
    """The process this code runs in, as a proc mesh of one process (Monarch's `this_proc()`)."""
    return _this_proc


def _forget(box: Mailbox) -> None:
    box.close()
    with _actors_lock:
        if _actors.get(box.name) is box:
            del _actors[box.name]


class LocalActorMesh(ActorMesh):
    """An actor spawned on `this_proc()`: a mesh of one actor, living on a thread of this process."""

    def __init__(
        self, proc: LocalProc, name: str, cls: type, endpoints: list[str], box: Mailbox, owner: sup.Owner
    ) -> None:
        super().__init__(cast("ProcMesh", proc), name, cls, endpoints, {})
        self._box, self._supervisor = box, owner

    def slice(self, **index: int | range | slice) -> LocalActorMesh:
        cast(LocalProc, self._procs).slice(**index)
        return self

    def __getattr__(self, attr: str) -> LocalEndpoint:
        super().__getattr__(attr)  # (raises, naming the endpoints, for anything else)
        return LocalEndpoint(self, attr)

    def stop(self) -> None:
        """Stop the actor: its thread ends after the messages already sent; later calls raise."""
        _forget(self._box)

    def owner(self) -> sup.Owner | None:
        return self._supervisor

    def __reduce__(self) -> Any:
        raise TypeError(
            f"actor mesh {self._name!r} lives in the controller's process (this_proc()): it cannot be sent to "
            "workers; call it from the notebook or script, or from another this_proc() actor"
        )


class LocalEndpoint(ActorEndpoint):
    """An endpoint of a `this_proc()` actor: a call is a message on the actor's thread."""

    def _start(self, procs: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        mesh = cast(LocalActorMesh, self._actors)
        box, endpoint = mesh._box, self._name

        def run() -> Any:
            return getattr(box.actor, endpoint)(*args, **kwargs)

        return LocalFuture(box, box.post(run), f"{mesh.name}.{endpoint}")

    def broadcast(self, *args: Any, **kwargs: Any) -> None:
        """A message on the actor's thread, not waited for; a failure goes to the actor mesh's owner."""
        mesh, endpoint = cast(LocalActorMesh, self._actors), self._name

        def report(f: LocalFuture) -> None:
            error = f.exception()
            if error is not None:
                failure = sup.endpoint_failed(mesh.name, mesh._cls.__name__, "this_proc", endpoint, error)
                sup.deliver(failure, mesh.owner())

        self._start(None, args, kwargs).add_done_callback(report)
