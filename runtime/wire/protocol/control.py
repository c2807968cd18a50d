"""Control requests: what a signal to a worker is about, whatever its main thread is doing.

A control request is written into the mesh's slot file and signalled with SIGUSR1 (or, on another host,
sent to the agent as `SignalWorkers`); `Control.INTERRUPT` is SIGINT for one call.
"""

from __future__ import annotations

from enum import IntEnum

from monarch.runtime.wire.protocol.base import message

SLOT = 32
"""Bytes per rank in a mesh's slot file: int64 the call a SIGINT is for, then a control request sent with
SIGUSR1: int64 sequence number, int64 call id, int64 kind."""


class Control(IntEnum):
    """The kind of a control request (the slot file's last field; `SignalWorkers.kind`)."""

    INTERRUPT = 0
    """SIGINT for call `call_id` (only `SignalWorkers` carries it; the slot file's first field holds the call)."""
    RELEASE = 1
    """If you wait in a collective (this call failed on another rank), be released from it."""
    REPORT = 2
    """Say what you are doing (`Busy`)."""
    DISCONNECT = 3
    """This call failed on you (or ended here) while others wait in a collective: shut your process groups'
    connections, so that peers on other hosts waiting on you are released too. Its call id field holds the
    groups' generation it is for (a late request must not break re-formed groups)."""
    STACKS = 4
    """Send your threads' stacks (`Stacks`); its call id field holds the request's number."""


@message(49)
class Stacks:
    """Worker -> controller: its threads' stacks (asked for with `STACKS`), main thread first; an empty
    main-thread stack means it is idle."""

    token: int
    """The request's number (in the control request's call id field)."""
    threads: list[tuple[str, list[tuple[str, str]]]]
    """(thread name, [(where, source line), ...] outermost first) per thread."""
