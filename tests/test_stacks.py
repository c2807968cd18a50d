"""Where every rank is, without attaching to each process: `mesh.stacks()` / `%mesh stacks`, the report a
call gets when ranks have waited in a collective past `MONARCH_HANG_REPORT`, and the periodic stack report
of `CONTROLLER_PYSPY_REPORT_INTERVAL`."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
import torch.distributed as dist

import monarch
from monarch.actor import this_host

from conftest import wait_for, wait_gone, worker_pids
from helpers.kernel_client import Result, monarch_kernel

pytestmark = pytest.mark.timeout(120)


@monarch.remote
def rank_1_lags(seconds):
    import time

    if dist.get_rank() == 1:
        time.sleep(seconds)
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()


def test_stacks_show_ranks_stuck_in_all_reduce_grouped_and_the_one_asleep():
    mesh = this_host().spawn_procs({"gpu": 4})
    pids = worker_pids(mesh)
    try:
        idle = str(mesh.stacks())
        assert "-- ranks 0-3:\n  MainThread: idle" in idle, idle
        fut = rank_1_lags.on(mesh).call_async(60)
        deadline = time.monotonic() + 30
        text = ""

        def settled(text: str) -> bool:  # (rank 1 asleep, the others in all_reduce: not still importing)
            waiting, _, asleep = text.partition("-- ranks 0, 2-3:")[2].partition("-- rank 1 (gpu=1):")
            return "dist.all_reduce(t)\n" in waiting and "time.sleep(seconds)" in asleep

        while not settled(text) and time.monotonic() < deadline:
            text = str(mesh.stacks())
        assert text.startswith(f"controller (pid {os.getpid()}):\n  MainThread:\n"), text
        waiting, asleep = text.split("-- ranks 0, 2-3:")[1].split("-- rank 1 (gpu=1):")
        assert "in rank_1_lags\n        dist.all_reduce(t)" in waiting and "in all_reduce" in waiting, text
        assert "in rank_1_lags\n        time.sleep(seconds)" in asleep, text
        assert "multiprocessing" not in text and "monarch/runtime" not in text  # (the user's frames, and torch's)
        # a view's stacks are its ranks'
        assert "-- rank 1 (gpu=1):" in str(mesh.slice(gpu=1).stacks())
    finally:
        mesh.exit()
    assert wait_gone(pids) == []
    with pytest.raises(
        monarch.MeshStoppedError,
        match=r"was stopped \(mesh.exit\(\), %mesh restart or %mesh shutdown\) while ranks 0-3 still ran this call",
    ):
        fut.result(timeout=30)


@monarch.remote
def rank_1_holds_the_gil():
    import re

    if dist.get_rank() == 1:
        re.match(r"(a+)+$", "a" * 64 + "b")  # (backtracks in C for ages, never letting go of the GIL)


def test_a_rank_whose_thread_holds_the_gil_is_read_from_outside_by_py_spy():
    import shutil

    assert shutil.which("py-spy"), "py-spy is a test dependency (pip install -e .[test])"
    probe = subprocess.Popen(
        [sys.executable, "-c", "import time; print('up', flush=True); time.sleep(30)"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert probe.stdout.readline() == "up\n"  # (an interpreter py-spy can read)
        tried = subprocess.run(["py-spy", "dump", "--pid", str(probe.pid)], capture_output=True, text=True, timeout=30)
    finally:
        probe.kill()
        probe.wait()
    if tried.returncode != 0:  # (ptrace not allowed on this machine: the built-in path is all there is)
        pytest.skip(f"py-spy cannot attach to a process here: {tried.stderr.strip()[-200:]}")
    mesh = this_host().spawn_procs({"gpu": 2})
    pids = worker_pids(mesh)
    try:
        rank_1_holds_the_gil.on(mesh).call_async()
        deadline = time.monotonic() + 30
        text = ""
        stuck = ""
        while "seen by py-spy" not in stuck and time.monotonic() < deadline:  # (rank 1 may still be importing)
            text = str(mesh.stacks(wait=0.5))
            stuck = text.partition("-- rank 1 (gpu=1):")[2]
        assert "MainThread (seen by py-spy: active+gil)" in stuck, text
        assert "in rank_1_holds_the_gil\n" in stuck and 're.match(r"(a+)+$", "a" * 64 + "b")' in stuck, text
        assert "re/__init__.py" in stuck and "in match" in stuck, text
    finally:
        mesh.exit()
    assert wait_gone(pids) == []


def _reports(msgs: list[dict]) -> list[dict]:
    """The hang reports among a cell's live per-rank output."""
    return [it for it in Result("", msgs).custom_items() if it.get("s") == "stderr" and "monarch:" in it["t"]]


