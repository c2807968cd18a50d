"""The Monarch kernel driven through jupyter_client: %%mesh cells, errors, interrupt, pdb, shutdown."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import re
import signal
import subprocess
import sys
import tempfile
import time

import pytest

from conftest import started, wait_for, wait_gone
from helpers.kernel_client import Kernel, Result, monarch_kernel

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def kernel():
    with monarch_kernel() as k:
        r = k.run("%%mesh gpu=4\nimport os\nos.getpid()")
        assert r.status == "ok", r.text()
        pids = k.worker_pids()
        yield k
        k.km.shutdown_kernel(now=False)
        assert wait_gone(pids, 10) == []


def _ranks_in_order(text: str) -> list[str]:
    return [m.group(1) for m in re.finditer(r"^\[(gpu=\d)\]", text, re.M)]


def test_output_per_rank(kernel: Kernel):
    code = "%%mesh\nimport time\nfor i in range(3):\n    print(f'line {i} of rank {rank}', flush=True)\ntime.sleep(0.6)\nrank * 10"
    r = kernel.run(code)
    assert r.status == "ok", r.text()
    live = r.custom_items()
    assert live, "no live output reached the per-rank view"
    # live chunks carry only new text, each for one rank
    for it in live:
        assert it["l"] == f"gpu={it['r']}" and f"of rank {it['r']}" in it["t"]
    assert sum(it["t"].count("\n") for it in live) == 12
    # when the cell ends, one static area per rank replaces the live view: grouped, not interleaved
    (final,) = r.final_outputs()
    text = final["text/plain"]
    assert _ranks_in_order(text) == [f"gpu={g}" for g in range(4) for _ in range(3)]
    for g in range(4):
        assert f'data-label="gpu={g}"' in final["text/html"]
        assert f"[gpu={g}] line 2 of rank {g}" in text
    (result,) = r.of("execute_result")
    assert "gpu=3        30" in result["content"]["data"]["text/plain"]
    assert "application/vnd.jupyter.widget-view+json" in result["content"]["data"]


def test_namespace_persists_and_predefined_names(kernel: Kernel):
    assert kernel.run("%%mesh\ny = rank + 1").status == "ok"
    r = kernel.run("%%mesh\n(y, coords, str(device), mesh_size)")
    assert r.status == "ok", r.text()
    out = r.of("execute_result")[0]["content"]["data"]["text/plain"]
    assert "(3, {'gpu': 2}, 'cpu', 4)" in out


def test_errors_grouped_with_ranks(kernel: Kernel):
    r = kernel.run("%%mesh\ndef f(x):\n    return 1 / x\nf(rank % 2)")
    assert r.status == "error"
    (err,) = r.of("error")
    tb = "\n".join(err["content"]["traceback"])
    assert "failed on 2 of 4 ranks" in tb
    assert tb.count("ZeroDivisionError: division by zero") == 2  # header + traceback, once for ranks 0, 2
    assert "ranks 0, 2" in tb
    assert "return 1 / x" in tb  # the cell's source line
    assert kernel.run("%%mesh\nrank").status == "ok"  # workers survived


def test_rich_display_labelled_by_rank(kernel: Kernel):
    r = kernel.run(
        "%%mesh --on gpu=0:2\nimport matplotlib.pyplot as plt\nplt.plot([0, rank])\n"
        "from IPython.display import HTML, display\ndisplay(HTML(f'<i>html from {rank}</i>'))\nNone"
    )
    assert r.status == "ok", r.text()
    html = r.final_outputs()[0]["text/html"]
    areas = dict(
        re.findall(r'<div class="monarch-rank" data-label="(gpu=\d)">(.*?)(?=<div class="monarch-rank" |$)', html)
    )
    assert sorted(areas) == ["gpu=0", "gpu=1"]
    for g in range(2):
        assert areas[f"gpu={g}"].count('class="monarch-figure"') == 1  # the figure, in the theme's colours
        assert "currentColor" in areas[f"gpu={g}"] and "#000000" not in areas[f"gpu={g}"]
        assert f"<i>html from {g}</i>" in areas[f"gpu={g}"]


def test_group_by_arrival(kernel: Kernel):
    r = kernel.run("%%mesh --group arrival\nprint('hi', rank)")
    assert r.status == "ok"
    streamed = "".join(m["content"]["text"] for m in r.of("stream"))
    assert sorted(streamed.splitlines()) == [f"[gpu={g}] hi {g}" for g in range(4)]


def test_mesh_line_status_pull_push(kernel: Kernel):
    r = kernel.run("%mesh")
    data = r.of("execute_result")[0]["content"]["data"]
    assert "monarch-mesh-table" in data["text/html"] and data["text/plain"].count(" idle ") == 4
    assert kernel.run("z = 'pushed'\n%mesh push z").status == "ok"
    assert kernel.run("%%mesh\nz2 = z + str(rank)").status == "ok"
    assert kernel.run("%mesh pull z2").status == "ok"
    assert kernel.value("z2.values()") == [f"pushed{g}" for g in range(4)]
    bad = kernel.run("%mesh pull nope")
    assert bad.status == "error" and "'nope' is not defined in this worker's namespace" in bad.text()
    # after a cell on a slice, `%mesh` still shows the whole mesh
    assert kernel.run("%%mesh --on gpu=0:2\nrank").status == "ok"
    rows = kernel.run("%mesh").of("execute_result")[0]["content"]["data"]["text/plain"]
    assert rows.count(" idle ") == 4, rows


@pytest.mark.parametrize(
    "line, message",
    [
        ("%%mesh gpu=x", "the size of dimension 'gpu' must be a positive integer"),
        ("%%mesh --on gpu=7", "out of range"),
        ("%%mesh --on gpu", "write DIM=INDEX or DIM=START:STOP"),
        ("%%mesh --group sideways", "use 'rank' (one area per rank) or 'arrival'"),
        ("%%mesh --frobnicate", "unknown option '--frobnicate'"),
        ("%%mesh not_defined", "NameError"),
        ("%%mesh os", "not a mesh"),
        ("%mesh explode", "unknown command 'explode'"),
    ],
)
def test_bad_arguments(kernel: Kernel, line: str, message: str):
    kernel.run("import os")
    r = kernel.run(f"{line}\nprint(1)")
    assert r.status == "error"
    assert message in r.text()


def test_completion_in_a_mesh_cell_offers_the_workers_names(kernel: Kernel):
    assert kernel.run("%%mesh\nworker_only_name = rank").status == "ok"
    got = kernel.complete("%%mesh\nx = worker_o")
    assert got["status"] == "ok" and got["matches"] == ["worker_only_name"], got
    assert (got["cursor_start"], got["cursor_end"]) == (len("%%mesh\nx = "), len("%%mesh\nx = worker_o"))
    assert "mesh_size" in kernel.complete("%%mesh\nmesh_si")["matches"]  # set on the workers before each cell
    assert "bit_length" in kernel.complete("%%mesh\nworker_only_name.bit_l")["matches"][0]  # attributes too
    # outside a %%mesh cell (and on its first line) the kernel's own names, as IPython completes them
    assert "worker_only_name" not in kernel.complete("worker_o")["matches"]
    assert "worker_only_name" not in kernel.complete("%%mesh worker_o\n", len("%%mesh worker_o"))["matches"]
    # a mesh that does not run yet is not started by a completion
    assert "worker_only_name" not in kernel.complete("%%mesh gpu=3\nworker_o")["matches"]
    assert kernel.value("len(get_ipython().run_line_magic('mesh', 'status').rows)") == 4


def test_interrupt_stops_busy_workers_and_they_survive(kernel: Kernel, tmp_path):
    pids = kernel.worker_pids()
    marker = str(tmp_path / "sleeping")
    kernel.interrupt_when(lambda: started(marker, 4), "the cell sleeping on every rank")
    code = f"%%mesh\nimport time; open({marker!r} + f'.{{rank}}', 'w').close()\nprint('sleeping', flush=True)\ntime.sleep(60)"
    r = kernel.run(code, timeout=30)
    assert r.status == "error"
    tb = r.text()
    assert "KeyboardInterrupt" in tb and "interrupted" in tb and "time.sleep(60)" in tb and "ranks 0-3" in tb
    assert kernel.worker_pids() == pids
    assert kernel.run("%%mesh\nrank").status == "ok"


def test_pdb_served_one_rank_after_another(kernel: Kernel):
    prompts: list[str] = []
    answers = {"gpu=0": iter(["p rank * 100", "c"]), "gpu=1": iter(["p rank * 100", "n", "c"])}

    def stdin_hook(msg):
        prompt = msg["content"]["prompt"]
        prompts.append(prompt)
        kernel.kc.input(next(answers[prompt[1:6]]))

    r = kernel.run(
        "%%mesh --on gpu=0:2\nv = rank\nbreakpoint()\nv += 1\nprint('resumed', v)",
        allow_stdin=True,
        stdin_hook=stdin_hook,
    )
    assert r.status == "ok", r.text()
    assert all(p.endswith("(Pdb) ") for p in prompts)
    labels = [p[1:6] for p in prompts]
    # one rank's session is served whole before the other's starts
    switch = [i for i in range(1, len(labels)) if labels[i] != labels[i - 1]]
    assert len(switch) == 1 and len(labels) == 5, labels
    final = r.final_outputs()[0]["text/plain"]
    assert "[gpu=0] 0" in final and "[gpu=1] 100" in final and "[gpu=1] resumed 2" in final
    assert re.search(r"\[gpu=0\] > Cell In\[\d+\], line 4\n\[gpu=0\] -> v \+= 1", final), final  # where it stopped
    assert any(m["msg_type"] == "comm_open" and "DebuggerView" in json.dumps(m["content"]) for m in r.msgs)


def _debugger_states(r) -> list[dict]:
    """Each state the cell's DebuggerView had (opened, then changed), in order."""
    opened = [m for m in r.of("comm_open") if "pdb:" in m["content"]["data"]["state"].get("_esm", "")]
    assert len(opened) == 1, opened
    state = dict(opened[0]["content"]["data"]["state"])
    states = [dict(state)]
    for m in r.of("comm_msg"):
        if m["content"]["comm_id"] == opened[0]["content"]["comm_id"]:
            state.update(m["content"]["data"].get("state", {}))
            states.append(dict(state))
    return states


