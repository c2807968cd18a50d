"""`monarch.profiler`: torch's profiler across a mesh, one trace per rank and a merged one.

    from monarch.profiler import Schedule, profile, record_function

    with mesh.activate(), profile(on_trace_ready="./traces/", schedule=Schedule(wait=1, warmup=1, active=2)) as prof:
        for batch in data:
            with record_function("forward"):
                loss = model(batch)
            prof.step()

In a notebook the block's end shows the merged timeline and a per-rank summary naming the slowest rank;
a script gets the summary on stderr. See `monarch.runtime.tools.profiler` for the details.
"""

from __future__ import annotations

import sys
from typing import Any

from monarch._default_mesh import default_mesh
from monarch.runtime.tools.profiler import ProfileResult, Schedule, record_function
from monarch.runtime.tools.profiler import profile as _profile

__all__ = ["profile", "record_function", "Schedule", "ProfileResult", "show"]


class profile(_profile):
    __doc__ = _profile.__doc__

    def _default_mesh(self) -> Any:
        return default_mesh(None)  # in a notebook: the %%mesh cells' mesh

    def _show(self, result: ProfileResult) -> None:
        if self._local is None and not show(result):
            super()._show(result)


def show(result: ProfileResult) -> bool:
    """Display `result`'s timeline and summary in the running notebook; False outside one."""
    ip = sys.modules.get("IPython")
    shell = ip.get_ipython() if ip is not None else None
    if shell is None or getattr(shell, "kernel", None) is None:
        return False
    from IPython.display import display

    from monarch.widgets.timeline import TimelineView

    display(TimelineView(result))
    return True
