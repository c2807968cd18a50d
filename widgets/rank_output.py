"""Per-rank output of a `%%mesh` cell: one area per rank that grows as the workers write.

Live, only the new text travels (one small comm message per batch); when the cell ends, static HTML
replaces the live view: each rank's last lines (`TAIL_CHARS`), with a line saying how many came before.
"""

from __future__ import annotations

import contextlib
import re
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import traitlets

from monarch.runtime.common import config
from monarch.runtime.common.shape import format_ranks
from monarch.widgets import render
from monarch.widgets.base import StaticFallbackWidget
from monarch.widgets.style import esc, page

_ESM = r"""
const STORE = (globalThis.__monarchRankOutputs ??= new Map());
function state(model) {
  const uid = model.get("uid");
  let st = STORE.get(uid);
  if (!st) { st = { log: [], views: new Set() }; STORE.set(uid, st); }
  return st;
}
// Stream text drawn as a terminal shows it, by the rules of render.py: "\r" goes back to the line's start,
// ANSI colours become JupyterLab's ansi-* classes, other escapes are dropped.
const COLOURS = ["black", "red", "green", "yellow", "blue", "magenta", "cyan", "white"];
const OTHER = /\x1b\[[0-9;?]*[A-Za-ln-z]|\x1b\][^\x07]*\x07/g;
function sgr(st, codes) {
  const nums = codes.split(";").filter((c) => /^\d+$/.test(c)).map(Number);
  for (const n of nums.length ? nums : [0]) {
    if (n === 0) Object.assign(st, { fg: null, bg: null, bold: false, underline: false });
    else if (n === 1) st.bold = true;
    else if (n === 4) st.underline = true;
    else if (n === 21 || n === 22) st.bold = false;
    else if (n === 24) st.underline = false;
    else if (n >= 30 && n <= 37) st.fg = COLOURS[n - 30];
    else if (n >= 90 && n <= 97) st.fg = COLOURS[n - 90] + "-intense";
    else if (n === 39) st.fg = null;
    else if (n >= 40 && n <= 47) st.bg = COLOURS[n - 40];
    else if (n >= 100 && n <= 107) st.bg = COLOURS[n - 100] + "-intense";
    else if (n === 49) st.bg = null;
  }
}
function classes(st) {
  const c = [];
  if (st.fg) c.push(`ansi-${st.fg}-fg`);
  if (st.bg) c.push(`ansi-${st.bg}-bg`);
  if (st.bold) c.push("ansi-bold");
  if (st.underline) c.push("ansi-underline");
  return c.join(" ");
}
function ansi(parent, text, st) {
  text = text.replace(OTHER, "");
  const put = (s) => {
    if (!s) return;
    const cls = classes(st);
    if (!cls) { parent.append(s); return; }
    const sp = document.createElement("span"); sp.className = cls; sp.textContent = s; parent.appendChild(sp);
  };
  const re = /\x1b\[([0-9;]*)m/g;
  let pos = 0, m;
  while ((m = re.exec(text))) { put(text.slice(pos, m.index)); sgr(st, m[1]); pos = re.lastIndex; }
  put(text.slice(pos));
}
function line(parent, text, st) {  // after "\r", characters write over the line from its start
  if (!text.includes("\r")) { ansi(parent, text, st); return; }
  const cells = [];
  let col = 0;
  for (const part of text.replace(OTHER, "").split(/(\r|\x1b\[[0-9;]*m)/)) {
    if (part === "\r") col = 0;
    else if (part.startsWith("\x1b[")) sgr(st, part.slice(2, -1));
    else for (const ch of part) { cells[col++] = [ch, classes(st)]; }
  }
  let run = "", cls = null;
  const flush = () => {
    if (!run) return;
    if (!cls) parent.append(run);
    else { const sp = document.createElement("span"); sp.className = cls; sp.textContent = run; parent.appendChild(sp); }
    run = "";
  };
  for (const [ch, c] of cells) { if (c !== cls) flush(); run += ch; cls = c; }
  flush();
}
function block(stream) {
  const div = document.createElement("div");
  div.className = `jp-RenderedText monarch-${stream}`;
  div.dataset.mimeType = `application/vnd.jupyter.${stream}`; div.dataset.stream = stream;
  const pre = document.createElement("pre");
  const done = document.createElement("span"), tail = document.createElement("span");
  pre.append(done, tail); div.appendChild(pre);
  return { div, stream, done, tail, rest: "", st: { fg: null, bg: null, bold: false, underline: false } };
}
function write(b, chunk) {
  const lines = (b.rest + chunk).replace(/\r\n/g, "\n").split("\n");
  b.rest = lines.pop();  // the line still being written: drawn again with each chunk
  for (const l of lines) { line(b.done, l, b.st); b.done.append("\n"); }
  b.tail.replaceChildren();
  line(b.tail, b.rest, { ...b.st });
}
export default {
  initialize({ model }) {
    const st = state(model);
    if (!st.log.length) st.log.push(...model.get("initial"));
    const on = (m) => { st.log.push(...m.items); for (const v of st.views) v(m.items); };
    model.on("msg:custom", on);
    return () => model.off("msg:custom", on);
  },
  render({ model, el }) {
    const st = state(model);
    const root = document.createElement("div");
    root.className = "monarch-ranks";
    el.appendChild(root);
    const shown = new Set();  // the areas drawn
    const makeArea = (label, order) => {
      const div = document.createElement("div"); div.className = "monarch-rank"; div.dataset.label = label;
      const h = document.createElement("div"); h.className = "monarch-rank-label";
      const name = document.createElement("span"); name.textContent = `[${label}]`;
      const more = document.createElement("button"); more.className = "monarch-rank-more";
      more.textContent = "show all"; more.hidden = true;
      const scroll = document.createElement("div"); scroll.className = "monarch-rank-scroll";
      more.onclick = () => { more.textContent = scroll.classList.toggle("monarch-all") ? "show less" : "show all"; };
      h.append(name, more);
      const body = document.createElement("div"); body.className = "monarch-rank-body";
      scroll.appendChild(body);
      div.append(h, scroll);
      const a = { div, h, name, body, scroll, more, last: null, order };
      let next = null;  // in order (of rank; of first rank for a group)
      for (const x of shown) if (x.order > order && (next === null || x.order < next.order)) next = x;
      root.insertBefore(div, next ? next.div : null);
      shown.add(a);
      return a;
    };
    const draw = (a, it) => {
      if (it.s === "display") {
        const t = document.createElement("template"); t.innerHTML = it.h;
        a.body.append(...t.content.childNodes); a.last = null;
        return;
      }
      if (!a.last || a.last.stream !== it.s) { a.last = block(it.s); a.body.appendChild(a.last.div); }
      write(a.last, it.t);
    };
    // One area per rank; or, for a cell on many ranks (`grouped`), one per distinct output so far: a rank's
    // output is hashed as it comes (FNV-1a over its characters, whatever the chunks), and it moves to the area
    // of the ranks whose output hashes the same, or to a new one drawn from its own items.
    const grouped = model.get("grouped");
    const areas = new Map();  // rank -> its area (not grouped)
    const ranks = new Map();  // rank -> { h, stream, items, label } (grouped)
    const groups = new Map();  // hash -> { a, members } (grouped)
    const dirty = new Set();
    const hash = (h, text) => {
      for (let i = 0; i < text.length; i++) h = Math.imul(h ^ text.charCodeAt(i), 16777619) >>> 0;
      return h;
    };
    const place = (it) => {
      let r = ranks.get(it.r);
      if (!r) { r = { h: 2166136261, stream: null, items: [], label: it.l }; ranks.set(it.r, r); }
      const old = groups.get(r.h);
      if (old && old.members.delete(it.r)) {
        if (old.members.size) dirty.add(old);
        else { old.a.div.remove(); shown.delete(old.a); groups.delete(r.h); dirty.delete(old); }
      }
      if (it.s === "display") { r.h = hash(hash(r.h, "\u0001display"), it.h); r.stream = null; }
      else { if (r.stream !== it.s) r.h = hash(r.h, "\u0001" + it.s); r.h = hash(r.h, it.t); r.stream = it.s; }
      r.items.push(it);
      let g = groups.get(r.h);
      if (!g) {
        g = { a: makeArea(it.l, it.r), members: new Set() };
        for (const x of r.items) draw(g.a, x);
        groups.set(r.h, g);
      }
      g.members.add(it.r);
      dirty.add(g);
    };
    const ranges = (sorted) => {
      const parts = [];
      for (let i = 0; i < sorted.length;) {
        let j = i;
        while (j + 1 < sorted.length && sorted[j + 1] === sorted[j] + 1) j++;
        parts.push(i === j ? `${sorted[i]}` : `${sorted[i]}-${sorted[j]}`);
        i = j + 1;
      }
      return (parts.length <= 6 ? parts : [...parts.slice(0, 3), "…", parts[parts.length - 1]]).join(", ");
    };
    const relabel = (g) => {  // its ranks named; each one's label listed when opened
      const members = [...g.members].sort((x, y) => x - y);
      const one = members.length === 1;
      const label = one ? ranks.get(members[0]).label : `ranks ${ranges(members)}`;
      g.a.div.dataset.label = label; g.a.div.dataset.ranks = `${members.length}`;
      g.a.name.textContent = `[${label}]`;
      let d = g.a.h.querySelector("details");
      if (one) { if (d) d.remove(); return; }
      if (!d) {
        d = document.createElement("details"); d.className = "monarch-rank-members";
        d.appendChild(document.createElement("summary"));
        d.ontoggle = () => {
          d.querySelectorAll("div").forEach((x) => x.remove());
          if (d.open) for (const m of [...g.members].sort((x, y) => x - y)) {
            const x = document.createElement("div"); x.textContent = ranks.get(m).label; d.appendChild(x);
          }
        };
        g.a.h.insertBefore(d, g.a.more);
      }
      d.firstChild.textContent = `${members.length} ranks`;
      if (d.open) d.ontoggle();
    };
    const add = (items) => {
      for (const it of items) {
        if (grouped) { place(it); continue; }
        let a = areas.get(it.r);
        if (!a) { a = makeArea(it.l, it.r); areas.set(it.r, a); }
        draw(a, it);
      }
      for (const g of dirty) relabel(g);
      dirty.clear();
      for (const a of shown) {  // "show all" once an area holds more than it shows
        if (a.more.hidden && a.scroll.scrollHeight > a.scroll.clientHeight + 1) a.more.hidden = false;
      }
    };
    add(st.log);
    st.views.add(add);
    return () => st.views.delete(add);
  },
};
"""