def test_pdb_names_frames_as_ipython_does_and_its_view_says_where_not_the_prompt(kernel: Kernel):
    """pdb's frame lines and `where` name a %%mesh cell's frame `Cell In[N], line L` (as grouped errors do), a
    live function typed in the notebook by its cell too, and leave out the worker's own frames; the debugger
    view says where the rank is paused, with no stray `(Pdb)` prompt in it."""
    answers = iter(["where", "c", "where", "c"])
    r = kernel.run(
        "%%mesh --on gpu=0\ndef f(x):\n    breakpoint()\n    return x\nf(rank)",
        allow_stdin=True,
        stdin_hook=lambda msg: kernel.kc.input(next(answers)),
    )
    assert r.status == "ok", r.text()
    n = r.reply["execution_count"]
    text = r.final_outputs()[0]["text/plain"]
    assert f"[gpu=0] > Cell In[{n}], line 4, in f()\n[gpu=0] -> return x" in text, text
    assert f"[gpu=0]   Cell In[{n}], line 5\n[gpu=0] -> f(rank)" in text, text  # `where`: the caller, outermost
    assert "<mesh cell" not in text and "forkserver" not in text and "worker.py" not in text, text
    states = _debugger_states(r)
    assert states[0]["active"] == "gpu=0" and states[0]["where"] == f"Cell In[{n}], line 4", states
    assert not any("Pdb" in json.dumps(st) for st in states), states
    r = kernel.run(
        "import monarch\n@monarch.remote\ndef g():\n    breakpoint()\n    return 1\n"
        "g.on(get_ipython().run_line_magic('mesh', 'status').mesh.slice(gpu=0))()",
        allow_stdin=True,
        stdin_hook=lambda msg: kernel.kc.input(next(answers)),
    )
    assert r.status == "ok", r.text()
    n = r.reply["execution_count"]
    assert f"[gpu=0] > Cell In[{n}], line 5, in g()" in r.text(), r.text()
    assert "ipykernel_" not in r.text(), r.text()


