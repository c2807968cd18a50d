"""A worker's output and input: what it prints (`Output`), shows (`Display`), and asks for (`AskInput`),
and the answer the controller sends down (`StdinReply`)."""

from __future__ import annotations

from typing import Any

from monarch.runtime.wire.protocol.base import message


@message(9)
class Output:
    """Text a worker wrote to stdout or stderr (Python or C level)."""

    call_id: int | None
    """The call it was written during; None between calls."""
    stream: str
    text: str


@message(10)
class Display:
    """A rich display made on a worker (`display(...)`, a matplotlib figure)."""

    call_id: int | None
    data: dict[str, Any]
    metadata: dict[str, Any]


@message(13)
class AskInput:
    """A worker waits for a line of input (`input()`, `sys.stdin`, or its pdb prompt)."""

    call_id: int | None
    req_id: int
    prompt: str
    password: bool
    debugger: bool
    where: str
    """For pdb: where it stopped (``script.py:12``); else ""."""


@message(3)
class StdinReply:
    """The answer to a worker's `AskInput`."""

    req_id: int
    ok: bool
    text: str
    """The line typed; or, when not `ok`, why there is none (``"interrupted"`` for Ctrl-C)."""
