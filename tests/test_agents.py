"""Host agents, without Slurm: two real agent processes on this machine (each on its own loopback address,
each with its own workspace directory), started by the test as `srun` would start them on two hosts.

The same code paths as a Slurm job's, but for the submission (tests/test_slurm.py runs those on a real
Slurm with hosts in network namespaces, when it can)."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import monarch
import monarch.notebook
from monarch.actor import this_host
from monarch.runtime.common.processes import batches, usable_cpus

from conftest import pid_alive, say_started, started, wait_for, wait_gone, worker_pids
from helpers.agent_job import AgentJob

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    root = tmp_path_factory.mktemp("jobs")
    source = root / "workspace-source"
    source.mkdir()
    (source / "udf.py").write_text("def version():\n    return 1\n")
    (source / "data.txt").write_text("unchanged\n")
    # (meshes of any size bundled: the fan-in that larger meshes get, shown here with real workers)
    j = AgentJob(root, "agents", hosts=2, workspace=source, env={"MONARCH_BUNDLE_ABOVE": "0"})
    j.source = source
    j.start()
    yield j
    assert j.stop() == []


@pytest.fixture(scope="module")
def mesh(job):
    m = monarch.notebook.job(job.name).spawn_procs({"gpu": 2})
    pids = worker_pids(m)
    yield m
    m.exit()
    assert wait_gone(pids) == []


@monarch.remote
def where(group=None):
    import torch.distributed as dist

    t = torch.ones(1) * dist.get_rank()
    dist.all_reduce(t, group=group)
    return t.item()


def _ancestors(pid: int) -> list[int]:
    out = []
    while pid > 1:
        with open(f"/proc/{pid}/stat") as f:
            pid = int(f.read().rsplit(")", 1)[1].split()[1])
        out.append(pid)
    return out


def test_a_mesh_on_two_hosts_runs_collectives_over_host_and_gpu(job, mesh):
    assert mesh.sizes == {"host": 2, "gpu": 2}
    assert where.on(mesh)().values() == [6.0] * 4
    assert where.on(mesh)(mesh.process_group("gpu")).values() == [1.0, 1.0, 5.0, 5.0]
    assert where.on(mesh)(mesh.process_group("host")).values() == [2.0, 4.0, 2.0, 4.0]
    # each host's workers were forked by that host's agent (through its own fork server)
    for rank, pid in enumerate(worker_pids(mesh)):
        assert job.pids[rank // 2] in _ancestors(pid)
    # the agents themselves never load torch (their fork servers do): answering a controller costs no import
    for pid in job.pids:
        with open(f"/proc/{pid}/maps") as f:
            assert "libtorch" not in f.read()
    # an agent's workers run as SCHED_BATCH where they and the agent outnumber the host's CPUs (2 workers a host)
    want = os.SCHED_BATCH if batches(2, usable_cpus()) else os.SCHED_OTHER
    assert policy.on(mesh)().values() == [want] * 4


@monarch.remote
def policy() -> int:
    return os.sched_getscheduler(0)


@monarch.remote
def speak() -> int:
    print("the same line on every rank")
    print(f"rank {os.environ['RANK']} says")
    return int(os.environ["RANK"]) // 2


def test_replies_and_output_come_bundled_by_the_agents_and_read_as_before(mesh, capfd):
    """Each host's agent bundles its workers' replies and output (`runtime/wire/fanin.py`): what the user gets is
    what they got before, each rank's lines in its own place and order."""
    from monarch.runtime.controller import get_controller

    transport = get_controller().backend.transport
    before = transport.bundles
    assert speak.on(mesh)().values() == [0, 0, 1, 1]
    assert transport.bundles > before
    out = capfd.readouterr().out
    for rank in range(4):
        label = f"host={rank // 2},gpu={rank % 2}"
        mine = [line for line in out.splitlines() if line.startswith(f"[{label}] ")]
        assert mine == [f"[{label}] the same line on every rank", f"[{label}] rank {rank} says"], out


def test_stacks_of_ranks_on_two_hosts_come_bundled_and_read_grouped(mesh):
    from monarch.runtime.controller import get_controller

    transport = get_controller().backend.transport
    before = transport.bundles
    text = str(mesh.stacks())
    assert "-- ranks 0-3:\n  MainThread: idle" in text, text
    assert transport.bundles > before


def test_the_tensor_engine_reduces_across_hosts_and_moves_between_them(mesh):
    with mesh.activate():
        r = torch.ones(3).mul(float(1)).reduce("host", "sum")
        coords = torch.arange(4.0).reduce("gpu", "stack")
    assert torch.equal(monarch.inspect(r, host=1, gpu=0), torch.full((3,), 2.0))
    first, second = mesh.slice(host=0), mesh.slice(host=1)
    with first.activate():
        x = torch.full((2,), 7.0)
    moved = x.to_mesh(second)
    assert torch.equal(monarch.inspect(moved, gpu=1), torch.full((2,), 7.0))
    assert monarch.inspect(coords, host=1, gpu=1).shape == (2, 4)


