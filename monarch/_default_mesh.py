"""The mesh `monarch.profiler` and `monarch.memory` act on in a notebook when none is named or active."""

from __future__ import annotations

import sys
from typing import Any


def default_mesh(mesh: Any) -> Any:
    """`mesh`; else, off a worker and outside `mesh.activate()`, the notebook's `%%mesh` mesh (None if none)."""
    if mesh is not None:
        return mesh
    from monarch.runtime.common import context
    from monarch.runtime.mesh import active_mesh

    if context.worker is not None or active_mesh() is not None:
        return None
    magics = sys.modules.get("monarch.extension.magics")  # loaded only where the magics are: no IPython import
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    return magics.notebook_mesh(shell) if magics is not None and shell is not None else None
