"""A merged profiler trace drawn inline: a row per rank (and per thread that did work), compute and
communication coloured apart, step boundaries marked; below it, the per-rank summary with the slowest
rank named. Plain SVG in HTML: no script, no external site, the same live and in a saved notebook.
"""

from __future__ import annotations

import collections
from typing import Any

from monarch.runtime.tools import traces
from monarch.widgets.style import esc, page, table

WIDTH = 960
"""Pixels of the time axis."""
ROW = 14
CHAR_W = 6.7
"""Pixels per character of the 11 px monospace labels (the label column is as wide as the longest label)."""
MAX_BOXES = 2500
"""Boxes drawn at most; the shortest are left out beyond it (the trace file keeps everything)."""
_COLOURS = {
    "compute": "var(--jp-brand-color1,#3b7dd8)",
    "comm": "var(--jp-warn-color1,#e08a00)",
    "mark": "var(--jp-success-color1,#2a9d5a)",
}


class TimelineView:
    """The inline view of a `ProfileResult` (what `monarch.profiler` shows in a notebook)."""

    def __init__(self, result: Any) -> None:
        self.result = result

    def _repr_html_(self) -> str:
        return render(self.result)

    def __repr__(self) -> str:
        return self.result.text()


def render(result: Any) -> str:
    """HTML for a `ProfileResult`: the timeline of its merged trace and the summary table."""
    merged, summary = result.merged, result.summary
    if merged is None or summary is None:
        return page(f"<div class='monarch-profile'>{esc(result.text())}</div>")
    files = ", ".join(esc(f) for f in result.merged_files)
    head = f"<div class='monarch-progress'>monarch.profiler: traces in {esc(result.directory)} (merged: {files})</div>"
    return page(f"<div class='monarch-profile'>{head}{timeline_svg(merged)}{summary_table(summary)}</div>")


def summary_table(summary: traces.Summary) -> str:
    rows, attrs = [], []
    for r in summary.ranks:
        slow = r.rank == summary.slowest
        cells = [
            f"{r.rank} ({r.label})" if r.label else str(r.rank),
            f"{r.step_ms:.2f}",
            f"{r.compute_ms:.2f}",
            f"{r.comm_ms:.2f}",
            f"{r.idle_ms:.2f}",
            "-" if r.overlap_pct is None else f"{r.overlap_pct:.0f}%",
            "slowest" if slow else "",
        ]
        rows.append([f"<td>{esc(c)}</td>" for c in cells])
        attrs.append(f"data-rank='{r.rank}'" + (" class='monarch-slowest'" if slow else ""))
    steps = summary.ranks[0].steps if summary.ranks else 0
    caption = f"per rank, ms per step ({steps} step{'s' * (steps != 1)})"
    if not summary.steps_marked:
        caption = "per rank, ms over the whole trace (no steps marked)"
    cols = ["rank", "step", "compute", "comm", "idle", "overlap", ""]
    out = table(caption, cols, rows, "monarch-table monarch-profile-summary", attrs)
    if summary.why:
        out += f"<div class='monarch-profile-why'>{esc(summary.why)}</div>"
    return out


