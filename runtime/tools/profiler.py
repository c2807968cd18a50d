"""`monarch.profiler`: torch's profiler on every worker of a mesh, one trace per rank plus a merged one.

    with mesh.activate(), profile(on_trace_ready="./traces/", schedule=Schedule(wait=1, warmup=1, active=2)) as prof:
        for batch in data:
            with record_function("forward"):
                loss = model(batch)
            ...
            prof.step()

Inside `mesh.activate()` (or with `mesh=`) the profiler runs on the mesh's workers: start, `step()` and
`record_function` travel as tensor commands, in order with the ops, without waiting for the workers. When
the block ends the workers hand their traces to the controller, which writes ``rank{N}.pt.trace.json``
per rank and ``merged.pt.trace.json`` (a process per rank, on the controller's clock) into the directory.
Inside a live function or a `%%mesh` cell (on a worker) it profiles that worker alone.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import socket
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from monarch.runtime.common import context
from monarch.runtime.tools import traces
from monarch.runtime.wire import protocol as P


@dataclass(frozen=True)
class Schedule:
    """Which `prof.step()` windows are recorded, as `torch.profiler.schedule` counts them."""

    wait: int
    """Steps skipped at the start of each cycle."""
    warmup: int
    """Steps the profiler runs but throws away (its start-up cost stays out of the trace)."""
    active: int
    """Steps recorded per cycle; each cycle writes one set of traces."""
    repeat: int = 0
    """Cycles; 0 repeats until the profile ends."""
    skip_first: int = 0
    """Steps skipped once, before the first cycle."""

    def __post_init__(self) -> None:
        for name in ("wait", "warmup", "active", "repeat", "skip_first"):
            v = getattr(self, name)
            if type(v) is not int or v < 0:
                raise ValueError(f"Schedule({name}={v!r}): must be a non-negative int")
        if self.active < 1:
            raise ValueError(f"Schedule(active={self.active}): at least one step must be recorded")


ACTIVITIES = ("CPU", "CUDA")
WORKER_MODULE = "monarch.runtime.worker.engine.profiler"


@dataclass
class ProfileResult:
    """What a profile wrote, and what its merged trace says."""

    directory: str
    rank_files: dict[int, list[str]] = field(default_factory=dict)
    """Per rank, its trace files (one per recorded cycle)."""
    merged_files: list[str] = field(default_factory=list)
    """One merged trace per recorded cycle."""
    merged: dict | None = None
    """The first cycle's merged trace."""
    summary: traces.Summary | None = None

    def text(self) -> str:
        if self.summary is None:
            return f"monarch.profiler: nothing was recorded (were there enough prof.step() calls?); {self.directory}"
        files = ", ".join(os.path.basename(f) for f in self.merged_files)
        n = len(self.rank_files)
        return f"monarch.profiler: {n} rank trace{'s' * (n != 1)} and {files} in {self.directory}\n" + (
            self.summary.text()
        )


