"""One `%%mesh` cell run: where its output goes while it runs, and its handle."""

from __future__ import annotations

import threading
import time
import uuid
from typing import Any

from monarch.runtime.common.errors import MeshStoppedError, placed
from monarch.runtime.common.figures import MIME as FIGURE
from monarch.runtime.controller import LineLabeller, OutputEvent
from monarch.runtime.values import Future, ValueMesh

STARTUP_GRACE = 0.3
"""Seconds a new live view gets to load in the browser before it is sent new text; what arrives meanwhile
is held, so nothing is sent to a view that is not listening yet."""
SEND_EVERY = 0.05
"""Seconds new text waits for more before it is sent, joined per rank: a flood of output then travels as a
few large messages a second, not thousands of small ones (past 1000 queued, iopub drops messages, the
cell's end among them, and a front-end waits for it forever)."""
CLOSE_AFTER = 3.0
"""Seconds after a live view was made before its widget is closed, once static HTML replaced it: anywidget gives a
new model 2 s to load its code in the browser, and one closed meanwhile (a quick cell's) logs "[anywidget] Failed
to initialize model." in the browser's console."""


class RankAreas:
    """Output grouped by rank: one live area per rank (a widget), static HTML once the cell ends; on more than
    `GROUP_ABOVE` ranks, one area per distinct output, its ranks named."""

    def __init__(self, widget_factory, ranks: int = 0) -> None:
        from monarch.widgets.rank_output import GROUP_ABOVE, RankLog

        self.log = RankLog(files=True, grouped=ranks > GROUP_ABOVE)
        self._factory = widget_factory
        self._widget = None
        self._display_id = uuid.uuid4().hex
        self._lock = threading.Lock()
        self._created = 0.0
        self._held: list[dict] = []
        self._parts: dict[int, tuple[int, list[str]]] = {}
        """Rank -> where its last held item is in `_held` when that is text, and the text in pieces (joined
        when sent)."""
        self._timer: threading.Timer | None = None
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
            self._hold(item)
            if self._timer is None:
                wait = max(SEND_EVERY, STARTUP_GRACE - (time.monotonic() - self._created))
                self._timer = threading.Timer(wait, self._release)
                self._timer.daemon = True
                self._timer.start()

    def _hold(self, item: dict) -> None:
        """Hold `item` until the next send; text joins the rank's last held item when that is text of
        the same stream (each rank's area shows its own text in order; the order across ranks is no
        matter)."""
        last = self._held[self._parts[item["r"]][0]] if item["r"] in self._parts else None
        if "t" in item and last is not None and last["s"] == item["s"]:
            self._parts[item["r"]][1].append(item["t"])
            return
        self._held.append(item)
        if "t" in item:
            self._parts[item["r"]] = (len(self._held) - 1, [item["t"]])
        else:
            self._parts.pop(item["r"], None)

    def _release(self) -> None:
        with self._lock:
            self._timer = None
            self._release_locked()

    def _release_locked(self) -> None:
        for i, parts in self._parts.values():
            self._held[i]["t"] = "".join(parts)
        if self._held and self._widget is not None:
            self._widget.append(self._held)
        self._held, self._parts = [], {}

    def finish(self, replace: bool = True) -> None:
        """Swap the live view for static HTML (saved with the notebook; renders anywhere)."""
        with self._lock:
            self._release_locked()  # each byte goes live once; the static view adds only each rank's last lines
            self.finished = True
            widget, self._widget = self._widget, None
            bundle = self.log.bundle() if widget is not None and replace else None
            self.log.close()
        if bundle is not None:
            from IPython.display import update_display

            update_display(bundle, display_id=self._display_id, raw=True)
            wait = self._created + CLOSE_AFTER - time.monotonic()
            if wait <= 0:
                widget.close()
            else:
                timer = threading.Timer(wait, widget.close)
                timer.daemon = True
                timer.start()


class ArrivalLines:
    """Output in arrival order, each line labelled with its rank (also the terminal's form)."""

    def __init__(self) -> None:
        self._lines = LineLabeller()

    def __call__(self, ev: OutputEvent) -> None:
        if ev.stream == "display" and ev.data:
            from IPython.display import display

            print(f"[{ev.label}]")  # (a figure's themed form is for rank areas: JupyterLab takes its PNG)
            data = {k: v for k, v in ev.data.items() if k != FIGURE}
            display(data, raw=True, metadata=ev.metadata or {})
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
        self._started = time.monotonic()
        if not blocking:  # nothing waits for it: its own areas say when (and how) it ended
            future.add_done_callback(lambda _: threading.Thread(target=self._say_ended, daemon=True).start())

    def _say_ended(self) -> None:
        """A line in each rank's area once a --noblock run has ended: its time, or why it failed."""
        took = time.monotonic() - self._started
        try:
            self.future.result()
        except MeshStoppedError:  # (what the user did: its whole story is for result(), if asked)
            stream, text = "stderr", f"[this run was stopped with its mesh, after {took:.1f} s]\n"
        except BaseException as e:
            labels = dict(self.future.points)
            for rank, shown in placed(self.future.unshown_failures()):  # (nothing raises them to the user)
                self.output(OutputEvent(None, self.future.mesh_id, rank, labels[rank], "error", shown))
            first = str(e).split("\n", 1)[0]
            stream, text = "stderr", f"[this run failed after {took:.1f} s: {type(e).__name__}: {first}]\n"
        else:
            stream, text = "stdout", f"[this run ended after {took:.1f} s]\n"
        for rank, label in self.future.points:
            self.output(OutputEvent(None, self.future.mesh_id, rank, label, stream, text))
        self.output.finish(replace=False)  # sent now; the live view stays (nothing waits to replace it)

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
