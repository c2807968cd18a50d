"""Messages on the wire: signed frames, pickle protocol 5 with out-of-band buffers.

A message is the frame list ``[signature | envelope | header | body, *buffers]``:

- the envelope names the sender (mesh id, rank; -1 for the controller) and carries its sequence number,
  so that a receiver can refuse a replayed message;
- ``header`` is a plain pickle of a message (a `protocol` dataclass);
- ``body`` is a cloudpickle of the user's payload (a function, arguments, a result), with every large
  buffer (tensor, ndarray, bytes-like) left out of the pickle and sent as its own frame;
- ``signature`` is a MAC over header, body and buffers with a key private to one controller: keyed BLAKE2b
  (32 bytes) for a message of one frame under 64 KiB, the common small message, HMAC-SHA256 otherwise.

`decode` checks the signature before anything is unpickled; nothing else in the runtime unpickles
bytes that came from a socket. Only the `wire` package (`controller_end`, `worker_end`, `links`, `store`) signs and checks (it owns keys and
sequence numbers); everything else sends and receives typed messages.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import io
import pickle
import struct
import sys
import types
import warnings
from collections import ChainMap
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, overload

import cloudpickle

if TYPE_CHECKING:
    import zmq

try:  # (built at install, `_fastwire.c`; where it could not be, the Python versions here serve alone)
    from monarch.runtime.wire import _fastwire
except ImportError:
    _fastwire = None  # type: ignore[assignment]

OOB_MIN_BYTES = 4096
"""Buffers at least this large travel as their own frame instead of inside the pickle."""


class BadSignature(Exception):
    """A message whose signature does not match; it is dropped unread."""


class UnknownSender(BadSignature):
    """A message that names a sender we hold no key for; it is dropped unread."""


SIG = 32
SMALL = 65536
"""A message of one frame shorter than this is signed with keyed BLAKE2b; anything else with HMAC-SHA256."""
_compare = hmac.compare_digest
_blake2b = hashlib.blake2b


def _sign(key: bytes, parts: list[bytes | memoryview]) -> bytes:
    if len(parts) == 1 and len(parts[0]) < SMALL:
        # The common small message. BLAKE2b with a key is a MAC by design (RFC 7693), CPython's own C code:
        # half of OpenSSL's HMAC-SHA256 in a tight loop, and far less in a process that wakes for each
        # message, which OpenSSL's per-call digest lookup (a lock, a provider store) makes cold.
        return _blake2b(parts[0], key=key, digest_size=SIG).digest()
    h = hmac.new(key, digestmod=hashlib.sha256)  # (large buffers: SHA-256 has CPU instructions, BLAKE2b not)
    for p in parts:
        h.update(p)
    return h.digest()


# -- tensors as out-of-band buffers ---------------------------------------------------------------
def _rebuild_tensor(buf: Any, dtype: Any, shape: tuple[int, ...]) -> Any:
    import torch

    if type(buf) is bytearray and buf:  # a small tensor's bytes, inside the pickle: writable, ours alone
        return torch.frombuffer(buf, dtype=dtype).reshape(shape)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # zmq frames are read-only buffers; the memory is ours
        flat = torch.frombuffer(buf, dtype=torch.uint8) if len(memoryview(buf)) else torch.empty(0, dtype=torch.uint8)
    return flat.view(dtype).reshape(shape)


def _rebuild_grad_tensor(buf: Any, dtype: Any, shape: tuple[int, ...]) -> Any:
    """A tensor that required grad where it was pickled: a leaf that requires grad here (as torch's own pickling
    rebuilds one)."""
    return _rebuild_tensor(buf, dtype, shape).requires_grad_()


def _reduce_tensor(t: Any) -> Any:
    """A tensor's reduction for both picklers: its bytes apart (out of band when large), or torch's own
    pickling where they cannot be had (no numpy)."""
    try:
        return _tensor_bytes(t)
    except (RuntimeError, ImportError):
        return t.__reduce_ex__(5)


def _tensor_bytes(t: Any) -> Any:
    torch = sys.modules["torch"]  # (a tensor is here: torch is imported)
    if type(t) is not torch.Tensor or t.layout != torch.strided or t.is_quantized:
        return t.__reduce_ex__(5)
    if t.requires_grad:  # (torch's own pickling of it takes milliseconds: torch.save of its storage)
        if not t.dtype.is_floating_point and not t.dtype.is_complex:
            return t.__reduce_ex__(5)
        _, (data, dtype, shape) = _tensor_bytes(t.detach())
        return _rebuild_grad_tensor, (data, dtype, shape)
    if not t.is_cpu:
        if not t.is_cuda:
            return t.__reduce_ex__(5)
        t = t.cpu()
    if t.element_size() == 0:
        return t.__reduce_ex__(5)
    if t.nbytes < OOB_MIN_BYTES:  # small: its bytes inside the pickle (torch's own pickling is ~50 µs)
        try:  # (no op through torch's dispatcher, whose code a worker just woken has cold: several µs each)
            data = bytearray(memoryview(t.numpy()))  # (not bytearray(array): a 0-dim int array is a count)
        except TypeError:  # a dtype numpy lacks (bfloat16, float8): the bytes of a uint8 view
            data = bytearray(t.contiguous().reshape(-1).view(torch.uint8).numpy())
        return _rebuild_tensor, (data, t.dtype, tuple(t.shape))
    flat = t.contiguous().reshape(-1).view(torch.uint8)
    return _rebuild_tensor, (pickle.PickleBuffer(flat.numpy()), t.dtype, tuple(t.shape))


_cloudpickle_code_reduce: Any = getattr(cloudpickle.cloudpickle, "_code_reduce", None)  # (private: may be gone)
_DYNAMIC = "<dynamic-code>"


def _code_keeping_its_file(code: Any) -> Any:
    """cloudpickle >= 3.1 writes every by-value code object's file as "<dynamic-code>" (for deterministic
    pickles); the workers' tracebacks and pdb would lose the cell and the lines it ran. Keep the file."""
    make, args = _cloudpickle_code_reduce(code)
    return make, tuple(code.co_filename if a == _DYNAMIC and type(a) is str else a for a in args)


