"""`monarch.memory`: memory snapshots of a mesh's workers, one file per rank.

    monarch.memory.record_memory_history()                   # on the mesh of `with mesh.activate():`
    for step in range(2):
        loss = net(torch.randn(8, DIM)); loss.backward()
    monarch.memory.dump_memory_snapshot(dir_snapshots="./snapshots/")   # snapshot_rank{N}.pickle per rank

On CUDA workers these are torch's `torch.cuda.memory._record_memory_history` and `_snapshot()`; on CPU
workers the allocations are recorded with torch's profiler and written in the same format (see
`monarch.runtime.worker.memory` for the format). Either file opens in pytorch.org/memory_viz. The
controller writes the files, so workers on other hosts need no shared directory. Which mesh: `mesh=`, else
the mesh of the innermost `mesh.activate()`, else (`monarch.memory`) the notebook's `%%mesh` mesh. Called
on a worker (inside a live function or a `%%mesh` cell) they act on that worker alone, which writes its file.
"""

from __future__ import annotations

import bisect
import os
import pickle
import re
import sysconfig
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from monarch.runtime.common import context
from monarch.runtime.common.errors import cell_name
from monarch.runtime.common.shape import format_ranks
from monarch.runtime.wire import codec

WORKER_MODULE = "monarch.runtime.worker.memory"
ENABLED = ("all", "state")
FILE = "snapshot_rank{rank}.pickle"
TIMELINE_POINTS = 400
"""At most this many (time, bytes) points per rank in a summary (peaks kept)."""
LARGEST = 8
MARK = "monarch-op@"
"""The range a tensor command runs in while memory is recorded: the controller's line that issued it follows."""
_WHERE_PATH = re.compile(r"^[^:]*/(?=[^/]*:\d+ in )")
_RUNTIME = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
"""monarch's runtime here (frames in it are never the user's; a worker names its own: `summarize(runtime=)`)."""
_STDLIB = sysconfig.get_paths()["stdlib"] + os.sep

html_view: Callable[[MemorySnapshots], str] | None = None
"""Draws a `MemorySnapshots` as HTML; set by `monarch.memory` (widgets live above the runtime)."""


@dataclass
class Allocation:
    """One allocation alive at the dump."""

    size: int
    """Bytes requested."""
    where: str
    """The innermost frame of the user's code that made it (``test.py:12 in f``, ``Cell In[5], line 3``)."""
    frames: list[dict] = field(default_factory=list)
    """All its frames, innermost first, as the snapshot has them."""


@dataclass
class RankMemory:
    """One rank's snapshot, summarized."""

    rank: int
    label: str
    """Its coordinates, ``host=0,gpu=1``."""
    path: str
    """Where its snapshot file was written."""
    device: str
    allocated: int
    """Bytes alive at the dump (on the CPU: of the allocations made while recording)."""
    peak: int
    """The most bytes alive at once in the recorded history."""
    events: int
    """Allocations and frees in the recorded history."""
    timeline: list[tuple[int, int]]
    """(microseconds since the Unix epoch, bytes alive) after each allocation or free, at most
    `TIMELINE_POINTS` (the highest of each stretch kept)."""
    largest: list[Allocation]
    """The largest allocations alive at the dump, largest first."""


