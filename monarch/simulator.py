"""`monarch.Simulator`: a mesh that simulates rather than computes (see `monarch.runtime.simulator.simulator`).

In a notebook `display()` draws the timeline inline; elsewhere it prints the summary.
"""

from __future__ import annotations

import sys

from monarch.runtime.simulator.simulator import SimSummary
from monarch.runtime.simulator.simulator import Simulator as _Simulator

__all__ = ["Simulator", "SimSummary"]


class Simulator(_Simulator):
    __doc__ = _Simulator.__doc__

    def display(self) -> None:
        """Show the timeline, the overlap of communication and compute per rank, and peak memory."""
        ip = sys.modules.get("IPython")
        shell = ip.get_ipython() if ip is not None else None
        if shell is None or getattr(shell, "kernel", None) is None:
            super().display()
            return
        from IPython.display import display

        from monarch.widgets.sim_view import SimView

        trace = self.trace_dict()
        display(SimView(trace, self.summary(trace)))
