"""`RDMABuffer`, Monarch's one-sided reads and writes of another process's memory, without RDMA hardware.

An actor makes ``RDMABuffer(t.view(torch.uint8).flatten())`` over a live tensor and hands the buffer out (it
pickles: a few hundred bytes naming the memory, never the bytes); whoever holds it calls
``buf.read_into(dst)`` or ``buf.write_from(src)`` and waits on the future (``.get()`` or ``await``). The bytes
move one of two ways:

- **Shared memory, on one host.** Making a buffer moves a CPU tensor's storage into an unlinked shared-memory
  file in place (torch's ``file_descriptor`` sharing: every tensor and view of that storage then lives in it,
  so the optimizer's later in-place updates are what a later read sees) and keeps a descriptor of that file
  open for as long as the buffer is registered. Another process of the same user, on the same machine, opens
  it through ``/proc/<owner pid>/fd/<fd>`` (which the kernel allows the same user only) and maps it once: a
  read is one copy from the mapping, a write one copy into it, with no help from the owner. A CUDA tensor is
  opened with CUDA IPC instead (torch's own rebuild of a storage from its IPC handle), the descriptor then a
  token of the registration.
- **The transport, otherwise** (another host, another user, memory that cannot be moved, or
  ``MONARCH_RDMA_PATH=transport``). The reader asks the owner process for the bytes (or sends them): from a
  worker, a signed message to the owner's inbox (the hidden actor ``__monarch_rdma__``,
  `runtime/worker/rdma.py`); from the controller, a live-function call on the owner's rank
  (`runtime/actors/rdma.py`). The owner answers between its messages (or while it waits for anything).

Before each copy the reader checks that the owner still holds the buffer: the descriptor it named, at the
same file (device and inode recorded at creation: a number reused for another file is refused), in a live
process; a buffer dropped or an owner gone raises `RDMAError` naming the buffer and why, at once.

The two sides (worker, controller) are named by module, not imported (`_side`): this module sits below both.
Nothing here imports torch or zmq until a buffer is used.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import importlib
import os
import secrets
import socket
import sys
import threading
import time
import warnings
from dataclasses import dataclass
from typing import Any

from monarch.runtime.common import actors as shared
from monarch.runtime.common import config, context
from monarch.runtime.common.processes import proc_state

WORKER_SIDE = "monarch.runtime.worker.rdma"
"""The worker's half: the hidden actor that serves the transport, and a worker's transport calls."""
CONTROLLER_SIDE = "monarch.runtime.actors.rdma"
"""The controller's half: its transport calls, live functions on the owner's rank."""
POLL = 0.2
"""Seconds between looks, while a transport operation waits, at whether the owner process still lives."""
MAX_MAPPINGS = 4096
"""Mappings of other processes' buffers a process keeps (the oldest go first; stale ones as they are seen)."""


paths: collections.Counter[str] = collections.Counter()
"""How this process's reads and writes went, counted: ``local`` (a buffer of its own), ``shm``, ``cuda`` (CUDA
IPC), ``transport``; ``served``: transport requests it answered as an owner. To see which path buffers take."""


class RDMAReadTransferWarning(Warning):
    """Monarch's warning class, kept for code that filters it (nothing here warns with it)."""


class RDMAWriteTransferWarning(Warning):
    """Monarch's warning class, kept for code that filters it (nothing here warns with it)."""


class RDMATcpFallbackWarning(Warning):
    """Monarch warns with it when it falls back from ibverbs to TCP; nothing here does (our paths are the
    design, not a fallback), and code that filters it keeps working."""


class RDMAError(RuntimeError):
    """A buffer that cannot be read or written: its owner dropped it or exited, or it cannot be reached from
    here. The message names the buffer and why."""


def is_ibverbs_available() -> bool:
    """Whether buffers move over ibverbs here: never (shared memory on one host, the signed actor transport
    across hosts), so False on every machine."""
    return False


