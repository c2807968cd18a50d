"""One rank fails while the others wait for it in a collective: the cell or call ends by itself.

torchrun reports such a failure within seconds because the dying process closes its sockets; a worker
that raises stays alive, so without help the others would wait for the group timeout (600 s). Each test
checks that the error arrives (the test's own timeout is the generous bound; benchmarks/faults.py reports
the real figure), that it names the failed rank and the collective the others were released from, and
that the next collective runs on the same workers with their namespaces intact.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import monarch
from monarch.actor import this_host

from conftest import started, wait_gone, worker_pids
from helpers.kernel_client import Kernel, monarch_kernel

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def kernel():
    with monarch_kernel() as k:
        assert k.run("%%mesh gpu=4\nkept = rank * 10").status == "ok"
        pids = k.worker_pids()
        yield k
        k.km.shutdown_kernel(now=False)
        assert wait_gone(pids) == []


FAILING_CELL = """%%mesh
import torch, torch.distributed as dist
t = torch.ones(2) * (rank + 1)
if rank == 1:
    raise ValueError(f"bad input shape on rank {rank}")
dist.all_reduce(t)
"""


def test_a_cell_where_one_rank_raises_before_a_collective_ends_and_the_next_runs(kernel: Kernel):
    pids = kernel.worker_pids()
    r = kernel.run(FAILING_CELL, timeout=30)  # (the group timeout is 600 s)
    assert r.status == "error"
    text = r.text()
    assert "ValueError: bad input shape on rank 1" in text
    assert "ranks 0, 2-3 were released from all_reduce at Cell In[" in text and "line 6" in text, text
    assert "Connection closed" not in text  # the released ranks' own error is not shown as a failure
    # rank 1's traceback was shown in its area while the others were still waiting
    live = [it for it in r.custom_items() if it["r"] == 1 and it.get("s") == "stderr"]
    assert any("bad input shape on rank 1" in it["t"] for it in live)
    r = kernel.run("%%mesh\ns = torch.tensor([float(rank)])\ndist.all_reduce(s)\n(s.item(), kept)", timeout=30)
    assert r.status == "ok", r.text()
    assert "(6.0, 30)" in r.text() and "(6.0, 0)" in r.text()  # the right sum, and the namespaces kept
    assert kernel.worker_pids() == pids


def test_groups_made_in_cells_are_named_as_torn_down(kernel: Kernel):
    made = (
        "%%mesh\nimport torch, torch.distributed as dist\nfrom torch.distributed.device_mesh import init_device_mesh\n"
        "pair = dist.new_group([0, 1])\ngrid = init_device_mesh('cpu', (2, 2), mesh_dim_names=('dp', 'tp'))"
    )
    assert kernel.run(made).status == "ok"
    r = kernel.run(FAILING_CELL, timeout=30)
    assert r.status == "error"
    text = " ".join(r.text().split())  # (as one line: the error is wrapped to fit an output area)
    assert "Process groups made in your code (dist.new_group, init_device_mesh, ...) were torn down with it: " in text
    assert "pair (ranks 0-1)" in text and "grid (a DeviceMesh)" in text, text
    assert "Make them again (run the code that made them)." in text
    r = kernel.run(
        made + "\ndist.barrier(pair) if rank < 2 else None\ndist.all_reduce(torch.ones(1), group=grid.get_group('tp'))"
    )
    assert r.status == "ok", r.text()


def test_a_rank_still_busy_is_named_before_the_next_cell_instead_of_waiting_for_it(kernel: Kernel, tmp_path):
    """A rank that ignores the interrupt keeps running; the next cell says at once which rank runs what."""
    marker = str(tmp_path / "sleeping")
    code = (
        f"%%mesh\nimport time; open({marker!r} + f'.{{rank}}', 'w').close()\n"  # (line 2: line 7 stays line 7)
        "try:\n    time.sleep(60)\nexcept KeyboardInterrupt:\n    if rank == 2:\n        time.sleep(60)\n"
    )
    kernel.interrupt_when(lambda: started(marker, 4), "the cell sleeping on every rank")
    r = kernel.run(code, timeout=30)
    assert r.status == "error"
    r = kernel.run("%%mesh\nrank", timeout=30)
    assert r.status == "error"
    text = " ".join(r.text().split())
    assert (
        "MeshBusyError" in text
        and "this cell was not started: rank 2 is still running an earlier call on mesh {gpu: 4}" in text
    )
    assert "rank 2 (gpu=2) has run %%mesh cell for" in text and "at Cell In[" in text and "line 7" in text, text
    assert "%mesh restart" in text
    r = kernel.run("%mesh status", timeout=30)
    assert "%%mesh cell at Cell In[" in r.text()
    assert kernel.run("%mesh restart", timeout=60).status == "ok"
    assert kernel.run("%%mesh\nrank").status == "ok"


# -- live functions ----------------------------------------------------------------------------------
@monarch.remote
def reduce_after_a_check(x):
    rank = dist.get_rank()
    if rank == 2:
        raise ValueError(f"bad input on rank {rank}")
    t = torch.ones(1) * x
    dist.all_reduce(t)
    return t.item()


@monarch.remote
def plain_sum(x):
    t = torch.ones(1) * x
    dist.all_reduce(t)
    return t.item()


def test_a_live_function_where_one_rank_raises_before_a_collective_ends():
    mesh = this_host().spawn_procs({"host": 2, "gpu": 2})
    pids = worker_pids(mesh)
    try:
        with pytest.raises(monarch.RemoteError) as e:
            reduce_after_a_check.on(mesh).call_async(1.0).result(timeout=30)
        assert e.value.ranks == [2]
        assert sorted(r.rank for r in e.value.released) == [0, 1, 3]
        assert "ranks 0-1, 3 were released from all_reduce at" in str(e.value)
        assert plain_sum.on(mesh)(2.0).values() == [8.0] * 4  # groups re-formed: the next collective is right
        group = mesh.process_group("gpu")  # and the dimension groups too
        assert plain_sum_in.on(mesh)(group).values() == [2.0] * 4
        assert worker_pids(mesh) == pids
    finally:
        mesh.exit()
    assert wait_gone(pids) == []


@monarch.remote
def plain_sum_in(group):
    t = torch.ones(1)
    dist.all_reduce(t, group=group)
    return t.item()


def test_ranks_that_compute_are_left_alone(tmp_path):
    """Only ranks waiting in a collective are released: one still computing finishes its work."""
    mesh = this_host().spawn_procs({"gpu": 3})
    pids = worker_pids(mesh)

    @monarch.remote
    def uneven(released):
        import os
        import time

        rank = dist.get_rank()
        if rank == 0:
            raise ValueError("rank 0 fails")
        if rank == 1:
            while not os.path.exists(released):  # computing all the while rank 2 waits in the collective
                time.sleep(0.01)
            return "done"
        try:
            dist.barrier()
        finally:
            open(released, "w").close()

    try:
        with pytest.raises(monarch.RemoteError) as e:
            uneven.on(mesh).call_async(str(tmp_path / "released")).result(timeout=30)
        assert e.value.ranks == [0] and [r.rank for r in e.value.released] == [2]
        assert "rank 2 was released from barrier" in str(e.value)
    finally:
        mesh.exit()
    assert wait_gone(pids) == []


@monarch.remote
def whoami():
    return dist.get_rank()


@monarch.remote
def stubborn(seconds, started=None):
    import pathlib
    import time

    if started:  # (say it runs, for a test that interrupts it then)
        pathlib.Path(started, str(dist.get_rank())).touch()
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            time.sleep(0.05)
        except KeyboardInterrupt:
            if dist.get_rank() != 1:
                raise


def test_a_live_function_behind_an_interrupted_call_that_still_runs_says_so_at_once(tmp_path):
    """Ctrl-C on a call whose rank 1 ignores it: the next call does not wait silently behind it."""
    import os
    import signal
    import threading
    import time

    def ctrl_c_once_both_run():
        deadline = time.monotonic() + 30
        while len(list(tmp_path.iterdir())) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        os.kill(os.getpid(), signal.SIGINT)

    mesh = this_host().spawn_procs({"gpu": 2})
    pids = worker_pids(mesh)
    try:
        threading.Thread(target=ctrl_c_once_both_run, daemon=True).start()
        with pytest.raises(KeyboardInterrupt) as e:
            stubborn.on(mesh)(60, str(tmp_path))
        assert "stubborn interrupted; rank 1 did not stop within the grace period" in str(e.value), str(e.value)
        with pytest.raises(monarch.MeshBusyError) as busy:
            plain_sum.on(mesh)(1.0)
        text = str(busy.value)
        assert "plain_sum was not started: rank 1 is still running an earlier call on mesh {gpu: 2}" in text, text
        assert "rank 1 (gpu=1) has run stubborn for" in text and "test_spmd_failures.py" in text
        assert "mesh.respawn()" in text
        assert whoami.on(mesh.slice(gpu=0))().values() == [0]  # rank 0 is free: calls on it run
    finally:
        mesh.exit()
    assert wait_gone(pids) == []
