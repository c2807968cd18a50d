"""Lanes: one Unix stream connection per local worker, carrying its commands down and everything it sends up.

Why: a message through ZeroMQ passes two more threads than through a socket (the sender's I/O thread, which
writes it, and the receiver's, which reads it and wakes the receiving thread). On 2 cores a no-op call to 8
workers costs 9 processes' wake-ups either way, and ZeroMQ's round trip to 8 forked processes is about 3x a
Unix socket's (`benchmarks/floor.py`: `rtt` against `rtt_unix`). Workers forked on the controller's own
machine (`LocalBackend`, IPC transport) talk over lanes; host agents and TCP keep ZeroMQ.

A lane carries exactly the signed frames `codec.encode` makes, each message as::

    frame count k (u32) | k frame lengths (u64 each) | the frames

so everything the sockets check (signature before unpickling, sender, sequence numbers) is checked the same
way. The listening socket lives in the controller's private directory (mode 0700), and a connection from a
process of another user is refused (SO_PEERCRED) before anything is read from it. A connection belongs to
the (mesh, rank) whose key signed its first message, and carries only that worker's messages from then on.

Queues stay bounded: the controller reads a lane only when it has handled what it read before (a worker
that writes faster than the controller reads waits in its own `send`); commands wait in the controller for
a worker that does not read, up to `send_hwm` of them, then the sender waits for it (backpressure) and,
after `send_stall` seconds without progress, gives up (`controller_end.PeerStalled`).
"""

from __future__ import annotations

import collections
import errno
import os
import select
import socket
import struct
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from monarch.runtime.wire.debug import peer_uid

_COUNT = struct.Struct("<I")
_ONE = struct.Struct("<IQ")
_ONE_SIZE = _ONE.size
MAX_FRAMES = 4096
"""More frames than this in one message is a corrupt stream (ours have a handful)."""
MAX_BYTES = 1 << 40
"""A message longer than this (1 TiB) is a corrupt stream, not a buffer to allocate."""
UNPROVEN_BYTES = 1 << 20
"""The most a message may claim on a connection that has not yet sent a signed message (a worker's first
messages are a few hundred bytes): any process of ours may connect, and a header costs it 12 bytes."""
CHUNK = 64 * 1024
"""Bytes a reader asks for at a time, at least (a no-op call's message is under 200 bytes, a batch of 256 tensor
commands about 20 KiB; a larger message is read whole into a buffer of its size). Each lane has one such
buffer at each end."""


def _nbytes(part: bytes | memoryview) -> int:
    return len(part) if type(part) is bytes else memoryview(part).nbytes


def size(parts: Sequence[bytes | memoryview]) -> int:
    """Bytes in all of `parts`."""
    return sum(map(_nbytes, parts))


def pack(frames: Sequence[bytes | memoryview]) -> list[bytes | memoryview]:
    """The parts to write for one message (the common small message: one bytes object)."""
    if len(frames) == 1:
        first = frames[0]
        n = _nbytes(first)
        if n < 65536:
            return [_ONE.pack(1, n) + bytes(first)]
        return [_ONE.pack(1, n), first]
    head = struct.pack(f"<I{len(frames)}Q", len(frames), *map(_nbytes, frames))
    return [head, *frames]


class CorruptLane(Exception):
    """A lane's bytes do not frame messages: the connection is dropped."""


