"""The host agent: one process per host of a job, started by Slurm's `srun`, outliving the controllers that
attach to it. It forks its host's workers from a torch-preloaded fork server, relays each command the
controller sends it once to every worker it concerns, and relays replies, output and the store's traffic
back. Code here runs in the agent process; it never imports controller or worker code.
"""
