"""`monarch.rdma.RDMABuffer` on real worker processes: reads and writes between actors of different processes
through shared memory (the owner's later in-place updates seen), the transport forced
(`MONARCH_RDMA_PATH=transport`), the controller reading and writing, a buffer made in the controller's own
process, batches, bad destinations, a dropped buffer and a killed owner (a clear error, no hang, nothing left
running), and a GPU tensor through CUDA IPC (`@pytest.mark.gpu`)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile

import pytest
import torch

from monarch.actor import Actor, endpoint, this_host, this_proc
from monarch.rdma import RDMAAction, RDMABuffer, RDMAError, get_rdma_backend, is_ibverbs_available
from monarch.runtime.common import rdma as rdma_impl

from conftest import wait_gone, worker_pids

pytestmark = pytest.mark.timeout(90)

N = 1000
"""Floats in the owner's weights: 4000 bytes, which the transport carries inside its pickle (under 4 KiB)."""
BIG = 300_000
"""Floats of a larger buffer: 1.2 MB, which the transport carries as frames of their own (out of band)."""


class Owner(Actor):
    """Holds weights and hands out buffers over them, as Monarch's learner does."""

    def __init__(self, n: int = N) -> None:
        self.w = torch.arange(n, dtype=torch.float32)
        self.bufs: list[RDMABuffer] = []

    @endpoint
    def buffer(self) -> RDMABuffer:
        buf = RDMABuffer(self.w.view(torch.uint8).flatten())
        self.bufs.append(buf)
        return buf

    @endpoint
    def halves(self) -> tuple[RDMABuffer, RDMABuffer]:
        """Two buffers over two halves of one storage (views with an offset)."""
        h = self.w.numel() // 2
        return RDMABuffer(self.w[:h].view(torch.uint8)), RDMABuffer(self.w[h:].view(torch.uint8))

    @endpoint
    def foreign(self) -> RDMABuffer:
        """A buffer over memory torch did not allocate (a numpy array's): it must stay where it is."""
        import numpy as np

        self.array = np.arange(N, dtype=np.float32)
        return RDMABuffer(torch.from_numpy(self.array))

    @endpoint
    def bump_array(self) -> None:
        self.array += 10  # through numpy: the buffer must still be this memory

    @endpoint
    def step(self) -> float:
        self.w.add_(1)  # in place, as an optimizer's step: readers must see it
        return float(self.w[0])

    @endpoint
    def weights(self) -> torch.Tensor:
        return self.w.clone()

    @endpoint
    def drop(self, buf: RDMABuffer) -> None:
        buf.drop().get()

    @endpoint
    def pid(self) -> int:
        return os.getpid()

    @endpoint
    def paths(self) -> dict[str, int]:
        return dict(rdma_impl.paths)


