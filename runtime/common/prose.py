"""Our messages as a notebook shows them: wrapped at spaces to a width an output area holds.

JupyterLab draws output text with `word-break: break-all`: a line longer than its output area is broken
wherever it reaches the edge, mid-word ("w/hat", "run/ning"). At 1,000 px with the file browser open an
output area holds about 72 columns; lines of ours no longer than `WIDTH` are never broken there.
"""

from __future__ import annotations

import textwrap

WIDTH = 68
"""Columns a line of our messages takes at most, its indent included."""


def fit(text: str, width: int = WIDTH) -> str:
    """`text` with each line of prose longer than `width` wrapped at spaces, its indent kept (a ``-- ranks
    0-3: ...`` line's rest under its text). Lines of code are left as they are: those indented four or more
    (a traceback's source lines) and a traceback's ``File ...`` lines."""
    out: list[str] = []
    for line in text.split("\n"):
        stripped = line.lstrip(" ")
        indent = line[: len(line) - len(stripped)]
        if len(line) <= width or len(indent) >= 4 or stripped.startswith("File "):
            out.append(line)
            continue
        more = indent + ("   " if stripped.startswith("-- ") else "")
        out += textwrap.wrap(
            stripped,
            width,
            initial_indent=indent,
            subsequent_indent=more,
            break_long_words=False,
            break_on_hyphens=False,
        )
    return "\n".join(out)
