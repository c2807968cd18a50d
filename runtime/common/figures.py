"""Matplotlib figures drawn in the notebook's theme: an inline SVG whose black is the text colour around it
(`currentColor`) and whose white is the page's background (JupyterLab's `--jp-layout-color0`), so a figure
reads in the dark theme as in the light one, and follows a change of theme. A PNG cannot: it is a white box
with black text in the dark theme.

Used by the workers (a figure a cell shows goes to the rank's area in this form as well as a PNG) and by
notebooks that draw on the controller (`figure_html`)."""

from __future__ import annotations

import io
import re
from typing import Any

MIME = "application/vnd.monarch.figure+svg"
"""The mime type a worker's figure travels under in this form: only monarch's rank areas draw it (inline, in
the page, where `currentColor` means something); JupyterLab draws an SVG as an image, and takes the PNG."""
MAX_BYTES = 400_000
"""A figure whose SVG is larger (a scatter of many points) goes as a PNG only."""

_DROP = re.compile(r"<\?xml[^>]*\?>|<!DOCTYPE[^>]*>|<metadata>.*?</metadata>|<style[^>]*>.*?</style>", re.S)


def themed_svg(fig: Any, max_bytes: int | None = MAX_BYTES) -> str | None:
    """`fig` (a matplotlib Figure) as inline SVG in the page's colours; None if it is larger than `max_bytes`."""
    import matplotlib

    buf = io.StringIO()
    with matplotlib.rc_context({"svg.fonttype": "none"}):  # text as text: smaller, and selectable
        fig.savefig(buf, format="svg", bbox_inches="tight")
    svg = buf.getvalue()
    if max_bytes is not None and len(svg) > max_bytes:
        return None
    # (its <style> holds a rule for `*`: inline, that would style the whole page; its two properties go on
    # the root instead, where they are inherited)
    svg = re.sub(r"\s*\n\s*", " ", _DROP.sub("", svg).strip())  # (one line: an output's HTML, not a file)
    svg = re.sub(r"#000000\b", "currentColor", svg)
    svg = re.sub(r"#ffffff\b", "var(--jp-layout-color0, #ffffff)", svg)
    root = 'fill="currentColor" stroke-linejoin="round" stroke-linecap="butt" class="monarch-figure"'
    return svg.replace("<svg ", f"<svg {root} ", 1)


def figure_html(fig: Any) -> Any:
    """`fig` as a displayable object drawn in the notebook's theme (`display(figure_html(fig))`)."""
    from IPython.display import HTML

    return HTML(themed_svg(fig, max_bytes=None))
