"""Memory history on a worker: `monarch.memory.record_memory_history` / `dump_memory_snapshot` land here
(calls by name from the controller, or direct calls on a worker).

On a CUDA worker this is torch's own: `torch.cuda.memory._record_memory_history` and `_snapshot()`. Each
tensor-engine command then runs inside a `record_function` range named ``monarch-op@`` and the controller's
line that issued it, which torch keeps in the snapshot's ``external_annotations`` (START/END, ``time_us``),
so an allocation made by the tensor engine can be traced to the user's line.

On a CPU worker torch keeps no allocation history, so recording runs torch's profiler on the worker's main
thread (`profile_memory=True, with_stack=True`: every allocation and free with its address, size and time,
nested in the ops and Python calls that made it), and a dump turns what it saw into the snapshot format
torch's CUDA allocator writes, so the same tools read both (pytorch.org/memory_viz, `torch.cuda._memory_viz`).
The CPU format, as `snapshot()` returns it:

- ``device_traces``: one list (the CPU, device 0) of trace entries, oldest first, at most `max_entries`
  (the oldest go first, as torch's ring buffer drops them). Each is a dict: ``action``, ``addr`` (int),
  ``size`` (bytes), ``stream`` (always 0), ``time_us`` (microseconds since the Unix epoch), ``frames``.
  On the CPU there is no caching allocator: every allocation is its own block, got from and given back to
  the system, so one allocation is written as ``segment_alloc`` then ``alloc``, and its free as
  ``free_requested``, ``free_completed``, ``segment_free`` (all with the allocation's address and size).
  ``size`` is the tensor storage's byte count exactly (the CPU allocator rounds nothing).
  A free of memory allocated before recording began has no alloc before it; a viewer counts it as
  allocated from the start.
- ``segments``: the allocations still alive at the dump that were made while recording, one segment per
  allocation: ``device`` 0, ``address``, ``total_size`` = ``allocated_size`` = ``active_size`` =
  ``requested_size`` (bytes), ``stream`` 0, ``segment_type`` ("large" from 1 MiB, else "small"),
  ``frames``, and ``blocks``: one ``{"address", "size", "requested_size", "state": "active_allocated",
  "frames"}``. Memory allocated before recording began and still alive is not in it.
- ``frames`` (innermost first, as torch writes them), for each allocation or free: ``{"filename", "line",
  "name"}``. First the torch ops it happened in, innermost first (``{"filename": "??", "line": 0, "name":
  "aten::empty"}``, as torch names C++ frames it has no file for), then the Python frames that called them
  (full paths), each with the line it was at, out to the user's outermost frame: monarch's own frames, and
  the worker's code that runs live functions, cells and commands, are left out. An op run by the tensor
  engine (``with mesh.activate():``) ends with the controller's line that issued it (``{"filename": "Cell
  In[5]", "line": 3, "name": "<module>"}``, or the script's path). When a Python function made the op
  without a Python-level call (an operator such as ``a + b``), its frame's line is the function's first.
- ``monarch``: ``{"format": "monarch-cpu-memory", "version": 1, "device": "cpu", "rank": ..., "recorded":
  "..."}``, saying where the snapshot came from (torch's own readers ignore the key).

Only the worker's main thread is recorded (live functions, `%%mesh` cells and the tensor engine's main
stream run there); ops on other `monarch.Stream`s run on threads of their own and are not seen. Recording
runs the profiler, so it costs time per op and Python call until `record(None)`, and it cannot run while
another profile (`monarch.profiler.profile`, `torch.profiler.profile`) does: torch runs one at a time.
"""

from __future__ import annotations

import bisect
import functools
import inspect
import os
import re
import sys
from collections import deque
from typing import Any

import torch

from monarch.runtime.common import context

ENABLED = ("all", "state")
FORMAT = "monarch-cpu-memory"
_MARK = "monarch-op@"
"""Names the range a tensor-engine command runs in while memory is recorded; the controller's line follows
(`monarch.runtime.tools.memory.MARK` reads it on the controller)."""
_WORKER = os.path.dirname(os.path.abspath(__file__)) + os.sep
"""The worker's own code: live functions, cells and tensor commands are called from it (frames further out
are the worker's start-up)."""
_RUNTIME = os.path.dirname(_WORKER.rstrip(os.sep)) + os.sep
_PROFILER_FILES = (os.path.join("torch", "autograd", "profiler"), os.path.join("torch", "profiler"))
_state: dict[str, Any] = {}
"""What records on this worker: {"device": "cuda"|"cpu", "enabled": "all"|"state"}; empty when nothing does."""
_cpu: _CpuRecorder | None = None