GROUP_ABOVE = 64
"""A cell on more ranks than this shows ranks whose output is the same as one area, its ranks named (live and
saved): 512 ranks printing the same line make one area, not 512."""
TAIL_CHARS = 32 * 1024
"""Stream text of each rank that the static view keeps: its last lines (the live view showed all of it).
A flood of output then crosses iopub once, live, plus this bounded tail when the cell ends."""
TAIL_DISPLAYS = 20
"""Rich displays of each rank that the static view keeps: its last ones."""
SKIPPED = "skipped"
"""A chunk standing for what the static view leaves out at its place: ``(SKIPPED, Skipped)``."""


@dataclass
class Skipped:
    lines: int = 0
    chars: int = 0
    displays: int = 0

    def note(self, tail: tuple[int, int], path: str | None = None) -> str:
        """The line the static view shows in place of what it left out; `tail` as `RankLog.tail`; `path`: the
        file that holds all of the rank's text."""
        parts, kept = [], []
        if self.chars:
            size = _size(self.chars)
            lines = f"{self.lines:,} line{'s' * (self.lines != 1)}"
            parts.append(f"{lines} ({size})" if self.lines else f"{size} of text")
            kept.append(f"{_size(tail[0])} of text")
        if self.displays:
            parts.append(f"{self.displays:,} display{'s' * (self.displays != 1)}")
            kept.append(f"{tail[1]} display{'s' * (tail[1] != 1)}")
        where = f"; all its text is in {path}" if path else ""
        return (
            f"… {' and '.join(parts)} not shown: a finished cell keeps each rank's last {' and '.join(kept)}{where} …"
        )


