"""`monarch.Simulator`: a mesh that simulates rather than computes, to check a program's timeline and
memory before running it.

    sim = monarch.Simulator(hosts=1, gpus=4, trace_mode="stream_only")
    mesh = sim.mesh.rename(gpu="dp")
    with mesh.activate():
        train(Net(), torch.rand(3, 4), torch.full((3,), 1, dtype=torch.int64))
    sim.display()              # the timeline inline, with compute/communication overlap per rank
    sim.trace("trace.json")    # Chrome/Perfetto: a process per rank, a track per stream

The mesh is a `ProcMesh` (rename, split, slice, activate, to_table); tensor-engine programs run on it
unchanged, on fake tensors, through the same backend seam as real workers (`simulator/backend.py`). Costs come
from a device's profile: datasheet rates for GPUs, or this machine measured by `Simulator.calibrate()`.
"""

from __future__ import annotations

import gc
import json
import os
from dataclasses import dataclass, field, replace
from typing import Any

from monarch.runtime.common.shape import format_ranks
from monarch.runtime.mesh import ProcMesh
from monarch.runtime.simulator import chrome
from monarch.runtime.simulator import devices as _devices
from monarch.runtime.simulator.backend import SimBackend
from monarch.runtime.simulator.devices import DeviceProfile
from monarch.runtime.tools import traces

TRACE_MODES = ("stream_only", "full")


@dataclass
class SimSummary:
    """What a simulated window says: per rank time, overlap and peak memory."""

    device: str
    timeline: traces.Summary
    peak_bytes: list[int] = field(default_factory=list)
    peak_at_ms: list[float] = field(default_factory=list)
    peak_where: list[str] = field(default_factory=list)
    commands: int = 0
    memory_limit: int = 0
    starved_ms: list[float] = field(default_factory=list)
    """Per rank: ms of the window it waited for the controller to send commands, having run all it had."""

    @property
    def step_ms(self) -> float:
        """A step's length (the slowest rank's), or the window's without steps marked."""
        return max((r.step_ms for r in self.timeline.ranks), default=0.0)

    @property
    def total_ms(self) -> float:
        """The window's length: from its start until the last rank's last op ended (or its last step, marked)."""
        return max((r.step_ms * r.steps for r in self.timeline.ranks), default=0.0)

    def overlap(self) -> dict[int, float | None]:
        """Rank -> the share of its communication hidden behind compute (0..1), None without communication."""
        return {r.rank: None if r.overlap_pct is None else r.overlap_pct / 100 for r in self.timeline.ranks}

    def peak(self) -> tuple[int, int]:
        """(rank, bytes) of the highest peak."""
        if not self.peak_bytes:
            return 0, 0
        rank = max(range(len(self.peak_bytes)), key=self.peak_bytes.__getitem__)
        return rank, self.peak_bytes[rank]

    def memory_line(self) -> str:
        rank, nb = self.peak()
        same = [r for r, b in enumerate(self.peak_bytes) if b == nb]
        who = f"rank {rank}" if len(same) == 1 else f"ranks {format_ranks(same)}"
        line = f"peak memory: {_size(nb)} on {who}, at {self.peak_at_ms[rank]:.3f} ms ({self.peak_where[rank]})"
        if self.memory_limit and nb > self.memory_limit:
            line += f"; MORE THAN THE DEVICE'S {_size(self.memory_limit)}"
        return line

    def overlap_line(self) -> str:
        values = [v for v in self.overlap().values() if v is not None]
        if not values:
            return "overlap: no communication"
        lo, hi = min(values), max(values)
        both = f"{100 * lo:.0f}%" if round(100 * lo) == round(100 * hi) else f"{100 * lo:.0f}-{100 * hi:.0f}%"
        return f"communication overlapped with compute: {both} (per rank)"

    def steps_line(self) -> str:
        """How many steps the table's rows are per: ``3 steps``, or that none were marked."""
        if not self.timeline.steps_marked:
            return "the whole run (no steps marked: sim.step() after each step counts them)"
        n = self.timeline.ranks[0].steps if self.timeline.ranks else 0
        return f"{n} step{'s' * (n != 1)}, ms per step"

    def idle_line(self) -> str:
        """Why the ranks are idle, when they mostly are: waiting for the controller's Python to send commands
        (the program's own time), or the engine's own time between short ops; "" when they idle little."""
        ranks = self.timeline.ranks
        run = sum(r.step_ms * r.steps for r in ranks)
        idle = sum(r.idle_ms * r.steps for r in ranks)
        if not ranks or run <= 0 or idle < IDLE_EXPLAINED * run:
            return ""
        starved = min(sum(self.starved_ms[r.rank] for r in ranks if r.rank < len(self.starved_ms)), idle)
        parts = []
        if starved >= 0.05 * run:
            parts.append(
                f"{100 * starved / run:.0f}% waiting for the controller to send the next commands (its Python: "
                "building modules, autograd, your loop, timed as it really runs here)"
            )
        if idle - starved >= 0.05 * run:
            parts.append(
                f"{100 * (idle - starved) / run:.0f}% the engine's own time between short ops (taking and decoding "
                f"each of {self.commands} commands, handing over between streams)"
            )
        line = f"idle {100 * idle / run:.0f}% of the time: {', '.join(parts)}"
        return line + ("; the controller's Python sets the pace, not the device" if starved >= idle / 2 else "")

    def text(self, max_ranks: int = 16) -> str:
        head = f"monarch.Simulator on {self.device}: {self.commands} commands, {self.total_ms:.3f} ms"
        tl = replace(self.timeline, ranks=self.timeline.ranks[:max_ranks])
        more = len(self.timeline.ranks) - max_ranks
        body = tl.text() + (f"\n... and {more} more ranks" if more > 0 else "")
        lines = [head, self.steps_line(), body, self.overlap_line(), self.idle_line(), self.memory_line()]
        return "\n".join(line for line in lines if line)


