"""A worker's last words: where its Python code was when the process crashed (SIGABRT, SIGSEGV, ...).

A worker's stderr goes to the controller through a pipe its own thread reads, so what a crashing process writes
last is lost with it, and the user reads only "aborted (SIGABRT)". Each worker has Python's `faulthandler` write
its threads' stacks to a file of its own in its mesh's private directory (`enable`); the process that watches it
(the controller's, or a host agent's, `WorkerProcs`) reads the crashing thread's place from there (`read`) and
says it with the cause of death.
"""

from __future__ import annotations

import faulthandler
import os
import re
from collections.abc import Callable

_FILE = re.compile(r'^\s+File "(.*)", line (\d+) in (.*)$')
_RUNTIME = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
"""This runtime's folder (in a checkout it is not under a `monarch` folder)."""
_kept: list = []  # (the open file: faulthandler writes to it when the process crashes)


def path(directory: str, mesh_id: int, rank: int) -> str:
    return os.path.join(directory, f"last-words-{mesh_id}-{rank}")


def enable(directory: str, mesh_id: int, rank: int) -> None:
    """Have `faulthandler` write this process's stacks to its file if it crashes (call first thing in a worker)."""
    try:
        f = open(path(directory, mesh_id, rank), "w")  # noqa: SIM115  (open for the process's life)
    except OSError:
        return
    _kept.append(f)
    faulthandler.enable(file=f, all_threads=True)


def read(directory: str, mesh_id: int, rank: int, name: Callable[[str, int, str], str | None] | None = None) -> str:
    """Where the crashed worker's failing thread was, as words to follow its cause of death (" in f (file, line
    N), called from g (...)": the innermost frame, and the innermost of the user's code if that is another);
    "" if it wrote nothing (it did not crash, or not in Python). `name(file, line, function)`, if given, names a
    notebook cell's frame as the notebook does (`errors.cell_frame`)."""
    try:
        with open(path(directory, mesh_id, rank), errors="replace") as f:
            text = f.read(1 << 16)
    except OSError:
        return ""
    frames: list[tuple[str, str, str]] = []
    current = False
    for line in text.splitlines():
        if line.startswith("Current thread"):
            current = True
        elif current and (m := _FILE.match(line)):
            frames.append((m.group(1), m.group(2), m.group(3)))
        elif current and frames and not line.strip():
            break
    if not frames:
        return ""
    places = [_place(frames[0], name)]
    mine = next((f for f in frames if _users(f[0])), None)
    if mine is not None and mine is not frames[0]:
        places.append(_place(mine, name))
    return " in " + ", called from ".join(places)


def _place(frame: tuple[str, str, str], name: Callable[[str, int, str], str | None] | None) -> str:
    file, line, fn = frame
    named = name(file, int(line), fn) if name is not None else None
    if named:
        return named
    return f"{fn} ({file if _users(file) else os.path.basename(file)}, line {line})"


def _users(file: str) -> bool:
    """Whether `file` is the user's code (not the standard library's, an installed package's, or the runtime's)."""
    return not (
        "site-packages" in file
        or "dist-packages" in file
        or "/lib/python" in file
        or f"{os.sep}monarch{os.sep}" in file
        or file.startswith(_RUNTIME + os.sep)
        or file.startswith("<")
    )


def forget(directory: str, mesh_id: int, ranks: list[int]) -> None:
    for rank in ranks:
        try:
            os.unlink(path(directory, mesh_id, rank))
        except OSError:
            pass
