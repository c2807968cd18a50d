"""A job's workspace on a worker: after a sync, the modules whose files changed are reloaded.

Runs on the worker (called by reference: `monarch.runtime.slurm.jobs` names it). The workspace is on the
worker's `sys.path` (its host agent's copy); a module imported from it before the sync has the old code
until reloaded here.
"""

from __future__ import annotations

import importlib
import os
import sys


def reload(changed: list[str]) -> list[str]:
    """Reload the loaded modules among `changed` (paths relative to the workspace); returns their names."""
    importlib.invalidate_caches()
    done = []
    for rel in changed:
        if not rel.endswith(".py"):
            continue
        parts = rel[: -len(".py")].split(os.sep)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        name = ".".join(parts)
        module = sys.modules.get(name)
        if module is not None and getattr(module, "__file__", None):
            importlib.reload(module)
            done.append(name)
    return done