class Reader:
    """Whole messages out of a stream: `fill` reads, `next` cuts a message off (its frames as bytes).

    A reader starts trusting its stream (`limit` MAX_BYTES, a message's buffer made at once from its header)
    or not (`limit` UNPROVEN_BYTES, the buffer grown as bytes come, at most doubling a read): `prove` once the
    peer has signed a message."""

    def __init__(self, trusted: bool = True) -> None:
        self.limit = MAX_BYTES if trusted else UNPROVEN_BYTES
        """A message claiming more than this is a corrupt stream."""
        self.trusted = trusted
        self.buf = bytearray(CHUNK)
        self.view = memoryview(self.buf)
        """Of `buf`, kept (not made again for each read and each message); released whenever `buf` changes
        size (a bytearray with a view cannot)."""
        self.start = 0
        self.end = 0
        self.want = 0
        """Bytes the message at `start` needs in all (0: not known yet)."""

    def fill(self, sock: socket.socket, flags: int = 0) -> int:
        """One read (blocking or not, as the socket is); bytes read, 0 at the end of the stream."""
        if self.end == 0 and self.want <= len(self.buf):  # (empty with room enough, the common case: no slice)
            n = self.end = sock.recv_into(self.view, 0, flags)
            return n
        room = max(CHUNK, self.want - (self.end - self.start))
        if not self.trusted:  # (a claim costs the peer nothing: the bytes it sends do)
            room = min(room, max(CHUNK, len(self.buf)))
        if len(self.buf) - self.end < room:
            self._make_room(room)
        n = sock.recv_into(self.view[self.end :], 0, flags)
        self.end += n
        return n

    def _make_room(self, room: int) -> None:
        data = self.end - self.start
        if self.start:  # move what is left to the front
            self.buf[:data] = self.buf[self.start : self.end]
            self.start, self.end = 0, data
        if len(self.buf) - self.end < room:
            self.view.release()
            self.buf.extend(bytes(room - (len(self.buf) - self.end)))
            self.view = memoryview(self.buf)

    def prove(self) -> None:
        """The peer signed a message: its messages may be as large as any (`MAX_BYTES`)."""
        self.limit, self.trusted = MAX_BYTES, True

    def next(self) -> list[bytes] | None:
        """The next whole message's frames, or None until more is read."""
        avail = self.end - self.start
        if avail < 4:
            return None
        buf, s = self.buf, self.start
        (k,) = _COUNT.unpack_from(buf, s)
        if not 0 < k <= MAX_FRAMES:
            raise CorruptLane(f"a message of {k} frames")
        head = 4 + 8 * k
        if avail < head:
            self.want = head
            return None
        lens = _ONE.unpack_from(buf, s)[1:] if k == 1 else struct.unpack_from(f"<{k}Q", buf, s + 4)
        total = head + sum(lens)
        if total > self.limit:
            raise CorruptLane(f"a message of {total} bytes (at most {self.limit} here)")
        if avail < total:
            self.want = total
            return None
        self.want = 0
        view = self.view
        pos = s + head
        frames = []
        for n in lens:
            frames.append(bytes(view[pos : pos + n]))
            pos += n
        if pos == self.end:
            self.start = self.end = 0
            if len(buf) > 16 * CHUNK:  # after a large message: give the memory back
                view.release()
                self.buf = bytearray(CHUNK)
                self.view = memoryview(self.buf)
        else:
            self.start = pos
        return frames


def _advance(parts: list[Any], n: int) -> list[Any]:
    """`parts` without their first `n` bytes."""
    while n:
        size = _nbytes(parts[0])
        if n < size:
            parts = [memoryview(parts[0]).cast("B")[n:], *parts[1:]]
            break
        n -= size
        parts = parts[1:]
    return parts


