"""`monarch.actor.config`: Monarch's module of actor settings."""

prefix_python_logs_with_actor = True
"""Prefix log lines of actors with the actor's name (here every line of a worker is labelled with its rank
already, in a notebook's per-rank areas and a script's ``[gpu=3]`` prefixes)."""
