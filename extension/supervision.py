"""Actor supervision in a notebook: an unhandled `MeshFailure` is shown where the user looks next.

The runtime calls `SHOW(failure)` on its hook thread (`monarch.runtime.actors.supervision`) when a failure
nobody handled comes. A frontend such as JupyterLab shows what a cell writes only while it runs, and a
notice appended to an old cell's output is one the user never sees (or mistakes for that cell's). So a
failure that comes while a cell runs is written to that cell's stderr (ipykernel routes a thread's output by
the parent header that thread sets); one that comes while no cell runs waits, and opens the output of the
next cell run, saying when it happened. Each is shown once.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Any

from monarch.runtime.actors import supervision
from monarch.runtime.common.prose import fit


class FailureDisplay:
    """Tracks the running cell (IPython's pre/post_run_cell) and shows failures in it, or in the next one."""

    def __init__(self, ip: Any) -> None:
        self.ip = ip
        self.running: dict | None = None
        """The parent message of the cell running now (None between cells)."""
        self.waiting: list[str] = []
        """Failures and notices that came while no cell ran, worded, for the next cell."""
        self._lock = threading.Lock()

    def pre_run_cell(self, info: Any = None) -> None:
        kernel = getattr(self.ip, "kernel", None)
        with self._lock:
            self.running = kernel.get_parent() if kernel is not None and hasattr(kernel, "get_parent") else None
            waiting, self.waiting = self.waiting, []
        for text in waiting:  # (the main thread, in the new cell: its output starts with them)
            sys.stderr.write(text)
        if waiting:
            sys.stderr.flush()

    def post_run_cell(self, result: Any = None) -> None:
        with self._lock:
            self.running = None

    def show(self, failure: supervision.MeshFailure) -> bool:
        """Show `failure` in the running cell, or at the top of the next; False outside a kernel (the default
        hook prints it)."""
        return self.notice(f"MeshFailure: {failure}\n{_HOW}", "MeshFailure")

    def notice(self, text: str, what: str = "") -> bool:
        """Write `text` to the running cell's stderr, or keep it for the next cell (saying when it came,
        after `what`, its first word); False outside a kernel."""
        stream = sys.stderr
        set_parent = getattr(stream, "set_thread_parent", None)
        if set_parent is None or getattr(self.ip, "kernel", None) is None:
            return False
        with self._lock:
            running = self.running
            if running is None:
                head, _, rest = text.partition(": ")
                if what and head == what:
                    text = f"{what} at {time.strftime('%H:%M:%S')}, while no cell ran: {rest}"
                else:
                    text = f"({time.strftime('%H:%M:%S')}, while no cell ran) {text}"
                self.waiting.append(fit(text) + "\n")
                return True
        token = set_parent(running)
        try:
            stream.write(fit(text) + "\n")
            stream.flush()
        finally:
            stream.reset_thread_parent(token)
        return True

    def print_notice(self, text: str) -> None:
        """`Controller.notify` in a kernel: a notice no call carries, shown where the user looks."""
        if not self.notice(text):
            print(text, file=sys.stderr)


_HOW = "(no __supervise__ of its owner handled it; set monarch.actor.unhandled_fault_hook to handle it yourself)"


def install(ip: Any) -> FailureDisplay:
    """Route unhandled actor mesh failures (and the runtime's notices, `FailureDisplay.print_notice`) to `ip`'s
    cells."""
    display = FailureDisplay(ip)
    ip.events.register("pre_run_cell", display.pre_run_cell)
    ip.events.register("post_run_cell", display.post_run_cell)
    supervision.SHOW = display.show
    return display
