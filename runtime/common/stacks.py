"""Where a process's threads are: their Python stacks as a user reads them (for `mesh.stacks()`, the
controller's and every worker's, and for the hang report).

A worker's control thread collects its stacks (`thread_stacks`) while the main thread is busy, even
stuck in a collective's C code, where no signal handler of Python would run.
"""

from __future__ import annotations

import linecache
import os
import re
import shutil
import subprocess
import sys
import threading
from dataclasses import dataclass, field

from monarch.runtime.common.errors import cell_frame
from monarch.runtime.common.shape import format_ranks

_RUNTIME = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_THREADING = threading.__file__
_PLUMBING = tuple(
    f"{os.sep}{name}{os.sep}" for name in ("ipykernel", "IPython", "tornado", "asyncio", "zmq", "traitlets",
                                           "jupyter_client", "concurrent", "multiprocessing")
) + ("selectors.py", "runpy")  # fmt: skip
"""Frames of the machinery around user code (the kernel's event loop, sockets): left out of stacks."""

Frame = tuple[str, str]
"""(where, source line): ``("Cell In[5], line 4", "dist.all_reduce(t)")``."""


def _shown(filename: str) -> bool:
    """Whether a frame of `filename` is the user's (or torch's): not the runtime's nor the machinery's."""
    return not filename.startswith(_RUNTIME) and filename != _THREADING and not any(p in filename for p in _PLUMBING)


def where(filename: str, line: int, func: str) -> str:
    """A line as a notebook user reads it: `Cell In[5], line 4` for a %%mesh cell or (in the notebook's own
    process) code typed in notebook cell 5, as IPython names it; `train.py:12 in step` for a file."""
    return cell_frame(filename, line, func) or f"{filename}:{line} in {func}"


def thread_stacks(skip: int | None = None) -> list[tuple[str, list[Frame]]]:
    """(thread name, frames outermost first) for each thread of this process but `skip` (a thread id), the
    main thread first. The runtime's own frames and the kernel's machinery are left out: a thread left
    with none is left out too, but for the main thread, whose empty stack means "idle"."""
    names = {t.ident: t.name for t in threading.enumerate()}
    main = threading.main_thread().ident
    out = []
    for ident, frame in sorted(sys._current_frames().items(), key=lambda kv: kv[0] != main):
        if ident == skip:
            continue
        frames = []
        while frame is not None:
            code = frame.f_code
            name = code.co_filename
            if _shown(name):
                line = frame.f_lineno or 0  # (None for a frame caught between two instructions)
                frames.append((where(name, line, code.co_name), linecache.getline(name, line).strip()))
            frame = frame.f_back
        if frames and frames[-1][0] == "<string>:1 in <module>":  # (a process's bootstrap: python -c)
            frames.pop()
        if frames or ident == main:
            out.append((names.get(ident, f"thread {ident}"), frames[::-1]))
    return out


def pyspy() -> str | None:
    """py-spy beside this interpreter (a virtual environment's, which Jupyter starts without putting its bin/
    on PATH), else on PATH; None where it is not installed."""
    beside = os.path.join(os.path.dirname(sys.executable), "py-spy")
    return beside if os.access(beside, os.X_OK) else shutil.which("py-spy")


def pyspy_threads(pid: int, timeout: float = 10.0) -> list[tuple[str, list[Frame]]] | None:
    """`thread_stacks` of process `pid` read from outside by py-spy (for a process whose own threads
    cannot answer: one holds the GIL in C code), or None where py-spy is not installed or cannot attach."""
    exe = pyspy()
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, "dump", "--pid", str(pid), "--full-filenames"], capture_output=True, text=True,
                             timeout=timeout)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    threads: list[tuple[str, list[Frame]]] = []
    for line in out.stdout.splitlines():
        head = re.match(r'Thread \S+ \((.*?)\): "(.*)"', line)
        if head:
            threads.append((f"{head.group(2)} (seen by py-spy: {head.group(1)})", []))
            continue
        frame = re.match(r"\s+(\S+) \((.+):(\d+)\)$", line)
        if frame and threads:
            func, name, lineno = frame.group(1), frame.group(2), int(frame.group(3))
            if _shown(name):
                threads[-1][1].insert(0, (where(name, lineno, func), linecache.getline(name, lineno).strip()))
    return [t for t in threads if t[1] or t[0].startswith("MainThread")] or None


@dataclass
class StackReport:
    """The stacks of a mesh's workers (and of the controller), as `mesh.stacks()` returns them; its text
    groups identical stacks with their ranks."""

    controller: list[tuple[str, list[Frame]]]
    """The controller's threads (main first)."""
    ranks: dict[int, list[tuple[str, list[Frame]]] | None]
    """Rank -> its threads, or None where the rank did not answer in time."""
    labels: dict[int, str] = field(default_factory=dict)
    """Rank -> its coordinates, ``gpu=3``."""

    def __str__(self) -> str:
        lines = [f"controller (pid {os.getpid()}):"]
        lines += _threads(self.controller)
        groups: dict[tuple, list[int]] = {}
        for rank, threads in sorted(self.ranks.items()):
            key = tuple((name, tuple(frames)) for name, frames in threads) if threads is not None else None
            groups.setdefault(key, []).append(rank)
        for key, ranks in groups.items():
            who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {format_ranks(ranks)}"
            if len(ranks) == 1 and ranks[0] in self.labels:
                who += f" ({self.labels[ranks[0]]})"
            if key is None:
                lines.append(
                    f"-- {who}: no answer (its control thread could not run: a thread holds the GIL?"
                    + (")" if pyspy() else "; pip install py-spy to see where it is)")
                )
                continue
            lines.append(f"-- {who}:")
            lines += _threads([(name, list(frames)) for name, frames in key])
        return "\n".join(lines)

    __repr__ = __str__


def _threads(threads: list[tuple[str, list[Frame]]]) -> list[str]:
    out = []
    for name, frames in threads:
        if not frames:
            out.append(f"  {name}: idle")
            continue
        out.append(f"  {name}:")
        for at, source in frames:
            out.append(f"    {at}" + (f"\n        {source}" if source else ""))
    return out
