"""Workers' output as the controller sees it, and the default place it goes (labelled lines)."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import IO, Any

AGGREGATED = -1
"""The rank of an event that stands for similar lines of several ranks (`ProcMesh.logging_option`'s
``aggregate_window_sec``): its text names them, ``[8 similar lines, ranks 0-7] loss 2.31``."""


@dataclass
class OutputEvent:
    """A chunk of a worker's stdout or stderr, or a rich display."""

    call_id: int | None
    """The call it was written during, or None between calls."""
    mesh_id: int
    rank: int
    """The worker's rank in its mesh; `AGGREGATED` for lines of several ranks collapsed into one."""
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
    default sink, and the notebook's arrival-order view); an `AGGREGATED` line as it is (it names its ranks).
    `out` and `err`: where to, instead of this process's stdout and stderr (a file)."""

    def __init__(self, out: IO[str] | None = None, err: IO[str] | None = None) -> None:
        self.files = (out, err)
        self.mid_line: set[tuple[int, int, str]] = set()
        """(mesh id, rank, stream) of each line half written (only those: a long-lived controller makes
        many meshes)."""

    def break_line(self) -> None:
        """End any half-written line (before a prompt), so the prompt starts on its own line."""
        if self.mid_line and self.files[0] is None and sys.stdout is not None:
            sys.stdout.write("\n")
            sys.stdout.flush()
            self.mid_line.clear()

    def __call__(self, ev: OutputEvent) -> None:
        to_err = ev.stream in ("stderr", "error")
        out = self.files[to_err] or (sys.stderr if to_err else sys.stdout)
        if out is None:
            return
        if ev.stream == "display":  # a rich display: its text form
            text = (ev.data or {}).get("text/plain", "")
            ev = OutputEvent(ev.call_id, ev.mesh_id, ev.rank, ev.label, "stdout", text + "\n")
        key = (ev.mesh_id, ev.rank, ev.stream)
        prefix = f"[{ev.label}] " if ev.rank != AGGREGATED else ""
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
