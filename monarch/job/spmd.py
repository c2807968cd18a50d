"""SPMD jobs from a torchrun command line (Monarch's `monarch.job.spmd`).

    from monarch.job.spmd import serve, job_load

    job = serve(["torchrun", "--nproc-per-node=4", "--standalone", "train.py"], scheduler="local_cwd")
    job.run_spmd()                                   # train.py on 4 workers, as torchrun would run it
    job = job_load(".monarch/job_state.pkl")         # later: the same hosts
    job.run_spmd()

``scheduler="slurm"`` (with ``--nnodes=N``) runs it on N hosts reserved through Slurm. See docs/features/spmd.md.
"""

from monarch.runtime.job.job import job_load
from monarch.runtime.job.spmd import SPMDJob, serve

__all__ = ["serve", "SPMDJob", "job_load"]
