"""Actors calling actors: worker -> worker, straight to the receiving worker's inbox (`wire/actor_end.py`),
never through the controller. A message (`ActorSend`) runs one endpoint; a call is answered (`ActorAnswer`)
on the same connection. And the controller's `broadcast()`: `Cast` down the command connection, answered only
when it fails (`CastFailed`, up the reply connection). A message to a port (`PortSend`, `common/ports.py`)
takes whichever of these ways leads to the port's process."""

from __future__ import annotations

from monarch.runtime.wire.protocol.base import message

__all__ = ["ActorAnswer", "ActorSend", "Cast", "CastFailed", "PortSend"]


@message(51)
class ActorSend:
    """Run endpoint `endpoint` of the receiver's actor `actor`; the body holds ``(args, kwargs)``."""

    call_id: int
    """The sender's number for the answer; 0: none wanted (a broadcast)."""
    actor: str
    endpoint: str
    names: tuple[str, ...]
    """The dimension names of the actor mesh view the message was sent to (`context().message_rank`)."""
    sizes: tuple[int, ...]
    ranks: tuple[int, ...]
    """The view's ranks in the receivers' mesh, row-major."""
    origin: int | None
    """The controller's call the sender was serving (the receiver's output goes to that call's areas)."""


@message(52)
class ActorAnswer:
    """An `ActorSend`'s result (`ok`) or its `ErrorInfo`; the body holds it."""

    call_id: int
    ok: bool


@message(53)
class Cast:
    """Controller -> workers: `broadcast()`s to actors, answering nothing; the body holds a list of
    ``(actor, endpoint, names, sizes, ranks, arguments)``, run in order: `names`, `sizes` and `ranks` are the
    actor mesh view each was sent to (`context().message_rank`), `arguments` the pickled ``(args, kwargs)``
    (`codec.dumps_whole`). It rides the command connection, in order with the calls."""


@message(54)
class CastFailed:
    """Worker -> controller: a `Cast` raised; the body holds its `ErrorInfo` (the controller hands it to the
    actor mesh's owner: `__supervise__`, else `unhandled_fault_hook`)."""

    actor: str
    endpoint: str


@message(55)
class PortSend:
    """A message to port `port_id` of the receiving process (`common/ports.py`): a value (`ok`) or an exception
    (the receiver's `recv()` raises it), pickled in the body. To a worker through its inbox (from workers and
    the controller alike: a worker busy in a call still serves its inbox); to the controller up the sender's
    reply connection."""

    port_id: int
    rank: int
    """The sender's rank, for a ranked receiver (`ports.UNRANKED` when its port had none)."""
    ok: bool