def _size(chars: int) -> str:
    if chars < 1024:
        return f"{chars} B"
    kib = chars / 1024
    return (f"{kib:.1f} KiB" if kib < 1024 else f"{kib / 1024:.1f} MiB").replace(".0 ", " ")


class RankLog:
    """What the ranks of one cell wrote, in order per rank: text and rich displays; of a flood, the last
    `TAIL_CHARS` of text and `TAIL_DISPLAYS` displays of each rank, what came before counted, not kept."""

    def __init__(
        self,
        tail_chars: int = TAIL_CHARS,
        tail_displays: int = TAIL_DISPLAYS,
        files: bool = False,
        grouped: bool = False,
    ) -> None:
        self.grouped = grouped
        """Whether ranks with the same output are shown as one area (`GROUP_ABOVE`)."""
        self.ranks: dict[int, tuple[str, list[tuple[str, str | dict | Skipped]]]] = {}
        """Rank -> (its label, its chunks in order: ``(stream, text)``, ``("display", mime bundle)`` or
        ``(SKIPPED, Skipped)``)."""
        self.tail = (tail_chars, tail_displays)
        self._kept: dict[int, list[int]] = {}
        """Rank -> [characters of text, displays] in its chunks."""
        self._written: dict[int, int] = {}
        """Rank -> characters of text it wrote in all."""
        self._files: dict[int, IO[str] | None] = {}
        """Rank -> the open file that gets all its text, once it wrote more than the saved view keeps (None:
        it could not be made)."""
        self.paths: dict[int, str] = {}
        """Rank -> that file's path."""
        self._folder: Path | None = None
        self._use_files = files
        """Whether a rank's text past the tail also goes to a file (`config.output_dir`): a notebook's cells."""

    def add(self, rank: int, label: str, stream: str, text: str = "", data: dict | None = None) -> dict:
        """Record one chunk; returns it in the form the live view takes (a display as HTML). An ``"error"``
        (a failed rank's traceback while others went on) is shown live as stderr and left out of the static
        view, where the cell's error shows it."""
        if stream == "error":
            return {"r": rank, "l": label, "s": "stderr", "t": text}
        chunk = (data or {}) if stream == "display" else text
        chunks = self.ranks.setdefault(rank, (label, []))[1]
        chunks.append((stream, chunk))
        kept = self._kept.setdefault(rank, [0, 0])
        if stream == "display":
            kept[1] += 1
        else:
            kept[0] += len(text)
            written = self._written[rank] = self._written.get(rank, 0) + len(text)
            if rank in self._files:
                f = self._files[rank]
                if f is not None:
                    f.write(text)
            elif written > self.tail[0] and self._use_files:  # more than the saved view keeps: to a file too
                self._open(rank, label, chunks)
        if kept[0] > 2 * self.tail[0] or kept[1] > 2 * self.tail[1]:  # now and then, so memory stays bounded
            tail, *self._kept[rank] = _tail(chunks, *self.tail)
            self.ranks[rank] = (label, tail)
        if stream == "display":
            return {"r": rank, "l": label, "s": stream, "h": render.bundle_html(chunk, render.MATHML)}
        return {"r": rank, "l": label, "s": stream, "t": text}

    def _open(self, rank: int, label: str, chunks: list[tuple[str, str | dict | Skipped]]) -> None:
        """Start rank's file with its text so far (all of it is still in `chunks`: they are trimmed only past
        twice what is kept)."""
        f = None
        try:
            if self._folder is None:
                name = f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:8]}"
                self._folder = config.output_dir() / name
                self._folder.mkdir(parents=True, exist_ok=True, mode=0o700)
            path = self._folder / (re.sub(r"[^\w=,.-]", "_", label) + ".txt")
            f = open(path, "w", encoding="utf-8")  # (kept open: the rank may write more)
            f.writelines(c for s, c in chunks if s not in ("display", SKIPPED) and isinstance(c, str))
            f.flush()
            self.paths[rank] = str(path)
        except OSError:
            f = None
        self._files[rank] = f

    def close(self) -> None:
        """Close the ranks' files (the cell ended)."""
        for f in self._files.values():
            if f is not None:
                with contextlib.suppress(OSError):
                    f.close()
        self._files = dict.fromkeys(self._files)

    def __del__(self) -> None:
        self.close()

    def __bool__(self) -> bool:
        return bool(self.ranks)

    def _shown(self) -> list[tuple[str, list[tuple[str, str | dict | Skipped]], str | None]]:
        """(label, runs, the file with all its text) of each rank, in rank order, as the static view shows them."""
        return [
            (label, _runs(_tail(list(chunks), *self.tail)[0]), self.paths.get(rank))
            for rank, (label, chunks) in sorted(self.ranks.items())
        ]

    def _areas(self) -> list[tuple[str, list[str], list[tuple[str, str | dict | Skipped]], str | None]]:
        """(label, the labels of its ranks, runs, file) of each area the static view shows: one per rank, or when
        `grouped` one per distinct output (its ranks in rank order, the areas in order of their first rank)."""
        shown = self._shown()
        if not self.grouped:
            return [(label, [label], runs, path) for label, runs, path in shown]
        ranks = sorted(self.ranks)
        groups: dict[str, tuple[list[int], list[str], list, str | None]] = {}
        for rank, (label, runs, path) in zip(ranks, shown, strict=True):
            key = repr((runs, path))
            group = groups.setdefault(key, ([], [], runs, path))
            group[0].append(rank)
            group[1].append(label)
        return [
            (labels[0] if len(members) == 1 else f"ranks {_brief(members)}", labels, runs, path)
            for members, labels, runs, path in groups.values()
        ]

    def html(self) -> str:
        """The static view: math as TeX, typeset by the MathJax of JupyterLab or nbconvert."""
        out = ['<div class="monarch-ranks">']
        for label, labels, runs, path in self._areas():
            out.append(f'<div class="monarch-rank" data-label="{esc(label)}">')
            out.append(f'<div class="monarch-rank-label">[{esc(label)}]{_members(labels)}</div>')
            out.append('<div class="monarch-rank-scroll"><div class="monarch-rank-body">')
            for stream, run in runs:
                if stream == "display":
                    out.append(render.bundle_html(run, render.TEX))
                elif stream == SKIPPED:
                    out.append(
                        f'<div class="jp-RenderedText monarch-skipped"><pre>{esc(run.note(self.tail, path))}</pre></div>'
                    )
                else:
                    out.append(render.stream_html(stream, run))
            out.append("</div></div></div>")
        out.append("</div>")
        return "".join(out)

    def text(self) -> str:
        lines = []
        for label, _, runs, path in self._areas():
            parts = [
                str(run.get("text/plain", "")) + "\n"
                if stream == "display"
                else run.note(self.tail, path) + "\n"
                if stream == SKIPPED
                else render.plain(run)
                for stream, run in runs
            ]
            lines += [f"[{label}] {line}" for line in "".join(parts).splitlines()]
        return "\n".join(lines)

    def bundle(self) -> dict:
        """The static outputs: `text/html` and `text/plain`."""
        return {"text/plain": self.text(), "text/html": page(self.html())}


