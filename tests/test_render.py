"""Worker output drawn as Jupyter draws it: carriage returns, ANSI colours, Markdown, LaTeX, other mime types.

The live view's script follows the same rules; the browser test checks it in a real JupyterLab."""

from monarch.widgets import RankLog, render


def test_a_progress_bar_redrawn_with_carriage_returns_leaves_one_line():
    bar = "".join(f"\r{p:3d}%|{'#' * (p // 10):<10}|" for p in range(0, 101, 10)) + "\n"
    log = RankLog()
    for i in range(0, len(bar), 7):  # in chunks, as it arrives
        log.add(0, "gpu=0", "stderr", bar[i : i + 7])
    assert log.text() == "[gpu=0] 100%|##########|"
    assert "100%|##########|\n</pre>" in log.html() and " 90%" not in log.html()


def test_carriage_return_writes_over_the_line_as_a_terminal_does():
    assert render.collapse_cr("abcdef\rxy\nnext\r\n") == "xycdef\nnext\n"
    assert render.plain("\x1b[31mred\x1b[0m 10%\r100%") == "100%10%"  # colours take no columns


def test_ansi_colours_become_jupyterlab_classes_and_carry_over_lines():
    html = render.terminal_html("\x1b[31mred\nstill red\x1b[0m plain \x1b[1;92mbold green\x1b[2K")
    assert html == (
        '<span class="ansi-red-fg">red</span>\n<span class="ansi-red-fg">still red</span> plain '
        '<span class="ansi-green-intense-fg ansi-bold">bold green</span>'
    )
    assert render.terminal_html("<b>&") == "&lt;b&gt;&amp;"


def test_markdown_and_latex_live_as_mathml_and_saved_as_tex_for_mathjax():
    md = {"text/markdown": "**rank 1** draws $y = x^{2}$ and `cost $5`", "text/plain": "<Markdown>"}
    live = render.bundle_html(md, render.MATHML)
    assert "<strong>rank 1</strong>" in live and '<math xmlns="http://www.w3.org/1998/Math/MathML"' in live
    assert "<msup><mi>x</mi>" in live and "<code>cost $5</code>" in live  # code is not math
    saved = render.bundle_html(md, render.TEX)
    assert "<strong>rank 1</strong> draws $y = x^{2}$" in saved and "<math" not in saved
    assert 'class="jp-RenderedHTMLCommon monarch-display"' in saved
    latex = render.bundle_html({"text/latex": r"$$\int_0^1 x\,dx = \frac{1}{2}$$"}, render.MATHML)
    assert '<math xmlns="http://www.w3.org/1998/Math/MathML" display="block"' in latex and "<mfrac>" in latex
    assert render.bundle_html({"text/latex": r"\(a_i\)"}, render.TEX).endswith(r"$a_i$</div>")


def test_every_mime_type_picks_what_jupyterlab_would_show():
    assert "<i>x</i>" in render.bundle_html({"text/html": "<i>x</i>", "text/plain": "x"})
    assert "<svg" in render.bundle_html({"image/svg+xml": "<svg></svg>", "image/png": "AA"})
    for mime in ("image/png", "image/jpeg", "image/gif", "image/webp"):
        assert f'<img src="data:{mime};base64,QUJD"/>' in render.bundle_html({mime: "QUJD"})
    assert 'type="application/pdf"' in render.bundle_html({"application/pdf": "JVBE"})
    assert "&quot;a&quot;: 1" in render.bundle_html({"application/json": {"a": 1}})
    plain = render.bundle_html({"text/plain": "\x1b[31mtensor\x1b[0m"})
    assert '<span class="ansi-red-fg">tensor</span>' in plain and 'data-mime-type="text/plain"' in plain


def test_the_live_view_gets_displays_as_html_and_stream_text_as_is():
    log = RankLog()
    item = log.add(2, "gpu=2", "display", data={"text/markdown": "# Title"})
    assert item == {"r": 2, "l": "gpu=2", "s": "display", "h": item["h"]} and "<h1>Title</h1>" in item["h"]
    assert log.add(2, "gpu=2", "stdout", "\rtext") == {"r": 2, "l": "gpu=2", "s": "stdout", "t": "\rtext"}


