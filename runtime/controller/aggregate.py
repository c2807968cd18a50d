"""`ProcMesh.logging_option`: where a mesh's worker output goes, and lines repeated across ranks collapsed.

Every output event of a mesh that has options passes through its `MeshLogs` (`Receiver._deliver`) on its
way to its sink: a cell's per-rank areas, or the controller's labelled lines. With
``stream_to_client=False`` it goes to a file of the mesh instead (its path said once). With
``aggregate_window_sec=N``, complete lines of text are held per sink for up to N seconds (from the first one
held), then let go as groups: the same line (exact text, leading and trailing blanks aside) from several
ranks, one after another in each rank's order, becomes one event ``[8 similar lines, ranks 0-7] loss 2.31``
in the `AGGREGATED` place (no rank's: the notebook shows it in an area of its own, a terminal as a line of
its own); a line no other rank wrote goes to its rank as it was. What is held is let go early when the call
ends (before its result is given), before a display, a runtime notice or an input prompt of the mesh, and
when the options change, so nothing is left held and each rank's order is kept.
"""

from __future__ import annotations

import collections.abc
import itertools
import math
import numbers
import sys
import threading
import time
import traceback
import uuid
from collections import deque
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from monarch.runtime.common import config
from monarch.runtime.common.shape import format_ranks
from monarch.runtime.controller.output import AGGREGATED, LineLabeller, OutputEvent

if TYPE_CHECKING:
    from monarch.runtime.controller.state import PendingCall, SpawnedMesh

Sink = Callable[[OutputEvent], None]

AGGREGATED_LABEL = "aggregated"
"""The label of the place collapsed lines go (a notebook cell's area above the ranks' areas)."""
ALLOWED = "stream_to_client (True or False) and aggregate_window_sec (seconds >= 0; None or 0: off)"


@dataclass
class _Line:
    seq: int
    """Arrival order across the sink's ranks."""
    rank: int
    label: str
    stream: str
    call_id: int | None
    text: str
    """With its newline (none for the held start of a line let go early)."""
    key: tuple[str, str] | None
    """What makes lines similar: (stream, text stripped); None: never collapsed (a line whose start was
    already let go, as its rank's)."""


@dataclass
class _Group:
    key: tuple[str, str] | None
    lines: list[_Line] = field(default_factory=list)
    ranks: set[int] = field(default_factory=set)


class _Held:
    """The lines held for one sink."""

    def __init__(self, sink: Sink) -> None:
        self.sink = sink
        self.queues: dict[tuple[int, str], deque[_Line]] = {}
        """(rank, stream) -> its complete lines, in order (stdout and stderr are pipes of their own: the order
        between them is not kept even on the worker)."""
        self.partial: dict[tuple[int, str], _Line] = {}
        """(rank, stream) -> the start of a line not yet ended."""
        self.started: set[tuple[int, str]] = set()
        """(rank, stream) whose current line's start was let go already: its rest goes to its rank as it is."""

    def __bool__(self) -> bool:
        return bool(self.partial) or any(self.queues.values())

    def add(self, ev: OutputEvent, seq: Callable[[], int]) -> None:
        where = (ev.rank, ev.stream)
        held = self.partial.pop(where, None)
        text = ev.text if held is None else held.text + ev.text
        *ended, rest = text.split("\n")
        queue = self.queues.setdefault(where, deque())
        for i, line in enumerate(ended):
            first = held if i == 0 and held is not None else None
            raw = where in self.started
            self.started.discard(where)
            queue.append(
                _Line(
                    first.seq if first is not None else seq(),
                    ev.rank,
                    ev.label,
                    ev.stream,
                    ev.call_id,
                    line + "\n",
                    None if raw else (ev.stream, line.strip()),
                )
            )
        if rest:
            start = held if held is not None and not ended else None
            self.partial[where] = _Line(
                start.seq if start is not None else seq(), ev.rank, ev.label, ev.stream, ev.call_id, rest, None
            )

    def take(self, mesh_id: int) -> list[OutputEvent]:
        """Everything held, as the events to deliver: similar lines of several ranks collapsed."""
        for where, line in self.partial.items():  # let go too, after the rank's lines
            self.queues.setdefault(where, deque()).append(line)
            self.started.add(where)
        self.partial = {}
        groups = _groups(self.queues)
        self.queues = {}
        events: list[OutputEvent] = []
        for g in groups:
            if len(g.ranks) > 1:
                first = g.lines[0]
                text = first.text[:-1] if first.text.endswith("\n") else first.text
                head = f"[{len(g.lines)} similar lines, ranks {format_ranks(sorted(g.ranks))}]"
                events.append(
                    OutputEvent(first.call_id, mesh_id, AGGREGATED, AGGREGATED_LABEL, first.stream, f"{head} {text}\n")
                )
                continue
            for line in g.lines:
                last = events[-1] if events else None
                if (
                    last is not None
                    and last.rank == line.rank
                    and (last.stream, last.call_id) == (line.stream, line.call_id)
                ):
                    last.text += line.text
                else:
                    events.append(OutputEvent(line.call_id, mesh_id, line.rank, line.label, line.stream, line.text))
        return events


