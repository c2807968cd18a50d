"""Worker output as Jupyter renders it, for monarch's per-rank areas: terminal text (carriage returns,
ANSI colours) and rich displays (HTML, images, Markdown, LaTeX, JSON, PDF).

Runs in the kernel. The live view gets each display as HTML from here (math as MathML, which browsers
draw natively) and draws stream text by the same rules in its own script (`rank_output.py`); the static
view saved with the notebook is built here entirely, its math left as TeX between `$` signs for the
MathJax of JupyterLab and nbconvert. Class names are JupyterLab's own (`jp-RenderedText`, `ansi-red-fg`,
`jp-RenderedHTMLCommon`), so the theme in use styles the areas as it styles a cell's outputs.
"""

from __future__ import annotations

import html
import json
import re

from monarch.runtime.common.figures import MIME as FIGURE

MATHML, TEX = "mathml", "tex"
"""How a formula is drawn: MathML (live view) or TeX for MathJax (static view)."""


# -- terminal text ---------------------------------------------------------------------------------------
def overlay_cr(line: str) -> str:
    """One line as a terminal shows it: a carriage return moves back to its start, and what follows
    writes over what was there (progress bars such as tqdm's redraw one line this way)."""
    if "\r" not in line:
        return line
    parts = line.split("\r")
    shown = parts[0]
    for part in parts[1:]:
        shown = part + shown[len(part) :]
    return shown


def collapse_cr(text: str) -> str:
    """`text` with every line as a terminal shows it (see `overlay_cr`)."""
    text = text.replace("\r\n", "\n")
    if "\r" not in text:
        return text
    return "\n".join(overlay_cr(line) for line in text.split("\n"))


_SGR = re.compile(r"\x1b\[([0-9;]*)m")
_OTHER_ESCAPES = re.compile(r"\x1b\[[0-9;?]*[A-Za-ln-z]|\x1b\][^\x07]*\x07")
"""Escapes other than colours (cursor moves, titles): dropped, as JupyterLab drops them."""
COLOURS = ["black", "red", "green", "yellow", "blue", "magenta", "cyan", "white"]


class AnsiState:
    """SGR attributes in force (they carry over from one chunk of output to the next)."""

    def __init__(self) -> None:
        self.fg: str | None = None
        self.bg: str | None = None
        self.bold = False
        self.underline = False

    def apply(self, codes: str) -> None:
        for n in [int(c) for c in codes.split(";") if c.isdigit()] or [0]:
            if n == 0:
                self.__init__()
            elif n == 1:
                self.bold = True
            elif n == 4:
                self.underline = True
            elif n in (21, 22):
                self.bold = False
            elif n == 24:
                self.underline = False
            elif 30 <= n <= 37:
                self.fg = COLOURS[n - 30]
            elif 90 <= n <= 97:
                self.fg = COLOURS[n - 90] + "-intense"
            elif n == 39:
                self.fg = None
            elif 40 <= n <= 47:
                self.bg = COLOURS[n - 40]
            elif 100 <= n <= 107:
                self.bg = COLOURS[n - 100] + "-intense"
            elif n == 49:
                self.bg = None

    def scan(self, text: str) -> int:
        """Apply the colour escapes of `text`, in order (the state in force where it ends); returns the
        characters they take."""
        taken = 0
        for m in _SGR.finditer(text):
            self.apply(m.group(1))
            taken += m.end() - m.start()
        return taken

    def sgr(self) -> str:
        """The escape that takes a fresh state to this one ("" when nothing is set)."""
        codes = ["1"] * self.bold + ["4"] * self.underline
        for colour, base in ((self.fg, 30), (self.bg, 40)):
            if colour:
                name, intense = colour.removesuffix("-intense"), colour.endswith("-intense")
                codes.append(str(base + 60 * intense + COLOURS.index(name)))
        return f"\x1b[{';'.join(codes)}m" if codes else ""

    def classes(self) -> str:
        out = []
        if self.fg:
            out.append(f"ansi-{self.fg}-fg")
        if self.bg:
            out.append(f"ansi-{self.bg}-bg")
        if self.bold:
            out.append("ansi-bold")
        if self.underline:
            out.append("ansi-underline")
        return " ".join(out)


def ansi_html(text: str, state: AnsiState | None = None) -> str:
    """Escaped HTML for `text` (no carriage returns), its ANSI colours as spans of JupyterLab's `ansi-*`
    classes; `state` carries the colours in force from one piece of text to the next."""
    state = state or AnsiState()
    text = _OTHER_ESCAPES.sub("", text)
    out, pos = [], 0
    for m in _SGR.finditer(text):
        out.append(_span(text[pos : m.start()], state.classes()))
        state.apply(m.group(1))
        pos = m.end()
    out.append(_span(text[pos:], state.classes()))
    return "".join(out)


def _span(text: str, cls: str) -> str:
    if not text:
        return ""
    return f'<span class="{cls}">{html.escape(text)}</span>' if cls else html.escape(text)


_CR_OR_SGR = re.compile(r"(\r|\x1b\[[0-9;]*m)")


