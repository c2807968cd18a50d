"""Drive a real Monarch kernel through jupyter_client, with its kernelspec in a private prefix."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from jupyter_client.manager import start_new_kernel

from conftest import wait_for


@dataclass
class Result:
    status: str
    msgs: list[dict] = field(default_factory=list)
    reply: dict = field(default_factory=dict)

    def of(self, *types: str) -> list[dict]:
        return [m for m in self.msgs if m["msg_type"] in types]

    def custom_items(self) -> list[dict]:
        """Live per-rank chunks sent to RankOutput widgets (with the widget, then as messages)."""
        out = []
        for m in self.of("comm_open"):
            out += m["content"]["data"]["state"].get("initial", [])
        for m in self.of("comm_msg"):
            data = m["content"]["data"]
            if data.get("method") == "custom" and "items" in data.get("content", {}):
                out += data["content"]["items"]
        return out

    def final_outputs(self) -> list[dict]:
        """The static bundles that replaced the live per-rank views when the cell ended."""
        return [m["content"]["data"] for m in self.of("update_display_data")]

    def text(self) -> str:
        """All text the cell showed: streams, results, errors."""
        parts = []
        for m in self.msgs:
            c = m["content"]
            if m["msg_type"] == "stream":
                parts.append(c["text"])
            elif m["msg_type"] in ("execute_result", "display_data", "update_display_data"):
                parts.append(c["data"].get("text/plain", ""))
            elif m["msg_type"] == "error":
                parts.append("\n".join(c["traceback"]))
        return "\n".join(parts)


class Kernel:
    def __init__(self, km, kc) -> None:
        self.km, self.kc = km, kc

    @property
    def pid(self) -> int:
        return self.km.provisioner.process.pid

    def interrupt_when(self, check: Callable[[], bool], what: str, timeout: float = 30) -> threading.Thread:
        """Press Interrupt, from another thread, once `check()` is true (the state the test interrupts, such as
        every rank's start marker written: see conftest.started), not after a fixed delay."""

        def press() -> None:
            wait_for(check, timeout, what)
            self.km.interrupt_kernel()

        thread = threading.Thread(target=press, name="interrupt-when", daemon=True)
        thread.start()
        return thread

    @contextlib.contextmanager
    def everything(self) -> Iterator[Result]:
        """Every iopub message received meanwhile, whichever cell it belongs to: what a background thread (a
        --noblock run) sends between two cells carries the finished cell's parent, and `run` drops it."""
        seen = Result("")
        channel = self.kc.iopub_channel
        get = channel.get_msg

        def recording(*args, **kw):
            msg = get(*args, **kw)
            seen.msgs.append(msg)
            return msg

        channel.get_msg = recording
        try:
            yield seen
        finally:
            del channel.get_msg

    def run(self, code: str, timeout: float = 60, **kw) -> Result:
        msgs: list[dict] = []
        reply = self.kc.execute_interactive(code, output_hook=msgs.append, timeout=timeout, **kw)
        return Result(reply["content"]["status"], msgs, reply["content"])

    def complete(self, code: str, cursor_pos: int | None = None, timeout: float = 30) -> dict:
        """The kernel's `complete_reply` content for `code` with the cursor at `cursor_pos` (default: the end)."""
        msg_id = self.kc.complete(code, len(code) if cursor_pos is None else cursor_pos)
        while True:
            reply = self.kc.get_shell_msg(timeout=timeout)
            if reply["parent_header"].get("msg_id") == msg_id:
                return reply["content"]

    def value(self, expr: str):
        """Evaluate `expr` in the kernel (its repr must be a Python literal)."""
        import ast

        r = self.run(f"print(repr({expr}))")
        assert r.status == "ok", r.text()
        return ast.literal_eval("".join(m["content"]["text"] for m in r.of("stream")).strip())

    def worker_pids(self) -> list[int]:
        """Pids of the workers of the mesh `%mesh` acts on."""
        return self.value("[row['pid'] for row in get_ipython().run_line_magic('mesh', 'status').rows]")


@contextlib.contextmanager
def kernelspec_prefix() -> Iterator[str]:
    """Install the kernelspec into a temporary prefix and point Jupyter at it."""
    with tempfile.TemporaryDirectory() as prefix:
        subprocess.run(
            [sys.executable, "-m", "monarch.kernel", "install", "--prefix", prefix], check=True, capture_output=True
        )
        old = os.environ.get("JUPYTER_PATH")
        os.environ["JUPYTER_PATH"] = os.path.join(prefix, "share", "jupyter")
        try:
            yield prefix
        finally:
            if old is None:
                os.environ.pop("JUPYTER_PATH", None)
            else:
                os.environ["JUPYTER_PATH"] = old


@contextlib.contextmanager
def monarch_kernel(name: str = "monarch") -> Iterator[Kernel]:
    with kernelspec_prefix():
        km, kc = start_new_kernel(kernel_name=name, startup_timeout=60)
        try:
            yield Kernel(km, kc)
        finally:
            kc.stop_channels()
            if km.is_alive():
                km.shutdown_kernel(now=False)