IDLE_EXPLAINED = 0.25
"""The share of the ranks' time idle from which the summary says why."""


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)


class Simulator:
    """A simulated mesh of `hosts` × `gpus` workers (dimensions ``host`` and ``gpu``).

    `trace_mode`: ``"stream_only"`` (a track per stream per rank) or ``"full"`` (also the controller's
    sends and fetches, a memory counter per rank, FLOPs and bytes per op). `device`: ``"h100"``,
    ``"a100"``, ``"h200"``, ``"cpu"``, ``"local"`` (this machine, from `calibrate()`), or the path of a
    saved profile.
    """

    def __init__(
        self, hosts: int = 1, gpus: int = 1, trace_mode: str = "stream_only", device: str | DeviceProfile = "h100"
    ) -> None:
        for name, value in (("hosts", hosts), ("gpus", gpus)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"Simulator: {name} must be a positive integer, got {value!r}")
        if trace_mode not in TRACE_MODES:
            raise ValueError(
                f"Simulator: unknown trace_mode {trace_mode!r}; use one of {', '.join(map(repr, TRACE_MODES))}"
            )
        self.device = _devices.resolve(device)
        self.trace_mode = trace_mode
        from monarch.runtime.controller import get_controller

        controller = get_controller()
        self._backend = SimBackend(self.device, gpus, controller.receiver.handle)
        spawned = controller.spawn({"host": hosts, "gpu": gpus}, self._backend, announce=False)
        self.mesh = ProcMesh(spawned, spawned.shape)
        """The simulated mesh: use it as any `ProcMesh`."""

    # -- what was simulated ------------------------------------------------------------------------
    @property
    def time(self) -> float:
        """The controller's simulated time now, in seconds since the simulator was made."""
        return self._backend.now()

    def step(self) -> None:
        """The end of a step (as `prof.step()`): the summary and the timeline show time per step and count
        the steps. Queued in order with the ops; nothing waits."""
        from monarch.runtime.tensor.engine import engine_for
        from monarch.runtime.tensor.streams import MAIN
        from monarch.runtime.wire import protocol

        engine_for(self.mesh.spawned).push(tuple(self.mesh._shape.ranks), protocol.ProfileStep(), stream=MAIN)

    def reset(self) -> None:
        """Forget the timeline so far (tensors stay): the next `trace`/`summary` covers what runs from now."""
        from monarch.runtime.tensor.engine import flush

        # What the program dropped before the window is freed before it: garbage in a reference cycle (an
        # autograd graph's) would otherwise be freed whenever Python's collector came round, perhaps inside
        # the window, where its memory hides the window's peak.
        gc.collect()
        flush(self.mesh)
        b = self._backend
        with b.lock:
            b.workers.reset(b.clock)
            b.controller_spans.clear()

    def _flushed(self) -> Any:
        from monarch.runtime.tensor.engine import flush

        flush(self.mesh)
        return self._backend.workers

    def trace_dict(self) -> dict:
        """The timeline as a Chrome trace (a dict), as `trace()` writes it."""
        w = self._flushed()
        from monarch.runtime.tensor.streams import stream_names

        b = self._backend
        with b.lock:
            w.names.update(stream_names())
            return chrome.build(w, self.mesh.spawned.labels, self.trace_mode == "full", list(b.controller_spans))

    def trace(self, path: str | os.PathLike = "trace.json") -> str:
        """Write the timeline as a Chrome/Perfetto trace (open it in ui.perfetto.dev or chrome://tracing)."""
        path = os.fspath(path)
        d = os.path.dirname(path)
        if d:
            os.makedirs(d, exist_ok=True)
        with open(path, "w") as f:
            json.dump(self.trace_dict(), f)
        return path

    def summary(self, trace: dict | None = None) -> SimSummary:
        """Per rank: the window's time in compute, communication and idle, overlap, and peak memory (read from
        `trace`, the window's `trace_dict()`, when the caller has it already)."""
        trace = self.trace_dict() if trace is None else trace
        w = self._backend.workers
        with self._backend.lock:
            peak, when, what = w.memory()
            commands = w.commands
            origin = w.origin()
            starved = [1000 * float(x) for x in w.starved]
        return SimSummary(
            device=self.device.describe(),
            timeline=traces.summarize(trace),
            peak_bytes=[int(x) for x in peak],
            peak_at_ms=[max(0.0, 1000 * (t - origin)) for t in when],
            peak_where=what,
            commands=commands,
            memory_limit=self.device.memory,
            starved_ms=starved,
        )

    def overlap(self) -> dict[int, float | None]:
        """Rank -> share of its communication time overlapped with compute (0..1; None: no communication)."""
        return self.summary().overlap()

    def display(self) -> None:
        """Show the timeline and summary (the notebook face draws it inline; here: text)."""
        print(self.summary().text())

    def exit(self) -> None:
        """Let go of the simulated mesh."""
        self.mesh.exit()

    def __enter__(self) -> Simulator:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.exit()

    def __repr__(self) -> str:
        return f"<Simulator {self.mesh.describe()} on {self.device.describe()}, {self.trace_mode}>"

    # -- calibration -------------------------------------------------------------------------------
    @staticmethod
    def calibrate(
        path: str | os.PathLike | None = None, workers: int = 4, quick: bool = False, passes: int | None = None
    ) -> DeviceProfile:
        """Measure this machine's device (its GPU if it has one, else its CPU with `workers` workers) and save
        the profile (default: ``~/.cache/monarch/sim/<host>.json``, what ``device="local"`` loads).

        Everything is measured `passes` times (3, or 1 with `quick`); each figure is their median, and how
        far they spread is kept (`profile.spread`) and said: a machine too busy to calibrate is named, in
        the profile's description too, rather than averaged away."""
        from monarch.runtime.simulator.calibration import calibrate

        return calibrate(path, workers, quick, passes, lambda dev, n: Simulator(hosts=1, gpus=n, device=dev))
