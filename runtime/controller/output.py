"""Workers' output as the controller sees it, and the default place it goes (labelled lines)."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any


@dataclass
class OutputEvent:
    """A chunk of a worker's stdout or stderr, or a rich display."""

    call_id: int | None
    """The call it was written during, or None between calls."""
    mesh_id: int
    rank: int
    label: str
    """The worker's coordinates, e.g. ``"gpu=3"``."""
    stream: str
    """``"stdout"``, ``"stderr"``, ``"display"`` for a rich display (then `data` holds it), or ``"error"``: the
    traceback of a rank that failed while others went on (the call's error shows it again when it ends)."""
    text: str
    data: dict[str, Any] | None = None
    """A display's mime bundle (``{"text/plain": ..., "image/png": ...}``)."""
    metadata: dict[str, Any] | None = None


class LineLabeller:
    """Writes worker output to this process's stdout/stderr, each line labelled ``[gpu=3] ...`` (the
    default sink, and the notebook's arrival-order view)."""

    def __init__(self) -> None:
        self.mid_line: set[tuple[int, int, str]] = set()
        """(mesh id, rank, stream) of each line half written (only those: a long-lived controller makes
        many meshes)."""

    def break_line(self) -> None:
        """End any half-written line (before a prompt), so the prompt starts on its own line."""
        if self.mid_line and sys.stdout is not None:
            sys.stdout.write("\n")
            sys.stdout.flush()
            self.mid_line.clear()

    def __call__(self, ev: OutputEvent) -> None:
        out = sys.stderr if ev.stream in ("stderr", "error") else sys.stdout
        if out is None:
            return
        if ev.stream == "display":  # a rich display: its text form
            text = (ev.data or {}).get("text/plain", "")
            ev = OutputEvent(ev.call_id, ev.mesh_id, ev.rank, ev.label, "stdout", text + "\n")
        key = (ev.mesh_id, ev.rank, ev.stream)
        prefix = f"[{ev.label}] "
        parts = []
        start = key not in self.mid_line
        for line in ev.text.splitlines(keepends=True):
            parts.append(prefix + line if start else line)
            start = line.endswith("\n")
        if start:
            self.mid_line.discard(key)
        else:
            self.mid_line.add(key)
        out.write("".join(parts))
        out.flush()
