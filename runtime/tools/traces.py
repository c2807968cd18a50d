"""Per-rank Chrome traces (as torch's profiler writes them) merged onto one clock, and what they say per
rank: step time, compute, communication, idle, overlap, and which rank the others wait for.

Plain JSON in, plain JSON out: no torch here, so the controller can read traces from any worker.
"""

from __future__ import annotations

import re
import statistics
from dataclasses import dataclass, field
from typing import Any

COMM = re.compile(
    r"nccl|gloo|c10d::|record_param_comms|all_?reduce|all_?gather|reduce_?scatter|all_?to_?all|broadcast|barrier"
    r"|^(aten::)?(send|recv)\b",
    re.IGNORECASE,
)
"""Names of events that are communication (collectives, point to point) rather than compute."""
STEP = re.compile(r"^ProfilerStep#\d+$")
GPU_THREAD = 10_000_000
"""Thread ids from here on are a GPU's streams, in the merged trace (`GPU_THREAD + 1000 * device + stream`)."""


@dataclass
class RankTrace:
    """One rank's trace, as its worker made it."""

    rank: int
    label: str
    """The rank's coordinates, e.g. ``"gpu=3"``."""
    trace: dict
    """torch's Chrome trace (``traceEvents``, ``baseTimeNanoseconds``)."""
    offset_ns: int = 0
    """The rank's clock minus the controller's; subtracted to put every rank on the controller's clock."""
    host: str = ""


def merge(ranks: list[RankTrace]) -> dict:
    """One Chrome/Perfetto trace with a process per rank (pid = rank), on the controller's clock."""
    starts = [_base_ns(r) - r.offset_ns for r in ranks]
    base = min(starts) if starts else 0
    events: list[dict] = []
    for r, start in zip(ranks, starts, strict=True):
        shift_us = (start - base) / 1000.0
        own_pid = _own_pid(r.trace)
        gpu_threads: set[tuple[int, Any]] = set()
        for e in r.trace.get("traceEvents", []):
            pid, tid = e.get("pid"), e.get("tid")
            if e.get("ph") == "M" and e.get("name", "").startswith("process_"):
                continue  # ours replace them
            if not isinstance(pid, int) or not isinstance(tid, int | str):
                continue  # the profiler's own spans ("Spans", "Trace")
            e = dict(e)
            if pid != own_pid:  # a GPU's events: device `pid`, stream `tid`
                gpu_threads.add((pid, tid))
                tid = GPU_THREAD + 1000 * pid + (tid if isinstance(tid, int) else 0)
            e["pid"], e["tid"] = r.rank, tid
            if "ts" in e:
                e["ts"] = round(float(e["ts"]) + shift_us, 3)
            if "id" in e and e.get("ph") in ("s", "f", "t"):
                e["id"] = f"{r.rank}:{e['id']}"
            if e.get("ph") == "M" and e.get("name") == "thread_name" and pid != own_pid:
                continue  # named below
            events.append(e)
        name = f"rank {r.rank} ({r.label})" if r.label else f"rank {r.rank}"
        meta = [
            ("process_name", {"name": name}),
            ("process_sort_index", {"sort_index": r.rank}),
            ("process_labels", {"labels": r.host or "worker"}),
        ]
        events.extend({"ph": "M", "name": n, "pid": r.rank, "tid": 0, "args": a} for n, a in meta)
        for dev, stream in sorted(gpu_threads, key=str):
            tid = GPU_THREAD + 1000 * dev + (stream if isinstance(stream, int) else 0)
            events.append(
                {"ph": "M", "name": "thread_name", "pid": r.rank, "tid": tid, "args": {"name": f"gpu {dev} {stream}"}}
            )
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "baseTimeNanoseconds": base,
        "otherData": {"merged_by": "monarch", "ranks": [r.rank for r in ranks]},
    }


def _base_ns(r: RankTrace) -> int:
    return int(r.trace.get("baseTimeNanoseconds", 0))


