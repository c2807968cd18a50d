import os
import time

import pytest


def pid_alive(pid: int) -> bool:
    """True while `pid` runs (a zombie counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):  # (the latter: gone while being read)
        return False


def wait_gone(pids, timeout: float = 5.0) -> list[int]:
    """Wait until none of `pids` runs; return those still running after `timeout`."""
    deadline = time.monotonic() + timeout
    alive = list(pids)
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if pid_alive(p)]
        time.sleep(0.02)
    return alive


def worker_pids(mesh) -> list[int]:
    return [row["pid"] for row in mesh.to_table().rows]


def _spawned(sizes: dict[str, int]):
    """A mesh for a fixture; afterwards, none of its workers is left."""
    from monarch.actor import this_host

    mesh = this_host().spawn_procs(sizes)
    pids = worker_pids(mesh)
    yield mesh
    mesh.exit()
    assert wait_gone(pids) == []


@pytest.fixture(scope="session")
def mesh8():
    """A {"host": 2, "gpu": 4} mesh shared by tests that do not break it."""
    yield from _spawned({"host": 2, "gpu": 4})


@pytest.fixture(scope="module")
def mesh():
    """A {"host": 2, "gpu": 2} mesh per test module (the tensor engine's tests break nothing in it)."""
    yield from _spawned({"host": 2, "gpu": 2})


@pytest.fixture(autouse=True)
def _no_stray_env(monkeypatch):
    monkeypatch.delenv("MONARCH_TRANSPORT", raising=False)
    yield


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
