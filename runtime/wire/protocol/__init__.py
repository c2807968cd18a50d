"""What controllers, workers and host agents say to each other, one module per conversation:

- `calls`: a call and its answer (the model for a new request: `controller.call` -> `Reply`);
- `tensor`: tensor commands, the body of `RunOps`;
- `output`: what a worker prints, shows and asks for;
- `lifecycle`: a worker's start and end;
- `store`: the rendezvous store;
- `control`: control requests (signals) and their `Stacks` answer;
- `agent`: a controller's link to a host agent;
- `actors`: actors calling actors, worker to worker.

Import this package (``from monarch.runtime.wire import protocol``): it registers them all. Each
message's wire tag is written next to it (`message(tag)`).
"""

from monarch.runtime.wire.protocol.actors import ActorAnswer, ActorSend, Cast, CastFailed, PortSend
from monarch.runtime.wire.protocol.agent import (
    LINK,
    AgentHello,
    AgentInfo,
    Bundle,
    Lead,
    Leading,
    RackMesh,
    SignalWorkers,
    StartWorkers,
    StopWorkers,
    Synced,
    SyncFiles,
    SyncOffer,
    SyncWant,
    WorkerLost,
    WorkersStopped,
)
from monarch.runtime.wire.protocol.base import message, pack, types, unpack
from monarch.runtime.wire.protocol.calls import (
    RELEASED,
    Busy,
    Call,
    ErrorInfo,
    MakeGroups,
    ReadyTorch,
    ReformGroups,
    Released,
    Reply,
    RunOps,
)
from monarch.runtime.wire.protocol.control import SLOT, Control, Stacks
from monarch.runtime.wire.protocol.lifecycle import Exit, Goodbye, Ready, StartFailed, WorkerStart
from monarch.runtime.wire.protocol.output import AskInput, Display, Output, StdinReply
from monarch.runtime.wire.protocol.store import (
    StoreAdd,
    StoreAnswer,
    StoreCheck,
    StoreCompareSet,
    StoreDelete,
    StoreGet,
    StoreNumKeys,
    StoreSet,
    StoreWait,
)
from monarch.runtime.wire.protocol.tensor import (
    Alias,
    BorrowEnd,
    BorrowStart,
    CallActor,
    FailResults,
    Free,
    MoveWithin,
    OnStream,
    Op,
    ProfileMark,
    ProfileStart,
    ProfileStep,
    RecvFrom,
    Reduce,
    Ref,
    Seed,
    SendTo,
    op_tuple,
    pack_commands,
    unpack_commands,
)

TO_WORKERS = (Call, MakeGroups, RunOps, StdinReply, Exit, ReformGroups, Cast, ReadyTorch)
"""Every message a controller sends its workers through `Backend.send`. Every backend answers each one: a
worker's `HANDLERS` (and `Exit`), the simulator's `HANDLED` and `IGNORED`; a request the receiver does not
handle gets an error `Reply`, never silence (`tests/test_wire_tags.py`)."""

__all__ = [
    "TO_WORKERS",
    "ActorAnswer",
    "ActorSend",
    "Cast",
    "CastFailed",
    "PortSend",
    "CallActor",
    "AgentHello",
    "AgentInfo",
    "Alias",
    "AskInput",
    "BorrowEnd",
    "BorrowStart",
    "Bundle",
    "Lead",
    "Leading",
    "Busy",
    "Call",
    "Control",
    "Display",
    "ErrorInfo",
    "Exit",
    "FailResults",
    "Free",
    "Goodbye",
    "LINK",
    "MakeGroups",
    "MoveWithin",
    "OnStream",
    "Op",
    "Output",
    "ProfileMark",
    "ProfileStart",
    "ProfileStep",
    "RELEASED",
    "Ready",
    "RecvFrom",
    "Reduce",
    "Ref",
    "RackMesh",
    "ReadyTorch",
    "ReformGroups",
    "Released",
    "Reply",
    "RunOps",
    "SLOT",
    "Seed",
    "SendTo",
    "SignalWorkers",
    "Stacks",
    "StartFailed",
    "StartWorkers",
    "StdinReply",
    "StopWorkers",
    "StoreAdd",
    "StoreAnswer",
    "StoreCheck",
    "StoreCompareSet",
    "StoreDelete",
    "StoreGet",
    "StoreNumKeys",
    "StoreSet",
    "StoreWait",
    "SyncFiles",
    "SyncOffer",
    "SyncWant",
    "Synced",
    "WorkerLost",
    "WorkerStart",
    "WorkersStopped",
    "message",
    "pack",
    "op_tuple",
    "pack_commands",
    "types",
    "unpack",
    "unpack_commands",
]