def test_a_flood_keeps_each_ranks_last_lines_in_the_static_view_and_says_how_many_came_before():
    log = RankLog(tail_chars=100, tail_displays=1)
    log.add(0, "gpu=0", "stdout", "\x1b[31m")  # red from here on: the kept lines stay red
    for i in range(1000):
        log.add(0, "gpu=0", "stdout", f"line {i:04d}\n")
    log.add(0, "gpu=0", "display", data={"text/plain": "fig 1"})
    log.add(0, "gpu=0", "display", data={"text/plain": "fig 2"})
    log.add(1, "gpu=1", "stderr", "".join(f"\r{p:3d}%" for p in range(101)))  # a progress bar, no newline
    assert sum(len(c) for _, c in log.ranks[0][1] if isinstance(c, str)) <= 200  # memory stays bounded too
    assert log.text().splitlines() == [
        "[gpu=0] … 990 lines (9.7 KiB) not shown: a finished cell keeps each rank's last 100 B of text …",
        *[f"[gpu=0] line {i:04d}" for i in range(990, 1000)],
        "[gpu=0] … 1 display not shown: a finished cell keeps each rank's last 1 display …",
        "[gpu=0] fig 2",
        "[gpu=1] … 405 B of text not shown: a finished cell keeps each rank's last 100 B of text …",
        "[gpu=1] 100%",
    ]
    html = log.html()
    assert '<span class="ansi-red-fg">line 0999</span>' in html and "line 0989" not in html
    assert html.count('class="jp-RenderedText monarch-skipped"') == 3 and "fig 1" not in html


def test_a_matplotlib_figure_is_drawn_in_the_pages_colours():
    """Black becomes the text colour around the figure and white the page's background (light or dark);
    nothing in it styles the page outside it; a worker's figure is drawn in this form in its rank's area."""
    import xml.etree.ElementTree as ET

    from matplotlib.figure import Figure

    from monarch.runtime.common import figures

    fig = Figure(figsize=(4, 3))
    ax = fig.subplots()
    ax.plot([0, 1], [1, 0], label="loss")
    ax.set_title("rank 0")
    ax.legend()
    svg = figures.themed_svg(fig)
    assert svg is not None and svg.startswith("<svg ") and 'class="monarch-figure"' in svg
    root = ET.fromstring(svg)  # well-formed, one root
    assert root.get("fill") == "currentColor"
    assert "#000000" not in svg and "<style" not in svg and "<?xml" not in svg
    assert "fill: var(--jp-layout-color0, #ffffff)" in svg and "stroke: currentColor" in svg
    assert "rank 0" in svg  # text as text
    assert figures.themed_svg(fig, max_bytes=1000) is None  # too large: the PNG only
    shown = render.bundle_html({figures.MIME: svg, "image/png": "AA", "text/plain": "<Figure>"})
    assert 'class="monarch-figure"' in shown and "<img" not in shown


def test_on_many_ranks_the_static_view_shows_each_distinct_output_once_with_its_ranks():
    """512 ranks: the same line from each, then the rank's parity; a cell saved with it stays small."""
    grouped, apart = RankLog(grouped=True), RankLog()
    for log in (grouped, apart):
        for rank in range(512):
            label = f"host={rank // 64},gpu={rank % 64}"
            log.add(rank, label, "stdout", "loss 0.25\n")
            log.add(rank, label, "stdout", f"{'even' if rank % 2 == 0 else 'odd'}\n")
        log.add(7, "host=0,gpu=7", "stderr", "only rank 7 warns\n")
    assert grouped.text().splitlines() == [
        "[ranks 0, 2, 4, …, 510] loss 0.25",
        "[ranks 0, 2, 4, …, 510] even",
        "[ranks 1, 3, 5, …, 511] loss 0.25",
        "[ranks 1, 3, 5, …, 511] odd",
        "[host=0,gpu=7] loss 0.25",
        "[host=0,gpu=7] odd",
        "[host=0,gpu=7] only rank 7 warns",
    ]
    html = grouped.html()
    assert html.count('class="monarch-rank"') == 3 and html.count("loss 0.25") == 3
    assert "<summary>256 ranks</summary><div>host=0,gpu=0</div><div>host=0,gpu=2</div>" in html
    assert "<summary>255 ranks</summary>" in html and '<div class="monarch-rank" data-label="host=0,gpu=7">' in html
    assert apart.html().count('class="monarch-rank"') == 512  # (at most GROUP_ABOVE ranks: one area each)
    assert len(grouped.bundle()["text/html"]) * 4 < len(apart.bundle()["text/html"])


def test_ranks_whose_output_differs_only_in_how_it_was_chunked_share_an_area():
    log = RankLog(grouped=True)
    log.add(0, "gpu=0", "stdout", "a\nb\n")
    log.add(1, "gpu=1", "stdout", "a\n")
    log.add(1, "gpu=1", "stdout", "b\n")
    assert log.text().splitlines() == ["[ranks 0-1] a", "[ranks 0-1] b"]
