"""Static HTML for monarch's views: what nbconvert, GitHub and untrusted notebooks show.

The widgets render the same structure and class names, so a view looks the same live and saved.
"""

from __future__ import annotations

import html

_ANSI = {  # JupyterLab's terminal colours (rendermime's base.css), for pages without its stylesheet
    "black": "#3e424d", "red": "#e75c58", "green": "#00a250", "yellow": "#ddb62b", "blue": "#208ffb",
    "magenta": "#d160c4", "cyan": "#60c6c8", "white": "#c5c1b4",
}  # fmt: skip
_ANSI_INTENSE = {
    "black": "#282c36", "red": "#b22b31", "green": "#007427", "yellow": "#b27d12", "blue": "#0065ca",
    "magenta": "#a03196", "cyan": "#258f8f", "white": "#a1a6b2",
}  # fmt: skip

# Colours come from JupyterLab's theme variables (light or dark), with light fallbacks for pages that
# have none (nbconvert's classic template, GitHub).
CSS = (
    """
.monarch-ranks{display:flex;flex-direction:column;gap:4px;font-family:var(--jp-code-font-family,monospace);font-size:var(--jp-code-font-size,13px);color:var(--jp-content-font-color1,inherit)}
.monarch-rank{display:flex;gap:8px;border-left:3px solid var(--jp-brand-color2,#8a6fd1);padding-left:6px}
.monarch-rank-label{color:var(--jp-brand-color1,#6a4fb1);white-space:nowrap;min-width:6em;font-weight:600}
.monarch-rank-scroll{flex:1;min-width:0;max-height:24em;overflow-y:auto;display:flex;flex-direction:column-reverse}
.monarch-rank-scroll.monarch-all{max-height:none}
.monarch-rank-body{min-width:0}
.monarch-rank-members{font-weight:normal;font-size:11px;color:var(--jp-content-font-color2,#666)}.monarch-rank-members summary{cursor:pointer}.monarch-rank-members[open]{max-height:16em;overflow-y:auto}
.monarch-rank-more{display:block;margin-top:2px;font:inherit;font-size:11px;font-weight:normal;cursor:pointer;color:var(--jp-content-font-color2,#666);background:none;border:1px solid var(--jp-border-color2,#ccc);border-radius:2px;padding:0 4px}
.monarch-ranks .monarch-rank-body pre{margin:0;white-space:pre-wrap;word-break:break-word;background:transparent;padding:0;color:inherit}
.monarch-rank-body .jp-RenderedText{padding:0}
.monarch-rank-body .monarch-stderr{background:var(--jp-rendermime-error-background,#fdd)}
.monarch-rank-body .monarch-display{padding:2px 0}
.monarch-rank-body .monarch-skipped{color:var(--jp-content-font-color2,#777);font-style:italic}
.monarch-ranks .ansi-bold{font-weight:bold}.monarch-ranks .ansi-underline{text-decoration:underline}
.monarch-table{border-collapse:collapse;font-size:12px;color:var(--jp-content-font-color1,inherit)}
.monarch-table th,.monarch-table td{padding:2px 8px;text-align:left;border-bottom:1px solid var(--jp-border-color2,#ddd);font-family:var(--jp-code-font-family,monospace)}
.monarch-table caption{text-align:left;font-weight:600;padding:2px 0}
.monarch-mesh-table td{white-space:nowrap}.monarch-mesh-table td.monarch-wrap{white-space:normal;min-width:10em}
.monarch-host-toggle{font:inherit;cursor:pointer;background:none;border:none;padding:0 2px;color:inherit}.monarch-host-ranks>td{padding-left:16px}
.monarch-status-idle{color:var(--jp-success-color1,#2a7d2a)}.monarch-status-busy{color:var(--jp-warn-color1,#b36b00)}
.monarch-status-failed{color:var(--jp-error-color1,#c00);font-weight:600}.monarch-status-stopped{color:var(--jp-ui-font-color2,#888)}
.monarch-tensor select{margin:2px 0 4px 0}
.monarch-tensor pre{margin:0}
.monarch-debugger{border:1px solid var(--jp-border-color1,#c9b8ef);padding:4px 8px;font-family:var(--jp-code-font-family,monospace)}
.monarch-progress{font-family:var(--jp-code-font-family,monospace);color:var(--jp-ui-font-color2,#666)}
"""
    + "".join(
        f".monarch-ranks .ansi-{n}-fg{{color:{c}}}.monarch-ranks .ansi-{n}-bg{{background-color:{c}}}"
        for n, c in _ANSI.items()
    )
    + "".join(
        f".monarch-ranks .ansi-{n}-intense-fg{{color:{c}}}.monarch-ranks .ansi-{n}-intense-bg{{background-color:{c}}}"
        for n, c in _ANSI_INTENSE.items()
    )
).strip()


def esc(text: object) -> str:
    return html.escape(str(text), quote=True)


def page(body: str) -> str:
    """`body` with the stylesheet, for a static `text/html` output."""
    return f"<style>{CSS}</style>{body}"


def table(caption: str, columns: list[str], rows: list[list[str]], cls: str, row_attrs: list[str] | None = None) -> str:
    """An HTML table; `row_attrs[i]` is added to row i's ``<tr>``."""
    head = "".join(f"<th>{esc(c)}</th>" for c in columns)
    body = []
    for i, row in enumerate(rows):
        attrs = f" {row_attrs[i]}" if row_attrs else ""
        body.append(f"<tr{attrs}>" + "".join(row) + "</tr>")
    return (
        f'<table class="monarch-table {cls}"><caption>{esc(caption)}</caption>'
        f"<thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"
    )


def text_table(columns: list[str], rows: list[list[str]]) -> str:
    """A plain-text table with aligned columns."""
    widths = [max(len(c), *(len(r[i]) for r in rows)) if rows else len(c) for i, c in enumerate(columns)]
    line = lambda vals: "  ".join(v.ljust(w) for v, w in zip(vals, widths)).rstrip()  # noqa: E731
    return "\n".join([line(columns), line(["-" * w for w in widths]), *map(line, rows)])