def test_stacks_name_the_controllers_notebook_frames_by_their_cell(kernel: Kernel):
    r = kernel.run(
        "def where_am_i():\n    return str(get_ipython().run_line_magic('mesh', 'status').mesh.stacks())\n"
        "print(where_am_i())"
    )
    assert r.status == "ok", r.text()
    n = r.reply["execution_count"]
    controller = r.text().split("\n-- rank", 1)[0]
    assert f"Cell In[{n}], line 3\n        print(where_am_i())" in controller, controller
    assert f"Cell In[{n}], line 2, in where_am_i\n" in controller, controller
    assert "ipykernel_" not in controller and "runtime/" not in controller, controller


def _said_by_each(kernel: Kernel, seen: Result, ranks: int = 4) -> dict[int, str]:
    """What each rank's area showed on stderr, once the line that ends a --noblock run saved as `job` is in every
    area (`seen`: `kernel.everything()`, since it may come between two cells)."""

    def said() -> dict[int, str]:
        items = seen.custom_items()
        return {g: "".join(it["t"] for it in items if it["r"] == g and it["s"] == "stderr") for g in range(ranks)}

    def ended() -> bool:
        return all("[this run" in t for t in said().values()) or kernel.run("job.done()").status != "ok"

    wait_for(ended, 30, "the line saying the run ended, in each rank's area")
    return said()