class UsageError(Exception):
    """A misuse the controller reports in words (no worker traceback)."""


def record(enabled: str | None, max_entries: int) -> tuple[str, str] | None:
    """Start (or, with `enabled=None`, stop) recording this worker's memory history. Returns
    ``("error", message)`` for a misuse, else None."""
    try:
        _record(enabled, max_entries)
    except UsageError as e:
        return ("error", str(e))
    return None


def snapshot() -> dict | tuple[str, str]:
    """This worker's snapshot, after every stream ran what was queued on it: ``{"device", "snapshot",
    "runtime"}`` (torch's snapshot dict; where this worker's monarch runtime lives, whose frames in it are not
    the user's), or ``("error", message)`` for a misuse."""
    from monarch.runtime.worker.engine.streams import sync_streams

    sync_streams()
    try:
        return _snapshot()
    except UsageError as e:
        return ("error", str(e))


def recording_on_cpu() -> bool:
    """Whether memory recording holds torch's profiler on this worker (a profile cannot start meanwhile)."""
    return _cpu is not None


def _profiler_blocked() -> str | None:
    if _cpu is None:
        return None
    return (
        "monarch.memory is recording this CPU worker's allocations, which holds torch's profiler; stop it "
        "(monarch.memory.record_memory_history(enabled=None)) before profiling"
    )


def _device() -> torch.device:
    w = context.worker
    return w.device if w is not None else torch.device("cpu")


def _record(enabled: str | None, max_entries: int) -> None:
    global _cpu
    if enabled is not None and enabled not in ENABLED:
        raise UsageError(f"enabled={enabled!r}: give 'all', 'state' or None")
    dev = _device()
    if dev.type == "cuda":
        record = torch.cuda.memory._record_memory_history
        annotate = "global_record_annotations" in inspect.signature(record).parameters
        if annotate:  # tensor commands' ranges kept in the snapshot's "external_annotations"
            record(enabled, max_entries=max_entries, global_record_annotations=enabled is not None)
        else:
            record(enabled, max_entries=max_entries)
        _state.clear()
        if enabled is not None:
            _state.update(device="cuda", enabled=enabled)
        (_mark_commands if enabled is not None and annotate else _unmark_commands)()
        return
    if enabled is None:
        if _cpu is not None:
            _cpu.stop()
        _cpu = None
        _state.clear()
        return
    if _cpu is not None and not _cpu.running():
        _cpu.stop()  # another profile ended it: start again
        _cpu = None
    if _cpu is None:
        _check_no_profile()
        _cpu = _CpuRecorder()
        _cpu.start()
    _cpu.configure(enabled == "all", max_entries)
    _state.update(device="cpu", enabled=enabled)


def _snapshot() -> dict:
    global _cpu
    if not _state:
        raise UsageError(
            "no memory history is being recorded on this worker: call monarch.memory.record_memory_history() first"
        )
    dev = _device()
    if _state["device"] == "cuda":
        return {"device": str(dev), "snapshot": torch.cuda.memory._snapshot(), "runtime": _RUNTIME}
    assert _cpu is not None
    try:
        snap = _cpu.snapshot()
    except UsageError:
        _cpu = None
        _state.clear()
        raise
    w = context.worker
    snap["monarch"] = {
        "format": FORMAT,
        "version": 1,
        "device": "cpu",
        "rank": w.rank if w is not None else 0,
        "recorded": "torch.profiler (profile_memory, with_stack) on the worker's main thread",
    }
    return {"device": "cpu", "snapshot": snap, "runtime": _RUNTIME}


def _check_no_profile() -> None:
    profiler = sys.modules.get("monarch.runtime.worker.engine.profiler")
    if getattr(profiler, "_prof", None) is not None:
        raise UsageError(
            "a monarch.profiler profile is running on this worker; memory recording on CPU uses torch's "
            "profiler, which runs one profile at a time: record memory outside the profile"
        )
    if torch.autograd.profiler._is_profiler_enabled:
        raise UsageError(
            "a torch profiler is running on this worker; memory recording on CPU uses torch's profiler, "
            "which runs one profile at a time: record memory outside the profile"
        )


