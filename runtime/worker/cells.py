"""`%%mesh` cells on workers: each worker runs a cell's source in its own persistent namespace.

Runs on the worker (called by reference as a live function; `monarch.runtime.cells` is the controller's half). The namespace outlives cells, like
a notebook's; `rank`, `coords`, `device` and `mesh_size` are set before each cell. `display()`
and matplotlib figures made in a cell travel to the controller as rich displays.
"""

from __future__ import annotations

import ast
import base64
import bdb
import builtins
import io
import linecache
import math
import os
import sys
import tokenize
from typing import Any

from monarch.runtime.common import context

_namespace: dict[str, Any] | None = None
_compiled: dict[tuple[str, str], tuple[Any, Any]] = {}
_formatter: Any = None
_SIMPLE = (type(None), bool, int, float, complex, str, bytes)


class Unpicklable:
    """Stands in for a cell's value that could not be sent back; shows the worker's repr."""

    def __init__(self, type_name: str, text: str):
        self.type_name, self.text = type_name, text

    def __repr__(self) -> str:
        return self.text


def namespace() -> dict[str, Any]:
    """This worker's cell namespace (created on first use)."""
    global _namespace
    if _namespace is None:
        _namespace = {"__name__": "__main__", "__builtins__": builtins, "display": display}
        context.cell_namespace = _namespace
        if "matplotlib" not in sys.modules:
            os.environ.setdefault("MPLBACKEND", "module://matplotlib_inline.backend_inline")
        _route_ipython_display()
    return _namespace


def run_cell(source: str, filename: str) -> Any:
    """Run `source` in this worker's namespace; return the last expression's value (or None)."""
    ns = namespace()
    w = context.worker
    assert w is not None, "run_cell runs on workers"
    ns.update(rank=w.rank, coords=dict(context.view.coords), device=w.device, mesh_size=math.prod(w.sizes.values()))
    body, last = _compile(source, filename)
    value = None
    try:
        exec(body, ns)
        if last is not None:
            value = eval(last, ns)
    except bdb.BdbQuit:
        return None  # `q` at a pdb prompt: the cell ends quietly on this rank
    finally:
        _flush_figures()
    if value is None:
        return None
    ns["_"] = value
    return _sendable(value)


def pull(name: str) -> Any:
    """The value of `name` in this worker's namespace (for ``%mesh pull``)."""
    ns = namespace()
    if name not in ns:
        raise NameError(f"name {name!r} is not defined in this worker's namespace")
    return _sendable(ns[name])


def push(values: dict[str, Any]) -> None:
    """Set names in this worker's namespace (for ``%mesh push``)."""
    namespace().update(values)


def complete(text: str, limit: int = 200) -> list[str]:
    """Completions of `text` (a name, or a dotted name's attribute) in this worker's namespace, builtins and
    keywords included (for Tab in a ``%%mesh`` cell)."""
    import rlcompleter

    completer = rlcompleter.Completer(namespace())
    out: list[str] = []
    for state in range(limit):
        try:
            match = completer.complete(text, state)
        except Exception:  # (an attribute that raises while listed)
            break
        if match is None:
            break
        out.append(match.rstrip("("))
    return sorted(set(out))


def reset() -> None:
    """Forget every name defined by cells."""
    global _namespace
    _namespace = context.cell_namespace = None


def _compile(source: str, filename: str) -> tuple[Any, Any]:
    key = (source, filename)
    found = _compiled.get(key)
    if found is not None:
        return found
    lines = source.splitlines(keepends=True)
    linecache.cache[filename] = (len(source), None, lines, filename)  # tracebacks and pdb show the cell
    tree = ast.parse(source, filename)
    last = None
    if tree.body and isinstance(tree.body[-1], ast.Expr) and not _ends_with_semicolon(source):
        last = compile(ast.Expression(tree.body.pop().value), filename, "eval")
    body = compile(tree, filename, "exec")
    if len(_compiled) > 256:
        _compiled.clear()
    _compiled[key] = (body, last)
    return body, last


def _ends_with_semicolon(source: str) -> bool:
    """True when the last code token is ``;`` (comments aside): IPython's sign to show no value."""
    last = None
    try:
        for tok in tokenize.generate_tokens(io.StringIO(source).readline):
            if tok.type not in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.ENDMARKER, tokenize.DEDENT):
                last = tok.string
    except (tokenize.TokenError, SyntaxError):
        return False
    return last == ";"


def _sendable(value: Any) -> Any:
    if isinstance(value, _SIMPLE) or type(value).__module__ == "torch":
        return value
    import cloudpickle

    try:
        cloudpickle.dumps(value)
    except Exception:
        return Unpicklable(type(value).__name__, repr(value))
    return value


# -- rich displays -----------------------------------------------------------------------------------
def display(*objs: Any, include=None, exclude=None, metadata: dict | None = None, raw: bool = False, **_: Any) -> None:
    """`IPython.display.display` on a worker: the mime bundle goes to the controller, labelled by rank."""
    from monarch.runtime.worker import worker

    if worker.current is None:
        print(*objs)
        return
    for obj in objs:
        if raw:
            data, md = dict(obj), {}
        else:
            data, md = _format(obj, include, exclude)
        if not data:
            continue
        if metadata:
            md.update(metadata)
        for mime, v in data.items():
            if isinstance(v, bytes):
                data[mime] = base64.b64encode(v).decode("ascii")
        worker.current.send_display(data, md)


def _format(obj: Any, include, exclude) -> tuple[dict, dict]:
    global _formatter
    if _formatter is None:
        from IPython.core.formatters import DisplayFormatter

        _formatter = DisplayFormatter()
        png = _formatter.formatters["image/png"]
        png.for_type_by_name("matplotlib.figure", "Figure", _figure_png)
    data, md = _formatter.format(obj, include=include, exclude=exclude)
    data, md = dict(data), dict(md)
    if type(obj).__name__ == "Figure" and type(obj).__module__ == "matplotlib.figure" and "image/png" in data:
        from monarch.runtime.common import figures

        svg = figures.themed_svg(obj)  # (the rank's area draws it in the notebook's theme; the PNG for the rest)
        if svg is not None:
            data[figures.MIME] = svg
    return data, md


def _figure_png(fig: Any) -> bytes | None:
    from IPython.core.pylabtools import print_figure

    return print_figure(fig, "png")


def _route_ipython_display() -> None:
    """Make `from IPython.display import display` (and matplotlib's inline backend) use ours."""
    try:
        import IPython.display
        from IPython.core import display_functions
    except ImportError:
        return
    display_functions.display = display
    IPython.display.display = display


def _flush_figures() -> None:
    """Show the figures a cell left open, as the inline backend does after each notebook cell."""
    plt = sys.modules.get("matplotlib.pyplot")
    if plt is None:
        return
    from matplotlib._pylab_helpers import Gcf

    for manager in Gcf.get_all_fig_managers():
        display(manager.canvas.figure)
    plt.close("all")
