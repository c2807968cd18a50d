"""Real browser: JupyterLab driven by Debian's Chromium through Playwright for Python.

A user's path: open the launcher card "Monarch (PyTorch mesh)", run a `%%mesh gpu=4` cell and check each rank's
own output area (`.monarch-rank[data-label=gpu=N]`), then run `%mesh` and check the MeshTable (4 rows, all idle).
The screenshot is saved to test-artifacts/browser/monarch_lab.png (with the output HTML beside it), pass or fail.
Afterwards the lab server, its kernel and the kernel's workers must all be gone."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from browser_lab import CHROMIUM, CHROMIUM_ARGS, Lab, cmdline, descendants
from conftest import REPO, wait_gone

if not os.access(CHROMIUM, os.X_OK):
    if os.environ.get("CI"):  # CI installs it (./run test): its absence there is a failure, not a skip
        raise RuntimeError(f"{CHROMIUM} is not installed; ./run test installs it with apt-get")
    pytest.skip(f"{CHROMIUM} not installed (apt-get install chromium)", allow_module_level=True)
sync_api = pytest.importorskip("playwright.sync_api", reason="playwright not installed (pip install playwright)")
expect = sync_api.expect

DISPLAY_NAME = "Monarch (PyTorch mesh)"
ARTIFACTS = Path(REPO) / "test-artifacts" / "browser"
WAIT_MS = 30_000


@pytest.fixture
def lab(tmp_path):
    prefix = tmp_path / "prefix"
    install = [sys.executable, "-m", "monarch.kernel", "install", "--prefix", str(prefix)]
    subprocess.run(install, cwd=REPO, check=True, timeout=60)
    server = Lab(tmp_path / "lab", prefix / "share" / "jupyter")
    server.start()
    yield server
    pids = [server.proc.pid, *descendants(server.proc.pid)]  # kernel, fork server, workers (own session)
    server.stop()
    left = {pid: cmdline(pid) for pid in wait_gone(pids, 10)}
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


@pytest.mark.timeout(180)
def test_mesh_cell_in_jupyterlab(lab):
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        try:
            page.goto(f"{lab.url}/lab?token={lab.token}")
            page.locator(f".jp-LauncherCard[data-category='Notebook'][title='{DISPLAY_NAME}']").click(timeout=WAIT_MS)
            expect(page.locator(".jp-NotebookPanel-toolbar .jp-Toolbar-kernelName")).to_have_text(
                DISPLAY_NAME, timeout=WAIT_MS
            )
            idle = page.locator(".jp-Notebook-ExecutionIndicator[data-status='idle']")
            idle.wait_for(timeout=WAIT_MS)

            source = (
                '%%mesh gpu=4\nimport time\nprint(f"hello from rank {rank}", flush=True)\ntime.sleep(5)\nprint("bye")'
            )
            cell, _ = run_cell(page, 0, source, wait=False)
            # live: each rank's first line shows in its own area while the cell still runs
            for rank in range(4):
                area = cell.locator(f".monarch-rank[data-label='gpu={rank}']")
                expect(area).to_contain_text(f"hello from rank {rank}", timeout=WAIT_MS)
            assert "bye" not in cell.locator(".jp-OutputArea").inner_text()
            expect(cell.locator(".jp-InputPrompt")).to_have_text("[*]:")
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
        finally:
            page.screenshot(path=ARTIFACTS / "monarch_lab.png", full_page=True)
            outputs = page.locator(".jp-OutputArea").evaluate_all("els => els.map(e => e.outerHTML).join('\\n')")
            (ARTIFACTS / "monarch_lab.html").write_text(outputs)
            browser.close()