def _the_one_traceback(said: dict[int, str], ranks) -> int:
    """The rank whose area shows the traceback its failed `ranks` share: once, in one area."""
    counts = [said[g].count("Traceback") for g in ranks]
    assert sorted(counts) == [0] * (len(counts) - 1) + [1], said
    return counts.index(1)


def test_an_interrupted_noblock_run_shows_each_traceback_once_with_its_ranks(kernel: Kernel, tmp_path):
    """Ranks 0-2 stop at the interrupt while rank 3 waits for them in a barrier: their identical tracebacks are
    shown once, with their ranks and the cell named as IPython names it, as a blocking cell's error is."""
    marker = str(tmp_path / "started")
    code = (
        "%%mesh --noblock --save job\nimport time, torch.distributed as dist\n"
        f"open({marker!r} + f'.{{rank}}', 'w').close()\n"
        "if rank == 3:\n    dist.barrier()\nelse:\n    time.sleep(60)"
    )
    with kernel.everything() as seen:
        r = kernel.run(code)
        assert r.status == "ok", r.text()
        n = r.reply["execution_count"]
        wait_for(lambda: started(marker, 4), 30, "the run starting on every rank")
        # Rank 3 must be in the barrier's C code as the interrupt comes (before it, a KeyboardInterrupt stops it too)
        waits = "[w for b in job.mesh.busy(ask=5) for r, w in b.waits.items() if r == 3]"
        wait_for(lambda: "['barrier']" in kernel.run(waits).text(), 30, "rank 3 waiting in its barrier")
        stopped = kernel.run(
            "job.interrupt()\nimport contextlib\nwith contextlib.suppress(Exception):\n    job.result()"
        )
        assert stopped.status == "ok", stopped.text()
        said = _said_by_each(kernel, seen)
    # (on a quiet machine the three arrive together: "-- ranks 0-2" under gpu=0; one that comes `RELEASE_FIRST`
    # after the first is shown apart, pointing to the same traceback)
    first = _the_one_traceback(said, range(3))
    assert re.match(r"-- ranks? [^:]+: KeyboardInterrupt:\nTraceback", said[first]), said
    assert f"Cell In[{n}], line 7\n    time.sleep(60)" in said[first] and "<mesh cell" not in said[first], said
    for g in {0, 1, 2} - {first}:
        assert re.match(rf"-- ranks? [^:]+: KeyboardInterrupt \(shown once, under gpu={first}\)\n", said[g]), said
    assert "KeyboardInterrupt" not in said[3].split("[this run", 1)[0], said  # rank 3 was released, not interrupted
    assert kernel.run("%%mesh\nrank").status == "ok"