_REDUCERS: dict[type, Callable[[Any], Any]] = {}
"""Types whose reduction is known and cheap, looked up first (`register_reducer`)."""


def register_reducer(kind: type, reduce: Callable[[Any], Any]) -> None:
    """Pickle objects of exactly `kind` as `reduce(obj)` (a `__reduce__` value) before anything else is tried:
    for a type sent in bulk, like the tensor ids inside a batch of ops (cloudpickle's checks and the dispatch
    table would cost each one some µs of Python)."""
    _REDUCERS[kind] = reduce


class _Pickler(cloudpickle.Pickler):  # type: ignore[misc]  # (cloudpickle: no type information)
    if _cloudpickle_code_reduce is not None:
        dispatch_table = ChainMap({types.CodeType: _code_keeping_its_file}, cloudpickle.Pickler.dispatch_table)

    def reducer_override(self, obj: Any) -> Any:
        reduce = _REDUCERS.get(type(obj))
        if reduce is not None:
            return reduce(obj)
        torch = sys.modules.get("torch")
        if torch is not None and type(obj) is torch.Tensor:
            return _reduce_tensor(obj)
        if torch is not None and isinstance(obj, torch.memory_format | torch.layout):
            # torch.preserve_format, torch.strided & co. reduce to a bare name like "torch.preserve_format", and
            # pickle then finds it wherever `torch` is bound first in sys.modules: in a notebook, `__mp_main__`.
            return _torch_attr, (str(obj).removeprefix("torch."),)
        return super().reducer_override(obj)


class _Reduced:
    """Pickles as the reduction it holds: a result that is one tensor goes through the C pickler alone, with
    no pickler subclass (cloudpickle's checks, made for functions and classes, cost such a result most of its
    pickling; a `reducer_override` is a Python call for each object in it)."""

    __slots__ = ("reduction",)

    def __init__(self, reduction: Any) -> None:
        self.reduction = reduction

    def __reduce__(self) -> Any:
        return self.reduction


class FunctionRef:
    """An importable function, pickled as its module and qualified name (workers import it)."""

    def __init__(self, module: str, qualname: str):
        self.module, self.qualname = module, qualname

    def __reduce__(self) -> tuple[Callable[[str, str], Any], tuple[str, str]]:
        return import_function, (self.module, self.qualname)


def import_function(module: str, qualname: str) -> Any:
    """The function `module.qualname` (a live function's own function, if it is one)."""
    import importlib

    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return getattr(obj, "__monarch_fn__", obj)


def call_function(module: str, qualname: str, *args: Any) -> Any:
    """Import `module.qualname` and call it (a process target named as data, not imported by its starter)."""
    return import_function(module, qualname)(*args)


def _torch_attr(name: str) -> Any:
    import torch

    return getattr(torch, name)


_SCALARS = (type(None), bool, int, float, str)