# -- a worker's end -----------------------------------------------------------------------------------------
class LaneClient:
    """A worker's lane: `send` from any thread (blocking, whole messages), `recv` on the main thread.

    A signal handler that raises (Ctrl-C in a call) must not land between a read or write and its
    bookkeeping: the stream would lose its framing. The worker's handler asks `defer_interrupt()` first;
    a deferred interrupt is raised when the message is whole (sent, or its bytes kept for the next `recv`).
    Waiting for a command is not such a moment: it is interrupted at once (`input()` at a pdb prompt).
    """

    def __init__(self, path: str, spin: float = 0.0) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(path)
        self.spin = spin
        """Seconds `recv` polls for a command before it sleeps (0: it sleeps at once), when the last wait was
        no longer than that (`_quick`): where commands come further apart, polling would only burn a CPU."""
        self._quick = True
        self.reader = Reader()
        self._next: list[bytes] | None = None
        self.lock = threading.Lock()
        self.broken = False
        self._reading: int | None = None
        self._writing: int | None = None
        """The thread in the middle of a read or a write (its bookkeeping included)."""
        self._deferred = False
        self._poller = select.poll()
        self._poller.register(self.sock, select.POLLIN)

    def fileno(self) -> int:
        return self.sock.fileno()

    def defer_interrupt(self) -> bool:
        """For a signal handler about to raise: True (and the interrupt is raised later, when the stream is
        in step) if this thread is in the middle of a read or write."""
        me = threading.get_ident()
        if me == self._reading or me == self._writing:
            self._deferred = True
            return True
        return False

    def _raise_deferred(self) -> None:
        if self._deferred:
            self._deferred = False
            raise KeyboardInterrupt

    def ready(self) -> bool:
        """Whether a whole message is already read (waiting on the descriptor would not see it)."""
        if self._next is None:
            if self.reader.end == self.reader.start:  # (nothing read and not taken: the common case)
                return False
            try:
                self._next = self.reader.next()
            except CorruptLane:
                return True  # (`recv` says so)
        return self._next is not None

    def recv(self, readable: bool = False) -> list[bytes] | None:
        """The next message's frames (blocks); None once the controller closed the lane (or its bytes frame
        no message: a bug of ours; the lane is useless then). `readable`: a poller has just said the lane
        has bytes, so the first read does not ask again."""
        taken, self._next = self._next, None
        reader = self.reader
        try:
            while taken is None:
                if reader.end != reader.start:  # (nothing read yet, the common case: straight to the read)
                    taken = reader.next()
                    if taken is not None:
                        break
                if not self._fill(readable):
                    return None
                readable = False
        except CorruptLane:
            return None
        return taken

    def recv_checked(self, check: Callable[[memoryview], Any], readable: bool = False) -> Any:
        """`recv`, with a one-frame message given to `check` as a view of the reader's buffer (good only during
        the call): what `check` makes of it, or the message's frames where it gives None (or for a message of
        several frames); None once the controller closed the lane. The message is taken off the stream before
        `check` runs, so one that raises there is gone. Why: each command wakes a worker that runs every step
        cold, 64 workers on two cores; cutting the frame out, as `recv` does, is a copy and three calls more."""
        taken = self._next
        if taken is not None:  # (`ready` cut it out already)
            self._next = None
            return taken
        reader = self.reader
        try:
            while True:
                s, end = reader.start, reader.end
                if end - s >= _ONE_SIZE:
                    k, n = _ONE.unpack_from(reader.buf, s)
                    if k == 1 and end - s - _ONE_SIZE >= n:
                        first = s + _ONE_SIZE
                        if first + n == end:
                            reader.start = reader.end = 0  # (taken: the next read starts at the front)
                        else:
                            reader.start = first + n
                        got = check(reader.view[first : first + n])
                        if got is not None:
                            return got
                        return [bytes(reader.buf[first : first + n])]
                    taken = reader.next()
                    if taken is not None:
                        return taken
                if not self._fill(readable):
                    return None
                readable = False
        except CorruptLane:
            return None

    def _fill(self, readable: bool = False) -> int:
        """One read, waiting for bytes if none have come: bytes read, 0 at the end of the stream. With `spin`,
        after a quick wait, it tries without waiting for that long first; `readable`, it reads at once (a
        poller said so: one system call less for each command of a worker serving actors)."""
        spin = self.spin
        began = time.perf_counter() if spin else 0.0
        until = began + spin if spin and self._quick else 0.0
        while True:
            if readable:
                readable = False
            elif not until:
                self._poller.poll()  # (an interrupt raised here takes nothing from the stream)
            elif time.perf_counter() > until:
                until = 0.0
            self._reading = threading.get_ident()
            try:
                n: int | None = self.reader.fill(self.sock, socket.MSG_DONTWAIT)
            except BlockingIOError:
                n = None
            finally:
                self._reading = None
            if self._deferred:  # (`_raise_deferred`; what was read stays in the reader)
                self._raise_deferred()
            if n is not None:
                if spin:
                    self._quick = time.perf_counter() - began <= spin
                return n

    def send(self, frames: Sequence[bytes | memoryview]) -> None:
        """Write one message whole (any thread; the caller orders messages). A lane the controller closed
        drops what is sent (the worker exits with its controller)."""
        parts = pack(frames)
        self._write(parts, len(parts[0]) if len(parts) == 1 and type(parts[0]) is bytes else size(parts))

    def send_frame(self, pieces: list[bytes]) -> None:
        """`send` of a message of one frame, given as the bytes it joins (`codec.one_signer`'s), without joining
        them: the common message (a reply) in fewer steps."""
        n = len(pieces[0]) + len(pieces[1])
        self._write([_ONE.pack(1, n), *pieces], n + _ONE_SIZE)

    def _write(self, parts: list[Any], left: int) -> None:
        with self.lock:
            self._writing = threading.get_ident()
            try:
                while parts and not self.broken:
                    try:
                        n = self.sock.sendmsg(parts)
                    except OSError as e:
                        if e.errno not in (errno.EPIPE, errno.ECONNRESET, errno.ENOTCONN):
                            raise
                        self.broken = True
                        break
                    if n == left:  # (the common case: all of it in one write)
                        break
                    left -= n
                    parts = _advance(parts, n)
            finally:
                self._writing = None
        if self._deferred:
            self._raise_deferred()

    def close(self) -> None:
        self.sock.close()


