"""Jobs on Slurm: reserving hosts and spawning meshes on them (`jobs`), and the Slurm commands (`commands`).
The host agents are `agent/`; the backend that drives them is `backends/hosts.py`."""