class profile:
    """Profile a mesh's workers (see the module docstring); arguments as `torch.profiler.profile`'s.

    `activities`: `torch.profiler.ProfilerActivity` values or their names (default CPU and CUDA; CUDA is
    left out on CPU workers). `on_trace_ready`: the directory the traces go to. `mesh`: the mesh to profile
    (default: the one of the innermost `mesh.activate()`).
    """

    def __init__(
        self,
        activities: list | None = None,
        *,
        on_trace_ready: str | os.PathLike = "./traces/",
        schedule: Schedule | None = None,
        record_shapes: bool = False,
        profile_memory: bool = False,
        with_stack: bool = False,
        with_flops: bool = False,
        mesh: Any = None,
    ) -> None:
        if not isinstance(on_trace_ready, str | os.PathLike):
            raise ValueError(
                f"profile(on_trace_ready={on_trace_ready!r}): give the directory the traces go to, e.g. './traces/'"
            )
        if schedule is not None and not isinstance(schedule, Schedule):
            raise ValueError(
                f"profile(schedule={schedule!r}): give a monarch.profiler.Schedule(wait=..., warmup=..., active=...)"
            )
        names = []
        for a in activities if activities is not None else ACTIVITIES:
            name = getattr(a, "name", a)
            if name not in ACTIVITIES:
                raise ValueError(f"profile(activities=[..., {a!r}]): allowed are ProfilerActivity.CPU and .CUDA")
            names.append(name)
        self.directory = os.fspath(on_trace_ready)
        self.config = {
            "activities": names,
            "schedule": asdict(schedule) if schedule is not None else None,
            "record_shapes": bool(record_shapes),
            "profile_memory": bool(profile_memory),
            "with_stack": bool(with_stack),
            "with_flops": bool(with_flops),
        }
        self.mesh = mesh
        self.result: ProfileResult | None = None
        self._local: Any = None
        self._target: Any = None

    # -- the mesh's workers ---------------------------------------------------------------------------
    def start(self) -> None:
        from monarch.runtime.mesh import mesh_to_act_on

        mesh = mesh_to_act_on(
            "profile",
            self.mesh if self.mesh is not None else self._default_mesh(),
            "monarch.profiler.profile: no mesh to profile; use it inside `with mesh.activate():`, "
            "pass mesh=..., or profile a %%mesh cell with `%%mesh --profile DIR`",
        )
        if mesh is None:
            self._start_local()
            return
        spawned = mesh.spawned
        spawned.check_usable()
        if id(spawned) in _running:
            raise RuntimeError("a monarch.profiler profile is already running on this mesh; profiles do not nest")
        from monarch.runtime.tensor.engine import engine_for
        from monarch.runtime.tensor.streams import MAIN

        _running.add(id(spawned))
        self._target = mesh
        engine_for(spawned).push(mesh._shape.ranks, P.ProfileStart(self.config), stream=MAIN)

    def step(self) -> None:
        """The end of a training step: the schedule moves on (no wait for the workers)."""
        if self._local is not None:
            self._local.step()
        elif self._target is not None:
            from monarch.runtime.tensor.engine import engine_for
            from monarch.runtime.tensor.streams import MAIN

            engine_for(self._target.spawned).push(self._target._shape.ranks, P.ProfileStep(), stream=MAIN)
        else:
            raise RuntimeError("prof.step(): the profile is not running (use it inside `with profile(...) as prof:`)")

    def stop(self) -> ProfileResult:
        """Stop, gather the workers' traces, write the files; the result is also kept in `self.result`."""
        if self._local is not None:
            self.result = self._stop_local()
            return self.result
        mesh, self._target = self._target, None
        if mesh is None:
            raise RuntimeError("the profile is not running")
        spawned = mesh.spawned
        try:
            from monarch.runtime.remote import RemoteFunction

            got = RemoteFunction.by_name(WORKER_MODULE, "collect", mesh)
            values = got.start((), {}, name="collecting profiler traces").result().values()
            offsets = _clock_offsets(mesh, [v["host"] for v in values])
        finally:
            _running.discard(id(spawned))
        ranks = [
            traces.RankTrace(r, spawned.labels[r], {}, offsets[i], v["host"])
            for i, (r, v) in enumerate(zip(mesh._shape.ranks, values, strict=True))
        ]
        self.result = _write(self.directory, ranks, [v["traces"] for v in values])
        return self.result

    def __enter__(self) -> profile:
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        if exc[0] is not None:  # the block failed: stop the workers' profilers, keep the block's error
            with contextlib.suppress(Exception):
                self.stop()
            return
        self._show(self.stop())

    def _default_mesh(self) -> Any:
        """The mesh to profile when none is given and none is active (the notebook's face names its own)."""
        return None

    def _show(self, result: ProfileResult) -> None:
        """Say what was written (a script's stderr); the notebook's face shows the timeline instead."""
        if self._local is None and sys.stderr is not None:
            print(result.text(), file=sys.stderr)

    # -- this worker alone (inside a live function or a %%mesh cell) -------------------------------------
    def _start_local(self) -> None:
        profiling = importlib.import_module(WORKER_MODULE)  # by name: controller code never imports worker code
        profiling.start(self.config)
        self._local = profiling

    def _stop_local(self) -> ProfileResult:
        got = self._local.collect()
        w = context.worker
        assert w is not None
        label = ",".join(f"{k}={v}" for k, v in w.coords.items())
        return _write(self.directory, [traces.RankTrace(w.rank, label, {}, 0, got["host"])], [got["traces"]])


