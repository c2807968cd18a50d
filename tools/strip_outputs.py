"""Git's clean filter for the tracked notebooks (`.gitattributes`; `./run setup` configures it): a notebook as
git should store it, without what running and saving it in JupyterLab adds (outputs, execution counts, the
kernel's full language_info, widget state, timing). The file on disk keeps its outputs, `git status` stays clean
and a commit holds the notebook as written.

    python tools/strip_outputs.py < notebook.ipynb > stripped.ipynb

Standard library only: git runs it for every notebook it looks at."""

from __future__ import annotations

import json
import sys
from typing import Any

CELL_METADATA = ("execution", "collapsed", "scrolled", "ExecuteTime")
"""Cell metadata that JupyterLab writes as the notebook runs or is looked at, never part of what is written."""


def strip(nb: dict[str, Any]) -> dict[str, Any]:
    """`nb` (nbformat 4, as parsed JSON) without outputs and what a run adds; changed in place, and returned."""
    for cell in nb.get("cells", []):
        if cell.get("cell_type") == "code":
            cell["outputs"] = []
            cell["execution_count"] = None
        metadata = cell.get("metadata", {})
        for key in CELL_METADATA:
            metadata.pop(key, None)
    metadata = nb.get("metadata", {})
    metadata.pop("widgets", None)
    info = metadata.get("language_info")
    if isinstance(info, dict) and "name" in info:
        metadata["language_info"] = {"name": info["name"]}
    return nb


def dumps(nb: dict[str, Any]) -> str:
    """As nbformat (and so JupyterLab) writes a notebook: sorted keys, one space of indent, a final newline."""
    return json.dumps(nb, sort_keys=True, indent=1, ensure_ascii=False) + "\n"


def main() -> None:
    data = sys.stdin.buffer.read()
    try:
        nb = json.loads(data)
    except ValueError:  # (not a notebook: git stores it as it is; a broken file is the author's to see)
        sys.stdout.buffer.write(data)
        return
    sys.stdout.buffer.write(dumps(strip(nb)).encode("utf-8"))


if __name__ == "__main__":
    main()
