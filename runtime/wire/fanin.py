"""A host's replies, output and reports to the controller, bundled by its agent: the host's half of the fan-in.

Every worker of a host sends its replies and output to the host's agent, which sends them up. One by one, each
cost the controller a receive, a signature check and an unpickle: ~10 µs of its CPU per rank, 40 ms for a no-op
call on 4,096 ranks. Here the agent checks each worker's message itself (its mesh's key, the rank's sequence
number), holds replies and output for a moment and sends them up as one `Bundle` per mesh, signed with the mesh's
key as this host's agent: each distinct message once, with the ranks that sent it (64 ranks answering `None`:
one item). The controller checks one signature per host and records a group's ranks at once.

A bundle goes when
- a call's replies from this host are all in: the ranks of its view on this host (read from the `Call` as it went
  down to them, `saw_command`), or every rank of the mesh here when the call was not seen (a large one);
- `wait` seconds after the oldest message it holds (`Settings.bundle_wait`) (a rank that answers later goes in a later bundle);
- before a message that is not bundled goes up (input requests, displays, anything large or in several frames,
  a `Goodbye`): each rank's messages reach the controller in the order it sent them.

Equal output lines from several ranks become one item only where that keeps each rank's own order.
"""

from __future__ import annotations

import pickle
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from monarch.runtime.wire import codec, protocol

HOLD_MAX = 8192
"""Messages held at most: a bundle goes when this many wait."""
EXPECT_MAX = 4096
"""Calls whose expected replies are remembered at most (a call whose ranks died is never completed)."""

_TAG = {cls: tag for tag, cls in protocol.types().items()}
_REPLY, _CALL = _TAG[protocol.Reply], _TAG[protocol.Call]
Packed = tuple[Any, ...]
"""A message as it travels (`protocol.pack`)."""
BUNDLED = (protocol.Reply, protocol.Output, protocol.Busy, protocol.Stacks, protocol.Released)
"""The messages a bundle carries: those every rank of a call sends, often equal (the rest go up as they came)."""
_BUNDLED = frozenset(_TAG[t] for t in BUNDLED)


def agent_sender(index: int) -> int:
    """The sender rank in the envelope of host `index`'s bundles (workers' ranks are >= 0, the controller's -1)."""
    return -2 - index


AGENTS = agent_sender(0)
"""Sender ranks at or below this are host agents, whose messages are `Bundle`s."""
RACKS = 1 << 20
"""Host indexes from here on name racks (`rack_sender`), not hosts."""


def rack_sender(index: int) -> int:
    """The sender rank of the merged bundles of the rack that host `index` leads (`agent/rack.py`): apart from the
    host's own, whose numbers run apart."""
    return agent_sender(RACKS + index)


def sender_name(rank: int) -> str:
    """Who an agent's sender rank stands for, for people."""
    index = AGENTS - rank
    return f"the rack leader on host {index - RACKS}" if index >= RACKS else f"the agent of host {index}"


@dataclass
class _Mesh:
    key: bytes
    ranks: frozenset[int]
    seen: dict[int, int]
    """Rank -> the sequence number of its last message (a replay is dropped here, as the controller would)."""
    seq: int = 0
    held: list[tuple[int, Packed, bytes]] = field(default_factory=list)
    """(rank, message, body) waiting to go up, in the order they came."""
    since: float = 0.0
    """`time.monotonic()` when the oldest of `held` came."""
    expect: dict[int, int] = field(default_factory=dict)
    """Call id -> how many of its replies are still to come from this host."""
    size: int = 0
    """The mesh's ranks, on every host (0: not known)."""
    views: set[int] = field(default_factory=set)
    """Of `expect`, the calls on some of the mesh's ranks only (their bundle says so: `Bundle.now`)."""


class Holding:
    """What holds messages per mesh for at most `wait` seconds (`FanIn`, a rack's `RackMerge`): when the oldest must
    go. Its meshes have `held` and `since`; `flush(mesh_id)` sends what a mesh holds."""

    meshes: dict[int, Any]
    wait: float

    def flush(self, mesh_id: int) -> None:
        raise NotImplementedError

    def due(self) -> float | None:
        """`time.monotonic()` by which the oldest held message must go up (None: nothing is held)."""
        times = [m.since for m in list(self.meshes.values()) if m.held]
        return min(times) + self.wait if times else None

    def flush_due(self, now: float) -> None:
        for mesh_id, mesh in list(self.meshes.items()):
            if mesh.held and now >= mesh.since + self.wait:
                self.flush(mesh_id)


