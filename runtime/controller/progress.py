"""How a mesh's start is shown while it runs: ``starting 8 workers {gpu: 8}… 5/8 ready``.

A cold start (the fork server importing torch) takes a second or more, a start on busy hosts longer:
the user sees that something happens. A script hears of a start only once it has taken a second; the
notebook extension puts its own `SpawnProgress` in the cell (`Controller.spawn_progress`).
"""

from __future__ import annotations

import sys
import time


class SpawnProgress:
    """One mesh's start. `update(ready)` is called often (several times a second, whether or not the count
    changed) from the thread that spawns; `finish(error)` once at the end."""

    def __init__(self, what: str, total: int) -> None:
        self.what = what
        """The mesh's shape, e.g. ``{gpu: 8}``."""
        self.total = total
        self.started = time.monotonic()
        self.ready = 0

    def text(self) -> str:
        return f"monarch: starting {self.total} workers {self.what}… {self.ready}/{self.total} ready"

    def final_text(self, error: BaseException | None) -> str:
        took = time.monotonic() - self.started
        if error is not None:
            return f"monarch: starting {self.what} failed after {took:.1f} s ({type(error).__name__})"
        return f"monarch: {self.total} workers {self.what} ready in {took:.2f} s"

    def update(self, ready: int) -> None:
        self.ready = ready

    def finish(self, error: BaseException | None) -> None:
        pass


class TerminalProgress(SpawnProgress):
    """On stderr, once the start has taken `AFTER` seconds: redrawn in place on a terminal, a line now and
    then in a log."""

    AFTER = 1.0
    EVERY = 0.25
    """Seconds between redraws on a terminal."""
    LOG_EVERY = 10.0
    """Seconds between lines in a log."""

    def __init__(self, what: str, total: int) -> None:
        super().__init__(what, total)
        self.shown = 0.0
        self.tty = sys.stderr is not None and sys.stderr.isatty()

    def update(self, ready: int) -> None:
        changed = ready != self.ready
        self.ready = ready
        now = time.monotonic()
        if sys.stderr is None or now - self.started < self.AFTER:
            return
        if self.tty and (changed or now - self.shown >= self.EVERY):
            sys.stderr.write("\r" + self.text())
        elif not self.tty and now - self.shown >= self.LOG_EVERY:
            sys.stderr.write(self.text() + "\n")
        else:
            return
        sys.stderr.flush()
        self.shown = now

    def finish(self, error: BaseException | None) -> None:
        if self.shown and sys.stderr is not None:
            sys.stderr.write(("\r" if self.tty else "") + self.final_text(error) + "\n")
            sys.stderr.flush()