class Reader(Actor):
    @endpoint
    def read(self, buf: RDMABuffer) -> torch.Tensor:
        dst = torch.zeros(buf.size() // 4, dtype=torch.float32)
        buf.read_into(dst.view(torch.uint8).flatten()).get()
        return dst

    @endpoint
    async def read_async(self, buf: RDMABuffer) -> torch.Tensor:
        dst = torch.zeros(buf.size() // 4, dtype=torch.float32)
        await buf.read_into(dst.view(torch.uint8).flatten())
        return dst

    @endpoint
    def write(self, buf: RDMABuffer, value: float) -> None:
        buf.write_from(torch.full((buf.size() // 4,), value).view(torch.uint8)).get()

    @endpoint
    def read_both(self, a: RDMABuffer, b: RDMABuffer) -> torch.Tensor:
        """Both buffers into one tensor, as one batch (`RDMAAction`)."""
        h = a.size() // 4
        dst = torch.zeros(h + b.size() // 4, dtype=torch.float32)
        RDMAAction().read_remote(dst[:h].view(torch.uint8), a).read_remote(dst[h:].view(torch.uint8), b).submit().get()
        return dst

    @endpoint
    def error_of(self, buf: RDMABuffer, timeout: int = 60) -> str:
        """Read `buf`, expecting a failure: its class and message."""
        try:
            buf.read_into(torch.zeros(buf.size(), dtype=torch.uint8), timeout=timeout).get()
        except Exception as e:
            return f"{type(e).__name__}: {e}"
        return "no error"

    @endpoint
    def paths(self) -> dict[str, int]:
        return dict(rdma_impl.paths)


def _spawned(env: dict[str, str] | None = None):
    old = {k: os.environ.get(k) for k in env or {}}
    os.environ.update(env or {})
    try:
        procs = this_host().spawn_procs({"gpu": 1})
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return procs


@pytest.fixture(scope="module")
def meshes():
    """An owner's process, a reader's, and a reader whose reads go through the transport."""
    owner_procs, reader_procs = _spawned(), _spawned()
    transport_procs = _spawned({"MONARCH_RDMA_PATH": "transport"})
    all_procs = [owner_procs, reader_procs, transport_procs]
    pids = [p for m in all_procs for p in worker_pids(m)]
    yield (
        owner_procs.spawn("owner", Owner),
        reader_procs.spawn("reader", Reader),
        transport_procs.spawn("reader", Reader),
    )
    for m in all_procs:
        m.exit()
    assert wait_gone(pids) == []


def _delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {
        k: after.get(k, 0) - before.get(k, 0) for k in set(before) | set(after) if after.get(k, 0) != before.get(k, 0)
    }


def test_the_module_is_light_and_says_what_it_is():
    code = (
        "import sys, monarch.rdma\n"
        "from monarch.rdma import RDMABuffer, RDMAAction, RDMAError, get_rdma_backend\n"
        "print(sorted(m for m in ('torch', 'zmq') if m in sys.modules))\n"
    )
    # (outside the checkout: `import monarch` is then the installed package, as a user's script gets it)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tempfile.gettempdir())
    assert out.returncode == 0, out.stderr
    out = out.stdout
    assert out.strip() == "[]"
    import monarch.rdma

    monarchs = ["get_rdma_backend", "is_ibverbs_available", "is_rdma_available", "RDMABuffer", "RDMAAction",
                "RDMAReadTransferWarning", "RDMATcpFallbackWarning", "RDMAWriteTransferWarning"]  # fmt: skip
    assert set(monarchs) <= set(monarch.rdma.__all__)
    assert get_rdma_backend() == "tcp" and is_ibverbs_available() is False
    with pytest.warns(DeprecationWarning):
        assert monarch.rdma.is_rdma_available() is False


def test_a_read_between_two_processes_goes_through_shared_memory_and_sees_later_updates(meshes):
    owner, reader, _ = meshes
    buf = owner.buffer.call_one().get()
    assert buf.size() == 4 * N and "owner" in buf.owner
    before_r, before_o = reader.paths.call_one().get(), owner.paths.call_one().get()
    assert torch.equal(reader.read.call_one(buf).get(), torch.arange(N, dtype=torch.float32))
    owner.step.call_one().get()  # an in-place update after the buffer was made and read
    assert torch.equal(reader.read.call_one(buf).get(), torch.arange(N, dtype=torch.float32) + 1)
    assert torch.equal(reader.read_async.call_one(buf).get(), torch.arange(N, dtype=torch.float32) + 1)
    reader.write.call_one(buf, 7.0).get()
    assert torch.equal(owner.weights.call_one().get(), torch.full((N,), 7.0))
    # the reader copied through the mapping; the owner served nothing (one-sided)
    assert _delta(before_r, reader.paths.call_one().get()) == {"shm": 4}
    assert _delta(before_o, owner.paths.call_one().get()) == {}


def test_the_transport_path_forced_reads_writes_and_sees_later_updates(meshes):
    owner, _, far = meshes
    buf = owner.buffer.call_one().get()
    before_r, before_o = far.paths.call_one().get(), owner.paths.call_one().get()
    now = owner.weights.call_one().get()
    assert torch.equal(far.read.call_one(buf).get(), now)
    owner.step.call_one().get()
    assert torch.equal(far.read_async.call_one(buf).get(), now + 1)
    far.write.call_one(buf, 3.0).get()
    assert torch.equal(owner.weights.call_one().get(), torch.full((N,), 3.0))
    assert _delta(before_r, far.paths.call_one().get()) == {"transport": 3}
    assert _delta(before_o, owner.paths.call_one().get()) == {"served": 3}


def test_large_buffers_and_views_with_an_offset(meshes):
    owner_procs = this_host().spawn_procs({"gpu": 1})
    pids = worker_pids(owner_procs)
    try:
        big = owner_procs.spawn("big", Owner, BIG)
        _, reader, far = meshes
        a, b = big.halves.call_one().get()
        want = torch.arange(BIG, dtype=torch.float32)
        for r in (reader, far):  # shared memory, the transport
            assert torch.equal(r.read_both.call_one(a, b).get(), want)
        big.step.call_one().get()
        assert torch.equal(far.read.call_one(b).get(), want[BIG // 2 :] + 1)
        want += 1
        got = torch.zeros(BIG, dtype=torch.float32)
        h = BIG // 2
        RDMAAction().read_remote(got[:h].view(torch.uint8), a).read_remote(got[h:].view(torch.uint8), b).submit().get()
        assert torch.equal(got, want)
        os.environ["MONARCH_RDMA_PATH"] = "transport"  # the controller's own transport: live functions
        try:
            got.zero_()
            a.read_into(got[:h].view(torch.uint8)).get()
            b.write_from(torch.full((BIG - h,), -1.0).view(torch.uint8)).get()
        finally:
            del os.environ["MONARCH_RDMA_PATH"]
        assert torch.equal(got[:h], want[:h])
        assert torch.equal(big.weights.call_one().get()[h:], torch.full((BIG - h,), -1.0))
    finally:
        owner_procs.exit()
        assert wait_gone(pids) == []


def test_memory_torch_did_not_allocate_stays_put_and_takes_the_transport(meshes):
    owner, reader, _ = meshes
    buf = owner.foreign.call_one().get()
    assert buf._h.kind == "none"
    before = reader.paths.call_one().get()
    owner.bump_array.call_one().get()
    assert torch.equal(reader.read.call_one(buf).get(), torch.arange(N, dtype=torch.float32) + 10)
    assert _delta(before, reader.paths.call_one().get()) == {"transport": 1}


def test_the_controller_reads_and_writes_a_workers_buffer(meshes):
    owner, _, _ = meshes
    buf = owner.buffer.call_one().get()
    dst = torch.zeros(N, dtype=torch.float32)
    before = dict(rdma_impl.paths)
    buf.read_into(dst.view(torch.uint8)).get()
    assert torch.equal(dst, owner.weights.call_one().get())
    buf.write_from(torch.full((N // 2,), 5.0).view(torch.uint8)).get()  # a shorter source: the buffer's start
    w = owner.weights.call_one().get()
    assert torch.equal(w[: N // 2], torch.full((N // 2,), 5.0)) and torch.equal(w[N // 2 :], dst[N // 2 :])
    os.environ["MONARCH_RDMA_PATH"] = "transport"
    try:
        buf.read_into(dst.view(torch.uint8)).get()
        buf.write_from(torch.full((N,), 6.0).view(torch.uint8)).get()
    finally:
        del os.environ["MONARCH_RDMA_PATH"]
    assert torch.equal(dst, w) and torch.equal(owner.weights.call_one().get(), torch.full((N,), 6.0))
    assert _delta(before, dict(rdma_impl.paths)) == {"shm": 2, "transport": 2}


class LocalOwner(Actor):
    def __init__(self) -> None:
        self.w = torch.arange(N, dtype=torch.float32)

    @endpoint
    def buffer(self) -> RDMABuffer:
        return RDMABuffer(self.w.view(torch.uint8).flatten())

    @endpoint
    def step(self) -> None:
        self.w.mul_(2)


def test_a_buffer_made_in_the_controllers_process_reaches_its_workers(meshes):
    _, reader, far = meshes
    local = this_proc().spawn("local-owner", LocalOwner)
    buf = local.buffer.call_one().get()
    local.step.call_one().get()
    want = torch.arange(N, dtype=torch.float32) * 2
    assert torch.equal(reader.read.call_one(buf).get(), want)
    # the controller's process has no transport: even a reader told to use it reads through shared memory
    assert torch.equal(far.read.call_one(buf).get(), want)
    dst = torch.zeros(N, dtype=torch.float32)
    buf.read_into(dst.view(torch.uint8)).get()  # its own process: a plain copy
    assert torch.equal(dst, want)
    buf.drop().get()
    assert "it was dropped" in str(pytest.raises(RDMAError, buf.read_into(dst.view(torch.uint8)).get).value)
    assert "its owner dropped it" in reader.error_of.call_one(buf).get()
    local.stop()


def test_bad_destinations_and_sources_are_named(meshes):
    owner, _, _ = meshes
    buf = owner.buffer.call_one().get()
    with pytest.raises(ValueError, match=r"dst has 3999 bytes, the buffer 4000 .*at least 4000 bytes"):
        buf.read_into(torch.zeros(3999, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"src has 4004 bytes, the buffer 4000 .*at most 4000 bytes"):
        buf.write_from(torch.zeros(1001, dtype=torch.float32))
    with pytest.raises(ValueError, match=r"1-D contiguous tensor .*shape \(10, 400\)"):
        buf.read_into(torch.zeros(10, 400, dtype=torch.uint8))
    with pytest.raises(ValueError, match="1-D contiguous"):
        buf.read_into(torch.zeros(8000, dtype=torch.uint8)[::2])
    with pytest.raises(TypeError, match="needs a torch.Tensor or a memoryview, got list"):
        buf.read_into([0] * 4000)
    with pytest.raises(ValueError, match="read-only"):
        buf.read_into(memoryview(bytes(4000)))
    with pytest.raises(ValueError, match="size 0"):
        RDMABuffer(torch.zeros(0, dtype=torch.uint8))
    with pytest.raises(ValueError, match="timeout=-1"):
        buf.read_into(torch.zeros(4000, dtype=torch.uint8), timeout=-1)
    dst = bytearray(4000)  # a memoryview destination works too
    buf.read_into(memoryview(dst)).get()
    assert torch.equal(torch.frombuffer(dst, dtype=torch.float32), owner.weights.call_one().get())


def test_a_bad_path_setting_is_named(monkeypatch, meshes):
    owner, _, _ = meshes
    buf = owner.buffer.call_one().get()
    monkeypatch.setenv("MONARCH_RDMA_PATH", "rdma")
    with pytest.raises(ValueError, match="MONARCH_RDMA_PATH='rdma'; use 'auto' .* or 'transport'"):
        buf.read_into(torch.zeros(4000, dtype=torch.uint8))


def test_a_dropped_buffer_is_a_clear_error_on_every_path(meshes):
    owner, reader, far = meshes
    buf = owner.buffer.call_one().get()
    assert torch.equal(reader.read.call_one(buf).get(), owner.weights.call_one().get())  # (mapped and cached)
    owner.drop.call_one(buf).get()
    shm = reader.error_of.call_one(buf).get()
    assert shm.startswith("RDMAError: RDMABuffer.read_into:") and buf._h.id in shm and "its owner dropped it" in shm
    transport = far.error_of.call_one(buf).get()
    assert transport.startswith("RDMAError:") and "was dropped by its owner" in transport
    with pytest.raises(RDMAError, match="its owner dropped it"):
        buf.read_into(torch.zeros(4000, dtype=torch.uint8)).get()
    # a reader may drop too (through the owner): the other buffers go on
    other = owner.buffer.call_one().get()
    other.drop().get()
    assert "its owner dropped it" in reader.error_of.call_one(other).get()
    assert torch.equal(reader.read.call_one(owner.buffer.call_one().get()).get(), owner.weights.call_one().get())


def test_a_killed_owner_is_a_clear_error_and_nothing_hangs(meshes):
    _, reader, far = meshes
    owner_procs = this_host().spawn_procs({"gpu": 1})
    pids = worker_pids(owner_procs)
    owner = owner_procs.spawn("doomed", Owner)
    buf = owner.buffer.call_one().get()
    assert torch.equal(reader.read.call_one(buf).get(), torch.arange(N, dtype=torch.float32))
    os.kill(owner.pid.call_one().get(), signal.SIGKILL)
    assert wait_gone(pids) == []
    for r in (reader, far):  # shared memory; the transport (which looks whether the owner lives as it waits)
        got = r.error_of.call_one(buf, timeout=60).get()
        assert got.startswith("RDMAError:") and "its owner process" in got and "exited" in got, got
    with pytest.raises(RDMAError, match="exited"):
        buf.read_into(torch.zeros(4000, dtype=torch.uint8)).get()
    os.environ["MONARCH_RDMA_PATH"] = "transport"
    try:
        with pytest.raises(RDMAError, match="its owner process died"):
            buf.read_into(torch.zeros(4000, dtype=torch.uint8)).get(timeout=30)
    finally:
        del os.environ["MONARCH_RDMA_PATH"]
    owner_procs.exit()
    assert wait_gone(pids) == []


class GpuOwner(Actor):
    def __init__(self) -> None:
        self.w = torch.arange(N, dtype=torch.float32, device="cuda")

    @endpoint
    def buffer(self) -> RDMABuffer:
        return RDMABuffer(self.w.view(torch.uint8).flatten())

    @endpoint
    def step(self) -> None:
        self.w.add_(1)
        torch.cuda.synchronize()

    @endpoint
    def weights(self) -> torch.Tensor:
        return self.w.cpu()


class GpuReader(Actor):
    @endpoint
    def read(self, buf: RDMABuffer, device: str) -> tuple[torch.Tensor, dict[str, int]]:
        dst = torch.zeros(N, dtype=torch.float32, device=device)
        buf.read_into(dst.view(torch.uint8)).get()
        return dst.cpu(), dict(rdma_impl.paths)

    @endpoint
    def write(self, buf: RDMABuffer, value: float) -> None:
        buf.write_from(torch.full((N,), value, device="cuda").view(torch.uint8)).get()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_gpu_tensor_goes_through_cuda_ipc_and_the_transport():
    a, b = this_host().spawn_procs({"gpu": 1}), this_host().spawn_procs({"gpu": 1})
    c = _spawned({"MONARCH_RDMA_PATH": "transport"})
    pids = [p for m in (a, b, c) for p in worker_pids(m)]
    try:
        owner = a.spawn("gpu-owner", GpuOwner)
        near, far = b.spawn("gpu-reader", GpuReader), c.spawn("gpu-reader", GpuReader)
        buf = owner.buffer.call_one().get()
        assert buf._h.kind == "cuda"
        want = torch.arange(N, dtype=torch.float32)
        for device in ("cuda", "cpu"):
            got, paths = near.read.call_one(buf, device).get()
            assert torch.equal(got, want) and paths.get("cuda", 0) >= 1
        owner.step.call_one().get()
        got, paths = far.read.call_one(buf, "cuda").get()
        assert torch.equal(got, want + 1) and paths.get("transport", 0) >= 1 and not paths.get("cuda")
        near.write.call_one(buf, 4.0).get()
        assert torch.equal(owner.weights.call_one().get(), torch.full((N,), 4.0))
        far.write.call_one(buf, 5.0).get()
        assert torch.equal(owner.weights.call_one().get(), torch.full((N,), 5.0))
        dst = torch.zeros(N, dtype=torch.float32)
        buf.read_into(dst.view(torch.uint8)).get()  # the controller: CUDA IPC into a CPU tensor
        assert torch.equal(dst, torch.full((N,), 5.0))
    finally:
        for m in (a, b, c):
            m.exit()
        assert wait_gone(pids) == []
