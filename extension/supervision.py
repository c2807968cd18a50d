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


class FailureDisplay:
    """Tracks the running cell (IPython's pre/post_run_cell) and shows failures in it, or in the next one."""

    def __init__(self, ip: Any) -> None:
        self.ip = ip
        self.running: dict | None = None
        """The parent message of the cell running now (None between cells)."""
        self.waiting: list[str] = []
        """Failures that came while no cell ran, worded, for the next cell."""
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
        """Write `failure` to the running cell's stderr, or keep it for the next cell; False outside a kernel
        (the default hook prints it)."""
        stream = sys.stderr
        set_parent = getattr(stream, "set_thread_parent", None)
        if set_parent is None or getattr(self.ip, "kernel", None) is None:
            return False
        with self._lock:
            running = self.running
            if running is None:
                when = time.strftime("%H:%M:%S")
                self.waiting.append(f"MeshFailure at {when}, while no cell ran: {failure}\n{_HOW}")
                return True
        token = set_parent(running)
        try:
            stream.write(f"MeshFailure: {failure}\n{_HOW}")
            stream.flush()
        finally:
            stream.reset_thread_parent(token)
        return True


_HOW = "(no __supervise__ of its owner handled it; set monarch.actor.unhandled_fault_hook to handle it yourself)\n"


def install(ip: Any) -> None:
    """Route unhandled actor mesh failures to `ip`'s cells."""
    display = FailureDisplay(ip)
    ip.events.register("pre_run_cell", display.pre_run_cell)
    ip.events.register("post_run_cell", display.post_run_cell)
    supervision.SHOW = display.show
