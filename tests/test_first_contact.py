"""First contact, as a new user meets it in a notebook: each paper cut of issue 11, with its message.

One real Monarch kernel driven through jupyter_client; the workers are real processes."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import tomllib

from conftest import REPO, wait_gone
from helpers.kernel_client import Kernel, monarch_kernel

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def kernel():
    with monarch_kernel() as k:
        yield k
        pids = k.worker_pids() if k.run("%mesh status").status == "ok" else []
        k.km.shutdown_kernel(now=False)
        assert wait_gone(pids) == []


def test_the_readme_example_with_a_comment_on_the_magic_line_runs_and_shows_the_start(kernel: Kernel):
    r = kernel.run("%%mesh gpu=2                         # start (or reuse) 2 workers\nkept = rank + 40\nrank")
    assert r.status == "ok", r.text()
    # the start is shown in the cell, before any output of the workers
    first = r.of("display_data", "update_display_data")
    assert first[0]["msg_type"] == "display_data"
    assert first[0]["content"]["data"]["text/plain"].startswith("monarch: starting 2 workers {gpu: 2}… ")
    done = [m for m in first if m["msg_type"] == "update_display_data" and "ready in" in str(m["content"]["data"])]
    assert re.fullmatch(r"monarch: 2 workers \{gpu: 2\} ready in \d+\.\d\d s", done[0]["content"]["data"]["text/plain"])
    assert r.msgs.index(first[0]) < r.msgs.index(r.of("execute_result")[0])
    assert kernel.run("%mesh status   # what runs where").status == "ok"
    assert kernel.run("%%mesh  # the same mesh\nprint(kept)").status == "ok"


def test_errors_that_differ_only_in_numbers_show_once_with_the_numbers_marked(kernel: Kernel):
    r = kernel.run('%%mesh\nraise ValueError(f"bad input on gpu {rank}, size {rank * 8 + 3}")')
    assert r.status == "error"
    text = r.text()
    assert "-- ranks 0-1: ValueError: bad input on gpu {0,1}, size {3,11}" in text, text
    assert "({...}: the values these ranks had)" in text
    assert text.count("Traceback (most recent call last)") == 1
    assert re.search(r"Cell In\[\d+\], line 2\n", text), text  # the editor's line: %%mesh is line 1
    # a different place is a different error, even with the same message
    r = kernel.run('%%mesh\nif rank == 0:\n    raise KeyError("x")\nraise KeyError("x")')
    assert r.text().count("Traceback (most recent call last)") == 2


def test_a_different_shape_is_refused_naming_the_running_one_and_the_flag_that_replaces_it(kernel: Kernel):
    pids = kernel.worker_pids()
    r = kernel.run("%%mesh gpus=2\nrank")
    assert r.status == "error"
    text = r.text()
    assert "UsageError" in text and "%%mesh gpus=2: a mesh {gpu: 2} is running" in text
    assert "Did you mean gpu=2?" in text and "%%mesh --replace gpus=2" in text, text
    assert kernel.worker_pids() == pids
    r = kernel.run("%%mesh gpu=3\nrank")
    assert r.status == "error" and "Did you mean" not in r.text() and "%%mesh --replace gpu=3" in r.text()
    r = kernel.run("%%mesh\nkept")  # nothing was lost
    assert r.status == "ok" and "40" in r.text() and "41" in r.text()


def test_shutdown_and_replace_say_what_they_stopped(kernel: Kernel):
    pids = kernel.worker_pids()
    r = kernel.run("%%mesh --replace gpu=3\nrank")
    assert r.status == "ok", r.text()
    assert "monarch: stopped mesh {gpu: 2} (2 workers) to start {gpu: 3}; its namespaces are gone" in r.text()
    assert wait_gone(pids) == []
    pids = kernel.worker_pids()
    r = kernel.run("%mesh shutdown")
    assert r.status == "ok" and "monarch: stopped mesh {gpu: 3} (3 workers); its namespaces are gone" in r.text()
    assert wait_gone(pids) == []
    assert "monarch: no mesh was running" in kernel.run("%mesh shutdown --all").text()
    assert kernel.run("%%mesh gpu=2\nkept = rank + 40").status == "ok"


LIVE = """import monarch, torch
mesh = get_ipython().run_line_magic("mesh", "status").mesh

