"""Real browser: JupyterLab driven by Debian's Chromium through Playwright for Python.

A user's path: open the launcher card "Monarch (PyTorch mesh)", run a `%%mesh gpu=4` cell and check each rank's
own output area (`.monarch-rank[data-label=gpu=N]`), then run `%mesh` and check the MeshTable (4 rows, all idle).
In the dark theme: workers' Markdown, LaTeX, ANSI colours, stderr and a tqdm bar, live and once the cell ended.
Screenshots are saved to test-artifacts/browser/ (with the output HTML beside them), pass or fail.
Afterwards the lab server, its kernel and the kernel's workers must all be gone."""

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, wait_for, wait_gone
from helpers.browser_lab import CHROMIUM, CHROMIUM_ARGS, Lab, cmdline, descendants, require_chromium

sync_api = require_chromium(allow_module_level=True)
expect = sync_api.expect

DISPLAY_NAME = "Monarch (PyTorch mesh)"
ARTIFACTS = Path(REPO) / "test-artifacts" / "browser"
WAIT_MS = 30_000


@pytest.fixture
def lab(tmp_path, request):
    prefix = tmp_path / "prefix"
    install = [sys.executable, "-m", "monarch.kernel", "install", "--prefix", str(prefix)]
    subprocess.run(install, cwd=REPO, check=True, timeout=60)
    server = Lab(tmp_path / "lab", prefix / "share" / "jupyter", theme=getattr(request, "param", None))
    server.start()
    yield server
    pids = [server.proc.pid, *descendants(server.proc.pid)]  # kernel, fork server, workers (own session)
    server.stop()
    left = {pid: cmdline(pid) for pid in wait_gone(pids)}
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert left == {}, f"processes left after JupyterLab stopped: {left}\n{server.log_tail()}"


def run_cell(page, index: int, source: str, wait: bool = True):
    """Type `source` into cell `index` and run it with Shift+Enter; wait for its `[n]:` unless told not to.

    Returns the cell and its outputs' text at that point (tracebacks included), for assertion messages."""
    cell = page.locator(".jp-Notebook .jp-Cell").nth(index)
    cell.locator(".jp-InputArea-editor").click()
    page.keyboard.insert_text(source)
    page.keyboard.press("Shift+Enter")
    if wait:
        expect(cell.locator(".jp-InputPrompt")).to_have_text(f"[{index + 1}]:", timeout=WAIT_MS)
    return cell, f"cell {source!r} shows:\n{cell.locator('.jp-OutputArea').inner_text()}\n"


def open_notebook(page, lab):
    """A new notebook on the Monarch kernel, idle; returns the idle indicator."""
    page.goto(f"{lab.url}/lab?token={lab.token}")
    page.locator(f".jp-LauncherCard[data-category='Notebook'][title='{DISPLAY_NAME}']").click(timeout=WAIT_MS)
    expect(page.locator(".jp-NotebookPanel-toolbar .jp-Toolbar-kernelName")).to_have_text(DISPLAY_NAME, timeout=WAIT_MS)
    idle = page.locator(".jp-Notebook-ExecutionIndicator[data-status='idle']")
    idle.wait_for(timeout=WAIT_MS)
    return idle


