"""Simulated workers: the tensor commands of a mesh, run on fake tensors against a cost model.

Every rank has a command thread (the *dispatch* clock) and one clock per stream. A batch arrives when the
controller sent it and is decoded whole (`decode` per command) before its first command runs; each command
costs the command thread `dispatch`. On a CPU worker the main stream
runs on the command thread itself (so a wait on it holds back every later command, as on a real CPU
worker); on a GPU the main stream is a queue like the others. A borrow makes the borrowing stream wait for
the point the origin stream had reached; its drop makes the origin wait for the borrower (on a CPU,
plus the calibrated cost of waking the threads, `handoff`). On a GPU the engine reads a reduce's failure
flag on the host, so the thread that issued it waits for its end, and a drop on the main stream waits for
the borrowing stream's thread (`held`). On a CPU a side stream's thread that had nothing to do starts
what it is given only when it is woken (half of the calibrated hand-over; the command thread waking from a
drop is the other half), so a reduce issued beside a few quick ops starts after them; the first op after
a reduce the command thread ran itself pays what the wait cost it (`after_reduce`, `owed`), and after one
on a side stream what running beside it costs (`beside_reduce`). A collective
starts when the last rank of its group reaches it; the time the others wait is communication too, as in
a real trace. On a CPU, compute on the main stream and a side stream's work that overlap share the cores
and slow each other down, by factors `calibrate()` measures (`SimWorkers._share`); where it found that a
collective beside compute made no progress (`devices.STALLED`), a side stream's command that main's op
found not begun begins when that op ends (`_postpone`: a woken stream thread got no core meanwhile), a
collective's end moving on every rank of its group with its last arrival, until the thread has waited the
calibrated `side_wait` for a core, or main paused longer than a wake (`_begun`); and a collective costs the
calibrated `reduce_in_step` at the compute its ranks ran since their last one; an op pays the calibrated
`cold_ops` at the bytes its rank's last `COLD_WINDOW` ops moved (what they evicted from the caches).
Memory: a result that does not alias an input is an allocation (at its op's start; on a GPU when the
command thread launches the op, as CUDA's caching allocator serves it on the host); a storage is freed
when the last handle naming it is freed. While the controller computes (issuing commands, autograd: the
sending thread and `grad_generator`'s), the workers of its host are slower by the calibrated
`controller_load` (`SimWorkers.controller_busy`).

State is kept once per command, not per rank: clocks are numpy arrays over ranks, so a 512-rank mesh
costs little more than a 4-rank one.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from monarch.runtime.common.op_schema import alias_plan
from monarch.runtime.simulator import costs
from monarch.runtime.simulator.devices import STALLED, DeviceProfile
from monarch.runtime.wire import protocol as P
from monarch.runtime.wire.protocol import Ref

BUSY_KEPT = 0.5
"""Seconds of the controller's recent spans of Python `SimWorkers` keeps (how far back `_apart` looks)."""
COLD_WINDOW = 5
"""The ops before an op whose bytes `cold_ops` follows (calibration's runs of small ops after a copy are this long)."""

_COLLECTIVE = {
    (False, False): "all_reduce",
    (True, False): "reduce_scatter",
    (False, True): "all_gather",
    (True, True): "all_to_all",
}


@dataclass
class Event:
    """One command on some ranks: per rank its start and end (seconds, the controller's clock)."""

    ranks: np.ndarray
    stream: int
    start: np.ndarray
    end: np.ndarray
    name: str
    kind: str
    """``compute`` or ``comm``."""
    where: str
    flops: float = 0.0
    nbytes: int = 0
    sync: list[np.ndarray] | None = None
    """A side stream's collective: its groups (arrays whose rows are a group's ranks), each of which ends
    together, when its last rank is there plus the collective's time (kept: an arrival may move)."""
    queued: np.ndarray | None = None
    """A side stream's command where its thread gets no core beside compute (`SimWorkers.defer`): per rank,
    when it could first have begun (before `_postpone` moved it)."""


@dataclass
class MemEvent:
    ranks: np.ndarray
    times: np.ndarray
    delta: int
    where: str


class _Value:
    __slots__ = ("fake", "storage")

    def __init__(self, fake: Any, storage: int) -> None:
        self.fake, self.storage = fake, storage