def test_a_rank_failing_after_the_others_were_shown_points_to_their_traceback(kernel: Kernel, tmp_path):
    """A --noblock run shows the tracebacks of ranks that failed while others still run (`RELEASE_FIRST`); a rank
    that fails the same way afterwards points to that traceback as it ends, not a second copy of it."""
    gate = tmp_path / "gate"
    code = (
        "%%mesh --noblock --save job\nimport os, time\n"
        f"while rank == 3 and not os.path.exists({str(gate)!r}):\n    time.sleep(0.02)\n"
        "x = 1 / (rank - rank)"
    )
    with kernel.everything() as seen:
        assert kernel.run(code).status == "ok"
        shown = lambda: [it["r"] for it in seen.custom_items() if "Traceback" in it["t"]]  # noqa: E731
        wait_for(lambda: shown() or kernel.run("pass").status != "ok", 30, "the first ranks' traceback shown")
        gate.touch()  # (rank 3 fails only now: after the others' traceback was shown)
        said = _said_by_each(kernel, seen)
    first = shown()[0]
    assert [said[g].count("Traceback") for g in range(4)] == [int(g == first) for g in range(4)], said
    assert "ZeroDivisionError: division by zero" in said[first], said
    assert f"-- rank 3 (gpu=3): ZeroDivisionError (shown once, under gpu={first})\n" in said[3], said
    assert all("[this run failed after" in said[g] for g in range(4)), said


def test_a_noblock_run_whose_ranks_all_fail_at_once_shows_the_traceback_once_as_it_ends(kernel: Kernel):
    """Nothing waits for a --noblock run to raise its error: as it ends, its areas show what a blocking cell's
    error would (the traceback once, under its first rank), before the line that says it failed."""
    with kernel.everything() as seen:
        r = kernel.run("%%mesh --noblock --save job\nx = 1 / (rank - rank)")
        assert r.status == "ok", r.text()
        n = r.reply["execution_count"]
        said = _said_by_each(kernel, seen)
    # (on a quiet machine all four arrive together: "-- ranks 0-3" under gpu=0; one that comes `RELEASE_FIRST` after
    # the first is shown apart, pointing to the same traceback)
    first = _the_one_traceback(said, range(4))
    assert re.match(r"-- ranks? [^:]+: ZeroDivisionError: division by zero\nTraceback", said[first]), said
    assert f"Cell In[{n}], line 2" in said[first], said
    for g in {0, 1, 2, 3} - {first}:
        assert re.match(rf"-- ranks? [^:]+: ZeroDivisionError \(shown once, under gpu={first}\)\n", said[g]), said
    assert all("[this run failed after" in said[g] for g in range(4)), said


def test_an_input_prompt_and_its_answer_show_in_the_ranks_area(kernel: Kernel):
    """The notebook's input box echoes a prompt after the cell's areas; the rank's own area shows it too, in
    order with what the rank printed, as a terminal does."""
    prompts = []

    def answer(msg):
        prompts.append(msg["content"]["prompt"])
        kernel.kc.input("alice")

    r = kernel.run(
        "%%mesh --on gpu=1\nprint('before')\nname = input('name? ')\nprint('hello', name)",
        allow_stdin=True,
        stdin_hook=answer,
    )
    assert r.status == "ok", r.text()
    assert prompts == ["[gpu=1] name? "]
    (final,) = r.final_outputs()
    assert final["text/plain"] == "[gpu=1] before\n[gpu=1] name? alice\n[gpu=1] hello alice", final["text/plain"]
    assert "name? alice" in final["text/html"]
    assert "".join(it["t"] for it in r.custom_items()).count("name? alice\n") == 1  # (live too, once)


