"""Streams and borrows on the controller: which stream may use which tensor, and when.

Commands on one stream run in order; different streams run concurrently on each worker (threads on
CPU). A tensor belongs to the stream that made it. `stream.borrow(t)` lends it to another stream:
the borrowing stream waits for the ops that made `t`; with `mutable=True` the origin stream may not
touch `t` until `borrow.drop()`, which makes the origin wait for the borrower's ops. Misuse is a
`TypeError` raised on the controller, before anything runs.
"""

from __future__ import annotations

import contextlib
import contextvars
import itertools
import weakref
from collections.abc import Iterator
from typing import Any

_ids = itertools.count(1)
_borrow_ids = itertools.count(1)


class Stream:
    """A named sequence of commands on each worker; `monarch.Stream("comms")`."""

    def __init__(self, name: str, *, _id: int | None = None) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"Stream(name): name must be a non-empty string, got {name!r}")
        self.name = name
        self.id = next(_ids) if _id is None else _id
        _names[self.id] = name

    @contextlib.contextmanager
    def activate(self) -> Iterator[Stream]:
        """Ops issued inside run on this stream."""
        token = _active.set(self)
        try:
            yield self
        finally:
            _active.reset(token)

    def borrow(self, t: Any, mutable: bool = False) -> tuple[Any, Borrow]:
        """Lend tensor `t` (made on another stream) to this stream: returns `(t_on_this_stream, borrow)`."""
        lend = getattr(type(t), "_lend", None)  # (a monarch.Tensor lends itself: `handles.borrow`)
        if lend is None:
            raise TypeError(f"borrow: needs a monarch.Tensor (made inside mesh.activate()), got {type(t).__name__}")
        return lend(t, self, mutable)

    def __repr__(self) -> str:
        return f"Stream({self.name!r})"


_names: dict[int, str] = {}
"""Stream id -> name, of every stream made (a few strings; kept after a stream is gone, whose commands a
simulator's trace still shows)."""


def stream_names() -> dict[int, str]:
    """Stream id -> name (the simulator's trace names its tracks with them)."""
    return dict(_names)


MAIN = Stream("main", _id=0)
_active: contextvars.ContextVar[Stream] = contextvars.ContextVar("monarch_stream", default=MAIN)


def get_active_stream() -> Stream:
    """The stream ops are issued on now (the main stream unless inside `stream.activate()`)."""
    return _active.get()


class Borrow:
    """One tensor lent from its stream to another, until `drop()`."""

    def __init__(self, origin: Any, to: Stream, mutable: bool, where: str) -> None:
        self.id = next(_borrow_ids)
        self.origin = weakref.ref(origin)
        self.from_stream: Stream = origin._stream
        self.to_stream = to
        self.mutable = mutable
        self.where = where
        self.dropped_at: str | None = None
        self.alias_ref: int = -1
        self._drop = None  # set by the tensor engine: sends the drop command

    @property
    def dropped(self) -> bool:
        return self.dropped_at is not None

    def drop(self) -> None:
        """End the borrow: the origin stream may use the tensor again, after the borrower's ops."""
        if self.dropped:
            return
        assert self._drop is not None
        self._drop(self)

    def describe(self) -> str:
        kind = "mutably" if self.mutable else "immutably"
        return f"{kind} borrowed by stream {self.to_stream.name!r} at {self.where}"
