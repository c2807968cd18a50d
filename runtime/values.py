"""What a call on a mesh returns: a `ValueMesh` (one value per point of the view) or, for an asynchronous
call, a `Future` of one. They sit below `mesh`, so that a `ProcMesh` method can return them."""

from __future__ import annotations

import asyncio
import concurrent.futures
import sys
import threading
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from monarch.runtime.common import load
from monarch.runtime.common.errors import Failure, Release, RemoteError, RemoteInterrupt, group_failures
from monarch.runtime.common.shape import Shape
from monarch.runtime.common.valuemesh import ValueMesh
from monarch.runtime.wire import codec, protocol

T = TypeVar("T")
INTERRUPT_GRACE = 0.6
"""Seconds an interrupted call waits for the workers to say where they were, on a quiet machine (stretched on a
busy one: `load.stretched`)."""


class Future(Generic[T]):
    """The pending result of an asynchronous live-function call; `result()` waits for it."""

    def __init__(self, pending, shape: Shape, name: str):
        self._pending = pending
        self._shape = shape
        self._name = name
        self._value: ValueMesh[T] | None = None

    def done(self) -> bool:
        return self._pending.future.done()

    def add_done_callback(self, fn: Callable[[Future[T]], None]) -> None:
        """Call `fn(self)` once the call has ended (every rank answered, or it failed as a whole), on the
        thread that saw it end, or at once if it has. `fn` must be quick and must not wait for anything."""
        self._pending.future.add_done_callback(lambda _: fn(self))

    @property
    def points(self) -> list[tuple[int, str]]:
        """``(rank in the spawned mesh, label)`` of each point the call runs on, in rank order."""
        labels = self._pending.mesh.labels
        return [(r, labels[r]) for r in self._shape.ranks]

    @property
    def mesh_id(self) -> int:
        return self._pending.mesh.mesh_id

    def result(self, timeout: float | None = None) -> ValueMesh[T]:
        """Wait for every worker; raise `RemoteError` if any failed. Ctrl-C interrupts the workers."""
        if self._value is None:
            controller = self._pending.mesh.controller
            try:
                replies = controller.wait(self._pending, timeout)
            except KeyboardInterrupt:
                raise self.interrupted() from None
            self._value = self._decode(replies)
        return self._value

    def exception(self) -> BaseException | None:
        """For a call that has ended: the error `result()` raises (None when it succeeded). Never waits, so a
        done callback may ask it."""
        if not self.done():
            raise RuntimeError(f"{self._name}: the call has not ended; exception() is for one that has")
        error = self._pending.future.exception()
        if error is not None or self._value is not None:
            return error
        try:
            self._value = self._decode(self._pending.future.result())
        except Exception as e:
            return e
        return None

    def unshown_failures(self) -> list[tuple[Failure, str | None]]:
        """For a call that has ended: the failures of its `RemoteError` (what `result()` raises) with ranks whose
        tracebacks its output did not show as they came, each with None, or the label of the rank whose place
        showed its traceback already (a rank that failed the same way after the others were shown: it points
        there). A call nobody waits for (`%%mesh --noblock`) shows these in its areas as it ends: its error is
        raised to no one."""
        error = self.exception()
        if type(error) is not RemoteError:  # (a worker's death, a stop: their headline says it all)
            return []
        shown = self._pending.errors_shown
        out: list[tuple[Failure, str | None]] = []
        for f in error.failures:
            keep = [i for i, rank in enumerate(f.ranks) if rank not in shown]
            if len(keep) == len(f.ranks):
                out.append((f, None))
            elif keep:
                messages = [f.messages[i] for i in keep] if f.messages else []
                ranks, labels = [f.ranks[i] for i in keep], [f.labels[i] for i in keep]
                # (shown early, the same error's ranks were grouped alike: its first shown rank holds it)
                under = next(f.labels[i] for i, rank in enumerate(f.ranks) if rank in shown)
                out.append((Failure(ranks, labels, f.exc_type, f.message, f.traceback, messages), under))
        return out

    def interrupt(self) -> None:
        """Raise KeyboardInterrupt on the workers still running this call, and return at once (what Ctrl-C
        does to a call being waited for; for calls nobody waits for, such as `%%mesh --noblock` runs)."""
        if not self.done():
            self._pending.mesh.controller.interrupt(self._pending)

    def interrupted(self) -> RemoteInterrupt:
        """Interrupt the busy workers and collect, for a moment, where each one was: the error Ctrl-C
        raises while this call is waited for (or started)."""
        pending = self._pending
        controller = pending.mesh.controller
        controller.interrupt(pending)
        try:
            controller.wait(pending, load.stretched(INTERRUPT_GRACE))
        except BaseException:
            pass  # a worker that did not answer in time is reported as busy
        labels = pending.mesh.labels
        raw = []
        for rank, env in list(pending.replies.items()):
            if not env.message.ok:
                try:
                    raw.append((rank, labels[rank], _loads(env.body, env.buffers)))
                except Exception:
                    pass
        busy = sorted(controller.calls.running_ranks(pending))
        queued = sorted(set(busy) & controller.calls.busy_before(pending))
        if busy:
            controller.calls.abandon(pending)  # the next call on these ranks says so, not waits
        return RemoteInterrupt(self._name, group_failures(raw), busy, len(self._shape), queued)

    get = result

    def __await__(self):
        yield from asyncio.wrap_future(self._pending.future).__await__()
        return self.result()

    def each(self) -> list[PointFuture[T]]:
        """A future per point of the call, in point order, each done as soon as its worker has answered (or
        the call failed as a whole): one call to many, its answers taken as they come (`stream()`)."""
        shared: dict[int, Any] = {}  # (id(envelope) -> its value, once unpickled, when it cannot be changed)
        lock = threading.Lock()
        futures = [PointFuture(self, i, shared, lock) for i in range(len(self._shape))]
        by_rank = {f.rank: f for f in futures}

        def answered(rank: int) -> None:  # (the receiving thread)
            f = by_rank.get(rank)
            if f is not None:
                f._answered()

        pending = self._pending
        pending.on_reply = answered
        for rank in list(pending.replies):  # (those recorded before it was told)
            answered(rank)
        pending.future.add_done_callback(lambda _: [f._answered() for f in futures])
        return futures

    def _decode(self, replies: dict[int, tuple]) -> ValueMesh[T]:
        pending = self._pending
        loads = _loader()
        envs = list(map(replies.__getitem__, self._shape.ranks))
        distinct = {id(env): env for env in envs}
        if len(distinct) < len(envs):  # envelopes shared by ranks: a host's agent sends an equal reply once
            values = _shared_values(distinct, envs, loads)
            if values is not None:
                return ValueMesh(self._shape, values)
        labels = pending.mesh.labels
        values, failed, released = [], [], []
        shared: dict[int, Any] = {}  # (id(envelope) -> its value, when it cannot be changed)
        for rank, env in zip(self._shape.ranks, envs):
            obj = shared.get(id(env), _NONE)
            if obj is not _NONE:
                values.append(obj)
                continue
            try:
                obj = loads(env.body, env.buffers)
                if type(obj) in _IMMUTABLE and env.message.ok:
                    shared[id(env)] = obj
            except Exception as e:
                info = protocol.ErrorInfo(type(e).__qualname__, f"result cannot be unpickled here: {e}", "")
                failed.append((rank, labels[rank], info))
                continue
            if not env.message.ok and obj.exc_type == protocol.RELEASED and rank in pending.released:
                r = pending.released[rank]
                released.append(Release(rank, labels[rank], r.collective, r.where, r.user_groups))
            elif not env.message.ok:
                failed.append((rank, labels[rank], obj))
            else:
                values.append(obj)
        if failed or released:
            raise RemoteError(self._name, group_failures(failed), len(self._shape), released)
        return ValueMesh(self._shape, values)