def test_a_quick_cells_live_view_is_closed_only_once_the_browser_had_time_to_load_it(kernel: Kernel):
    """anywidget gives a new model 2 s to load its code in the browser: a quick cell's live view, closed as soon as
    static HTML replaced it, logged "[anywidget] Failed to initialize model." in the browser's console."""
    r = kernel.run("%%mesh\nprint('quick', rank)")
    assert r.status == "ok" and r.final_outputs(), r.text()
    (opened,) = [m for m in r.of("comm_open") if "RankOutput" in m["content"]["data"]["state"].get("_anywidget_id", "")]
    comm = opened["content"]["comm_id"]
    closed = [m for m in r.of("comm_close") if m["content"]["comm_id"] == comm]
    deadline = time.monotonic() + 60
    with kernel.everything() as seen:  # (sent later, by a timer thread, whether a cell runs or not)
        while not closed and time.monotonic() < deadline:
            with contextlib.suppress(queue.Empty):
                kernel.kc.iopub_channel.get_msg(timeout=1)
            closed = [m for m in seen.of("comm_close") if m["content"]["comm_id"] == comm]
    assert closed, "the live view was never closed"
    assert (closed[0]["header"]["date"] - opened["header"]["date"]).total_seconds() >= 2.5


def test_pdb_without_stdin_is_an_error_not_a_hang(kernel: Kernel):
    r = kernel.run("%%mesh --on gpu=0\nbreakpoint()\n1", allow_stdin=False, timeout=30)
    assert r.status == "error"
    assert "has no stdin" in r.text() or "does not support input requests" in r.text()
    assert kernel.run("%%mesh\nrank").status == "ok"


def test_replace_starts_a_new_shape_and_restart_stops_it():
    with monarch_kernel() as k:
        assert k.run("%%mesh gpu=2\nrank").status == "ok"
        old = k.worker_pids()
        r = k.run("%%mesh gpu=3 --replace\nrank")
        assert r.status == "ok" and "stopped mesh {gpu: 2} (2 workers) to start {gpu: 3}" in r.text()
        assert wait_gone(old, 5) == []
        new = k.worker_pids()
        assert len(new) == 3
        k.km.restart_kernel(now=False)  # restart stops every worker
        assert wait_gone(new, 10) == []


def test_kernel_sigkill_leaves_no_worker():
    with monarch_kernel() as k:
        assert k.run("%%mesh gpu=2\nrank").status == "ok"
        pids = k.worker_pids()
        os.kill(k.pid, signal.SIGKILL)
        assert wait_gone(pids, 30) == []


def test_load_ext_in_a_plain_ipython_kernel():
    with monarch_kernel("python3") as k:
        assert k.run("%load_ext monarch").status == "ok"
        r = k.run("%%mesh gpu=2\nprint('plain', rank)")
        assert r.status == "ok", r.text()
        assert "plain 1" in r.text()
        pids = k.worker_pids()
        k.km.shutdown_kernel(now=False)
        assert wait_gone(pids, 10) == []


