"""Errors raised on the controller for what went wrong on workers."""

from __future__ import annotations

import re
import signal
import sys
from dataclasses import dataclass, field

from monarch.runtime.common.prose import fit
from monarch.runtime.common.shape import format_ranks


@dataclass(frozen=True)
class ErrorInfo:
    """An exception raised on a worker, as the controller shows it (travels in a `Reply`'s body)."""

    exc_type: str
    """Qualified name of the exception type."""
    message: str
    traceback: str
    """The formatted traceback, worker plumbing left out."""


@dataclass
class Failure:
    """One distinct error, and the ranks that raised it."""

    ranks: list[int]
    """Global ranks (in the spawned mesh) that failed this way."""
    labels: list[str]
    """Their coordinates, e.g. ``"host=0,gpu=3"``."""
    exc_type: str
    """Qualified name of the exception type on the worker."""
    message: str
    """`str()` of the exception."""
    traceback: str
    """The worker's formatted traceback (user frames only)."""
    messages: list[str] = field(default_factory=list)
    """Each rank's own message, in the order of `ranks` (`message` marks the numbers that differ)."""

    @property
    def varies(self) -> bool:
        """Whether the ranks' messages differ (in numbers only: other differences make other failures)."""
        return len(set(self.messages)) > 1

    def where(self) -> str:
        if len(self.ranks) == 1:
            return f"rank {self.ranks[0]} ({self.labels[0]})"
        return f"ranks {format_ranks(self.ranks)}"

    def describe(self) -> str:
        """``-- ranks 0-2: KeyboardInterrupt:`` and the traceback: this failure as a call's error shows it."""
        lines = [f"-- {self.where()}: {self.exc_type}: {self.message}".rstrip()]
        if self.varies:
            lines.append("   ({...}: the values these ranks had)")
        lines.append(self.traceback.rstrip())
        return "\n".join(lines)


@dataclass
class Release:
    """A rank taken out of a collective it waited in for a rank that had failed."""

    rank: int
    label: str
    collective: str
    """The torch.distributed function, e.g. ``"all_reduce"``."""
    where: str
    """The user's line that called it."""
    user_groups: list[str]
    """Process groups user code made on that rank, torn down with it (by the names they have there)."""


class RemoteError(Exception):
    """Raised on the controller when code on one or more workers failed.

    `failures` holds one `Failure` per distinct traceback, with the ranks that produced it, so
    an error that all eight ranks raised is shown once. `released` lists the ranks that were taken out
    of a collective they waited in for a failed rank (their process groups are re-formed before the next
    call on the mesh).
    """

    def __init__(self, what: str, failures: list[Failure], total: int, released: list[Release] | None = None):
        self.what = what
        self.failures = failures
        self.total = total
        self.released = list(released or [])
        super().__init__(self._text())

    @property
    def ranks(self) -> list[int]:
        """The ranks that failed (not those released from a collective)."""
        return sorted(r for f in self.failures for r in f.ranks)

    def _text(self) -> str:
        n = sum(len(f.ranks) for f in self.failures)
        text = _describe(f"{self.what} failed on {n} of {self.total} ranks", self.failures)
        by_place: dict[tuple[str, str], list[int]] = {}
        for r in self.released:
            by_place.setdefault((r.collective, r.where), []).append(r.rank)
        for (collective, where), ranks in by_place.items():
            who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {format_ranks(ranks)}"
            was = "was" if len(ranks) == 1 else "were"
            text += (
                f"\n\n{who} {was} released from {collective} at {where}: it waited for the failed rank"
                f"{'s' if n > 1 else ''}. The mesh's process groups are made again before its next call."
            )
        user = list(dict.fromkeys(g for r in self.released for g in r.user_groups))
        if user:
            text += (
                f"\nProcess groups made in your code (dist.new_group, init_device_mesh, ...) were torn down with it: "
                f"{', '.join(user)}. Make {'them' if len(user) > 1 else 'it'} again (run the code that made "
                f"{'them' if len(user) > 1 else 'it'})."
            )
        return text

    def _render_traceback_(self) -> list[str]:
        """IPython shows this instead of the controller-side traceback, which is only our plumbing."""
        return _render(type(self).__name__, str(self))

    def __reduce__(self):
        return type(self), (self.what, self.failures, self.total, self.released)

    def headline(self) -> str:
        """The first line (``inner.boom failed on 2 of 2 ranks``): what an actor's call that failed inside an
        endpoint says of it before its traceback, whose last line holds the rest once."""
        return str(self).partition("\n")[0]


RemoteError.__module__ = "monarch"  # (tracebacks name it as users import it: monarch.RemoteError)


