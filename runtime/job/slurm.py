"""Monarch's `SlurmJob`, mapped onto this project's Slurm reservations (`monarch.runtime.slurm.jobs.reserve`):
each host mesh of the job is one reservation (a batch job whose `srun` starts one host agent per node), and
`state().<name>` is that reservation's `Job`, whose `spawn_procs(per_host)` starts a mesh ``{host: N,
**per_host}`` through its agents.

    job = SlurmJob({"trainers": 2}, partition="gpu", gpus_per_node=8)
    procs = job.state().trainers.spawn_procs(per_host={"gpus": 8})
    job.kill()                                                        # scancel

What differs from Monarch's: one Slurm job per host mesh (Monarch puts all of them in one); the agents run this
process's Python (`python_exe` must be it); `monarch_port` is not used (agents pick their ports and write them
in the job's directory); options without a counterpart (`log_dir`, `ntasks_per_node` other than 1,
`out_of_cluster`, `attach_to`) are refused, naming why.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence

from monarch.runtime.job.job import JobState, JobTrait, _check_meshes
from monarch.runtime.slurm import commands as slurm
from monarch.runtime.slurm import jobs


class SlurmJob(JobTrait):
    """Host meshes reserved through Slurm (Monarch's `monarch.job.SlurmJob`; see the module)."""

    def __init__(
        self,
        meshes: dict[str, int],
        python_exe: str = "python",
        slurm_args: Sequence[str] = (),
        monarch_port: int = 22222,
        job_name: str = "monarch_job",
        ntasks_per_node: int = 1,
        time_limit: str | None = None,
        partition: str | None = None,
        log_dir: str | None = None,
        exclusive: bool = True,
        gpus_per_node: int | None = None,
        cpus_per_task: int | None = None,
        mem: str | None = None,
        job_start_timeout: int | None = None,
        account: str | None = None,
        qos: str | None = None,
        out_of_cluster: bool = False,
        attach_to: str | None = None,
        *,
        interface: str | None = None,
        workspace: str | None = None,
    ) -> None:
        """Monarch's arguments, and two of ours: `interface`, the network interface the hosts' agents listen on
        and give gloo/NCCL (default: each host's first one up); `workspace`, a folder copied to each host (the
        workers' working directory; `mesh.sync_workspace()` copies what changed)."""
        super().__init__()
        _check_meshes(meshes)
        if python_exe not in ("python", "python3", sys.executable):
            raise ValueError(
                f"SlurmJob(python_exe={python_exe!r}): the hosts' agents run this process's Python "
                f"({sys.executable}), so that workers unpickle what it sends; run the controller with that Python"
            )
        if ntasks_per_node != 1:
            raise ValueError(
                f"SlurmJob(ntasks_per_node={ntasks_per_node!r}): one agent runs per host and starts its workers; "
                "ask for processes per host with spawn_procs(per_host={'gpus': N})"
            )
        if log_dir is not None:
            raise ValueError(
                f"SlurmJob(log_dir={log_dir!r}): the agents' Slurm output goes to the job's own directory "
                "(MONARCH_JOBS_DIR/<name>/slurm-<id>.out); leave log_dir out"
            )
        if out_of_cluster or attach_to is not None:
            raise ValueError(
                "SlurmJob(out_of_cluster=/attach_to=): the controller connects to each host's agent directly "
                "(TCP with CURVE); run it where it reaches the hosts (a login node)"
            )
        if isinstance(slurm_args, str) or not all(isinstance(a, str) for a in slurm_args):
            raise ValueError(f"slurm_args must be a list of sbatch options, got {slurm_args!r}")
        self._meshes = dict(meshes)
        self._job_name = job_name
        self._time_limit = time_limit
        self._partition = partition
        self._gpus_per_node = gpus_per_node
        self._job_start_timeout = job_start_timeout
        self._interface = interface
        self._workspace = workspace
        self._monarch_port = monarch_port
        options = [a for a in slurm_args if a.startswith("-")]  # (Monarch keeps only options, too)
        if exclusive:
            options.append("--exclusive")
        options += [f"--{k}={v}" for k, v in (("cpus-per-task", cpus_per_task), ("mem", mem), ("account", account),
                                              ("qos", qos)) if v is not None]  # fmt: skip
        self._sbatch = options
        self._reserved: dict[str, str] = {}
        """Mesh name -> the name of its reservation (a job of `monarch.runtime.slurm.jobs`)."""

    def add_mesh(self, name: str, num_nodes: int) -> None:
        """Another host mesh of `num_nodes` hosts (before the job is applied)."""
        _check_meshes({name: num_nodes})
        self._meshes[name] = num_nodes

    @property
    def reservations(self) -> dict[str, str]:
        """Mesh name -> its reservation's name (`monarch.notebook.job(name)`, `python -m monarch.notebook list`)."""
        return dict(self._reserved)

    def _create(self, client_script: str | None) -> None:
        if client_script is not None:
            raise ValueError(
                "SlurmJob.apply(client_script=...): batch mode (the client inside the allocation) is not supported; "
                "run the client where it reaches the hosts: it attaches with job.state() (or job_load(path))"
            )
        tag = os.urandom(3).hex()
        try:
            for mesh, hosts in self._meshes.items():
                name = f"{self._job_name}-{mesh}-{tag}"
                jobs.reserve(
                    hosts, self._gpus_per_node or 0, name=name, partition=self._partition,
                    time_limit=self._time_limit, workspace=self._workspace, timeout=self._job_start_timeout,
                    interface=self._interface, sbatch=self._sbatch,
                )  # fmt: skip
                self._reserved[mesh] = name
        except BaseException:
            self._kill()
            raise

    def _state(self) -> JobState:
        return JobState({mesh: jobs.Job(name) for mesh, name in self._reserved.items()})

    def _spec(self) -> tuple:
        return (self._meshes, self._job_name, self._time_limit, self._partition, self._gpus_per_node, self._interface,
                self._workspace, self._sbatch)  # fmt: skip

    def can_run(self, spec: JobTrait) -> bool:
        return isinstance(spec, SlurmJob) and spec._spec() == self._spec() and self._alive()

    def _alive(self) -> bool:
        """Whether every reservation's Slurm job still runs with all its agents up."""
        if set(self._reserved) != set(self._meshes):
            return False
        for name in self._reserved.values():
            try:
                job = jobs.Job(name)
                if job.state().terminal or len(job.dir.agents()) < job.hosts:
                    return False
            except (ValueError, OSError, subprocess.SubprocessError, slurm.SlurmError):
                return False
        return True

    def _kill(self) -> None:
        for name in list(self._reserved.values()):
            try:
                jobs.cleanup(name)
            except ValueError:
                pass  # (cleaned up already)
        self._reserved.clear()
