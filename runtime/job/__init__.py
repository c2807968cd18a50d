"""`monarch.job`: Monarch's jobs (a specification of hosts, applied once, whose state is host meshes to spawn
on), mapped onto the backends this project has: `LocalJob` and `ProcessJob` onto this machine's workers,
`SlurmJob` onto reservations of `monarch.runtime.slurm.jobs`, and `spmd.serve` (a torchrun command line) onto
either. `job.py` holds the trait, the state, the cache; `slurm.py` the Slurm job; `spmd.py` torchrun's command
line and `SPMDJob`; `unavailable.py` the names that need what this project does not have.
"""