def is_rdma_available() -> bool:
    """Deprecated in Monarch (ambiguous): whether RDMA over ibverbs is available, which is never here. Use
    `get_rdma_backend()` to learn whether `RDMABuffer` works (it always does)."""
    warnings.warn(
        "is_rdma_available is deprecated (Monarch's wording: ambiguous with several backends); use "
        "is_ibverbs_available() or get_rdma_backend() instead",
        DeprecationWarning,
        stacklevel=2,
    )
    return is_ibverbs_available()


def get_rdma_backend() -> str:
    """``"tcp"``: Monarch's name for the backend that works without ibverbs hardware. Here buffers always work:
    through shared memory (or CUDA IPC) on one host, the signed actor transport otherwise."""
    return "tcp"


# -- who and where this process is ---------------------------------------------------------------------
@functools.cache
def _host() -> str:
    """This machine as shared memory needs it: one boot, one process namespace, one user."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        return f"{boot}/{os.stat('/proc/self/ns/pid').st_ino}/{os.getuid()}"
    except OSError:
        return f"unknown/{socket.gethostname()}/{os.getpid()}"  # (no other process matches: the transport)


def _start_time(pid: int) -> int | None:
    """When process `pid` started (clock ticks since boot), or None when it is gone: with the pid, it names
    one process for good (a pid can be reused, not with the same start time)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


_me: tuple[int, int | None] | None = None


def _myself() -> tuple[int, int | None]:
    """(pid, start time) of this process (a forked child has its own)."""
    global _me
    pid = os.getpid()
    if _me is None or _me[0] != pid:
        _me = (pid, _start_time(pid))
    return _me


# -- what the caller passes ------------------------------------------------------------------------------
def _torch() -> Any:
    return sys.modules.get("torch")


def _local(obj: Any, what: str, *, writable: bool) -> tuple[Any, int]:
    """`obj` (a 1-D contiguous tensor or a C-contiguous memoryview) as a flat view of its bytes, and their
    count; a clear error for anything else."""
    torch = _torch()
    if torch is not None and isinstance(obj, torch.Tensor):
        if obj.layout != torch.strided or obj.device.type not in ("cpu", "cuda"):
            raise ValueError(f"{what}: needs a CPU or CUDA tensor of plain (strided) memory, got one on "
                             f"{obj.device} with layout {obj.layout}")  # fmt: skip
        if obj.dim() != 1 or not obj.is_contiguous():
            raise ValueError(
                f"{what}: needs a 1-D contiguous tensor (for example t.view(torch.uint8).flatten()), got shape "
                f"{tuple(obj.shape)} with strides {obj.stride()}"
            )
        if type(obj) is torch.Tensor and obj.dtype == torch.uint8 and not obj.requires_grad:
            return obj, obj.numel()  # (the common case, made cheap: a read of 1 MB takes tens of µs)
        try:
            flat = obj.detach().view(torch.uint8)
            flat.untyped_storage()
        except (RuntimeError, NotImplementedError) as e:
            raise ValueError(f"{what}: {type(obj).__name__} has no memory of its own to share ({e})") from None
        return flat, flat.numel()
    if isinstance(obj, memoryview):
        if not obj.c_contiguous:
            raise ValueError(f"{what}: needs a C-contiguous memoryview, got one with strides {obj.strides}")
        if writable and obj.readonly:
            raise ValueError(f"{what}: the memoryview is read-only, and this writes into it")
        return obj.cast("B") if obj.format != "B" or obj.ndim != 1 else obj, obj.nbytes
    raise TypeError(f"{what}: needs a torch.Tensor or a memoryview, got {type(obj).__name__}")


def _as_tensor(flat: Any) -> Any:
    """A flat uint8 tensor over `flat` (a tensor already, or a memoryview: no copy)."""
    torch = _torch()
    if torch is not None and isinstance(flat, torch.Tensor):
        return flat
    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (a read-only memoryview: only read from here)
        return torch.frombuffer(flat, dtype=torch.uint8) if len(flat) else torch.empty(0, dtype=torch.uint8)