def _groups(queues: dict[tuple[int, str], deque[_Line]]) -> list[_Group]:
    """The lines of every rank merged into groups, each rank's order kept (only the head of a rank's queue is
    ever taken). A line is taken with every other rank's head similar to it, once no rank still has a line
    like it further back (it waits for them to get there); of those ready, the earliest first; if none is
    (ranks wrote lines in different orders), the earliest head. A group like the one before it in its stream
    joins it (the same line written several times)."""
    heads: dict[tuple[str, str], set[tuple[int, str]]] = {}
    """Similar-line key -> the queues whose head has it."""
    left: dict[tuple[str, str], dict[tuple[int, str], int]] = {}
    """Similar-line key -> queue -> how many lines like it the queue still has."""
    for qid, q in queues.items():
        for line in q:
            if line.key is not None:
                counts = left.setdefault(line.key, {})
                counts[qid] = counts.get(qid, 0) + 1
        if q and q[0].key is not None:
            heads.setdefault(q[0].key, set()).add(qid)
    out: list[_Group] = []
    last: dict[str, _Group] = {}
    """Stream -> its last group."""
    while True:
        best: _Line | None = None
        earliest: _Line | None = None
        for q in queues.values():
            if not q:
                continue
            line = q[0]
            if earliest is None or line.seq < earliest.seq:
                earliest = line
            if (best is None or line.seq < best.seq) and (line.key is None or heads[line.key] == left[line.key].keys()):
                best = line
        if earliest is None:
            return out
        take = best or earliest
        key = take.key
        qids = sorted(heads.pop(key)) if key is not None else [(take.rank, take.stream)]
        group = last.get(take.stream)
        if group is None or key is None or group.key != key:
            group = last[take.stream] = _Group(key)
            out.append(group)
        for r in qids:
            group.lines.append(queues[r].popleft())
            group.ranks.add(r[0])
            if key is not None:
                counts = left[key]
                counts[r] -= 1
                if not counts[r]:
                    del counts[r]
            nxt = queues[r]
            if nxt and nxt[0].key is not None:
                heads.setdefault(nxt[0].key, set()).add(r)


class MeshLogs:
    """One mesh's logging options, and the lines held for collapsing (`SpawnedMesh.logs`)."""

    def __init__(self, mesh_id: int, describe: str) -> None:
        self.mesh_id = mesh_id
        self.describe = describe
        self.stream_to_client = True
        self.window: float | None = None
        """Seconds lines are held for collapsing; None: they are not."""
        self.path: str | None = None
        """The file the mesh's output goes to while it is not streamed to the client."""
        self._file: Any = None
        self._to_file: LineLabeller | None = None
        self._lock = threading.RLock()  # (a done callback may run at once, inside deliver)
        self._held: dict[int, _Held] = {}
        """id(sink) -> what is held for it."""
        self._watched: set[int] = set()
        """Calls whose end lets their held lines go (whatever way they end)."""
        self._timer: threading.Timer | None = None
        self._seq = itertools.count()

    def configure(self, stream_to_client: bool, window: float | None) -> bool:
        """Set the options (what was held goes first, by the old ones); True when the output file was just
        made (its path is to be said)."""
        made = False
        with self._lock:
            self._let_go_locked(None)
            if self._timer is not None:  # (the next line held starts the new window)
                self._timer.cancel()
                self._timer = None
            self.window = window or None
            self.stream_to_client = stream_to_client
            if not stream_to_client and self._to_file is None:
                folder = config.output_dir()
                folder.mkdir(parents=True, exist_ok=True, mode=0o700)
                name = f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:8]}-mesh{self.mesh_id}.txt"
                path = folder / name
                self._file = open(path, "a", encoding="utf-8")  # (kept open: the workers write more)
                self._to_file = LineLabeller(self._file, self._file)
                self.path = str(path)
                made = True
        return made

    def deliver(self, sink: Sink, ev: OutputEvent, pending: PendingCall | None, as_is: bool = False) -> None:
        """Give `ev` to `sink`, or hold it (a line to collapse), or write it to the file. `as_is`: a line of the
        runtime's (a notice, an echoed prompt), never collapsed."""
        with self._lock:
            if not self.stream_to_client:
                if self._to_file is not None:  # (None: closed, the mesh stopped)
                    self._to_file(ev)
                return
            held = self._held.get(id(sink))
            if self.window is None or as_is or ev.stream not in ("stdout", "stderr"):
                if held:  # what came before it first: each rank's order is kept
                    self._deliver_all(held)
                sink(ev)
                return
            if held is None:
                held = self._held[id(sink)] = _Held(sink)
            held.add(ev, self._seq.__next__)
            if pending is not None and pending.call_id not in self._watched:
                self._watched.add(pending.call_id)
                call_id = pending.call_id
                pending.future.add_done_callback(lambda _: self._call_ended(call_id, sink))
            if self._timer is None:
                self._timer = threading.Timer(self.window, self._window_ended)
                self._timer.daemon = True
                self._timer.start()

    def let_go(self, sink: Sink | None = None, ended: bool = False) -> None:
        """Deliver what is held for `sink` (None: for every sink) now; `ended`: its call ended (nothing of
        it is kept, not even which lines were let go half written)."""
        with self._lock:
            self._let_go_locked(sink, ended)

    def _let_go_locked(self, sink: Sink | None, ended: bool = False) -> None:
        for key, held in list(self._held.items()):
            if sink is None or held.sink is sink:
                self._deliver_all(held)
                if ended or not held.started:
                    del self._held[key]

    def _deliver_all(self, held: _Held) -> None:
        for ev in held.take(self.mesh_id):
            try:
                held.sink(ev)
            except Exception:
                traceback.print_exc(file=sys.__stderr__)

    def _call_ended(self, call_id: int, sink: Sink) -> None:
        self._watched.discard(call_id)
        self.let_go(sink, ended=True)

    def _window_ended(self) -> None:
        with self._lock:
            self._timer = None
            self._let_go_locked(None)

    def close(self) -> None:
        """The mesh stopped: what is held goes out, the output file is closed (a line that still comes for it
        is dropped: its file says all the mesh wrote)."""
        with self._lock:
            self._let_go_locked(None, ended=True)
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            if self._file is not None:
                self._file.close()
                self._file = self._to_file = None