def test_the_workspace_travels_by_changed_file_and_changed_modules_reload(job, mesh):
    @monarch.remote
    def use():
        import udf

        return udf.version(), os.getcwd()

    got = use.on(mesh)().values()
    assert [v for v, _ in got] == [1] * 4
    assert {cwd for _, cwd in got} == {str(job.workspaces[0]), str(job.workspaces[1])}  # each host its own copy
    (job.source / "udf.py").write_text("def version():\n    return 2\n")
    changed = mesh.sync_workspace()
    assert sorted(changed.values()) == [["udf.py"], ["udf.py"]]  # the unchanged file did not travel
    assert [v for v, _ in use.on(mesh)().values()] == [2] * 4  # reloaded, no new reservation
    (job.source / "data.txt").unlink()
    assert sorted(mesh.sync_workspace().values()) == [["data.txt"], ["data.txt"]]
    assert not (job.workspaces[1] / "data.txt").exists()
    assert mesh.sync_workspace() == {k: [] for k in changed}


def test_the_jobs_secret_is_private_and_on_no_command_line(job, mesh):
    d = job.dir.path
    assert stat.S_IMODE(d.stat().st_mode) == 0o700
    assert stat.S_IMODE((d / "secret.json").stat().st_mode) == 0o600
    secret = job.dir.secret()
    needles = [secret.key.hex().encode(), secret.curve.server_secret, secret.curve.client_secret]
    for pid in job.pids + worker_pids(mesh):
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read()
        with open(f"/proc/{pid}/environ", "rb") as f:
            environ = f.read()
        assert not any(n in cmdline or n in environ for n in needles), pid


def test_a_stranger_without_the_jobs_key_gets_no_answer(job, mesh):
    import zmq

    from monarch.runtime.wire import codec, protocol

    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    public, secret = zmq.curve_keypair()  # its own client keys: the agent's ZAP handler refuses them
    s.curve_serverkey = job.dir.secret().curve.server_public
    s.curve_publickey, s.curve_secretkey = public, secret
    s.connect(job.dir.agents()[0].endpoints["ctl"])
    s.send_multipart(codec.encode(os.urandom(32), protocol.LINK, -1, 1, protocol.pack(protocol.AgentHello("x"))))
    assert s.poll(1000) == 0
    s.close(0)
    assert where.on(mesh)().values() == [6.0] * 4  # the agents serve on


def test_a_mesh_of_few_ranks_is_not_bundled_its_replies_go_up_as_they_came(tmp_path):
    """Bundling pays on many ranks (`MONARCH_BUNDLE_ABOVE`, 64); below, each reply goes straight up through the
    agent's C proxy (a hop through its Python would cost each call latency)."""
    from monarch.runtime.controller import get_controller

    j = AgentJob(tmp_path, "unbundled", hosts=1)
    j.start()
    try:
        mesh = monarch.notebook.job("unbundled").spawn_procs({"gpu": 3})
        transport = get_controller().backend.transport
        before = transport.bundles
        assert speak.on(mesh)().values() == [0, 0, 1]
        assert transport.bundles == before
        mesh.exit()
    finally:
        assert j.stop() == []


CONTROLLER = textwrap.dedent(
    """
    import os, sys, time
    os.environ["MONARCH_JOBS_DIR"] = sys.argv[1]
    import monarch.notebook
    mesh = monarch.notebook.job(sys.argv[2]).spawn_procs({"gpu": 1})
    print(" ".join(str(r["pid"]) for r in mesh.to_table().rows), flush=True)
    time.sleep(120)
    """
)


def test_the_agents_end_the_workers_of_a_controller_that_died_and_serve_the_next_one(tmp_path):
    j = AgentJob(tmp_path, "restart", hosts=2)
    j.start()
    try:
        other = subprocess.Popen(
            [sys.executable, "-c", CONTROLLER, str(tmp_path), j.name], stdout=subprocess.PIPE, text=True
        )
        pids = [int(p) for p in other.stdout.readline().split()]
        assert len(pids) == 2
        with pytest.raises(ConnectionError, match=r"refused: the job is in use by the controller \S+:\d+"):
            monarch.notebook.job(j.name).spawn_procs({"gpu": 1})
        other.send_signal(signal.SIGKILL)  # a kernel killed: its link closes, its workers go
        other.wait()
        assert wait_gone(pids) == []
        t0 = time.monotonic()
        mesh = monarch.notebook.job(j.name).spawn_procs({"gpu": 1})
        print(f"attach and start after a controller died: {time.monotonic() - t0:.2f} s")
        fresh = worker_pids(mesh)
        assert set(fresh).isdisjoint(pids) and all(pid_alive(p) for p in j.pids)  # the same agents
        assert where.on(mesh)().values() == [1.0, 1.0]
        mesh.exit()
    finally:
        assert j.stop() == []


