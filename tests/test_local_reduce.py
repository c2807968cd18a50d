"""The shared-memory all-reduce of one machine's workers: exact results across rounds and dtypes, through
the tensor engine; and, on forked processes meeting through a real store, the paths where it must not
hang: a rank released, a rank that died, ranks that are not all on one machine."""

import multiprocessing as mp
import os
import queue

import pytest
import torch
import torch.distributed as dist

import monarch
from monarch.runtime.worker import local_reduce

pytestmark = pytest.mark.skipif(local_reduce._FUTEX is None, reason="the shared-memory reduce is x86-64 Linux only")


@monarch.remote
def _local_reducers() -> int:
    from monarch.runtime.worker import groups

    return sum(r is not None for r in groups.current._local.values())


@pytest.mark.timeout(120)
def test_a_reduce_larger_than_its_slots_is_exact_in_every_dtype(mesh):
    """Three rounds (a slot holds 1 MiB per rank), a length no rank count divides, ints summed exactly."""
    n = local_reduce.SLOT // 8 * 2 + 12_345  # int64: two full rounds and a part
    with mesh.activate():
        rank = torch.arange(4).reduce(("host", "gpu"), "stack", scatter=True)[:1]
        big = torch.arange(n, dtype=torch.int64) * (rank + 1)
        summed = big.reduce(("host", "gpu"), "sum")
        peak = (big.to(torch.float64) * -1).reduce("gpu", "max")
        halves = torch.full((1000,), 0.5, dtype=torch.bfloat16).reduce("host", "product")
        small = (rank.to(torch.int32) + 1).reduce("gpu", "sum")
        grid = torch.arange(12.0).reshape(3, 4) * (rank + 1)
        across = grid.t().reduce(("host", "gpu"), "sum")  # a view that is not contiguous, out of place
        grid.t().reduce_(("host", "gpu"), "max")  # and in place: into `grid`'s memory
    base = torch.arange(n, dtype=torch.int64)
    assert torch.equal(monarch.inspect(summed, host=1, gpu=0), base * 10)  # 1 + 2 + 3 + 4
    assert torch.equal(monarch.inspect(big, host=1, gpu=0), base * 3)  # its input stays as it was
    assert torch.equal(monarch.inspect(across, host=0, gpu=1), torch.arange(12.0).reshape(3, 4).t() * 10)
    assert torch.equal(monarch.inspect(grid, host=0, gpu=0), torch.arange(12.0).reshape(3, 4) * 4)
    assert torch.equal(monarch.inspect(peak, host=1, gpu=1), (base * -3).to(torch.float64))  # ranks 2, 3
    assert monarch.inspect(halves, host=0, gpu=1).tolist() == [0.25] * 1000
    out = monarch.inspect(small, host=1, gpu=1)
    assert out.dtype == torch.int32 and out.tolist() == [7]
    assert _local_reducers.on(mesh)().values() == [3] * 4  # (world, gpu, host): each went through memory


def _rank(rank: int, n: int, path: str, role: str, out: mp.Queue) -> None:
    store = dist.FileStore(path, n)
    if role == "elsewhere" and rank == n - 1:
        local_reduce._here = lambda: "another machine"
    try:
        reducer = local_reduce.meet(store, rank, n, timeout=60)
        if reducer is None:
            out.put((rank, "none"))
            return
        t = torch.full((5,), float(rank + 1))
        if rank == n - 1 and role == "release":
            reducer.abort()
            out.put((rank, "aborted"))
            return
        if rank == n - 1 and role == "die":
            os._exit(0)  # (a zombie until the test reaps it: dead all the same)
        reducer.all_reduce(t, "sum", 0)
        out.put((rank, f"reduced {t.tolist()}"))
    except Exception as e:
        out.put((rank, f"{type(e).__name__}: {e}"))


def _run(tmp_path, role: str, n: int = 3) -> dict[int, str]:
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, n, str(tmp_path / "store"), role, out)) for r in range(n)]
    for p in procs:
        p.start()
    got: dict[int, str] = {}
    try:
        while len(got) < (n if role != "die" else n - 1):
            rank, what = out.get(timeout=60)
            got[rank] = what
    except queue.Empty:
        pass
    for p in procs:
        p.join(10)
    left = [p.pid for p in procs if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
    assert left == [], f"ranks still waiting: {got}"
    return got


@pytest.mark.timeout(90)
def test_a_released_group_raises_on_every_waiting_rank(tmp_path):
    got = _run(tmp_path, "release")
    assert got[2] == "aborted"
    assert all(got[r].startswith("RuntimeError: ") and "released" in got[r] for r in (0, 1)), (
        got
    )  # (waiting or not yet)


@pytest.mark.timeout(90)
def test_a_rank_that_died_fails_the_others_instead_of_leaving_them_waiting(tmp_path):
    got = _run(tmp_path, "die")
    assert all("rank 2 of the group exited during the collective" in got[r] for r in (0, 1)), got


@pytest.mark.timeout(90)
def test_ranks_not_all_on_one_machine_keep_gloo_every_one_of_them(tmp_path):
    assert _run(tmp_path, "elsewhere") == {0: "none", 1: "none", 2: "none"}


@pytest.mark.timeout(90)
def test_a_group_on_one_machine_reduces_through_its_segment(tmp_path):
    got = _run(tmp_path, "plain", n=2)
    assert got == {0: "reduced [3.0, 3.0, 3.0, 3.0, 3.0]", 1: "reduced [3.0, 3.0, 3.0, 3.0, 3.0]"}
