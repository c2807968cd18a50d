"""Training progress in a notebook: a progress bar and the loss curve, redrawn in place as steps finish.

    live = TrainingProgress(total=100, title="llama, 4 ranks")
    for step, loss in ...:
        live.add(step, loss)
    live.done("trained 100 steps")

Plain HTML and SVG in one display that is updated (no widget state): it is saved with the notebook and
shows without a kernel. Outside a notebook it prints a line per `every` steps instead.
"""

from __future__ import annotations

import html
import sys
import time

from monarch.runtime.common.figures import figure_html

__all__ = ["TrainingProgress", "figure_html"]  # figure_html: a matplotlib figure drawn in the notebook's theme


class TrainingProgress:
    """A bar (steps done of `total`) and the loss per step, drawn as a polyline."""

    def __init__(self, total: int, title: str = "training", every: int = 10, width: int = 480, height: int = 160):
        self.total, self.title, self.every = total, title, every
        self.width, self.height = width, height
        self.points: list[tuple[int, float]] = []
        self.note = ""
        self.t0 = time.perf_counter()
        self._handle = None
        ip = sys.modules.get("IPython")
        shell = ip.get_ipython() if ip is not None else None
        if shell is not None and getattr(shell, "kernel", None) is not None:
            from IPython.display import HTML, display

            self._handle = display(HTML(self._html()), display_id=True)

    def add(self, step: int, loss: float) -> None:
        """Step `step` finished with `loss`."""
        self.points.append((step, loss))
        self._redraw(len(self.points) % self.every == 0 or len(self.points) >= self.total)

    def done(self, note: str = "") -> None:
        """The end: the last figures, and `note` under the curve."""
        self.note = note
        self._redraw(True)

    def _redraw(self, print_too: bool) -> None:
        if self._handle is not None:
            from IPython.display import HTML

            self._handle.update(HTML(self._html()))
        elif print_too and self.points:
            step, loss = self.points[-1]
            print(f"{self.title}: step {step} loss {loss:.4f} ({len(self.points)}/{self.total})", flush=True)

    def _html(self) -> str:
        n = len(self.points)
        secs = time.perf_counter() - self.t0
        last = f", loss {self.points[-1][1]:.4f}" if self.points else ""
        head = html.escape(f"{self.title}: {n}/{self.total} steps in {secs:.1f} s{last}")
        bar = f'<progress value="{n}" max="{max(self.total, 1)}" style="width:{self.width}px"></progress>'
        note = f"<div>{html.escape(self.note)}</div>" if self.note else ""
        return f'<div class="training-progress"><div>{head}</div>{bar}{self._svg()}{note}</div>'

    def _svg(self) -> str:
        w, h, pad = self.width, self.height, 36
        if len(self.points) < 2:
            return f'<svg width="{w}" height="{h}" viewBox="0 0 {w} {h}"></svg>'
        steps = [s for s, _ in self.points]
        losses = [v for _, v in self.points]
        s0, s1 = min(steps), max(max(steps), min(steps) + 1)
        lo, hi = min(losses), max(losses)
        hi = hi if hi > lo else lo + 1e-6

        def xy(s: int, v: float) -> str:
            x = pad + (w - pad - 8) * (s - s0) / (s1 - s0)
            y = 8 + (h - 8 - 20) * (hi - v) / (hi - lo)
            return f"{x:.1f},{y:.1f}"

        line = " ".join(xy(s, v) for s, v in self.points)
        axis = "font-size:10px;fill:currentColor"
        return (
            f'<svg width="{w}" height="{h}" viewBox="0 0 {w} {h}" role="img" aria-label="loss per step">'
            f'<polyline points="{line}" fill="none" stroke="#1f77b4" stroke-width="1.5"/>'
            f'<text x="2" y="14" style="{axis}">{hi:.2f}</text>'
            f'<text x="2" y="{h - 20}" style="{axis}">{lo:.2f}</text>'
            f'<text x="{pad}" y="{h - 4}" style="{axis}">step {s0}</text>'
            f'<text x="{w - 8}" y="{h - 4}" text-anchor="end" style="{axis}">step {s1}</text>'
            "</svg>"
        )
