"""The inline view of a simulation: the simulated timeline (drawn as a profiler trace is), the per-rank
summary with the overlap of communication and compute, and peak memory. Plain SVG in HTML, offline."""

from __future__ import annotations

import dataclasses
from typing import Any

from monarch.widgets.style import esc, page
from monarch.widgets.timeline import summary_table, timeline_svg

MAX_RANKS = 16
"""Ranks drawn at most (the trace file has them all)."""


class SimView:
    """What `monarch.Simulator.display()` shows in a notebook."""

    def __init__(self, trace: dict, summary: Any) -> None:
        self.trace = trace
        self.summary = summary

    def _repr_html_(self) -> str:
        return render(self.trace, self.summary)

    def __repr__(self) -> str:
        return self.summary.text()


def render(trace: dict, summary: Any) -> str:
    events = [e for e in trace.get("traceEvents", []) if not isinstance(e.get("pid"), int) or e["pid"] < MAX_RANKS]
    shown = {"traceEvents": events}
    n = len(summary.timeline.ranks)
    more = f" (the first {MAX_RANKS} of {n} ranks)" if n > MAX_RANKS else ""
    head = (
        f"<div class='monarch-progress'>monarch.Simulator on {esc(summary.device)}: {summary.commands} commands, "
        f"{summary.total_ms:.3f} ms simulated{more}</div>"
    )
    tl = summary.timeline
    table = summary_table(dataclasses.replace(tl, ranks=tl.ranks[:MAX_RANKS]))
    idle = summary.idle_line()
    steps = "" if tl.steps_marked else f"<div class='monarch-profile-why'>{esc(summary.steps_line())}</div>"
    lines = (
        steps
        + f"<div class='monarch-sim-overlap monarch-profile-why'>{esc(summary.overlap_line())}</div>"
        + (f"<div class='monarch-sim-idle monarch-profile-why'>{esc(idle)}</div>" if idle else "")
        + f"<div class='monarch-sim-memory monarch-profile-why'>{esc(summary.memory_line())}</div>"
    )
    return page(f"<div class='monarch-sim'>{head}{timeline_svg(shown)}{lines}{table}</div>")
