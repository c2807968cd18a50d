"""Tab completion inside a ``%%mesh`` cell: names from the workers' namespace (where the cell runs), not the
kernel's. Asks the first worker of the mesh the cell would run on; never starts a mesh, and never waits for a
busy one."""

from __future__ import annotations

import re
from typing import Any

TIMEOUT = 2.0
"""Seconds a completion waits for the worker's answer before the kernel completes as usual."""
_TOKEN = re.compile(r"[A-Za-z_][\w.]*$")


def complete(magics: Any, code: str, cursor_pos: int) -> dict | None:
    """A `complete_reply` for `code` if the cursor is in the body of a ``%%mesh`` cell whose mesh runs and is
    idle, and the worker knows completions; None to let the kernel complete as usual."""
    if not code.startswith("%%mesh"):
        return None
    head_end = code.find("\n")
    if head_end < 0 or cursor_pos <= head_end:
        return None
    m = _TOKEN.search(code[head_end + 1 : cursor_pos])
    if m is None:
        return None
    token = m.group(0)
    view = magics.existing_target(code[len("%%mesh") : head_end])
    if view is None or view.busy():
        return None
    from monarch.runtime import cells

    matches = cells.complete(view, token, TIMEOUT)
    if not matches:
        return None
    return {
        "status": "ok",
        "matches": matches,
        "cursor_start": cursor_pos - len(token),
        "cursor_end": cursor_pos,
        "metadata": {},
    }
