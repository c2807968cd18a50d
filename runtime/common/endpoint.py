"""The adverbs, declared once: what every endpoint does, wherever its actors live.

Three kinds of endpoint exist, one per place an actor mesh can be held: the controller's actor meshes
(`runtime/actors/__init__.py`, `ActorEndpoint`), the references actors hold (`runtime/worker/actor_ref.py`,
`RefEndpoint`) and `this_proc()` actors (`runtime/actors/local.py`, `LocalEndpoint`). Each subclasses `Adverbs`
and provides two primitives, `_call(points, args, kwargs)` (a call answered by the actors at those points: a
future of their `ValueMesh`) and `_post(points, args, kwargs, port)` (a message answered by nobody, or through
`port`); `Adverbs` builds every adverb from them, so they mean the same everywhere:

- `call(...)`: every actor; a future of their `ValueMesh`.
- `call_one(...)`: the one actor of a mesh of one point; a future of its value.
- `choose(...)`: one actor (the one with the fewest calls in flight); a future of its value.
- `stream(...)`: every actor; yields each one's future as it is answered.
- `broadcast(...)`: every actor, no answer (a failure goes to the actor mesh's owner).
- `send(endpoint, args, kwargs, port=, selection=)`: broadcast (``"all"``) or to one actor (``"choose"``), each
  answer to `port`.
- `rref(...)`: a tensor-engine result (see `Endpoint.rref`).
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Generic, Literal, ParamSpec, Protocol, TypeVar

from monarch.runtime.common import actors as shared
from monarch.runtime.common.shape import Shape

if TYPE_CHECKING:
    from monarch.runtime.common.ports import Port

P = ParamSpec("P")
R = TypeVar("R")
A = TypeVar("A")

Selection = Literal["all", "choose"]


class AnyFuture(Protocol[R]):
    """What the adverbs return: `get(timeout=)` (alias `result`), `await`, `done()`."""

    def get(self, timeout: float | None = None) -> R: ...

    def done(self) -> bool: ...

    def add_done_callback(self, fn: Callable[[Any], None]) -> None: ...


class Endpoint(Protocol[P, R]):
    """An endpoint of an actor mesh, as every kind here has it (Monarch's `Endpoint` protocol)."""

    def call(self, *args: P.args, **kwargs: P.kwargs) -> AnyFuture[Any]: ...

    def call_one(self, *args: P.args, **kwargs: P.kwargs) -> AnyFuture[R]: ...

    def choose(self, *args: P.args, **kwargs: P.kwargs) -> AnyFuture[R]: ...

    def stream(self, *args: P.args, **kwargs: P.kwargs) -> Iterator[AnyFuture[R]]: ...

    def broadcast(self, *args: P.args, **kwargs: P.kwargs) -> None: ...

    def rref(self, *args: P.args, **kwargs: P.kwargs) -> R: ...

    def _send(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], port: Port[R] | None = None, selection: Selection = "all"
    ) -> None: ...


