"""What controller and workers say to each other: one dataclass per message and per tensor command.

Messages travel as the header of a signed envelope (see `backends/transport.py`); a message's bulky
payload (a function's arguments, a result, a batch of tensor commands) travels as its body, pickled
apart with large buffers out of band. Who sent a message (mesh and rank) is part of the envelope, not of
the message. Receivers dispatch on the message's type through a handler table, never by position.

On the wire a message is the tuple ``(tag, *fields)`` (`pack` / `unpack`): pickling a tuple costs a
fraction of pickling an instance, and ops are sent tens of thousands of times a second. Nothing here
imports torch, zmq or the rest of the runtime.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from operator import attrgetter
from typing import Any

_TYPES: list[type] = []
"""Every message type, by tag (its index): the wire carries ``(tag, *fields)``."""


def message(cls):
    """A slotted dataclass registered for `pack` / `unpack`."""
    cls = dataclass(slots=True)(cls)
    names = tuple(f.name for f in fields(cls))
    cls._tag = len(_TYPES)
    cls._values = staticmethod(
        attrgetter(*names) if len(names) > 1 else lambda m, n=names: tuple(getattr(m, x) for x in n)
    )
    cls._arity = len(names)
    _TYPES.append(cls)
    return cls


def pack(msg: Any) -> tuple:
    """`msg` as the tuple that travels: ``(tag, *fields)`` (tuples pickle ~20x faster than instances)."""
    return (msg._tag, *msg._values(msg))


def unpack(t: Any) -> Any:
    """The message a `pack` tuple stands for; ValueError for anything else."""
    if type(t) is not tuple or not t or type(t[0]) is not int or not 0 <= t[0] < len(_TYPES):
        raise ValueError(f"not a message: {type(t).__name__}")
    cls = _TYPES[t[0]]
    if len(t) != cls._arity + 1:
        raise ValueError(f"{cls.__name__} has {cls._arity} fields, got {len(t) - 1}")
    return cls(*t[1:])


def pack_commands(cmds: list) -> list:
    """A batch of tensor commands for the wire (`OnStream` holds a command: packed too)."""
    out = []
    for c in cmds:
        if type(c) is OnStream:
            out.append((c._tag, c.stream_id, pack(c.cmd)))
        else:
            out.append((c._tag, *c._values(c)))
    return out


def unpack_commands(items: list) -> list:
    out = []
    for t in items:
        c = unpack(t)
        if type(c) is OnStream:
            c.cmd = unpack(c.cmd)
        out.append(c)
    return out


# -- controller -> worker ---------------------------------------------------------------------------
@message
class Call:
    """Run a live function on the addressed workers; its arguments are the body."""

    call_id: int
    fid: int
    """The function's id in this mesh; `fn` brings it the first time a worker needs it."""
    names: tuple
    """The dimension names of the mesh view it was called on (the worker's coordinates are in it)."""
    sizes: tuple
    ranks: tuple
    """The view's global ranks, row-major."""
    fn: bytes | None = None
    """The pickled function, when a worker does not have it yet."""
    sources: dict | None = None
    """``{filename: lines}`` of by-value code, so worker tracebacks show its source."""


@message
class MakeGroups:
    """Create (collectively, on every worker of the mesh) the process groups of one rank partition."""

    gid: int
    partition: tuple
    """Tuples of global ranks, one per group."""


@message
class RunOps:
    """A batch of tensor commands (the body: a list of the commands below), run in order."""


@message
class StdinReply:
    """The answer to a worker's `AskInput`."""

    req_id: int
    ok: bool
    text: str
    """The line typed; or, when not `ok`, why there is none (``"interrupted"`` for Ctrl-C)."""


@message
class Exit:
    """Stop serving and exit."""


@message
class ReformGroups:
    """Make the mesh's process groups again (every worker, in lockstep): some were torn down to release
    ranks waiting in a collective for a rank that had failed."""

    generation: int
    """How many times the mesh's groups were re-formed (names the new groups' store keys)."""


# -- worker -> controller, on the command connection (start-up) --------------------------------------
@message
class Ready:
    """The worker is up: connected, in its process group, serving commands."""

    info: dict
    """``{"pid", "host", "device"}``."""


@message
class StartFailed:
    traceback: str


# -- worker -> controller, on the reply connection --------------------------------------------------
@message
class Reply:
    """A call's result (`ok`) or `ErrorInfo`; the body holds it."""

    call_id: int
    ok: bool


@message
class Output:
    """Text a worker wrote to stdout or stderr (Python or C level)."""

    call_id: int | None
    """The call it was written during; None between calls."""
    stream: str
    text: str


@message
class Display:
    """A rich display made on a worker (`display(...)`, a matplotlib figure)."""

    call_id: int | None
    data: dict
    metadata: dict