@contextlib.contextmanager
def browser_page(name: str, height: int = 1000, width: int = 1400):
    """A page in headless Chromium; afterwards, pass or fail, its screenshot and output HTML as `name`."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": width, "height": height})
        try:
            yield page
        finally:
            page.screenshot(path=ARTIFACTS / f"{name}.png", full_page=True)
            outputs = page.locator(".jp-OutputArea").evaluate_all("els => els.map(e => e.outerHTML).join('\\n')")
            (ARTIFACTS / f"{name}.html").write_text(outputs)
            browser.close()


@pytest.mark.timeout(180)
def test_mesh_cell_in_jupyterlab(lab, tmp_path):
    gate = tmp_path / "gate"  # (the ranks wait at it until the test has looked at the live view)
    with browser_page("monarch_lab") as page:
        idle = open_notebook(page, lab)

        source = (
            '%%mesh gpu=4\nimport os, time\nprint(f"hello from rank {rank}", flush=True)\n'
            f"while not os.path.exists({str(gate)!r}):\n    time.sleep(0.05)\n"
            'print("bye")'
        )
        cell, _ = run_cell(page, 0, source, wait=False)
        # live: each rank's first line shows in its own area while the cell still runs
        for rank in range(4):
            area = cell.locator(f".monarch-rank[data-label='gpu={rank}']")
            expect(area).to_contain_text(f"hello from rank {rank}", timeout=WAIT_MS)
        assert "bye" not in cell.locator(".jp-OutputArea").inner_text()
        expect(cell.locator(".jp-InputPrompt")).to_have_text("[*]:")
        gate.touch()
        expect(cell.locator(".jp-InputPrompt")).to_have_text("[1]:", timeout=WAIT_MS)
        shown = f"cell {source!r} shows:\n{cell.locator('.jp-OutputArea').inner_text()}\n"
        # done: static areas, one per rank, each with its own lines only
        expect(cell.locator(".monarch-rank"), shown).to_have_count(4, timeout=WAIT_MS)
        for rank in range(4):
            area = cell.locator(f".monarch-rank[data-label='gpu={rank}']")
            expect(area, shown).to_contain_text(f"hello from rank {rank}", timeout=WAIT_MS)
            expect(area, shown).to_contain_text("bye", timeout=WAIT_MS)
            text = area.inner_text()
            assert [r for r in range(4) if r != rank and f"hello from rank {r}" in text] == [], text

        cell, shown = run_cell(page, 1, "%mesh")
        rows = cell.locator("table.monarch-mesh-table tr[data-rank]")
        expect(rows, shown).to_have_count(4, timeout=WAIT_MS)
        expect(rows.locator(".monarch-status"), shown).to_have_text(["idle"] * 4, timeout=WAIT_MS)
        idle.wait_for(timeout=WAIT_MS)


RICH_CELL = r"""%%mesh gpu=2
import os, sys, time
from IPython.display import Markdown, Math
from tqdm import tqdm

print("\x1b[31mred text\x1b[0m and plain")
print(f"a warning on stderr from rank {rank}", file=sys.stderr, flush=True)
display(Markdown(f"**rank {rank}** draws $y = x^{rank + 1}$"))
display(Math(r"\int_0^1 x^{%d}\,dx = \frac{1}{%d}" % (rank + 1, rank + 2)))
for _ in tqdm(range(20), mininterval=0, miniters=1, ascii=True, ncols=60):
    time.sleep(0.03)
while not os.path.exists(GATE):  # (the test looks at the live view meanwhile)
    time.sleep(0.05)
"""

# What the eye sees behind stderr's text: the backgrounds from its <pre> up to the first opaque one, laid over
# each other; and the WCAG contrast of the text on it
SEEN = """el => {
  const rgba = (c) => { const v = c.match(/[\\d.]+/g).map(Number); return [v[0], v[1], v[2], v[3] ?? 1]; };
  const pre = el.querySelector("pre");
  const layers = [];
  for (let n = pre; n; n = n.parentElement) {
    const c = rgba(getComputedStyle(n).backgroundColor);
    if (c[3] > 0) layers.push(c);
    if (c[3] === 1) break;
  }
  let bg = [255, 255, 255];
  for (const [r, g, b, a] of layers.reverse()) bg = [r, g, b].map((v, i) => v * a + bg[i] * (1 - a));
  const fg = rgba(getComputedStyle(pre).color);
  const lum = (c) => { const l = c.slice(0, 3).map((v) => { v /= 255; return v <= 0.03928 ? v / 12.92 : ((v + 0.055) / 1.055) ** 2.4; }); return 0.2126 * l[0] + 0.7152 * l[1] + 0.0722 * l[2]; };
  const [hi, lo] = [lum(fg), lum(bg)].sort((x, y) => y - x);
  return { contrast: (hi + 0.05) / (lo + 0.05), bg: bg.map(Math.round), fg };
}"""


def _assert_dark_error_background(seen: dict) -> None:
    """The dark theme's error background behind stderr (a red tint on near black), the text readable on it."""
    r, g, b = seen["bg"]
    assert max(r, g, b) < 128 and r > g + 20 and seen["contrast"] >= 4.5, seen