# -- the controller's end -----------------------------------------------------------------------------------
class Lane:
    """The controller's end of one worker's lane."""

    def __init__(self, sock: socket.socket, server: LaneServer) -> None:
        self.sock = sock
        self.fd = sock.fileno()
        self.server = server
        self.reader = Reader(trusted=False)
        """Trusted once the lane's first message proved whose lane it is (`Reader.prove`)."""
        self.owner: tuple[int, int] | None = None
        """(mesh id, rank) of the worker, from its first message."""
        self.out: collections.deque[list[Any]] = collections.deque()
        """Messages (their parts) the worker has not taken yet, in order; the first may be partly written."""
        self.lock = threading.Lock()
        """Guards `out` and writes (senders, and the receiving thread when the socket becomes writable)."""
        self.closed = False
        self.progress = 0
        """Bumped by each write that moved bytes (a sender waiting for room watches it)."""
        self.writing = False
        """Whether the epoll watches this lane for room to write (commands wait in `out`)."""
        self.take: Callable[[memoryview], Any] | None = None
        """Once the lane's owner is known (set by the transport): checks one whole one-frame message, given as
        a view of the reader's buffer that is good only during the call, and gives what the receiver gets
        (None: nothing). The lane's messages then skip framing them as lists of frames and checking them apart."""

    def send(self, parts: list[Any], size: int) -> int:
        """Write one message (`size` bytes in all) as far as the socket takes it now, the rest queued; returns
        how many messages wait."""
        with self.lock:
            if self.closed:
                return 0
            if self.out:
                self.out.append(parts)
                return len(self.out)
            try:  # (the common case: nothing waits, and the socket takes the whole message)
                n = self.sock.send(parts[0]) if len(parts) == 1 else self.sock.sendmsg(parts)
            except BlockingIOError:
                n = 0
            except OSError:
                self._gone()
                return 0
            if n == size:
                self.progress += 1
                return 0
            self.progress += bool(n)
            self.out.append(_advance(parts, n))
            self.writing = True
            self.server.want_write(self, True)
            return 1

    def flush(self) -> None:
        with self.lock:
            self._write()

    def _write(self) -> None:
        out = self.out
        while out and not self.closed:
            parts = out[0]
            try:
                n = self.sock.sendmsg(parts)
            except BlockingIOError:
                break
            except OSError:
                self._gone()
                break
            self.progress += 1
            rest = _advance(parts, n)
            if rest:
                out[0] = rest
                break
            out.popleft()
        writing = bool(out) and not self.closed
        if writing != self.writing:
            self.writing = writing
            self.server.want_write(self, writing)

    def _gone(self) -> None:
        """The worker is gone (its exit is reported by the backend's monitor): nothing more is written."""
        self.closed = True
        self.out.clear()

    def shut(self) -> None:
        """Stop the lane (any thread): queued commands are dropped; the receiving thread sees the end and
        closes the socket."""
        with self.lock:
            self.closed = True
            self.out.clear()
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


