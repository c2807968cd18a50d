"""Help where a newcomer looks for it: `%mesh?`, `%%mesh?`, `%mesh help`, `help(monarch)` (issue 27, item 5)."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from monarch.extension.magics import LINE_COMMANDS
from monarch.runtime.common import prose

from conftest import REPO
from helpers.kernel_client import monarch_kernel


def _page(reply: dict) -> str:
    """The text IPython's pager got (`%mesh?` answers with a page payload, not a stream)."""
    return "".join(p["data"].get("text/plain", "") for p in reply.get("payload", []) if p.get("source") == "page")


@pytest.mark.timeout(90)
def test_the_magics_explain_themselves_in_the_kernel():
    with monarch_kernel() as k:
        line = k.run("%mesh?")
        assert line.status == "ok", line.text()
        page = _page(line.reply)
        assert "<no docstring>" not in page
        flat = " ".join(page.split())  # (descriptions are wrapped to fit an output area)
        for command in LINE_COMMANDS:
            assert f"%mesh {command.name} {command.args}".strip() in page and command.does in flat, page
        cell = k.run("%%mesh?\n")
        page = _page(cell.reply)
        assert "Run this cell on every worker of a mesh" in page and "--noblock" in page, page
        told = k.run("%mesh help")
        assert told.status == "ok", told.text()
        text = told.text()
        assert "%mesh status" in text and "%%mesh gpu=8 --on gpu=0:4" in text, text
        # no line longer than an output area holds at 1,000 px (JupyterLab would break it mid-word)
        assert [line for line in text.splitlines() if len(line) > prose.WIDTH] == [], text
        wrong = k.run("%mesh halp")
        assert wrong.status == "error" and "unknown command 'halp'" in wrong.text() and "push NAME" in wrong.text()
        extra = k.run("%mesh stacks now")
        assert extra.status == "error" and "%mesh stacks takes nothing, not 'now'" in extra.text(), extra.text()


def test_the_docs_table_of_mesh_commands_lists_each_declared_command_once():
    """docs/features/mesh-cells.md's table of `%mesh` commands, row by row, against `LINE_COMMANDS`."""
    with open(f"{REPO}/docs/features/mesh-cells.md") as f:
        text = f.read()
    section = text[text.index("## `%mesh`") :]
    section = section[: section.index("\n## ", 1)]
    rows = re.findall(r"^\| `%mesh (\w+)[^`]*`", section, re.M)
    rows += re.findall(r"^\| `%mesh` or `%mesh (\w+)`", section, re.M)
    assert sorted(rows) == sorted(c.name for c in LINE_COMMANDS)


def test_bench_help_prints_its_options_and_runs_nothing():
    out = subprocess.run(
        [sys.executable, "benchmarks/run.py", "--help"], capture_output=True, text=True, timeout=60, cwd=REPO
    )
    assert out.returncode == 0, out.stderr
    assert "usage: ./run bench" in out.stdout and "--before REV" in out.stdout and "--actors" in out.stdout
    assert "machine:" not in out.stdout  # (nothing was measured)


def test_help_of_monarch_starts_with_how_to_begin_and_stays_short():
    code = (
        "import pydoc, monarch, torch\n"
        "monarch.Tensor, monarch.ProcMesh, monarch.Simulator, monarch.inspect  # (loaded, as after some use)\n"
        "print(pydoc.render_doc(monarch, renderer=pydoc.plaintext))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert out.returncode == 0, out.stderr
    text = out.stdout
    head = text[: text.index("PACKAGE CONTENTS")] if "PACKAGE CONTENTS" in text else text[:2000]
    assert "spawn_procs" in head and "%%mesh" in head, head
    assert "Methods inherited from torch" not in text  # torch.Tensor's 200 KB of methods
    assert len(text) < 60_000, f"help(monarch) is {len(text):,} characters"