class One(Generic[R]):
    """The future of one actor's answer (`call_one`, `choose`, `stream`'s items): `get()` gives the value, not
    a `ValueMesh`."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def done(self) -> bool:
        return bool(self._inner.done())

    def get(self, timeout: float | None = None) -> R:
        (value,) = self._inner.get(timeout).values()
        return value  # type: ignore[no-any-return]

    result = get

    def exception(self, timeout: float | None = None) -> BaseException | None:
        from monarch.runtime.common.ports import exception_of

        return exception_of(self, timeout)

    def add_done_callback(self, fn: Callable[[One[R]], None]) -> None:
        self._inner.add_done_callback(lambda _: fn(self))

    def __await__(self) -> Any:
        return self._await().__await__()

    async def _await(self) -> R:
        (value,) = (await self._inner).values()
        return value  # type: ignore[no-any-return]


class Adverbs(Generic[P, R]):
    """The adverbs of one endpoint (see the module); a subclass provides `_shape` (the actor mesh view it
    addresses), `_what` (``actors.endpoint``, for messages), `_call` and `_post`."""

    _name: str

    @property
    def _shape(self) -> Shape:
        raise NotImplementedError

    @property
    def _what(self) -> str:
        raise NotImplementedError

    def _call(self, points: list[int] | None, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """A call to the actors at `points` (indices into `_shape`; None: all of them); a future of their
        `ValueMesh` over the view they make."""
        raise NotImplementedError

    def _post(
        self, points: list[int] | None, args: tuple[Any, ...], kwargs: dict[str, Any], port: Port[Any] | None
    ) -> None:
        """A message to the actors at `points` that nobody waits for; each one's answer to `port` if given."""
        raise NotImplementedError

    def _live(self) -> list[int]:
        """The points whose actors can be called (all, unless some of their processes died)."""
        return list(range(len(self._shape)))

    # -- the adverbs ---------------------------------------------------------------------------------
    def call(self, *args: P.args, **kwargs: P.kwargs) -> Any:
        """Call every actor of the mesh; a future (`.get()`, or `await`) of their `ValueMesh`."""
        return self._call(None, args, kwargs)

    def call_one(self, *args: P.args, **kwargs: P.kwargs) -> One[R]:
        """Call the one actor of a mesh of size 1 (a slice to one point); a future of its value."""
        n = len(self._shape)
        if n != 1:
            raise ValueError(
                f"call_one() needs exactly one actor; {self._what} here is on {self._shape.describe()} ({n} actors): "
                "slice it to one point first, e.g. .slice(**point), or use call()"
            )
        return One(self._call(None, args, kwargs))

    def choose(self, *args: P.args, **kwargs: P.kwargs) -> One[R]:
        """Call one actor of the mesh, the one with the fewest `choose` calls in flight; a future of its value."""
        point = self._take_point()
        future = self._call([point], args, kwargs)
        future.add_done_callback(lambda _: self._put_point(point))
        return One(future)

    def stream(self, *args: P.args, **kwargs: P.kwargs) -> Iterator[One[R]]:
        """Call every actor; yield each one's future as it is answered (`.get()` it: a failure raises there)."""
        return Stream([One(self._call([i], args, kwargs)) for i in range(len(self._shape))])

    def broadcast(self, *args: P.args, **kwargs: P.kwargs) -> None:
        """Send to every actor without waiting; a failure goes to the actor mesh's owner (its `__supervise__`,
        else `unhandled_fault_hook`), never raised here."""
        self._post(None, args, kwargs, None)

    def _send(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], port: Port[R] | None = None, selection: Selection = "all"
    ) -> None:
        """Monarch's `send()`: to every actor (``"all"``) or one (``"choose"``), each answer to `port`."""
        if selection not in ("all", "choose"):
            raise ValueError(f"send(..., selection={selection!r}): the selections are 'all' and 'choose'")
        if not isinstance(args, tuple) or not isinstance(kwargs, dict):
            raise TypeError(
                f"send({self._what}, args, kwargs): args must be a tuple and kwargs a dict, got "
                f"{type(args).__name__} and {type(kwargs).__name__}"
            )
        if selection == "all":
            self._post(None, args, kwargs, port)
            return
        point = self._take_point()
        try:
            self._post([point], args, kwargs, port)
        finally:
            self._put_point(point)

    def rref(self, *args: P.args, **kwargs: P.kwargs) -> R:
        """Monarch's tensor-engine adverb (an endpoint's result as a distributed tensor)."""
        raise NotImplementedError(
            f"{self._what}.rref(): an actor's result as a distributed tensor is not supported here; call the "
            "endpoint (call() / call_one()) and pass tensors to it and from it as values, or use the tensor engine "
            "(`with mesh.activate():`) and live functions for distributed tensors"
        )

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(
            f"call an endpoint with an adverb: {self._name}.call(...).get(), .call_one(...), .broadcast(...), "
            ".choose(...) or .stream(...)"
        )

    # -- choose's bookkeeping ------------------------------------------------------------------------
    def _in_flight(self) -> tuple[threading.Lock, dict[int, int]]:
        """The lock and the per-point count of `choose` calls in flight, shared by every endpoint of the mesh."""
        raise NotImplementedError

    def _take_point(self) -> int:
        lock, counts = self._in_flight()
        with lock:
            point = min(self._live(), key=lambda i: (counts.get(i, 0), i))
            counts[point] = counts.get(point, 0) + 1
        return point

    def _put_point(self, point: int) -> None:
        lock, counts = self._in_flight()
        with lock:
            counts[point] -= 1


class Stream(Iterator[One[R]]):
    """`stream()`'s answers: iterating yields each actor's future as it is answered (waiting between them);
    `futures` are all of them, in point order."""

    def __init__(self, futures: list[One[R]]) -> None:
        self.futures = futures
        self._answered: collections.deque[One[R]] = collections.deque()
        """Futures answered and not yet yielded, in the order they were (appended by their done callbacks)."""
        self._arrival = threading.Event()
        self._left = len(futures)
        for f in futures:
            f.add_done_callback(self._arrived)

    def _arrived(self, f: One[R]) -> None:
        self._answered.append(f)
        self._arrival.set()

    def __next__(self) -> One[R]:
        if not self._left:
            raise StopIteration
        answered = self._answered
        if not answered:
            from monarch.runtime.common import ports  # (a worker's main thread serves its messages meanwhile)

            if ports.ROUTER is not None:
                ports.ROUTER.block(lambda: bool(answered), None)
            while not answered:  # (cleared after each wake, then looked at again: no arrival is missed)
                self._arrival.wait()
                self._arrival.clear()
        self._left -= 1
        return answered.popleft()