class LaneServer:
    """The controller's lanes: a listening socket, the accepted lanes, and one epoll over them (and over any
    other descriptor the receiver watches, `watch`). Reading, accepting and closing happen on the one thread
    that receives; senders write to lanes from any thread."""

    def __init__(self, path: str, log: Callable[[str, str], None] | None = None) -> None:
        self.path = path
        self.log = log
        """Says why a lane was closed (rate-limited by its owner: a process that reconnects in a loop must not
        flood the terminal)."""
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(path)
        os.chmod(path, 0o600)
        self.listener.listen(1024)
        self.listener.setblocking(False)
        self.ep = select.epoll()
        self.ep.register(self.listener.fileno(), select.EPOLLIN)
        self.lanes: dict[int, Lane] = {}
        self.messages: collections.deque[tuple[Lane, list[bytes]] | Any] = collections.deque()
        """In order: a lane's message as its frames (to be checked), or what its `Lane.take` made of it."""
        self.watched: set[int] = set()
        self.uid = os.getuid()
        self.refused = 0
        """Connections refused because another user made them (for the log, and tests)."""

    def fileno(self) -> int:
        """Readable when a lane has something to read or take (or a watched descriptor is readable)."""
        return self.ep.fileno()

    def watch(self, fd: int) -> None:
        self.ep.register(fd, select.EPOLLIN)
        self.watched.add(fd)

    def want_write(self, lane: Lane, on: bool) -> None:
        try:
            self.ep.modify(lane.fd, select.EPOLLIN | select.EPOLLOUT if on else select.EPOLLIN)
        except (OSError, ValueError):
            pass  # closed meanwhile

    def pump(self, timeout: float) -> tuple[bool, bool]:
        """Wait up to `timeout` seconds (-1: for ever) for anything, then act on it: accept, read (whole
        messages go to `messages`), write what waits, close what ended. Returns (anything happened, a watched
        descriptor is readable)."""
        events = self.ep.poll(timeout)
        watched_ready = False
        for fd, ev in events:
            lane = self.lanes.get(fd)
            if lane is None:
                if fd in self.watched:
                    watched_ready = True
                elif fd == self.listener.fileno():
                    self._accept()
                continue
            if ev & select.EPOLLOUT:
                lane.flush()
            if ev & (select.EPOLLIN | select.EPOLLHUP | select.EPOLLERR):
                self._read(lane)
        return bool(events), watched_ready

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return  # (out of descriptors: the worker's connect fails and it says so)
            if peer_uid(sock) != self.uid:
                self.refused += 1
                sock.close()
                continue
            sock.setblocking(False)
            lane = Lane(sock, self)
            self.lanes[lane.fd] = lane
            self.ep.register(lane.fd, select.EPOLLIN)

    def _read(self, lane: Lane) -> None:
        reader = lane.reader
        try:
            n = reader.fill(lane.sock)
        except BlockingIOError:
            return
        except MemoryError:  # (a signed peer's message larger than this machine's memory)
            self.misbehaved(lane, f"a message of {reader.want} bytes does not fit in memory")
            return
        except OSError:
            n = 0
        take = lane.take
        if take is not None and n:  # one-frame messages cut off here (`Reader.next`'s common case) and checked
            buf, view, s, end = reader.buf, reader.view, reader.start, reader.end
            messages = self.messages
            try:
                while end - s >= _ONE_SIZE:
                    k, size = _ONE.unpack_from(buf, s)
                    if k != 1 or end - s - _ONE_SIZE < size:
                        break
                    got = take(view[s + _ONE_SIZE : s + _ONE_SIZE + size])
                    s += _ONE_SIZE + size
                    if got is not None:
                        messages.append(got)
            finally:
                if s == end:
                    reader.start = reader.end = 0
                else:
                    reader.start = s
        try:
            while reader.end != reader.start:  # (the common case: one whole message, then nothing left)
                frames = reader.next()
                if frames is None:
                    break
                self.messages.append((lane, frames))
        except CorruptLane as e:
            self.misbehaved(lane, str(e))
            return
        if not n or lane.closed:
            self.drop(lane)

    def misbehaved(self, lane: Lane, why: str) -> None:
        """Close a lane whose bytes are not a worker's messages, saying why (the receiving thread). The other
        lanes go on; a worker whose lane this was exits, and its mesh reports it."""
        if self.log is not None:
            owner = "an unproven connection" if lane.owner is None else f"rank {lane.owner[1]} of mesh {lane.owner[0]}"
            self.log("a lane", f"{owner} sent {why}; closed")
        self.drop(lane)

    def drop(self, lane: Lane) -> None:
        """Close a lane (the receiving thread)."""
        lane.shut()
        lane.take = None  # (it refers to the lane)
        if self.lanes.pop(lane.fd, None) is not None:
            try:
                self.ep.unregister(lane.fd)
            except (OSError, ValueError):
                pass
            lane.sock.close()

    def close(self) -> None:
        for lane in list(self.lanes.values()):
            self.drop(lane)
        self.listener.close()
        self.ep.close()
        try:
            os.unlink(self.path)
        except OSError:
            pass
