"""Tools that must not print torch's own notes as if they were the user's errors (issue 27, item 4)."""

import subprocess
import sys

import pytest

from conftest import REPO

pytestmark = pytest.mark.timeout(120)

SCRIPT = r"""
import monarch
from monarch.actor import this_host

mesh = this_host().spawn_procs({"gpu": 2})

@monarch.remote
def work():
    import torch
    global keep
    keep = None  # frees blocks allocated before recording started
    x = torch.randn(500, 500)
    return float((x @ x).sum())

@monarch.remote
def allocate():
    import torch
    global keep
    keep = [torch.randn(1000) for _ in range(10)]

allocate.on(mesh)()
monarch.memory.record_memory_history(mesh=mesh)
work.on(mesh)()
snapshots = monarch.memory.dump_memory_snapshot(DIR, mesh=mesh)
monarch.memory.record_memory_history(None, mesh=mesh)
print("ranks recorded:", len(snapshots.ranks))
mesh.exit()
"""


def test_recording_memory_on_cpu_prints_nothing_of_torchs_own(tmp_path):
    env_free = {k: v for k, v in __import__("os").environ.items() if not k.startswith("KINETO")}
    out = subprocess.run(
        [sys.executable, "-c", f"DIR = {str(tmp_path)!r}\n" + SCRIPT],
        cwd=REPO, env=env_free, capture_output=True, text=True, timeout=100,
    )  # fmt: skip
    text = out.stdout + out.stderr
    assert out.returncode == 0, text
    assert "ranks recorded: 2" in text
    for noise in ("USDT", "profiler_start", "profiler_stop", "CPUAllocator", "Memory block of unknown size"):
        assert noise not in text, text