class Accumulator(Generic[P, R, A]):
    """Fold the answers of every actor of an endpoint into one value:
    ``Accumulator(counters.value, 0, lambda acc, x: acc + x).accumulate().get()``."""

    def __init__(self, endpoint: Endpoint[P, R], identity: A, combine: Callable[[A, R], A]) -> None:
        self._endpoint = endpoint
        self._identity = identity
        self._combine = combine

    def accumulate(self, *args: P.args, **kwargs: P.kwargs) -> Folded[A]:
        """Call the endpoint on every actor; a future of ``combine(...combine(identity, v0)..., vn)``, the values
        in the order they came (`get()`), or in point order (`await`)."""
        stream = self._endpoint.stream(*args, **kwargs)
        assert isinstance(stream, Stream)
        return Folded(stream, self._identity, self._combine)


class Folded(Generic[A]):
    """`Accumulator.accumulate`'s future: `get()` or `await`."""

    def __init__(self, stream: Stream[Any], identity: A, combine: Callable[[A, Any], A]) -> None:
        self._stream, self._value, self._combine = stream, identity, combine
        self._done = False

    def done(self) -> bool:
        return self._done

    def get(self, timeout: float | None = None) -> A:
        if not self._done:
            for future in self._stream:
                self._value = self._combine(self._value, future.get(timeout))
            self._done = True
        return self._value

    result = get

    def __await__(self) -> Any:
        return self._await().__await__()

    async def _await(self) -> A:
        if not self._done:
            for future in self._stream.futures:
                self._value = self._combine(self._value, await future)
            self._done = True
        return self._value


class MethodAndEndpoint:
    """An endpoint whose name is also a method of the actor mesh (an actor with an endpoint named `stop`, as
    Monarch's grpo_actor.py has, or `describe`): calling it calls the mesh's method (``actors.stop()``); its
    adverbs are the endpoint's (``actors.stop.call_one()``)."""

    def __init__(self, method: Callable[..., Any], endpoint: Any) -> None:
        self._method, self._endpoint = method, endpoint

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._method(*args, **kwargs)

    def __getattr__(self, attr: str) -> Any:
        return getattr(self.__dict__["_endpoint"], attr)


def expose_endpoints(mesh: Any, endpoints: list[str]) -> None:
    """Make `mesh.<name>` reach the endpoint `name` where the mesh's class has a method of that name too."""
    for name in endpoints:
        method = getattr(type(mesh), name, None)
        if callable(method) and not isinstance(method, property):
            mesh.__dict__[name] = MethodAndEndpoint(getattr(mesh, name), mesh._endpoint(name))


class NotAnEndpoint:
    """A method of an actor mesh's class that is not marked `@endpoint`: calling it says so;
    `as_endpoint(actors.method)` calls it as one."""

    def __init__(self, mesh: Any, name: str, cls_name: str) -> None:
        self._mesh, self._name, self._cls_name = mesh, name, cls_name

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError(
            f"Actor {self._cls_name}.{self._name} is not annotated as an endpoint. To call it as one, add a "
            f"@endpoint decorator to it, or directly wrap it in one as_endpoint(obj.method).call(...)"
        )


def as_endpoint(not_an_endpoint: Any, *, propagate: Any = None, explicit_response_port: bool = False) -> Any:
    """Call a method that is not marked `@endpoint` through the adverbs: ``as_endpoint(actors.method).call()``."""
    if not isinstance(not_an_endpoint, NotAnEndpoint):
        raise ValueError(
            f"as_endpoint() takes a method of a spawned actor mesh that is not an endpoint (actors.method), got "
            f"{not_an_endpoint!r}"
        )
    prefix = shared.LOOSE_PORTED if explicit_response_port else shared.LOOSE
    return not_an_endpoint._mesh._endpoint(prefix + not_an_endpoint._name)


def send(
    endpoint: Endpoint[P, R],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    port: Port[R] | None = None,
    selection: Selection = "all",
) -> None:
    """Fire and forget: call `endpoint` on every actor of its mesh (``selection="all"``) or on one
    (``"choose"``), not waiting; each actor's answer goes to `port` if given (a ranked receiver sees each
    actor's rank), an exception too (the receiver's `recv()` raises it)."""
    sender = getattr(endpoint, "_send", None)
    if sender is None:
        raise TypeError(f"send() takes an actor endpoint (actors.method), got {endpoint!r}")
    sender(args, kwargs, port, selection)
