"""ValueMeshView and TensorView: one value per rank, as a table or with a rank selector."""

from __future__ import annotations

import traitlets

from monarch.widgets.base import StaticFallbackWidget
from monarch.widgets.style import esc, table, text_table

_TABLE_ESM = r"""
export default {
  render({ model, el }) {
    const t = document.createElement("table");
    t.className = "monarch-table monarch-value-mesh";
    t.createCaption().textContent = model.get("title");
    const hr = t.createTHead().insertRow();
    for (const c of ["coordinates", "value"]) { const th = document.createElement("th"); th.textContent = c; hr.appendChild(th); }
    const tb = t.createTBody();
    for (const [label, value] of model.get("rows")) {
      const tr = tb.insertRow(); tr.dataset.label = label;
      tr.insertCell().textContent = label;
      const pre = document.createElement("pre"); pre.textContent = value; pre.style.margin = "0";
      tr.insertCell().appendChild(pre);
    }
    el.replaceChildren(t);
  },
};
"""

_TENSOR_ESM = r"""
export default {
  render({ model, el }) {
    const root = document.createElement("div"); root.className = "monarch-tensor";
    const cap = document.createElement("div"); cap.textContent = model.get("title");
    const sel = document.createElement("select");
    model.get("labels").forEach((l, i) => { const o = document.createElement("option"); o.value = i; o.textContent = l; sel.appendChild(o); });
    const pre = document.createElement("pre");
    const show = () => { const i = model.get("selected"); sel.value = i; pre.textContent = model.get("values")[i]; pre.dataset.label = model.get("labels")[i]; };
    sel.onchange = () => { model.set("selected", Number(sel.value)); model.save_changes(); };
    model.on("change:selected", show);
    root.append(cap, sel, pre); el.replaceChildren(root); show();
    return () => model.off("change:selected", show);
  },
};
"""


def _text(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 4000 else text[:4000] + " …"


class ValueMeshView(StaticFallbackWidget):
    """A `ValueMesh` in a notebook: coordinates and value per rank."""

    _esm = _TABLE_ESM
    title = traitlets.Unicode().tag(sync=True)
    rows = traitlets.List().tag(sync=True)

    def __init__(self, values) -> None:
        rows = [[values.label(c), _text(v)] for c, v in values.items()]
        super().__init__(title=f"ValueMesh {values.describe()}", rows=rows)

    def static_html(self) -> str:
        cells = [[f"<td>{esc(k)}</td>", f'<td><pre style="margin:0">{esc(v)}</pre></td>'] for k, v in self.rows]
        return table(
            self.title,
            ["coordinates", "value"],
            cells,
            "monarch-value-mesh",
            [f'data-label="{esc(k)}"' for k, _ in self.rows],
        )

    def static_text(self) -> str:
        flat = [[k, v.replace("\n", " ")] for k, v in self.rows]
        return self.title + "\n" + text_table(["coordinates", "value"], flat)


class TensorView(StaticFallbackWidget):
    """Per-rank tensor values with a rank selector (used by `monarch.show`).

    Every rank's value is sent once; choosing a rank happens in the browser, so it works even
    while a cell is running.
    """

    _esm = _TENSOR_ESM
    title = traitlets.Unicode().tag(sync=True)
    labels = traitlets.List().tag(sync=True)
    values = traitlets.List().tag(sync=True)
    selected = traitlets.Int(0).tag(sync=True)

    def __init__(self, values, title: str | None = None, selected: int = 0) -> None:
        labels, texts = [], []
        for coords, v in values.items():
            labels.append(values.label(coords))
            texts.append(_text(v))
        super().__init__(
            title=title or f"tensor on {values.describe()}", labels=labels, values=texts, selected=selected
        )

    def static_html(self) -> str:
        parts = [f'<div class="monarch-tensor"><div>{esc(self.title)}</div>']
        for label, text in zip(self.labels, self.values):
            parts.append(f'<div data-label="{esc(label)}"><b>[{esc(label)}]</b><pre>{esc(text)}</pre></div>')
        return "".join(parts) + "</div>"

    def static_text(self) -> str:
        return "\n".join([self.title] + [f"[{k}]\n{v}" for k, v in zip(self.labels, self.values)])