def _red(colour: str) -> bool:
    r, g, b = (int(float(v)) for v in colour[colour.index("(") + 1 : colour.index(")")].split(",")[:3])
    return r > 180 and g < 120 and b < 120


@pytest.mark.timeout(180)
@pytest.mark.parametrize("lab", ["JupyterLab Dark"], indirect=True)
def test_worker_output_renders_as_jupyter_renders_it(lab, tmp_path):
    gate = tmp_path / "gate"
    with browser_page("monarch_lab_dark", height=1200) as page:
        open_notebook(page, lab)
        assert page.locator("body").get_attribute("data-jp-theme-name") == "JupyterLab Dark"
        cell, _ = run_cell(page, 0, RICH_CELL.replace("GATE", repr(str(gate))), wait=False)
        outputs = cell.locator(".jp-OutputArea-output")
        # the start shows before anything else, while the workers start
        expect(outputs.first).to_contain_text("monarch: ", timeout=WAIT_MS)
        expect(outputs.first).to_contain_text("workers {gpu: 2}", timeout=WAIT_MS)
        area = cell.locator(".monarch-rank[data-label='gpu=1']")
        expect(area.locator("strong")).to_have_text("rank 1", timeout=WAIT_MS)
        assert cell.locator(".monarch-ranks").count() == 1
        assert outputs.first.locator(".monarch-ranks").count() == 0  # the progress line came first

        # live: MathML drawn by the browser, a tqdm bar on one line, red in red
        expect(area.locator("math")).to_have_count(2, timeout=WAIT_MS)
        stderr = area.locator(".monarch-stderr")
        expect(stderr.last).to_contain_text("100%", timeout=WAIT_MS)
        expect(cell.locator(".jp-InputPrompt")).to_have_text("[*]:")  # still running
        bar = [line for line in stderr.last.inner_text().splitlines() if "%" in line]
        assert len(bar) == 1 and "100%" in bar[0], stderr.last.inner_text()
        live_red = area.locator(".ansi-red-fg")
        expect(live_red).to_have_text("red text")
        assert _red(live_red.evaluate("e => getComputedStyle(e).color"))
        _assert_dark_error_background(stderr.first.evaluate(SEEN))
        gate.touch()

        # ended: the static view, math typeset by JupyterLab's MathJax, the same rendering otherwise
        expect(cell.locator(".jp-InputPrompt")).to_have_text("[1]:", timeout=WAIT_MS)
        expect(area.locator("mjx-container")).to_have_count(2, timeout=WAIT_MS)
        expect(area.locator("strong")).to_have_text("rank 1")
        bar = [line for line in area.locator(".monarch-stderr").last.inner_text().splitlines() if "%" in line]
        assert len(bar) == 1 and "100%" in bar[0], bar
        red = area.locator(".ansi-red-fg")
        expect(red).to_have_text("red text")
        assert _red(red.evaluate("e => getComputedStyle(e).color"))
        _assert_dark_error_background(area.locator(".monarch-stderr").first.evaluate(SEEN))
        expect(outputs.first).to_contain_text("monarch: 2 workers {gpu: 2} ready in")


TIMELINE_CELLS = [
    r"""import monarch, torch
sim = monarch.Simulator(hosts=2, gpus=2)
with sim.mesh.activate():
    x = torch.randn(256, 256)
    for _ in range(3):
        x = (x @ x).tanh()
        x = x.reduce("gpu", "avg")
sim.display()""",
    r"""import time, torch.distributed as dist
from monarch.actor import this_host
from monarch.profiler import Schedule, profile
mesh = this_host().spawn_procs({"gpu": 2})
@monarch.remote
def step():
    a = torch.randn(128, 128)
    until = time.perf_counter() + (0.05 if monarch.current_rank()["gpu"] == 1 else 0.005)
    while time.perf_counter() < until:
        a = (a @ a) / 128
    dist.all_reduce(a)
with profile(mesh=mesh, on_trace_ready=OUT, schedule=Schedule(wait=0, warmup=1, active=2)) as prof:
    for _ in range(3):
        step.on(mesh)()
        prof.step()""",
]