def test_the_same_controller_attaching_again_before_its_old_link_ends_takes_over(tmp_path):
    """A controller that lost a host detaches and attaches again; on a loaded machine the agents can read its
    new hello before they see the old link close. The old link stays open here, so that order is certain."""
    from monarch.runtime.controller import get_controller

    j = AgentJob(tmp_path, "again", hosts=2)
    j.start()
    try:
        job = monarch.notebook.job(j.name)
        mesh = job.spawn_procs({"gpu": 1})
        pids = worker_pids(mesh)
        controller = get_controller()
        old = controller.jobs.pop(j.name)  # (forgotten, not closed: its link is still up)
        again = job.spawn_procs({"gpu": 1})
        assert wait_gone(pids) == []  # the old link's workers went with it
        assert where.on(again)().values() == [1.0, 1.0]
        for host in old.hosts:
            host.lost = "replaced by a new link"  # (nothing to wait for: the agents answer only the new link)
        mesh.exit()
        old.close()
        again.exit()
    finally:
        assert j.stop() == []


def test_a_host_whose_agent_dies_is_named_and_other_meshes_keep_working(tmp_path):
    j = AgentJob(tmp_path, "lost", hosts=2)
    j.start()
    local = this_host().spawn_procs({"gpu": 2})
    try:
        mesh = monarch.notebook.job(j.name).spawn_procs({"gpu": 2})
        pids = worker_pids(mesh)

        @monarch.remote
        def nap(marker):
            say_started(marker)
            time.sleep(60)

        marker = str(tmp_path / "napping")
        fut = nap.on(mesh).call_async(marker)
        wait_for(lambda: started(marker, 4), what="the nap on every rank")
        os.kill(j.pids[1], signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(monarch.WorkerDiedError) as e:
            fut.result(timeout=30)
        print(f"agent killed: the call raised after {time.monotonic() - t0:.2f} s")
        assert "is on host" in str(e.value) and "(127.0.0.2)" in str(e.value), str(e.value)
        assert wait_gone(pids) == []  # the lost host's workers went with their agent, the others were stopped
        assert where.on(local)().values() == [1.0, 1.0]  # this machine's mesh is untouched
        with pytest.raises(ConnectionError, match=r"the agent on \S+ \(127.0.0.2\) is not listening"):
            mesh.respawn()
    finally:
        local.exit()
        j.stop()


@monarch.remote
def fails_on_rank_1_before_all_reduce():
    import torch.distributed as dist

    t = torch.ones(2)
    if dist.get_rank() == 1:
        raise ValueError("bad input shape on rank 1")
    dist.all_reduce(t)
    return t.sum().item()


def test_one_rank_failing_before_a_collective_releases_the_ranks_on_other_hosts_too(mesh):
    """Rank 1 (host 0) raises; ranks 0 (host 0) and 2-3 (host 1) wait in all_reduce: all are released."""
    pids = worker_pids(mesh)
    for _ in range(3):  # (and again, on the groups re-formed after the last one)
        # Released promptly, not by the groups' timeout (600 s): the wait has a deadline far below it, and a
        # release that never came would end it with TimeoutError (benchmarks/faults.py has the real figure).
        with pytest.raises(monarch.RemoteError) as e:
            fails_on_rank_1_before_all_reduce.on(mesh).call_async().result(timeout=30)
        text = str(e.value)
        assert "bad input shape on rank 1" in text
        assert "ranks 0, 2-3 were released from all_reduce" in text, text
        assert where.on(mesh)().values() == [6.0] * 4 and worker_pids(mesh) == pids  # the groups re-formed


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_an_agents_workers_own_its_gpus_and_reduce_over_nccl(tmp_path):
    """One agent on a GPU machine: it counts the GPUs without importing torch itself, each worker owns
    `cuda:<local rank>`, and a CUDA tensor's all_reduce runs over NCCL, released like gloo's on a failure."""
    n = torch.cuda.device_count()
    j = AgentJob(tmp_path, "gpus", hosts=1)
    j.start()
    mesh = None
    try:
        mesh = monarch.notebook.job("gpus").spawn_procs({"gpu": n})
        assert mesh.spawned.backend.hosts[0].info.gpus == n

        @monarch.remote
        def nccl_sum(fail_rank=None):
            import torch.distributed as dist

            if dist.get_rank() == fail_rank:
                raise ValueError("fails")
            t = torch.ones(4, device="cuda") * dist.get_rank()
            dist.all_reduce(t)
            return str(t.device), t[0].item(), dist.get_backend()

        res = nccl_sum.on(mesh)().values()
        assert [d for d, _, _ in res] == [f"cuda:{i}" for i in range(n)]
        assert {s for _, s, _ in res} == {float(sum(range(n)))} and all("cuda:nccl" in b for *_, b in res)
        if n > 1:
            with pytest.raises(monarch.RemoteError, match="were released from all_reduce"):
                nccl_sum.on(mesh)(fail_rank=1)
            assert {s for _, s, _ in nccl_sum.on(mesh)().values()} == {float(sum(range(n)))}
    finally:
        if mesh is not None:
            mesh.exit()
        assert j.stop() == []
