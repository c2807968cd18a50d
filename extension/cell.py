"""One `%%mesh` cell run: where its output goes while it runs, and its handle."""

from __future__ import annotations

import threading
import time
import uuid
from typing import Any

from monarch.runtime.controller import LineLabeller, OutputEvent
from monarch.runtime.remote import Future, ValueMesh

STARTUP_GRACE = 0.3
"""Seconds a new live view gets to load in the browser before it is sent new text directly; what
arrives meanwhile is batched, so nothing is sent to a view that is not listening yet."""


class RankAreas:
    """Output grouped by rank: one live area per rank (a widget), static HTML once the cell ends."""

    def __init__(self, widget_factory) -> None:
        from monarch.widgets.rank_output import RankLog

        self.log = RankLog()
        self._factory = widget_factory
        self._widget = None
        self._display_id = uuid.uuid4().hex
        self._lock = threading.Lock()
        self._created = 0.0
        self._held: list[dict] = []
        self.finished = False

    def show_now(self) -> None:
        """Display the (empty) live view at once: for a cell that returns before its output comes."""
        with self._lock:
            self._ensure_widget([])

    def _ensure_widget(self, initial: list[dict]) -> bool:
        if self._widget is not None:
            return False
        from IPython.display import display

        self._widget = self._factory(self.log, initial)
        self._created = time.monotonic()
        display(self._widget, display_id=self._display_id)
        return True

    def __call__(self, ev: OutputEvent) -> None:
        with self._lock:
            item = self.log.add(ev.rank, ev.label, ev.stream, ev.text, ev.data)
            if self.finished or self._ensure_widget([item]):
                return
            if time.monotonic() - self._created < STARTUP_GRACE:
                if not self._held:
                    timer = threading.Timer(STARTUP_GRACE, self._release)
                    timer.daemon = True
                    timer.start()
                self._held.append(item)
                return
            self._release_locked()
            self._widget.append([item])

    def _release(self) -> None:
        with self._lock:
            self._release_locked()

    def _release_locked(self) -> None:
        if self._held and self._widget is not None:
            self._widget.append(self._held)
        self._held = []

    def finish(self, replace: bool = True) -> None:
        """Swap the live view for static HTML (saved with the notebook; renders anywhere)."""
        with self._lock:
            if not replace:
                self._release_locked()
            self.finished = True
            self._held = []
            widget, self._widget = self._widget, None
        if widget is None:
            return
        if replace:
            from IPython.display import update_display

            update_display(self.log.bundle(), display_id=self._display_id, raw=True)
            widget.close()


class ArrivalLines:
    """Output in arrival order, each line labelled with its rank (also the terminal's form)."""

    def __init__(self) -> None:
        self._lines = LineLabeller()

    def __call__(self, ev: OutputEvent) -> None:
        if ev.stream == "display" and ev.data:
            from IPython.display import display

            print(f"[{ev.label}]")
            display(ev.data, raw=True, metadata=ev.metadata or {})
        else:
            self._lines(ev)

    def finish(self, replace: bool = True) -> None:
        pass


class CellRun:
    """The handle of a `%%mesh` cell run (what ``--save NAME`` stores).

    `result()` waits for every rank and returns the last expression's values as a `ValueMesh`
    (raising `RemoteError` if a rank failed); `done()` says whether all ranks finished.
    """

    def __init__(self, future: Future, output: RankAreas | ArrivalLines, mesh: Any, blocking: bool) -> None:
        self.future = future
        self.output = output
        self.mesh = mesh
        self._blocking = blocking

    def done(self) -> bool:
        return self.future.done()

    def interrupt(self) -> None:
        """KeyboardInterrupt on the ranks still running this cell (Kernel > Interrupt reaches only the cell
        being waited for, not a --noblock one); returns at once."""
        self.future.interrupt()

    def result(self, timeout: float | None = None) -> ValueMesh:
        try:
            return self.future.result(timeout)
        finally:
            if self._blocking:
                self.output.finish()

    def __repr__(self) -> str:
        state = "done" if self.done() else "running"
        return f"<%%mesh run on {self.mesh.describe()}: {state}>"
