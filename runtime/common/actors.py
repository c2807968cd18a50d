"""Actors, the part both sides share: the `Actor` base class, the `@endpoint` mark and `context()`.

An actor is an object living in each worker process of a mesh: `procs.spawn("trainer", Trainer, cfg)` makes
one per process (the controller side is `monarch.runtime.actors`, the worker side `monarch.runtime.worker.actors`),
and its `@endpoint` methods are what the controller calls. A user's actor class subclasses `Actor` here, so that
unpickling it on a worker imports nothing of the controller's.
"""

from __future__ import annotations

import contextvars
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from traceback import TracebackException
from typing import Any, TypeVar

from monarch.runtime.common.mesh_trait import Extent, MeshTrait, Point
from monarch.runtime.common.shape import Shape

ENDPOINT = "__monarch_endpoint__"
"""The attribute `@endpoint` sets on a method (its `EndpointOptions`)."""

F = TypeVar("F", bound=Callable[..., Any])


@dataclass(frozen=True)
class EndpointOptions:
    """How an endpoint is called (what `@endpoint(...)` / `@concurrent_endpoint` said)."""

    explicit_response_port: bool = False
    """The method takes its caller's response `Port` as its first argument and answers through it."""
    concurrent: bool = False
    """An `async def` run as a task on the actor's event loop: the actor takes its next message at once."""
    propagate: Any = None
    """Monarch's tensor-engine shape propagation for `rref` (kept, not used: see docs/features/actors.md)."""

    def __bool__(self) -> bool:
        return True


PLAIN = EndpointOptions()
LOOSE = "~"
"""Prefix of an endpoint name that `as_endpoint` made of a method not marked `@endpoint`."""
LOOSE_PORTED = "~^"
"""The same, with `explicit_response_port=True`."""


class Actor:
    """Base class of actors. Subclass it, mark the methods callers may call with `@endpoint`, and spawn it on
    a mesh: `procs.spawn("name", MyActor, *args)` constructs one instance per process, with those arguments.

    Optional special methods: `__supervise__(failure)` (a mesh this actor spawned failed: return True if
    handled) and `__cleanup__(exc)` (the actor stops: `actors.stop()`, or its processes stopping; may be
    `async def`)."""


def endpoint(
    method: F | None = None,
    *,
    propagate: Any = None,
    explicit_response_port: bool = False,
    instrument: bool = True,
) -> Any:
    """Mark an actor's method as callable from outside (`actors.method.call(...)`), bare (`@endpoint`) or with
    Monarch's options: `explicit_response_port=True` gives the method its caller's response `Port` as first
    argument (it answers with `port.send(value)`, now or later, from anywhere); `propagate` and `instrument`
    are accepted. `async def` endpoints run on the actor process's event loop, one message at a time (use
    `concurrent_endpoint` for ones that may overlap)."""
    options = EndpointOptions(explicit_response_port, False, propagate)

    def mark(f: F) -> F:
        if not callable(f):
            raise TypeError(f"@endpoint marks a method, got {f!r}")
        setattr(f, ENDPOINT, options)
        return f

    return mark(method) if method is not None else mark


def concurrent_endpoint(
    method: F | None = None,
    *,
    propagate: Any = None,
    explicit_response_port: bool = False,
    instrument: bool = True,
) -> Any:
    """Mark an `async def` method as an endpoint whose calls run as tasks on the actor's event loop: the actor
    takes its next message at once, so one call may wait (an `asyncio.Event`, a queue) for what another call
    delivers. Calls start in the order sent (each runs to its first `await` before the next starts); an
    exception goes to the caller. Tasks still running when the actor stops are cancelled before
    `__cleanup__`."""
    options = EndpointOptions(explicit_response_port, True, propagate)

    def mark(f: F) -> F:
        if not inspect.iscoroutinefunction(f):
            raise ValueError(f"concurrent_endpoint can only wrap async endpoints; {f!r} is not `async def`")
        setattr(f, ENDPOINT, options)
        return f

    return mark(method) if method is not None else mark


def options_of(method: Any) -> EndpointOptions | None:
    """The endpoint options of a method, or None when it is not an endpoint."""
    got = getattr(method, ENDPOINT, None)
    return got if isinstance(got, EndpointOptions) else (PLAIN if got else None)


def endpoints_of(cls: type) -> list[str]:
    """The names of `cls`'s endpoints, sorted."""
    return sorted(name for name in dir(cls) if options_of(getattr(cls, name, None)) is not None)


def methods_of(cls: type) -> list[str]:
    """The names of `cls`'s public methods that are not endpoints (what `as_endpoint` can call)."""
    out = []
    for name in dir(cls):
        if name.startswith("_"):
            continue
        value = getattr(cls, name, None)
        if callable(value) and options_of(value) is None and not isinstance(value, type):
            out.append(name)
    return out


