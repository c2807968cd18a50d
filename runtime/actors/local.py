"""Actors in the controller's own process: `this_proc().spawn(name, cls, *args, **kwargs)`.

`this_proc()` is this process as a proc mesh of one point and no dimensions (Monarch's getting-started code
spawns on it). Each actor spawned there gets a thread of its own (its `Mailbox`) running an event loop that
takes its messages one at a time, in the order they were posted, so one local actor waiting on another never
blocks the other; an `async def` endpoint runs to completion before the next message, a `concurrent_endpoint`
as a task beside the next ones. The actor mesh has the adverbs of a worker actor mesh (`common/endpoint.py`);
an endpoint's error reaches the caller as a `RemoteError` like a worker's, its traceback without our frames.
An actor that would wait for its own answer (directly, or around a cycle of local actors waiting on each other)
gets a `RuntimeError` instead of a hang.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import inspect
import os
import sys
import threading
import traceback
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, cast

from monarch.runtime.actors import ActorMesh, check_spawn
from monarch.runtime.actors import supervision as sup
from monarch.runtime.common import actors as shared
from monarch.runtime.common import ports
from monarch.runtime.common.endpoint import Adverbs
from monarch.runtime.common.errors import ErrorInfo, RemoteError, group_failures
from monarch.runtime.common.mesh_trait import Extent, MeshTrait, Point
from monarch.runtime.common.shape import Shape
from monarch.runtime.values import Done, ValueMesh

if TYPE_CHECKING:
    from monarch.runtime.mesh import ProcMesh

LABEL = "this_proc"
"""A local actor's coordinates, as errors and failures name them."""
_SHAPE = Shape((), (), (0,))
_actors: dict[str, Mailbox] = {}
_actors_lock = threading.Lock()
_waits_lock = threading.Lock()
CLEANUP_WAIT = 10.0
"""Seconds a stopping local actor's tasks and `__cleanup__` may take."""


current_mailbox = sup.current_mailbox


def context() -> shared.Context:
    """`monarch.actor.context()`: a local actor's context on its own thread, else the worker-side one (or the
    client's)."""
    got = shared.current()
    if got is not None:
        return got
    box = current_mailbox()
    return box.context if box is not None else shared.context()


class Mailbox:
    """One local actor: its object, its thread, and the event loop there that runs its messages in order."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.actor: Any = None
        self.context = shared.Context(shared.ActorInstance(name, Point(0, Extent()), "this_proc"))
        self.closed = False
        self.waiting_for: Mailbox | None = None
        """The local actor this one's thread waits for an answer from (to refuse a wait that would never end)."""
        self.tasks: set[asyncio.Task[Any]] = set()
        """Its `concurrent_endpoint` calls still running."""
        self.loop = asyncio.new_event_loop()
        self._queue: asyncio.Queue[tuple[concurrent.futures.Future[Any], Callable[[], Any], bool] | None] | None = None
        self._ready = threading.Event()
        self.thread = threading.Thread(target=self._serve, name=f"monarch-actor-{name}", daemon=True)
        self.thread.start()
        self._ready.wait()

    def post(self, fn: Callable[[], Any], concurrent_: bool = False) -> concurrent.futures.Future[Any]:
        """Run `fn()` on the actor's thread after the messages posted before; a future of its result (awaited
        on the actor's event loop when it is a coroutine; as a task beside the next messages if `concurrent_`)."""
        if self.closed:
            raise RuntimeError(f"this_proc() actor {self.name!r} was stopped")
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self.loop.call_soon_threadsafe(self._put, (future, fn, concurrent_))
        return future

    def _put(self, item: Any) -> None:
        assert self._queue is not None
        self._queue.put_nowait(item)

    def close(self) -> None:
        """Stop taking messages: its concurrent tasks are cancelled and `__cleanup__(None)` runs after the
        messages already posted; then the thread ends."""
        if self.closed:
            return
        self.closed = True
        self.loop.call_soon_threadsafe(self._put, None)

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
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_until_complete(self._dispatch())
        finally:
            self.loop.close()

    async def _dispatch(self) -> None:
        self._queue = asyncio.Queue()
        self._ready.set()
        token = shared.enter(self.context)
        try:
            while (item := await self._queue.get()) is not None:
                future, fn, concurrent_ = item
                if not future.set_running_or_notify_cancel():
                    continue
                if concurrent_:
                    task = asyncio.ensure_future(_run(future, fn))
                    self.tasks.add(task)
                    task.add_done_callback(self.tasks.discard)
                else:
                    await _run(future, fn)
            await self._clean_up()
        finally:
            shared.leave(token)

    async def _clean_up(self) -> None:
        for task in list(self.tasks):
            task.cancel()
        if self.tasks:
            await asyncio.wait(list(self.tasks), timeout=CLEANUP_WAIT)
        cleanup = getattr(self.actor, "__cleanup__", None)
        if cleanup is None:
            return
        try:
            result = cleanup(None)
            if inspect.isawaitable(result):
                await asyncio.wait_for(_awaited(result), CLEANUP_WAIT)
        except BaseException:
            print(f"monarch: {self.name}.__cleanup__ raised:", file=sys.__stderr__)
            traceback.print_exc(file=sys.__stderr__)


async def _run(future: concurrent.futures.Future[Any], fn: Callable[[], Any]) -> None:
    try:
        result = fn()
        if inspect.isawaitable(result):
            result = await result
    except BaseException as e:  # (the caller gets it; the actor goes on with its next message)
        if not future.done():
            future.set_exception(e)
    else:
        if not future.done():
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
            if self._box.thread is threading.current_thread():
                raise RuntimeError(_deadlock(self._box.name, [], self._what))
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
    message = e.headline() if isinstance(e, RemoteError) else str(e)  # (as `worker/describe.py` says it)
    info = ErrorInfo(type(e).__qualname__, message, "".join(te.format()))
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


