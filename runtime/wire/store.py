"""The torch.distributed rendezvous store, served by the controller over the signed transport.

torch's TCPStore listens on every interface and takes any client, so another local user could read
or set our keys. This store answers only signed requests from workers of this controller's running
meshes, on the transport's private socket (IPC in a 0700 directory, or TCP with CURVE). Workers use
`StoreClient`, a `torch.distributed.Store`, for `init_process_group`, `new_group` and gloo/NCCL
rendezvous; each thread has its own connection, so one thread waiting for a key never blocks another.
"""

from __future__ import annotations

import datetime
import os
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import zmq

from monarch.runtime.wire import protocol as P
from monarch.runtime.wire.controller_end import DROPPED, ControllerTransport
from monarch.runtime.wire.worker_end import StoreConnection, WorkerTransport

if TYPE_CHECKING:
    from typing import TypeAlias

    from monarch.runtime.wire import codec

    _Answer: TypeAlias = "tuple[bool, bytes | int | str | None] | None"
    """A request's answer, ``(ok, value)``; None: it waits (a waiter answers it later)."""


@dataclass
class _Waiter:
    ident: tuple[bytes, ...]
    mesh_id: int
    request: int
    keys: tuple[str, ...]
    deadline: float
    get: str | None
    """For a `StoreGet`: the key whose value is the answer."""


