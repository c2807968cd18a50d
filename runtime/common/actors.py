"""Actors, the part both sides share: the `Actor` base class, the `@endpoint` mark and `context()`.

An actor is an object living in each worker process of a mesh: `procs.spawn("trainer", Trainer, cfg)` makes
one per process (the controller side is `monarch.runtime.actors`, the worker side `monarch.runtime.worker.actors`),
and its `@endpoint` methods are what the controller calls. A user's actor class subclasses `Actor` here, so that
unpickling it on a worker imports nothing of the controller's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

ENDPOINT = "__monarch_endpoint__"
"""The attribute `@endpoint` sets on a method."""

F = TypeVar("F", bound=Callable[..., Any])


class Actor:
    """Base class of actors. Subclass it, mark the methods callers may call with `@endpoint`, and spawn it on
    a mesh: `procs.spawn("name", MyActor, *args)` constructs one instance per process, with those arguments."""


def endpoint(fn: F | None = None, **options: Any) -> Any:
    """Mark an actor's method as callable from outside (`actors.method.call(...)`); `async def` methods run
    on the actor's event loop. Used bare (`@endpoint`) or with Monarch's options (`@endpoint(propagate=...)`,
    accepted and ignored)."""

    def mark(f: F) -> F:
        if not callable(f):
            raise TypeError(f"@endpoint marks a method, got {f!r}")
        setattr(f, ENDPOINT, True)
        return f

    return mark(fn) if fn is not None else mark


def endpoints_of(cls: type) -> list[str]:
    """The names of `cls`'s endpoints, sorted."""
    return sorted(name for name in dir(cls) if getattr(getattr(cls, name, None), ENDPOINT, False))


@dataclass
class ActorInstance:
    """The actor an endpoint runs in."""

    name: str
    """The name it was spawned under."""
    rank: dict[str, int] = field(default_factory=dict)
    """Its coordinates in its actor mesh."""


@dataclass
class Context:
    """What an endpoint knows about the message it serves (`context()`)."""

    actor_instance: ActorInstance
    message_rank: dict[str, int] = field(default_factory=dict)
    """This actor's coordinates in the mesh (or slice) the message was sent to."""


current: Context | None = None
"""The running endpoint's context (set by the worker while it runs one)."""


def context() -> Context:
    """Inside an endpoint or an actor's constructor: which actor this is and where the message went."""
    if current is None:
        raise RuntimeError("context() is for code running in an actor (an endpoint or its constructor)")
    return current
