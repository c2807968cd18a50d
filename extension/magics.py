"""`%%mesh` (run a cell on every worker of a mesh) and `%mesh` (its commands: `LINE_COMMANDS`).

What each takes is in `MeshMagics.mesh`'s docstring and `LINE_COMMANDS`, which `%%mesh?`, `%mesh?` and
`%mesh help` show.

A shape different from the running implicit mesh's is refused, naming the running shape (its workers
hold the cells' names; a typo such as `gpus=4` must not throw them away): `--replace` replaces it.
Meshes given by name are never replaced. A `# comment` may end the magic line.
"""

from __future__ import annotations

import contextlib
import difflib
import inspect
import math
import re
import shlex
import textwrap
from dataclasses import dataclass
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class

from monarch.extension.cell import ArrivalLines, CellRun, RankAreas
from monarch.extension.frontend import NotebookProgress, NotebookStdin, in_kernel, register_formatters
from monarch.runtime.common import prose
from monarch.runtime.common.load import ASK_WAIT

_DIM = re.compile(r"^([A-Za-z_]\w*)=(.+)$")
_NAME = re.compile(r"^[A-Za-z_][\w.]*$")
_USAGE = "usage: %%mesh [DIM=SIZE ... | MESH_VARIABLE] [--on DIM=INDEX|START:STOP ...] [--noblock] [--group rank|arrival] [--save NAME] [--replace] [--profile DIR]"


@dataclass(frozen=True)
class LineCommand:
    """One ``%mesh`` command. The table below is the only list of them: the usage line, ``%mesh?`` and
    ``%mesh help``, the check of what was typed and the dispatch are made from it (the docs' table is checked
    against it by tests/test_help.py)."""

    name: str
    args: str
    """What follows the name, as the usage line shows it ("" for nothing)."""
    does: str
    """One line of help."""


LINE_COMMANDS = (
    LineCommand("status", "", "a table of the workers: where each is, what it runs, its memory"),
    LineCommand("stacks", "", "every thread's Python stack on the controller and each worker"),
    LineCommand("shutdown", "[--all]", "stop the mesh (--all: every mesh of this kernel)"),
    LineCommand("restart", "", "stop it and start the same shape again (its namespaces are lost)"),
    LineCommand("pull", "NAME ...", "bring NAME from every worker here, as a ValueMesh (one value per rank)"),
    LineCommand("push", "NAME ...", "send NAME from here to every worker's namespace"),
    LineCommand("help", "", "this text and %%mesh's"),
)
_COMMANDS = {c.name: c for c in LINE_COMMANDS}
_LINE_USAGE = f"usage: %mesh [{' | '.join(f'{c.name} {c.args}'.strip() for c in LINE_COMMANDS)}] [--mesh MESH_VARIABLE]"


def _line_doc() -> str:
    """The docstring of ``%mesh`` (what ``%mesh?`` shows), lines no longer than an output area holds."""
    rows = [("%mesh", "the same as %mesh status")]
    rows += [(f"%mesh {c.name} {c.args}".strip(), c.does) for c in LINE_COMMANDS]
    rows.append(("--mesh MESH_VARIABLE", "act on that mesh instead"))
    col = max(len(usage) for usage, _ in rows) + 2
    table = []
    for usage, does in rows:
        lines = textwrap.wrap(does, prose.WIDTH - col) or [""]
        table.append(f"    {usage:<{col}}{lines[0]}")
        table += [f"    {'':<{col}}{more}" for more in lines[1:]]
    return (
        "Look at and steer the mesh the last ``%%mesh`` cell ran on.\n\n"
        + "\n".join(table)
        + "\n\n    ``%%mesh?`` shows how to run a cell on a mesh.\n"
    )


def _help() -> str:
    """What `%mesh help` prints: both magics' docstrings."""
    return "\n\n".join(inspect.getdoc(f) for f in (MeshMagics.mesh_line, MeshMagics.mesh))


