"""Process meshes: `this_host().spawn_procs({"gpu": 8})` and the views made from them."""

from __future__ import annotations

import contextlib
import contextvars
import os
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from monarch.runtime.common import load
from monarch.runtime.common.groups import WORLD, ProcessGroupRef
from monarch.runtime.common.mesh_trait import MeshTrait
from monarch.runtime.common.shape import Shape, format_ranks
from monarch.runtime.common.stacks import StackReport, pyspy_threads, thread_stacks
from monarch.runtime.wire import protocol

if TYPE_CHECKING:
    from monarch.runtime.controller import SpawnedMesh

_active: contextvars.ContextVar[ProcMesh | None] = contextvars.ContextVar("monarch_active_mesh", default=None)


def active_mesh() -> ProcMesh | None:
    """The mesh of the innermost `with mesh.activate():`, if any."""
    return _active.get()


def mesh_to_act_on(what: str, mesh: Any, missing: str) -> ProcMesh | None:
    """The view a mesh-wide tool (the profiler, memory snapshots) acts on: `mesh` if given, else None on a
    worker (the tool acts on that worker alone), else the innermost `mesh.activate()`'s; `ValueError(missing)`
    when there is none."""
    from monarch.runtime.common import context

    if mesh is not None:
        if not isinstance(mesh, ProcMesh):
            raise ValueError(f"{what}(mesh={mesh!r}): give a ProcMesh (from spawn_procs, or a view of one)")
        if context.worker is not None:
            raise ValueError(f"{what}(mesh=...): on a worker, it acts on this worker alone; leave mesh out")
        return mesh
    if context.worker is not None:
        return None
    found = active_mesh()
    if found is None:
        raise ValueError(missing)
    return found


class HostMesh(MeshTrait):
    """The machines a mesh can be spawned on. `this_host()` is the machine running the controller, a host mesh of
    no dimensions (as Monarch's); ``HostMesh(Shape(("hosts",), (1,), (0,)))`` is the same machine as a mesh of one
    host (`hosts_from_config` without a job); a Slurm job's hosts are a `monarch.notebook.job(...)`. A proc mesh
    spawned here has the host mesh's dimensions, then `per_host`'s."""

    def __init__(self, shape: Shape | None = None) -> None:
        self._shape = shape if shape is not None else Shape((), (), (0,))

    def _new_with_shape(self, shape: Shape) -> HostMesh:
        if len(shape) != 1:
            raise ValueError(f"this machine is one host: no view of it has {len(shape)} points")
        return HostMesh(shape)

    def spawn_procs(
        self,
        per_host: dict[str, int] | None = None,
        bootstrap: Callable[[], Any] | None = None,
        name: str | None = None,
        proc_bind: list[dict[str, str]] | None = None,
        bootstrap_command: Any = None,
    ) -> ProcMesh:
        """Start one worker process per point of `per_host` (e.g. ``{"host": 2, "gpu": 4}``).

        Each worker owns `cuda:<local rank>` when GPUs exist, else the CPU, and joins a torch.distributed group
        of the whole mesh. Returns when every worker is ready. Monarch's options: `bootstrap` (a function run on
        each process first, `async def` too), `proc_bind` (per process, ``{"cpus": "0-3"}`` or
        ``{"physcpubind": "0,1"}``: the CPUs it may run on); `name` is accepted."""
        from monarch.runtime.controller import get_controller  # (here: `import monarch` must not import zmq)

        if bootstrap_command is not None:
            raise ValueError(
                "spawn_procs(bootstrap_command=...): workers here are forked from this machine's fork server, not "
                "started by a command; use bootstrap= (a function each process runs first) or, on a cluster, "
                "monarch.notebook.reserve / monarch.job.SlurmJob"
            )
        sizes = {"gpu": 1} if per_host is None else per_host
        if self._shape.names:
            clash = set(sizes) & set(self._shape.names)
            if clash:
                raise ValueError(f"per_host {per_host} repeats the host mesh's dimension {sorted(clash)[0]!r}")
            sizes = {**self._shape.size_dict, **sizes}
        binds = _check_binds(proc_bind, sizes)
        spawned = get_controller().spawn(sizes)
        mesh = ProcMesh(spawned, spawned.shape)
        if binds is not None or bootstrap is not None:
            mesh._bootstrap(bootstrap, binds)
        return mesh

    @property
    def initialized(self) -> Any:
        """A done future: this host is up."""
        from monarch.runtime.values import Done

        return Done(True)

    def shutdown(self) -> Any:
        """Stop every mesh this controller spawned on this host; a done future."""
        from monarch.runtime.controller import get_controller
        from monarch.runtime.values import Done

        get_controller().stop_all()
        return Done(None)

    stop = shutdown

    def __repr__(self) -> str:
        return "HostMesh(this_host)" if not self._shape.names else f"HostMesh(this host, {self._shape.describe()})"


