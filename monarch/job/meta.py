"""Monarch's jobs on Meta's internal scheduler: not available here (`MASTJob` raises, naming what to use instead)."""

from monarch.runtime.job.unavailable import MASTJob

__all__ = ["MASTJob"]