class RemoteInterrupt(KeyboardInterrupt):
    """The user interrupted a call (Ctrl-C, the kernel's Interrupt); says where each rank was.

    A `KeyboardInterrupt`, so code that handles interrupts keeps working.
    """

    def __init__(self, what: str, failures: list[Failure], busy: list[int], total: int, queued: list[int] = ()):
        self.what, self.failures, self.busy, self.total = what, failures, busy, total
        self.queued = list(queued)
        """Ranks still running an earlier call (another thread's): they skip this one when they reach it."""
        head = f"{what} interrupted"
        stuck = [r for r in busy if r not in self.queued]
        if stuck:
            head += f"; {_ranks(stuck)} did not stop within the grace period and may still be busy"
        if self.queued:
            head += f"; {_ranks(self.queued)} {'is' if len(self.queued) == 1 else 'are'} busy with an earlier call and will skip this one"
        super().__init__(_describe(head, failures))

    def _render_traceback_(self) -> list[str]:
        return _render("KeyboardInterrupt", str(self))

    def __reduce__(self):
        return type(self), (self.what, self.failures, self.busy, self.total, self.queued)


class MeshBusyError(RuntimeError):
    """A cell was not started because ranks of its mesh still run an earlier call (one that an interrupt
    did not stop, say): it would have waited for them, silently."""

    def _render_traceback_(self) -> list[str]:
        return _render(type(self).__name__, str(self))


class MeshStoppedError(RuntimeError):
    """A call was still running when its mesh was stopped on purpose (`mesh.exit()`, ``%mesh restart``,
    ``%mesh shutdown``): nothing crashed. Raised instead of what the stop made the ranks say (a collective's
    peer gone: "Connection closed by peer")."""

    def _render_traceback_(self) -> list[str]:
        return _render(type(self).__name__, str(self))


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {format_ranks(ranks)}"


def _describe(head: str, failures: list[Failure]) -> str:
    lines = [head]
    for f in failures:
        lines += ["", f.describe()]
    return "\n".join(lines)


def _render(name: str, text: str) -> list[str]:
    """The lines IPython shows for one of our errors: its name in red, its prose wrapped to fit an output
    area (`prose.fit`: JupyterLab breaks longer lines mid-word)."""
    red, reset = "\x1b[0;31m", "\x1b[0m"
    lines = fit(f"{name}: {text}").split("\n")
    return [f"{red}{name}{reset}{lines[0][len(name) :]}", *lines[1:]]


class WorkerDiedError(RemoteError):
    """A worker process exited while its mesh was in use. Without actors the rest of that mesh is stopped;
    a mesh with actors goes on without it (`kept`), and each later call that includes the rank raises this."""

    def __init__(self, rank: int, label: str, cause: str, mesh: str, total: int, kept: bool = False):
        self.rank, self.label, self.cause, self.mesh, self.kept = rank, label, cause, mesh, kept
        self.what = f"mesh {mesh}"
        self.failures = [Failure([rank], [label], "WorkerDied", cause, "")]
        self.total = total
        self.released = []
        if kept:
            then = (
                f"the mesh's other workers go on (it runs actors): calls to them work, calls that include rank "
                f"{rank} fail (mesh.respawn() starts a new mesh of the same shape)"
            )
        else:
            then = (
                "the other workers of the mesh were stopped and calls in flight failed (mesh.respawn() starts a "
                "new mesh of the same shape)"
            )
        Exception.__init__(self, f"rank {rank} ({label}) of mesh {mesh} {cause}; {then}")

    def __reduce__(self):
        return type(self), (self.rank, self.label, self.cause, self.mesh, self.total, self.kept)


def group_failures(raw: list[tuple[int, str, ErrorInfo]]) -> list[Failure]:
    """`[(rank, label, error)]` -> one `Failure` per kind of error: the same type, raised at the same place,
    with messages that differ at most in numbers (a rank, a device, a size). Those numbers are marked:
    ``bad input on gpu {0..7}``."""
    groups: dict[tuple, list[tuple[int, str, ErrorInfo, list[str], list[str]]]] = {}
    for rank, label, info in sorted(raw, key=lambda r: r[0]):
        tb = name_cells(info.traceback)
        msg_parts, tb_parts = _NUMBERS.split(info.message), _NUMBERS.split(tb)
        key = (info.exc_type, tuple(msg_parts[::2]), tuple(tb_parts[::2]), tuple(_kept(tb_parts)))
        groups.setdefault(key, []).append((rank, label, info, msg_parts, tb_parts))
    split = []
    for members in groups.values():
        varying = sum(len({m[3][i] for m in members}) > 1 for i in range(1, len(members[0][3]), 2))
        if varying <= MARKED_AT_MOST:
            split.append(members)
            continue
        by_message: dict[str, list] = {}  # e.g. torch's "Rank 0 runs X, but rank 1 runs Y": marked, unreadable
        for m in members:
            by_message.setdefault(m[2].message, []).append(m)
        split.extend(by_message.values())
    out = []
    for members in split:
        rank, label, info, msg_parts, tb_parts = members[0]
        out.append(
            Failure(
                [m[0] for m in members],
                [m[1] for m in members],
                info.exc_type,
                _marked(msg_parts, [m[3] for m in members]),
                _marked(tb_parts, [m[4] for m in members]),
                [m[2].message for m in members],
            )
        )
    return out


