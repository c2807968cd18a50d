"""A rack's merge of its hosts' bundles (`agent/rack.py` moves the messages; this checks and merges them): the
second level of the fan-in (`fanin.py` is the first).

Each member host's `Bundle` of a mesh the leader was told of (`set_mesh`) is checked (the mesh's key, the member's
sequence number, ranks of that member only) and held; the held items of a mesh go up as one `Bundle` (`fanin.merge`:
equal items once, each host's order kept), signed with the mesh's key under `fanin.rack_sender(leader)`, numbered
apart from the leader host's own bundles. A merge goes up when every member host of the mesh sent a bundle since it
began (a call on the whole mesh: each host's bundle ends its part of it), at once when a host's bundle ends its part
of a call on some of the mesh's ranks (`Bundle.now`: which of the rack's hosts such a call reaches is not known
here), `wait` seconds after its first item, and before anything that is not merged: a worker's own message, or a
bundle of a mesh the leader was not told of, passes as it came, after what its mesh's hosts sent before it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from monarch.runtime.wire import codec, protocol
from monarch.runtime.wire.fanin import AGENTS, HOLD_MAX, Holding, Packed, merge, rack_sender

_BUNDLE = next(tag for tag, cls in protocol.types().items() if cls is protocol.Bundle)  # (mypy knows no `_tag`)


@dataclass
class _Mesh:
    key: bytes
    ranks: dict[int, frozenset[int]]
    """Member host index -> its ranks of the mesh."""
    seen: dict[int, int] = field(default_factory=dict)
    """Member host index -> the sequence number of its last bundle."""
    seq: int = 0
    held: list[tuple[int, tuple[tuple[int, ...], Packed, bytes]]] = field(default_factory=list)
    """(member, item) waiting to go up, in the order they came."""
    sent: set[int] = field(default_factory=set)
    """Members whose bundles are in `held`."""
    since: float = 0.0


class RackMerge(Holding):
    """The leader's merger: `take` each member's message, `due` when the oldest held merge must go. Used by one
    thread (the leader's), except `set_mesh` and `clear`, whose changes are single dict operations."""

    def __init__(
        self, index: int, send: Callable[[Sequence[Any]], None], log: Callable[[str, str], None], wait: float
    ) -> None:
        self.sender = rack_sender(index)
        self.send = send
        """Sends frames up (the leader's socket toward the controller)."""
        self.log = log
        self.wait = max(wait, 0.0005)
        self.meshes: dict[int, _Mesh] = {}
        self.merges = 0
        """Merged bundles sent (for tests)."""

    def set_mesh(self, mesh_id: int, key: bytes, ranks: dict[int, tuple[int, ...]]) -> None:
        """Merge mesh `mesh_id`'s bundles from these members (no ranks: the mesh is gone)."""
        if ranks:
            self.meshes[mesh_id] = _Mesh(key, {m: frozenset(r) for m, r in ranks.items()})
        else:
            self.meshes.pop(mesh_id, None)

    def clear(self) -> None:
        """Every mesh is gone (its controller detached): what is held is dropped."""
        self.meshes.clear()

    def take(self, frames: list[Any]) -> None:
        """One message from a member's relay: a bundle of a mesh this rack merges is held; anything else goes up as
        it came, after what its mesh's hosts sent before it."""
        first = frames[0].buffer
        if len(first) < codec.FIXED:
            self.send(frames)  # (the controller says what is wrong with it)
            return
        mesh_id, rank = codec.sender(first)
        mesh = self.meshes.get(mesh_id)
        member = AGENTS - rank
        if mesh is None or len(frames) != 1 or rank > AGENTS or member not in mesh.ranks:
            self.flush(mesh_id)
            self.send(frames)
            return
        try:
            env = codec.decode(mesh.key, [first])
        except Exception as e:
            self.log("a host's bundle", f"host {member}'s failed its checks: {type(e).__name__}: {e}")
            return
        if env.seq <= mesh.seen.get(member, 0):
            self.log("a replayed message", f"host {member} already sent bundle number {env.seq}")
            return
        bundle = env.message
        if (
            type(bundle) is not tuple
            or len(bundle) not in (2, 3)
            or bundle[0] != _BUNDLE
            or type(bundle[1]) is not tuple
        ):
            self.log("a host's bundle", f"host {member} sent something else under its bundles' name")
            return
        mine = mesh.ranks[member]
        for item in bundle[1]:
            if type(item) is not tuple or len(item) != 3 or not mine.issuperset(item[0]):
                self.log("a host's bundle", f"host {member} bundled messages of ranks it does not run")
                return
        mesh.seen[member] = env.seq
        if not mesh.held:
            mesh.since = time.monotonic()
        mesh.held.extend((member, item) for item in bundle[1])
        mesh.sent.add(member)
        now = len(bundle) == 3 and bundle[2]  # (an agent of a version before sends no `now`)
        if now or len(mesh.sent) == len(mesh.ranks) or len(mesh.held) >= HOLD_MAX:
            self.flush(mesh_id)

    def flush(self, mesh_id: int) -> None:
        """Send up, as one bundle of this rack (`fanin.merge`), what `mesh_id`'s hosts sent that is held."""
        mesh = self.meshes.get(mesh_id)
        if mesh is None or not mesh.held:
            return
        held, mesh.held = mesh.held, []
        mesh.sent.clear()
        mesh.seq += 1
        bundle = (_BUNDLE, merge((member, *item) for member, item in held), False)
        self.send(codec.encode(mesh.key, mesh_id, self.sender, mesh.seq, bundle))
        self.merges += 1