def copy_bytes(dst: Any, src: Any, size: int) -> None:
    """Copy `size` bytes from flat `src` into flat `dst` (tensors or memoryviews, any devices): one copy."""
    d, s = _as_tensor(dst), _as_tensor(src)
    (d if d.numel() == size else d[:size]).copy_(s if s.numel() == size else s[:size])
    if d.is_cuda or s.is_cuda:
        _torch().cuda.current_stream(d.device if d.is_cuda else s.device).synchronize()


# -- the buffers this process owns -----------------------------------------------------------------------
@dataclass
class _Owned:
    """A buffer registered by this process: the memory is held until `drop()`."""

    data: Any
    """Its bytes: a flat uint8 tensor (CPU or CUDA), or a flat memoryview."""
    fd: int
    """The descriptor readers on this host check (-1: none); closed at drop."""
    readonly: bool
    """A read-only memoryview: writes are refused."""


_owned: dict[str, _Owned] = {}
_lock = threading.Lock()


def owned(buffer_id: str) -> _Owned | None:
    """The buffer `buffer_id` as this process registered it, or None once dropped (or never made here)."""
    return _owned.get(buffer_id)


def unregister(buffer_id: str) -> bool:
    """Forget buffer `buffer_id` (its memory is no longer held for it; readers on this host see it dropped at
    their next use); whether it was registered."""
    with _lock:
        got = _owned.pop(buffer_id, None)
    if got is None:
        return False
    if got.fd >= 0:
        os.close(got.fd)
    return True


def serve_read(buffer_id: str) -> Any:
    """The owner's answer to a transport read: the buffer's bytes as a flat uint8 tensor (it travels out of
    band, not copied into the pickle), or why not (a string)."""
    got = _owned.get(buffer_id)
    if got is None:
        return f"buffer {buffer_id} was dropped by its owner (or its owner never made it)"
    paths["served"] += 1
    return _as_tensor(got.data)


def serve_write(buffer_id: str, data: Any) -> str | None:
    """The owner's side of a transport write: copy `data`'s bytes into the buffer; None, or why not."""
    got = _owned.get(buffer_id)
    if got is None:
        return f"buffer {buffer_id} was dropped by its owner (or its owner never made it)"
    if got.readonly:
        return f"buffer {buffer_id} is a read-only memoryview"
    size = len(data) if isinstance(data, memoryview | bytes | bytearray) else data.numel()
    if size > _length(got.data):
        return f"buffer {buffer_id} holds {_length(got.data)} bytes, the data {size}"
    paths["served"] += 1
    copy_bytes(got.data, data, size)
    return None


def _length(flat: Any) -> int:
    return flat.nbytes if isinstance(flat, memoryview) else flat.numel()


@dataclass(frozen=True)
class Handle:
    """Everything a reader needs to reach a buffer: what it pickles to (a few hundred bytes, never the data)."""

    id: str
    """Random, unique to this buffer."""
    size: int
    """Its length in bytes."""
    owner: str
    """Who made it, for messages: the actor and process."""
    pid: int
    """The owner process."""
    start: int | None
    """The owner process's start time (with `pid`, names it for good)."""
    host: str
    """The owner's machine as shared memory needs it (`_host`); `hostname` is for people."""
    hostname: str
    kind: str
    """``shm`` (a shared-memory file), ``cuda`` (a CUDA IPC handle) or ``none`` (the transport only)."""
    fd: int = -1
    """The descriptor readers open (``shm``) or check (``cuda``) through /proc/<pid>/fd."""
    dev: int = 0
    """The descriptor's file: device and inode, recorded at creation (a reused number is refused)."""
    ino: int = 0
    offset: int = 0
    """Where the bytes start in the shared-memory file."""
    cuda: tuple | None = None
    """torch's arguments to rebuild the CUDA memory from its IPC handle (`rebuild_cuda_tensor`)."""
    inbox: tuple[str, bytes | None, bytes] | None = None
    """The owner worker's inbox (address, CURVE key, signing key), for the transport; None: the controller's
    own process, which other processes reach through shared memory only."""
    mesh_id: int | None = None
    """The owner worker's mesh and rank (the controller's transport calls it there)."""
    rank: int | None = None


