import os
import signal
import time

import pytest

# A suite started in the background of a non-interactive shell inherits SIGINT ignored: Python then installs no
# KeyboardInterrupt handler, and the processes it starts keep ignoring it. The Ctrl-C tests need what a terminal
# gives: SIGINT raising KeyboardInterrupt, here and in the scripts the tests run.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def pid_alive(pid: int) -> bool:
    """True while `pid` runs (a zombie counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):  # (the latter: gone while being read)
        return False


def wait_for(check, timeout: float = 30.0, what: str = "it") -> None:
    """Wait until `check()` is true (an observable state, instead of a fixed sleep); fail naming `what`."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not happen within {timeout:.0f} s")
        time.sleep(0.01)


def started(marker: str, n: int) -> bool:
    """Whether `n` ranks wrote their `marker` file (``<marker>.<rank>``: see `say_started`)."""
    import glob

    return len(glob.glob(glob.escape(marker) + ".*")) >= n


def say_started(marker: str) -> None:
    """On a worker: write ``<marker>.<rank>``, so a test can wait for the call to have started there."""
    import monarch

    rank = monarch.current_rank()
    with open(f"{marker}.{'-'.join(str(v) for v in rank.values())}", "w"):
        pass


def wait_gone(pids, timeout: float = 30.0) -> list[int]:
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


@pytest.fixture(autouse=True, scope="session")
def _output_dir(tmp_path_factory):
    """Cells' whole outputs (MONARCH_OUTPUT_DIR) go to a folder of the test run, not the user's home; kernels
    and JupyterLab started by tests inherit it."""
    os.environ["MONARCH_OUTPUT_DIR"] = str(tmp_path_factory.mktemp("monarch-output"))
    yield


@pytest.fixture(autouse=True)
def _no_stray_env(monkeypatch):
    monkeypatch.delenv("MONARCH_TRANSPORT", raising=False)
    yield


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