class PointFuture(Generic[T]):
    """One point's part of a call made to many (`Future.each()`): done once that point's worker answered;
    `result()` is a `ValueMesh` over that point alone, or raises its error as a call to it alone would.
    Ctrl-C while waiting interrupts the whole call."""

    def __init__(self, call: Future[T], index: int, shared: dict[int, Any], lock: threading.Lock) -> None:
        self._call = call
        self._index = index
        self.rank = call._shape.ranks[index]
        """The point's rank in the spawned mesh."""
        self._shared = shared
        """id(envelope) -> its value, for the call's points that share an envelope (a host's equal answers)."""
        self._lock = lock
        """The call's (its points' state changes on the receiving thread and is read on the caller's)."""
        self._is_done = False
        self._callbacks: list[Callable[[PointFuture[T]], None]] = []
        self._waiter: concurrent.futures.Future[None] | None = None
        """Made only when someone waits for this point (thousands of points: no future each)."""
        self._value: ValueMesh[T] | None = None

    def _answered(self) -> None:
        with self._lock:
            if self._is_done:  # (told twice: its reply, then the call's end)
                return
            self._is_done = True
            callbacks, waiter = self._callbacks, self._waiter
        if waiter is not None:
            waiter.set_result(None)
        for fn in callbacks:
            fn(self)

    def done(self) -> bool:
        return self._is_done

    def add_done_callback(self, fn: Callable[[PointFuture[T]], None]) -> None:
        """Call `fn(self)` once this point has answered (on the receiving thread; quick, waits for nothing)."""
        with self._lock:
            if not self._is_done:
                self._callbacks.append(fn)
                return
        fn(self)

    def _waited(self) -> concurrent.futures.Future[None]:
        with self._lock:
            if self._waiter is None:
                self._waiter = concurrent.futures.Future()
                if self._is_done:
                    self._waiter.set_result(None)
            return self._waiter

    def result(self, timeout: float | None = None) -> ValueMesh[T]:
        if self._value is None:
            pending = self._call._pending
            if not self._is_done:
                try:
                    pending.mesh.controller.wait(pending, timeout, until=self._waited())
                except KeyboardInterrupt:
                    raise self._call.interrupted() from None
            env = pending.replies.get(self.rank)
            if env is None:  # the call failed as a whole before this point answered
                error = pending.future.exception(0)
                assert error is not None
                raise error
            shape = self._call._shape
            point = Shape(shape.names, (1,) * len(shape.names), (self.rank,))  # (its dimensions kept, each of 1)
            obj = self._shared.get(id(env), _NONE)
            if obj is not _NONE:
                self._value = ValueMesh(point, [obj])
            else:
                self._value = Future(pending, point, self._call._name)._decode({self.rank: env})
                (obj,) = self._value.values()
                if env.message.ok and type(obj) in _IMMUTABLE:
                    self._shared[id(env)] = obj
        return self._value

    get = result

    def __await__(self):
        yield from asyncio.wrap_future(self._waited()).__await__()
        return self.result()