def _shm_room(nbytes: int) -> bool:
    """Whether /dev/shm has room for `nbytes` more (a tmpfs past its size kills the process writing it)."""
    try:
        st = os.statvfs("/dev/shm")
    except OSError:
        return False
    return st.f_bavail * st.f_frsize > 2 * nbytes


def _share(flat: Any) -> dict[str, Any]:
    """Make `flat`'s memory reachable from other processes on this host, in place; the `Handle` fields."""
    torch = _torch()
    if torch is None or not isinstance(flat, torch.Tensor):
        return {"kind": "none"}
    if flat.is_cuda:
        from torch.multiprocessing.reductions import reduce_tensor

        try:
            _, args = reduce_tensor(flat)
            token = os.memfd_create("monarch-rdma", os.MFD_CLOEXEC)
        except (RuntimeError, OSError):
            return {"kind": "none"}
        st = os.fstat(token)
        return {"kind": "cuda", "cuda": tuple(args), "fd": token, "dev": st.st_dev, "ino": st.st_ino}
    storage = flat.untyped_storage()
    if not storage.is_shared() and (not storage.resizable() or not _shm_room(storage.nbytes())):
        # memory torch did not allocate (from_numpy, frombuffer) cannot move without leaving its owner behind
        return {"kind": "none"}
    try:
        fd, _ = storage._share_fd_cpu_()  # (in place: every view of the storage now lives in the file)
        mine = os.dup(fd)  # ours: open while the buffer is registered, whatever torch does with its own
    except (RuntimeError, OSError):
        return {"kind": "none"}
    st = os.fstat(mine)
    offset = flat.data_ptr() - storage.data_ptr()
    return {"kind": "shm", "fd": mine, "dev": st.st_dev, "ino": st.st_ino, "offset": offset}


def _who() -> str:
    """The actor (if any) and process making a buffer, as messages name its owner."""
    current = shared.current()
    actor = f"actor {current.actor_instance.name!r} on " if current is not None else ""
    w = context.worker
    place = f"worker rank {w.rank}" if w is not None else "the controller's process"
    return f"{actor}{place} (pid {os.getpid()} on {socket.gethostname()})"


def _side() -> Any:
    """This process's half (the worker's or the controller's), imported by name: this module sits below both,
    as `RemoteFunction.by_name` names worker code."""
    return importlib.import_module(WORKER_SIDE if context.worker is not None else CONTROLLER_SIDE)


# -- readers' mappings of other processes' buffers ---------------------------------------------------------
_maps: collections.OrderedDict[tuple[int, int, int, int], tuple[Any, dict[str, Any]]] = collections.OrderedDict()
"""(owner pid, descriptor, device, inode) -> (that memory mapped here as a flat uint8 tensor: a whole
shared-memory file, or CUDA memory; each buffer's bytes in it, by buffer id), least recently used first."""
_maps_lock = threading.Lock()


def _registered(h: Handle) -> str | None:
    """None while `h`'s owner still holds it; else why not, as a sentence ("denied": this process may not
    open the owner's descriptors)."""
    try:
        st = os.stat(f"/proc/{h.pid}/fd/{h.fd}")
    except PermissionError:
        return "denied"
    except OSError:
        st = None
    if st is not None and (st.st_dev, st.st_ino) == (h.dev, h.ino):
        return None
    if _start_time(h.pid) != h.start or proc_state(h.pid) in (None, "Z", "X"):
        return f"its owner process (pid {h.pid}) exited"
    return "its owner dropped it (the owner process no longer holds its memory)"


def _key(h: Handle) -> tuple[int, int, int, int]:
    return (h.pid, h.fd, h.dev, h.ino)


def _view(h: Handle) -> Any:
    """`h`'s bytes in this process (a flat uint8 tensor over the owner's memory), mapped once per (process,
    descriptor, file); None when its memory cannot be opened here."""
    key = _key(h)
    got = _maps.get(key)
    if got is None:
        whole = _map(h)
        if whole is None:
            return None
        with _maps_lock:
            got = _maps.setdefault(key, (whole, {}))
            while len(_maps) > MAX_MAPPINGS:
                _maps.popitem(last=False)
        _sweep(h.pid, key)
    view = got[1].get(h.id)
    if view is None:
        start = h.offset if h.kind == "shm" else 0
        view = got[1][h.id] = got[0][start : start + h.size]
    return view


