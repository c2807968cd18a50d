"""Per-rank output of a `%%mesh` cell: one area per rank that grows as the workers write.

Live, only the new text travels (one small comm message per batch); the whole text is sent once,
as static HTML, when the cell ends.
"""

from __future__ import annotations

import uuid

import traitlets

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
    const areas = new Map();
    const area = (it) => {
      let a = areas.get(it.r);
      if (!a) {
        const div = document.createElement("div"); div.className = "monarch-rank"; div.dataset.label = it.l;
        const h = document.createElement("div"); h.className = "monarch-rank-label"; h.textContent = `[${it.l}]`;
        const body = document.createElement("div"); body.className = "monarch-rank-body";
        div.append(h, body);
        let next = null;
        for (const [r, x] of areas) if (r > it.r && (next === null || r < next[0])) next = [r, x.div];
        root.insertBefore(div, next ? next[1] : null);
        a = { div, body, last: null };
        areas.set(it.r, a);
      }
      return a;
    };
    const add = (items) => {
      for (const it of items) {
        const a = area(it);
        if (it.s === "display") {
          const t = document.createElement("template"); t.innerHTML = it.h;
          a.body.append(...t.content.childNodes); a.last = null;
          continue;
        }
        if (!a.last || a.last.stream !== it.s) { a.last = block(it.s); a.body.appendChild(a.last.div); }
        write(a.last, it.t);
      }
    };
    add(st.log);
    st.views.add(add);
    return () => st.views.delete(add);
  },
};
"""


class RankLog:
    """Everything the ranks of one cell wrote, in order per rank: text and rich displays."""

    def __init__(self) -> None:
        self.ranks: dict[int, tuple[str, list[tuple[str, str | dict]]]] = {}
        """Rank -> (its label, its chunks in order: ``(stream, text)`` or ``("display", mime bundle)``)."""

    def add(self, rank: int, label: str, stream: str, text: str = "", data: dict | None = None) -> dict:
        """Record one chunk; returns it in the form the live view takes (a display as HTML). An ``"error"``
        (a failed rank's traceback while others went on) is shown live as stderr and left out of the static
        view, where the cell's error shows it."""
        if stream == "error":
            return {"r": rank, "l": label, "s": "stderr", "t": text}
        chunk = (data or {}) if stream == "display" else text
        self.ranks.setdefault(rank, (label, []))[1].append((stream, chunk))
        if stream == "display":
            return {"r": rank, "l": label, "s": stream, "h": render.bundle_html(chunk, render.MATHML)}
        return {"r": rank, "l": label, "s": stream, "t": text}

    def __bool__(self) -> bool:
        return bool(self.ranks)

    def html(self) -> str:
        """The static view: math as TeX, typeset by the MathJax of JupyterLab or nbconvert."""
        out = ['<div class="monarch-ranks">']
        for rank in sorted(self.ranks):
            label, chunks = self.ranks[rank]
            out.append(f'<div class="monarch-rank" data-label="{esc(label)}">')
            out.append(f'<div class="monarch-rank-label">[{esc(label)}]</div><div class="monarch-rank-body">')
            for stream, run in _runs(chunks):
                if stream == "display":
                    out.append(render.bundle_html(run, render.TEX))
                else:
                    out.append(render.stream_html(stream, run))
            out.append("</div></div>")
        out.append("</div>")
        return "".join(out)

    def text(self) -> str:
        lines = []
        for rank in sorted(self.ranks):
            label, chunks = self.ranks[rank]
            parts = [
                str(run.get("text/plain", "")) + "\n" if stream == "display" else render.plain(run)
                for stream, run in _runs(chunks)
            ]
            lines += [f"[{label}] {line}" for line in "".join(parts).splitlines()]
        return "\n".join(lines)

    def bundle(self) -> dict:
        """The static outputs: `text/html` and `text/plain`."""
        return {"text/plain": self.text(), "text/html": page(self.html())}


def _runs(chunks: list[tuple[str, str | dict]]) -> list[tuple[str, str | dict]]:
    """Consecutive text of one stream joined (a carriage return may act on text of an earlier chunk)."""
    out: list[tuple[str, str | dict]] = []
    for stream, chunk in chunks:
        if out and stream != "display" and out[-1][0] == stream:
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

    def __init__(self, record: RankLog | None = None, initial: list[dict] | None = None) -> None:
        super().__init__(uid=uuid.uuid4().hex, initial=initial or [])
        self.record = record if record is not None else RankLog()

    def append(self, items: list[dict]) -> None:
        self.send({"items": items})

    def static_html(self) -> str:
        return self.record.html()

    def static_text(self) -> str:
        return self.record.text()
