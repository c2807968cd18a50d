"""What controller and workers say to each other: one dataclass per message and per tensor command.

Messages travel as the header of a signed envelope (see `wire/controller_end.py`); a message's bulky
payload (a function's arguments, a result, a batch of tensor commands) travels as its body, pickled
apart with large buffers out of band. Who sent a message (mesh and rank) is part of the envelope, not of
the message. Receivers dispatch on the message's type through a handler table, never by position.

On the wire a message is the tuple ``(tag, *fields)`` (`pack` / `unpack`): pickling a tuple costs a
fraction of pickling an instance, and ops are sent tens of thousands of times a second. Nothing here
imports torch, zmq or the rest of the runtime.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, fields
from operator import attrgetter
from typing import Any, TypeVar

T = TypeVar("T")

if sys.version_info >= (3, 11):
    from typing import dataclass_transform
else:  # Python 3.10: no-op (the decorator only tells type checkers that `message` makes dataclasses)

    def dataclass_transform(**kwargs: Any) -> Callable[[T], T]:
        return lambda f: f


_TYPES: list[type[Any] | None] = []
"""Every message type, by its tag (the index): the wire carries ``(tag, *fields)``."""
_NAMES: list[tuple[str, ...] | None] = []
"""The field names of each, by tag (what `unpack` sets)."""


@dataclass_transform()
def message(tag: int) -> Callable[[type[T]], type[T]]:
    """Register a message: a slotted dataclass whose wire tag is `tag`, written out so that adding or moving a
    message never renumbers the others (`tests/test_wire_tags.py` pins every tag)."""

    def register(cls: type[T]) -> type[T]:
        taken = _TYPES[tag] if tag < len(_TYPES) else None
        if taken is not None:
            raise AssertionError(f"wire tag {tag} of {cls.__name__} is taken by {taken.__name__}")
        cls = dataclass(slots=True)(cls)
        _register(cls, tag)
        return cls

    return register


def _register(cls: type[Any], tag: int) -> None:
    names = tuple(f.name for f in fields(cls))
    cls._tag = tag
    values: Callable[..., tuple[Any, ...]] = (
        attrgetter(*names) if len(names) > 1 else lambda m, n=names: tuple(getattr(m, x) for x in n)
    )
    cls._values = staticmethod(values)
    cls._arity = len(names)
    _TYPES.extend([None] * (tag + 1 - len(_TYPES)))
    _NAMES.extend([None] * (tag + 1 - len(_NAMES)))
    _TYPES[tag] = cls
    _NAMES[tag] = names


def types() -> dict[int, type[Any]]:
    """Every registered message type by its wire tag."""
    return {tag: cls for tag, cls in enumerate(_TYPES) if cls is not None}


def pack(msg: Any) -> tuple[Any, ...]:
    """`msg` as the tuple that travels: ``(tag, *fields)`` (tuples pickle ~20x faster than instances)."""
    return (msg._tag, *msg._values(msg))


def py_unpack(t: Any) -> Any:
    """The message a `pack` tuple stands for; ValueError for anything else."""
    if type(t) is not tuple or not t or type(t[0]) is not int or not 0 <= t[0] < len(_TYPES):
        raise ValueError(f"not a message: {type(t).__name__}")
    cls = _TYPES[t[0]]
    if cls is None:
        raise ValueError(f"not a message: no message has tag {t[0]}")
    if len(t) != cls._arity + 1:
        raise ValueError(f"{cls.__name__} has {cls._arity} fields, got {len(t) - 1}")
    return cls(*t[1:])


unpack: Callable[[Any], Any] = py_unpack
"""The message a `pack` tuple stands for; ValueError for anything else (compiled where `_fastwire` was built:
each message is made without running its dataclass `__init__`, which sets only its fields)."""
try:
    from monarch.runtime.wire import _fastwire

    unpack = _fastwire.unpacker(_TYPES, _NAMES)
except ImportError:
    pass
