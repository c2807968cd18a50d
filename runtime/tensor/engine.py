"""The controller's side of one spawned mesh's tensor engine: handle ids, the command batch, frees.

Commands are batched per set of workers and sent without waiting for anything: when a batch is full,
when another set of workers is addressed (one global order), when a value is fetched, when a live
call goes out, when `activate()` exits. Freed handles ride on the next batch, or go alone within
`FREE_DELAY` when nothing else is sent.
"""

from __future__ import annotations

import contextvars
import itertools
import sys
import threading
import time
import traceback
import weakref
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from monarch.runtime.tensor.streams import Stream, get_active_stream
from monarch.runtime.wire import codec
from monarch.runtime.wire import protocol as P

codec.register_reducer(P.Ref, P.Ref.__reduce__)  # (a batch holds many)

BATCH = 256
"""Commands kept before a batch is sent on its own."""
FREE_DELAY = 0.1
"""Seconds a freed handle waits for a batch to ride on before it is sent alone (`del t` in an idle notebook)."""


class Engine:
    """The controller's side of one spawned mesh: ids, the command batch, freed ids."""

    def __init__(self, spawned) -> None:
        self.spawned = spawned
        self.weak = weakref.ref(self)
        """(each handle holds it: made once)"""
        self.ids = itertools.count(1)
        self.batches: dict[tuple[int, ...], list] = {}
        self.dead: list[tuple] = []
        """Freed handles not yet sent: (ranks, stream id, ref)."""
        self.lock = threading.RLock()
        self.fake = FakeTensorMode(allow_non_fake_inputs=True)
        self.specs: dict[tuple, Any] = {}
        """Output metadata of ops already seen, by op and input metadata: most ops skip fake tensors."""
        self.cpu_only = all(info.get("device", "cpu").startswith("cpu") for info in spawned.info)
        simulated = bool(spawned.info) and all(info.get("simulated") for info in spawned.info)
        self.simulated_cuda = simulated and not self.cpu_only and not torch.cuda.is_available()
        """A simulated GPU mesh on a controller without CUDA: "cuda" tensors get CPU metadata, silently."""

    def push(self, ranks: tuple[int, ...], cmd: Any, stream: Stream | None = None) -> None:
        """Queue `cmd` (a `protocol` tensor command) for `ranks`, on `stream` (default: the active one)."""
        sid = (stream or get_active_stream()).id
        if sid:
            cmd = P.OnStream(sid, cmd)
        with self.lock:
            batch = self.batches.get(ranks)
            if batch is None:
                if self.batches:
                    self.flush()  # another set of workers: keep one global order of commands
                batch = self.batches[ranks] = []
            batch.append(cmd)
            if len(batch) >= BATCH:
                self._send(ranks)

    def flush(self) -> None:
        """Send every pending command now (frees too, even with no command pending)."""
        with self.lock:
            if not self.batches and self.dead:
                self._send(())
            for ranks in list(self.batches):
                self._send(ranks)

    def _send(self, ranks: tuple[int, ...]) -> None:
        batches = {ranks: self.batches.pop(ranks, [])}
        dead, self.dead = self.dead, []  # one step: a free from another thread (GC) lands in one list or the other
        if dead:
            # Frees go to the workers that hold the value, on the stream that owns it. Other rank sets have
            # no commands pending (push sends them before it switches), so theirs can go now.
            by_owner: dict[tuple, list[int]] = {}
            for owner_ranks, sid, ref in dead:
                by_owner.setdefault((owner_ranks, sid), []).append(ref)
            for (owner_ranks, sid), refs in by_owner.items():
                free = P.Free(refs)
                batches.setdefault(owner_ranks, []).append(free if sid == 0 else P.OnStream(sid, free))
        spawned = self.spawned
        if spawned.state != "running":
            return
        for to, batch in batches.items():
            if batch:
                with torch.utils._python_dispatch._disable_current_modes():
                    try:
                        body = codec.dumps(P.pack_commands(batch))
                    except Exception:  # some op's argument cannot be pickled: that op fails, not the batch
                        body = codec.dumps(P.pack_commands([_sendable(cmd) for cmd in batch]))
                spawned.controller.send(spawned, to, P.RunOps(), body)

    def free(self, ref: int, stream_id: int, ranks: tuple[int, ...]) -> None:
        """Free `ref` on `ranks` (sent with the next batch, run on the stream that owns it); any thread."""
        self.dead.append((ranks, stream_id, ref))

    def new_id(self) -> int:
        return next(self.ids)


def _sendable(cmd: Any) -> Any:
    """`cmd`, or, if it cannot be pickled, a command that poisons its results with the reason."""
    try:
        codec.dumps(P.pack_commands([cmd]))
        return cmd
    except Exception as e:
        if type(cmd) is tuple:  # an op, packed
            cmd = P.unpack(cmd)
        if type(cmd) is P.OnStream:
            return P.OnStream(cmd.stream_id, _sendable(cmd.cmd))
        if type(cmd) is not P.Op:
            raise  # our own commands hold nothing unpicklable
        why = f"an argument of {cmd.name} cannot be sent to the workers: {type(e).__name__}: {e}"
        return P.FailResults(cmd.out, "TypeError", why, cmd.where)


capturing: contextvars.ContextVar[Any] = contextvars.ContextVar("monarch_capturing", default=None)
"""The mesh view whose `activate()` is innermost on this thread, if any."""


def engine_for(spawned) -> Engine:
    """The engine of a spawned mesh (made on first use; one per mesh, whichever thread asks first)."""
    engine = spawned.engine
    if engine is None:
        with _engines_lock:  # two threads starting on one mesh must share one engine (one id counter)
            engine = spawned.engine
            if engine is None:
                engine = spawned.engine = Engine(spawned)
                _engines.add(engine)
                if not _reaper_started:
                    _start_reaper()
    return engine


def flush(mesh) -> None:
    """Send what `mesh`'s engine holds, if it has one."""
    engine = mesh.spawned.engine
    if engine is not None:
        engine.flush()


_engines_lock = threading.Lock()
_engines: weakref.WeakSet[Engine] = weakref.WeakSet()
_reaper_started = False


def _start_reaper() -> None:
    """A thread that sends frees nobody else sends: polls (a free runs inside `__del__`, where waking a
    thread through a lock could deadlock)."""
    global _reaper_started
    _reaper_started = True

    def reap() -> None:
        while True:
            time.sleep(FREE_DELAY)
            for engine in list(_engines):
                if engine.dead and engine.spawned.state == "running" and engine.lock.acquire(blocking=False):
                    try:  # (a busy engine sends them with its next batch)
                        engine.flush()
                    except Exception:
                        traceback.print_exc(file=sys.__stderr__)
                    finally:
                        engine.lock.release()

    threading.Thread(target=reap, name="monarch-frees", daemon=True).start()