def configure(
    spawned: SpawnedMesh, stream_to_client: Any, aggregate_window_sec: Any, unknown: dict[str, Any]
) -> LoggingOption:
    """`ProcMesh.logging_option`: check the options, apply them to the mesh at once, and return an awaitable."""
    window = check(stream_to_client, aggregate_window_sec, unknown)
    logs = spawned.logs
    if logs is None:
        logs = spawned.logs = MeshLogs(spawned.mesh_id, spawned.shape.describe())
    if logs.configure(stream_to_client, window):
        print(
            f"monarch: the output of mesh {logs.describe} goes to {logs.path} (logging_option(stream_to_client=False))",
            file=sys.stderr,
            flush=True,
        )
    return LoggingOption(logs.describe, stream_to_client, aggregate_window_sec, logs.path)


def check(stream_to_client: Any, aggregate_window_sec: Any, unknown: dict[str, Any]) -> float | None:
    """The window in seconds (None: off); `TypeError` or `ValueError` naming what is wrong and what is allowed."""
    if unknown:
        names = ", ".join(sorted(unknown))
        extra = ""
        if "level" in unknown:
            extra = " (level: the workers' log levels are their code's own here: set them there, with logging)"
        raise TypeError(f"logging_option() got unexpected keyword argument(s) {names}{extra}; it takes {ALLOWED}")
    if not isinstance(stream_to_client, bool):
        raise TypeError(
            f"logging_option(stream_to_client={stream_to_client!r}): give True (the workers' output is shown here) "
            "or False (it goes to a file, whose path is said)"
        )
    if aggregate_window_sec is None:
        return None
    w = aggregate_window_sec
    if isinstance(w, bool) or not isinstance(w, numbers.Real):
        raise TypeError(f"logging_option(aggregate_window_sec={w!r}): give seconds (a number >= 0), or None: off")
    if not math.isfinite(w) or w < 0:
        raise ValueError(f"logging_option(aggregate_window_sec={w!r}): give seconds >= 0 (None or 0: off)")
    return float(w) or None


class LoggingOption(collections.abc.Coroutine[Any, Any, None]):
    """What `ProcMesh.logging_option` returns: the options are already applied; awaiting it (``await``,
    ``asyncio.run``) does nothing more, and leaving it unawaited is harmless (no warning)."""

    def __init__(self, mesh: str, stream_to_client: bool, aggregate_window_sec: Any, path: str | None) -> None:
        self.mesh = mesh
        self.stream_to_client = stream_to_client
        self.aggregate_window_sec = aggregate_window_sec
        self.path = path
        """The file the mesh's output goes to, with ``stream_to_client=False``."""

    def __await__(self) -> Generator[Any, None, None]:
        return
        yield  # (a generator that ends at once)

    def send(self, value: Any) -> Any:
        raise StopIteration(None)

    def throw(self, typ: Any, val: Any = None, tb: Any = None) -> Any:
        raise typ if val is None else val

    def close(self) -> None:
        pass

    def __repr__(self) -> str:
        where = "" if self.stream_to_client else f", output to {self.path}"
        return (
            f"<logging_option of mesh {self.mesh}: stream_to_client={self.stream_to_client}, "
            f"aggregate_window_sec={self.aggregate_window_sec}{where} (applied)>"
        )
