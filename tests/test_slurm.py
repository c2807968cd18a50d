"""Scale-out on a real Slurm (slurmctld, slurmd per host, munge) with 2 hosts faked by network namespaces:
distinct hostnames and addresses, a bridge between them. Needs root and Slurm's packages (`./run test` installs
them as root); without them every test here is skipped, saying what is missing."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import pytest
import torch

import monarch
import monarch.notebook
from monarch.runtime.slurm import commands as slurm
from monarch.runtime.wire.links import HEARTBEAT_TIMEOUT

from conftest import REPO, say_started, started, wait_for, wait_gone, worker_pids
from helpers.kernel_client import monarch_kernel
from helpers.slurm_cluster import missing, running

WHY = missing()
if WHY is not None and os.environ.get("CI") and os.geteuid() == 0:  # CI as root installs Slurm (./run test)
    raise RuntimeError(f"the scale-out tests cannot run: {WHY}")
pytestmark = [pytest.mark.timeout(180), pytest.mark.skipif(WHY is not None, reason=f"no Slurm here: {WHY}")]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with running(tmp_path_factory.mktemp("slurm-jobs")) as c:
        yield c


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    ws = tmp_path_factory.mktemp("workspace")
    (ws / "steps.py").write_text("def step(x):\n    return x + 1\n")
    return ws


@pytest.fixture(scope="module")
def job(cluster, workspace):
    cmd = [sys.executable, "-m", "monarch.notebook", "reserve", "--hosts", "2", "--gpus-per-host", "2",
           "--name", "scale", "--workspace", str(workspace), "--interface", "eth0"]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stderr + cluster.log_tail()
    assert "monarch: job scale is up: 2 hosts (node1, node2)" in out.stderr, out.stderr
    assert re.search(r"monarch: job scale \(Slurm \d+\) is (pending|running)", out.stderr), (
        out.stderr
    )  # the queue, shown
    j = monarch.notebook.job("scale")
    yield j
    if (j.dir.path / "job.json").exists():
        monarch.notebook.cleanup("scale")


@monarch.remote
def whereabouts(group=None, fail_rank=None):
    import socket

    import torch.distributed as dist

    from monarch.runtime.common.net import interface_addr

    if dist.get_rank() == fail_rank:
        raise ValueError(f"rank {fail_rank} fails")
    t = torch.ones(1) * dist.get_rank()
    dist.all_reduce(t, group=group)
    return socket.gethostname(), interface_addr("eth0"), t.item()


@monarch.remote
def nap(marker):
    say_started(marker)
    time.sleep(60)


def test_a_reserved_job_runs_live_functions_collectives_and_tensors_across_hosts(job):
    listed = [j for j in monarch.notebook.list_jobs() if j["name"] == "scale"]
    assert listed and listed[0]["state"] == "RUNNING" and listed[0]["agents_up"] == 2
    t0 = time.monotonic()
    mesh = job.spawn_procs({"gpu": 2})
    print(f"attach + first spawn on 2 hosts x 2: {time.monotonic() - t0:.2f} s")
    try:
        got = whereabouts.on(mesh)().values()
        assert [(h, a) for h, a, _ in got] == [("node1", "10.77.0.11")] * 2 + [("node2", "10.77.0.12")] * 2
        assert {s for _, _, s in got} == {6.0}
        assert [s for *_, s in whereabouts.on(mesh)(mesh.process_group("gpu")).values()] == [1.0, 1.0, 5.0, 5.0]
        assert [s for *_, s in whereabouts.on(mesh)(mesh.process_group("host")).values()] == [2.0, 4.0, 2.0, 4.0]
        with mesh.activate():
            r = torch.full((4,), 1.0).reduce("host", "sum")
        assert torch.equal(monarch.inspect(r, host=1, gpu=1), torch.full((4,), 2.0))
        with mesh.slice(host=0).activate():
            x = torch.arange(3.0)
        moved = x.to_mesh(mesh.slice(host=1))
        assert torch.equal(monarch.inspect(moved, gpu=1), torch.arange(3.0))
        # rank 1 (node1) fails before all_reduce: the ranks waiting on node1 and node2 are released
        with pytest.raises(monarch.RemoteError, match=r"(?s)rank 1 fails.*ranks 0, 2-3 were released from all_reduce"):
            whereabouts.on(mesh)(fail_rank=1)
        assert {s for *_, s in whereabouts.on(mesh)().values()} == {6.0}  # the groups re-formed
    finally:
        pids = worker_pids(mesh)
        mesh.exit()
    assert wait_gone(pids) == []


def test_the_workspace_reaches_each_host_and_an_edit_runs_after_a_sync(job, workspace):
    mesh = job.spawn_procs({"gpu": 1})
    try:

        @monarch.remote
        def run():
            import os

            import steps

            return steps.step(1), os.path.dirname(steps.__file__)

        got = run.on(mesh)().values()
        assert [v for v, _ in got] == [2, 2]
        assert got[0][1] != got[1][1] and all("node" in d for _, d in got)  # each host's own copy
        (workspace / "steps.py").write_text("def step(x):\n    return x * 10\n")
        assert list(mesh.sync_workspace().values()) == [["steps.py"], ["steps.py"]]
        assert [v for v, _ in run.on(mesh)().values()] == [10, 10]
    finally:
        mesh.exit()


def test_a_kernel_restart_attaches_again_to_the_same_agents_with_fresh_workers(job):
    agents = [a.pid for a in job.dir.agents()]
    spawn = "import monarch.notebook\nmesh = monarch.notebook.job('scale').spawn_procs({'gpu': 2})"
    with monarch_kernel() as k:
        assert k.run(spawn, timeout=60).status == "ok"
        r = k.run("%%mesh mesh\nimport socket\nprint(socket.gethostname())")
        assert r.status == "ok", r.text()
        text = r.final_outputs()[0]["text/plain"]
        assert "[host=0,gpu=1] node1" in text and "[host=1,gpu=0] node2" in text, text
        before = k.value("[row['pid'] for row in mesh.to_table().rows]")
        k.km.restart_kernel(now=False)
        assert wait_gone(before) == []  # the agents ended the old kernel's workers
        t0 = time.monotonic()
        assert k.run(spawn, timeout=60).status == "ok"
        print(f"kernel restarted: attach + spawn again on the same agents: {time.monotonic() - t0:.2f} s")
        after = k.value("[row['pid'] for row in mesh.to_table().rows]")
        assert set(after).isdisjoint(before)
        assert k.run("%%mesh mesh\nrank").status == "ok"
        k.km.shutdown_kernel(now=False)
        assert wait_gone(after) == []
    assert [a.pid for a in job.dir.agents()] == agents  # the same agents throughout


def test_a_host_whose_link_goes_down_is_named_within_seconds_and_the_rest_works(job, cluster, tmp_path):
    from monarch.actor import this_host

    mesh = job.spawn_procs({"gpu": 1})
    local = this_host().spawn_procs({"gpu": 1})

    marker = str(tmp_path / "napping")  # (the hosts are namespaces of this machine: one file system)
    fut = nap.on(mesh).call_async(marker)
    wait_for(lambda: started(marker, 2), what="the nap on both hosts")
    cluster.link(1, up=False)  # no RST: packets just stop
    t0 = time.monotonic()
    try:
        # The heartbeats notice (HEARTBEAT_TIMEOUT, 6 s), not TCP's own timeouts (minutes; the nap's reply could
        # not get through either); the wait's deadline says so (a call still waiting then raises TimeoutError,
        # and fails), with room for a loaded machine.
        with pytest.raises(monarch.WorkerDiedError) as e:
            fut.result(timeout=10 * HEARTBEAT_TIMEOUT)
        print(f"link down: the call raised after {time.monotonic() - t0:.1f} s")
        assert "host node2 (10.77.0.12)" in str(e.value) and "stopped answering" in str(e.value), str(e.value)
        assert whereabouts.on(local)().values()[0][2] == 0.0  # other meshes are untouched
    finally:
        cluster.link(1, up=True)
        local.exit()
    # back up: attaching again works (a new link), with fresh workers on both hosts
    again = job.spawn_procs({"gpu": 1})
    assert [h for h, *_ in whereabouts.on(again)().values()] == ["node1", "node2"]
    again.exit()


def test_bad_requests_name_what_is_wrong(cluster):
    with pytest.raises(ValueError, match=r"hosts=5: partition debug has 2 nodes"):
        monarch.notebook.reserve(5)
    with pytest.raises(slurm.SlurmError, match=r"no Slurm partition 'gpus' \(partitions: debug\)"):
        monarch.notebook.reserve(1, partition="gpus")
    with pytest.raises(ValueError, match=r"no job named 'nope' \(jobs: "):
        monarch.notebook.job("nope")
    with pytest.raises(slurm.SlurmError, match=r"(?s)before its agents were up.*no network interface .*'nope0'"):
        monarch.notebook.reserve(1, name="badif", interface="nope0")
    assert "badif" not in [j["name"] for j in monarch.notebook.list_jobs()]
    out = subprocess.run(
        [sys.executable, "-m", "monarch.notebook", "reserve", "--hosts", "1"],
        capture_output=True, text=True, timeout=60, env=dict(os.environ, PATH="/nonexistent"),
    )  # fmt: skip
    assert (
        out.returncode == 2 and "Slurm is not installed here (sbatch, squeue, scancel, sinfo not on PATH)" in out.stderr
    )


def test_ctrl_c_while_reserve_waits_cancels_the_request(cluster):
    import signal

    before = {h: set(cluster.pids_in(h)) for h in range(2)}
    cmd = [sys.executable, "-m", "monarch.notebook", "reserve", "--hosts", "2", "--name", "ctrlc"]
    p = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, cwd=REPO)
    first = p.stderr.readline()  # the queue's state, said while it waits
    assert re.match(r"monarch: job ctrlc \(Slurm (\d+)\) is (pending|running)", first), first
    slurm_id = re.search(r"Slurm (\d+)", first).group(1)
    p.send_signal(signal.SIGINT)
    rest = p.communicate(timeout=30)[1]
    assert p.returncode == 130 and "monarch: the request was cancelled" in rest, (p.returncode, rest)
    assert "ctrlc" not in [j["name"] for j in monarch.notebook.list_jobs()]
    wait_for(lambda: slurm.state(slurm_id).terminal, 60, "the request scancel'ed")

    def new_ones() -> list[int]:
        return [p for h in range(2) for p in cluster.pids_in(h) if p not in before[h]]

    wait_for(lambda: _only_slurmd(new_ones()), 60, "no agent left behind")


def test_a_job_that_slurm_ends_is_reported_and_cleanup_leaves_nothing(cluster, tmp_path):
    job = monarch.notebook.reserve(2, name="ended")
    mesh = job.spawn_procs({"gpu": 1})
    pids = worker_pids(mesh)
    agents = [a.pid for a in job.dir.agents()]
    slurm.cancel(job.meta["slurm_id"])  # ended from outside (scancel, a time limit, a preemption)
    with pytest.raises(monarch.WorkerDiedError, match=r"Slurm job \d+ was cancelled"):
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            whereabouts.on(mesh)()
            time.sleep(0.2)
    assert wait_gone(pids + agents) == []
    with pytest.raises(RuntimeError, match=r"Slurm job \d+ was cancelled|no longer known to Slurm"):
        job.spawn_procs({"gpu": 1})
    monarch.notebook.cleanup("ended")
    assert "ended" not in [j["name"] for j in monarch.notebook.list_jobs()]


def test_a_call_running_when_its_job_is_cleaned_up_names_the_cleanup(cluster, tmp_path):
    job = monarch.notebook.reserve(2, name="cut")
    mesh = job.spawn_procs({"gpu": 1})
    pids = worker_pids(mesh) + [a.pid for a in job.dir.agents()]

    marker = str(tmp_path / "napping")
    fut = nap.on(mesh).call_async(marker)
    wait_for(lambda: started(marker, 2), what="the nap on both hosts")
    monarch.notebook.cleanup("cut")
    with pytest.raises(monarch.MeshStoppedError) as e:
        fut.result(timeout=30)
    assert (
        "stopped because its job 'cut' was cleaned up (monarch.notebook.cleanup) while ranks 0-1 still ran this call (nap)"
        in str(e.value)
    )
    assert "mesh.exit()" not in str(e.value)
    assert wait_gone(pids) == []


@pytest.mark.timeout(300)
def test_the_slurm_notebook_runs(cluster, tmp_path):
    """notebooks/slurm.ipynb: reserve, attach, run, sync, clean up (its outputs checked in test_notebooks)."""
    from pathlib import Path

    from test_notebooks import run_notebook

    before = {h: set(cluster.pids_in(h)) for h in range(2)}  # (another job of this module may be up)
    run_notebook(Path(REPO, "notebooks", "slurm.ipynb"), tmp_path, local_workers=False)  # (its are the agents')
    assert "notebook-demo" not in [j["name"] for j in monarch.notebook.list_jobs()]

    def new_ones() -> list[int]:
        return [p for h in range(2) for p in cluster.pids_in(h) if p not in before[h]]

    wait_for(lambda: _only_slurmd(new_ones()), 60, "the notebook's agents and workers gone")


def test_serve_on_slurm_runs_a_torchrun_script_across_hosts_and_job_load_reuses_them(cluster, tmp_path, monkeypatch):
    """monarch.job.spmd.serve([torchrun --nnodes=2 ...], scheduler="slurm"): a reservation of 2 hosts, the script on
    2 x 2 workers through SPMDActor with torchrun's environment (tests/test_spmd_actor.py: the same losses as
    torchrun on one machine), the job cached so that job_load() runs it again on the same hosts."""
    import json

    from monarch.job.spmd import job_load, serve
    from monarch.runtime.slurm.jobs import Job

    monkeypatch.chdir(tmp_path)  # (the job's cache, .monarch/, goes there)
    script = os.path.join(REPO, "tests", "helpers", "spmd_train.py")
    cmd = ["torchrun", "--nnodes=2", "--nproc-per-node=2", script, "--out", str(tmp_path)]
    job = serve(cmd, scheduler="slurm", scheduler_cfg={"interface": "eth0", "exclusive": False, "job_name": "spmd"})
    (name,) = job.hosts_job.reservations.values()
    agents = [a.pid for a in Job(name).dir.agents()]
    try:
        job.run_spmd()
        got = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
        assert [g["host"] for g in got] == ["node1", "node1", "node2", "node2"]
        assert [[g["env"][k] for k in ("RANK", "LOCAL_RANK", "GROUP_RANK", "GROUP_WORLD_SIZE")] for g in got] == [
            ["0", "0", "0", "2"], ["1", "1", "0", "2"], ["2", "0", "1", "2"], ["3", "1", "1", "2"]]  # fmt: skip
        assert {g["env"]["MASTER_ADDR"] for g in got} == {"10.77.0.11"}  # node1's address on the bridge
        assert len({g["ddp"][0] for g in got}) == 4  # (each rank its own data)

        for r in range(4):
            (tmp_path / f"rank{r}.json").unlink()
        again = job_load(".monarch/job_state.pkl")
        assert again.hosts_job.reservations == {"workers": name}  # the same reservation, still up
        again.run_spmd()
        assert [json.loads((tmp_path / f"rank{r}.json").read_text())["ddp"] for r in range(4)] == [
            g["ddp"] for g in got
        ]
    finally:
        job.kill()
    assert name not in [j["name"] for j in monarch.notebook.list_jobs()]
    assert wait_gone(agents) == []


def test_cleanup_cancels_the_slurm_job_and_every_process_goes(job, cluster):
    mesh = job.spawn_procs({"gpu": 2})
    pids = worker_pids(mesh)
    agents = [a.pid for a in job.dir.agents()]
    slurm_id = job.meta["slurm_id"]
    monarch.notebook.cleanup("scale")
    assert wait_gone(pids + agents) == []
    wait_for(lambda: slurm.state(slurm_id).terminal, 60, "the Slurm job ended")  # (COMPLETING for a moment)
    assert all(cluster.pids_in(h) == [] or _only_slurmd(cluster.pids_in(h)) for h in range(2))


def _only_slurmd(pids: list[int]) -> bool:
    names = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/comm") as f:
                names.append(f.read().strip())
        except OSError:
            pass
    return set(names) <= {"slurmd", "sh", "unshare"}
