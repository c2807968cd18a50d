"""An exception raised on a worker, as the controller shows it (`ErrorInfo`): the worker's own frames left out."""

from __future__ import annotations

import os
import traceback

from monarch.runtime.common.errors import RemoteError
from monarch.runtime.wire import protocol

_HERE = os.path.dirname(__file__)
_PLUMBING = {
    os.path.join(_HERE, f) for f in ("worker.py", "cells.py", "stdin.py", "actors.py", "actor_ref.py", "describe.py")
}
"""Our frames at the top of a worker traceback; left out so the user's code comes first."""


def describe(e: BaseException, prefix: str = "") -> protocol.ErrorInfo:
    """`e` as the controller shows it, our own frames (worker plumbing) left out."""
    if type(e).__name__ == "PoisonedValueError":  # its message holds the traceback that matters
        return protocol.ErrorInfo(type(e).__qualname__, prefix + str(e), "")
    te = traceback.TracebackException.from_exception(e)
    for t in (te, *_chained(te)):
        t.stack = traceback.StackSummary.from_list([f for f in t.stack if f.filename not in _PLUMBING])
    return protocol.ErrorInfo(type(e).__qualname__, prefix + message(e), "".join(te.format()))


def message(e: BaseException) -> str:
    """What a failure's header line says of `e`: for a failed call to other actors only its first line (the
    traceback's last line holds their ranks' errors, shown once)."""
    return e.headline() if isinstance(e, RemoteError) else str(e)


def _chained(te: traceback.TracebackException) -> list[traceback.TracebackException]:
    out, seen = [], set()
    todo = [te.__cause__, te.__context__]
    while todo:
        t = todo.pop()
        if t is None or id(t) in seen:
            continue
        seen.add(id(t))
        out.append(t)
        todo += [t.__cause__, t.__context__]
    return out