_BOXES = """svg => {
  const area = svg.closest('.jp-OutputArea-output').getBoundingClientRect();
  const box = svg.getBoundingClientRect();
  const texts = [...svg.querySelectorAll('text')].map(t => {
    const b = t.getBoundingClientRect();
    return {text: t.textContent, left: b.left, right: b.right, top: b.top, bottom: b.bottom};
  });
  const rects = [...svg.querySelectorAll('rect')].filter(r => r.closest('title') === null && r.getAttribute('y') !== '2')
    .map(r => r.getBoundingClientRect().left);
  return {area: {left: area.left, right: area.right}, svg: {left: box.left, right: box.right},
          texts, firstBar: Math.min(...rects)};
}"""


@pytest.mark.timeout(240)
@pytest.mark.parametrize("width", [1000, 1900])
def test_timelines_fit_the_output_area_whatever_its_width(lab, tmp_path, width):
    """The profiler's and the simulator's timelines scale to the output area: the whole picture and every label
    stay inside it (narrower than the picture: scaled down, not cut), and rank labels end before the bars."""
    with browser_page(f"timelines_{width}") as page:
        page.set_viewport_size({"width": width + 400, "height": 1000})
        open_notebook(page, lab)
        cells = [TIMELINE_CELLS[0], f"OUT = {str(tmp_path)!r}\n" + TIMELINE_CELLS[1], "mesh.exit()"]
        for i, source in enumerate(cells):
            cell, shown = run_cell(page, i, source)
            if i == 2:
                break
            svg = cell.locator("svg.monarch-timeline")
            expect(svg, shown).to_have_count(1, timeout=WAIT_MS)
            if i == 0:  # make the output area `width` wide (the rest of the window is JupyterLab's)
                area = svg.evaluate("s => s.closest('.jp-OutputArea-output').getBoundingClientRect().width")
                page.set_viewport_size({"width": int(width + 400 + width - area), "height": 1000})
                page.wait_for_function(
                    f"() => Math.abs(document.querySelector('svg.monarch-timeline').closest('.jp-OutputArea-output')"
                    f".getBoundingClientRect().width - {width}) < 20",
                    timeout=WAIT_MS,
                )
            got = svg.evaluate(_BOXES)
            area, box = got["area"], got["svg"]
            assert abs(area["right"] - area["left"] - width) < 20, (width, area)
            assert area["left"] - 1 <= box["left"] and box["right"] <= area["right"] + 1, (width, got, shown)
            outside = [t for t in got["texts"] if t["left"] < area["left"] - 1 or t["right"] > area["right"] + 1]
            assert outside == [], (width, outside)
            ranks = [t for t in got["texts"] if t["text"].startswith("rank ")]
            assert ranks and all(t["right"] <= got["firstBar"] for t in ranks), (width, ranks, got["firstBar"])
            ends = [t for t in got["texts"] if t["text"].endswith(" ms")]
            assert len(ends) == 2, got["texts"]  # "0 ms" and the end time: both shown


def _statuses(cell) -> list[str]:
    return cell.locator("table.monarch-mesh-table tr[data-rank] .monarch-status").all_inner_texts()