def _plain(obj: Any, depth: int = 0) -> bool:
    """True for small trees of builtin scalars, which the C pickler handles alone (no cloudpickle)."""
    t = type(obj)
    if t in _SCALARS:
        return True
    if t is bytes:
        return len(obj) < OOB_MIN_BYTES
    if depth > 3:
        return False
    if t is tuple or t is list:
        if len(obj) > 16:
            return False
        for o in obj:
            if type(o) not in _SCALARS and not _plain(o, depth + 1):  # (a scalar: no call)
                return False
        return True
    if t is dict:
        if len(obj) > 16:
            return False
        for k, v in obj.items():
            if type(k) is not str or (type(v) not in _SCALARS and not _plain(v, depth + 1)):
                return False
        return True
    return False


def dumps(obj: Any) -> list[bytes | memoryview]:
    """Pickle `obj` as ``[body, *buffers]``."""
    if _plain(obj):
        return [pickle.dumps(obj, protocol=5)]
    buffers: list[bytes | memoryview] = []

    def keep(pb: pickle.PickleBuffer) -> bool:
        raw = pb.raw()
        if raw.nbytes < OOB_MIN_BYTES:
            return True  # small: inside the pickle
        buffers.append(raw)
        return False

    torch = sys.modules.get("torch")
    if torch is not None and type(obj) is torch.Tensor:
        return [pickle.dumps(_Reduced(_reduce_tensor(obj)), protocol=5, buffer_callback=keep), *buffers]
    f = io.BytesIO()
    _Pickler(f, protocol=5, buffer_callback=keep).dump(obj)
    return [f.getvalue(), *buffers]


def dumps_whole(obj: Any) -> bytes:
    """Pickle `obj` as one bytes object, large buffers inside it (a payload carried inside another message's
    body)."""
    if _plain(obj):
        return pickle.dumps(obj, protocol=5)
    f = io.BytesIO()
    _Pickler(f, protocol=5).dump(obj)
    return f.getvalue()


def dumps_function(fn: Any) -> bytes:
    """Pickle a function by value (cloudpickle), keeping its code's file name (see `_code_keeping_its_file`)."""
    f = io.BytesIO()
    _Pickler(f, protocol=5).dump(fn)
    return f.getvalue()


def loads(body: bytes | memoryview, buffers: Iterable[bytes | memoryview] = ()) -> Any:
    return pickle.loads(body, buffers=buffers)


_ENVELOPE = struct.Struct("<IiQI")
"""mesh id, sender rank (-1: the controller), sequence number, header length."""
_FIXED = SIG + _ENVELOPE.size
FIXED = _FIXED
"""Bytes before a message's header: its signature and envelope."""
CONTROLLER = -1
"""The sender rank of messages from the controller."""


def sender(first: memoryview | bytes) -> tuple[int, int]:
    """The (mesh id, rank) a message's first frame claims to be from (at least `FIXED` bytes; not checked)."""
    mesh_id, rank, _, _ = _ENVELOPE.unpack_from(first, SIG)
    return mesh_id, rank


@dataclass(slots=True)
class Envelope:
    """A message as received: who sent it, its sequence number, the message, its body (not yet unpickled)."""

    mesh_id: int
    rank: int
    seq: int
    message: Any
    body: bytes | memoryview
    buffers: list[bytes | memoryview]


_ENVELOPE_FIELDS = tuple(f.name for f in fields(Envelope))
_DUMPS5 = functools.partial(pickle.dumps, protocol=5)


def encode(
    key: bytes, mesh_id: int, rank: int, seq: int, message: Any, body: Sequence[bytes | memoryview] | None = None
) -> list[bytes | memoryview]:
    """Frames for `message` from (`mesh_id`, `rank`), with an already pickled body ``[body, *buffers]``.

    The first frame is ``signature | mesh id | rank | seq | len(header) | header | body``; each buffer
    follows as its own frame. The signature covers everything after itself, buffers included.
    """
    h = pickle.dumps(message, protocol=5)
    body = body or [b""]
    meta = b"".join((_ENVELOPE.pack(mesh_id, rank, seq, len(h)), h, body[0]))
    return [_sign(key, [meta, *body[1:]]) + meta, *body[1:]]


def _view(f: zmq.Frame | bytes | memoryview) -> memoryview:
    if type(f) is bytes:  # (a lane's frames; `hasattr` on bytes raises inside, several µs in a woken worker)
        return memoryview(f)
    return f.buffer if hasattr(f, "buffer") else memoryview(f)  # a zmq.Frame, or a memoryview


