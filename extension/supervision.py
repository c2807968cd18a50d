"""Actor supervision in a notebook: an unhandled `MeshFailure` is shown in the cell that spawned its actor mesh.

The runtime asks `CELL_ORIGIN()` when an actor mesh is spawned (the cell running then) and, when a failure
nobody handled comes, calls `SHOW(failure)` on its hook thread (`monarch.runtime.actors.supervision`). In a
kernel the text goes to that cell as a stderr stream (ipykernel routes a thread's output by the parent header
that thread sets). A frontend such as JupyterLab shows a cell's output only while it runs, so a failure whose
cell has ended goes to the cell running now; with none running, to its own cell and to the kernel's stderr.
"""

from __future__ import annotations

import sys
from typing import Any

from monarch.runtime.actors import supervision


class FailureDisplay:
    """Tracks the running cell (IPython's pre/post_run_cell) and shows failures in a cell."""

    def __init__(self, ip: Any) -> None:
        self.ip = ip
        self.running: dict | None = None
        """The parent message of the cell running now (None between cells)."""

    def pre_run_cell(self, info: Any = None) -> None:
        kernel = getattr(self.ip, "kernel", None)
        self.running = kernel.get_parent() if kernel is not None and hasattr(kernel, "get_parent") else None

    def post_run_cell(self, result: Any = None) -> None:
        self.running = None

    def origin(self) -> Any:
        return self.running

    def show(self, failure: supervision.MeshFailure) -> bool:
        """Write `failure` to a cell's stderr; False outside a kernel (the default hook prints it)."""
        stream = sys.stderr
        set_parent = getattr(stream, "set_thread_parent", None)
        if set_parent is None or getattr(self.ip, "kernel", None) is None:
            return False
        running, origin = self.running, failure.origin
        target = origin if origin is not None and _same(origin, running) else running or origin
        if target is None:
            return False
        text = f"MeshFailure (not handled by a __supervise__ or unhandled_fault_hook): {failure}\n"
        token = set_parent(target)
        try:
            stream.write(text)
            stream.flush()
        finally:
            stream.reset_thread_parent(token)
        if running is None and sys.__stderr__ is not None:  # (no cell runs: a frontend may not show it)
            print(f"monarch: {text}", end="", file=sys.__stderr__, flush=True)
        return True


def _same(a: dict, b: dict | None) -> bool:
    return b is not None and a.get("header", {}).get("msg_id") == b.get("header", {}).get("msg_id")


def install(ip: Any) -> None:
    """Route unhandled actor mesh failures to `ip`'s cells."""
    display = FailureDisplay(ip)
    ip.events.register("pre_run_cell", display.pre_run_cell)
    ip.events.register("post_run_cell", display.post_run_cell)
    supervision.CELL_ORIGIN = display.origin
    supervision.SHOW = display.show