def _brief(ranks: list[int]) -> str:
    """``0-63, 128-191`` (what `format_ranks` says), or past six runs its first three and its last: ``0, 2, 4, …,
    510``; an area's opened list names each rank."""
    parts = format_ranks(ranks).split(", ")
    return ", ".join(parts if len(parts) <= 6 else [*parts[:3], "…", parts[-1]])


def _members(labels: list[str]) -> str:
    """An area's ranks, when it stands for more than one: how many, and each one's label when opened."""
    if len(labels) < 2:
        return ""
    each = "".join(f"<div>{esc(label)}</div>" for label in labels)
    return f'<details class="monarch-rank-members"><summary>{len(labels)} ranks</summary>{each}</details>'


def _tail(chunks: list[tuple[str, str | dict | Skipped]], chars: int, displays: int) -> tuple[list, int, int]:
    """The last `chars` characters of text (from a line's start where it can) and `displays` displays of
    `chunks`, what comes before them counted in `Skipped` chunks; and the characters and displays kept."""
    cuts = [0] * len(chunks)
    """Per chunk, where what is kept starts (a display: 1 when it is left out)."""
    left = [chars, displays]
    for i in range(len(chunks) - 1, -1, -1):
        stream, chunk = chunks[i]
        if stream == SKIPPED:
            continue
        if stream == "display":
            cuts[i] = 0 if left[1] else 1
            left[1] = max(left[1] - 1, 0)
        elif len(chunk) > left[0]:
            start = len(chunk) - left[0]
            nl, cr = chunk.find("\n", start - 1), chunk.find("\r", start)
            cuts[i] = nl + 1 if nl >= 0 else cr if cr >= 0 else start  # a line's start, or a "\r" redraw's
            left[0] = 0
        else:
            left[0] -= len(chunk)
    if not any(cuts):
        return chunks, chars - left[0], displays - left[1]
    out: list[tuple[str, str | dict | Skipped]] = []
    gap = Skipped()
    """What is left out since the last chunk kept."""
    run, state, cut_in_run = None, render.AnsiState(), False
    """The stream of the run of text a chunk belongs to, the colours in force where its text was cut, and
    whether it was (the first text kept after the cut then starts with an escape to those colours)."""
    for (stream, chunk), cut in zip(chunks, cuts, strict=True):
        text = stream not in ("display", SKIPPED)
        if not text or stream != run:
            run, state, cut_in_run = stream if text else None, render.AnsiState(), False
        if stream == SKIPPED:
            gap.lines, gap.chars, gap.displays = (
                gap.lines + chunk.lines,
                gap.chars + chunk.chars,
                gap.displays + chunk.displays,
            )
            continue
        if stream == "display" and cut:
            gap.displays += 1
            continue
        if text:
            if cut:
                dropped, chunk = chunk[:cut], chunk[cut:]
                gap.lines += dropped.count("\n")
                gap.chars += len(dropped) - state.scan(dropped)  # (text: colour escapes left out)
                cut_in_run = True
            if not chunk:
                continue
            if cut_in_run:
                chunk, cut_in_run = state.sgr() + chunk, False
        if gap != Skipped():
            out.append((SKIPPED, gap))
            gap = Skipped()
        out.append((stream, chunk))
    if gap != Skipped():
        out.append((SKIPPED, gap))
    return out, chars - left[0], displays - left[1]