def line_html(line: str, state: AnsiState) -> str:
    """One line (no newline) as a terminal shows it: after a carriage return, characters write over those
    from the line's start, each keeping the colours it was written with."""
    if "\r" not in line:
        return ansi_html(line, state)
    cells: list[tuple[str, str]] = []
    col = 0
    for part in _CR_OR_SGR.split(_OTHER_ESCAPES.sub("", line)):
        if part == "\r":
            col = 0
        elif part.startswith("\x1b["):
            state.apply(part[2:-1])
        elif part:
            cls = state.classes()
            for ch in part:
                if col < len(cells):
                    cells[col] = (ch, cls)
                else:
                    cells.append((ch, cls))
                col += 1
    out, run, cls = [], [], None
    for ch, c in cells:
        if c != cls and run:
            out.append(_span("".join(run), cls))
            run = []
        run.append(ch)
        cls = c
    if run:
        out.append(_span("".join(run), cls))
    return "".join(out)


def terminal_html(text: str) -> str:
    """`text` as a terminal shows it (carriage returns, colours), as HTML."""
    state = AnsiState()
    return "\n".join(line_html(line, state) for line in text.replace("\r\n", "\n").split("\n"))


def plain(text: str) -> str:
    """`text` as a terminal shows it, without colours (for `text/plain`)."""
    return collapse_cr(_OTHER_ESCAPES.sub("", _SGR.sub("", text)))


def stream_html(stream: str, text: str) -> str:
    """A run of one stream's text, as JupyterLab draws a stream output."""
    return _text_html(f"monarch-{stream}", f"application/vnd.jupyter.{stream}", text, f' data-stream="{stream}"')


def _text_html(cls: str, mime: str, text: str, attrs: str = "") -> str:
    return f'<div class="jp-RenderedText {cls}" data-mime-type="{mime}"{attrs}><pre>{terminal_html(text)}</pre></div>'


# -- rich displays ---------------------------------------------------------------------------------------
# code (kept as is) | $$display$$ | \[display\] | \(inline\) | $inline$
_MATH = re.compile(
    r"(?P<code>```.*?```|`[^`\n]*`)"
    r"|\$\$(?P<d1>.+?)\$\$|\\\[(?P<d2>.+?)\\\]|\\\((?P<i1>.+?)\\\)"
    r"|(?<![\\$])\$(?![\s$])(?P<i2>[^$\n]+?)(?<![\s\\])\$",
    re.S,
)


def math_html(tex: str, display: bool, math: str) -> str:
    """One formula: MathML (`math=MATHML`), or TeX between `$` signs for MathJax (`math=TEX`)."""
    if math == TEX:
        return html.escape(f"$${tex}$$" if display else f"${tex}$")
    try:
        from latex2mathml.converter import convert

        return convert(tex, display="block" if display else "inline")
    except Exception:  # TeX it does not know: show it as written
        return f"<code>{html.escape(tex)}</code>"


def _with_math(source: str, math: str, render) -> str:
    """`render(source)` with the formulas of `source` typeset (kept out of `render`'s way meanwhile)."""
    formulas: list[str] = []

    def keep(m: re.Match) -> str:
        if m.group("code"):
            return m.group("code")
        display = m.group("d1") or m.group("d2")
        tex = display or m.group("i1") or m.group("i2")
        formulas.append(math_html(tex.strip(), display is not None, math))
        return f"MONARCHMATH{len(formulas) - 1}X"

    rendered = render(_MATH.sub(keep, source))
    return re.sub(r"MONARCHMATH(\d+)X", lambda m: formulas[int(m.group(1))], rendered)


def markdown_html(source: str, math: str = MATHML) -> str:
    """Markdown as Jupyter renders it (CommonMark, tables, strikethrough, inline HTML), math typeset."""
    from markdown_it import MarkdownIt

    md = MarkdownIt("commonmark", {"html": True}).enable(["table", "strikethrough"])
    return _with_math(source, math, md.render)


def latex_html(source: str, math: str = MATHML) -> str:
    """A `text/latex` display (IPython's `Math` and `Latex`): its formulas typeset, the rest as text."""
    return _with_math(source.strip(), math, lambda s: html.escape(s).replace("\n", "<br>"))


_IMAGES = ("image/png", "image/jpeg", "image/gif", "image/webp", "image/bmp")


def bundle_html(data: dict, math: str = MATHML) -> str:
    """The richest form of a display that can be shown, as HTML, chosen in JupyterLab's order (a worker's
    matplotlib figure first in its themed form: `runtime/common/figures.py`)."""
    if FIGURE in data:
        body = data[FIGURE]
    elif "text/html" in data:
        body = data["text/html"]
    elif "image/svg+xml" in data:
        body = data["image/svg+xml"]
    elif image := next((m for m in _IMAGES if m in data), None):
        body = f'<img src="data:{image};base64,{data[image]}"/>'
    elif "application/pdf" in data:
        body = f'<embed type="application/pdf" src="data:application/pdf;base64,{data["application/pdf"]}"/>'
    elif "text/markdown" in data:
        body = markdown_html(data["text/markdown"], math)
    elif "text/latex" in data:
        body = latex_html(data["text/latex"], math)
    elif "application/json" in data:
        body = f"<pre>{html.escape(json.dumps(data['application/json'], indent=2))}</pre>"
    else:
        return _text_html("monarch-plain", "text/plain", str(data.get("text/plain", "")))
    return f'<div class="jp-RenderedHTMLCommon monarch-display">{body}</div>'