@magics_class
class MeshMagics(Magics):
    def __init__(self, shell) -> None:
        super().__init__(shell)
        self.implicit = None
        """The mesh `%%mesh DIM=SIZE` cells run on (started on first use)."""
        self.current = None
        """The mesh the last `%%mesh` cell ran on (the whole mesh, with `--on`); `%mesh` commands act on it."""
        self.widgets = in_kernel(shell)
        self.stdin: NotebookStdin | None = None

    # -- %%mesh ------------------------------------------------------------------------------------
    @cell_magic
    def mesh(self, line: str, cell: str | None = None) -> Any:
        """Run this cell on every worker of a mesh: ``%%mesh gpu=4`` starts
        (or reuses) 4 workers.

        %%mesh gpu=8
            start (or reuse) a local mesh of 8 workers; run the cell on each
        %%mesh host=2 gpu=4
            a two-dimensional mesh
        %%mesh mesh
            run on a ProcMesh variable (any view of a spawned mesh)
        %%mesh gpu=8 --on gpu=0:4
            run on part of the mesh (an index or a start:stop range)
        %%mesh gpu=8 --noblock
            return at once; output keeps arriving in the cell
        %%mesh gpu=8 --group arrival
            output in arrival order, each line labelled (default: by rank)
        %%mesh gpu=8 --save run
            keep the run's handle in `run` (run.result(), run.mesh)
        %%mesh --replace gpu=4
            stop the running mesh (its namespaces are lost), start this
            shape
        %%mesh gpu=4 --profile traces/
            profile the cell: a trace per rank, a merged one, a summary

        On each worker the cell runs in that worker's own namespace, kept
        between cells, with `rank`, `coords`, `device` and `mesh_size` set;
        the workers already form a torch.distributed group. Output appears
        live, one area per rank; the last expression comes back as a
        ValueMesh (one value per rank). ``%mesh help`` lists the line
        commands.
        """
        if cell is None:
            return self._line(line)
        opts = _parse_cell_args(line)
        self.current = self._target(opts)  # (`%mesh` acts on the whole mesh, also after a cell on a slice)
        view = _on(self.current, opts["on"])
        _refuse_if_busy(view)
        blocking = not opts["noblock"]
        if opts["group"] == "rank" and self.widgets:
            from monarch.widgets.rank_output import RankOutput

            output = RankAreas(RankOutput, len(view))
        else:
            output = ArrivalLines()
        from monarch.runtime import cells

        filename = f"<mesh cell {_cell_number(self.shell)}>"
        no_stdin = None if blocking else "the cell runs with --noblock, so nothing waits to answer"
        if not blocking and isinstance(output, RankAreas):
            output.show_now()  # in this cell, before it returns
        prof = None
        if opts["profile"] is not None:
            if not blocking:
                raise UsageError(
                    "%%mesh --profile: a profiled cell cannot run with --noblock (the profile ends with it)"
                )
            from monarch.profiler import profile

            prof = profile(on_trace_ready=opts["profile"], mesh=view)
            prof.start()
        # one line down: the editor's line 1 is the %%mesh line, so tracebacks and pdb count as it does
        future = cells.run_cell(view, "\n" + cell, filename, output=output, no_stdin=no_stdin)
        run = CellRun(future, output, view, blocking)
        if opts["save"]:
            self.shell.user_ns[opts["save"]] = run
        if not blocking:
            return None if opts["save"] else run
        try:
            values = run.result()
        except BaseException:
            if prof is not None:
                with contextlib.suppress(Exception):
                    prof.stop()  # the workers' profilers stop with the cell; its error is what the user sees
            raise
        finally:
            if self.stdin is not None:
                self.stdin.cell_done()
        if prof is not None:
            from monarch.profiler import show

            show(prof.stop())
        if all(v is None for v in values.values()):
            return None
        return values

    def _target(self, opts: dict) -> Any:
        from monarch.runtime.mesh import ProcMesh

        if opts["name"]:
            try:
                view = eval(opts["name"], self.shell.user_ns)
            except Exception as e:
                raise UsageError(f"%%mesh {opts['name']}: {type(e).__name__}: {e}") from None
            if not isinstance(view, ProcMesh):
                raise UsageError(
                    f"%%mesh {opts['name']}: that is a {type(view).__name__}, not a mesh; "
                    "give a ProcMesh (from this_host().spawn_procs) or a shape like gpu=4"
                )
        elif opts["sizes"]:
            view = self._implicit(opts["sizes"], opts.get("replace", False))
        elif self.implicit is not None and self.implicit.state == "running":
            view = self.implicit
        else:
            raise UsageError("%%mesh needs a shape (e.g. %%mesh gpu=4) or a mesh variable\n" + _USAGE)
        return view

    def existing_target(self, line: str) -> Any:
        """The view a ``%%mesh`` cell with this first line would run on, if its mesh runs already; else None
        (for completion: never starts a mesh, never runs code but a variable's lookup)."""
        try:
            opts = _parse_cell_args(line)
        except UsageError:
            return None
        from monarch.runtime.mesh import ProcMesh

        if opts["name"]:
            view = self.shell.user_ns.get(opts["name"]) if opts["name"].isidentifier() else None
        elif opts["sizes"]:
            implicit = self.implicit
            view = implicit if implicit is not None and implicit.sizes == opts["sizes"] else None
        else:
            view = self.implicit
        if not isinstance(view, ProcMesh) or view.state != "running":
            return None
        try:
            return _on(view, opts["on"])
        except UsageError:
            return None

    def _implicit(self, sizes: dict[str, int], replace: bool) -> Any:
        from monarch.actor import this_host

        old = self.implicit
        if old is not None and old.state == "running" and old.sizes == sizes:
            return old
        if old is not None and old.state == "running":
            if not replace:
                raise UsageError(_shape_change(old.sizes, sizes))
            old.exit()
            print(f"monarch: stopped mesh {_stopped(old)} to start {_describe(sizes)}; its namespaces are gone")
        self._ensure_controller()
        try:
            self.implicit = this_host().spawn_procs(sizes)
        except ValueError as e:
            raise UsageError(f"%%mesh: {e}") from None
        return self.implicit

    def _ensure_controller(self) -> None:
        from monarch.runtime.controller import get_controller

        get_controller()  # runs on_create, which installs our stdin

    # -- %mesh -------------------------------------------------------------------------------------
    @line_magic("mesh")
    def mesh_line(self, line: str) -> Any:
        return self._line(line)

    mesh_line.__doc__ = _line_doc()

    def _line(self, line: str) -> Any:
        try:
            args = shlex.split(line, comments=True)
        except ValueError as e:
            raise UsageError(f"%mesh: {e}\n{_LINE_USAGE}") from None
        target = None
        if "--mesh" in args:
            i = args.index("--mesh")
            if i + 1 >= len(args):
                raise UsageError("%mesh --mesh needs a mesh variable\n" + _LINE_USAGE)
            target = self._target({"name": args[i + 1], "sizes": None, "on": None})
            del args[i : i + 2]
        name, rest = (args[0], args[1:]) if args else ("status", [])
        if name in ("-h", "--help"):
            name = "help"
        if name not in _COMMANDS:
            raise UsageError(f"%mesh: unknown command {name!r}\n" + _LINE_USAGE)
        if name == "help":
            print(_help())
            return None
        view = target or self.current or self.implicit
        if name == "shutdown" and rest == ["--all"]:
            return self._shutdown_all()
        wants_names = _COMMANDS[name].args == "NAME ..."
        if wants_names and not rest:
            raise UsageError(f"%mesh {name} needs at least one variable name\n" + _LINE_USAGE)
        if rest and not wants_names:
            raise UsageError(
                f"%mesh {name} takes {_COMMANDS[name].args or 'nothing'}, not {' '.join(rest)!r}\n" + _LINE_USAGE
            )
        if view is None:
            raise UsageError(f"%mesh {name}: no mesh yet; run a %%mesh cell first (e.g. %%mesh gpu=4)")
        return getattr(self, f"_{name}")(view, rest)

    def _status(self, view: Any, rest: list[str]) -> Any:
        return view.to_table(ask=ASK_WAIT)  # busy ranks say where they are

    def _stacks(self, view: Any, rest: list[str]) -> None:
        print(view.stacks())

    def _shutdown_all(self) -> None:
        from monarch.runtime.controller import current

        controller = current()
        stopped = controller.stop_all() if controller is not None else []
        self.implicit = self.current = None
        if not stopped:
            print("monarch: no mesh was running")
        else:
            what = ", ".join(f"{m.shape.describe()} ({_workers(m.size)})" for m in stopped)
            print(f"monarch: stopped {len(stopped)} mesh{'es' if len(stopped) > 1 else ''}: {what}")

    def _shutdown(self, view: Any, rest: list[str]) -> None:
        if view.state in ("stopped", "failed"):
            print(f"monarch: mesh {_stopped(view)} was already {view.state}; nothing to stop")
        else:
            view.exit()
            print(f"monarch: stopped mesh {_stopped(view)}; its namespaces are gone")
        if self.implicit is not None and self.implicit.shares_workers_with(view):
            self.implicit = None
        self.current = None

    def _restart(self, view: Any, rest: list[str]) -> Any:
        fresh = view.respawn()
        if self.implicit is not None and self.implicit.shares_workers_with(view):
            self.implicit = fresh
        self.current = fresh
        return fresh.to_table()

    def _pull(self, view: Any, rest: list[str]) -> Any:
        from monarch.runtime import cells

        out = None
        for name in rest:
            out = cells.pull(view, name)
            self.shell.user_ns[name] = out
        return out if len(rest) == 1 else None

    def _push(self, view: Any, rest: list[str]) -> None:
        from monarch.runtime import cells

        missing = [n for n in rest if n not in self.shell.user_ns]
        if missing:
            raise UsageError(f"%mesh push: {', '.join(missing)} not defined in this notebook")
        cells.push(view, {n: self.shell.user_ns[n] for n in rest})


