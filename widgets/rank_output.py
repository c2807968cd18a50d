"""Per-rank output of a `%%mesh` cell: one area per rank that grows as the workers write.

Live, only the new text travels (one small comm message per batch); the whole text is sent once,
as static HTML, when the cell ends.
"""

from __future__ import annotations

import uuid

import traitlets

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
function bundle(d) {
  for (const [mime, kind] of [["image/png", "png"], ["image/jpeg", "jpeg"]]) {
    if (d[mime]) { const i = document.createElement("img"); i.src = `data:image/${kind};base64,${d[mime]}`; return i; }
  }
  if (d["image/svg+xml"] || d["text/html"]) {
    const x = document.createElement("div"); x.innerHTML = d["image/svg+xml"] || d["text/html"]; return x;
  }
  const p = document.createElement("pre"); p.textContent = d["text/markdown"] || d["text/plain"] || ""; return p;
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
    const body = (it) => {
      let a = areas.get(it.r);
      if (!a) {
        a = document.createElement("div"); a.className = "monarch-rank"; a.dataset.label = it.l;
        const h = document.createElement("div"); h.className = "monarch-rank-label"; h.textContent = `[${it.l}]`;
        const b = document.createElement("div"); b.className = "monarch-rank-body";
        a.append(h, b);
        let next = null;
        for (const [r, x] of areas) if (r > it.r && (next === null || r < next[0])) next = [r, x];
        root.insertBefore(a, next ? next[1] : null);
        areas.set(it.r, a);
      }
      return a.lastChild;
    };
    const add = (items) => {
      for (const it of items) {
        const b = body(it);
        if (it.s === "display") { b.appendChild(bundle(it.d)); continue; }
        let p = b.lastChild;
        if (!p || p.dataset.stream !== it.s) {
          p = document.createElement("pre"); p.className = `monarch-${it.s}`; p.dataset.stream = it.s; b.appendChild(p);
        }
        p.textContent += it.t;
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
        self.ranks: dict[int, tuple[str, list[dict]]] = {}

    def add(self, rank: int, label: str, stream: str, text: str = "", data: dict | None = None) -> dict:
        """Record one chunk; returns it in the form the live view takes."""
        item = {"r": rank, "l": label, "s": stream}
        if stream == "display":
            item["d"] = data or {}
        else:
            item["t"] = text
        self.ranks.setdefault(rank, (label, []))[1].append(item)
        return item

    def __bool__(self) -> bool:
        return bool(self.ranks)

    def html(self) -> str:
        out = ['<div class="monarch-ranks">']
        for rank in sorted(self.ranks):
            label, items = self.ranks[rank]
            out.append(f'<div class="monarch-rank" data-label="{esc(label)}">')
            out.append(f'<div class="monarch-rank-label">[{esc(label)}]</div><div class="monarch-rank-body">')
            stream, text = None, []
            for it in [*items, {"s": None}]:
                if it["s"] != stream and text:
                    out.append(f'<pre class="monarch-{stream}" data-stream="{stream}">{esc("".join(text))}</pre>')
                    text = []
                stream = it["s"]
                if stream == "display":
                    out.append(_bundle_html(it["d"]))
                    stream = None
                elif stream is not None:
                    text.append(it["t"])
            out.append("</div></div>")
        out.append("</div>")
        return "".join(out)

    def text(self) -> str:
        lines = []
        for rank in sorted(self.ranks):
            label, items = self.ranks[rank]
            chunks = [it["t"] if it["s"] != "display" else it["d"].get("text/plain", "") + "\n" for it in items]
            lines += [f"[{label}] {line}" for line in "".join(chunks).splitlines()]
        return "\n".join(lines)

    def bundle(self) -> dict:
        """The static outputs: `text/html` and `text/plain`."""
        return {"text/plain": self.text(), "text/html": page(self.html())}


def _bundle_html(d: dict) -> str:
    for mime, kind in (("image/png", "png"), ("image/jpeg", "jpeg")):
        if mime in d:
            return f'<img src="data:image/{kind};base64,{d[mime]}"/>'
    if "image/svg+xml" in d:
        return f"<div>{d['image/svg+xml']}</div>"
    if "text/html" in d:
        return f"<div>{d['text/html']}</div>"
    return f"<pre>{esc(d.get('text/markdown') or d.get('text/plain', ''))}</pre>"


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