def _check_binds(proc_bind: list[dict[str, str]] | None, sizes: dict[str, int]) -> list[set[int]] | None:
    """`proc_bind` as the CPUs of each process (checked: one entry per process, keys we can apply)."""
    if proc_bind is None:
        return None
    n = 1
    for size in sizes.values():
        n *= size
    if not isinstance(proc_bind, list) or len(proc_bind) != n:
        raise ValueError(f"proc_bind: give one dict per process ({n}), got {proc_bind!r}")
    out = []
    for entry in proc_bind:
        unknown = set(entry) - {"cpus", "physcpubind"}
        if unknown:
            raise ValueError(
                f"proc_bind {entry!r}: {', '.join(sorted(unknown))} needs numactl; here only 'cpus' and "
                "'physcpubind' (the CPUs a process may run on, e.g. '0-3,8') apply"
            )
        cpus: set[int] = set()
        for spec in entry.values():
            for part in str(spec).split(","):
                lo, _, hi = part.strip().partition("-")
                if not lo.isdigit() or (hi and not hi.isdigit()):
                    raise ValueError(f"proc_bind {entry!r}: {part!r} is not a CPU number or range like '0-3'")
                cpus.update(range(int(lo), int(hi or lo) + 1))
        out.append(cpus)
    return out


_this_host = HostMesh()


def this_host() -> HostMesh:
    """The machine this controller runs on."""
    return _this_host


BOOTSTRAP: Callable[[ProcMesh, Any, Any], None] | None = None
"""Runs `spawn_procs(bootstrap=, proc_bind=)` on a new mesh's workers: set by `monarch.runtime.actors` (a layer
above, where live functions are)."""

ACTORS: Callable[..., Any] | None = None
"""Makes `ProcMesh.spawn`'s actor mesh: set by `monarch.runtime.actors` (which `monarch.actor` imports), a layer
above this one."""


