"""DebuggerView: which ranks are paused in pdb, and which one the prompt belongs to."""

from __future__ import annotations

import traitlets

from monarch.widgets.base import StaticFallbackWidget
from monarch.widgets.style import esc

_ESM = r"""
function draw(model, el) {
  const root = document.createElement("div"); root.className = "monarch-debugger";
  const active = model.get("active"), paused = model.get("paused");
  const head = document.createElement("div"), where = model.get("where");
  head.textContent = active ? `pdb: rank ${active} has the prompt${where ? `, paused at ${where}` : ""}` : "pdb: no rank paused";
  const rest = document.createElement("div");
  rest.textContent = paused.length ? `waiting: ${paused.join(", ")}` : "";
  root.append(head, rest); el.replaceChildren(root);
}
export default {
  render({ model, el }) {
    draw(model, el);
    const on = () => draw(model, el);
    model.on("change", on);
    return () => model.off("change", on);
  },
};
"""


class DebuggerView(StaticFallbackWidget):
    """Shown while workers are paused at a breakpoint; the prompt itself is the notebook's stdin."""

    _esm = _ESM
    active = traitlets.Unicode("").tag(sync=True)
    """Label of the rank whose prompt is shown, e.g. ``gpu=1``."""
    paused = traitlets.List().tag(sync=True)
    """Labels of other ranks waiting at a prompt."""
    where = traitlets.Unicode("").tag(sync=True)
    """Where the active rank is paused, e.g. ``Cell In[5], line 4`` (its prompt is the notebook's stdin)."""

    def _head(self) -> str:
        if not self.active:
            return "pdb: no rank paused"
        return f"pdb: rank {self.active} has the prompt" + (f", paused at {self.where}" if self.where else "")

    def static_html(self) -> str:
        waiting = f"<div>waiting: {esc(', '.join(self.paused))}</div>" if self.paused else ""
        return f'<div class="monarch-debugger"><div>{esc(self._head())}</div>{waiting}</div>'

    def static_text(self) -> str:
        return self._head() + (f"; waiting: {', '.join(self.paused)}" if self.paused else "")