class _CpuRecorder:
    """Torch's profiler on this thread, read at each dump and started again: the history carries on."""

    def __init__(self) -> None:
        self.keep_history = True
        self.trace: deque[dict] = deque(maxlen=100_000)
        self.live: dict[int, dict] = {}
        """Allocations made while recording and not freed: address -> their alloc entry."""
        self.prof: Any = None

    def configure(self, keep_history: bool, max_entries: int) -> None:
        self.keep_history = keep_history
        if not keep_history:
            self.trace.clear()
        if self.trace.maxlen != max_entries:
            self.trace = deque(self.trace, maxlen=max_entries)

    def start(self) -> None:
        os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # kineto's start/stop notes on every rank's stderr
        self.prof = torch.autograd.profiler.profile(
            use_cpu=True, profile_memory=True, with_stack=True, use_kineto=True
        )  # (torch.profiler.profile would import torch._inductor, seconds on a fresh worker)
        self.prof.__enter__()
        _mark_commands()

    def running(self) -> bool:
        """False once another profile, started meanwhile, ended ours (torch runs one at a time)."""
        return self.prof is not None and torch._C._autograd._profiler_enabled()

    def stop(self) -> list:
        """Stop the profiler; the event tree of what it saw (empty if another profile ended it)."""
        _unmark_commands()
        running = self.running()
        prof, self.prof = self.prof, None
        if not running:
            return []
        prof.__exit__(None, None, None)
        return prof.kineto_results.experimental_event_tree()

    def snapshot(self) -> dict:
        if not self.running():
            self.stop()
            raise UsageError(
                "memory recording on this CPU worker was ended by a profile started while it ran "
                "(monarch.profiler.profile or torch.profiler): CPU memory recording uses torch's profiler, "
                "one profile at a time; call record_memory_history() again after the profile"
            )
        tree = self.stop()
        self._take(tree)
        self.start()
        segments = [_segment(e) for _, e in sorted(self.live.items())]
        return {"segments": segments, "device_traces": [list(self.trace)]}

    def _take(self, tree: list) -> None:
        types = torch._C._profiler._EventType
        allocs, marks = [], []
        todo = list(tree)
        while todo:
            n = todo.pop()
            if n.tag == types.Allocation:
                ef = n.extra_fields
                if ef.alloc_size and ef.device.type == "cpu":
                    allocs.append(n)
                continue
            if n.tag == types.TorchOp and n.name.startswith(_MARK):
                marks.append((n.start_time_ns, n.end_time_ns, n.name[len(_MARK) :]))
            todo.extend(n.children)
        allocs.sort(key=lambda n: n.start_time_ns)
        marks.sort()
        starts = [m[0] for m in marks]
        add = self.trace.extend if self.keep_history else (lambda entries: None)
        for n in allocs:
            ef = n.extra_fields
            addr, size, t = int(ef.ptr), int(ef.alloc_size), n.start_time_ns // 1000
            i = bisect.bisect_right(starts, n.start_time_ns) - 1
            issued = marks[i][2] if i >= 0 and marks[i][1] >= n.start_time_ns else None
            frames = _frames(n, issued)
            if size > 0:
                entry = _entry("alloc", addr, size, frames, t)
                self.live[addr] = entry
                add([_entry("segment_alloc", addr, size, frames, t), entry])
            else:
                made = self.live.pop(addr, None)
                size = made["size"] if made is not None else -size
                add([_entry(a, addr, size, frames, t) for a in ("free_requested", "free_completed", "segment_free")])


# -- tensor-engine commands run inside a range named for the controller's line that issued them -------------
def _mark_commands() -> None:
    """While recording, each tensor command runs inside a `record_function` range named ``monarch-op@WHERE``:
    the CPU recorder reads it from the profiler, torch's CUDA history keeps it as an annotation."""
    from monarch.runtime.worker.engine import commands

    enter = torch.ops.profiler._record_function_enter_new
    leave = torch.ops.profiler._record_function_exit._RecordFunction

    def around(cmd: Any, handler: Any) -> None:
        where = getattr(cmd, "where", None)
        if where is None:
            handler(cmd)
            return
        handle = enter(_MARK + where, None)
        try:
            handler(cmd)
        finally:
            leave(handle)

    commands.around = around