def timeline_svg(merged: dict) -> str:
    """An SVG of the merged trace: per rank, one row per thread that ran ops or kernels."""
    rows: dict[tuple[int, Any], list[tuple[float, float, str, str]]] = {}
    steps: dict[int, list[float]] = {}
    names: dict[int, str] = {}
    for e in merged.get("traceEvents", []):
        pid = e.get("pid")
        if e.get("ph") == "M" and e.get("name") == "process_name":
            names[pid] = e.get("args", {}).get("name", f"rank {pid}")
        if e.get("ph") != "X" or "ts" not in e or not isinstance(pid, int):
            continue
        cat, name = e.get("cat"), e.get("name", "")
        start, dur = float(e["ts"]), float(e.get("dur", 0))
        if traces.STEP.match(name):
            steps.setdefault(pid, []).append(start)
            continue
        if cat == "user_annotation" or cat == "gpu_user_annotation":
            kind = "comm" if traces.COMM.search(name) else "mark"  # gloo:all_reduce, nccl:all_reduce: waiting
        elif cat in ("cpu_op", "kernel", "gpu_memcpy", "gpu_memset"):
            kind = "comm" if traces.COMM.search(name) else "compute"
        else:
            continue
        rows.setdefault((pid, e.get("tid")), []).append((start, dur, kind, name))
    if not rows:
        return "<div class='monarch-progress'>no ops were recorded</div>"
    t0 = min(s for evs in rows.values() for s, *_ in evs)
    t1 = max(s + d for evs in rows.values() for s, d, *_ in evs)
    span = max(t1 - t0, 1e-3)
    scale = WIDTH / span
    rows = {key: _coalesce(evs, 1.0 / scale) for key, evs in rows.items()}
    keep = _biggest([(d, key, i) for key, evs in rows.items() for i, (_, d, *_r) in enumerate(evs)])
    label_w = int(max(len(str(names.get(pid, pid))) for pid, _ in rows) * CHAR_W) + 12
    parts, y = [], 18
    last_pid = None
    rank_rows: dict[int, list[int]] = {}
    for key in sorted(rows, key=lambda k: (k[0], str(k[1]))):
        pid = key[0]
        rank_rows.setdefault(pid, []).append(y)
        if pid != last_pid:
            parts.append(
                f"<text x='0' y='{y + 10}' class='monarch-tl-rank' data-rank='{pid}'>{esc(names.get(pid, pid))}</text>"
            )
            last_pid = pid
        parts.append(
            f"<line x1='{label_w}' x2='{label_w + WIDTH}' y1='{y + ROW}' y2='{y + ROW}' class='monarch-tl-row'/>"
        )
        for i, (s, d, kind, name) in enumerate(rows[key]):
            if (key, i) not in keep:
                continue
            x = label_w + (s - t0) * scale
            w = max(d * scale, 0.5)
            h, dy = (ROW - 8, 0) if kind == "mark" else (ROW - 4, 4)
            parts.append(
                f"<rect x='{x:.1f}' y='{y + dy}' width='{w:.1f}' height='{h}' fill='{_COLOURS[kind]}'>"
                f"<title>{esc(name)} {d / 1000:.3f} ms</title></rect>"
            )
        y += ROW + 2
    for pid, starts in steps.items():  # each rank's step boundaries, across its own rows
        ys = rank_rows.get(pid)
        for s in starts if ys else ():
            x = label_w + (s - t0) * scale
            parts.append(f"<line x1='{x:.1f}' x2='{x:.1f}' y1='{ys[0]}' y2='{ys[-1] + ROW}' class='monarch-tl-step'/>")
    axis = f"<text x='{label_w}' y='10' class='monarch-tl-axis'>0 ms</text><text x='{label_w + WIDTH}' y='10' "
    axis += f"text-anchor='end' class='monarch-tl-axis'>{span / 1000:.2f} ms</text>"
    legend = "".join(
        f"<rect x='{label_w + 200 + 90 * i}' y='2' width='10' height='8' fill='{c}'/>"
        f"<text x='{label_w + 214 + 90 * i}' y='10' class='monarch-tl-axis'>{k}</text>"
        for i, (k, c) in enumerate(_COLOURS.items())
    )
    style = (
        "<style>.monarch-timeline text{font:11px var(--jp-code-font-family,monospace);"
        "fill:var(--jp-content-font-color1,#222)}.monarch-tl-row{stroke:var(--jp-border-color2,#ddd)}"
        ".monarch-tl-step{stroke:var(--jp-content-font-color3,#999);stroke-dasharray:3 3}"
        ".monarch-profile-summary tr.monarch-slowest td{color:var(--jp-error-color1,#c00);font-weight:600}.monarch-profile-why{font:12px var(--jp-code-font-family,monospace);padding:2px 0}</style>"
    )
    # Drawn in its own coordinates (viewBox) and scaled to the output's width, never wider than drawn: an
    # output area narrower than the picture shrinks it instead of cutting off its right part.
    w, h = label_w + WIDTH + 10, y + 4
    return (
        f"{style}<svg class='monarch-timeline' viewBox='0 0 {w} {h}' width='100%' "
        f"style='max-width:{w}px;height:auto;display:block' preserveAspectRatio='xMinYMin meet' "
        f"xmlns='http://www.w3.org/2000/svg'>{axis}{legend}{''.join(parts)}</svg>"
    )


def _coalesce(events: list[tuple[float, float, str, str]], px: float) -> list[tuple[float, float, str, str]]:
    """Events of one kind less than a pixel apart drawn as one box ("3 ops: aten::mm, ..."), so that a loop of
    thousands of small ops stays a small picture."""
    out = []
    for kind in _COLOURS:
        run: list[tuple[float, float, str, str]] = []
        end = 0.0
        for ev in sorted(e for e in events if e[2] == kind):
            if run and ev[0] > end + px:
                out.append(_one_box(run, end))
                run = []
            end = max(end, ev[0] + ev[1]) if run else ev[0] + ev[1]
            run.append(ev)
        if run:
            out.append(_one_box(run, end))
    return out


def _one_box(run: list[tuple[float, float, str, str]], end: float) -> tuple[float, float, str, str]:
    if len(run) == 1:
        return run[0]
    counts = collections.Counter(n for *_, n in run)
    shown = ", ".join(n for n, _ in counts.most_common(3)) + (", ..." if len(counts) > 3 else "")
    return run[0][0], end - run[0][0], run[0][2], f"{len(run)} ops: {shown}"


def _biggest(items: list[tuple[float, Any, int]]) -> set[tuple[Any, int]]:
    if len(items) > MAX_BOXES:
        items = sorted(items, key=lambda t: t[0], reverse=True)[:MAX_BOXES]
    return {(key, i) for _, key, i in items}