@message
class Released:
    """A worker waiting in a collective while its call had failed elsewhere was released (its connections
    to the other workers were shut down, so the collective raised)."""

    call_id: int
    collective: str
    """The torch.distributed function it waited in, e.g. ``"all_reduce"``."""
    where: str
    """The user's line that called it, e.g. ``"Cell In[5], line 4"``."""
    user_groups: list
    """Process groups made by user code (dist.new_group, init_device_mesh) that were torn down with it, as
    the user knows them: ``"pair (ranks 0-1)"``, ``"mesh_2d (a DeviceMesh)"``, ``"a group of ranks 0-3"``."""


@message
class Busy:
    """What a worker is doing (asked for while a call runs): the user's line it is at."""

    call_id: int | None
    where: str
    collective: str
    """The collective it waits in, or ""."""


@message
class AskInput:
    """A worker waits for a line of input (`input()`, `sys.stdin`, or its pdb prompt)."""

    call_id: int | None
    req_id: int
    prompt: str
    password: bool
    debugger: bool
    where: str
    """For pdb: where it stopped (``script.py:12``); else ""."""


RELEASED = "Released"
"""`ErrorInfo.exc_type` of a rank released from a collective (not a failure of its own)."""


@dataclass(frozen=True)
class ErrorInfo:
    """An exception raised on a worker, as the controller shows it (travels in a `Reply`'s body)."""

    exc_type: str
    """Qualified name of the exception type."""
    message: str
    traceback: str
    """The formatted traceback, worker plumbing left out."""


# -- the rendezvous store: worker -> controller, and its answer --------------------------------------
@message
class StoreSet:
    key: str
    value: bytes


@message
class StoreGet:
    """The value of `key`, waiting for it to be set (up to `timeout` seconds)."""

    key: str
    timeout: float


@message
class StoreAdd:
    key: str
    amount: int


@message
class StoreCompareSet:
    key: str
    expected: bytes
    desired: bytes


@message
class StoreWait:
    keys: tuple
    timeout: float


@message
class StoreCheck:
    keys: tuple


@message
class StoreDelete:
    key: str


@message
class StoreNumKeys:
    pass


@message
class StoreAnswer:
    request: int
    """The sequence number of the request it answers (a late answer to an abandoned request is ignored)."""
    ok: bool
    value: Any
    """The result; or, when not `ok`, the error's text."""


# -- tensor commands (the body of `RunOps`) ---------------------------------------------------------
class Ref:
    """A tensor in a worker's table, by id (inside an op's arguments; pickles as its id)."""

    __slots__ = ("id",)

    def __init__(self, id: int):
        self.id = id

    def __reduce__(self):
        return Ref, (self.id,)


@message
class Op:
    """Run torch op `name` (``"aten::add.Tensor"``) and keep its results under the ids in `out`."""

    name: str
    args: tuple
    kwargs: dict
    out: Any
    """An id, None, or a (nested) list of ids matching the op's results."""
    where: str
    """The controller line that issued it (named in errors)."""


@message
class Reduce:
    """A collective over process group `gid`: ``src`` reduced into ``out`` (the same id: in place)."""

    src: int
    out: int
    gid: int
    size: int
    reduction: str
    scatter: bool
    shape: tuple
    dtype: Any
    device_type: str
    where: str


@message
class MoveWithin:
    """`to_mesh` between views of one spawned mesh: rank s sends `src` to rank d for each (s, d)."""

    src: int
    out: int
    pairs: list
    shape: tuple
    dtype: Any
    device_type: str
    where: str


@message
class SendTo:
    """This mesh's half of a move to another spawned mesh, over two-worker links ``(s, d, name)``."""

    src: int
    links: list
    shape: tuple
    dtype: Any
    where: str
    peer_mesh: int


@message
class RecvFrom:
    """The receiving mesh's half of a move between spawned meshes."""

    out: int
    links: list
    shape: tuple
    dtype: Any
    device_type: str
    where: str
    peer_mesh: int


@message
class Alias:
    """`t.data = other`: id `ref` now names the tensor of id `target`."""

    ref: int
    target: int


@message
class Free:
    refs: list


@message
class Seed:
    """`torch.manual_seed` on the workers."""

    seed: int


@message
class FailResults:
    """An op the controller could not send: its results hold this error."""

    out: Any
    exc_type: str
    message: str
    where: str


@message
class OnStream:
    """Run `cmd` on stream `stream_id` (after what that stream already queued)."""

    stream_id: int
    cmd: Any


@message
class BorrowStart:
    """Lend tensor `src` of stream `from_stream` to `to_stream` as id `alias`, after `from_stream`'s ops so far."""

    borrow_id: int
    from_stream: int
    to_stream: int
    src: int
    alias: int


@message
class BorrowEnd:
    """End a borrow: `from_stream` waits for the borrower's ops, then `alias` is forgotten."""

    borrow_id: int
    from_stream: int
    to_stream: int
    alias: int


@message
class ProfileStart:
    """Start the profiler on each worker (`monarch.profiler.profile`); `config` holds plain values only."""

    config: dict


@message
class ProfileStep:
    """`prof.step()`: the profiler's schedule moves on a step."""


@message
class ProfileMark:
    """`record_function(name)` entered (or left) on the stream this command runs on."""

    name: str
    enter: bool