def _own_pid(trace: dict) -> int | None:
    """The worker process's pid in its trace (its CPU events'); GPU events use the device as pid."""
    for e in trace.get("traceEvents", []):
        if e.get("cat") in ("cpu_op", "user_annotation", "python_function") and isinstance(e.get("pid"), int):
            return e["pid"]
    for e in trace.get("traceEvents", []):
        if e.get("ph") == "M" and e.get("name") == "process_labels" and e.get("args", {}).get("labels") == "CPU":
            return e.get("pid")
    return None


# -- what the merged trace says -------------------------------------------------------------------------
@dataclass
class RankSummary:
    """One rank's time, per step (the mean over the profiled steps)."""

    rank: int
    label: str
    steps: int
    """Profiled steps (`prof.step()` windows); 1 when there were none (the whole trace is one)."""
    step_ms: float
    compute_ms: float
    """Time in ops that are not communication (GPU kernels on a GPU, top-level CPU ops otherwise)."""
    comm_ms: float
    """Time in collectives and point-to-point ops, waiting for peers included."""
    idle_ms: float
    """Step time in neither."""
    overlap_pct: float | None
    """Share of communication hidden behind compute; None without communication."""
    device: str = "cpu"
    """Where compute and communication were read from: ``"cpu"`` ops or ``"gpu"`` kernels."""


@dataclass
class Summary:
    """Per-rank time and the rank the others wait for."""

    ranks: list[RankSummary] = field(default_factory=list)
    slowest: int | None = None
    why: str = ""
    """One sentence: why `slowest` is named."""
    steps_marked: bool = True
    """Whether the trace marks steps (`prof.step()`, `sim.step()`); without, each rank's row covers the whole
    trace as one step."""

    def text(self) -> str:
        """A small table, for a terminal."""
        rows = [f"{'rank':<16}{'step ms':>9}{'compute':>9}{'comm':>9}{'idle':>9}{'overlap':>9}"]
        for r in self.ranks:
            ov = "-" if r.overlap_pct is None else f"{r.overlap_pct:.0f}%"
            name = f"{r.rank} ({r.label})" if r.label else str(r.rank)
            rows.append(f"{name:<16}{r.step_ms:>9.2f}{r.compute_ms:>9.2f}{r.comm_ms:>9.2f}{r.idle_ms:>9.2f}{ov:>9}")
        if self.why:
            rows.append(self.why)
        return "\n".join(rows)


def summarize(merged: dict) -> Summary:
    """Step time, compute, communication, idle and overlap per rank of a merged trace; the slowest named."""
    by_rank: dict[int, list[dict]] = {}
    labels: dict[int, str] = {}
    for e in merged.get("traceEvents", []):
        pid = e.get("pid")
        if not isinstance(pid, int):
            continue
        if e.get("ph") == "M" and e.get("name") == "process_name":
            name = e.get("args", {}).get("name", "")
            labels[pid] = name[name.find("(") + 1 : -1] if "(" in name else ""
        elif e.get("ph") == "X":
            by_rank.setdefault(pid, []).append(e)
    out = Summary()
    common = None  # without `prof.step()`, every rank is measured over the same span (a rank that started
    if not any(STEP.match(e.get("name", "")) for evs in by_rank.values() for e in evs):  # late was not quicker)
        out.steps_marked = False
        spans = [(e["ts"], e["ts"] + e.get("dur", 0)) for evs in by_rank.values() for e in evs if "ts" in e]
        common = (min(s for s, _ in spans), max(t for _, t in spans)) if spans else None
    for rank in sorted(by_rank):
        out.ranks.append(_rank_summary(rank, labels.get(rank, ""), by_rank[rank], common))
    _name_slowest(out)
    return out


