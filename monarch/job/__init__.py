"""Jobs (Monarch's `monarch.job`): a specification of hosts, applied once, whose state is host meshes.

    from monarch.job import LocalJob, SlurmJob

    job = SlurmJob({"trainers": 2}, gpus_per_node=8)     # or LocalJob(("trainers",)) for this machine
    procs = job.state().trainers.spawn_procs(per_host={"gpus": 8})

`state()` applies the job once and caches it in `.monarch/job_state.pkl`; `job_load()` reads it back in a
later process. A torchrun command line as a job: `monarch.job.spmd.serve`. `LocalJob` and `ProcessJob` run on
this machine's workers, `SlurmJob` on reservations of `monarch.notebook`'s Slurm jobs. Names that need what
this project does not have (a telemetry sidecar, a mesh admin, Kubernetes) raise, naming what to use instead.
See docs/features/spmd.md.
"""

from monarch.runtime.job.job import (
    DEFAULT_JOB_PATH,
    JobState,
    JobTrait,
    LocalJob,
    ProcessJob,
    exec_command,
    job_load,
    job_loads,
    load_current_job,
    set_current_job,
)
from monarch.runtime.job.slurm import SlurmJob
from monarch.runtime.job.unavailable import MeshAdminConfig, PortForwarder, TelemetryConfig, shell

__all__ = [
    "DEFAULT_JOB_PATH",
    "exec_command",
    "JobTrait",
    "job_load",
    "job_loads",
    "JobState",
    "load_current_job",
    "LocalJob",
    "MeshAdminConfig",
    "PortForwarder",
    "ProcessJob",
    "set_current_job",
    "shell",
    "SlurmJob",
    "TelemetryConfig",
]