def test_the_notebook_says_which_ranks_wait_in_which_collective_and_who_lags(monkeypatch, tmp_path):
    monkeypatch.setenv("MONARCH_HANG_REPORT", "2")
    reported = tmp_path / "reported"
    with monarch_kernel() as k:
        assert k.run("%%mesh gpu=4\nimport os, time, torch, torch.distributed as dist").status == "ok"  # (imports)
        cell = "%%mesh\nt = torch.ones(1)\nif rank == 1:\n"
        cell += f"    while not os.path.exists({str(reported)!r}): time.sleep(0.05)\n"
        cell += "dist.all_reduce(t)"
        msgs: list[dict] = []

        def output(msg: dict) -> None:  # rank 1 lags until the report is shown, however long that takes
            msgs.append(msg)
            if _reports([msg]):
                reported.touch()

        # The report does not hold the cell up: it ends once rank 1 goes on (the default MONARCH_HANG_REPORT,
        # 30 s, would have said nothing in so short a wait).
        reply = k.kc.execute_interactive(cell, output_hook=output, timeout=60)["content"]
        r = Result(reply["status"], msgs, reply)
        assert r.status == "ok", r.text()
        live = _reports(r.msgs)
        assert [it["r"] for it in live] == [1], live  # shown in the lagging rank's area, while it ran
        said = live[0]["t"]
        assert "monarch: %%mesh cell has run " in said and "; for the last 2 s:" in said, said
        assert "ranks 0, 2-3 wait in all_reduce at Cell In[2], line 5" in said, said
        assert "rank 1 (gpu=1) is at Cell In[2], line 4, in no collective" in said, said
        assert "rank 1 lags: the others wait for it" in said, said
        # a loop that is merely busy past the threshold, its ranks meeting in all_reduce 50 times a second: no report
        busy = "%%mesh\nfor _ in range(250):\n    time.sleep(0.02)\n    dist.all_reduce(t)"
        r = k.run(busy, timeout=60)
        assert r.status == "ok" and not [it for it in r.custom_items() if "monarch:" in it.get("t", "")], r.text()
        r = k.run("%mesh stacks")
        assert "-- ranks 0-3:\n  MainThread: idle" in r.text(), r.text()
        pids = k.worker_pids()
        k.km.shutdown_kernel(now=False)
    assert wait_gone(pids) == []


def test_the_periodic_stack_report_goes_to_stderr(tmp_path):
    script, seen = tmp_path / "report.py", tmp_path / "seen"
    script.write_text(
        textwrap.dedent(
            """
            import os, sys, time
            import monarch
            from monarch.actor import this_host

            @monarch.remote
            def nap(seen):
                while not os.path.exists(seen):  # (until the test saw a report of it)
                    time.sleep(0.05)

            mesh = this_host().spawn_procs({"gpu": 2})
            nap.on(mesh)(sys.argv[1])
            mesh.exit()
            """
        )
    )
    env = dict(os.environ, CONTROLLER_PYSPY_REPORT_INTERVAL="1")
    proc = subprocess.Popen(
        [sys.executable, str(script), str(seen)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env
    )
    err: list[str] = []
    reader = threading.Thread(target=lambda: [err.append(line) for line in proc.stderr], daemon=True)
    reader.start()

    def reported() -> bool:  # (both ranks in the nap's sleep, in the same report)
        text = "".join(err)
        return "-- ranks 0-1:\n  MainThread:\n" in text and "in nap\n        time.sleep(0.05)" in text

    try:
        wait_for(reported, 60, "a report of both ranks in the nap")
    finally:
        seen.touch()
        try:
            proc.wait(60)
        finally:
            proc.kill()
            reader.join(30)
    text = "".join(err)
    assert proc.returncode == 0, text
    assert "monarch: stacks of mesh {gpu: 2}" in text, text


def test_a_bad_report_interval_is_named():
    env = dict(os.environ, MONARCH_HANG_REPORT="soon")
    code = "from monarch.runtime.common.config import from_env; import os; from_env(os.environ)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert "MONARCH_HANG_REPORT='soon' is not a number; give a number >= 0" in out.stderr, out.stderr


@monarch.remote
def rank_1_broadcasts():
    t = torch.ones(4)
    if dist.get_rank() == 1:
        dist.broadcast(t, 0)
    else:
        dist.all_reduce(t)
    return t.sum().item()


@monarch.remote
def everyone_all_reduces():
    t = torch.ones(4)
    dist.all_reduce(t)
    return t.sum().item()


def test_mismatched_collectives_are_named_by_torch_with_torch_distributed_debug(monkeypatch):
    """With TORCH_DISTRIBUTED_DEBUG=DETAIL set when the mesh starts (even after the fork server read its
    environment), torch checks each collective across ranks: the call fails at once saying which rank ran
    which collective, each rank's message apart, and the mesh goes on."""
    monkeypatch.setenv("TORCH_DISTRIBUTED_DEBUG", "DETAIL")
    mesh = this_host().spawn_procs({"gpu": 3})
    pids = worker_pids(mesh)
    try:
        # At once, not after the mismatched collectives wait out the groups' timeout (600 s): the wait has a
        # deadline far below it (a call still waiting then raises TimeoutError, and fails).
        with pytest.raises(monarch.RemoteError) as e:
            rank_1_broadcasts.on(mesh).call_async().result(timeout=30)
        text = str(e.value)
        assert "failed on 3 of 3 ranks" in text and "Detected mismatch between collectives" in text
        assert "-- ranks 0, 2:" in text and "-- rank 1 (gpu=1):" in text
        assert "OpType=ALLREDUCE" in text and "OpType=BROADCAST" in text
        assert everyone_all_reduces.on(mesh)().values() == [12.0] * 3
    finally:
        mesh.exit()
    assert wait_gone(pids) == []
