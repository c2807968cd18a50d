"""DebuggerView: which ranks are paused in pdb, and which one the prompt belongs to."""

from __future__ import annotations

import traitlets

from monarch.widgets.base import StaticFallbackWidget
from monarch.widgets.style import esc

_ESM = r"""
function draw(model, el) {
  const root = document.createElement("div"); root.className = "monarch-debugger";
  const active = model.get("active"), paused = model.get("paused");
  const head = document.createElement("div");
  head.textContent = active ? `pdb: rank ${active} has the prompt` : "pdb: no rank paused";
  const rest = document.createElement("div");
  rest.textContent = paused.length ? `waiting: ${paused.join(", ")}` : "";
  const where = document.createElement("pre"); where.textContent = model.get("where");
  root.append(head, rest, where); el.replaceChildren(root);
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
    """The active rank's prompt."""

    def static_html(self) -> str:
        head = f"pdb: rank {esc(self.active)} has the prompt" if self.active else "pdb: no rank paused"
        waiting = f"<div>waiting: {esc(', '.join(self.paused))}</div>" if self.paused else ""
        return f'<div class="monarch-debugger"><div>{head}</div>{waiting}<pre>{esc(self.where)}</pre></div>'

    def static_text(self) -> str:
        head = f"pdb: rank {self.active} has the prompt" if self.active else "pdb: no rank paused"
        return head + (f"; waiting: {', '.join(self.paused)}" if self.paused else "")