@dataclass
class MemorySnapshots:
    """What `dump_memory_snapshot` wrote: a file per rank, each summarized. In a notebook it draws each
    rank's memory over time and its largest allocations."""

    directory: str
    ranks: list[RankMemory]

    @property
    def paths(self) -> dict[int, str]:
        """The snapshot file of each rank."""
        return {r.rank: r.path for r in self.ranks}

    def text(self) -> str:
        n = len(self.ranks)
        lines = [
            f"monarch.memory: {n} snapshot{'s' * (n != 1)} in {self.directory} (open them in pytorch.org/memory_viz)"
        ]
        for r in self.ranks:
            who = f"rank {r.rank}" + (f" ({r.label})" if r.label else "")
            lines.append(
                f"  {who} {r.device}: {format_bytes(r.allocated)} allocated, peak {format_bytes(r.peak)}, "
                f"{r.events} allocations and frees recorded  {os.path.basename(r.path)}"
            )
            for a in r.largest[:3]:
                lines.append(f"      {format_bytes(a.size):>10}  {a.where}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return self.text()

    def _repr_html_(self) -> str | None:
        return html_view(self) if html_view is not None else None


# -- the calls -------------------------------------------------------------------------------------------
def record_memory_history(enabled: str | None = "all", max_entries: int = 100_000, *, mesh: Any = None) -> None:
    """Start recording each worker's allocations (`enabled="all"`: history and live state; `"state"`: the
    live allocations only), keeping at most `max_entries` events per worker; `enabled=None` stops."""
    if enabled is True or enabled is False:  # torch's older spelling
        enabled = "all" if enabled else None
    if enabled is not None and enabled not in ENABLED:
        raise ValueError(
            f"record_memory_history(enabled={enabled!r}): give 'all' (allocation history and live state), "
            "'state' (live state only) or None (stop recording)"
        )
    if type(max_entries) is not int or max_entries < 1:
        raise ValueError(f"record_memory_history(max_entries={max_entries!r}): give a positive int")
    target = _target("record_memory_history", mesh)
    if target is None:
        _raise_errors("record_memory_history", {_here(): _local("record", enabled, max_entries)})
        return
    replies = _call(target, "record", (enabled, max_entries), "record_memory_history")
    _raise_errors("record_memory_history", replies)


def dump_memory_snapshot(dir_snapshots: str | os.PathLike = "./snapshots/", *, mesh: Any = None) -> MemorySnapshots:
    """Write each worker's memory snapshot to ``DIR/snapshot_rank{N}.pickle`` (torch's format), after the
    tensor commands issued so far ran; returns the files with a summary of each."""
    if not isinstance(dir_snapshots, str | os.PathLike):
        raise ValueError(f"dump_memory_snapshot(dir_snapshots={dir_snapshots!r}): give a directory")
    directory = os.fspath(dir_snapshots)
    target = _target("dump_memory_snapshot", mesh)
    if target is None:
        w = context.worker
        assert w is not None
        got = {w.rank: _local("snapshot")}
        labels = {w.rank: ",".join(f"{k}={v}" for k, v in w.coords.items())}
    else:
        got = _call(target, "snapshot", (), "dump_memory_snapshot")
        labels = {r: target.spawned.labels[r] for r in got}
    _raise_errors("dump_memory_snapshot", got)
    os.makedirs(directory, exist_ok=True)
    ranks = []
    for rank, value in got.items():
        path = os.path.join(os.path.abspath(directory), FILE.format(rank=rank))
        with open(path, "wb") as f:
            pickle.dump(value["snapshot"], f)
        ranks.append(summarize(value["snapshot"], rank, labels[rank], path, value["device"], value.get("runtime")))
    return MemorySnapshots(os.path.abspath(directory), ranks)


def _target(what: str, mesh: Any) -> Any:
    """The mesh view to act on, or None for this worker alone."""
    from monarch.runtime.mesh import mesh_to_act_on

    return mesh_to_act_on(
        what,
        mesh,
        f"monarch.memory.{what}: no mesh to act on; call it inside `with mesh.activate():`, pass mesh=..., "
        "or run a %%mesh cell first (in a notebook the %%mesh cells' mesh is used)",
    )


def _call(target: Any, fn: str, args: tuple, name: str) -> dict[int, Any]:
    from monarch.runtime.remote import RemoteFunction

    call = RemoteFunction.by_name(WORKER_MODULE, fn, target)
    values = call.start(args, {}, name=name).result()
    return dict(zip(target._shape.ranks, values.values(), strict=True))


def _local(fn: str, *args: Any) -> Any:
    return codec.import_function(WORKER_MODULE, fn)(*args)  # (by name: controller code never imports worker code)


def _here() -> int:
    return context.worker.rank if context.worker is not None else 0


def _raise_errors(what: str, replies: dict[int, Any]) -> None:
    errors: dict[str, list[int]] = {}
    for rank, value in replies.items():
        if isinstance(value, tuple) and value[:1] == ("error",):
            errors.setdefault(value[1], []).append(rank)
    if errors:
        parts = [f"{msg} (rank{'s' * (len(r) > 1)} {format_ranks(sorted(r))})" for msg, r in errors.items()]
        raise RuntimeError(f"monarch.memory.{what}: " + "; ".join(parts))


# -- summaries -------------------------------------------------------------------------------------------
def summarize(snapshot: dict, rank: int, label: str, path: str, device: str, runtime: str | None = None) -> RankMemory:
    """What a notebook shows of one rank's snapshot (torch's CUDA snapshot or the CPU one); `runtime` is where
    monarch's runtime lives on the worker that wrote it (its frames are not the user's: on another host it
    can be installed elsewhere than here)."""
    own = (_RUNTIME,) if runtime is None else (_RUNTIME, runtime)
    index = int(device.partition(":")[2] or 0) if device.startswith("cuda") else 0
    traces = snapshot.get("device_traces") or [[]]
    trace = traces[index] if index < len(traces) else max(traces, key=len)
    live = [
        b
        for seg in snapshot.get("segments", [])
        if seg.get("device", index) == index
        for b in seg.get("blocks", [])
        if b.get("state") == "active_allocated"
    ]
    allocated = sum(b.get("requested_size", b.get("size", 0)) for b in live)
    points, total, low = [], 0, 0
    for e in trace:
        action = e.get("action")
        if action == "alloc":
            total += e["size"]
        elif action == "free_completed":
            total -= e["size"]
        else:
            continue
        low = min(low, total)
        points.append((int(e.get("time_us", 0)), total))
    base = max(allocated - total, -low)  # what was alive before the history began
    timeline = [(t, base + v) for t, v in points]
    if timeline:
        timeline.insert(0, (timeline[0][0], base))
    largest = sorted(live, key=lambda b: b.get("requested_size", b.get("size", 0)), reverse=True)[:LARGEST]
    issued = _issued_by(snapshot, trace, index)
    return RankMemory(
        rank=rank,
        label=label,
        path=path,
        device=device,
        allocated=allocated,
        peak=max([allocated, *(v for _, v in timeline)]),
        events=len(points),
        timeline=_thin(timeline, TIMELINE_POINTS),
        largest=[
            Allocation(
                b.get("requested_size", b.get("size", 0)),
                user_frame(b.get("frames", []), issued(b.get("address")), own),
                b.get("frames", []),
            )
            for b in largest
        ],
    )


def _thin(points: list[tuple[int, int]], most: int) -> list[tuple[int, int]]:
    """At most `most` points: the highest of each run of consecutive ones (a peak is never smoothed away)."""
    if len(points) <= most:
        return points
    step = len(points) / most
    out = []
    for i in range(most):
        run = points[int(i * step) : int((i + 1) * step)] or [points[-1]]
        out.append((run[0][0], max(v for _, v in run)))
    out[-1] = (points[-1][0], max(out[-1][1], points[-1][1]))
    return out


def _issued_by(snapshot: dict, trace: list[dict], device: int) -> Callable[[Any], str | None]:
    """For a CUDA snapshot: the controller's line whose tensor command made the block at an address (from the
    ``monarch-op@`` ranges torch kept as annotations, and the time of the block's last alloc)."""
    ranges, open_at = [], {}
    for a in snapshot.get("external_annotations") or ():
        name = str(a.get("name", ""))
        if not name.startswith(MARK) or a.get("device", device) != device:
            continue
        if a.get("stage") == "START":
            open_at[name] = a.get("time_us", 0)
        elif name in open_at:
            ranges.append((open_at.pop(name), a.get("time_us", 0), name[len(MARK) :]))
    if not ranges:
        return lambda addr: None
    ranges.sort()
    starts = [r[0] for r in ranges]
    made_at = {e.get("addr"): e.get("time_us", 0) for e in trace if e.get("action") == "alloc"}

    def issued(addr: Any) -> str | None:
        t = made_at.get(addr)
        i = bisect.bisect_right(starts, t) - 1 if t is not None else -1
        return ranges[i][2] if i >= 0 and ranges[i][1] >= t else None

    return issued


def user_frame(frames: list[dict], issued: str | None = None, own: tuple[str, ...] = (_RUNTIME,)) -> str:
    """The innermost frame of the user's Python code (not torch's, not monarch's: under a path in `own`, not
    C++), in words; else the controller's line that issued the tensor command (`issued`), else the op."""
    for f in frames:
        filename = str(f.get("filename", ""))
        if _is_python(filename) and not filename.startswith(own) and not _is_library(filename):
            return frame_text(f)
    if issued is not None:
        return _WHERE_PATH.sub("", issued)  # `/path/train.py:12 in f` -> `train.py:12 in f`
    ops = [f for f in frames if f.get("filename") == "??"]
    if ops:  # no user code: the outermost op, as `aten::zeros`
        return str(ops[-1].get("name", "?"))
    return "(allocated before recording began)" if not frames else "(no Python frame)"


def _is_python(filename: str) -> bool:
    return filename.endswith(".py") or filename.startswith(
        ("Cell In[", "<mesh cell ", "<ipython-input", "<dynamic-code")
    )


def frame_text(f: dict) -> str:
    filename, line, name = str(f.get("filename", "")), f.get("line", 0), str(f.get("name", ""))
    cell = filename if filename.startswith("Cell In[") else cell_name(filename)
    if cell is not None:
        return f"{cell}, line {line}" + ("" if name == "<module>" else f", in {name}")
    return f"{os.path.basename(filename)}:{line} in {name}"


def _is_library(filename: str) -> bool:
    parts = filename.replace("\\", "/").split("/")
    return "site-packages" in parts or "dist-packages" in parts or filename.startswith(("<frozen ", _STDLIB))


def format_bytes(n: int) -> str:
    """``4000012`` -> ``3.8 MiB``."""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(size) < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"