class ProcMesh(MeshTrait):
    """A view (all or part, possibly renamed or reshaped) of a spawned mesh of worker processes.

    Views share workers: `mesh.slice(gpu=0)` and `mesh.rename(gpu="tp")` address the same
    processes as `mesh`. Its shape API (`extent`, `sizes`, `size`, `slice`, `rename`, `split`, `flatten`) is
    every mesh's (`common/mesh_trait.py`).
    """

    def __init__(self, spawned: SpawnedMesh, shape: Shape):
        self._spawned = spawned
        self._shape = shape
        self._derived: dict[str, Any] = {}
        """What the runtime made from this view once and reuses (its workers never change), by name."""

    @property
    def spawned(self) -> SpawnedMesh:
        """The spawned mesh this view addresses (shared by every view of it): its controller, backend and
        tensor engine. The runtime's handle on the workers; user code does not need it."""
        return self._spawned

    # -- shape -------------------------------------------------------------------------------------
    def _new_with_shape(self, shape: Shape) -> ProcMesh:
        return type(self)(self._spawned, shape)

    @property
    def host_mesh(self) -> HostMesh:
        """The hosts this mesh runs on (`this_host()` for a mesh on this machine)."""
        return _this_host

    @property
    def state(self) -> str:
        """The workers' state: ``starting``, ``running``, ``failed``, ``stopping`` or ``stopped``."""
        return self._spawned.state

    def shares_workers_with(self, other: ProcMesh) -> bool:
        """Whether `other` is a view of the same spawned mesh (the same worker processes)."""
        return isinstance(other, ProcMesh) and other._spawned is self._spawned

    def on_change(self, fn: Callable[[], None]) -> Callable[[], None]:
        """Call `fn()` (on any thread) when this mesh's workers change state (busy, idle, failed,
        stopped); returns a function that stops it."""
        spawned = self._spawned
        controller = spawned.controller

        def listener(changed) -> None:
            if changed is spawned:
                fn()

        controller.add_listener(listener)
        return lambda: controller.remove_listener(listener)

    # -- workers -----------------------------------------------------------------------------------
    def _check(self) -> None:
        self._spawned.check_usable(self._shape.ranks)

    def process_group(self, dims: str | tuple[str, ...]) -> ProcessGroupRef:
        """The torch.distributed group over mesh dimension(s) `dims` of this view.

        Pass the result into a live function: on each worker it arrives as that worker's group.
        Groups are created on first request, on every worker in the same order.
        """
        self._check()
        dims_t = (dims,) if isinstance(dims, str) else tuple(dims)
        partition = tuple(self._shape.partition(dims_t))
        spawned = self._spawned
        everyone = (tuple(range(spawned.size)),)
        if partition == everyone:
            return ProcessGroupRef(WORLD, dims_t, self._shape.describe())
        with spawned.order_lock:  # a call that uses the group goes out after the message that makes it
            gid = spawned.groups.get(partition)
            if gid is None:
                gid = len(spawned.groups) + 1
                spawned.controller.send(spawned, None, protocol.MakeGroups(gid, partition))
                spawned.groups[partition] = gid
        return ProcessGroupRef(gid, dims_t, self._shape.describe())

    @contextlib.contextmanager
    def activate(self) -> Iterator[ProcMesh]:
        """Run torch ops on every worker of this view, and make it the mesh live functions run on.

        Inside, torch ops on the controller become commands for the workers and return
        `monarch.Tensor` handles; outside, torch is untouched.
        """
        self._check()
        from monarch.runtime.tensor import capture  # (lazily: it imports torch)

        token = _active.set(self)
        try:
            with capture.activate(self):
                yield self
        finally:
            _active.reset(token)
            capture.flush(self)

    def spawn(self, name: str, cls: type, *args: Any, **kwargs: Any) -> Any:
        """Start actor `cls(*args, **kwargs)` on every process of this view, under `name`; an actor mesh of this
        view's shape (see `monarch.actor`)."""
        if ACTORS is None:
            raise TypeError(f"spawn({name!r}, {cls!r}): actors subclass monarch.actor.Actor (import it from there)")
        self._check()
        return ACTORS(self, name, cls, args, kwargs)

    def logging_option(
        self, stream_to_client: bool = True, aggregate_window_sec: float | None = None, **unknown: Any
    ) -> Any:
        """Where the workers' output goes (of the whole spawned mesh: every view shares its workers), applied at
        once; returns an awaitable, so Monarch's ``await procs.logging_option(...)`` and
        ``asyncio.run(procs.logging_option(...))`` work, and so does a plain call.

        `stream_to_client`: True (the default), the output is shown here (a script's stdout and stderr, a
        cell's per-rank areas); False, it goes to a file instead, whose path is said once. `aggregate_window_sec`:
        None or 0 (the default), every line as it comes; N, lines are held up to N seconds (and until the call
        ends), and the same line from several ranks is shown once, ``[8 similar lines, ranks 0-7] loss 2.31``."""
        from monarch.runtime.controller.aggregate import configure  # (here: `import monarch` must not import zmq)

        return configure(self._spawned, stream_to_client, aggregate_window_sec, unknown)

    def sync_workspace(self) -> dict[str, list[str]]:
        """For a mesh on a job reserved with a workspace: copy the workspace to the hosts again (only
        changed files travel) and reload, on this view's workers, the modules whose files changed."""
        raise ValueError(f"mesh {self.describe()} has no workspace to sync: it runs on this machine")

    def exit(self) -> None:
        """Stop the workers (of the whole spawned mesh, which all views share). Idempotent. Their actors'
        `__cleanup__` runs first."""
        self._spawned.controller.stop(self._spawned)

    def stop(self, reason: str = "stopped by client") -> Any:
        """Monarch's name for `exit()`: stop the workers; returns a done future (`.get()`, `await`)."""
        from monarch.runtime.values import Done

        self.exit()
        return Done(None)

    @property
    def initialized(self) -> Any:
        """A done future: `spawn_procs` returns once every worker is ready."""
        from monarch.runtime.values import Done

        return Done(True)

    def _bootstrap(self, bootstrap: Callable[[], Any] | None, binds: list[set[int]] | None) -> None:
        """`spawn_procs(bootstrap=, proc_bind=)`: each process's CPUs set, then `bootstrap()` run there (its
        error fails the spawn, and the mesh is stopped)."""
        if BOOTSTRAP is None:
            self.exit()
            raise TypeError(
                "spawn_procs(bootstrap=/proc_bind=): import monarch.actor first (Monarch's API lives there)"
            )
        try:
            BOOTSTRAP(self, bootstrap, binds)
        except BaseException:
            self.exit()
            raise

    def respawn(self) -> ProcMesh:
        """A new mesh with the shape this mesh was spawned with, where it was (this machine, or the same
        job's hosts): after a failure, say."""
        from monarch.runtime.controller import get_controller

        self.exit()
        sp = self._spawned
        controller = get_controller()
        backend = None
        job = getattr(sp.backend, "job", None)
        if job is not None:  # a job's hosts: attach again (raises, naming a host that is gone)
            backend = controller.attach(job, job.agents(), sp.backend.why_ended)
        spawned = controller.spawn(sp.shape.size_dict, backend)
        return type(self)(spawned, spawned.shape)

    @property
    def spawned_sizes(self) -> dict[str, int]:
        """The sizes the whole mesh (not this view) was spawned with."""
        return self._spawned.shape.size_dict

    def status(self) -> list[str]:
        """Per point of this view: ``idle``, ``busy``, ``failed`` or ``stopped``."""
        sp = self._spawned
        busy = sp.controller.calls.busy_ranks(sp)
        out = []
        for r in self._shape.ranks:
            if sp.state in ("running", "starting"):
                out.append("failed" if r in sp.lost else "busy" if r in busy else "idle")
            elif sp.state == "failed":
                out.append("failed" if sp.failure is not None and sp.failure.rank == r else "stopped")
            else:
                out.append("stopped")
        return out

    def refuse_if_busy(self, what: str, remedy: str, interrupted_only: bool = False) -> None:
        """Raise `MeshBusyError` naming who runs what, where and for how long, if ranks of this view still run
        an earlier call (with `interrupted_only`, one whose caller was interrupted and gave up on it): a new
        call would wait behind it, silently. `remedy` ends the message."""
        sp = self._spawned
        if interrupted_only and not sp.abandoned:
            return
        busy = self.busy(ask=load.ASK_WAIT, interrupted_only=interrupted_only)
        if not busy:
            return
        from monarch.runtime.common.errors import MeshBusyError

        ranks = sorted({r for b in busy for r in b.ranks})
        who = f"rank {ranks[0]} is" if len(ranks) == 1 else f"ranks {format_ranks(ranks)} are"
        lines = [f"{what} was not started: {who} still running an earlier call on mesh {self.describe()}:"]
        lines += ["  " + line for b in busy for line in b.describe().splitlines()]
        lines.append(remedy)
        raise MeshBusyError("\n".join(lines))

    def stacks(self, wait: float = 1.0) -> StackReport:
        """Where everyone is: each thread's Python stack on the controller and on this view's workers,
        identical stacks grouped with their ranks (print it). Each worker's control thread answers, so a
        rank stuck in a collective or in C code shows where; one that cannot answer within `wait` seconds
        (a thread holding the GIL) is named as such."""
        sp = self._spawned
        ranks = tuple(self._shape.ranks)
        stacks = sp.controller.watchdogs.stacks(sp, ranks, wait) if sp.state == "running" else {}
        for r, threads in stacks.items():
            info = sp.info[r] if r < len(sp.info) else {}
            if threads is None and info.get("host") == _HOST and info.get("pid"):
                stacks[r] = pyspy_threads(info["pid"])  # (from outside: a thread of its holds the GIL)
        return StackReport(thread_stacks(), stacks, {r: sp.labels[r] for r in ranks})

    def busy(self, ask: float = 0.0, interrupted_only: bool = False) -> list[BusyCall]:
        """The calls still running on this view's workers, with which ranks run them and for how long.

        With `ask` > 0 the busy workers are asked where they are (their control thread answers even while
        user code or a collective holds them), waiting up to `ask` seconds for the answers."""
        sp = self._spawned
        controller = sp.controller
        mine = set(self._shape.ranks)
        if ask and sp.state == "running":
            running = controller.calls.ask_busy(sp, ask)
        else:
            running = controller.calls.running(sp)
        if interrupted_only:
            running = [(p, ranks) for p, ranks in running if p.call_id in sp.abandoned]
        now = time.monotonic()
        out = []
        for p, ranks in running:
            ranks = sorted(set(ranks) & mine)
            if ranks:
                where = {r: p.busy[r].where for r in ranks if r in p.busy}
                waits = {r: p.busy[r].collective for r in ranks if r in p.busy and p.busy[r].collective}
                out.append(BusyCall(p.name or "a call", ranks, [sp.labels[r] for r in ranks], now - p.started,
                                    where, waits))  # fmt: skip
        return out

    def to_table(self, ask: float = 0.0, with_memory: bool = True) -> MeshTable:
        """A table of this view's workers: coordinates, rank, host, pid, device, status, memory (unless
        `with_memory` is False), what each busy one runs and for how long (`ask`: see `busy`)."""
        sp = self._spawned
        status = self.status()
        doing = {r: (b, f"{b.seconds:.0f} s") for b in self.busy(ask) for r in b.ranks}
        rows = []
        for (coords, rank), st in zip(self._shape.points(), status):
            info = sp.info[rank] if rank < len(sp.info) else {}
            b, since = doing.get(rank, (None, ""))
            rows.append(
                {
                    **coords,
                    "rank": rank,
                    "hostname": info.get("host", "?"),
                    "pid": info.get("pid", "?"),
                    "device": info.get("device", "?"),
                    "status": st,
                    "memory": _rss(info.get("pid"))
                    if with_memory and st in ("idle", "busy") and info.get("host") == _HOST
                    else "",
                    "running": b.doing(rank) if b is not None else "",
                    "for": since,
                    "actors": ", ".join(f"{n} ({c})" for n, (c, ranks) in sp.actors.items() if rank in ranks),
                }
            )
        return MeshTable(self._shape.describe(), list(self._shape.names), rows, self)

    def __repr__(self) -> str:
        return f"<ProcMesh {self._shape.describe()}, {self._spawned.state}>"