_running: set[int] = set()
"""Spawned meshes (by id) with a profile running: profiles do not nest."""


def _write(directory: str, ranks: list[traces.RankTrace], per_rank: list[list[bytes]]) -> ProfileResult:
    """Write each rank's traces and, per cycle, the merged one; summarize the first cycle."""
    os.makedirs(directory, exist_ok=True)
    result = ProfileResult(os.path.abspath(directory))
    cycles = max((len(t) for t in per_rank), default=0)
    for k in range(cycles):
        suffix = "" if k == 0 else f".{k}"
        in_cycle = []
        for r, got in zip(ranks, per_rank, strict=True):
            if k >= len(got):
                continue
            path = os.path.join(result.directory, f"rank{r.rank}{suffix}.pt.trace.json")
            with open(path, "wb") as f:
                f.write(got[k])
            result.rank_files.setdefault(r.rank, []).append(path)
            in_cycle.append(traces.RankTrace(r.rank, r.label, json.loads(got[k]), r.offset_ns, r.host))
        if len(ranks) == 1 and context.worker is not None:
            continue  # one worker alone: its own trace is the whole story
        merged = traces.merge(in_cycle)
        path = os.path.join(result.directory, f"merged{suffix}.pt.trace.json")
        with open(path, "w") as f:
            json.dump(merged, f)
        result.merged_files.append(path)
        if k == 0:
            result.merged = merged
            result.summary = traces.summarize(merged)
    return result


def _clock_offsets(mesh: Any, hosts: list[str]) -> list[int]:
    """Each rank's clock minus ours: 0 on this host; elsewhere from the quickest of a few round trips."""
    here = socket.gethostname()
    if all(h == here for h in hosts):
        return [0] * len(hosts)
    from monarch.runtime.remote import RemoteFunction

    clock = RemoteFunction.by_name("time", "time_ns", mesh)
    best: list[tuple[int, int]] = [(1 << 62, 0)] * len(hosts)
    for _ in range(5):
        t0 = time.time_ns()
        theirs = clock.start((), {}, name="reading the workers' clocks").result().values()
        t1 = time.time_ns()
        for i, t in enumerate(theirs):
            if t1 - t0 < best[i][0]:
                best[i] = (t1 - t0, t - (t0 + t1) // 2)
    return [0 if h == here else off for h, (_, off) in zip(hosts, best, strict=True)]


class record_function(contextlib.ContextDecorator):
    """Name a range of work in the trace (a context manager or a decorator), as torch's `record_function`.

    Inside `mesh.activate()` the range is marked on the workers, on the active stream, in order with the ops;
    elsewhere (on a worker, or locally) it is torch's own.
    """

    def __init__(self, name: str) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"record_function(name={name!r}): give a non-empty string")
        self.name = name
        self._open: list[Any] = []

    def __enter__(self) -> record_function:
        from monarch.runtime.mesh import active_mesh

        mesh = active_mesh()
        if mesh is None:
            import torch

            local = torch.autograd.profiler.record_function(self.name)
            local.__enter__()
            self._open.append(local)
        else:
            from monarch.runtime.tensor.engine import engine_for
            from monarch.runtime.tensor.streams import get_active_stream

            where = (engine_for(mesh.spawned), mesh._shape.ranks, get_active_stream())
            where[0].push(where[1], P.ProfileMark(self.name, True), stream=where[2])
            self._open.append(where)
        return self

    def __exit__(self, *exc: Any) -> None:
        opened = self._open.pop()
        if isinstance(opened, tuple):
            engine, ranks, stream = opened
            engine.push(ranks, P.ProfileMark(self.name, False), stream=stream)
        else:
            opened.__exit__(*exc)
