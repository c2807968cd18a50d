"""The inline view of `monarch.memory.dump_memory_snapshot`: per rank, bytes allocated over the recorded
history (a small step chart) and the largest allocations alive at the dump, with the user's line that made
each. Plain HTML with inline SVG: no script, nothing fetched; colours from JupyterLab's theme variables."""

from __future__ import annotations

import os

from monarch.runtime.tools.memory import MemorySnapshots, RankMemory, format_bytes
from monarch.widgets.style import esc, page

WIDTH, HEIGHT = 320, 90
_PAD_LEFT, _PAD_BOTTOM, _PAD_TOP = 4, 14, 12

CSS = """
.monarch-memory{display:flex;flex-direction:column;gap:6px;font-family:var(--jp-ui-font-family,sans-serif);font-size:12px;color:var(--jp-content-font-color1,inherit)}
.monarch-memory-head{color:var(--jp-ui-font-color2,#666)}
.monarch-memory-ranks{display:flex;flex-wrap:wrap;gap:10px}
.monarch-memory-rank{border-left:3px solid var(--jp-brand-color2,#8a6fd1);padding:2px 8px;flex:0 1 340px;min-width:300px}
.monarch-memory-title{font-family:var(--jp-code-font-family,monospace)}
.monarch-memory-title .monarch-rank-label{color:var(--jp-brand-color1,#6a4fb1);font-weight:600}
.monarch-memory-stats{color:var(--jp-ui-font-color2,#666);display:block}
.monarch-memory-chart{display:block;margin:2px 0}
.monarch-memory-area{fill:var(--jp-brand-color3,#d9cdf5);stroke:none}
.monarch-memory-line{fill:none;stroke:var(--jp-brand-color1,#6a4fb1);stroke-width:1.2}
.monarch-memory-axis{stroke:var(--jp-border-color1,#bbb);stroke-width:1}
.monarch-memory-chart text{fill:var(--jp-ui-font-color2,#666);font-size:9px;font-family:var(--jp-code-font-family,monospace)}
.monarch-memory-empty{color:var(--jp-ui-font-color2,#666);font-style:italic;padding:4px 0}
.monarch-memory .monarch-table td.monarch-memory-size{text-align:right;white-space:nowrap}
.monarch-memory .monarch-table td.monarch-memory-where{white-space:nowrap}
.monarch-memory-rank{overflow-x:auto}
""".strip()


def memory_html(snapshots: MemorySnapshots) -> str:
    """The whole view, stylesheet included (a cell's `text/html`)."""
    n = len(snapshots.ranks)
    head = (
        f'<div class="monarch-memory-head">monarch.memory: {n} snapshot{"s" * (n != 1)} in '
        f"<code>{esc(snapshots.directory)}</code> (open them in pytorch.org/memory_viz)</div>"
    )
    cards = "".join(rank_html(r) for r in snapshots.ranks)
    return page(
        f'<style>{CSS}</style><div class="monarch-memory">{head}<div class="monarch-memory-ranks">{cards}</div></div>'
    )


def rank_html(r: RankMemory) -> str:
    who = f"rank {r.rank}" + (f" ({r.label})" if r.label else "")
    title = (
        f'<div class="monarch-memory-title"><span class="monarch-rank-label">{esc(who)}</span> '
        f'<span class="monarch-memory-stats">{esc(r.device)} · {esc(format_bytes(r.allocated))} allocated · peak '
        f"{esc(format_bytes(r.peak))} · {r.events} allocations and frees · "
        f'<code title="{esc(r.path)}">{esc(os.path.basename(r.path))}</code></span></div>'
    )
    chart = (
        chart_svg(r)
        if len(r.timeline) > 1
        else '<div class="monarch-memory-empty">no allocation history recorded</div>'
    )
    if r.largest:
        rows = "".join(
            f'<tr><td class="monarch-memory-size">{esc(format_bytes(a.size))}</td><td class="monarch-memory-where">{esc(a.where)}</td></tr>'
            for a in r.largest
        )
        largest = (
            '<table class="monarch-table monarch-memory-largest"><caption>largest allocations alive at the dump'
            f"</caption><thead><tr><th>size</th><th>made at</th></tr></thead><tbody>{rows}</tbody></table>"
        )
    else:
        largest = '<div class="monarch-memory-empty">no allocation made while recording is alive</div>'
    return f'<div class="monarch-memory-rank" data-rank="{r.rank}">{title}{chart}{largest}</div>'


def chart_svg(r: RankMemory) -> str:
    """Bytes allocated over time as a step chart (memory holds its level until the next allocation or free)."""
    points = r.timeline
    t0, t1 = points[0][0], points[-1][0]
    top = max(max(v for _, v in points), 1)
    plot_w, plot_h = WIDTH - _PAD_LEFT, HEIGHT - _PAD_BOTTOM - _PAD_TOP
    by_time = t1 > t0

    def x(i: int, t: int) -> float:
        frac = (t - t0) / (t1 - t0) if by_time else i / (len(points) - 1)
        return _PAD_LEFT + frac * plot_w

    def y(v: int) -> float:
        return _PAD_TOP + plot_h * (1 - v / top)

    line: list[str] = []
    prev = None
    for i, (t, v) in enumerate(points):
        if prev is not None:
            line.append(f"{x(i, t):.1f},{y(prev):.1f}")
        line.append(f"{x(i, t):.1f},{y(v):.1f}")
        prev = v
    base = f"{x(len(points) - 1, t1):.1f},{y(0):.1f} {x(0, t0):.1f},{y(0):.1f}"
    span = f"{(t1 - t0) / 1e6:.3g} s" if by_time else f"{len(points)} events"
    label = f"bytes allocated on rank {r.rank} over {span}, peak {format_bytes(r.peak)}"
    return (
        f'<svg class="monarch-memory-chart" width="{WIDTH}" height="{HEIGHT}" viewBox="0 0 {WIDTH} {HEIGHT}" '
        f'role="img" aria-label="{esc(label)}"><title>{esc(label)}</title>'
        f'<polygon class="monarch-memory-area" points="{" ".join(line)} {base}"/>'
        f'<polyline class="monarch-memory-line" points="{" ".join(line)}"/>'
        f'<line class="monarch-memory-axis" x1="{_PAD_LEFT}" y1="{y(0):.1f}" x2="{WIDTH}" y2="{y(0):.1f}"/>'
        f'<text x="{_PAD_LEFT + 2}" y="{_PAD_TOP - 3}">{esc(format_bytes(top))}</text>'
        f'<text x="{_PAD_LEFT + 2}" y="{HEIGHT - 3}">0</text>'
        f'<text x="{WIDTH - 2}" y="{HEIGHT - 3}" text-anchor="end">{esc(span)}</text></svg>'
    )
