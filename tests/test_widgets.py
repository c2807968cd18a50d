"""Widgets outside a front-end: live MeshTable status, and the static HTML/text every view carries."""

import time

import pytest
import torch

import monarch
from monarch.widgets import DebuggerView, MeshTableWidget, RankLog, TensorView, ValueMeshView

WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"


def _wait_for(pred, timeout=30.0):  # (generous: a loaded machine is slow, and a state that comes ends it at once)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.02)
    return False


@pytest.mark.timeout(60)
def test_mesh_table_status_follows_the_workers(mesh8, tmp_path):
    table = MeshTableWidget(mesh8.slice(host=1))
    assert [r["status"] for r in table.rows] == ["idle"] * 4
    assert {r["rank"] for r in table.rows} == {4, 5, 6, 7}
    gate = tmp_path / "gate"

    @monarch.remote
    def nap(path):
        import os

        while monarch.current_rank()["gpu"] == 2 and not os.path.exists(path):  # held until the table saw it
            time.sleep(0.02)

    fut = nap.on(mesh8).call_async(str(gate))
    assert _wait_for(lambda: [r["status"] for r in table.rows] == ["idle", "idle", "busy", "idle"]), table.rows
    gate.touch()
    fut.result()
    assert _wait_for(lambda: [r["status"] for r in table.rows] == ["idle"] * 4), table.rows
    bundle = table._repr_mimebundle_()
    assert WIDGET_VIEW in bundle
    assert bundle["text/html"].count("<tr data-rank=") == 4 and "monarch-status-idle" in bundle["text/html"]
    lines = bundle["text/plain"].splitlines()  # the slice dropped the host dimension
    assert (
        table.title == "ProcMesh {gpu: 4} (live)"
        and lines[0] == "ProcMesh {gpu: 4}"
        and lines[1].split()[:3] == ["gpu", "rank", "hostname"]
    )


@pytest.mark.timeout(60)
def test_a_mesh_table_keeps_its_last_state_when_the_mesh_is_stopped():
    from monarch.actor import this_host

    mesh = this_host().spawn_procs({"gpu": 2})
    table = MeshTableWidget(mesh)
    mesh.exit()
    assert _wait_for(lambda: "stopped at" in table.title), table.title
    assert table.title.startswith("ProcMesh {gpu: 2} (stopped at ") and "the rows show its last state" in table.title
    assert [r["status"] for r in table.rows] == ["idle", "idle"]
    assert "monarch-status monarch-status-stopped" not in table._repr_mimebundle_()["text/html"]
    later = MeshTableWidget(mesh)  # made after the stop: it says so
    assert [r["status"] for r in later.rows] == ["stopped", "stopped"]


@pytest.mark.timeout(60)
def test_a_mesh_table_follows_each_rank_of_a_call_and_keeps_counting(tmp_path):
    """A rank that finished its part shows idle while another still runs the call (the table is told of each
    rank's reply, not only of the call's end), and a busy rank's "for" column keeps counting."""
    from monarch.actor import this_host

    release = tmp_path / "release"

    @monarch.remote
    def uneven(path):
        import os

        if monarch.current_rank()["gpu"] == 1:
            while not os.path.exists(path):
                time.sleep(0.02)
        else:
            time.sleep(0.5)  # well after the table's first refresh

    mesh = this_host().spawn_procs({"gpu": 2})
    try:
        table = MeshTableWidget(mesh)
        fut = uneven.on(mesh).call_async(str(release))
        assert _wait_for(lambda: [r["status"] for r in table.rows] == ["idle", "busy"]), table.rows
        assert _wait_for(lambda: table.rows[1]["for"] not in ("", "0 s")), table.rows  # it counts
        release.touch()
        fut.result()
        assert _wait_for(lambda: [r["status"] for r in table.rows] == ["idle", "idle"]), table.rows
    finally:
        mesh.exit()


@pytest.mark.timeout(60)
def test_a_mesh_table_made_while_ranks_run_keeps_counting_without_a_change(tmp_path):
    """`%mesh` shown while a call runs: nothing changes after the table is made (no rank becomes busy or
    idle), yet its "for" column counts; a change that came between reading the table and following the mesh
    would likewise be caught by that first look."""
    import socket

    from monarch.actor import this_host

    path = str(tmp_path / "hold.sock")

    @monarch.remote
    def hold(path):
        import socket

        with socket.socket(socket.AF_UNIX) as s:  # connected: running; then held until the test lets go
            s.connect(path)
            s.recv(1)

    mesh = this_host().spawn_procs({"gpu": 2})
    with socket.socket(socket.AF_UNIX) as server:
        server.bind(path)
        server.listen(2)
        server.settimeout(30)
        try:
            fut = hold.on(mesh).call_async(path)
            held = [server.accept()[0] for _ in range(2)]  # both ranks run the call
            table = MeshTableWidget(mesh)
            assert [r["status"] for r in table.rows] == ["busy", "busy"], table.rows
            assert _wait_for(lambda: all(r["for"] not in ("", "0 s") for r in table.rows)), table.rows
            for conn in held:
                conn.close()
            fut.result()
            assert _wait_for(lambda: [r["status"] for r in table.rows] == ["idle", "idle"]), table.rows
        finally:
            mesh.exit()