class SimWorkers:
    """The simulated workers of one mesh."""

    def __init__(self, dev: DeviceProfile, size: int, hosts: np.ndarray) -> None:
        self.dev = dev
        self.size = size
        self.hosts = hosts
        """Rank -> its host."""
        self.inline = dev.kind == "cpu"
        self.dispatch = np.zeros(size)
        self.streams: dict[int, np.ndarray] = {0: np.zeros(size)}
        self.events: list[Event] = []
        self.mem: list[MemEvent] = []
        self.live = np.zeros(size, dtype=np.int64)
        """Bytes allocated per rank now."""
        self.baseline = np.zeros(size, dtype=np.int64)
        """Bytes allocated per rank when the recording window began."""
        self.window = 0.0
        self.values: dict[int, _Value | None] = {}
        self.storages: dict[int, list] = {}
        """Storage key -> [bytes, handles naming it, ranks array]."""
        self.groups: dict[int, tuple] = {}
        self.fake = FakeTensorMode(allow_non_fake_inputs=True)
        self._keys = itertools.count(1)
        self._ops: dict[str, Any] = {}
        self.names: dict[int, str] = {0: "main"}
        """Stream id -> name, as the controller named it (known from borrows)."""
        self.commands = 0
        self.open: dict[int, list[Event]] = {}
        """Stream id (not main) -> its events that may still end after some rank's main stream is at."""
        self.sharing = self.inline and (dev.compute_contention > 1.0 or dev.comm_contention > 1.0)
        """Compute and a side stream's work slow each other down where they overlap (CPU workers)."""
        self.defer = self.sharing and dev.comm_contention >= STALLED
        """A side stream's thread woken while the main thread computes gets no core until that op ends
        (calibrated: a collective beside compute made no progress); from then on they share (`_share`)."""
        self.local = hosts == 0
        """Ranks on the controller's host."""
        self.loaded = dev.controller_load > 1.0 and bool(self.local.any())
        """The controller's Python slows down the workers of its host while it runs (`controller_busy`)."""
        self.ahead: list[Event | MemEvent] = []
        """Events that may still end after the controller's clock (what `controller_busy` may move)."""
        self.worked: dict[int, np.ndarray] = {}
        """Stream id (not main) -> per rank, when its thread ended its last command (CPU: after that it sleeps
        until it is given another)."""
        self.held: dict[int, np.ndarray] = {}
        """Stream id (not main) -> per rank, until when its thread waits for a reduce (on a GPU)."""
        self.owed = np.zeros(size) if self.inline and (dev.after_reduce > 0 or dev.beside_reduce > 0) else None
        """Per rank: what the ops after a reduce on the command thread still lose (`after_reduce`, CPU)."""
        self.steps: list[tuple[np.ndarray, np.ndarray]] = []
        """(ranks, when each had run all it was given) at each step's end (`sim.step()`, `prof.step()`)."""
        self.since = np.zeros(size)
        """Per rank: seconds of compute since its last collective (what `reduce_in_step` follows)."""
        self.in_step = (
            np.array([0.0, *(c for c, _ in dev.reduce_in_step)]),
            np.array([0.0, *(x for _, x in dev.reduce_in_step)]),
        ) if self.inline and dev.reduce_in_step else None  # fmt: skip
        """`reduce_in_step`'s points, from none after no compute (CPU workers)."""
        self.in_step_loaded = (
            np.array([0.0, *(c for c, _ in dev.reduce_in_step_loaded)]),
            np.array([0.0, *(x for _, x in dev.reduce_in_step_loaded)]),
        ) if self.in_step is not None and dev.reduce_in_step_loaded and self.local.any() else None  # fmt: skip
        """`reduce_in_step_loaded`'s points (CPU workers on the controller's host)."""
        self.watched = self.loaded or self.in_step_loaded is not None
        """The controller's spans of Python matter here (`controller_busy`)."""
        self.met_at = np.zeros(size)
        """Per rank: when it met its group at its last collective (the span `_apart` asks about)."""
        self.busy: list[tuple[float, float, float]] = []
        """The controller's spans of Python, (start, end, CPU share), of its last `BUSY_KEPT` seconds."""
        self.cold = (
            np.array([0.0, *(b for b, _ in dev.cold_ops)]),
            np.array([0.0, *(x for _, x in dev.cold_ops)]),
        ) if self.inline and dev.cold_ops else None  # fmt: skip
        """`cold_ops`' points, from none after nothing moved (CPU workers)."""
        self.moved = np.zeros((COLD_WINDOW, size))
        """Per rank, bytes each of its last `COLD_WINDOW` ops moved (a ring, at `_slot`: what `cold_ops` follows)."""
        self._slot = 0
        self.starved = np.zeros(size)
        """Per rank: seconds in the window it had run everything it was given and waited for the controller
        to send more (idle because of the controller's own time, not the device's)."""

    # -- clocks ------------------------------------------------------------------------------------
    def reset(self, now: float) -> None:
        """Start a new recording window at `now` (events and memory history so far are dropped)."""
        self.events.clear()
        self.open.clear()
        self.mem.clear()
        self.ahead.clear()
        self.steps.clear()
        self.starved[:] = 0.0
        self.commands = 0
        self.baseline = self.live.copy()
        self.window = now
        self.dispatch = np.maximum(self.dispatch, now)
        for s in self.streams.values():
            np.maximum(s, now, out=s)

    def _stream(self, sid: int) -> np.ndarray:
        s = self.streams.get(sid)
        if s is None:
            s = self.streams[sid] = np.zeros(self.size)
        return s

    def _main(self, idx: np.ndarray) -> np.ndarray:
        return self.dispatch[idx] if self.inline else self.streams[0][idx]

    def _take(self, idx: np.ndarray) -> None:
        """The command thread takes one command."""
        self.dispatch[idx] += self.dev.dispatch

    def _run(
        self, idx: np.ndarray, sid: int, dur: Any, name: str, kind: str, where: str, flops=0.0, nb=0
    ) -> np.ndarray:
        """An op of `dur` seconds on stream `sid` of ranks `idx`; returns its start times."""
        self._take(idx)
        if sid == 0 and self.inline:
            start = self.dispatch[idx]
            if self.owed is not None:  # (the first op after a reduce on this thread pays what it lost)
                dur = dur + self.owed[idx]
                self.owed[idx] = 0.0
            end = start + dur
            if self.sharing and kind == "compute" and len(self.streams) > 1:
                end = self._share(idx, start, end)
            self.dispatch[idx] = end
        else:
            s = self._stream(sid)
            start = self._side_start(idx, sid)
            end = start + dur
            s[idx] = end
            if self.inline:
                self._worked(sid)[idx] = end
        if kind == "compute" and self.in_step is not None:
            self.since[idx] += end - start
        self._record(Event(idx, sid, start, end, name, kind, where, flops, nb))
        return start

    def _record(self, ev: Event) -> None:
        self.events.append(ev)
        if ev.stream != 0 and self.sharing:
            self.open.setdefault(ev.stream, []).append(ev)
            if self.defer:
                ev.queued = ev.start.copy()
        if self.loaded:
            self.ahead.append(ev)

    def _record_mem(self, ev: MemEvent) -> None:
        self.mem.append(ev)
        if self.loaded:
            self.ahead.append(ev)

    def controller_busy(self, t0: float, t1: float, share: float = 1.0) -> None:
        """The controller ran the program's Python from `t0` to `t1` (seconds), computing for `share` of it,
        on its host's cores: the work of those ranks planned in that span progresses `controller_load`
        times slower (at full share), and what comes after moves back by what it lost (in the trace too).
        Calibrated as a whole-host reduce's slowdown while another process computes: a step's reduces
        during the backward pass run beside the controller issuing the rest of the step."""
        took = t1 - t0
        if self.in_step_loaded is not None and took > 0:
            self.busy.append((t0, t1, max(0.0, min(share, 1.0))))
            if self.busy[0][1] < t1 - BUSY_KEPT:
                self.busy = [b for b in self.busy if b[1] >= t1 - BUSY_KEPT]
        f = 1.0 + (self.dev.controller_load - 1.0) * max(0.0, min(share, 1.0))
        if took <= 0 or f <= 1.0:
            return
        m = self.local
        for clock in (self.dispatch, *self.streams.values()):
            clock[m] = _stretch(clock[m], t0, took, f)
        keep: list[Event | MemEvent] = []
        for ev in self.ahead:
            times = (ev.start, ev.end) if type(ev) is Event else (ev.times,)
            if float(times[-1].max()) <= t0:  # over before the controller's clock: never moves again
                continue
            em = m[ev.ranks]
            for t in times:
                t[em] = _stretch(t[em], t0, took, f)
            keep.append(ev)
        self.ahead = keep

    def _share(self, idx: np.ndarray, start: np.ndarray, end: np.ndarray) -> np.ndarray:
        """The end of a compute op on a CPU worker's main stream over [`start`, `end`) alone, where a side
        stream of its rank is still busy (in a step: reducing gradients while the backward computes).

        They share the cores: while both run, compute runs `compute_contention` times slower and the side
        stream `comm_contention` times slower (both calibrated); whichever ends first leaves the other
        alone. The side stream's later work moves back by what it lost, its events in the trace too."""
        fc, fm = max(self.dev.compute_contention, 1.0), max(self.dev.comm_contention, 1.0)
        dur = end - start
        out = end.copy()
        for sid, clock in self.streams.items():
            if sid == 0:
                continue
            left = clock[idx] - start  # the side stream's work still to run, in seconds alone
            busy = left > 0
            if not busy.any():
                continue
            if self.defer:  # a thread that has not begun its next command waits for this op to end
                waiting = busy & ~self._begun(sid, idx, start)
                if waiting.any():
                    self._postpone(sid, idx, start, np.where(waiting, end, -np.inf))
                busy &= ~waiting
                if not busy.any():
                    continue
            left = np.where(busy, left, 0.0)
            compute_first = dur * fc <= left * fm
            # how long the compute takes (0 where the side stream is idle); the side stream gets 1/fm of
            # that time's progress
            took = np.where(busy, np.where(compute_first, dur * fc, left * fm + dur - left * fm / fc), 0.0)
            out = np.maximum(out, start + took)
            clock[idx] = _stretch(clock[idx], start, took, fm)
            self._stretch_events(sid, idx, start, took, fm)
        return out

    def _begun(self, sid: int, idx: np.ndarray, at: np.ndarray) -> np.ndarray:
        """Per rank of `idx`: whether stream `sid`'s thread is inside a command when main begins an op at
        `at`: it ends after `at`, and began while main paused longer than a wake (half the hand-over), or by
        `at` after waiting `side_wait` for a core since it was queued."""
        when = np.full(self.size, np.nan)
        when[idx] = at
        inside = np.zeros(self.size, dtype=bool)
        wake, wait = self.dev.handoff / 2, self.dev.side_wait
        for ev in self.open.get(sid, ()):
            t = when[ev.ranks]
            turn = (ev.start <= t) & (t >= ev.queued + wait)  # (`_begun` is asked only where `defer` set it)
            inside[ev.ranks] |= (ev.end > t) & ((ev.start < t - wake) | turn)
        return inside[idx]

    def _postpone(self, sid: int, idx: np.ndarray, since: np.ndarray, until: np.ndarray) -> None:
        """Stream `sid`'s commands on ranks `idx`, none of which it had begun by `since` (`_begun`), begin no
        earlier than `until` (-inf: not moved); every later command of the stream, and a collective's end on
        every rank of its group, moves with them (the trace too)."""
        frm, to = np.full(self.size, np.inf), np.full(self.size, -np.inf)
        frm[idx], to[idx] = since, until
        prev = np.full(self.size, -np.inf)  # per rank: where the stream's command before this one ends
        low = float(since.min())
        keep = []
        for ev in self.open.get(sid, ()):  # (in the stream's order)
            if float(ev.end.max()) <= low:  # over before any of these ranks' ops began: never moves again
                continue
            keep.append(ev)
            r = ev.ranks
            begin = np.maximum(ev.start, prev[r])
            begin = np.where(ev.end > frm[r], np.maximum(begin, to[r]), begin)  # (not over by `since`: not begun)
            if ev.sync is None:
                ev.end = begin + (ev.end - ev.start)
            else:  # a collective ends as much later as its group's last arrival
                pos = np.full(self.size, -1)
                pos[r] = np.arange(len(r))
                end = ev.end.copy()
                for groups in ev.sync:
                    p = pos[groups]
                    end[p] += (begin[p].max(axis=1) - ev.start[p].max(axis=1))[:, None]
                ev.end = end
            ev.start = begin
            prev[r] = ev.end
        self.open[sid] = keep
        clock = self.streams[sid]
        moved = prev > -np.inf
        clock[moved] = np.maximum(clock[moved], prev[moved])
        self._worked(sid)[moved] = np.maximum(self._worked(sid)[moved], prev[moved])

    def _stretch_events(self, sid: int, idx: np.ndarray, start: np.ndarray, took: np.ndarray, fm: float) -> None:
        pos = np.full(self.size, -1)
        pos[idx] = np.arange(len(idx))
        low = float(start.min())
        prev = np.full(self.size, -np.inf)  # per rank: where the event before now ends
        keep = []
        for ev in self.open.get(sid, ()):  # (in the stream's order)
            if float(ev.end.max()) <= low:  # over before any of these ranks' main streams are now: never again
                continue
            keep.append(ev)
            p = pos[ev.ranks]
            m = p >= 0
            if not m.any():
                continue
            ranks = ev.ranks[m]
            # an op queued behind another starts when that one now ends; one the stream was idle for still
            # starts when it did (then waits for the cores, as a real trace shows it)
            ev.start[m] = np.maximum(ev.start[m], prev[ranks])
            ev.end[m] = _stretch(ev.end[m], start[p[m]], took[p[m]], fm)
            prev[ranks] = ev.end[m]
        self.open[sid] = keep

    def _ready(self, idx: np.ndarray, sid: int) -> np.ndarray:
        """When stream `sid` of ranks `idx` could start its next command (taking it included)."""
        self._take(idx)
        if sid == 0 and self.inline:
            return self.dispatch[idx].copy()
        return self._side_start(idx, sid)

    def _side_start(self, idx: np.ndarray, sid: int) -> np.ndarray:
        """When stream `sid` (not main on a CPU) of ranks `idx` starts a command the command thread has just
        queued: after what is queued before it, and on a CPU not before its thread is woken, if it slept."""
        at = np.maximum(self._stream(sid)[idx], self.dispatch[idx])
        if not self.inline or self.dev.handoff <= 0:
            return at
        asleep = self._worked(sid)[idx] < self.dispatch[idx]
        return np.maximum(at, np.where(asleep, self.dispatch[idx] + self.dev.handoff / 2, 0.0))

    def _worked(self, sid: int) -> np.ndarray:
        w = self.worked.get(sid)
        if w is None:
            w = self.worked[sid] = np.zeros(self.size)
        return w

    def _finish(self, idx: np.ndarray, sid: int, end: np.ndarray) -> None:
        if sid == 0 and self.inline:
            self.dispatch[idx] = end
        else:
            self._stream(sid)[idx] = end
            if self.inline:
                self._worked(sid)[idx] = end

    def synced(self, rank: int) -> float:
        """When every stream of `rank` has run what it was given (a value can be read)."""
        return max(self.dispatch[rank], *(s[rank] for s in self.streams.values())) + self.dev.dispatch

    def _done(self, idx: np.ndarray) -> np.ndarray:
        """Per rank of `idx`: when its command thread and every stream have run what they were given."""
        return np.maximum.reduce([self.dispatch[idx], *(s[idx] for s in self.streams.values())])

    # -- commands ----------------------------------------------------------------------------------
    def run_batch(self, idx: np.ndarray, batch: list, arrival: float) -> None:
        if self.events:  # (before its first op the window has not begun)
            self.starved[idx] += np.maximum(arrival - self._done(idx), 0.0)
        # (a worker decodes a whole batch before it runs the first of its commands)
        self.dispatch[idx] = np.maximum(self.dispatch[idx], arrival) + len(batch) * self.dev.decode
        for cmd in batch:
            self.commands += 1
            if type(cmd) is P.OnStream:
                self._command(idx, cmd.stream_id, cmd.cmd)
            else:
                self._command(idx, 0, cmd)

    def _command(self, idx: np.ndarray, sid: int, cmd: Any) -> None:
        t = type(cmd)
        if t is P.Op:
            self._op(idx, sid, cmd)
        elif t is P.Reduce:
            self._reduce(idx, sid, cmd)
        elif t is P.MoveWithin:
            self._move(idx, sid, cmd)
        elif t is P.Free:
            at = self._ready(idx, sid)
            self._finish(idx, sid, at)
            at = at if self.inline else self.dispatch[idx].copy()  # (a GPU's caching allocator: at once)
            for ref in cmd.refs:
                self._drop(ref, idx, at)
        elif t is P.Alias:
            self._take(idx)
            old = self.values.get(cmd.ref)
            target = self.values.get(cmd.target)
            if target is not None:
                self.storages[target.storage][1] += 1
            self.values[cmd.ref] = target
            if old is not None:
                self._release(old.storage, idx, self._main(idx))
        elif t is P.BorrowStart:
            self._take(idx)
            mark = self._main(idx) if cmd.from_stream == 0 else self._stream(cmd.from_stream)[idx]
            s = self._stream(cmd.to_stream)
            s[idx] = np.maximum(s[idx], mark)
            v = self.values.get(cmd.src)
            if v is not None:
                self.storages[v.storage][1] += 1
            self.values[cmd.alias] = v
        elif t is P.BorrowEnd:
            self._take(idx)
            done = self._stream(cmd.to_stream)[idx]
            if cmd.from_stream == 0 and self.inline:  # the main thread waits for the drop: a hand-over
                d = self.dispatch[idx]
                # (its wake: half the hand-over, the side thread's wake was the other half)
                self.dispatch[idx] = np.where(done > d, done + self.dev.handoff / 2, d)
                if self.owed is not None:  # (one that waited ran nothing beside the reduce: the hand-over is
                    self.owed[idx] = np.where(done > d, 0.0, self.owed[idx])  # what the wait cost it)
            else:
                s = self._stream(cmd.from_stream)
                s[idx] = np.maximum(s[idx], done)
                if cmd.from_stream == 0 and cmd.to_stream in self.held:  # (a GPU) the main thread waits too
                    self.dispatch[idx] = np.maximum(self.dispatch[idx], self.held[cmd.to_stream][idx])
            v = self.values.pop(cmd.alias, None)
            if v is not None:
                self._release(v.storage, idx, done)
        elif t in (P.FailResults, P.CallActor):  # (no actor runs on a simulated mesh: nothing to call)
            self._take(idx)
            for ref in _refs(cmd.out):
                self.values[ref] = None
        elif t in (P.SendTo, P.RecvFrom):
            nb = _numel(cmd.shape) * _itemsize(cmd.dtype)
            dur = costs.p2p_time(self.dev, nb, True)
            self._run(idx, sid, dur, "send" if t is P.SendTo else "recv", "comm", cmd.where, 0.0, nb)
            if t is P.RecvFrom:
                self._new_value(cmd.out, torch.empty(cmd.shape, dtype=cmd.dtype), idx, self._main(idx), cmd.where)
        elif t is P.ProfileStep:  # a step ends where each rank has run what came before it
            self._take(idx)
            self.steps.append((idx, self._done(idx)))
        else:  # Seed, other profiler commands: the command thread's time only
            self._take(idx)

    def _resolve(self, x: Any) -> Any:
        if isinstance(x, Ref):
            v = self.values.get(x.id)
            if v is None:
                raise _Unknown(x.id)
            return v.fake
        if isinstance(x, torch.Tensor):
            return self.fake.from_tensor(x)
        if isinstance(x, list | tuple):
            return type(x)(self._resolve(o) for o in x)
        if isinstance(x, dict):
            return {k: self._resolve(v) for k, v in x.items()}
        return x

    def _lookup(self, name: str) -> Any:
        fn = self._ops.get(name)
        if fn is None:
            ns, _, rest = name.partition("::")
            base, _, overload = rest.partition(".")
            fn = self._ops[name] = getattr(getattr(getattr(torch.ops, ns), base), overload or "default")
        return fn

    def _op(self, idx: np.ndarray, sid: int, cmd: P.Op) -> None:
        func = self._lookup(cmd.name)
        try:
            with self.fake:
                args, kwargs = self._resolve(cmd.args), self._resolve(cmd.kwargs)
                out = func(*args, **kwargs)
        except Exception:  # (a poisoned input, or an op the workers would fail too): its results are unknown
            self._take(idx)
            for ref in _refs(cmd.out):
                self.values[ref] = None
            return
        dur, flops, nb = costs.op_cost(self.dev, func, args, kwargs, out)
        if self.cold is not None:  # (the ops before it moved more than the caches hold: it pays to refill them)
            dur = dur + np.interp(self.moved[:, idx].sum(axis=0), *self.cold)
            self.moved[self._slot, idx] = nb
            self._slot = (self._slot + 1) % COLD_WINDOW
        kind = "comm" if cmd.name.startswith("c10d::") else "compute"
        alloc_at = self._run(idx, sid, dur, cmd.name, kind, cmd.where, flops, nb)  # (the op's start)
        if not self.inline:  # (on a GPU the command thread allocates results as it launches the op)
            alloc_at = self.dispatch[idx]
        shares = _shared_memory(func, cmd)
        for ref, value in zip(_flat(cmd.out), _flat(out)):
            if ref is None or not isinstance(value, torch.Tensor):
                continue
            src = shares.get(ref)
            base = self.values.get(src) if src is not None else None
            if base is not None:
                self.storages[base.storage][1] += 1
                self._set(ref, _Value(value, base.storage), idx)
            else:
                self._new_value(ref, value, idx, alloc_at, cmd.where)

    def _new_value(self, ref: int, fake: Any, idx: np.ndarray, at: np.ndarray, where: str) -> None:
        nb = costs.alloc_bytes(self.dev, fake)
        key = next(self._keys)
        self.storages[key] = [nb, 1, idx]
        self._set(ref, _Value(fake, key), idx)
        if nb:
            self.live[idx] += nb
            self._record_mem(MemEvent(idx, at.copy(), nb, where))

    def _set(self, ref: int, v: _Value, idx: np.ndarray) -> None:
        old = self.values.get(ref)
        self.values[ref] = v
        if old is not None:  # an in-place op's result reuses its input's id: nothing new
            self._release(old.storage, idx, self._main(idx))

    def _drop(self, ref: int, idx: np.ndarray, at: np.ndarray) -> None:
        v = self.values.pop(ref, None)
        if v is not None:
            self._release(v.storage, idx, at)

    def _release(self, key: int, idx: np.ndarray, at: np.ndarray) -> None:
        st = self.storages.get(key)
        if st is None:
            return
        st[1] -= 1
        if st[1] <= 0:
            del self.storages[key]
            nb, _, owners = st
            if nb:
                self.live[owners] -= nb
                times = at if len(at) == len(owners) else np.full(len(owners), float(np.max(at)))
                self._record_mem(MemEvent(owners, times.copy(), -nb, "free"))

    def _reduce(self, idx: np.ndarray, sid: int, cmd: P.Reduce) -> None:
        kind = _COLLECTIVE[(bool(cmd.scatter), cmd.reduction == "stack")]
        elements = _numel(cmd.shape)
        nb = elements * _itemsize(cmd.dtype)
        ready = np.zeros(self.size)
        ready[idx] = self._ready(idx, sid)
        alloc_at = ready[idx] if self.inline else self.dispatch[idx]  # (on a GPU: as the thread launches it)
        end = ready.copy()
        partition = self.groups.get(cmd.gid) or (tuple(int(r) for r in idx),)
        sync = []
        for groups in _by_size(partition):
            p = groups.shape[1]
            hosts = self.hosts[groups]
            spans = hosts.min(axis=1) != hosts.max(axis=1)
            dur = np.where(spans, costs.collective_time(self.dev, kind, nb, p, True, elements),
                           costs.collective_time(self.dev, kind, nb, p, False, elements))  # fmt: skip
            if self.in_step is not None and p > 1:  # (its ranks gather from their compute: see `reduce_in_step`)
                dur = dur + self._apart(groups, ready[groups].max(axis=1))
            end[groups] = (ready[groups].max(axis=1) + dur)[:, None]
            sync.append(groups)
        self._finish(idx, sid, end[idx])
        self.since[idx] = 0.0
        if self.in_step_loaded is not None:
            self.met_at[idx] = end[idx]
        if self.owed is not None:  # (what the main thread's next op loses: it waited, or it runs beside it)
            self.owed[idx] += self.dev.after_reduce if sid == 0 else self.dev.beside_reduce
        if not self.inline:  # on a GPU the engine reads the reduce's failure flag: its thread waits for the end
            if sid == 0:
                self.dispatch[idx] = np.maximum(self.dispatch[idx], end[idx])
            else:
                held = self.held.setdefault(sid, np.zeros(self.size))
                held[idx] = np.maximum(held[idx], end[idx])
        name = f"{kind} ({cmd.reduction})"
        self._record(Event(idx, sid, ready[idx], end[idx], name, "comm", cmd.where, 0.0, nb, sync if sid else None))
        if cmd.out != cmd.src:
            shape = _out_shape(cmd)
            self._new_value(cmd.out, _empty(self, shape, cmd.dtype), idx, alloc_at, cmd.where)

    def _apart(self, groups: np.ndarray, ready: np.ndarray) -> np.ndarray:
        """Per group (a row of ranks, all of which can start the collective by `ready`): how much later than its
        ranks' modelled arrival the last of them arrives, after the compute each ran since its last collective
        (`reduce_in_step`), blended toward `reduce_in_step_loaded` by the share of that span the controller
        computed on its host (its ranks there)."""
        compute = self.since[groups].max(axis=1)
        apart = np.interp(compute, *self.in_step)
        if self.in_step_loaded is None or not self.busy:
            return apart
        # (the controller's Python that runs beside a span of the workers' is mostly what it does after it
        # issued this collective, not known yet: its share over as long a span just before stands in for it)
        spans = np.array(self.busy)
        now = float(spans[-1, 1])
        lo = now - np.clip(ready - self.met_at[groups].max(axis=1), 1e-6, BUSY_KEPT)
        covered = np.clip(spans[:, 1] - np.maximum(spans[:, 0], lo[:, None]), 0.0, None)
        share = (covered * spans[:, 2]).sum(axis=1) / (now - lo)
        share = np.clip(share, 0.0, 1.0) * self.local[groups].mean(axis=1)
        return apart + share * (np.interp(compute, *self.in_step_loaded) - apart)

    def _move(self, idx: np.ndarray, sid: int, cmd: P.MoveWithin) -> None:
        nb = _numel(cmd.shape) * _itemsize(cmd.dtype)
        ready = np.zeros(self.size)
        ready[idx] = self._ready(idx, sid)
        end = ready.copy()
        for s, d in cmd.pairs:
            start = max(ready[s], ready[d])
            end[s] = end[d] = start + (
                costs.p2p_time(self.dev, nb, bool(self.hosts[s] != self.hosts[d])) if s != d else nb / self.dev.mem_bw
            )
        self._finish(idx, sid, end[idx])
        self._record(Event(idx, sid, ready[idx], end[idx], "send/recv", "comm", cmd.where, 0.0, nb))
        dst = np.array(sorted({d for _, d in cmd.pairs}), dtype=np.int64)
        self._new_value(cmd.out, _empty(self, cmd.shape, cmd.dtype), dst, end[dst], cmd.where)

    def origin(self) -> float:
        """Time zero of the window's trace: its first op's start (the controller's time before it is not shown)."""
        return min((float(e.start.min()) for e in self.events if len(e.start)), default=self.window)

    def fake_of(self, ref: int) -> Any:
        v = self.values.get(ref)
        return None if v is None else v.fake

    # -- memory ------------------------------------------------------------------------------------
    def memory(self) -> tuple[np.ndarray, np.ndarray, list[str]]:
        """Per rank: peak bytes in the window, when (seconds), and what allocated last before it."""
        peak = self.baseline.astype(np.float64).copy()
        when = np.full(self.size, self.window)
        what = ["(before the window)"] * self.size
        if not self.mem:
            return peak, when, what
        ranks = np.concatenate([m.ranks for m in self.mem])
        times = np.concatenate([m.times for m in self.mem])
        deltas = np.concatenate([np.full(len(m.ranks), m.delta, dtype=np.int64) for m in self.mem])
        which = np.concatenate([np.full(len(m.ranks), i) for i, m in enumerate(self.mem)])
        # frees before allocations at the same moment; then per rank, in time order
        order = np.lexsort((deltas > 0, times, ranks))
        ranks, times, deltas, which = ranks[order], times[order], deltas[order], which[order]
        level = np.cumsum(deltas)
        starts = np.searchsorted(ranks, np.arange(self.size))
        ends = np.searchsorted(ranks, np.arange(self.size), side="right")
        for r in range(self.size):
            a, b = starts[r], ends[r]
            if a == b:
                continue
            before = level[a - 1] if a else 0
            seg = level[a:b] - before + self.baseline[r]
            i = int(np.argmax(seg))
            if seg[i] > peak[r]:
                peak[r], when[r], what[r] = seg[i], times[a + i], self.mem[which[a + i]].where
        return peak, when, what


