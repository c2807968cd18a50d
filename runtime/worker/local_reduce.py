"""An all-reduce through shared memory, for a group whose workers all run on this host (CPU tensors).

gloo's ring moves each rank's tensor through loopback TCP in 2(n-1) steps, each copied through the
kernel on the way out and again on the way in. Here each rank copies its piece of the tensor into its
slot of a segment the group shares, reduces its 1/n share across every slot in one pass, and copies the
whole result back: two copies and one pass (16 MB on 8 workers of a 2-core VM: 2.1-2.3x gloo's
`all_reduce`, `benchmarks/RESULTS.md`). Ranks meet at barriers: each writes a counter in its own cache
line and wakes the others through a futex on it (no atomics, no spinning, no sockets). Tensors larger
than a slot go through in slot-sized rounds, alternating between two sets of slots, so that two barriers
per round keep a fast rank from overwriting what a slow one still reads.

The failure flag every collective carries (which rank's input failed) rides along in each rank's line,
so one meeting does what two gloo all-reduces did.

No other user can touch it: the segment is a memfd of the group's first rank, with no name anywhere;
the others open it through ``/proc/<pid>/fd`` (which the kernel allows a process of the same user
only) and it is freed when the last of them closes it. Workers in one process namespace and under one
boot only (what `_here` compares); anything else keeps gloo. x86-64 only: a rank reads another's data
after seeing its counter, which x86's ordering of stores makes safe without fences.
"""

from __future__ import annotations

import ctypes
import datetime
import errno
import json
import mmap
import os
import platform
import time
from typing import Any

import torch

from monarch.runtime.common.processes import proc_state

SLOT = 1 << 20
"""Bytes of each rank's slot in each of the two sets: a tensor of more than n * SLOT bytes takes rounds."""
LINE = 64
"""Bytes per rank for its barrier counter and failure flag (a cache line: ranks never share one)."""
POLL = 0.1
"""Seconds a waiting rank sleeps before it looks whether a peer died, the wait timed out or was released."""
OPS = {"sum": "sum", "avg": "sum", "max": "amax", "min": "amin", "product": "prod"}
"""A reduction -> the torch function that reduces the slots' dimension (avg: the caller divides)."""
DTYPES = frozenset(
    {
        torch.float64,
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
    }  # fmt: skip
)
_FUTEX = {"x86_64": 202}.get(platform.machine())
_WAIT, _WAKE = 0, 1
_libc = ctypes.CDLL(None, use_errno=True) if _FUTEX is not None else None


class _Timespec(ctypes.Structure):
    _fields_ = [("sec", ctypes.c_long), ("nsec", ctypes.c_long)]


def usable(reduction: str, dtype: torch.dtype, device_type: str) -> bool:
    """Whether a reduce of this kind can go through shared memory (the same answer on every rank: it
    depends on the command only)."""
    return _FUTEX is not None and device_type == "cpu" and reduction in OPS and dtype in DTYPES