class FanIn(Holding):
    """The agent's bundler: `take` each worker message, `due` when the oldest held one must go. Used by one
    thread (the relay's replies thread), except `add_mesh`, `remove_mesh` and `saw_command`, whose changes are
    single dict operations."""

    def __init__(
        self, index: int, send: Callable[[Sequence[Any]], None], log: Callable[[str, str], None], wait: float = 0.002
    ) -> None:
        self.sender = agent_sender(index)
        self.wait = wait
        """Seconds a message is held at most for others to join its bundle; 0: nothing is bundled."""
        self.send = send
        """Sends frames up (the relay's socket toward the controller)."""
        self.log = log
        self.meshes: dict[int, _Mesh] = {}
        self.bundles = 0
        """Bundles sent (for tests: that bundling happened)."""

    def add_mesh(self, mesh_id: int, key: bytes, ranks: Sequence[int], size: int = 0) -> None:
        self.meshes[mesh_id] = _Mesh(key, frozenset(ranks), dict.fromkeys(ranks, 0), size=size)

    def remove_mesh(self, mesh_id: int) -> None:
        self.meshes.pop(mesh_id, None)

    # -- commands on their way down ------------------------------------------------------------------
    def saw_command(self, mesh_id: int, first: memoryview) -> None:
        """A command of one frame going down to this host's workers of `mesh_id`: if it is a `Call`, how many
        replies this host will send is known (its view's ranks here)."""
        mesh = self.meshes.get(mesh_id)
        if mesh is None or len(first) >= codec.SMALL:
            return
        try:
            env = codec.decode(mesh.key, [first])
        except Exception:
            return  # (the workers check it, and drop it)
        msg = env.message
        if env.rank != codec.CONTROLLER or type(msg) is not tuple or not msg or msg[0] != _CALL:
            return
        call = protocol.unpack(msg)
        if call.call_id in mesh.expect:
            return  # (the same call once per rank topic)
        here = mesh.ranks.intersection(call.ranks)
        if here:
            if len(mesh.expect) >= EXPECT_MAX:
                oldest = next(iter(mesh.expect))
                del mesh.expect[oldest]
                mesh.views.discard(oldest)
            mesh.expect[call.call_id] = len(here)
            if len(call.ranks) != mesh.size:
                mesh.views.add(call.call_id)

    # -- messages on their way up --------------------------------------------------------------------
    def take(self, frames: list[Any]) -> None:
        """One worker message (zmq frames, as read): held for a bundle, or sent up as it is."""
        first = frames[0].buffer
        if len(frames) != 1 or len(first) >= codec.SMALL or len(first) < codec.FIXED or not self.wait:
            self._pass(frames, first)
            return
        mesh_id, rank = codec.sender(first)
        mesh = self.meshes.get(mesh_id)
        if mesh is None or rank not in mesh.ranks:
            self._pass(frames, first)  # (not ours to judge: the controller checks and says)
            return
        try:
            env = codec.decode(mesh.key, [first])
        except codec.BadSignature as e:
            self.log("a worker's message", f"it failed its checks: {e}")
            return
        except Exception as e:
            self.log("a worker's message", f"its header could not be read: {type(e).__name__}: {e}")
            return
        if env.seq <= mesh.seen[rank]:
            self.log("a replayed message", f"rank {rank} of mesh {mesh_id} already sent number {env.seq}")
            return
        msg = env.message
        if type(msg) is not tuple or not msg or msg[0] not in _BUNDLED:
            self.flush(mesh_id)  # (everything this rank sent before goes first)
            self.send(frames)
            mesh.seen[rank] = env.seq
            return
        mesh.seen[rank] = env.seq
        held = mesh.held
        if not held:
            mesh.since = time.monotonic()
        held.append((rank, msg, bytes(env.body)))
        if msg[0] == _REPLY:
            call_id = msg[1]
            left = mesh.expect.get(call_id)
            if left is None:
                left = len(mesh.ranks)
            left -= 1
            if left <= 0:
                mesh.expect.pop(call_id, None)
                view = call_id in mesh.views
                if view:
                    mesh.views.discard(call_id)
                self.flush(mesh_id, now=view)
                return
            mesh.expect[call_id] = left
        if len(held) >= HOLD_MAX:
            self.flush(mesh_id)

    def _pass(self, frames: list[Any], first: memoryview) -> None:
        """Up as it is, after what its mesh's ranks sent before it."""
        if len(first) >= codec.FIXED:
            self.flush(codec.sender(first)[0])
        self.send(frames)

    def flush(self, mesh_id: int, now: bool = False) -> None:
        """Send up what `mesh_id`'s ranks sent that is held, as one bundle (`now`: `Bundle.now`)."""
        mesh = self.meshes.get(mesh_id)
        if mesh is None or not mesh.held:
            return
        held, mesh.held = mesh.held, []
        mesh.seq += 1
        bundle = protocol.Bundle(group(held), now)
        self.send(codec.encode(mesh.key, mesh_id, self.sender, mesh.seq, protocol.pack(bundle)))
        self.bundles += 1


def group(held: list[tuple[int, Packed, bytes]]) -> tuple[tuple[tuple[int, ...], Packed, bytes], ...]:
    """`held` (rank, message, body) as a bundle's items: `merge`, each rank's order kept."""
    return merge((rank, (rank,), msg, body) for rank, msg, body in held)


def merge(
    held: Iterable[tuple[int, Sequence[int], Packed, bytes]],
) -> tuple[tuple[tuple[int, ...], Packed, bytes], ...]:
    """`held` (who, ranks, message, body) as a bundle's items: equal (message, body) pairs once, with their ranks
    in the order they came. `who` is whose order is kept: a rank (a host's bundle), or a host (a rack's, whose
    items each hold some of that host's ranks, in that host's order). Its items join an earlier item only if that
    item comes after the last one they joined."""
    groups: list[tuple[list[int], Packed, bytes]] = []
    latest: dict[tuple[Any, bytes], int] = {}
    last: dict[int, int] = {}
    bodies: dict[bytes, bytes] = {}
    for who, ranks, msg, body in held:
        body = bodies.setdefault(body, body)  # (one object per distinct body: pickled once, then referenced)
        key: tuple[Any, bytes] = (msg, body)
        try:
            i = latest.get(key)
        except TypeError:  # (a message holding a list, as `Stacks` does: compared by its pickle)
            key = (pickle.dumps(msg), body)
            i = latest.get(key)
        if i is None or i <= last.get(who, -1):
            i = latest[key] = len(groups)
            groups.append(([], msg, body))
        groups[i][0].extend(ranks)
        last[who] = i
    return tuple((tuple(ranks), msg, body) for ranks, msg, body in groups)
