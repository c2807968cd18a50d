"""The simulated timeline as a Chrome/Perfetto trace: a process per rank, a thread per stream.

Ops are written as torch's profiler writes them (``cpu_op`` on a CPU device, ``kernel`` on a GPU), so
the summary and the inline timeline of `monarch.profiler` read simulated and measured traces alike.
With ``trace_mode="full"`` the trace also holds the controller (when each batch was sent, when each
value was fetched) and a memory counter per rank.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from monarch.runtime.simulator.model import SimWorkers

CONTROLLER_PID_OFFSET = 1
"""The controller's process id in the trace: the number of ranks plus this."""


def stream_tid(n_ranks: int, sid: int) -> int:
    """The thread id of stream `sid` in every rank's process: above every rank's pid, since Perfetto's importer
    reads a thread id of 0 as the process's main thread (tid = pid), and a stream whose id were that pid would
    share its track (rank 1's main stream and a stream of id 1 did)."""
    return n_ranks + CONTROLLER_PID_OFFSET + 1 + sid


def build(w: SimWorkers, labels: list[str], full: bool, controller: list[tuple[float, float, str]]) -> dict:
    """The trace of `w`'s recorded window; `controller`: (start, end, what) spans of the controller's."""
    t0 = w.origin()
    cat = "kernel" if w.dev.kind == "gpu" else "cpu_op"
    n = len(labels)
    events: list[dict] = []
    used: set[tuple[int, int]] = set()
    for r, label in enumerate(labels):
        events.append({"ph": "M", "name": "process_name", "pid": r, "tid": 0, "args": {"name": f"rank {r} ({label})"}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": r, "tid": 0, "args": {"sort_index": r}})
    for e in w.events:
        args: dict[str, Any] = {"issued at": e.where}
        if full:
            if e.flops:
                args["flops"] = e.flops
            if e.nbytes:
                args["bytes"] = e.nbytes
        starts = (e.start - t0) * 1e6
        durs = (e.end - e.start) * 1e6
        for r, ts, dur in zip(e.ranks.tolist(), starts.tolist(), durs.tolist()):
            used.add((r, e.stream))
            events.append({"ph": "X", "cat": cat, "name": e.name, "pid": r, "tid": stream_tid(n, e.stream),
                           "ts": round(ts, 3), "dur": round(dur, 3), "args": args})  # fmt: skip
    begun: dict[int, float] = {}
    for k, (ranks, ends) in enumerate(w.steps):  # as torch's profiler marks `prof.step()`, on the main stream
        for r, end in zip(ranks.tolist(), ends.tolist()):
            start = begun.get(r, t0)
            begun[r] = max(end, start)
            events.append({"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{k}", "pid": r,
                           "tid": stream_tid(n, 0), "ts": round((start - t0) * 1e6, 3),
                           "dur": round((begun[r] - start) * 1e6, 3)})  # fmt: skip
    for r, sid in sorted(used):
        name = w.names.get(sid, f"stream {sid}")
        events.append(
            {"ph": "M", "name": "thread_name", "pid": r, "tid": stream_tid(n, sid), "args": {"name": f"stream {name}"}}
        )
    if full:
        pid = n + CONTROLLER_PID_OFFSET
        events.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": "controller"}})
        for start, end, what in controller:
            if end >= w.window:
                events.append({"ph": "X", "cat": "controller", "name": what, "pid": pid, "tid": 0,
                               "ts": round((start - t0) * 1e6, 3), "dur": round((end - start) * 1e6, 3)})  # fmt: skip
        events += _memory_counters(w, t0)
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {"simulated": True, "device": w.dev.describe()},
    }


def _memory_counters(w: SimWorkers, t0: float) -> list[dict]:
    out = []
    level = w.baseline.astype(np.int64).copy()
    changes: dict[int, list[tuple[float, int]]] = {}
    for m in w.mem:
        for r, t in zip(m.ranks.tolist(), m.times.tolist()):
            changes.setdefault(r, []).append((t, m.delta))
    for r in range(w.size):
        out.append({"ph": "C", "name": "memory", "pid": r, "tid": 0, "ts": round((w.window - t0) * 1e6, 3),
                    "args": {"bytes": int(level[r])}})  # fmt: skip
        for t, d in sorted(changes.get(r, ()), key=lambda x: (x[0], x[1] > 0)):
            level[r] += d
            out.append({"ph": "C", "name": "memory", "pid": r, "tid": 0, "ts": round((t - t0) * 1e6, 3),
                        "args": {"bytes": int(level[r])}})  # fmt: skip
    return out