def test_install_writes_absolute_interpreter():
    with tempfile.TemporaryDirectory() as prefix:
        out = subprocess.run(
            [sys.executable, "-m", "monarch.kernel", "install", "--prefix", prefix, "--name", "mk"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        assert "Installed kernelspec mk" in out
        with open(os.path.join(prefix, "share", "jupyter", "kernels", "mk", "kernel.json")) as f:
            spec = json.load(f)
        assert spec["argv"][0] == sys.executable and os.path.isabs(spec["argv"][0])
        assert spec["display_name"] == "Monarch (PyTorch mesh) [mk]"


def test_interrupt_during_a_live_function(kernel: Kernel, tmp_path):
    setup = (
        "import monarch, os, time\n@monarch.remote\ndef snooze(marker):\n    open(f'{marker}.{os.getpid()}', 'w').close()\n"
        "    time.sleep(60)\nm = get_ipython().run_line_magic('mesh', 'status').mesh"
    )
    assert kernel.run(setup).status == "ok"
    marker = str(tmp_path / "snoozing")
    kernel.interrupt_when(lambda: started(marker, 4), "snooze running on every rank")
    r = kernel.run(f"snooze.on(m)({marker!r})", timeout=30)
    assert r.status == "error"
    assert "snooze interrupted" in r.text() and "time.sleep(60)" in r.text()
    assert kernel.run("%%mesh\nrank").status == "ok"


def test_interrupt_at_a_pdb_prompt(kernel: Kernel):
    prompts = []

    def stdin_hook(msg):  # instead of answering, the user presses Interrupt
        prompts.append(msg["content"]["prompt"])
        kernel.km.interrupt_kernel()

    r = kernel.run("%%mesh --on gpu=1\nbreakpoint()\nx = 1", allow_stdin=True, stdin_hook=stdin_hook, timeout=30)
    assert r.status == "error"
    assert prompts and prompts[0].startswith("[gpu=1] (Pdb)")
    assert "KeyboardInterrupt" in r.text()
    assert kernel.run("%%mesh\nrank").status == "ok"  # the worker left pdb and serves the next cell


def test_tensor_engine_show_uses_the_tensor_view(kernel: Kernel):
    code = (
        "import torch, monarch\nm = get_ipython().run_line_magic('mesh', 'status').mesh\n"
        "with m.activate():\n    t = torch.ones(2) * 3\nmonarch.show(t, gpu=1)"
    )
    r = kernel.run(code)
    assert r.status == "ok", r.text()
    (shown,) = [m["content"]["data"] for m in r.of("display_data")]
    assert "application/vnd.jupyter.widget-view+json" in shown
    text = shown["text/plain"]  # the rank selector lists every rank; the one asked for is selected
    assert text.startswith("tensor on {gpu: 4}, showing gpu=1") and text.count("tensor([3., 3.])") == 4
    assert all(f"[gpu={g}]" in text for g in range(4))
    (state,) = [m["content"]["data"]["state"] for m in r.of("comm_open") if "labels" in m["content"]["data"]["state"]]
    assert state["labels"] == [f"gpu={g}" for g in range(4)] and state["selected"] == 1


def test_mesh_variable_and_saved_handle(kernel: Kernel):
    setup = "from monarch.actor import this_host\npair = this_host().spawn_procs({'host': 2})"
    assert kernel.run(setup).status == "ok"
    r = kernel.run("%%mesh pair --save run\ncoords['host'] * 7")
    assert r.status == "ok", r.text()
    assert kernel.value("run.result().values()") == [0, 7]
    assert kernel.value("run.done()") is True and kernel.value("run.mesh.sizes") == {"host": 2}
    r = kernel.run("%%mesh pair --on host=1\nprint('only', rank, coords)")  # an index drops the dimension
    assert r.final_outputs()[0]["text/plain"] == "[host=1] only 1 {}"
    pids = kernel.value("[row['pid'] for row in pair.to_table().rows]")
    assert kernel.run("pair.exit()").status == "ok"
    assert wait_gone(pids, 5) == []


def test_a_failed_tensor_op_names_its_notebook_cell(kernel: Kernel):
    code = (
        "import torch, monarch\none = monarch.actor.this_host().spawn_procs({'gpu': 1})\n"
        "with one.activate():\n    bad = torch.rand(2, 2**55)\nmonarch.inspect(bad)"
    )
    r = kernel.run(code)
    assert kernel.run("one.exit()").status == "ok"
    assert r.status == "error"
    cell = re.search(r"Cell In\[(\d+)\], line 4", r.text())
    assert cell, r.text()
    assert "ipykernel_" not in r.text().split("the failing op was issued at", 1)[1].split("\n", 1)[0]


def test_a_restart_during_a_noblock_run_says_the_mesh_was_stopped_not_that_a_worker_crashed(tmp_path):
    """`%mesh restart` while a --noblock run waits in a collective: its `result()` says the mesh was stopped
    (what the user did), not gloo's "Connection closed by peer ... a remote worker crashing"."""
    marker = tmp_path / "started"
    with monarch_kernel() as k:
        code = (
            "%%mesh gpu=2 --noblock --save job\nimport time, torch, torch.distributed as dist\n"
            f"open({str(marker)!r} + '.' + str(rank), 'w').close()\n"
            "if rank == 0:\n    time.sleep(600)\ndist.all_reduce(torch.ones(1))"
        )
        assert k.run(code).status == "ok"
        wait_for(lambda: started(str(marker), 2), 60, "both ranks starting")
        first = k.worker_pids()
        with k.everything() as seen:  # (the run's end is said by a thread: perhaps between two cells)
            restart = k.run("%mesh restart")
            assert restart.status == "ok", restart.text()
            r = k.run("job.result()")
            assert r.status == "error"
            (err,) = r.of("error")
            assert err["content"]["ename"] == "MeshStoppedError", r.text()
            text = " ".join("\n".join(err["content"]["traceback"]).split())  # (as one line: it is wrapped to fit)
            assert (
                "mesh {gpu: 2} was stopped (mesh.exit(), %mesh restart or %mesh shutdown) while ranks 0-1 still "
                "ran this call (%%mesh cell)" in text
            ), text
            assert "Connection closed" not in r.text() and "crash" not in r.text()

            # the --noblock cell's own areas say how its run ended (its live view, updated after the cell returned)
            def stopped() -> list[dict]:
                return [it for it in seen.custom_items() if "[this run was stopped" in it.get("t", "")]

            wait_for(lambda: len(stopped()) >= 2 or k.run("pass").status != "ok", 30, "each area saying so")
        ended = stopped()
        assert sorted(it["r"] for it in ended) == [0, 1], seen.custom_items()
        assert all(it["t"].startswith("[this run was stopped with its mesh, after ") for it in ended), ended
        r = k.run("%%mesh\nrank")  # the restarted mesh works
        assert r.status == "ok", r.text()
        k.km.shutdown_kernel(now=False)
        assert wait_gone(first, 10) == []


def test_a_flood_keeps_a_bounded_tail_in_the_notebook_and_all_of_it_in_a_file(kernel: Kernel, tmp_path):
    assert kernel.run(f"import os\nos.environ['MONARCH_OUTPUT_DIR'] = {str(tmp_path)!r}").status == "ok"
    r = kernel.run("%%mesh --on gpu=0\nfor i in range(5000):\n    print(f'line {i:05d} ' + 'x' * 40)")
    assert r.status == "ok", r.text()
    (final,) = r.final_outputs()
    assert len(final["text/html"]) < 100_000 and len(final["text/plain"]) < 100_000  # 5,000 lines: 255 KB
    (path,) = tmp_path.glob("*/gpu=0.txt")
    lines = path.read_text().splitlines()
    assert len(lines) == 5000 and lines[0].startswith("line 00000") and lines[-1].startswith("line 04999")
    assert f"; all its text is in {path} …" in final["text/plain"], final["text/plain"][:400]
    assert "line 04999" in final["text/plain"] and "line 00000" not in final["text/plain"]
    assert oct(path.parent.stat().st_mode & 0o777) == "0o700"


def _fork_server_of(kernel_pid: int) -> list[int]:
    """The monarch fork servers the kernel `kernel_pid` started (their title names it)."""
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/cmdline", "rb") as f:
                    cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if cmd.startswith(f"monarch fork server (controller {kernel_pid})"):
                found.append(int(name))
    return found


def test_the_kernel_starts_the_fork_server_before_the_first_cell_and_it_preloads_ipythons_display(monkeypatch):
    """MONARCH_PREWARM (default 1): the fork server (torch imported once) starts with the kernel, so the first
    mesh does not wait for torch; the workers forked from a kernel's fork server have IPython's display
    imported already (a `%%mesh` cell routes it), instead of 8 workers importing it at once on the first cell."""
    with monarch_kernel() as k:
        wait_for(lambda: _fork_server_of(k.pid), what="the kernel's fork server")
        code = (
            "import monarch, sys\nfrom monarch.actor import this_host\nm = this_host().spawn_procs({'gpu': 2})\n"
            "print(monarch.remote(lambda: 'IPython.display' in sys.modules).on(m)().values())\nm.exit()"
        )
        r = k.run(code)
        assert r.status == "ok" and "[True, True]" in r.text(), r.text()
    monkeypatch.setenv("MONARCH_PREWARM", "0")
    with monarch_kernel() as k:
        assert k.run("1").status == "ok"  # the kernel is up: a prewarm would have started the server by now
        assert _fork_server_of(k.pid) == []