@pytest.mark.timeout(240)
def test_the_status_table_tells_what_each_rank_does(lab, tmp_path):
    """During a --noblock run, a rank that finished shows idle while another still runs (and its time counts):
    the table says it is live until the next cell starts. Then it keeps what was true at that moment: cells
    queued after it as Run All queues them, a busy one and a shutdown, change nothing in it."""
    release = tmp_path / "release"
    with browser_page("status_table") as page:
        idle = open_notebook(page, lab)
        noblock = (
            "%%mesh gpu=2 --noblock --save job\nimport os, time\n"
            f"while rank == 1 and not os.path.exists({str(release)!r}):\n    time.sleep(0.05)\n"
            "time.sleep(0.5)"
        )
        run_cell(page, 0, noblock)
        table, shown = run_cell(page, 1, "%mesh")
        expect(table.locator("table.monarch-mesh-table tr[data-rank]"), shown).to_have_count(2, timeout=WAIT_MS)
        status = table.locator("table.monarch-mesh-table tr[data-rank] .monarch-status")
        expect(status, shown).to_have_text(["idle", "busy"], timeout=WAIT_MS)  # rank 0's part ended after 0.5 s
        row1 = table.locator("table.monarch-mesh-table tr[data-rank='1'] td").last
        expect(row1).not_to_have_text("0 s", timeout=WAIT_MS)  # the busy rank's time counts
        release.touch()
        expect(status, shown).to_have_text(["idle", "idle"], timeout=WAIT_MS)
        expect(table.locator("caption"), shown).to_have_text("ProcMesh {gpu: 2} (live)")
        # Run All's way: the next cells queued at once; the last stops the mesh right after a call ends
        for i, source in enumerate(["%%mesh\nimport time\ntime.sleep(0.3)", "%mesh shutdown"], start=2):
            run_cell(page, i, source, wait=False)
        expect(page.locator(".jp-Cell").nth(3).locator(".jp-InputPrompt")).to_have_text("[4]:", timeout=WAIT_MS)
        idle.wait_for(timeout=WAIT_MS)
        expect(table.locator("caption"), shown).to_contain_text("ProcMesh {gpu: 2} (as of ", timeout=WAIT_MS)
        assert _statuses(table) == ["idle", "idle"] and "stopped" not in table.inner_text(), table.inner_text()
        ended = page.locator(".jp-Cell").nth(0).locator(".jp-OutputArea")  # (said by a thread of the kernel's)
        expect(ended).to_contain_text("[this run ended after", timeout=WAIT_MS)


@pytest.mark.timeout(180)
def test_tab_in_a_mesh_cell_completes_from_the_workers_namespace(lab):
    with browser_page("completion") as page:
        open_notebook(page, lab)
        run_cell(page, 0, "%%mesh gpu=2\nworker_only_name = rank")
        cell = page.locator(".jp-Notebook .jp-Cell").nth(1)
        cell.locator(".jp-InputArea-editor").click()
        page.keyboard.insert_text("%%mesh\nx = worker_o")
        page.keyboard.press("Tab")
        offered = page.locator(".jp-Completer-item")
        expect(offered.first).to_contain_text("worker_only_name", timeout=WAIT_MS)  # the workers' name, offered
        page.keyboard.press("Enter")
        expect(cell.locator(".jp-InputArea-editor")).to_contain_text("x = worker_only_name", timeout=WAIT_MS)
        run_cell(page, 1, "", wait=True)
        expect(cell.locator(".jp-OutputArea")).not_to_contain_text("Error")
        run_cell(page, 2, "%mesh shutdown")