def _map(h: Handle) -> Any:
    """Map `h`'s memory here: its whole shared-memory file, or its CUDA memory; None when it cannot be."""
    import torch

    if h.kind == "cuda":
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        try:
            got = rebuild_cuda_tensor(*h.cuda)  # (the memory the owner's storage holds, opened here)
        except (RuntimeError, TypeError):
            return None
        return got.view(torch.uint8).reshape(-1)
    import mmap

    try:
        fd = os.open(f"/proc/{h.pid}/fd/{h.fd}", os.O_RDWR | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) != (h.dev, h.ino) or st.st_uid != os.getuid() or st.st_size < h.offset + h.size:
            return None
        mm = mmap.mmap(fd, st.st_size)
    finally:
        os.close(fd)  # (the mapping keeps the file)
    return torch.frombuffer(mm, dtype=torch.uint8)


def _sweep(pid: int, keep: tuple[int, int, int, int]) -> None:
    """A new buffer of owner `pid` was mapped: forget its mappings that it no longer holds (and their memory)."""
    for k in [k for k in list(_maps) if k[0] == pid and k != keep]:
        try:
            st = os.stat(f"/proc/{k[0]}/fd/{k[1]}")
            if (st.st_dev, st.st_ino) == (k[2], k[3]):
                continue
        except OSError:
            pass
        with _maps_lock:
            _maps.pop(k, None)


def _forget(h: Handle) -> None:
    with _maps_lock:
        _maps.pop(_key(h), None)


# -- futures -------------------------------------------------------------------------------------------------
class Pending:
    """One operation under way through the transport (made by a side): `wait` for it, or `wait_async`. `future`
    is the side's call or message to the owner; its answer goes to `finish(value)` (the bytes copied into place,
    or the owner's refusal raised)."""

    def __init__(self, h: Handle, what: str, future: Any, finish: Any) -> None:
        self.h, self.what, self.future, self.finish = h, what, future, finish
        self.ended = False

    def done(self) -> bool:
        return self.ended or bool(self.future.done())

    def wait(self, deadline: float) -> None:
        """Wait until it completes (raising its error) or `deadline` (time.monotonic()) passes (TimeoutError)."""
        raise NotImplementedError

    async def wait_async(self, deadline: float) -> None:
        raise NotImplementedError


class RDMAFuture:
    """What `read_into`, `write_from`, `drop` and `RDMAAction.submit` return: ``.get()`` waits (and raises the
    operation's error), or ``await`` it in an ``async def`` endpoint. Shared-memory copies are done before it is
    returned; transport operations complete when it is waited for (or `done()` says so)."""

    def __init__(self, what: str, pending: list[Pending], error: BaseException | None, timeout: float) -> None:
        self._what, self._pending, self._error = what, pending, error
        self._timeout = timeout
        self._deadline = time.monotonic() + timeout
        self._finished = not pending

    def done(self) -> bool:
        """Whether every operation completed (or failed); a transport read's bytes are in place once it is."""
        if not self._finished and all(p.done() for p in self._pending):
            try:
                self._finish_sync(self._deadline)
            except Exception as e:
                self._fail(e)
        return self._finished

    def get(self, timeout: float | None = None) -> None:
        """Wait for completion (at most `timeout` seconds, else the operation's own timeout): None, or the
        operation's error (`RDMAError`, `ValueError`, `TimeoutError`)."""
        if not self._finished:
            deadline = self._deadline if timeout is None else min(self._deadline, time.monotonic() + timeout)
            try:
                self._finish_sync(deadline)
            except TimeoutError:
                if timeout is not None and deadline < self._deadline:
                    raise TimeoutError(f"{self._what}: not complete within {timeout} s") from None
                raise TimeoutError(f"{self._what}: not complete within its timeout of {self._timeout} s") from None
            except Exception as e:
                self._fail(e)
        if self._error is not None:
            raise self._error
        return None

    result = get

    def exception(self) -> BaseException | None:
        """For a completed operation: its error, or None."""
        self.done()
        return self._error

    def _fail(self, error: Exception) -> None:
        """An operation failed: the future is done, with the first error."""
        self._error = self._error or error
        self._finished = True

    def _finish_sync(self, deadline: float) -> None:
        for p in self._pending:
            p.wait(deadline)
        self._finished = True

    def __await__(self) -> Any:
        return self._wait_async().__await__()

    async def _wait_async(self) -> None:
        if not self._finished:
            try:
                for p in self._pending:
                    await p.wait_async(self._deadline)
                self._finished = True
            except TimeoutError:
                raise TimeoutError(f"{self._what}: not complete within its timeout of {self._timeout} s") from None
            except Exception as e:
                self._fail(e)
        if self._error is not None:
            raise self._error

    def __repr__(self) -> str:
        return f"<RDMAFuture {self._what}: {'done' if self._finished else 'pending'}>"


