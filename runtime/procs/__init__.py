"""Processes on a host: starting and watching workers (`workers`, the fork server) and a job's files
(`jobfiles`); used by the local backend and by host agents."""
