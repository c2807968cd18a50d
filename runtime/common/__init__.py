"""Shared leaves: what controller, workers and host agents all use and that imports nothing else of ours
(configuration, errors, mesh shapes, a worker's context, logging, group names, op schemas, stack capture)."""
