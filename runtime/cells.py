"""`%%mesh` cells, the controller's half: run a cell's source on every worker of a view, and move names
between the notebook and the workers' namespaces. The workers' half is `worker/cells.py` (named here,
not imported: controller code never imports worker code)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from monarch.runtime.controller import OutputEvent
from monarch.runtime.mesh import ProcMesh
from monarch.runtime.remote import RemoteFunction
from monarch.runtime.values import Future, ValueMesh

_WORKER = "monarch.runtime.worker.cells"


def run_cell(
    view: ProcMesh,
    source: str,
    filename: str,
    *,
    output: Callable[[OutputEvent], None] | None = None,
    no_stdin: str | None = None,
) -> Future:
    """Start `source` on every worker of `view`, each in its persistent namespace; the future's value is
    the last expression's, per rank. `filename` names the cell in tracebacks and pdb."""
    fn = RemoteFunction.by_name(_WORKER, "run_cell", view)
    return fn.start((source, filename), {}, no_stdin=no_stdin, output=output, name="%%mesh cell")


def complete(view: ProcMesh, text: str, timeout: float) -> list[str]:
    """Completions of `text` in the namespace of `view`'s first worker (Tab in a ``%%mesh`` cell); empty if
    it does not answer within `timeout` seconds."""
    first = view.slice(**dict.fromkeys(view.names, 0))
    future = RemoteFunction.by_name(_WORKER, "complete", first).call_async(text)
    try:
        return list(future.result(timeout).values()[0])
    except TimeoutError:
        return []


def pull(view: ProcMesh, name: str) -> ValueMesh:
    """The value of `name` in each worker's namespace."""
    return RemoteFunction.by_name(_WORKER, "pull", view)(name)


def push(view: ProcMesh, values: dict[str, Any]) -> None:
    """Set names in each worker's namespace."""
    RemoteFunction.by_name(_WORKER, "push", view)(values)