@monarch.remote
def check(x):
    rank = torch.distributed.get_rank()
    if rank == 1:
        raise ValueError(f"rank {rank} says no to {x}")
    return x
"""


def test_a_live_functions_traceback_names_its_notebook_cell(kernel: Kernel):
    assert kernel.run(LIVE).status == "ok"
    r = kernel.run("check.on(mesh)(5)")
    assert r.status == "error"
    text = r.text()
    assert "ValueError: rank 1 says no to 5" in text
    assert re.search(r"Cell In\[\d+\], line 8, in check\n", text), text
    assert "ipykernel_" not in text


def test_q_in_a_live_function_ends_that_ranks_call_quietly_and_the_debugger_view_clears(kernel: Kernel):
    code = (
        "@monarch.remote\ndef paused():\n    rank = torch.distributed.get_rank()\n"
        "    if rank == 0:\n        breakpoint()\n    return rank\npaused.on(mesh)()"
    )
    r = kernel.run(code, allow_stdin=True, stdin_hook=lambda msg: kernel.kc.input("q"))
    assert r.status == "ok", r.text()
    (result,) = r.of("execute_result")
    assert result["content"]["data"]["text/plain"].splitlines()[-2:] == ["gpu=0        None", "gpu=1        1"]
    opened = [m for m in r.of("comm_open") if m["content"]["data"]["state"].get("_esm", "").count("pdb:")]
    assert opened and opened[0]["content"]["data"]["state"]["active"] == "gpu=0"
    view = opened[0]["content"]["comm_id"]
    final = dict(opened[0]["content"]["data"]["state"])
    for m in r.of("comm_msg"):
        if m["content"]["comm_id"] == view:
            final.update(m["content"]["data"].get("state", {}))
    assert (final["active"], final["paused"], final["where"]) == ("", [], "")  # the call ended: nobody paused


def test_workers_are_named_in_ps(kernel: Kernel):
    mesh_line = kernel.run("%mesh status").text()
    for rank, pid in enumerate(kernel.worker_pids()):
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            title = f.read().split(b"\0")[0].decode()
        assert re.fullmatch(rf"monarch worker gpu={rank} mesh \d+", title), (title, mesh_line)
        with open(f"/proc/{pid}/comm") as f:
            assert f.read().strip() == f"monarch gpu={rank}"


def test_numpy_is_a_dependency_so_torch_does_not_warn_at_import():
    """A fresh venv with our dependencies has numpy (else torch prints "Failed to initialize NumPy")."""
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        deps = tomllib.load(f)["project"]["dependencies"]
    assert any(re.match(r"numpy\b", d) for d in deps)
    out = subprocess.run([sys.executable, "-c", "import torch"], capture_output=True, text=True, timeout=60)
    assert "NumPy" not in out.stderr


def test_a_script_hears_of_a_slow_start():
    script = (
        "from monarch.runtime.controller.progress import TerminalProgress\n"
        "TerminalProgress.AFTER = 0  # (a real start says something only after a second)\n"
        "from monarch.actor import this_host\n"
        "mesh = this_host().spawn_procs({'gpu': 2})\nmesh.exit()\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = out.stderr.splitlines()
    assert lines[0].startswith("monarch: starting 2 workers {gpu: 2}… ") and lines[0].endswith("/2 ready")
    assert re.fullmatch(r"monarch: 2 workers \{gpu: 2\} ready in \d+\.\d\d s", lines[-1]), lines


def test_show_names_a_worker_that_is_not_there(kernel: Kernel):
    r = kernel.run("with mesh.activate():\n    t = torch.ones(2) * 3\nmonarch.show(t, gpu=5)")
    assert r.status == "error" and "show: no worker at gpu=5; the tensor is on mesh {gpu: 2}" in r.text()


def test_pdb_counts_lines_as_the_editor_does(kernel: Kernel):
    r = kernel.run(
        "%%mesh --on gpu=0\nx = 1\nbreakpoint()\ny = 2",
        allow_stdin=True,
        stdin_hook=lambda msg: kernel.kc.input("c"),
    )
    assert r.status == "ok", r.text()
    assert re.search(r"> Cell In\[\d+\], line 4\n\[gpu=0\] -> y = 2", r.text()), r.text()
