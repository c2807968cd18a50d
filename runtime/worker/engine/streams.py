"""Streams on a worker: the main stream runs on the worker's thread; every other stream has a thread
of its own (and, on a GPU, its own CUDA stream, so its kernels overlap the main stream's)."""

from __future__ import annotations

import queue
import threading
import traceback

import torch

from monarch.runtime.common import context

threads: dict[int, _StreamThread] = {}
"""Each stream other than main that was used, by id, with its thread (empty: only main was used)."""
here = threading.local()
"""`.sid` on a stream thread: the stream it runs (0, main, elsewhere)."""


def current_sid() -> int:
    return getattr(here, "sid", 0)


class _StreamThread:
    def __init__(self, sid: int) -> None:
        self.sid = sid
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._loop, name=f"monarch-stream-{sid}", daemon=True).start()

    def _loop(self) -> None:
        here.sid = self.sid
        w = context.worker
        if torch.cuda.is_available() and w is not None and w.device.type == "cuda":
            torch.cuda.set_device(w.device)
            torch.cuda.set_stream(torch.cuda.Stream(w.device))
        while True:
            fn = self.queue.get()
            try:
                fn()
            except Exception:  # our bug; ops poison their results themselves
                traceback.print_exc()


def on(sid: int, fn) -> None:
    """Run `fn` on stream `sid`, after what is already queued there (main: right now, on this thread)."""
    if sid == 0:
        fn()
        return
    st = threads.get(sid)
    if st is None:
        st = threads[sid] = _StreamThread(sid)
    st.queue.put(fn)


def sync_streams() -> None:
    """Wait until every stream has run what was queued on it (before a value is read)."""
    events = []
    for st in list(threads.values()):
        ev = threading.Event()
        st.queue.put(ev.set)
        events.append(ev)
    for ev in events:
        ev.wait()
    if events and torch.cuda.is_available():
        torch.cuda.synchronize()  # and until their kernels are done


class Mark:
    """A point in one stream that another waits for: a thread event, plus a CUDA event on a GPU."""

    def __init__(self) -> None:
        self.host = threading.Event()
        self.cuda = None

    def record(self) -> None:
        if torch.cuda.is_available():
            self.cuda = torch.cuda.Event()
            self.cuda.record()  # on this thread's current CUDA stream
        self.host.set()

    def wait(self) -> None:
        self.host.wait()
        if self.cuda is not None:
            torch.cuda.current_stream().wait_event(self.cuda)