@pytest.mark.timeout(180)
def test_a_flood_keeps_the_cell_short_and_the_saved_notebook_small(lab):
    """5,000 lines from one rank: each rank's area shows its last lines in a box of bounded height (24 lines:
    the cell stays under 1,000 px), with "show all" live; the saved notebook stays under 100 KB."""
    flood = (  # (in bursts, over about 3 s: the live view is on show meanwhile)
        "%%mesh gpu=2\nimport time\nfor i in range(5000 if rank == 0 else 3):\n"
        "    print(f'line {i:05d} ' + 'x' * 40)\n    if i % 500 == 499:\n        time.sleep(0.3)"
    )
    with browser_page("flood") as page:
        open_notebook(page, lab)
        cell, _ = run_cell(page, 0, flood, wait=False)
        live = cell.locator(".monarch-rank[data-label='gpu=0'] .monarch-rank-more")
        expect(live).to_be_visible(timeout=WAIT_MS)  # "show all", live, once the area overflows
        expect(cell.locator(".jp-InputPrompt")).to_have_text("[1]:", timeout=WAIT_MS)
        expect(cell.locator(".monarch-skipped")).to_contain_text("all its text is in", timeout=WAIT_MS)
        height = cell.evaluate("c => c.getBoundingClientRect().height")
        assert height < 1000, height
        area = cell.locator(".monarch-rank[data-label='gpu=0'] .monarch-rank-scroll")
        assert "line 04999" in area.inner_text()  # the end is what shows
        page.keyboard.press("Control+s")
        accept = page.locator(".jp-Dialog .jp-mod-accept")  # JupyterLab asks for a name on a first save
        with contextlib.suppress(sync_api.TimeoutError):
            accept.wait_for(timeout=WAIT_MS)
            accept.click()
        saved = lab.tmp / "root" / "Untitled.ipynb"
        wait_for(lambda: saved.exists() and "line 04999" in saved.read_text(), 30, "the notebook's save")
        assert saved.stat().st_size < 100_000, saved.stat().st_size
        run_cell(page, 1, "%mesh shutdown")


# Words a line break cut in two inside `root`'s text (JupyterLab draws output text with `word-break:
# break-all`: a line longer than its area breaks wherever it reaches the edge)
BROKEN_WORDS = """root => {
  const broken = [];
  const walker = document.createTreeWalker(root, NodeFilter.SHOW_TEXT);
  for (let n = walker.nextNode(); n; n = walker.nextNode()) {
    const re = /[A-Za-z0-9_']+/g;
    let m;
    while ((m = re.exec(n.textContent))) {
      const r = document.createRange();
      r.setStart(n, m.index);
      r.setEnd(n, m.index + m[0].length);
      const tops = new Set([...r.getClientRects()].filter((x) => x.width > 0).map((x) => Math.round(x.top)));
      if (tops.size > 1) broken.push(m[0]);
    }
  }
  return broken;
}"""

# A figure's text and background as drawn: computed colours
FIGURE_COLOURS = """svg => {
  const text = svg.querySelector("text"), bg = svg.querySelector("path");
  return { text: getComputedStyle(text).fill, bg: getComputedStyle(bg).fill };
}"""


def _contrast(fg: str, bg: str) -> float:
    def lum(colour: str) -> float:
        vals = [float(v) for v in colour[colour.index("(") + 1 : colour.index(")")].split(",")[:3]]
        lin = [(v / 255) / 12.92 if v / 255 <= 0.03928 else ((v / 255 + 0.055) / 1.055) ** 2.4 for v in vals]
        return 0.2126 * lin[0] + 0.7152 * lin[1] + 0.0722 * lin[2]

    hi, lo = sorted([lum(fg), lum(bg)], reverse=True)
    return (hi + 0.05) / (lo + 0.05)