def _cell_number(shell: Any) -> int:
    """The number IPython shows for the running cell (``Cell In[N]``), found as IPython finds it: from the
    cell's code file. (IPython 9 counts a cell before running it, 8 after: `execution_count` is off by one.)"""
    numbers = getattr(shell.compile, "_filename_map", {})
    frame = inspect.currentframe()
    while frame is not None:
        n = numbers.get(frame.f_code.co_filename)
        if n is not None:
            return n
        frame = frame.f_back
    return shell.execution_count


def _refuse_if_busy(view: Any) -> None:
    """Ranks still running an earlier call would make this cell wait for them, silently: say so instead."""
    view.refuse_if_busy(
        "%%mesh: this cell",
        "Wait for them (a --noblock cell's handle: .result()), interrupt them (Kernel > Interrupt; a --noblock "
        "cell's handle: .interrupt()), or start a new mesh with %mesh restart (the workers' namespaces are lost).",
    )


def _describe(sizes: dict[str, int]) -> str:
    return "{" + ", ".join(f"{k}: {v}" for k, v in sizes.items()) + "}"


def _workers(n: int) -> str:
    return f"{n} worker{'s' if n != 1 else ''}"


def _stopped(view: Any) -> str:
    """``{gpu: 4} (4 workers)``: what stopping `view` stops (every worker of its spawned mesh)."""
    sizes = view.spawned_sizes
    text = f"{_describe(sizes)} ({_workers(math.prod(sizes.values()))})"
    return text if view.sizes == sizes else f"{text}, of which {view.describe()} was in use"


