"""How meshes meet the notebook: rich views of mesh objects, and stdin for workers' pdb prompts."""

from __future__ import annotations

import time
from typing import Any

from monarch.runtime.controller import Controller, InputRequest, SpawnProgress


def in_kernel(ip: Any) -> bool:
    """True inside a Jupyter kernel (widgets can render); False in terminal IPython."""
    return getattr(ip, "kernel", None) is not None


def register_formatters(ip: Any) -> None:
    """ValueMesh, MeshTable and ProcMesh display as widgets (with static HTML inside). A mesh table is live
    until the next cell starts, then frozen: an old output shows what was true when its cell ran."""
    live: list[Any] = []

    def mesh_table_bundle(table) -> dict | None:
        from monarch.widgets.mesh_table import MeshTableWidget

        mesh = getattr(table, "mesh", None)
        if mesh is None:
            return None
        widget = MeshTableWidget(mesh)
        live.append(widget)
        return widget._repr_mimebundle_()

    def next_cell(info: Any = None) -> None:
        while live:
            live.pop().freeze()

    fmt = ip.display_formatter.mimebundle_formatter
    fmt.for_type_by_name("monarch.runtime.common.valuemesh", "ValueMesh", _value_mesh_bundle)
    fmt.for_type_by_name("monarch.runtime.mesh", "MeshTable", mesh_table_bundle)
    ip.events.register("pre_run_cell", next_cell)


def _value_mesh_bundle(values) -> dict:
    from monarch.widgets.value_mesh import ValueMeshView

    return ValueMeshView(values)._repr_mimebundle_()


class NotebookProgress(SpawnProgress):
    """A mesh's start shown in the cell that starts it, one line updated in place (at most ten times a
    second), ending as ``monarch: 4 workers {gpu: 4} ready in 1.05 s``."""

    def __init__(self, what: str, total: int) -> None:
        from IPython.display import display

        super().__init__(what, total)
        self.shown = time.monotonic()
        self.handle = display({"text/plain": self.text()}, raw=True, display_id=True)

    def update(self, ready: int) -> None:
        changed = ready != self.ready
        self.ready = ready
        now = time.monotonic()
        if self.handle is not None and (changed or now - self.shown >= 0.1) and now - self.shown >= 0.05:
            self.handle.update({"text/plain": self.text()}, raw=True)
            self.shown = now

    def finish(self, error: BaseException | None) -> None:
        if self.handle is not None:
            self.handle.update({"text/plain": self.final_text(error)}, raw=True)


class NotebookStdin:
    """Serves workers' input requests from the notebook's stdin, one rank at a time.

    A DebuggerView in the cell shows which rank holds the prompt and which others wait.
    """

    def __init__(self, controller: Controller, widgets: bool) -> None:
        self.controller = controller
        self.widgets = widgets
        self.view = None

    def __call__(self, req: InputRequest) -> str:
        if self.widgets and req.debugger:
            self._show(req)
        prompt = f"[{req.label}] {req.prompt}"
        echo = self.controller.stdin.echo  # the prompt and its answer in the rank's area too, as a terminal shows them
        echo(req, req.prompt)
        if req.password:
            import getpass

            text = getpass.getpass(prompt)
            echo(req, "\n")
            return text
        text = input(prompt)
        echo(req, text + "\n")
        return text

    def _show(self, req: InputRequest) -> None:
        from IPython.display import display

        from monarch.widgets.debugger import DebuggerView

        waiting = [r.label for r in self.controller.stdin.waiting() if r is not req]
        if self.view is None:
            self.view = DebuggerView(active=req.label, paused=waiting, where=req.where)
            display(self.view)
        else:
            self.view.active, self.view.paused, self.view.where = req.label, waiting, req.where

    def cell_done(self) -> None:
        """The cell ended: no rank is paused any more; the next breakpoint gets a new view."""
        if self.view is not None:
            self.view.active, self.view.paused, self.view.where = "", [], ""
            self.view = None