def _rank_summary(rank: int, label: str, events: list[dict], common: tuple[float, float] | None) -> RankSummary:
    windows = sorted(
        (e["ts"], e["ts"] + e.get("dur", 0)) for e in events if STEP.match(e.get("name", "")) and "ts" in e
    )
    if not windows and common is not None:
        windows = [common]
    kernels = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    device = "gpu" if kernels else "cpu"
    # (a collective that is a range of our own, such as monarch's shared-memory reduce, holds the ops it runs:
    # they are communication, not compute)
    work = kernels if kernels else _top_level(e for e in events if e.get("cat") == "cpu_op" or _comm_range(e))
    comm_iv, comp_iv = [], []
    for e in work:
        iv = (e["ts"], e["ts"] + e.get("dur", 0))
        (comm_iv if COMM.search(e.get("name", "")) else comp_iv).append(iv)
    for e in events:  # a backend's own ranges ("gloo:all_reduce" on its thread, "nccl:all_reduce") hold the waiting
        if e.get("cat") in ("user_annotation", "gpu_user_annotation") and "ts" in e and COMM.search(e.get("name", "")):
            comm_iv.append((e["ts"], e["ts"] + e.get("dur", 0)))
    if not windows:
        spans = [(e["ts"], e["ts"] + e.get("dur", 0)) for e in events if "ts" in e]
        windows = [(min(s for s, _ in spans), max(t for _, t in spans))] if spans else [(0.0, 0.0)]
    comm_u, comp_u = _union(comm_iv), _union(comp_iv)
    total = sum(t - s for s, t in windows)
    comm = sum(_covered(comm_u, w) for w in windows)
    comp = sum(_covered(comp_u, w) for w in windows)
    both = sum(_covered(_intersect(comm_u, comp_u), w) for w in windows)
    n = len(windows)
    ms = 1000.0 * n
    return RankSummary(
        rank=rank,
        label=label,
        steps=n,
        step_ms=total / ms,
        compute_ms=comp / ms,
        comm_ms=comm / ms,
        idle_ms=max(0.0, total - comm - comp + both) / ms,
        overlap_pct=(100.0 * both / comm) if comm > 0 else None,
        device=device,
    )


STANDS_OUT = 0.10
"""A rank is named the slowest when its time exceeds the others' median by this share of a step."""


def _name_slowest(s: Summary) -> None:
    if len(s.ranks) < 2:
        return
    # Ranks that meet in collectives finish steps together: the slow one is the one the others wait for,
    # the one with the most step time outside communication. Without communication: the longest step.
    comm = any(r.comm_ms > 0 for r in s.ranks)
    key = {r.rank: (r.step_ms - r.comm_ms) if comm else r.step_ms for r in s.ranks}
    slow = max(s.ranks, key=lambda r: key[r.rank])
    others = sorted(key[r.rank] for r in s.ranks if r is not slow)
    median = statistics.median(others)
    step = sum(r.step_ms for r in s.ranks) / len(s.ranks)
    what = "ms per step outside communication" if comm else "ms per step"
    spread = f"the others {others[0]:.2f}-{others[-1]:.2f}"
    if key[slow.rank] - median <= STANDS_OUT * step:
        s.why = f"no rank stands out: {min(key.values()):.2f}-{max(key.values()):.2f} {what} across ranks"
        return
    s.slowest = slow.rank
    s.why = f"slowest: rank {slow.rank}{_paren(slow.label)}: {key[slow.rank]:.2f} {what}, {spread}"
    if comm:
        s.why += "; they wait for it in collectives"


def _paren(label: str) -> str:
    return f" ({label})" if label else ""


def _comm_range(e: dict) -> bool:
    return e.get("cat") == "user_annotation" and bool(COMM.search(e.get("name", "")))


def _top_level(events) -> list[dict]:
    """Ops not inside another op of the same thread (their children's time is theirs already)."""
    out = []
    by_tid: dict[Any, list[dict]] = {}
    for e in events:
        if "ts" in e:
            by_tid.setdefault(e.get("tid"), []).append(e)
    for evs in by_tid.values():
        evs.sort(key=lambda e: (e["ts"], -e.get("dur", 0)))
        end = float("-inf")
        for e in evs:
            if e["ts"] >= end:
                out.append(e)
                end = e["ts"] + e.get("dur", 0)
    return out


def _union(ivs: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for s, t in sorted(ivs):
        if out and s <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], t))
        else:
            out.append((s, t))
    return out


def _intersect(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        s, t = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if s < t:
            out.append((s, t))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def _covered(u: list[tuple[float, float]], w: tuple[float, float]) -> float:
    return sum(max(0.0, min(t, w[1]) - max(s, w[0])) for s, t in u)
