"""A JupyterLab server in isolated temp dirs, and /proc helpers, for the real-browser test."""

import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def require_chromium(allow_module_level: bool = False):
    """Chromium and Playwright's sync API, or skip; CI installs both (./run test), so there their absence is a
    failure, not a skip."""
    import pytest

    if not os.access(CHROMIUM, os.X_OK):
        if os.environ.get("CI"):
            raise RuntimeError(f"{CHROMIUM} is not installed; ./run test installs it with apt-get")
        pytest.skip(f"{CHROMIUM} not installed (apt-get install chromium)", allow_module_level=allow_module_level)
    return pytest.importorskip("playwright.sync_api", reason="playwright not installed (pip install playwright)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def descendants(pid: int) -> list[int]:
    """All processes below `pid` in the parent tree (read from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (FileNotFoundError, ProcessLookupError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except (FileNotFoundError, ProcessLookupError):
        return "<gone>"


class Lab:
    """`jupyter lab` on a free port with a random token; config, data, runtime, settings and workspaces under `tmp`.

    `jupyter_path` (a `share/jupyter` dir) is where extra kernelspecs are found."""

    def __init__(self, tmp: Path, jupyter_path: Path, theme: str | None = None):
        self.tmp, self.port, self.token = tmp, free_port(), secrets.token_hex(16)
        self.url = f"http://127.0.0.1:{self.port}"
        settings = tmp / "settings"
        news = settings / "@jupyterlab/apputils-extension/notification.jupyterlab-settings"
        news.parent.mkdir(parents=True)
        news.write_text('{"fetchNews": "false"}')
        if theme is not None:  # e.g. "JupyterLab Dark"
            (news.parent / "themes.jupyterlab-settings").write_text(f'{{"theme": "{theme}"}}')
        (tmp / "root").mkdir()
        self.env = dict(
            os.environ,
            # (after it, any the caller had: ./run adds a base Python's, where its front-end extensions are)
            JUPYTER_PATH=os.pathsep.join([str(jupyter_path), *filter(None, [os.environ.get("JUPYTER_PATH")])]),
            JUPYTER_CONFIG_DIR=str(tmp / "config"),
            JUPYTER_DATA_DIR=str(tmp / "data"),
            JUPYTER_RUNTIME_DIR=str(tmp / "runtime"),
            JUPYTERLAB_SETTINGS_DIR=str(settings),
            JUPYTERLAB_WORKSPACES_DIR=str(tmp / "workspaces"),
            IPYTHONDIR=str(tmp / "ipython"),
        )
        self.log = tmp / "lab.log"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 60.0) -> None:
        argv = [sys.executable, "-m", "jupyterlab", "--no-browser", "--ip=127.0.0.1", f"--port={self.port}"]
        argv += [f"--IdentityProvider.token={self.token}", "--ServerApp.allow_root=True", "--ServerApp.port_retries=0"]
        argv += [
            f"--ServerApp.root_dir={self.tmp / 'root'}",
            "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
        ]
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(argv, env=self.env, stdout=log, stderr=subprocess.STDOUT)
        status = urllib.request.Request(f"{self.url}/api/status", headers={"Authorization": f"token {self.token}"})
        deadline = time.monotonic() + timeout
        while True:
            try:
                urllib.request.urlopen(status, timeout=1).close()
                return
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"JupyterLab did not come up:\n{self.log_tail()}") from None
                time.sleep(0.1)

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM (the server shuts its kernels down), then SIGKILL after `timeout`."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def log_tail(self, n: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-n:]
