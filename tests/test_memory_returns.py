"""Large results give their memory back: once the user lets go of them, the controller's RSS returns to
where it was (issue 30). A result's tensor is built on the received zmq frame (no copy), so anything in
the controller still holding the call's replies keeps the whole frame."""

import gc
import time

import pytest
import torch

import monarch

from conftest import _spawned

pytestmark = pytest.mark.timeout(90)

MiB = 1 << 20
SIZE = 256 * MiB
"""Bytes in each large result (float32)."""
BOUND = 64 * MiB
"""How far above its starting point the controller's RSS may stay once the results are released."""
LONG_CALL = 1.1
"""Seconds a call runs: longer than the controller's hang watcher sleeps between its looks at the calls in
flight (it kept the last one it looked at, replies and all, until its next look found another)."""


@pytest.fixture(scope="module")
def mesh1():
    yield from _spawned({"gpu": 1})


def rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def rss_back_to(limit: int, timeout: float = 30.0) -> int:
    """The controller's RSS once it is at most `limit`, or when `timeout` has passed."""
    deadline = time.monotonic() + timeout
    while True:
        gc.collect()
        now = rss()
        if now <= limit or time.monotonic() > deadline:
            return now
        time.sleep(0.05)


@monarch.remote
def ones(nbytes: int, seconds: float = 0.0):
    time.sleep(seconds)
    return torch.ones(nbytes // 4)


@monarch.remote
def pause(seconds: float) -> None:
    time.sleep(seconds)


def test_released_results_give_their_memory_back(mesh1):
    ones.on(mesh1)(MiB, LONG_CALL)  # warm; and long, so that what the hang watcher last saw is small
    gc.collect()
    before = rss()
    a = ones.on(mesh1)(SIZE, LONG_CALL)
    b = ones.on(mesh1)(SIZE, LONG_CALL)
    held = rss()
    assert a.item(gpu=0).shape == b.item(gpu=0).shape == (SIZE // 4,)
    assert held - before > SIZE // 2, "the results should be in the controller's memory (else this measures nothing)"
    del a, b
    after = rss_back_to(before + BOUND)
    assert after <= before + BOUND, (
        f"RSS {before / MiB:.0f} MiB before two {SIZE // MiB} MiB results, {held / MiB:.0f} MiB holding them, "
        f"{after / MiB:.0f} MiB after they were released (bound: +{BOUND // MiB} MiB)"
    )


def test_inspected_tensors_give_their_memory_back(mesh1):
    with mesh1.activate():
        t = torch.ones(SIZE // 4)
        small = torch.ones(MiB // 4)
    pause.on(mesh1).call_async(LONG_CALL)
    monarch.inspect(small)  # warm; and long, so that what the hang watcher last saw is small
    gc.collect()
    before = rss()
    got = []
    for _ in range(2):
        pause.on(mesh1).call_async(LONG_CALL)  # the fetch waits behind it: in flight for a while
        got.append(monarch.inspect(t))
    held = rss()
    assert all(g.shape == (SIZE // 4,) for g in got)
    assert held - before > SIZE // 2, "the values should be in the controller's memory (else this measures nothing)"
    del got
    after = rss_back_to(before + BOUND)
    assert after <= before + BOUND, (
        f"RSS {before / MiB:.0f} MiB before two {SIZE // MiB} MiB fetches, {held / MiB:.0f} MiB holding them, "
        f"{after / MiB:.0f} MiB after they were released (bound: +{BOUND // MiB} MiB)"
    )
    del t, small
