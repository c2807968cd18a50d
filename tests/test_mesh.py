"""Spawned meshes: coordinates, views, process groups, tables."""

import pytest
import torch
import torch.distributed as dist

import monarch
from monarch.actor import current_rank, current_size


@monarch.remote
def whoami():
    import os

    from monarch.runtime.common import context

    return {"rank": context.worker.rank, "view": current_rank(), "sizes": current_size(), "pid": os.getpid(),
            "device": str(context.worker.device), "env_rank": os.environ["RANK"]}  # fmt: skip


@monarch.remote
def all_reduce_rank(group):
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t, group=group)
    return t.item(), dist.get_world_size(group)


def test_spawn_2x4_coordinates(mesh8):
    assert mesh8.sizes == {"host": 2, "gpu": 4} and len(mesh8) == 8
    info = whoami.on(mesh8)()
    for coords, v in info.items():
        assert v["view"] == coords
        assert v["rank"] == coords["host"] * 4 + coords["gpu"] == int(v["env_rank"])
        assert v["sizes"] == {"host": 2, "gpu": 4}
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        # (8 workers on this machine: each its own GPU where there are 8, else all on the CPU, as NCCL wants)
        assert v["device"] == (f"cuda:{v['rank']}" if gpus >= 8 else "cpu")
    assert len({v["pid"] for v in info.values()}) == 8


def test_views_share_workers_and_have_their_own_coordinates(mesh8):
    pids = {(c["host"], c["gpu"]): v["pid"] for c, v in whoami.on(mesh8)().items()}
    renamed = mesh8.rename(host="dp", gpu="tp")
    assert renamed.sizes == {"dp": 2, "tp": 4}
    for c, v in whoami.on(renamed)().items():
        assert v["view"] == c and v["pid"] == pids[(c["dp"], c["tp"])]
    split = mesh8.split(host=("dp", "pp"), gpu=("tp",), pp=2)
    assert split.sizes == {"dp": 1, "pp": 2, "tp": 4}
    stage1 = split.slice(pp=1)
    assert stage1.sizes == {"dp": 1, "tp": 4}
    res = whoami.on(stage1)()
    assert [v["rank"] for v in res.values()] == [4, 5, 6, 7]
    assert res.item(dp=0, tp=2)["view"] == {"dp": 0, "tp": 2}
    part = mesh8.slice(gpu=range(1, 3))
    assert [v["rank"] for v in whoami.on(part)().values()] == [1, 2, 5, 6]
    flat = mesh8.slice(gpu=slice(0, 4, 2)).flatten("w")
    assert [(c, v["rank"]) for c, v in whoami.on(flat)().items()] == [({"w": i}, r) for i, r in enumerate([0, 2, 4, 6])]


def test_all_reduce_over_one_dimension(mesh8):
    gpu = all_reduce_rank.on(mesh8)(mesh8.process_group("gpu"))
    assert gpu.item(host=0, gpu=2) == (0 + 1 + 2 + 3, 4)
    assert gpu.item(host=1, gpu=0) == (4 + 5 + 6 + 7, 4)
    host = all_reduce_rank.on(mesh8)(mesh8.process_group("host"))
    assert [v for v, _ in host.values()] == [4.0, 6.0, 8.0, 10.0] * 2
    world = all_reduce_rank.on(mesh8)(mesh8.process_group(("host", "gpu")))
    assert set(world.values()) == {(28.0, 8)}


def test_group_on_a_renamed_slice(mesh8):
    view = mesh8.split(host=("dp", "pp"), gpu=("tp",), pp=2).slice(pp=1)
    res = all_reduce_rank.on(view)(view.process_group("tp"))
    assert res.values() == [(22.0, 4)] * 4
    # the same partition asked for again is the same group, not a new one
    again = view.process_group("tp")
    assert all_reduce_rank.on(view)(again).item(dp=0, tp=0) == (22.0, 4)


def test_to_table_lists_every_worker(mesh8):
    table = mesh8.to_table()
    text = str(table)
    assert text.splitlines()[0] == "ProcMesh {host: 2, gpu: 4}"
    assert table.columns == ["host", "gpu", "rank", "hostname", "pid", "device", "status", "memory", "running", "for"]
    assert [r["rank"] for r in table.rows] == list(range(8))
    assert {r["status"] for r in table.rows} == {"idle"}
    assert all(r["memory"].endswith("MiB") for r in table.rows)
    sub = str(mesh8.slice(host=1).to_table())
    assert "ProcMesh {gpu: 4}" in sub and len(sub.splitlines()) == 3 + 4


def test_bad_dimension_names_are_explained(mesh8):
    with pytest.raises(ValueError, match=r"unknown mesh dimension 'gpus'; this mesh has dimensions \('host', 'gpu'\)"):
        mesh8.process_group("gpus")
    with pytest.raises(ValueError, match="index gpu=9 is out of range; gpu has size 4"):
        mesh8.slice(gpu=9)
    with pytest.raises(ValueError, match="not divisible by 3"):
        mesh8.split(gpu=("a", "b"), a=3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_nccl_all_reduce_on_gpus():
    from monarch.actor import this_host

    n = torch.cuda.device_count()
    mesh = this_host().spawn_procs({"gpu": n})

    @monarch.remote
    def nccl_sum():
        t = torch.ones(4, device="cuda") * dist.get_rank()
        dist.all_reduce(t)
        return str(t.device), t[0].item(), dist.get_backend()

    try:
        res = nccl_sum.on(mesh)().values()
        assert [d for d, _, _ in res] == [f"cuda:{i}" for i in range(n)]
        assert {s for _, s, _ in res} == {float(sum(range(n)))}
    finally:
        mesh.exit()


def test_exit_lets_every_worker_finish_by_itself():
    """`exit()` asks the workers to stop; each closes its groups and sockets and exits with status 0 (not
    killed after the grace period: a socket left open would have kept it waiting)."""
    from monarch.actor import this_host

    mesh = this_host().spawn_procs({"host": 2, "gpu": 2})
    group = mesh.process_group("gpu")  # a group made later, and the store connections behind it
    assert [s for s, _ in all_reduce_rank.on(mesh)(group).values()] == [1.0, 1.0, 5.0, 5.0]
    mesh.exit()
    assert mesh.spawned.exit_codes == {0: 0, 1: 0, 2: 0, 3: 0}