@overload
def decode(key: bytes, frames: Sequence[zmq.Frame | bytes | memoryview]) -> Envelope: ...
@overload
def decode(key: Callable[[int, int], bytes | None], frames: Sequence[zmq.Frame | bytes | memoryview]) -> Envelope: ...
def decode(key: Any, frames: Sequence[zmq.Frame | bytes | memoryview]) -> Envelope:
    """Check the signature, then unpickle the message (its body stays bytes). Nothing is unpickled before.

    `key` is the key, or a function of the claimed sender ``(mesh id, rank)`` that gives it (None: a sender
    we do not know, `UnknownSender`)."""
    first = _view(frames[0])
    if len(first) < _FIXED:
        raise BadSignature(f"a {len(first)}-byte message is too short to be signed")
    mesh_id, rank, seq, n = _ENVELOPE.unpack_from(first, SIG)
    if type(key) is not bytes:
        key = key(mesh_id, rank)
        if key is None:
            raise UnknownSender(f"it names no running mesh and rank ({mesh_id}, {rank})")
    if len(frames) == 1:
        bufs: list[bytes | memoryview] = []
        mac = _sign(key, [first[SIG:]])
    else:
        bufs = [_view(f) for f in frames[1:]]
        mac = _sign(key, [first[SIG:], *bufs])
    if not _compare(first[:SIG], mac):
        raise BadSignature(f"bad signature on a {len(first)}-byte message")
    return Envelope(mesh_id, rank, seq, pickle.loads(first[_FIXED : _FIXED + n]), first[_FIXED + n :], bufs)


def one_signer(key: bytes, mesh_id: int, rank: int) -> Callable[[int, Any, bytes | memoryview], list[bytes] | None]:
    """`py_one_signer`, compiled where `_fastwire` was built (the same results)."""
    if _fastwire is None:
        return py_one_signer(key, mesh_id, rank)
    return _fastwire.one_signer(mesh_id, rank, _blake2b, {"key": key, "digest_size": SIG}, _DUMPS5)


def one_sender(key: bytes, mesh_id: int, rank: int, seen: list[int]) -> Callable[[memoryview], Envelope | None]:
    """`py_one_sender`, compiled where `_fastwire` was built (the same results and errors)."""
    if _fastwire is None:
        return py_one_sender(key, mesh_id, rank, seen)
    mac = {"key": key, "digest_size": SIG}
    return _fastwire.one_sender(mesh_id, rank, seen, Envelope, _ENVELOPE_FIELDS, _blake2b, mac, pickle.loads)


def py_one_signer(key: bytes, mesh_id: int, rank: int) -> Callable[[int, Any, bytes | memoryview], list[bytes] | None]:
    """`encode` for a message of one frame from (`mesh_id`, `rank`) in one call: ``sign(seq, message, body)``
    gives the frame's two parts (signature, then the rest) or None where the frame would be `SMALL` or more
    (`encode` then signs it as a large message). Why: a worker sends a reply per call, and `encode` with its
    helpers and the lane's framing was a quarter of the bytecode a woken worker runs for a no-op call (the mirror
    of `one_sender`)."""
    small, envelope, dumps = SMALL, _ENVELOPE.pack, pickle.dumps

    def sign(seq: int, message: Any, body: bytes | memoryview) -> list[bytes] | None:
        h = dumps(message, protocol=5)
        meta = b"".join((envelope(mesh_id, rank, seq, len(h)), h, body))
        if len(meta) >= small:
            return None
        return [_blake2b(meta, key=key, digest_size=SIG).digest(), meta]

    return sign


def py_one_sender(key: bytes, mesh_id: int, rank: int, seen: list[int]) -> Callable[[memoryview], Envelope | None]:
    """`decode` for a connection that carries only (`mesh_id`, `rank`)'s messages (a lane), in one call per
    message: a one-frame message signed with `key`, from that sender, numbered above ``seen[rank]`` (which it
    then becomes) comes back as its `Envelope`, its body copied out of the view; for anything else, None
    (or the header's unpickling error) and nothing changes: `decode` and the receiver's checks then say
    what is wrong. Why: a no-op call on 8 workers takes 8 replies, and `decode` with its helpers cost a third
    of their Python."""
    fixed, small, unpack, loads = _FIXED, SMALL + SIG, _ENVELOPE.unpack_from, pickle.loads

    def check(first: memoryview) -> Envelope | None:
        size = len(first)
        if size < fixed or size >= small:
            return None
        m, r, seq, n = unpack(first, SIG)
        if m != mesh_id or r != rank or seq <= seen[rank] or fixed + n > size:
            return None
        if not _compare(first[:SIG], _blake2b(first[SIG:], key=key, digest_size=SIG).digest()):
            return None
        env = Envelope(m, r, seq, loads(first[fixed : fixed + n]), bytes(first[fixed + n :]), [])
        seen[rank] = seq  # (only now: a header that does not unpickle raises, and `decode` says so)
        return env

    return check