@pytest.mark.timeout(360)
@pytest.mark.parametrize("lab", ["JupyterLab Dark"], indirect=True)
def test_at_1000_px_in_the_dark_outputs_stay_true_to_their_cell_and_whole(lab, tmp_path):
    """Chromium 1,000 px wide (the file browser open), the dark theme: help and errors keep each word whole;
    a worker's figure reads in the dark; an old `%mesh status` output keeps what it showed while later cells
    run; a worker killed while no cell runs is reported once, at the top of the next cell run, and no old
    cell's output changes."""
    gate = tmp_path / "gate"
    with browser_page("narrow_dark", width=1000) as page:
        open_notebook(page, lab)

        def outputs(i: int):
            return page.locator(".jp-Notebook .jp-Cell").nth(i).locator(".jp-OutputArea")

        def whole(i: int, what: str) -> None:
            area = outputs(i)
            assert area.evaluate(BROKEN_WORDS) == [], f"{what}: words broken across lines:\n{area.inner_text()}"

        cell, shown = run_cell(page, 0, "%mesh?")
        expect(cell.locator(".jp-OutputArea"), shown).to_contain_text("%mesh status", timeout=WAIT_MS)
        whole(0, "%mesh?")

        actors = (
            "import os, time\nfrom monarch.actor import Actor, endpoint, this_host\n"
            "from monarch.runtime.actors import supervision\n"
            "class W(Actor):\n    @endpoint\n    def pid(self):\n        return os.getpid()\n"
            "procs = this_host().spawn_procs({'gpu': 2})\nws = procs.spawn('watched', W)\n"
            "print('pids', *ws.pid.call().get().values())"
        )
        cell, shown = run_cell(page, 1, actors)
        expect(cell.locator(".jp-OutputArea"), shown).to_contain_text("pids ", timeout=WAIT_MS)
        pids = [int(p) for p in outputs(1).inner_text().split("pids ")[1].split()[:2]]

        figure = (
            "%%mesh gpu=2\nimport matplotlib.pyplot as plt\n"
            "plt.plot([0, 1], [rank, 1 - rank], label='loss')\nplt.title(f'rank {rank}')\nplt.legend()"
        )
        cell, shown = run_cell(page, 2, figure)
        svgs = cell.locator("svg.monarch-figure")
        expect(svgs, shown).to_have_count(2, timeout=WAIT_MS)
        colours = svgs.first.evaluate(FIGURE_COLOURS)
        assert _contrast(colours["text"], colours["bg"]) >= 4.5, colours  # light text on the dark page
        assert _contrast("rgb(0, 0, 0)", colours["bg"]) < 2, colours  # (the background is dark, not a white box)

        table, shown = run_cell(page, 3, "%mesh status")
        rows = table.locator("table.monarch-mesh-table tr[data-rank]")
        expect(rows, shown).to_have_count(2, timeout=WAIT_MS)
        expect(table.locator("caption"), shown).to_have_text("ProcMesh {gpu: 2} (live)")
        whole(3, "%mesh status")
        cut = table.locator("table.monarch-mesh-table td").evaluate_all(
            "tds => tds.filter(td => td.scrollWidth > td.clientWidth + 1).map(td => td.textContent)"
        )
        assert cut == [], f"cells clipped: {cut}"
        busy = f"%%mesh --noblock\nimport os, time\nwhile not os.path.exists({str(gate)!r}):\n    time.sleep(0.05)"
        run_cell(page, 4, busy)
        expect(outputs(3)).to_contain_text("(as of ", timeout=WAIT_MS)  # frozen as the next cell started
        before = outputs(3).inner_text()
        assert "busy" not in before, before
        cell, shown = run_cell(page, 5, "%%mesh\nprint(1)")
        expect(cell.locator(".jp-OutputArea"), shown).to_contain_text("MeshBusyError", timeout=WAIT_MS)
        whole(5, "MeshBusyError")
        assert outputs(3).inner_text() == before  # the ranks are busy now: the old table still shows then
        gate.touch()
        expect(outputs(4)).to_contain_text("[this run ended after", timeout=WAIT_MS)
        cell, shown = run_cell(page, 6, "%%mesh\nimport os\nif rank == 1:\n    os._exit(7)")
        expect(cell.locator(".jp-OutputArea"), shown).to_contain_text("WorkerDiedError", timeout=WAIT_MS)
        whole(6, "WorkerDiedError")

        # a worker of the actors killed while no cell runs
        old = [outputs(i).inner_text() for i in range(7)]
        os.kill(pids[1], signal.SIGKILL)
        assert wait_gone([pids[1]], 30) == []
        nxt = (
            "deadline = time.monotonic() + 60\n"
            "while supervision.delivered < 1 and time.monotonic() < deadline:\n    time.sleep(0.05)\nprint('next')"
        )
        cell, shown = run_cell(page, 7, nxt)
        expect(cell.locator(".jp-OutputArea"), shown).to_contain_text("next", timeout=WAIT_MS)
        text = cell.locator(".jp-OutputArea").inner_text()
        assert text.count("MeshFailure") == 1 and "'watched' (W)" in text and "killed by SIGKILL" in text, text
        whole(7, "MeshFailure")
        assert [outputs(i).inner_text() for i in range(7)] == old  # nothing appended to an old cell
        run_cell(page, 8, "procs.exit()")
        run_cell(page, 9, "%mesh shutdown")