def _runs(chunks: list[tuple[str, str | dict | Skipped]]) -> list[tuple[str, str | dict | Skipped]]:
    """Consecutive text of one stream joined (a carriage return may act on text of an earlier chunk)."""
    out: list[tuple[str, str | dict | Skipped]] = []
    for stream, chunk in chunks:
        if out and stream not in ("display", SKIPPED) and out[-1][0] == stream:
            out[-1] = (stream, out[-1][1] + chunk)
        else:
            out.append((stream, chunk))
    return out


class RankOutput(StaticFallbackWidget):
    """The live view of a `RankLog`: areas per rank, appended to by small messages."""

    _esm = _ESM
    uid = traitlets.Unicode().tag(sync=True)
    initial = traitlets.List().tag(sync=True)
    """What was written before the widget existed (sent once, with the widget)."""
    grouped = traitlets.Bool(False).tag(sync=True)
    """Ranks with the same output share an area (a cell on more than `GROUP_ABOVE` ranks)."""

    def __init__(self, record: RankLog | None = None, initial: list[dict] | None = None) -> None:
        record = record if record is not None else RankLog()
        super().__init__(uid=uuid.uuid4().hex, initial=initial or [], grouped=record.grouped)
        self.record = record

    def append(self, items: list[dict]) -> None:
        self.send({"items": items})

    def static_html(self) -> str:
        return self.record.html()

    def static_text(self) -> str:
        return self.record.text()