@dataclass
class ActorInstance:
    """The actor an endpoint runs in (`context().actor_instance`)."""

    name: str
    """The name it was spawned under."""
    rank: Point = field(default_factory=lambda: Point(0, Extent()))
    """Its place in its actor mesh (a `Point`: ``rank["gpu"]``, ``rank.rank``)."""
    proc_id: str = ""
    """Its process, as text (``mesh 1 rank 3 (gpu=3) pid 4242``)."""

    @property
    def actor_id(self) -> str:
        """This actor, as text: ``name[rank] on <process>``."""
        return f"{self.name}[{self.rank.rank}] on {self.proc_id or 'this process'}"

    @property
    def proc_mesh(self) -> OwnProcess:
        """The process this actor runs in, as a mesh: its `activate()` runs the tensor engine's ops here, on this
        process's own tensors (Monarch's actors drive their process's tensor engine this way)."""
        return OwnProcess(self)

    proc = proc_mesh


class OwnProcess(MeshTrait):
    """An actor's own process as a proc mesh (`context().actor_instance.proc_mesh`). `activate()` makes torch
    ops inside run here, on this process's device, and their results are this process's tensors
    (`monarch.fetch_shard` of one is a done future): the tensor engine of a mesh of one process, run by that
    process. An actor of a mesh of several processes reaching for all of them from inside is refused: meshes are
    driven from the controller here (give it the mesh's tensors as endpoint arguments, or use `rref`)."""

    def __init__(self, instance: ActorInstance) -> None:
        self._instance = instance
        self._shape = Shape((), (), (0,))

    def _new_with_shape(self, shape: Shape) -> OwnProcess:
        return self

    def activate(self) -> Any:
        import contextlib

        if self._instance.rank.extent.nelements > 1:
            raise NotImplementedError(
                f"context().actor_instance.proc_mesh.activate() in actor {self._instance.name!r}, one of "
                f"{self._instance.rank.extent.nelements}: each actor would drive every process of its mesh. Here an "
                "actor's tensor engine is its own process's (a mesh of one process); drive a mesh of several from "
                "the controller (`with procs.activate():`, `endpoint.rref(...)`)"
            )
        return contextlib.nullcontext(self)


class Context:
    """What an endpoint knows about the message it serves (`context()`).

    `message_rank` is made when first read, from `view` (the call's `CallView`: its `coords` and `sizes`) where
    none is given: most endpoints never read it, and a worker serving a call to every actor of a large mesh
    runs each step cold (every process woken once per message)."""

    __slots__ = ("actor_instance", "_message_rank", "_view")

    def __init__(self, actor_instance: ActorInstance, message_rank: Point | None = None, view: Any = None) -> None:
        self.actor_instance = actor_instance
        self._message_rank = message_rank
        self._view = view

    @property
    def message_rank(self) -> Point:
        """This actor's place in the mesh (or slice) the message was sent to, as `current_rank()` gives it."""
        rank = self._message_rank
        if rank is None:
            view = self._view
            rank = self._message_rank = Point(0, Extent()) if view is None else Point.of(view.coords, view.sizes)
        return rank

    def __repr__(self) -> str:
        return f"Context(actor_instance={self.actor_instance!r}, message_rank={self.message_rank!r})"


CLIENT = Context(ActorInstance("client", proc_id="the controller"))
"""The context outside any actor: the client (a script or notebook), as Monarch's root client context."""

_current: contextvars.ContextVar[Context | None] = contextvars.ContextVar("monarch_actor_context", default=None)
"""The running endpoint's context (a context variable: an endpoint's asyncio tasks keep theirs)."""


def enter(ctx: Context) -> contextvars.Token[Context | None]:
    """Make `ctx` the current context (until `leave(token)`)."""
    return _current.set(ctx)


def leave(token: contextvars.Token[Context | None]) -> None:
    _current.reset(token)


def current() -> Context | None:
    """The running endpoint's context, or None outside one."""
    return _current.get()


def context() -> Context:
    """Inside an endpoint or an actor's constructor: which actor this is (`actor_instance`: its `name`, its
    `rank` in its mesh) and where the message went (`message_rank`). Elsewhere, the client's context."""
    got = _current.get()
    return got if got is not None else CLIENT


def current_actor_name() -> str:
    """The running actor, as text (``name[rank] on <process>``); ``client...`` outside an actor."""
    return str(context().actor_instance.actor_id)


class ActorError(Exception):
    """An actor's call failed: `exception` is what was raised; the message carries where (Monarch's error type
    for a failed endpoint; monarch's own calls raise `monarch.RemoteError`, naming each rank)."""

    def __init__(self, exception: BaseException, message: str = "A remote actor call has failed.") -> None:
        self.exception = exception
        self.message = message
        lines = TracebackException.from_exception(exception).format()
        self.exception_formatted = "".join(lines).replace(
            "Traceback (most recent call last):", "Traceback of where the remote call failed (most recent call last):"
        )
        super().__init__(message)

    def __str__(self) -> str:
        return f"{self.message}\n {self.exception_formatted}"

    def __reduce__(self) -> tuple[Any, ...]:
        return _rebuild_actor_error, (self.exception_formatted, self.message)


def _rebuild_actor_error(formatted: str, message: str) -> ActorError:
    error = ActorError.__new__(ActorError)
    Exception.__init__(error, message)
    error.exception, error.message, error.exception_formatted = RuntimeError(formatted), message, formatted
    return error