def _shape_change(running: dict[str, int], asked: dict[str, int]) -> str:
    """Why `%%mesh ASKED` did not replace the running mesh, and what to write instead."""
    asked_text = " ".join(f"{k}={v}" for k, v in asked.items())
    running_text = " ".join(f"{k}={v}" for k, v in running.items())
    lines = [
        f"%%mesh {asked_text}: a mesh {_describe(running)} is running, and its workers hold what your %%mesh "
        f"cells defined; {_describe(asked)} would replace it and lose that."
    ]
    renamed = {(difflib.get_close_matches(k, list(running), 1, 0.6) or [k])[0]: v for k, v in asked.items()}
    if renamed != asked and renamed == running:
        lines.append(f"Did you mean {running_text}?")
    lines.append(f"  to run on the running mesh:          %%mesh   (or %%mesh {running_text})")
    lines.append(f"  to replace it (its names are lost):  %%mesh --replace {asked_text}")
    return "\n".join(lines)


def _parse_cell_args(line: str) -> dict:
    try:
        args = shlex.split(line, comments=True)  # a `# comment` may end the line
    except ValueError as e:
        raise UsageError(f"%%mesh: {e}\n{_USAGE}") from None
    opts: dict[str, Any] = {
        "sizes": {}, "name": None, "on": {}, "noblock": False, "group": "rank", "save": None, "replace": False,
    "profile": None,
    }  # fmt: skip
    i = 0
    while i < len(args):
        a = args[i]
        if a in ("--on", "--group", "--save", "--group-outputs", "--profile"):
            if i + 1 >= len(args):
                raise UsageError(f"%%mesh {a} needs a value\n{_USAGE}")
            value = args[i + 1]
            i += 2
            if a == "--on":
                dim, index = _parse_on(value)
                opts["on"][dim] = index
            elif a == "--profile":
                opts["profile"] = value
            elif a == "--save":
                if not value.isidentifier():
                    raise UsageError(f"%%mesh --save {value!r}: not a valid variable name")
                opts["save"] = value
            else:
                if value not in ("rank", "arrival"):
                    raise UsageError(f"%%mesh --group {value!r}: use 'rank' (one area per rank) or 'arrival'")
                opts["group"] = value
            continue
        i += 1
        if a == "--noblock":
            opts["noblock"] = True
        elif a == "--block":
            opts["noblock"] = False
        elif a == "--replace":
            opts["replace"] = True
        elif a.startswith("-"):
            raise UsageError(f"%%mesh: unknown option {a!r}\n{_USAGE}")
        elif m := _DIM.match(a):
            dim, size = m.groups()
            if not size.isdigit() or int(size) < 1:
                raise UsageError(f"%%mesh {a}: the size of dimension {dim!r} must be a positive integer")
            opts["sizes"][dim] = int(size)
        elif _NAME.match(a) and opts["name"] is None:
            opts["name"] = a
        else:
            raise UsageError(f"%%mesh: cannot read {a!r}\n{_USAGE}")
    if opts["sizes"] and opts["name"]:
        raise UsageError(f"%%mesh: give a shape or a mesh variable ({opts['name']!r}), not both")
    return opts