def _failed(what: str, error: BaseException) -> RDMAFuture:
    return RDMAFuture(what, [], error, 0)


async def wait_polling(task: asyncio.Future[Any], deadline: float, check: Any) -> Any:
    """Await `task`, calling `check()` (which raises when waiting is pointless) every `POLL` seconds; a
    TimeoutError at `deadline`."""
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            task.cancel()
            raise TimeoutError
        done, _ = await asyncio.wait({task}, timeout=min(POLL, left))
        if done:
            return task.result()
        check()


# -- the buffer -------------------------------------------------------------------------------------------
class RDMABuffer:
    """Bytes of this process's memory that other processes read and write one-sidedly (Monarch's
    ``monarch.rdma.RDMABuffer``). Make it over a 1-D contiguous tensor (``t.view(torch.uint8).flatten()``: a
    view, not a copy, so later in-place updates are what later reads see) or a memoryview, return it from an
    endpoint (it pickles), and the holder calls ``read_into(dst)`` / ``write_from(src)`` and waits on the
    future (``.get()`` or ``await``). The memory is held until `drop()`.

    On one host the bytes move through shared memory (CUDA IPC for a GPU tensor) with no help from the owner;
    across hosts through the owner process (its inbox). Only processes of the same user can open the shared
    memory (through /proc, as the kernel allows). See docs/features/rdma.md."""

    def __init__(self, data: Any) -> None:
        flat, size = _local(data, "RDMABuffer(data)", writable=False)
        if size == 0:
            raise ValueError("Cannot create RDMABuffer with size 0.")
        buffer_id = secrets.token_hex(8)
        inbox = mesh_id = rank = None
        if context.worker is not None:
            inbox, mesh_id, rank = _side().register()
        shared_fields = _share(flat)
        pid, start = _myself()
        readonly = isinstance(flat, memoryview) and flat.readonly
        with _lock:
            _owned[buffer_id] = _Owned(flat, shared_fields.get("fd", -1), readonly)
        self._h = Handle(
            buffer_id, size, _who(), pid, start, _host(), socket.gethostname(), inbox=inbox, mesh_id=mesh_id,
            rank=rank, **shared_fields,
        )  # fmt: skip

    @classmethod
    def _of(cls, h: Handle) -> RDMABuffer:
        buf = cls.__new__(cls)
        buf._h = h
        return buf

    @property
    def backend(self) -> str:
        """`get_rdma_backend()`."""
        return get_rdma_backend()

    @property
    def owner(self) -> str:
        """Who made the buffer (the actor and process), as a string."""
        return self._h.owner

    def size(self) -> int:
        """Its length in bytes."""
        return self._h.size

    def read_into(self, dst: Any, *, timeout: int = 60) -> RDMAFuture:
        """Copy the buffer's bytes into `dst` (a 1-D contiguous tensor or memoryview of at least `size()`
        bytes; the first `size()` are written); a future to ``.get()`` or ``await``. A smaller `dst` is a
        ValueError here, naming both sizes."""
        return RDMAAction().read_remote(dst, self).submit(timeout=timeout)

    def write_from(self, src: Any, *, timeout: int = 60) -> RDMAFuture:
        """Copy `src`'s bytes (a 1-D contiguous tensor or memoryview of at most `size()` bytes) into the start
        of the buffer; a future to ``.get()`` or ``await``."""
        return RDMAAction().write_remote(self, src).submit(timeout=timeout)

    def drop(self) -> RDMAFuture:
        """Release the buffer: its owner no longer holds the memory for it, and reads and writes from then on
        raise `RDMAError` (at once on one host; across hosts when the owner answers)."""
        h = self._h
        what = "RDMABuffer.drop"
        _forget(h)
        if _is_mine(h):
            unregister(h.id)
            return RDMAFuture(what, [], None, 0)
        if h.inbox is None:
            return _failed(what, RDMAError(f"{what}: {buffer_name(h)}: only its own process can drop it (the "
                                           "controller's process has no transport)"))  # fmt: skip
        try:
            return RDMAFuture(what, [_side().start_drop(h)], None, 60)
        except RDMAError as e:
            return _failed(what, e)

    def __repr__(self) -> str:
        h = self._h
        return f"RDMABuffer({h.size} bytes of {h.owner}, id {h.id})"