class StoreServer:
    """The key-value map and its waiters, served on the transport's store socket by a thread of its own."""

    def __init__(self, transport: ControllerTransport) -> None:
        self.transport = transport
        self.data: dict[str, bytes] = {}
        """Workers' keys (under ``monarch/<mesh id>/`` and ``monarch/link/``), dropped with their mesh."""
        self.marks: dict[str, bytes] = {}
        """The controller's own keys (`set`: that a mesh is gone), a few bytes per mesh, kept apart."""
        self.waiting: list[_Waiter] = []
        self.lock = threading.Lock()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        os.set_blocking(self._wake_r, False)
        self._closed = False
        self._handlers: dict[type[Any], Callable[[tuple[bytes, ...], codec.Envelope], _Answer]] = {
            P.StoreSet: self._set,
            P.StoreGet: self._get,
            P.StoreAdd: self._add,
            P.StoreCompareSet: self._compare_set,
            P.StoreWait: self._wait,
            P.StoreCheck: self._check,
            P.StoreDelete: self._delete,
            P.StoreNumKeys: self._num_keys,
        }
        self._chores: list[tuple[Callable[[], None], threading.Event]] = []
        """Work on the store's socket asked for by other threads (`run`), done by this one."""
        self._thread = threading.Thread(target=self._loop, name="monarch-store", daemon=True)
        self._thread.start()
        transport.store_owner = self.run

    def run(self, chore: Callable[[], None], timeout: float = 10.0) -> None:
        """Run `chore` (say, connecting the store's socket to a host agent) on the store's thread, the only
        one that may touch its socket, and wait until it is done."""
        if threading.current_thread() is self._thread or not self._thread.is_alive():
            chore()  # (no other thread serves the socket)
            return
        done = threading.Event()
        with self.lock:
            self._chores.append((chore, done))
        self._poke()
        if not done.wait(timeout):
            raise TimeoutError(f"the store's thread did not take its socket's work within {timeout:.0f} s")

    def set(self, key: str, value: bytes) -> None:
        """Set a key from the controller itself (e.g. that a mesh is gone); wakes its waiters."""
        with self.lock:
            self.marks[key] = value
        self._poke()

    def forget_mesh(self, mesh_id: int) -> int:
        """Drop a stopped mesh's keys (its groups' rendezvous, its moves' links) and requests, so that a
        controller that makes meshes for days keeps a store of the running ones only; returns how many."""
        prefix = f"monarch/{mesh_id}/"
        with self.lock:
            gone = [k for k in self.data if k.startswith(prefix) or _link_of(k, mesh_id)]
            for k in gone:
                del self.data[k]
            self.waiting = [w for w in self.waiting if w.mesh_id != mesh_id]
        return len(gone)

    def _has(self, key: str) -> bool:
        return key in self.data or key in self.marks

    def _value(self, key: str) -> bytes:
        value = self.data.get(key)
        return self.marks[key] if value is None else value

    def close(self) -> None:
        self._closed = True
        self._poke()
        self._thread.join(2)
        self.transport.store_owner = None
        self._do_chores()  # (any asked for meanwhile: nobody else will)
        self.transport.close_store()
        os.close(self._wake_r)
        os.close(self._wake_w)

    def _poke(self) -> None:
        try:
            os.write(self._wake_w, b"w")
        except (BlockingIOError, OSError):
            pass

    def _loop(self) -> None:
        poller = zmq.Poller()  # zmq's own poll: a socket's fd alone is edge-triggered and easy to miss
        poller.register(self.transport.store, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        while not self._closed:
            timeout = None
            if self.waiting:
                timeout = max(1, int((min(w.deadline for w in self.waiting) - time.monotonic()) * 1000))
            poller.poll(timeout)
            try:
                os.read(self._wake_r, 4096)
            except BlockingIOError:
                pass
            except OSError:
                return
            if self._closed:
                return
            self._do_chores()
            while True:
                got = self.transport.store_recv()
                if got is None:
                    break
                if got is DROPPED:
                    continue
                ident, env = got
                handler = self._handlers.get(type(env.message))
                if handler is None:
                    self.transport.log("a store request", f"{type(env.message).__name__} is not a store request")
                    continue
                with self.lock:
                    answer = handler(ident, env)
                if answer is not None:
                    self._answer(ident, env.mesh_id, env.seq, *answer)
            self._serve_waiters()

    def _do_chores(self) -> None:
        with self.lock:
            chores, self._chores = self._chores, []
        for chore, done in chores:
            try:
                chore()
            except Exception as e:  # a bug of ours: say so, keep serving
                self.transport.log("store socket work", f"{type(e).__name__}: {e}")
            finally:
                done.set()

    def _answer(
        self, ident: tuple[bytes, ...], mesh_id: int, request: int, ok: bool, value: bytes | int | str | None
    ) -> None:
        self.transport.store_send(ident, mesh_id, P.StoreAnswer(request, ok, value))

    def _serve_waiters(self) -> None:
        now = time.monotonic()
        done: list[tuple[_Waiter, bool, bytes | str | None]] = []
        with self.lock:
            still = []
            for w in self.waiting:
                if all(self._has(k) for k in w.keys):
                    done.append((w, True, self._value(w.get) if w.get is not None else None))
                elif now >= w.deadline:
                    missing = [k for k in w.keys if not self._has(k)]
                    done.append((w, False, f"timed out waiting for store keys {missing}"))
                else:
                    still.append(w)
            self.waiting = still
        for w, ok, value in done:
            self._answer(w.ident, w.mesh_id, w.request, ok, value)

    # -- requests (under the lock); each returns (ok, value), or None when it waits ----------------
    def _set(self, ident: tuple[bytes, ...], env: codec.Envelope) -> _Answer:
        self.data[env.message.key] = env.message.value
        return True, None

    def _get(self, ident: tuple[bytes, ...], env: codec.Envelope) -> _Answer:
        m: P.StoreGet = env.message
        if self._has(m.key):
            return True, self._value(m.key)
        self.waiting.append(_Waiter(ident, env.mesh_id, env.seq, (m.key,), time.monotonic() + m.timeout, m.key))
        return None

    def _add(self, ident: tuple[bytes, ...], env: codec.Envelope) -> _Answer:
        m: P.StoreAdd = env.message
        try:
            value = int(self.data.get(m.key, b"0")) + m.amount
        except ValueError:
            return False, f"store key {m.key!r} does not hold a number"
        self.data[m.key] = str(value).encode()
        return True, value

    def _compare_set(self, ident: tuple[bytes, ...], env: codec.Envelope) -> _Answer:
        m: P.StoreCompareSet = env.message
        current = self.data.get(m.key)
        if (current is None and m.expected == b"") or current == m.expected:
            self.data[m.key] = m.desired
            return True, m.desired
        return True, m.expected if current is None else current

    def _wait(self, ident: tuple[bytes, ...], env: codec.Envelope) -> _Answer:
        m: P.StoreWait = env.message
        if all(self._has(k) for k in m.keys):
            return True, None
        self.waiting.append(_Waiter(ident, env.mesh_id, env.seq, tuple(m.keys), time.monotonic() + m.timeout, None))
        return None

    def _check(self, ident: tuple[bytes, ...], env: codec.Envelope) -> _Answer:
        return True, all(self._has(k) for k in env.message.keys)

    def _delete(self, ident: tuple[bytes, ...], env: codec.Envelope) -> _Answer:
        return True, self.data.pop(env.message.key, None) is not None

    def _num_keys(self, ident: tuple[bytes, ...], env: codec.Envelope) -> _Answer:
        return True, len(self.data) + len(self.marks)


_LINK = re.compile(r"monarch/link/(\d+)\.\d+>(\d+)\.\d+/")
"""A move's link between two meshes (`worker/groups.py`): ``monarch/link/<mesh>.<rank>><mesh>.<rank>/``."""


def _link_of(key: str, mesh_id: int) -> bool:
    m = _LINK.match(key)
    return m is not None and str(mesh_id) in m.groups()


def _store_error(text: str) -> Exception:
    import torch.distributed as dist

    return getattr(dist, "DistStoreError", RuntimeError)(text)


def _bytes(value: str | bytes) -> bytes:
    if isinstance(value, str):
        return value.encode()
    return bytes(value)


def store_client(transport: WorkerTransport, timeout: datetime.timedelta) -> Any:
    """A `torch.distributed.Store` talking to the controller's store (imports torch: workers only)."""
    import torch.distributed as dist

    class _Client(dist.Store):  # type: ignore[misc]  # (torch is not type-checked here)
        def __init__(self) -> None:
            super().__init__()
            self.set_timeout(timeout)
            self._local = threading.local()
            self._all: list[StoreConnection] = []
            self._all_lock = threading.Lock()

        def _conn(self) -> StoreConnection:
            conn = getattr(self._local, "conn", None)
            if conn is None:
                conn = self._local.conn = transport.store_client()
                with self._all_lock:
                    self._all.append(conn)
            return conn

        def _ask(self, message: Any, waits: float = 0.0) -> Any:
            # an answer comes at once, or when what it waits for is there (the server times the wait)
            answer = self._conn().request(message, waits + 30.0)
            if not answer.ok:
                raise _store_error(str(answer.value))
            return answer.value

        def _seconds(self, timeout: datetime.timedelta | float | None = None) -> float:
            t = self.timeout if timeout is None else timeout
            return t.total_seconds() if isinstance(t, datetime.timedelta) else float(t)

        def set(self, key: str, value: str | bytes) -> None:
            self._ask(P.StoreSet(key, _bytes(value)))

        def get(self, key: str) -> bytes:
            t = self._seconds()
            value: bytes = self._ask(P.StoreGet(key, t), t)
            return value

        def add(self, key: str, amount: int) -> int:
            value: int = self._ask(P.StoreAdd(key, int(amount)))
            return value

        def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
            value: bytes = self._ask(P.StoreCompareSet(key, _bytes(expected), _bytes(desired)))
            return value

        def wait(self, keys: list[str], timeout: datetime.timedelta | float | None = None) -> None:
            t = self._seconds(timeout)
            self._ask(P.StoreWait(tuple(keys), t), t)

        def check(self, keys: list[str]) -> bool:
            value: bool = self._ask(P.StoreCheck(tuple(keys)))
            return value

        def delete_key(self, key: str) -> bool:
            value: bool = self._ask(P.StoreDelete(key))
            return value

        def num_keys(self) -> int:
            value: int = self._ask(P.StoreNumKeys())
            return value

        def close(self) -> None:
            with self._all_lock:
                conns, self._all = self._all, []
            for c in conns:
                c.close()

    return _Client()