# -- the slot file: what a signal to a worker is about -------------------------------------------------
SLOT = 32
"""Bytes per rank in a mesh's slot file: int64 the call a SIGINT is for, then a control request sent with
SIGUSR1: int64 sequence number, int64 call id, int64 kind."""
RELEASE = 1
"""Control request: if you wait in a collective (this call failed on another rank), be released from it."""
REPORT = 2
"""Control request: say what you are doing (`Busy`)."""
STACKS = 4
"""Control request: send your threads' stacks (`Stacks`); its call id field holds the request's number."""
DISCONNECT = 3
"""Control request: this call failed on you (or ended here) while others wait in a collective: shut your
process groups' connections, so that peers on other hosts waiting on you are released too. Its call id
field holds the groups' generation it is for (a late request must not break re-formed groups)."""


# -- starting a worker ------------------------------------------------------------------------------
@dataclass
class WorkerStart:
    """Everything a worker needs to start; handed over privately (the fork server's pipe), with its keys."""

    keys: Any
    """`backends.transport.WorkerKeys`: mesh id, rank, HMAC key, addresses."""
    coords: dict
    """Coordinates in the spawned mesh."""
    sizes: dict
    """Sizes of the spawned mesh."""
    local_rank: int
    """Index among this host's workers (picks the GPU)."""
    label: str
    """The coordinates as text (``"host=0,gpu=3"``)."""
    interrupt_path: str
    """A file of int64 slots, one per rank: the call the controller's next SIGINT is meant for."""
    env: dict
    """Environment to run with (the controller's, plus rank variables)."""
    cwd: str
    sys_path: list
    threads: int
    """torch intra-op threads."""
    parent_pid: int | None
    """The process that forked us (the fork server); the worker dies with it."""
    controller_pid: int
    """The controller's process; the worker exits the moment it is gone."""
    group_timeout: float
    """Seconds collectives and the store wait."""


# -- controller <-> host agent: one link per host, signed with the job's key -------------------------------
LINK = 0xFFFFFFFF
"""The `mesh_id` of the envelopes on a controller's link to a host agent (they belong to no mesh)."""


@message
class AgentHello:
    """Controller -> agent, first on a new link: who attaches."""

    controller: str
    """``host:pid`` of the controller (named when another one tries to attach meanwhile)."""


@message
class AgentInfo:
    """Agent -> controller: the answer to `AgentHello`, or why it refuses (another controller is attached)."""

    host: str
    addr: str
    pid: int
    gpus: int
    cpus: int
    workspace: str
    """This host's copy of the job's workspace (on workers' sys.path), or "" without one."""
    refused: str
    """Empty when attached."""


@message
class StartWorkers:
    """Controller -> agent: start this host's workers of a mesh. Each of `starts` is ``(rank, coords, label,
    local_rank, (key, mesh_topic, rank_topic))``; the agent fills in its own sockets' addresses."""

    mesh_id: int
    size: int
    sizes: dict
    starts: list
    group_timeout: float
    env: dict
    """Variables the controller sets for its workers (the agent adds the rank ones and its own)."""
    sys_path: list
    """The controller's `sys.path`: entries that exist on the host follow the workspace and the agent's own."""
    cwd: str
    """The controller's working directory (used where it exists on the host and there is no workspace)."""


@message
class SignalWorkers:
    """Controller -> agent: `kind` 0 interrupts call `call_id` on `ranks` (SIGINT); otherwise a control
    request (`RELEASE`, `REPORT`) through the slot file and SIGUSR1."""

    mesh_id: int
    ranks: tuple
    call_id: int
    kind: int


@message
class StopWorkers:
    """Controller -> agent: the mesh's workers were asked to exit; kill those still there after `grace`
    seconds, then answer `WorkersStopped`."""

    mesh_id: int
    grace: float


@message
class WorkersStopped:
    mesh_id: int
    codes: dict
    """Rank -> exit status (0: exited when asked; negative: killed by that signal)."""


@message
class WorkerLost:
    """Agent -> controller: a worker exited (or froze) while its mesh ran, or before it was ready."""

    mesh_id: int
    rank: int
    cause: str


@message
class SyncOffer:
    """Controller -> agent: every file of the job's workspace and its content hash (sha256)."""

    files: dict


@message
class SyncWant:
    """Agent -> controller: the files of the offer its copy lacks or has otherwise."""

    paths: list


@message
class SyncFiles:
    """Controller -> agent: the contents of `paths` (the body: one bytes each, in order)."""

    paths: list


@message
class Synced:
    """Agent -> controller: the workspace copy matches the offer; `changed` were written or removed."""

    changed: list


@message
class Stacks:
    """Worker -> controller: its threads' stacks (asked for with `STACKS`), main thread first; an empty
    main-thread stack means it is idle."""

    token: int
    """The request's number (in the control request's call id field)."""
    threads: list
    """(thread name, [(where, source line), ...] outermost first) per thread."""


@message
class Goodbye:
    """Worker -> controller, its last message on the reply connection when it exits as asked: one
    connection keeps its order, so once this has arrived, so has everything the worker printed."""
