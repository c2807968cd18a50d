"""The runtime's own logging: ``MONARCH_LOG=debug|info|warning`` (default ``warning``).

Every runtime module logs through a child of ``logging.getLogger("monarch")`` (`get`). `configure` gives
that logger one stderr handler whose lines name the process they come from (``monarch[controller]``,
``monarch[worker gpu=3]``), so a run with ``MONARCH_LOG=info`` reads as one story across processes. The
controller configures it when it is made; each worker at its start (workers run with the controller's
environment, so they share its level). The logger does not propagate: a program's own logging setup
(``logging.basicConfig(level=DEBUG)``) neither doubles nor unlocks the runtime's lines.

A bad value is one warning naming the allowed values (on the controller only; workers fall back
quietly), then the default. By default nothing new is printed: the runtime logs nothing at warning level
that it does not already say in words.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable
from typing import IO

from monarch.runtime.common import config

LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING}
"""The values of ``MONARCH_LOG``."""
DEFAULT = "warning"

_root = logging.getLogger("monarch")
_handler: _Stderr | None = None


def get(name: str) -> logging.Logger:
    """The logger of one part of the runtime (``get("controller")`` is ``monarch.controller``)."""
    return _root.getChild(name)


class _Stderr(logging.StreamHandler):
    """Writes to the stream `where()` gives at the time of each line: a worker replaces `sys.stderr` with
    its forwarding stream after logging is set up; the controller writes to the process's real stderr
    (a kernel's goes to the Jupyter server's log, not into a cell)."""

    def __init__(self, where: Callable[[], IO[str] | None]) -> None:
        super().__init__()
        self._where = where

    @property  # type: ignore[override]
    def stream(self) -> IO[str] | None:
        return self._where()

    @stream.setter
    def stream(self, value: object) -> None:
        pass  # (StreamHandler.__init__ sets it; the stream is always looked up)

    def emit(self, record: logging.LogRecord) -> None:
        if self.stream is not None:
            super().emit(record)


def level_from_env(warn: bool) -> int:
    """``MONARCH_LOG``'s level; a bad value warns (if `warn`) and gives the default."""
    text = config.log_level_name()
    level = LEVELS.get(text or DEFAULT)
    if level is None:
        if warn:
            allowed = ", ".join(LEVELS)
            _root.warning("MONARCH_LOG=%r is not one of %s; using %s", text, allowed, DEFAULT)
        level = LEVELS[DEFAULT]
    return level


def configure(role: str, worker: bool = False) -> None:
    """Set up the runtime's logging in this process, named `role` in each line (``"controller"``,
    ``"worker gpu=3"``). Called again (a second controller, a forked worker), it renames the process and
    reads ``MONARCH_LOG`` again. A worker writes to its current `sys.stderr` (forwarded to the
    controller, labelled with its rank) and does not warn about a bad value: the controller did."""
    global _handler
    if _handler is None:
        _handler = _Stderr(lambda: sys.stderr)
        _root.addHandler(_handler)
        _root.propagate = False
    _handler._where = (lambda: sys.stderr) if worker else (lambda: sys.__stderr__)
    _handler.setFormatter(
        logging.Formatter(f"monarch[{role}] %(asctime)s.%(msecs)03d %(levelname)s %(message)s", "%H:%M:%S")
    )
    _root.setLevel(logging.WARNING)  # (so that a bad value's warning shows)
    _root.setLevel(level_from_env(warn=not worker))


class RateLimitedLog:
    """Lines about dropped messages: at most one per kind every `interval` seconds, with a count of
    those left unsaid (a flood of junk must not flood the terminal)."""

    def __init__(self, prefix: str, interval: float = 5.0) -> None:
        self.prefix = prefix
        self.interval = interval
        self._last: dict[str, float] = {}
        self._quiet: dict[str, int] = {}
        self._lock = threading.Lock()

    def __call__(self, kind: str, detail: str) -> None:
        now = time.monotonic()
        with self._lock:
            if now - self._last.get(kind, -1e9) < self.interval:
                self._quiet[kind] = self._quiet.get(kind, 0) + 1
                return
            self._last[kind] = now
            quiet = self._quiet.pop(kind, 0)
        more = f" ({quiet} more like it in the last {self.interval:.0f} s)" if quiet else ""
        out = sys.__stderr__
        if out is not None:
            print(f"{self.prefix}: dropped {kind}: {detail}{more}", file=out, flush=True)
