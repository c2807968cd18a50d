"""The profiler on a worker: started, stepped and marked by tensor commands from the controller's
`monarch.profiler.profile`, read back by `collect` (a call by name) when the profile ends.

Traces stay in memory until `collect`: the controller writes the files, so a worker on another host
needs no shared directory.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Iterator
from typing import Any

import torch

_prof: Any = None
"""The running `torch.profiler.profile`, if any."""
_traces: list[bytes] = []
"""Chrome traces (JSON) the schedule made ready and `collect` has not taken yet."""
_marks: dict[int, list] = {}
"""Open `record_function` handles per thread (each stream runs on its own thread)."""


blockers: list = []
"""Functions saying why torch's profiler cannot start now (None: it can); `worker.memory` adds one."""
_refused: str | None = None
"""Why the last `start` did not start (told by `collect`: a tensor command has nobody to tell)."""


def start(config: dict) -> None:
    """Start profiling every thread of this worker, as `config` (see `monarch.runtime.tools.profiler`) says."""
    global _prof, _refused
    _refused = None
    if _prof is not None:
        _refused = "a monarch.profiler profile is already running on this worker; profiles do not nest"
        return
    for why_not in blockers:
        _refused = why_not()
        if _refused is not None:
            return
    from torch.profiler import ProfilerActivity, profile, schedule

    activities = [getattr(ProfilerActivity, a) for a in config["activities"]]
    if ProfilerActivity.CUDA in activities and not torch.cuda.is_available():
        activities.remove(ProfilerActivity.CUDA)
        if not activities:
            activities = [ProfilerActivity.CPU]
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # kineto's start/stop notes on every worker's stderr
    sched = config.get("schedule")
    _traces.clear()
    _prof = profile(
        activities=activities,
        schedule=schedule(**sched) if sched else None,
        on_trace_ready=_keep,
        record_shapes=config.get("record_shapes", False),
        profile_memory=config.get("profile_memory", False),
        with_stack=config.get("with_stack", False),
        with_flops=config.get("with_flops", False),
        experimental_config=torch._C._profiler._ExperimentalConfig(profile_all_threads=True),
    )
    with warnings.catch_warnings(), _inductor_left_alone():
        warnings.simplefilter("ignore")  # kineto's notes about CUPTI on a CPU machine
        _prof.__enter__()


def step() -> None:
    if _prof is not None:
        with _inductor_left_alone():  # a step may prepare the trace (warmup begins)
            _prof.step()


@contextlib.contextmanager
def _inductor_left_alone() -> Iterator[None]:
    """torch's profiler asks `hasattr(torch, "_inductor")` to read a CUDA-graphs flag of inductor's, which
    imports inductor and dynamo: 2 s per worker at a profile's start (4 workers on 2 cores made the first
    profiled steps of a loop 4x slower). Where inductor is not imported, nobody compiled with it: say so."""
    if "torch._inductor" in sys.modules:
        yield
        return
    lazy = torch.__dict__.get("__getattr__")

    def no_inductor(name: str) -> Any:
        if name == "_inductor":
            raise AttributeError(name)
        return lazy(name)

    if lazy is None:
        yield
        return
    torch.__getattr__ = no_inductor
    try:
        yield
    finally:
        torch.__getattr__ = lazy


def mark(name: str, enter: bool) -> None:
    """Open or close a `record_function` range on this thread (the stream's)."""
    stack = _marks.setdefault(threading.get_ident(), [])
    if enter:
        stack.append(torch.ops.profiler._record_function_enter_new(name, None))
    elif stack:
        torch.ops.profiler._record_function_exit._RecordFunction(stack.pop())


def collect() -> dict:
    """Stop profiling (after every stream ran what was queued) and hand over the traces.

    Returns the traces with this host's name and clock, so the controller can put every rank on one clock.
    """
    global _prof
    from monarch.runtime.worker.engine.streams import sync_streams

    sync_streams()
    if _refused is not None:
        raise RuntimeError(_refused)
    prof, _prof = _prof, None
    if prof is not None:
        prof.__exit__(None, None, None)  # a window still recording is made ready now
    traces = list(_traces)
    _traces.clear()
    return {"traces": traces, "host": socket.gethostname(), "now_ns": time.time_ns()}


def _keep(prof: Any) -> None:
    fd, path = tempfile.mkstemp(prefix="monarch-trace-", suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path, "rb") as f:
            _traces.append(f.read())
    finally:
        os.unlink(path)