def _is_mine(h: Handle) -> bool:
    return (h.pid, h.start) == _myself() and h.host == _host()


def _same_host(h: Handle) -> bool:
    return h.host == _host()


def check_alive(h: Handle, what: str) -> None:
    """Raise `RDMAError` when `h`'s owner is known to be gone (on this host only: elsewhere, the timeout)."""
    if _same_host(h) and (_start_time(h.pid) != h.start or proc_state(h.pid) in (None, "Z", "X")):
        raise RDMAError(f"{what}: {buffer_name(h)}: its owner process (pid {h.pid}) exited")


def buffer_name(h: Handle) -> str:
    return f"RDMABuffer {h.id} ({h.size} bytes) of {h.owner}"


def _direct(h: Handle, local: Any, size: int, reading: bool, what: str, path: str) -> bool:
    """Do the copy through this host's shared memory (or this process's own memory) when that is the path;
    whether it was done. Raises `RDMAError` for a buffer its owner no longer holds."""
    if _is_mine(h):
        got = owned(h.id)
        if got is None:
            raise RDMAError(f"{what}: {buffer_name(h)}: it was dropped")
        if not reading and got.readonly:
            raise RDMAError(f"{what}: {buffer_name(h)} is a read-only memoryview")
        copy_bytes(local, got.data, size) if reading else copy_bytes(got.data, local, size)
        paths["local"] += 1
        return True
    if not _same_host(h) or h.kind == "none":
        return False
    if h.inbox is not None and path == "transport":
        return False
    why = _registered(h)
    if why == "denied":
        return False
    if why is not None:
        _forget(h)
        raise RDMAError(f"{what}: {buffer_name(h)}: {why}")
    view = _view(h)
    if view is None:
        return False
    copy_bytes(local, view, size) if reading else copy_bytes(view, local, size)
    paths[h.kind] += 1
    return True


