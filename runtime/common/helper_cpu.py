"""CPU time the program spends on threads working on its behalf while the thread that called them waits
(`grad_generator`'s backward pass runs autograd on a thread of its own, in lockstep with the loop).

The simulator's controller clock asks how much of the time between two messages the program computed: the
sending thread's CPU time plus what these threads reported meanwhile. Other threads of the process (a kernel's,
a real mesh's receivers) are not the program's and do not count.
"""

from __future__ import annotations

import threading
import time

_lock = threading.Lock()
_spent = 0.0


def spent() -> float:
    """Seconds of CPU helper threads have reported so far (a running total: take differences)."""
    return _spent


class Meter:
    """A helper thread's CPU, reported as it goes: made on that thread, `report()` before each wait and once at
    its end (on any other thread it reports nothing: its CPU clock is another's)."""

    def __init__(self) -> None:
        self._thread = threading.get_ident()
        self._mark = time.thread_time()

    def report(self) -> None:
        global _spent
        if threading.get_ident() != self._thread:
            return
        now = time.thread_time()
        with _lock:
            _spent += now - self._mark
        self._mark = now