class LocalProc(MeshTrait):
    """`this_proc()`: the controller's own process as a proc mesh of one point and no dimensions."""

    _shape = _SHAPE

    def _new_with_shape(self, shape: Shape) -> LocalProc:
        return self

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

    @property
    def host_mesh(self) -> Any:
        from monarch.runtime.mesh import this_host

        return this_host()

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

    def _new_with_shape(self, shape: Shape) -> LocalActorMesh:
        return self

    def slice(self, **index: int | range | slice) -> LocalActorMesh:
        cast(LocalProc, self._procs).slice(**index)
        return self

    def _endpoint(self, name: str) -> LocalEndpoint:  # type: ignore[override]
        return LocalEndpoint(self, name)

    def stop(self, reason: str = "stopped by client") -> Done[None]:
        """Stop the actor: its concurrent calls are cancelled and its `__cleanup__(None)` runs after the
        messages already sent; later calls raise. Waits for that; a done future."""
        _forget(self._box)
        if self._box.thread is not threading.current_thread():
            self._box.thread.join(CLEANUP_WAIT * 2)
        return Done(None)

    def owner(self) -> sup.Owner | None:
        return self._supervisor

    def __reduce__(self) -> Any:
        raise TypeError(
            f"actor mesh {self._name!r} lives in the controller's process (this_proc()): it cannot be sent to "
            "workers; call it from the notebook or script, or from another this_proc() actor"
        )


class LocalEndpoint(Adverbs[Any, Any]):
    """An endpoint of a `this_proc()` actor: a call is a message on the actor's thread."""

    def __init__(self, actors: LocalActorMesh, name: str) -> None:
        self._actors, self._name = actors, name

    @property
    def _shape(self) -> Shape:
        return _SHAPE

    @property
    def _what(self) -> str:
        return f"{self._actors.name}.{self._name.lstrip('~^')}"

    def _in_flight(self) -> tuple[threading.Lock, dict[int, int]]:
        return self._actors._lock, self._actors._choosing

    def _method(self) -> tuple[Callable[..., Any], shared.EndpointOptions]:
        box, name = self._actors._box, self._name
        loose = name.startswith(shared.LOOSE)
        attr = name.lstrip("~^")
        method = getattr(box.actor, attr)
        options = shared.options_of(method)
        if options is None:
            if not loose:
                raise AttributeError(f"{type(box.actor).__name__} has no endpoint {attr!r}")
            options = shared.EndpointOptions(explicit_response_port=name.startswith(shared.LOOSE_PORTED))
        return method, options

    def _start(self, args: tuple[Any, ...], kwargs: dict[str, Any], answer: ports.Deliver | None) -> LocalFuture:
        """Post the message; a future of its answer (its return value, or what it sends its response port)."""
        box = self._actors._box
        method, options = self._method()
        if not options.explicit_response_port and not options.concurrent and answer is None:
            return LocalFuture(box, box.post(lambda: method(*args, **kwargs)), self._what)
        result: concurrent.futures.Future[Any] = concurrent.futures.Future()

        def deliver(rank: int | None, ok: bool, value: Any) -> None:
            if answer is not None:
                answer(rank, ok, value)
            elif not result.done():
                result.set_result(value) if ok else result.set_exception(value)

        port = ports.Port(ports.register(deliver, once=True), 0, deliver)

        def run() -> Any:
            if options.explicit_response_port:
                return method(port, *args, **kwargs)
            return _answering(method(*args, **kwargs), port)

        ran = box.post(run, options.concurrent)

        def after(f: concurrent.futures.Future[Any]) -> None:
            error = f.exception()
            if error is not None and not port._sent:
                port.exception(error)

        ran.add_done_callback(after)
        return LocalFuture(box, result, self._what)

    def _call(self, points: list[int] | None, args: tuple[Any, ...], kwargs: dict[str, Any]) -> LocalFuture:
        return self._start(args, kwargs, None)

    def _post(
        self, points: list[int] | None, args: tuple[Any, ...], kwargs: dict[str, Any], port: ports.Port[Any] | None
    ) -> None:
        """A message on the actor's thread, not waited for; its answer to `port`, else a failure to the actor
        mesh's owner."""
        mesh, endpoint = self._actors, self._name

        def answer(rank: int | None, ok: bool, value: Any) -> None:
            if port is not None:
                port._ranked(0)._post(ok, value)
            elif not ok:
                failure = sup.endpoint_failed(
                    mesh.name, mesh._cls.__name__, LABEL, endpoint, remote_error(self._what, value)
                )
                sup.deliver(failure, mesh.owner())

        self._start(args, kwargs, answer)


async def _answering(result: Any, port: ports.Port[Any]) -> None:
    """Send an endpoint's result to its response port (awaited first if it is a coroutine)."""
    try:
        value = await result if inspect.isawaitable(result) else result
    except BaseException as e:
        port.exception(e)
        return
    port.send(value)


def current_rank() -> Point:
    """Where the running code is in the mesh its message was sent to (Monarch's `current_rank()`: an actor's
    `context().message_rank`; a live function's coordinates; on the client, the point of no dimensions)."""
    from monarch.runtime.common import context as worker_context

    got = shared.current()
    if got is not None:
        return got.message_rank
    box = current_mailbox()
    if box is not None:
        return box.context.message_rank
    if worker_context.worker is not None:
        return worker_context.current_rank()
    return shared.CLIENT.message_rank


def current_size() -> dict[str, int]:
    """The sizes of the mesh the running code's message was sent to (``{}`` on the client)."""
    return dict(current_rank().extent)