class Done(Generic[T]):
    """A future that is already done (what Monarch's asynchronous methods return where ours finish before
    returning, such as `ProcMesh.stop()`): `get()`, `result()`, `await`."""

    def __init__(self, value: T) -> None:
        self._value = value

    def done(self) -> bool:
        return True

    def get(self, timeout: float | None = None) -> T:
        return self._value

    result = get

    def exception(self, timeout: float | None = None) -> BaseException | None:
        return None

    def add_done_callback(self, fn: Callable[[Done[T]], None]) -> None:
        fn(self)

    def __await__(self):
        return self._value
        yield  # (a generator: `await` takes its return value)


_NONE = object()
_IMMUTABLE = frozenset((type(None), bool, int, float, complex, str, bytes))


def _shared_values(distinct: dict[int, codec.Envelope], envs: list[codec.Envelope], loads: Any) -> list[Any] | None:
    """Each rank's value, unpickling each distinct envelope once; None (each rank's own, then) unless every one
    succeeded with a value that cannot be changed (one list shared by many ranks would be one list)."""
    values: dict[int, Any] = {}
    for key, env in distinct.items():
        if not env.message.ok:
            return None
        try:
            obj = loads(env.body, env.buffers)
        except Exception:
            return None
        if type(obj) not in _IMMUTABLE:
            return None
        values[key] = obj
    return [values[id(env)] for env in envs]


def _loader() -> Callable[[Any, Any], Any]:
    """`_loads` for this thread now, decided once for a call's replies (`codec.loads` itself outside
    `mesh.activate()`: one call fewer per reply)."""
    capture = sys.modules.get("monarch.runtime.tensor.engine")
    return codec.loads if capture is None or capture.capturing.get() is None else _loads


def _loads(body, buffers) -> Any:
    """Unpickle a result as local objects, also inside `mesh.activate()` (whose capture would turn
    the tensors being rebuilt into commands for the workers)."""
    capture = sys.modules.get("monarch.runtime.tensor.engine")
    if capture is None or capture.capturing.get() is None:
        return codec.loads(body, buffers)
    import torch

    with torch.utils._python_dispatch._disable_current_modes():
        return codec.loads(body, buffers)