def _unmark_commands() -> None:
    from monarch.runtime.worker.engine import commands

    commands.around = None


def _entry(action: str, addr: int, size: int, frames: list, t: int) -> dict:
    return {"action": action, "addr": addr, "size": size, "stream": 0, "frames": frames, "time_us": t}


def _segment(alloc: dict) -> dict:
    addr, size, frames = alloc["addr"], alloc["size"], alloc["frames"]
    block = {"address": addr, "size": size, "requested_size": size, "state": "active_allocated", "frames": frames}
    return {
        "device": 0,
        "address": addr,
        "total_size": size,
        "allocated_size": size,
        "active_size": size,
        "requested_size": size,
        "stream": 0,
        "segment_type": "large" if size >= 1 << 20 else "small",
        "segment_pool_id": (0, 0),
        "is_expandable": False,
        "frames": frames,
        "blocks": [block],
    }


def _frames(node: Any, issued: str | None) -> list[dict]:
    """Where an allocation (or free) happened, innermost first: the ops it ran in, then the Python frames
    that called them, as far as the worker's own code; then, for a tensor-engine command, the controller's
    line that issued it (`issued`)."""
    types = torch._C._profiler._EventType
    frames: list[dict] = []
    python_seen = False
    p = node.parent
    while p is not None:
        if p.tag == types.TorchOp:
            if not python_seen and not p.name.startswith(_MARK):
                frames.append({"filename": "??", "line": 0, "name": p.name})
        elif p.tag in (types.PyCall, types.PyCCall):
            ef = p.extra_fields
            if not python_seen and p.tag == types.PyCall:  # the op came from this function's own code
                if not _add(frames, ef.callsite):
                    break
            python_seen = True
            caller = ef.caller
            if caller is not None and not (p.parent is None and _same(caller, ef.callsite)):  # (the outermost
                # frame running when recording began is its own caller, at the line it was at then)
                if not _add(frames, caller):
                    break
        p = p.parent
    if issued is not None:
        frames.append(_controller_frame(issued))
    return frames


def _same(a: Any, b: Any) -> bool:
    return b is not None and a.file_name == b.file_name and a.function_name == b.function_name


def _add(frames: list[dict], frame: Any) -> bool:
    """Add a frame of Python's; False at the worker's own code, which every user frame is called from."""
    filename = _full_path(frame.file_name)
    if filename.startswith(_WORKER):
        return False
    if not filename.startswith(_RUNTIME) and not any(f in filename for f in _PROFILER_FILES):
        frames.append({"filename": filename, "line": int(frame.line_number), "name": frame.function_name})
    return True  # (monarch's other code and the profiler's own frames are left out)


@functools.lru_cache(maxsize=4096)
def _full_path(filename: str) -> str:
    """The profiler names files relative to the `sys.path` entry they were found on: the full path again."""
    if os.path.isabs(filename) or filename.startswith("<"):
        return filename
    for entry in sys.path:
        path = os.path.join(entry or os.getcwd(), filename)
        if os.path.isfile(path):
            return os.path.abspath(path)
    return filename


_WHERE_CELL = re.compile(r"^(Cell In\[\d+\]), line (\d+)(?: in (.+))?$")
_WHERE_FILE = re.compile(r"^(.+):(\d+) in (.+)$")


def _controller_frame(where: str) -> dict:
    """The controller's line that issued a tensor-engine op (`checks.where()`'s words) as a frame."""
    m = _WHERE_CELL.match(where)
    if m:
        return {"filename": m.group(1), "line": int(m.group(2)), "name": m.group(3) or "<module>"}
    m = _WHERE_FILE.match(where)
    if m:
        return {"filename": m.group(1), "line": int(m.group(2)), "name": m.group(3)}
    return {"filename": where, "line": 0, "name": "<controller>"}


def _register() -> None:
    from monarch.runtime.worker.engine import profiler as profiling

    if _profiler_blocked not in profiling.blockers:
        profiling.blockers.append(_profiler_blocked)


_register()