@dataclass
class BusyCall:
    """A call still running on some ranks of a mesh."""

    name: str
    """What it runs: ``"%%mesh cell"``, a live function's name."""
    ranks: list[int]
    labels: list[str]
    seconds: float
    """Since it was started."""
    where: dict[int, str]
    """Rank -> the user's line it is at (for ranks that said)."""
    waits: dict[int, str]
    """Rank -> the collective it waits in, if it waits in one."""

    def doing(self, rank: int) -> str:
        text = self.name
        if rank in self.where:
            text += f" at {self.where[rank]}"
        if rank in self.waits:
            text += f", waiting in {self.waits[rank]}"
        return text

    def describe(self) -> str:
        """``rank 2 (gpu=2) has run the %%mesh cell for 35 s, at Cell In[4], line 7``, one line per place."""
        lines = []
        by_place: dict[str, list[int]] = {}
        for r in self.ranks:
            by_place.setdefault(self.doing(r).removeprefix(self.name), []).append(r)
        for place, ranks in by_place.items():
            who = f"rank {ranks[0]} ({self.labels[self.ranks.index(ranks[0])]})" if len(ranks) == 1 else (
                f"ranks {format_ranks(ranks)}")  # fmt: skip
            lines.append(
                f"{who} {'has' if len(ranks) == 1 else 'have'} run {self.name} for {self.seconds:.0f} s{place}"
            )
        return "\n".join(lines)