@pytest.mark.timeout(60)
def test_a_mesh_stopped_right_after_a_call_keeps_the_state_it_had_not_an_older_one(tmp_path):
    """A notebook run top to bottom: a call ends and the next cell stops the mesh within the table's refresh
    delay; the table must show the ranks idle, not busy as at its last refresh during the call."""
    from monarch.actor import this_host

    gate = tmp_path / "gate"

    @monarch.remote
    def work(path):
        import os

        while not os.path.exists(path):  # busy until the table has shown it
            time.sleep(0.02)

    mesh = this_host().spawn_procs({"gpu": 2})
    table = MeshTableWidget(mesh)
    fut = work.on(mesh).call_async(str(gate))
    assert _wait_for(lambda: [r["status"] for r in table.rows] == ["busy", "busy"]), table.rows
    gate.touch()
    fut.result()
    mesh.exit()
    assert _wait_for(lambda: "stopped at" in table.title), table.title
    assert [(r["status"], r["running"]) for r in table.rows] == [("idle", "")] * 2, table.rows


def test_value_mesh_and_tensor_views(mesh8):
    @monarch.remote
    def value():
        c = monarch.current_rank()
        return torch.full((2,), float(10 * c["host"] + c["gpu"]))

    vm = value.on(mesh8)()
    view = ValueMeshView(vm)
    b = view._repr_mimebundle_()
    assert 'data-label="host=1,gpu=3"' in b["text/html"] and "tensor([13., 13.])" in b["text/html"]
    assert "host=1,gpu=3  tensor([13., 13.])" in b["text/plain"]
    tv = TensorView(vm, selected=5)
    assert tv.labels[5] == "host=1,gpu=1" and tv.values[5] == "tensor([11., 11.])"
    assert tv._repr_mimebundle_()["text/plain"].startswith("tensor on {host: 2, gpu: 4}")


def test_rank_log_groups_by_rank_and_escapes():
    log = RankLog()
    log.add(1, "gpu=1", "stdout", "b1\n")
    log.add(0, "gpu=0", "stdout", "a1\n")
    log.add(1, "gpu=1", "stderr", "<oops>\n")
    log.add(0, "gpu=0", "display", data={"text/plain": "fig", "image/png": "AAAA"})
    log.add(0, "gpu=0", "stdout", "a2\n")
    assert log.text() == "[gpu=0] a1\n[gpu=0] fig\n[gpu=0] a2\n[gpu=1] b1\n[gpu=1] <oops>"
    html = log.bundle()["text/html"]
    assert html.index('data-label="gpu=0"') < html.index('data-label="gpu=1"')
    assert "&lt;oops&gt;" in html and '<img src="data:image/png;base64,AAAA"/>' in html
    assert '<div class="jp-RenderedText monarch-stderr" data-mime-type="application/vnd.jupyter.stderr"' in html


def test_debugger_view_static_forms():
    view = DebuggerView(active="gpu=1", paused=["gpu=0", "gpu=3"], where="Cell In[5], line 4")
    b = view._repr_mimebundle_()
    assert b["text/plain"] == "pdb: rank gpu=1 has the prompt, paused at Cell In[5], line 4; waiting: gpu=0, gpu=3"
    assert "Pdb" not in b["text/html"]  # where the rank is paused, not its prompt (the notebook's stdin shows that)
    assert "waiting: gpu=0, gpu=3" in b["text/html"]


@pytest.mark.timeout(90)
def test_a_frozen_mesh_table_keeps_what_was_true_when_it_froze(tmp_path):
    """A table is live until the next cell starts; then the extension freezes it, and later work (a later
    cell's) changes nothing in it. A live table made beside it is the witness that changes were sent."""
    from monarch.actor import this_host

    gate = tmp_path / "gate"

    @monarch.remote
    def hold(path):
        import os

        while not os.path.exists(path):
            time.sleep(0.02)

    mesh = this_host().spawn_procs({"gpu": 2})
    try:
        old = MeshTableWidget(mesh)
        old.freeze()
        assert old.title.startswith("ProcMesh {gpu: 2} (as of ") and "live" not in old.title, old.title
        seen = (old.title, old.rows)
        live = MeshTableWidget(mesh)
        fut = hold.on(mesh).call_async(str(gate))
        assert _wait_for(lambda: [r["status"] for r in live.rows] == ["busy", "busy"], 60), live.rows
        assert _wait_for(lambda: all(r["for"] not in ("", "0 s") for r in live.rows), 60), live.rows  # ticks went by
        gate.touch()
        fut.result()
        live.freeze()
        mesh.exit()
        assert (old.title, old.rows) == seen and [r["status"] for r in old.rows] == ["idle", "idle"]
        assert "(stopped at" not in old.title and "(stopped at" not in live.title  # stopped after both froze
    finally:
        mesh.exit()


def test_a_table_of_many_ranks_is_a_row_per_host_with_each_hosts_ranks_kept():
    from monarch.runtime.mesh import MeshTable

    rows = [
        {"host": r // 64, "gpu": r % 64, "rank": r, "hostname": f"node{r // 64}", "pid": 100 + r, "device": "cpu",
         "status": "busy" if r in (70, 71) else "idle", "memory": "", "running": "train (Cell In[3], line 4)"
         if r in (70, 71) else "", "for": "", "actors": ""}
        for r in range(512)
    ]  # fmt: skip
    table = MeshTable("{host: 8, gpu: 64}", ["host", "gpu"], rows)
    columns, hosts = table.per_host
    assert columns == ["host", "ranks", "workers", "hostname", "status", "running"]
    assert len(hosts) == 8 and hosts[1]["ranks"] == "64-127" and hosts[1]["status"] == "62 idle, 2 busy"
    assert hosts[1]["running"] == "train (Cell In[3], line 4)" and hosts[1]["members"] == list(range(64, 128))
    text = str(table).splitlines()
    assert text[0].startswith("ProcMesh {host: 8, gpu: 64}: 512 ranks on 8 hosts, a row each") and len(text) == 11
    assert text[4].split()[:6] == ["1", "64-127", "64", "node1", "62", "idle,"]
    assert MeshTable("{gpu: 64}", ["gpu"], rows[:64]).per_host is None  # (64 ranks: a row each, as before)
