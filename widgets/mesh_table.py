"""MeshTable: which worker is where, and what it is doing, updated live while its cell runs."""

from __future__ import annotations

import contextlib
import threading
import time
import weakref

import traitlets

from monarch.runtime.mesh import MeshTable
from monarch.widgets.base import StaticFallbackWidget
from monarch.widgets.style import esc, table, text_table

_ESM = r"""
const OPTIONAL = ["memory", "running", "for", "actors"], WRAP = ["running", "actors"];
function ranksTable(rows, columns, caption) {
  const cols = columns.filter((c) => !OPTIONAL.includes(c) || rows.some((r) => `${r[c] ?? ""}` !== ""));
  const t = document.createElement("table");
  t.className = "monarch-table monarch-mesh-table";
  if (caption !== null) { const cap = t.createCaption(); cap.textContent = caption; }
  const hr = t.createTHead().insertRow();
  for (const c of cols) { const th = document.createElement("th"); th.textContent = c; hr.appendChild(th); }
  const tb = t.createTBody();
  for (const row of rows) {
    const tr = tb.insertRow(); tr.dataset.rank = row.rank;
    for (const c of cols) {
      const td = tr.insertCell(); td.textContent = row[c];
      if (c === "status") td.className = `monarch-status monarch-status-${row[c]}`;
      else if (WRAP.includes(c)) td.className = "monarch-wrap";
    }
  }
  return t;
}
// Many ranks: a row per host, its ranks' rows under it on a click (which stays open across refreshes).
function hostsTable(model, open, redraw) {
  const rows = model.get("rows"), hosts = model.get("hosts"), cols = model.get("host_columns");
  const t = document.createElement("table");
  t.className = "monarch-table monarch-mesh-table monarch-hosts-table";
  const cap = t.createCaption(); cap.textContent = model.get("title");
  const hr = t.createTHead().insertRow();
  for (const c of ["", ...cols]) { const th = document.createElement("th"); th.textContent = c; hr.appendChild(th); }
  const tb = t.createTBody();
  for (const host of hosts) {
    const key = `${host[cols[0]]}`;
    const tr = tb.insertRow(); tr.dataset.host = key;
    const toggle = tr.insertCell();
    const b = document.createElement("button"); b.className = "monarch-host-toggle";
    b.textContent = open.has(key) ? "▾" : "▸"; b.title = `${host.workers} ranks`;
    b.onclick = () => { open.has(key) ? open.delete(key) : open.add(key); redraw(); };
    toggle.appendChild(b);
    for (const c of cols) {
      const td = tr.insertCell(); td.textContent = host[c];
      if (WRAP.includes(c) || c === "status") td.className = "monarch-wrap";
    }
    if (open.has(key)) {
      const inner = tb.insertRow(); inner.className = "monarch-host-ranks"; inner.dataset.host = key;
      const td = inner.insertCell(); td.colSpan = cols.length + 1;
      td.appendChild(ranksTable(host.members.map((i) => rows[i]), model.get("columns"), null));
    }
  }
  return t;
}
function draw(model, el, open, redraw) {
  if (model.get("hosts").length) { el.replaceChildren(hostsTable(model, open, redraw)); return; }
  el.replaceChildren(ranksTable(model.get("rows"), model.get("columns"), model.get("title")));
}
export default {
  render({ model, el }) {
    const open = new Set();
    const redraw = () => draw(model, el, open, redraw);
    redraw();
    model.on("change:rows change:title change:hosts", redraw);
    return () => model.off("change:rows change:title change:hosts", redraw);
  },
};
"""


OPTIONAL = ("memory", "running", "for", "actors")
"""Columns left out when empty in every row (idle ranks run nothing; a mesh without actors)."""
WRAP = ("running", "actors")
"""Columns whose text may wrap at spaces; the others keep each value on one line (``200 MiB``)."""


def _cell(col: str, value: object) -> str:
    if col == "status":
        return f'<td class="monarch-status monarch-status-{esc(value)}">{esc(value)}</td>'
    if col in WRAP:
        return f'<td class="monarch-wrap">{esc(value)}</td>'
    return f"<td>{esc(value)}</td>"


def table_html(title: str, columns: list[str], rows: list[dict]) -> str:
    columns = [c for c in columns if c not in OPTIONAL or any(str(row.get(c, "")) for row in rows)]
    cells = [[_cell(c, row[c]) for c in columns] for row in rows]
    attrs = [f'data-rank="{row["rank"]}"' for row in rows]
    return table(title, columns, cells, "monarch-mesh-table", attrs)