def _here() -> str:
    """This process's machine as the segment needs it: one boot, one process namespace, one user."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        return f"{boot}/{os.stat('/proc/self/ns/pid').st_ino}/{os.getuid()}"
    except OSError:
        return f"unknown/{os.getpid()}"  # (matches no other rank: the group keeps gloo)


class LocalReducer:
    """One group's segment, on one rank. Made collectively by `meet`; used by one thread (a stream's)."""

    def __init__(self, mm: mmap.mmap, n: int, me: int, pids: list[int], timeout: float) -> None:
        self.n, self.me, self.pids, self.timeout = n, me, pids, timeout
        self._mm = mm
        header = LINE * (n + 1)
        self._cells = (ctypes.c_int32 * (header // 4)).from_buffer(mm)
        self._base = ctypes.addressof(self._cells)
        self._abort = n * LINE // 4  # (the line after the ranks': set by `abort`, seen by every rank)
        self._sets = [
            torch.frombuffer(mm, dtype=torch.uint8, count=n * SLOT, offset=header + k * n * SLOT).view(n, SLOT)
            for k in range(2)
        ]
        self._epoch = 0
        self._round = 0
        self._poll = _Timespec(0, int(POLL * 1e9))

    def all_reduce(self, t: torch.Tensor, reduction: str, failed: int, out: torch.Tensor | None = None) -> int:
        """Reduce `t` across the group into `out` (contiguous, `t`'s shape and dtype; default: `t` itself, which
        must then be contiguous); `failed` is this rank's failure flag (0: none), the largest of all ranks' is
        returned."""
        out = t if out is None else out
        assert out.is_contiguous() and out.shape == t.shape and out.dtype == t.dtype and reduction in OPS
        src, flat = t.reshape(-1), out.view(-1)  # (no copy of `t` either way: it goes into the slots)
        fn = getattr(torch, OPS[reduction])
        keep = {"dtype": t.dtype} if fn in (torch.sum, torch.prod) else {}  # (not int64 for ints)
        per = SLOT // t.element_size()
        n, me, cells = self.n, self.me, self._cells
        if cells[self._abort]:
            raise RuntimeError("this group's collectives were released; it is re-formed before the next call")
        cells[me * LINE // 4 + 1] = failed
        culprit = 0
        for start in range(0, max(flat.numel(), 1), per):
            piece = flat[start : start + per]
            size = piece.numel()
            slots = self._sets[self._round & 1].view(t.dtype)
            self._round += 1
            slots[me, :size].copy_(src[start : start + size])
            self._barrier()
            if start == 0:
                culprit = max(cells[j * LINE // 4 + 1] for j in range(n))
            lo, hi = me * size // n, (me + 1) * size // n
            if hi > lo:
                fn(slots[:, lo:hi], dim=0, out=piece[lo:hi], **keep)
                slots[0, lo:hi].copy_(piece[lo:hi])
            self._barrier()
            if lo > 0:
                piece[:lo].copy_(slots[0, :lo])
            if hi < size:
                piece[hi:size].copy_(slots[0, hi:size])
        return culprit

    def _barrier(self) -> None:
        self._epoch += 1
        epoch, cells, line = self._epoch, self._cells, LINE // 4
        cells[self.me * line] = epoch
        _libc.syscall(_FUTEX, ctypes.c_void_p(self._base + self.me * LINE), _WAKE, 0x7FFFFFFF, None, None, 0)
        deadline = None
        for j in range(self.n):
            while (seen := cells[j * line]) < epoch:
                if cells[self._abort]:
                    raise RuntimeError("the collective was released (a rank failed or the call was interrupted)")
                addr = ctypes.c_void_p(self._base + j * LINE)
                if _libc.syscall(_FUTEX, addr, _WAIT, seen, ctypes.byref(self._poll), None, 0) == 0:
                    continue
                if ctypes.get_errno() != errno.ETIMEDOUT:
                    continue  # (EAGAIN: it moved on before we slept; EINTR: a signal)
                deadline = deadline or time.monotonic() + self.timeout - POLL
                self._check(j, deadline)

    def _check(self, j: int, deadline: float) -> None:
        if proc_state(self.pids[j]) in (None, "Z", "X"):  # (a zombie not reaped yet is dead too)
            raise RuntimeError(f"rank {j} of the group exited during the collective")
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank {j} of the group did not reach the collective in {self.timeout:.0f} s")

    def abort(self) -> None:
        """Make every rank's wait in this segment raise (any thread; `Groups.release`)."""
        cells = self._cells
        cells[self._abort] = 1
        for j in range(self.n):
            _libc.syscall(_FUTEX, ctypes.c_void_p(self._base + j * LINE), _WAKE, 0x7FFFFFFF, None, None, 0)


def meet(store: Any, me: int, n: int, timeout: float) -> LocalReducer | None:
    """Collectively (every rank of the group, at the same point of its commands): a segment shared by the
    group's `n` ranks, or None on every rank when they are not all on this machine or any cannot open it.
    `store` is the group's own prefix of the mesh's store."""
    assert _FUTEX is not None
    size = LINE * (n + 1) + 2 * n * SLOT
    here, fd = _here(), None
    if me == 0:
        try:
            fd = os.memfd_create("monarch-reduce", os.MFD_CLOEXEC)
            os.ftruncate(fd, size)
        except OSError:  # (no memfd here, or no memory for it: the group keeps gloo)
            if fd is not None:
                os.close(fd)
            fd = None
    keys = [f"who/{r}" for r in range(n)]
    store.set(keys[me], json.dumps([here, os.getpid(), fd]))
    store.wait(keys, _delta(timeout))
    who = [json.loads(v) for v in store.multi_get(keys)]
    mm = None
    try:
        if all(w[0] == here for w in who) and who[0][2] is not None:
            mm = _map(fd if me == 0 else None, who[0][1], who[0][2], size)
        store.set(f"opened/{me}", b"1" if mm is not None else b"0")
        if mm is None:
            return None
        opened = [f"opened/{r}" for r in range(n)]
        store.wait(opened, _delta(timeout))
        if any(v != b"1" for v in store.multi_get(opened)):
            mm.close()
            return None
    finally:
        if fd is not None:
            os.close(fd)  # (the mappings keep the memory while any rank holds one)
    return LocalReducer(mm, n, me, [w[1] for w in who], timeout)


def _map(fd: int | None, pid: int, their_fd: int, size: int) -> mmap.mmap | None:
    """Map the segment: rank 0's own fd, or its fd opened through /proc (None if that fails)."""
    try:
        mine = fd if fd is not None else os.open(f"/proc/{pid}/fd/{their_fd}", os.O_RDWR | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        st = os.fstat(mine)
        if st.st_size != size or st.st_uid != os.getuid():
            return None
        return mmap.mmap(mine, size)
    finally:
        if fd is None:
            os.close(mine)


def _delta(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)