def placed(failures: list[tuple[Failure, str | None]]) -> list[tuple[int, str]]:
    """``(rank, text)`` to show `failures` in per-rank places: each traceback once, in its first rank's place,
    and in its other ranks' places a line saying where it is. Each failure comes with None, or the label of the
    place that showed its traceback already (every one of its ranks then points there)."""
    out = []
    for f, under in failures:
        pointed = f.ranks
        if under is None:
            out.append((f.ranks[0], f.describe() + "\n"))
            under, pointed = f.labels[0], f.ranks[1:]
        pointer = f"-- {f.where()}: {f.exc_type} (shown once, under {under})\n"
        out += [(rank, pointer) for rank in pointed]
    return out


PEER_GONE = re.compile(
    r"Connection (?:reset|closed) by peer|Broken pipe|remote process exited|NCCL communicator was aborted"
)
"""What a collective raises when another rank's process went away: a consequence, not a cause."""


def peer_gone(info: ErrorInfo) -> bool:
    """Whether `info` is a collective's error about a peer that went away (its own failure is told elsewhere:
    a `WorkerDiedError`, or the failing rank's own traceback)."""
    return bool(PEER_GONE.search(info.message))


_NUMBERS = re.compile(r"(\d+(?:\.\d+)?)")
MARKED_AT_MOST = 3
"""Messages that differ in more numbers than this are shown apart: marking them all would hide which is which."""
_PLACE = re.compile(r"(line |In\[)$")
"""Numbers that say where (a line, a cell): never marked, they tell places apart."""


def _kept(parts: list[str]) -> list[str]:
    return [parts[i] for i in range(1, len(parts), 2) if _PLACE.search(parts[i - 1])]


def _marked(first: list[str], all_parts: list[list[str]]) -> str:
    """`first` (text split around its numbers) with each number that differs between the ranks replaced
    by the values they had."""
    out = list(first)
    for i in range(1, len(first), 2):
        values = [parts[i] for parts in all_parts]
        if len(set(values)) > 1:
            out[i] = _values(values)
    return "".join(out)


def _values(values: list[str]) -> str:
    """``{0..7}`` for a run of integers, else ``{1,5,9}`` (at most six, then an ellipsis)."""
    unique = sorted(set(values), key=float)
    if all(v.isdigit() for v in unique) and len(unique) > 2 and int(unique[-1]) - int(unique[0]) == len(unique) - 1:
        return f"{{{unique[0]}..{unique[-1]}}}"
    if len(unique) > 6:
        unique = [*unique[:3], "…", *unique[-2:]]
    return "{" + ",".join(unique) + "}"


_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')


KNOWN_CELLS: dict[str, str] = {}
"""``{filename: "Cell In[5]"}``: files of notebook cells this process was told of (a worker, with the live
functions defined in them that it is sent: `protocol.Call.cells`)."""


def cell_name(filename: str) -> str | None:
    """`Cell In[5]` for code of notebook cell 5: the file IPython compiled it into (known in the notebook's
    process, and on workers sent code from it), or a `%%mesh` cell's `<mesh cell 5>`; None for any other file."""
    if filename.startswith("<mesh cell ") and filename.endswith(">"):
        return f"Cell In[{filename[len('<mesh cell ') : -1]}]"
    if filename in KNOWN_CELLS:
        return KNOWN_CELLS[filename]
    ip = sys.modules.get("IPython")  # (never imported here: only looked up where a notebook runs)
    shell = ip.get_ipython() if ip is not None else None
    number = getattr(getattr(shell, "compile", None), "_filename_map", {}).get(filename)
    return None if number is None else f"Cell In[{number}]"


def cell_frame(filename: str, line: int, func: str) -> str | None:
    """``Cell In[5], line 4, in f`` (``Cell In[5], line 4`` at a cell's top level), as IPython names a frame
    of a notebook cell; None for a frame of any other file (see `cell_name`)."""
    cell = cell_name(filename)
    if cell is None:
        return None
    return f"{cell}, line {line}" + ("" if func == "<module>" else f", in {func}")


def name_cells(traceback: str) -> str:
    """A worker's traceback with frames of notebook cells named as IPython names them:
    ``Cell In[5], line 4, in f`` instead of ``File "/tmp/ipykernel_81/3170.py", line 4, in f``."""

    def name(m: re.Match) -> str:
        return cell_frame(m.group(1), int(m.group(2)), m.group(3)) or m.group(0)

    return _FRAME.sub(name, traceback) if "File " in traceback else traceback


def exit_cause(exitcode: int | None) -> str:
    """Words for a worker's exit status as `multiprocessing` reports it."""
    if exitcode is None:
        return "lost contact (exit status unknown)"
    if exitcode < 0:
        sig = -exitcode
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = f"signal {sig}"
        if sig == signal.SIGKILL:
            return f"killed by {name} (kill -9, or the kernel's out-of-memory killer)"
        if sig == signal.SIGSEGV:
            return f"crashed with {name} (segmentation fault)"
        if sig == signal.SIGABRT:
            return f"aborted ({name})"
        return f"killed by {name}"
    if exitcode == 0:
        return "exited (status 0)"
    return f"exited with status {exitcode}"