@pytest.fixture
def jobs512(tmp_path_factory):
    """8 synthetic hosts of 64 ranks (`helpers/synthetic_hosts.py`), made before the lab so that its kernel finds
    them (`MONARCH_JOBS_DIR`)."""
    from helpers.synthetic_hosts import SyntheticJob

    job = SyntheticJob(tmp_path_factory.mktemp("jobs512"), "scale512", hosts=8)
    job.start()
    yield job
    assert job.stop() == []


@pytest.mark.timeout(300)
def test_a_cell_on_512_ranks_shows_an_area_per_distinct_output_and_a_table_per_host(jobs512, lab):
    with browser_page("monarch_lab_512", height=1400) as page:
        idle = open_notebook(page, lab)
        spawn = 'import monarch.notebook\nmesh = monarch.notebook.job("scale512").spawn_procs({"gpu": 64})'
        cell, shown = run_cell(page, 0, spawn)
        expect(cell.locator(".jp-OutputArea-output.jp-OutputArea-executeResult"), shown).to_have_count(0)
        # --noblock: the live view stays, grouped by its own script as the output comes
        source = '%%mesh mesh --noblock\nprint("step 1: loss 0.25")\nprint("even" if rank % 2 == 0 else "odd")'
        cell, _ = run_cell(page, 1, source)
        areas = cell.locator(".monarch-rank")
        even = cell.locator(".monarch-rank[data-label='ranks 0, 2, 4, …, 510']")
        odd = cell.locator(".monarch-rank[data-label='ranks 1, 3, 5, …, 511']")
        for area in (even, odd):
            expect(area).to_contain_text("[this run ended after", timeout=WAIT_MS)
            expect(area).to_have_attribute("data-ranks", "256")
            expect(area.locator("summary")).to_have_text("256 ranks")
        shown = f"cell {source!r} shows:\n{cell.locator('.jp-OutputArea').inner_text()}\n"
        expect(areas, shown).to_have_count(2)
        expect(even, shown).to_contain_text("step 1: loss 0.25\neven")
        expect(odd, shown).to_contain_text("step 1: loss 0.25\nodd")
        even.locator("summary").click()  # each rank named when opened
        expect(even.locator(".monarch-rank-members div"), shown).to_have_count(256)
        expect(even.locator(".monarch-rank-members div").nth(1)).to_have_text("host=0,gpu=2")

        # a cell that ends: the saved view, one area for the same line from every rank
        cell, shown = run_cell(page, 2, '%%mesh mesh\nprint("the same on every rank")')
        area = cell.locator(".monarch-rank")
        expect(area, shown).to_have_count(1, timeout=WAIT_MS)
        expect(area, shown).to_have_attribute("data-label", "ranks 0-511", timeout=WAIT_MS)
        expect(area.locator("summary"), shown).to_have_text("512 ranks")

        # the page answers: the next cell runs, and the mesh's table is a row per host, a host's ranks a click away
        cell, shown = run_cell(page, 3, "%mesh")
        hosts = cell.locator("table.monarch-hosts-table tr[data-host]")
        expect(hosts, shown).to_have_count(8, timeout=WAIT_MS)
        expect(hosts.first, shown).to_contain_text("64 idle")
        hosts.nth(5).locator(".monarch-host-toggle").click()
        ranks = cell.locator(".monarch-host-ranks tr[data-rank]")
        expect(ranks, shown).to_have_count(64, timeout=WAIT_MS)
        expect(ranks.first).to_have_attribute("data-rank", "320")
        cell, shown = run_cell(page, 4, "mesh.exit()\n1 + 1")
        expect(cell.locator(".jp-OutputArea-output"), shown).to_contain_text("2", timeout=WAIT_MS)
        idle.wait_for(timeout=WAIT_MS)
