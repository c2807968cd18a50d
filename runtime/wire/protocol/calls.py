"""Calls: controller -> worker (`Call`, a batch of tensor commands `RunOps`, groups to make), and the
worker's answers on the reply connection (`Reply`, `Released`, `Busy`). Answered through
`controller.call` -> `Reply`: the model for a new request a worker answers."""

from __future__ import annotations

from monarch.runtime.common.errors import ErrorInfo
from monarch.runtime.wire.protocol.base import message

__all__ = [
    "RELEASED",
    "Busy",
    "Call",
    "ErrorInfo",
    "MakeGroups",
    "ReformGroups",
    "Released",
    "Reply",
    "ReadyTorch",
    "RunOps",
]


@message(0)
class Call:
    """Run a live function on the addressed workers; its arguments are the body."""

    call_id: int
    fid: int
    """The function's id in this mesh; `fn` brings it the first time a worker needs it."""
    names: tuple[str, ...]
    """The dimension names of the mesh view it was called on (the worker's coordinates are in it)."""
    sizes: tuple[int, ...]
    ranks: tuple[int, ...]
    """The view's global ranks, row-major."""
    fn: bytes | None = None
    """The pickled function, when a worker does not have it yet."""
    sources: dict[str, list[str]] | None = None
    """``{filename: lines}`` of by-value code, so worker tracebacks show its source."""
    cells: dict[str, str] | None = None
    """``{filename: "Cell In[5]"}`` for those of `sources` that are notebook cells, so a worker names their
    frames (pdb, stacks) as IPython does."""


@message(1)
class MakeGroups:
    """Create (collectively, on every worker of the mesh) the process groups of one rank partition."""

    gid: int
    partition: tuple[tuple[int, ...], ...]
    """Tuples of global ranks, one per group."""


@message(5)
class ReformGroups:
    """Make the mesh's process groups again (every worker, in lockstep): some were torn down to release
    ranks waiting in a collective for a rank that had failed."""

    generation: int
    """How many times the mesh's groups were re-formed (names the new groups' store keys)."""


@message(57)
class ReadyTorch:
    """Set torch up now, as a worker started with `WorkerStart.torch` does at start (every worker of the mesh,
    in lockstep: it makes the mesh's default process group). Sent once, before the first message that needs
    torch, to a mesh whose workers started without it."""


@message(2)
class RunOps:
    """A batch of tensor commands (the body: a list of the commands below), run in order."""


@message(8)
class Reply:
    """A call's result (`ok`) or `ErrorInfo`; the body holds it."""

    call_id: int
    ok: bool


@message(11)
class Released:
    """A worker waiting in a collective while its call had failed elsewhere was released (its connections
    to the other workers were shut down, so the collective raised)."""

    call_id: int
    collective: str
    """The torch.distributed function it waited in, e.g. ``"all_reduce"``."""
    where: str
    """The user's line that called it, e.g. ``"Cell In[5], line 4"``."""
    user_groups: list[str]
    """Process groups made by user code (dist.new_group, init_device_mesh) that were torn down with it, as
    the user knows them: ``"pair (ranks 0-1)"``, ``"mesh_2d (a DeviceMesh)"``, ``"a group of ranks 0-3"``."""


@message(12)
class Busy:
    """What a worker is doing (asked for while a call runs): the user's line it is at."""

    call_id: int | None
    where: str
    collective: str
    """The collective it waits in, or ""."""


RELEASED = "Released"
"""`ErrorInfo.exc_type` of a rank released from a collective (not a failure of its own)."""