class MeshTableWidget(StaticFallbackWidget):
    """`mesh.to_table()` in a notebook: refreshed when workers become busy, idle or fail, until `freeze()`.

    In a notebook the table is live (its title says so) until the next cell starts: then the extension
    freezes it, and it keeps what was true then (its title says when), as any other output does. A table of
    a notebook's section 4 must not show section 7's work; one shown beside a `--noblock` run follows it
    while nothing else runs.

    When the mesh is stopped on purpose (`exit()`, `%mesh shutdown`), the table keeps the last state it
    showed and says in its title when the mesh stopped: a notebook run top to bottom that ends by
    stopping its meshes keeps tables that show what they showed, not a column of "stopped"."""

    _esm = _ESM
    title = traitlets.Unicode().tag(sync=True)
    columns = traitlets.List().tag(sync=True)
    rows = traitlets.List().tag(sync=True)
    hosts = traitlets.List().tag(sync=True)
    """On many ranks (`SUMMARY_ABOVE`), a row per host (`MeshTable.per_host`); empty otherwise."""
    host_columns = traitlets.List().tag(sync=True)

    def __init__(self, mesh) -> None:
        table = mesh.to_table()
        super().__init__(title=f"ProcMesh {table.title}{LIVE}", columns=table.columns, rows=_plain(table.rows))
        self._dims = table.dims
        self._by_host()
        self.observe(lambda _: self._by_host(), names="rows")
        self._mesh = mesh
        self._pending = False
        self._frozen = False
        self._lock = threading.Lock()
        self._last = _doing(table.rows)
        """What each rank was doing at the last change while the mesh ran (shown once it has stopped)."""
        self._follow(mesh)
        # A rank may have changed between the table above and following the mesh (its change then reached
        # no one), and a rank busy from the start must have its "for" column counting: look again.
        self.note_change()

    def _by_host(self) -> None:
        summary = MeshTable("", self._dims, self.rows).per_host
        self.host_columns, self.hosts = summary if summary is not None else ([], [])

    def _follow(self, mesh) -> None:
        ref = weakref.ref(self)
        stop = None

        def changed() -> None:
            w = ref()
            if w is None:
                stop()
            else:
                w.note_change()

        stop = mesh.on_change(changed)
        self._stop_following = stop

    def note_change(self) -> None:
        """A rank became busy or idle, or the mesh changed state (any thread): remember what each rank does
        now (a stop that follows within the refresh's delay must not leave an older state on show)."""
        if self._mesh.state == "running":
            with contextlib.suppress(Exception):
                self._last = _doing(self._mesh.to_table(with_memory=False).rows)
        self.schedule_refresh()

    def freeze(self) -> None:
        """Stop following the mesh, after one last look: from now on the table shows what was true now."""
        with self._lock:
            if self._frozen:
                return
            self._frozen = True
        self._stop_following()
        if self._said_stopped():
            return
        if self._mesh.state in ("stopping", "stopped"):
            self._show_stopped()
            return
        with contextlib.suppress(Exception):
            self.rows = _plain(self._mesh.to_table().rows)
        self.title = self.title.removesuffix(LIVE) + f" (as of {time.strftime('%H:%M:%S')})"

    def schedule_refresh(self, delay: float = 0.1) -> None:
        """Coalesce bursts of changes into at most ~10 updates a second."""
        with self._lock:
            if self._pending or self._frozen:
                return
            self._pending = True
        timer = threading.Timer(delay, self.refresh)
        timer.daemon = True
        timer.start()

    def refresh(self) -> None:
        with self._lock:
            self._pending = False
            if self._frozen:
                return
        if self._mesh.state in ("stopping", "stopped") and any(r["status"] != "stopped" for r in self.rows):
            if not self._said_stopped():
                self._stop_following()
                self._show_stopped()
            return
        self.rows = _plain(self._mesh.to_table().rows)
        if any(r["status"] == "busy" for r in self.rows):
            self.schedule_refresh(BUSY_TICK)  # the "for" column keeps counting while a rank is busy

    def _show_stopped(self) -> None:
        self.rows = [{**r, **self._last.get(r["rank"], {})} for r in self.rows]
        self.title = (
            self.title.removesuffix(LIVE) + f" (stopped at {time.strftime('%H:%M:%S')}; the rows show its last state)"
        )

    def _said_stopped(self) -> bool:
        return "(stopped at " in self.title

    def static_html(self) -> str:  # (saved with the notebook: not live there; by host on many ranks: it stays small)
        title = self.title.removesuffix(LIVE)
        if self.hosts:
            cells = [[_cell(c, h[c]) for c in self.host_columns] for h in self.hosts]
            caption = f"{title}: {len(self.rows)} ranks, by host"
            return table(caption, self.host_columns, cells, "monarch-mesh-table monarch-hosts-table")
        return table_html(title, self.columns, self.rows)

    def static_text(self) -> str:
        if self.hosts:
            return str(MeshTable(self.title.removesuffix(LIVE).removeprefix("ProcMesh "), self._dims, self.rows))
        return (
            self.title.removesuffix(LIVE)
            + "\n"
            + text_table(self.columns, [[str(r[c]) for c in self.columns] for r in self.rows])
        )


LIVE = " (live)"
"""The title's end while the table follows the mesh."""
BUSY_TICK = 1.0
"""Seconds between refreshes while a rank is busy (its "for" column counts)."""


def _doing(rows: list[dict]) -> dict[int, dict]:
    return {r["rank"]: {"status": r["status"], "running": r["running"], "for": r["for"]} for r in rows}


def _plain(rows: list[dict]) -> list[dict]:
    return [{k: v if isinstance(v, int | str) else str(v) for k, v in row.items()} for row in rows]