class RDMAAction:
    """A batch of reads and writes submitted as one (Monarch's ``RDMAAction``): queue them with `read_remote`
    and `write_remote`, then `submit()`; the future completes when all have. Overlapping ranges in one batch
    race, as in Monarch."""

    def __init__(self) -> None:
        self._ops: list[tuple[bool, RDMABuffer, Any, int]] = []

    def read_remote(self, dst: Any, src: RDMABuffer) -> RDMAAction:
        """Queue a read of buffer `src` into local `dst` (at least `src.size()` bytes)."""
        _need_buffer(src, "read_remote")
        flat, n = _local(dst, "RDMABuffer.read_into(dst)", writable=True)
        if n < src.size():
            raise ValueError(
                f"RDMABuffer.read_into(dst): dst has {n} bytes, the buffer {src.size()} ({buffer_name(src._h)}); "
                f"give a destination of at least {src.size()} bytes"
            )
        self._ops.append((True, src, flat, src.size()))
        return self

    def write_remote(self, dst: RDMABuffer, src: Any) -> RDMAAction:
        """Queue a write of local `src` (at most `dst.size()` bytes) into the start of buffer `dst`."""
        _need_buffer(dst, "write_remote")
        flat, n = _local(src, "RDMABuffer.write_from(src)", writable=False)
        if n > dst.size():
            raise ValueError(
                f"RDMABuffer.write_from(src): src has {n} bytes, the buffer {dst.size()} ({buffer_name(dst._h)}); "
                f"give a source of at most {dst.size()} bytes"
            )
        self._ops.append((False, dst, flat, n))
        return self

    def fetch_add(self, src: RDMABuffer, dst: Any, add: int) -> RDMAAction:
        raise NotImplementedError("RDMAAction.fetch_add is not supported (nor in Monarch yet)")

    def compare_and_swap(self, src: RDMABuffer, dst: Any, compare: int, swap: int) -> RDMAAction:
        raise NotImplementedError("RDMAAction.compare_and_swap is not supported (nor in Monarch yet)")

    def submit(self, *, timeout: int = 60) -> RDMAFuture:
        """Start every queued operation (shared-memory copies are done before this returns); a future of their
        completion, failing with the first error. May be called again (the operations run again)."""
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) or timeout < 0:
            raise ValueError(f"timeout={timeout!r}: give a number of seconds >= 0")
        ops = [f"RDMABuffer.{'read_into' if reading else 'write_from'}" for reading, _, _, _ in self._ops]
        what = (
            f"{ops[0]} ({buffer_name(self._ops[0][1]._h)})" if len(ops) == 1 else f"RDMAAction of {len(ops)} operations"
        )
        path = config.rdma_path()
        pending: list[Pending] = []
        for op, (reading, buf, flat, size) in zip(ops, self._ops, strict=True):
            h = buf._h
            try:
                if _direct(h, flat, size, reading, op, path):
                    continue
                if h.inbox is None:
                    raise RDMAError(f"{op}: {buffer_name(h)}: {_unreachable(h)}")
                side = _side()
                pending.append(side.start_read(h, flat, size) if reading else side.start_write(h, flat, size))
                paths["transport"] += 1
            except (RDMAError, ValueError) as e:
                return _failed(what, e)
        return RDMAFuture(what, pending, None, timeout)


def _unreachable(h: Handle) -> str:
    """Why a buffer of a process with no transport (the controller's) cannot be reached from here."""
    if not _same_host(h):
        where = "another host (or another user's process)"
    elif h.kind == "none":
        where = "this host, but its memory is not in shared memory (a memoryview, or memory torch did not allocate)"
    else:
        where = "this host, but its memory cannot be opened from this process"
    return (
        f"its owner is a controller's process on {where}, which only shared memory reaches; make the buffer "
        "in a worker's actor, whose process answers the transport"
    )


def _need_buffer(obj: Any, what: str) -> None:
    if not isinstance(obj, RDMABuffer):
        raise TypeError(f"RDMAAction.{what}: needs an RDMABuffer, got {type(obj).__name__}")


def handle_of(buf: RDMABuffer) -> Handle:
    """The buffer's `Handle` (for the sides)."""
    return buf._h


READ = "RDMABuffer.read_into"
WRITE = "RDMABuffer.write_from"


def refused(h: Handle, what: str, value: Any) -> None:
    """Raise the owner's refusal (it answers a transport operation with a reason, as text, when it cannot)."""
    if isinstance(value, str):
        raise RDMAError(f"{what}: {buffer_name(h)}: {value}")


def read_finisher(h: Handle, dst: Any, size: int) -> Any:
    """What a transport read does with the owner's answer: refused, or its bytes copied into `dst`."""

    def finish(value: Any) -> None:
        refused(h, READ, value)
        copy_bytes(dst, value, size)

    return finish


def write_finisher(h: Handle) -> Any:
    """What a transport write does with the owner's answer: nothing, unless it was refused."""
    return lambda value: refused(h, WRITE, value)
