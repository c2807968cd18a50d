"""Tensor commands: the body of `RunOps`, a batch the controller's tensor engine pipelines."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from monarch.runtime.wire.protocol.base import message, pack, unpack

if TYPE_CHECKING:
    from typing import ClassVar


class Ref:
    """A tensor in a worker's table, by id (inside an op's arguments; pickles as its id)."""

    __slots__ = ("id",)

    def __init__(self, id: int):
        self.id = id

    def __reduce__(self) -> tuple[type[Ref], tuple[int]]:
        return Ref, (self.id,)


@message(23)
class Op:
    """Run torch op `name` (``"aten::add.Tensor"``) and keep its results under the ids in `out`."""

    name: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    out: Any
    """An id, None, or a (nested) list of ids matching the op's results."""
    where: str
    """The controller line that issued it (named in errors)."""


@message(24)
class Reduce:
    """A collective over process group `gid`: ``src`` reduced into ``out`` (the same id: in place)."""

    src: int
    out: int
    gid: int
    size: int
    reduction: str
    scatter: bool
    shape: tuple[int, ...]
    dtype: Any
    device_type: str
    where: str


@message(25)
class MoveWithin:
    """`to_mesh` between views of one spawned mesh: rank s sends `src` to rank d for each (s, d)."""

    src: int
    out: int
    pairs: list[tuple[int, int]]
    shape: tuple[int, ...]
    dtype: Any
    device_type: str
    where: str


@message(26)
class SendTo:
    """This mesh's half of a move to another spawned mesh, over two-worker links ``(s, d, name)``."""

    src: int
    links: list[tuple[int, int, str]]
    shape: tuple[int, ...]
    dtype: Any
    where: str
    peer_mesh: int


@message(27)
class RecvFrom:
    """The receiving mesh's half of a move between spawned meshes."""

    out: int
    links: list[tuple[int, int, str]]
    shape: tuple[int, ...]
    dtype: Any
    device_type: str
    where: str
    peer_mesh: int


@message(28)
class Alias:
    """`t.data = other`: id `ref` now names the tensor of id `target`."""

    ref: int
    target: int


@message(29)
class Free:
    refs: list[int]


@message(30)
class Seed:
    """`torch.manual_seed` on the workers."""

    seed: int


@message(31)
class FailResults:
    """An op the controller could not send: its results hold this error."""

    out: Any
    exc_type: str
    message: str
    where: str


@message(32)
class OnStream:
    """Run `cmd` on stream `stream_id` (after what that stream already queued)."""

    stream_id: int
    cmd: Any
    if TYPE_CHECKING:
        _tag: ClassVar[int]  # (every message's: set by `message`)


@message(33)
class BorrowStart:
    """Lend tensor `src` of stream `from_stream` to `to_stream` as id `alias`, after `from_stream`'s ops so far."""

    borrow_id: int
    from_stream: int
    to_stream: int
    src: int
    alias: int


@message(34)
class BorrowEnd:
    """End a borrow: `from_stream` waits for the borrower's ops, then `alias` is forgotten."""

    borrow_id: int
    from_stream: int
    to_stream: int
    alias: int


@message(35)
class ProfileStart:
    """Start the profiler on each worker (`monarch.profiler.profile`); `config` holds plain values only."""

    config: dict[str, Any]


@message(36)
class ProfileStep:
    """`prof.step()`: the profiler's schedule moves on a step."""


@message(37)
class ProfileMark:
    """`record_function(name)` entered (or left) on the stream this command runs on."""

    name: str
    enter: bool


@message(56)
class CallActor:
    """`actors.endpoint.rref(...)`: call endpoint `endpoint` of this worker's actor `actor` with the tensors its
    `Ref`s name (the actors live in the tensor engine's processes), and keep its result under the ids in `out`
    (a failure poisons them, as an op's does)."""

    actor: str
    endpoint: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    out: Any
    where: str


def pack_commands(cmds: list[Any]) -> list[tuple[Any, ...]]:
    """A batch of tensor commands for the wire (`OnStream` holds a command: packed too). A command may come
    packed already (`op_tuple`: the controller makes each op that way)."""
    out: list[tuple[Any, ...]] = []
    for c in cmds:
        kind = type(c)
        if kind is tuple:
            out.append(c)
        elif kind is OnStream:
            out.append((c._tag, c.stream_id, c.cmd if type(c.cmd) is tuple else pack(c.cmd)))
        else:
            out.append((c._tag, *c._values(c)))
    return out


def op_tuple(name: str, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any, where: str) -> tuple[Any, ...]:
    """`pack(Op(name, args, kwargs, out, where))`, made directly: the controller makes one per op."""
    return (_OP_TAG, name, args, kwargs, out, where)


def unpack_commands(items: list[Any]) -> list[Any]:
    out = []
    for t in items:
        c = unpack(t)
        if type(c) is OnStream:
            c.cmd = unpack(c.cmd)
        out.append(c)
    return out


_OP_TAG: int = Op._tag  # type: ignore[attr-defined]  # (set by `message`)
