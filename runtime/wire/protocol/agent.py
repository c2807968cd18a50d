"""Controller <-> host agent: one link per host, signed with the job's key."""

from __future__ import annotations

from typing import Any

from monarch.runtime.wire.protocol.base import message

LINK = 0xFFFFFFFF
"""The `mesh_id` of the envelopes on a controller's link to a host agent (they belong to no mesh)."""


@message(38)
class AgentHello:
    """Controller -> agent, first on a new link: who attaches."""

    controller: str
    """``host:pid`` of the controller (named when another one tries to attach meanwhile)."""


@message(39)
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


@message(40)
class StartWorkers:
    """Controller -> agent: start this host's workers of a mesh. Each of `starts` is ``(rank, coords, label,
    local_rank, (key, mesh_topic, rank_topic))``; the agent fills in its own sockets' addresses."""

    mesh_id: int
    size: int
    sizes: dict[str, int]
    starts: list[tuple[int, dict[str, int], str, int, tuple[bytes, bytes, bytes]]]
    group_timeout: float
    env: dict[str, str]
    """Variables the controller sets for its workers (the agent adds the rank ones and its own)."""
    sys_path: list[str]
    """The controller's `sys.path`: entries that exist on the host follow the workspace and the agent's own."""
    cwd: str
    """The controller's working directory (used where it exists on the host and there is no workspace)."""


@message(41)
class SignalWorkers:
    """Controller -> agent: `kind` 0 interrupts call `call_id` on `ranks` (SIGINT); otherwise a control
    request (`RELEASE`, `REPORT`) through the slot file and SIGUSR1."""

    mesh_id: int
    ranks: tuple[int, ...]
    call_id: int
    kind: int


@message(42)
class StopWorkers:
    """Controller -> agent: the mesh's workers were asked to exit; kill those still there after `grace`
    seconds, then answer `WorkersStopped`."""

    mesh_id: int
    grace: float


@message(43)
class WorkersStopped:
    mesh_id: int
    codes: dict[int, int | None]
    """Rank -> exit status (0: exited when asked; negative: killed by that signal)."""


@message(44)
class WorkerLost:
    """Agent -> controller: a worker exited (or froze) while its mesh ran, or before it was ready."""

    mesh_id: int
    rank: int
    cause: str


@message(45)
class SyncOffer:
    """Controller -> agent: every file of the job's workspace and its content hash (sha256)."""

    files: dict[str, str]


@message(46)
class SyncWant:
    """Agent -> controller: the files of the offer its copy lacks or has otherwise."""

    paths: list[str]


@message(47)
class SyncFiles:
    """Controller -> agent: the contents of `paths` (the body: one bytes each, in order)."""

    paths: list[str]


@message(48)
class Synced:
    """Agent -> controller: the workspace copy matches the offer; `changed` were written or removed."""

    changed: list[str]


@message(58)
class Bundle:
    """Agent -> controller, on the reply path, signed with the mesh's key: messages of this host's workers sent up
    as one (`wire/fanin.py`). Each item is ``(ranks, message, body)``: a message (as `pack` makes it) and its
    body, equal for every rank in `ranks`, in the order the first of them sent it."""

    items: tuple[tuple[tuple[int, ...], Any, bytes], ...]
    """On the wire each message is packed; as received, the controller's end unpacked each."""
    now: bool = False
    """It ends this host's part of a call on some of the mesh's ranks: a rack's leader passes it on at once
    instead of waiting for its other hosts' (`agent/rack.py`). (An agent of a version before sends no such field.)"""


@message(59)
class Lead:
    """Controller -> agent: lead a rack (`agent/rack.py`): take the replies of `members` and give them their commands
    (host index -> its relay's "reply" and "cmd" addresses; this host among them); `Leading` answers."""

    members: dict[int, dict[str, str]]


@message(60)
class Leading:
    """Agent -> controller: the answer to `Lead`, once the leader's connections to its members are made: where the
    rack's commands go in and its replies come out ("cmd", "reply"), and the members it could not reach."""

    endpoints: dict[str, str]
    missing: list[str]


@message(61)
class RackMesh:
    """Controller -> a rack's leader: mesh `mesh_id` (signed with `key`) runs `ranks` on these hosts of the rack
    (host index -> its ranks): their bundles are checked and merged. An empty `ranks`: the mesh is gone."""

    mesh_id: int
    key: bytes
    ranks: dict[int, tuple[int, ...]]
