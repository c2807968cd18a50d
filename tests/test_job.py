"""`monarch.job` and `monarch.job.spmd`: Monarch's jobs on our backends. `serve([...torchrun...],
scheduler="local_cwd").run_spmd()` runs the script on local workers and gives torchrun's environment; the job is
cached so that `job_load()` runs it again; `LocalJob`, `ProcessJob` give host meshes to spawn on; a torchrun
command line is read as Monarch reads it, and whatever cannot be served says why. (The Slurm path:
tests/test_slurm.py, `test_serve_on_slurm_runs_a_torchrun_script_across_hosts_and_job_load_reuses_them`.)"""

from __future__ import annotations

import json
import os
import stat
import sys

import pytest

import monarch
import monarch.job
from monarch.actor import this_host
from monarch.job import (
    DEFAULT_JOB_PATH,
    JobState,
    LocalJob,
    MeshAdminConfig,
    PortForwarder,
    ProcessJob,
    SlurmJob,
    TelemetryConfig,
    exec_command,
    job_load,
    job_loads,
    shell,
)
from monarch.job.spmd import SPMDJob, serve

from conftest import REPO, wait_for, wait_gone, worker_pids

SCRIPT = os.path.join(REPO, "tests", "helpers", "spmd_train.py")
MONARCH_JOB_ALL = [
    "DEFAULT_JOB_PATH", "exec_command", "JobTrait", "job_load", "job_loads", "JobState", "load_current_job", "LocalJob",
    "MeshAdminConfig", "PortForwarder", "ProcessJob", "set_current_job", "shell", "SlurmJob", "TelemetryConfig",
]  # fmt: skip
"""Monarch's `monarch.job.__all__` (python/monarch/job/__init__.py)."""


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    """The working directory is a fresh folder: `.monarch/` (the job cache) goes there."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_serve_local_runs_the_script_on_every_rank_and_job_load_runs_it_again(in_tmp):
    others = _my_workers()  # (other tests' meshes: a session's shared mesh lives on)
    out = in_tmp / "out"
    out.mkdir()
    job = serve(["torchrun", "--nproc-per-node=2", "--standalone", SCRIPT, "--out", str(out)], scheduler="local_cwd")
    assert isinstance(job, SPMDJob) and job.script_args == [SCRIPT, "--out", str(out)] and job.nproc_per_node == 2
    job.run_spmd()
    first = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    assert [(s["env"]["RANK"], s["env"]["LOCAL_RANK"], s["env"]["WORLD_SIZE"]) for s in first] == [
        ("0", "0", "2"), ("1", "1", "2")]  # fmt: skip
    assert {s["name"] for s in first} == {"__main__"}
    assert _my_workers() == others  # (stopped when the run ended)

    # the job was cached where Monarch's example says, privately
    st = os.stat(DEFAULT_JOB_PATH)
    assert stat.S_IMODE(st.st_mode) == 0o600 and stat.S_IMODE(os.stat(".monarch").st_mode) == 0o700
    for f in out.iterdir():
        f.unlink()
    again = job_load(DEFAULT_JOB_PATH)
    assert isinstance(again, SPMDJob) and again.active
    again.run_spmd()  # fresh workers, the same script: the same losses
    second = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    assert [s["ddp"] for s in second] == [s["ddp"] for s in first]


def test_a_failing_rank_fails_run_spmd_and_no_worker_is_left(in_tmp):
    others = _my_workers()
    job = serve(["torchrun", "--nproc-per-node", "2", SCRIPT, "--out", str(in_tmp), "--fail-rank", "0"])
    with pytest.raises(monarch.RemoteError, match=r"(?s)rank 0 \(gpus=0\): ValueError: rank 0 fails on purpose"):
        job.run_spmd()
    wait_for(lambda: _my_workers() == others, what="run_spmd's workers exiting")


def _my_workers() -> list[int]:
    """The worker processes descended from this one, sorted (run_spmd stops its own when it ends)."""
    me, found = os.getpid(), []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                if not f.read().startswith(b"monarch worker"):
                    continue
            pid = int(name)
            while pid > 1:
                with open(f"/proc/{pid}/stat") as f:
                    pid = int(f.read().rsplit(")", 1)[1].split()[1])
                if pid == me:
                    found.append(int(name))
                    break
        except (OSError, ValueError):
            continue
    return sorted(found)


def test_torchrun_command_lines_are_read_as_monarch_reads_them_and_bad_ones_say_why(in_tmp):
    from monarch.runtime.job.spmd import parse_torchrun

    cmd = parse_torchrun(["python", "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node", "8",
                          "--rdzv-backend=c10d", "-m", "pkg.train", "--lr", "0.1", "--nproc-per-node", "3"])  # fmt: skip
    assert (cmd.script_args, cmd.nproc_per_node, cmd.nnodes) == (["-m", "pkg.train", "--lr", "0.1",
                                                                  "--nproc-per-node", "3"], 8, 2)  # fmt: skip
    assert parse_torchrun([sys.executable, "train.py", "-x"]).script_args == ["train.py", "-x"]
    assert parse_torchrun(["torchrun", "--nproc-per-node=cpu", "t.py"]).nproc_per_node == os.cpu_count()
    bad = {
        ("torchrun", "--nnodes=1:4", "t.py"): r"--nnodes='1:4': give a fixed number of hosts",
        ("torchrun", "--nproc-per-node=0", "t.py"): r"--nproc-per-node='0': give a number >= 1, or gpu, cpu, auto",
        ("torchrun", "--bogus", "t.py"): r"torchrun has no option '--bogus'",
        ("torchrun", "--nproc-per-node=2"): r"no training script",
        ("torchrun", "--no-python", "t"): r"--no-python runs an executable, not Python",
        ("bash", "t.sh"): r"expected a torchrun command .* got 'bash' first",
    }
    for words, message in bad.items():
        with pytest.raises(ValueError, match=message):
            serve(list(words))
    with pytest.raises(ValueError, match=r"--nnodes=2: scheduler='local_cwd' is this one machine.*use scheduler='sl"):
        serve(["torchrun", "--nnodes=2", "t.py"], scheduler="local_cwd")
    with pytest.raises(ValueError, match=r"scheduler='mast_conda': here an SPMD job runs on this machine"):
        serve(["torchrun", "t.py"], scheduler="mast_conda")
    with pytest.raises(ValueError, match=r"scheduler='local_cwd' takes no scheduler_cfg here, got \['partition'\]"):
        serve(["torchrun", "t.py"], scheduler_cfg={"partition": "gpu"})
    with pytest.raises(ValueError, match=r"scheduler_cfg: no Slurm option 'colour' here \(options: partition, time"):
        serve(["torchrun", "t.py"], scheduler="slurm", scheduler_cfg={"colour": "red"})
    with pytest.raises(TypeError, match=r"got a dict; without torchx .* takes the torchrun command as a list"):
        serve({"roles": []})
    assert not os.path.exists(DEFAULT_JOB_PATH)  # (nothing was served)


def test_jobs_give_host_meshes_by_name_and_are_cached_and_loaded_privately(in_tmp):
    job = LocalJob(("trainers", "loaders"))
    state = job.state(cached_path="cache/job.pkl")
    assert isinstance(state, JobState) and state.trainers is this_host() and state.loaders is this_host()
    with pytest.raises(AttributeError, match=r"'critics' is not a host mesh of this job \(its host meshes: loaders, "):
        _ = state.critics
    assert job.active and job.apply_id and isinstance(job_load("cache/job.pkl"), LocalJob)
    assert job_loads(job.dumps())._host_names == ("trainers", "loaders")

    os.chmod("cache/job.pkl", 0o666)  # another user could have written it: a pickle runs code as it loads
    with pytest.raises(PermissionError, match=r"writable by nobody else \(mode 666\)"):
        job_load("cache/job.pkl")
    with pytest.raises(ValueError, match=r"hosts must be a sequence of host mesh names"):
        LocalJob("trainers")

    fake = ProcessJob({"trainers": 2})  # several hosts, faked on this machine
    procs = fake.state(cached_path=None).trainers.spawn_procs(per_host={"gpu": 2})
    pids = worker_pids(procs)
    try:
        assert procs.sizes == {"host": 2, "gpu": 2}
        assert monarch.remote(lambda: monarch.current_rank()["host"]).on(procs)().values() == [0, 0, 1, 1]
    finally:
        procs.exit()
    assert wait_gone(pids) == []
    with pytest.raises(ValueError, match=r"meshes\['trainers'\] = 0: give a number of hosts >= 1"):
        ProcessJob({"trainers": 0})


def test_exec_command_runs_on_every_process_with_its_coordinates(in_tmp):
    others = _my_workers()
    script = "echo rank $MONARCH_RANK_gpu of $MONARCH_SIZE_gpu in $PWD; exit $MONARCH_RANK_gpu"
    assert exec_command(this_host(), ["bash", "-c", script], per_host={"gpu": 2}, output_dir="logs/$SUBDIR").get() == 1
    assert (in_tmp / "logs" / "gpu_1" / "stdout.txt").read_text() == f"rank 1 of 2 in {in_tmp}\n"
    assert exec_command(this_host(), ["bash", "-c", script], per_host={"gpu": 2}, rank=0).get() == 0
    wait_for(lambda: _my_workers() == others, what="exec_command's workers exiting")
    with pytest.raises(ValueError, match=r"cmd must be a non-empty list of strings"):
        exec_command(this_host(), "ls")


def test_a_local_job_can_run_its_client_script(in_tmp):
    (in_tmp / "client.py").write_text("print('client ran')\n")
    job = LocalJob()
    job.apply(client_script="client.py")
    assert job.process.wait(timeout=60) == 0
    wait_for(lambda: "client ran" in open(os.path.join(job.log_dir, "stdout.log")).read(), what="the client's output")


def test_what_needs_what_we_do_not_have_says_what_to_use_instead(in_tmp):
    import monarch.job.kubernetes
    import monarch.job.meta

    for make, instead in [
        (TelemetryConfig, r"telemetry sidecar .* not available in this monarch: use monarch.profiler"),
        (MeshAdminConfig, r"mesh admin agent .* not available in this monarch: use mesh.to_table\(\)"),
        (PortForwarder, r"PortForwarder .* not available .* connect to the host and port"),
        (lambda: shell(this_host()), r"interactive terminal on a host\) is not available .*monarch.job.exec_command"),
        (monarch.job.kubernetes.KubernetesJob, r"KubernetesJob is not available .* use monarch.job.SlurmJob"),
        (monarch.job.meta.MASTJob, r"MASTJob .* not available .* use monarch.job.SlurmJob"),
        (lambda: LocalJob().enable_telemetry(), r"telemetry sidecar"),
        (lambda: LocalJob().remote_mount("/data"), r"remote_mount\('/data'\): .* mesh.sync_workspace\(\)"),
    ]:
        with pytest.raises(NotImplementedError, match=instead):
            make()
    with pytest.raises(ValueError, match=r"python_exe='/opt/py'.*run the controller with that Python"):
        SlurmJob({"trainers": 2}, python_exe="/opt/py")
    with pytest.raises(ValueError, match=r"ntasks_per_node=4.*spawn_procs\(per_host="):
        SlurmJob({"trainers": 2}, ntasks_per_node=4)
    with pytest.raises(ValueError, match=r"mesh name '2x': use an identifier"):
        SlurmJob({"2x": 2})
    assert sorted(monarch.job.__all__) == sorted(MONARCH_JOB_ALL)