def _parse_on(text: str) -> tuple[str, int | slice]:
    m = _DIM.match(text)
    if not m:
        raise UsageError(f"%%mesh --on {text!r}: write DIM=INDEX or DIM=START:STOP, e.g. --on gpu=0:4")
    dim, spec = m.groups()
    try:
        if ":" in spec:
            start, _, stop = spec.partition(":")
            return dim, slice(int(start) if start else None, int(stop) if stop else None)
        return dim, int(spec)
    except ValueError:
        raise UsageError(f"%%mesh --on {text!r}: {spec!r} is not an index or a START:STOP range") from None


_loaded: dict[int, MeshMagics] = {}


def notebook_mesh(shell: Any) -> Any:
    """The mesh `shell`'s last `%%mesh` cell ran on (what `%mesh` commands act on), if it still runs."""
    loaded = _loaded.get(id(shell))
    for view in (getattr(loaded, "current", None), getattr(loaded, "implicit", None)):
        if view is not None and view.state == "running":
            return view
    return None


def _on(view: Any, on: dict | None) -> Any:
    """`view` sliced by a cell's `--on` (itself without one)."""
    if not on:
        return view
    try:
        return view.slice(**on)
    except (ValueError, TypeError) as e:
        raise UsageError(f"%%mesh --on: {e}") from None


def magics_of(ip) -> MeshMagics | None:
    """The `%%mesh` magics registered with `ip` (None before the extension is loaded)."""
    return _loaded.get(id(ip))


def load(ip) -> None:
    """Register the magics and views with `ip`, and route workers' stdin through it."""
    if id(ip) in _loaded:
        return
    magics = MeshMagics(ip)
    ip.register_magics(magics)
    _loaded[id(ip)] = magics
    if magics.widgets:
        register_formatters(ip)
    from monarch.extension import supervision
    from monarch.runtime import controller as ctl

    shown = supervision.install(ip)  # (unhandled actor mesh failures, notices: in the cell the user looks at)

    def setup(controller) -> None:
        if magics.widgets:
            controller.notify = shown.print_notice
        magics.stdin = NotebookStdin(controller, magics.widgets)
        controller.stdin.prompt = magics.stdin
        if magics.widgets:
            controller.spawn_progress = NotebookProgress

    ctl.on_create.append(setup)
    if ctl.current() is not None:
        setup(ctl.current())

    def cell_done(result=None) -> None:  # a live function's call ends with its cell: its prompts are over
        if magics.stdin is not None:
            magics.stdin.cell_done()

    ip.events.register("post_run_cell", cell_done)


def unload(ip) -> None:
    _loaded.pop(id(ip), None)