SUMMARY_ABOVE = 64
"""A mesh table of more ranks than this is shown by host (`MeshTable.per_host`), each host's ranks a click away."""


class MeshTable:
    """The rows of `mesh.to_table()`; prints as a text table (by host on more than `SUMMARY_ABOVE` ranks)."""

    def __init__(self, title: str, dims: list[str], rows: list[dict], mesh: ProcMesh | None = None):
        self.title = title
        self.dims = dims
        self.rows = rows
        self.mesh = mesh
        """The view it describes (a notebook shows it as a live widget)."""

    @property
    def columns(self) -> list[str]:
        """The dimensions, then each worker's facts; "actors" only where some run actors."""
        actors = ["actors"] if any(row.get("actors") for row in self.rows) else []
        return [*self.dims, "rank", "hostname", "pid", "device", "status", "memory", "running", "for", *actors]

    @property
    def per_host(self) -> tuple[list[str], list[dict]] | None:
        """On more than `SUMMARY_ABOVE` ranks, the table by host (`host` coordinate, else hostname): columns and one
        row per host, each with its ranks' statuses counted and what they run, its ranks' rows under
        ``"members"`` (their positions in `rows`); None on fewer ranks."""
        if len(self.rows) <= SUMMARY_ABOVE:
            return None
        key = "host" if "host" in self.dims else "hostname"
        by: dict[object, list[int]] = {}
        for i, row in enumerate(self.rows):
            by.setdefault(row[key], []).append(i)
        out = []
        for value, members in by.items():
            rows = [self.rows[i] for i in members]
            statuses: dict[str, int] = {}
            for row in rows:
                statuses[row["status"]] = statuses.get(row["status"], 0) + 1
            running = sorted({str(row["running"]) for row in rows if row["running"]})
            actors = sorted({str(row.get("actors", "")) for row in rows if row.get("actors")})
            out.append(
                {
                    key: value,
                    "ranks": format_ranks([row["rank"] for row in rows]),
                    "workers": len(rows),
                    "hostname": ", ".join(sorted({str(row["hostname"]) for row in rows})),
                    "status": ", ".join(f"{n} {st}" for st, n in sorted(statuses.items(), key=lambda x: -x[1])),
                    "running": "; ".join(running[:3]) + (f" (and {len(running) - 3} more)" if len(running) > 3 else ""),
                    "actors": "; ".join(actors),
                    "members": members,
                }
            )
        columns = [key, "ranks", "workers", *(["hostname"] if key == "host" else []), "status", "running", "actors"]
        return [c for c in columns if c not in ("running", "actors") or any(r[c] for r in out)], out

    def __str__(self) -> str:
        summary = self.per_host
        if summary is not None:
            cols, rows = summary
            head = (
                f"ProcMesh {self.title}: {len(self.rows)} ranks on {len(rows)} hosts, a row each "
                f"(`.rows` holds every rank's; a host's alone: `mesh.slice({cols[0]}=...).to_table()`)"
            )
        else:
            cols, rows, head = self.columns, self.rows, f"ProcMesh {self.title}"
        cells = [[str(row[c]) for c in cols] for row in rows]
        widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(cols)]
        line = lambda vals: "  ".join(v.ljust(w) for v, w in zip(vals, widths)).rstrip()  # noqa: E731
        return "\n".join([head, line(cols), line(["-" * w for w in widths]), *map(line, cells)])

    __repr__ = __str__


_HOST = socket.gethostname()
"""This machine's name: the memory column reads /proc, which knows only this machine's workers."""


def _rss(pid: int | None) -> str:
    if pid is None:
        return ""
    try:
        with open(f"/proc/{pid}/statm") as f:
            pages = int(f.read().split()[1])
    except (OSError, ValueError, IndexError):
        return ""
    return f"{pages * os.sysconf('SC_PAGE_SIZE') / 2**20:.0f} MiB"