def _stretch(t: np.ndarray, start: np.ndarray, took: np.ndarray, fm: float) -> np.ndarray:
    """Where a side stream's point `t` (planned as if alone) moves when, from `start`, it shares the cores
    with compute for `took` seconds, progressing 1/`fm` as fast meanwhile."""
    u = t - start
    slow = took / fm  # the side stream's progress (seconds alone) while the compute runs
    return np.where(u <= 0, t, np.where(u <= slow, start + u * fm, t + took - slow))


class _Unknown(Exception):
    """A command names a value the simulated workers do not have (freed, poisoned)."""


def _by_size(partition: tuple) -> list[np.ndarray]:
    """A rank partition as arrays of groups of equal size (one array per size)."""
    out: dict[int, list] = {}
    for g in partition:
        out.setdefault(len(g), []).append(g)
    return [np.array(gs, dtype=np.int64) for gs in out.values()]


def _refs(out: Any) -> list[int]:
    if isinstance(out, int):
        return [out]
    if isinstance(out, list | tuple):
        return [r for o in out for r in _refs(o)]
    return []


def _flat(x: Any) -> list:
    """An op's results (or their ids, as the controller nests them) in order, one per tensor."""
    if isinstance(x, list | tuple):
        return [o for item in x for o in _flat(item)]
    return [x]


def _shared_memory(func: Any, cmd: P.Op) -> dict[int, int]:
    """Result id -> the id of the input whose memory it shares (views, in-place results: `alias_plan`)."""
    found = {}
    single = len(func._schema.returns) == 1
    for r, i, name in alias_plan(func):
        src = cmd.args[i] if i < len(cmd.args) else cmd.kwargs.get(name)
        if isinstance(src, Ref):
            ids = cmd.out if single else (cmd.out[r] if isinstance(cmd.out, list) and r < len(cmd.out) else None)
            for ref in _refs(ids):
                found[ref] = src.id
    return found


def _numel(shape: tuple) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def _itemsize(dtype: Any) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _out_shape(cmd: P.Reduce) -> tuple:
    shape = tuple(cmd.shape)
    if cmd.reduction == "stack":
        return (cmd.size, *shape) if not cmd.scatter else (cmd.size, *shape[1:])
    return (shape[0] // cmd.size, *shape[1:]) if cmd.scatter else shape


def _empty(w: SimWorkers, shape: tuple, dtype: Any) -> Any:
    with w.fake:
        return torch.empty(shape, dtype=dtype)
