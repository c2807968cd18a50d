"""Ctrl-C held back while the main thread is between the frames of one message (or taking a reply off the
socket), then delivered: a message cut in half would leave the socket unusable."""

from __future__ import annotations

import _signal  # type: ignore[import-not-found]  # (typeshed has no stub for CPython's private _signal)
import signal
import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from types import FrameType


class InterruptHold:
    """Holds Ctrl-C back while the main thread is in the middle of something that must not be cut short
    (the frames of one message; a reply being taken off the socket), then delivers it.

    Our handler acts as Python's default one (raises KeyboardInterrupt) except inside `hold()`; it is
    installed only over the default handler, and put back by `uninstall`."""

    def __init__(self) -> None:
        self.depth = 0
        self.pending = False
        self.handler = self._handle  # one bound method, so that getsignal() can recognise it

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.depth:
            self.pending = True
            return
        raise KeyboardInterrupt

    def install(self) -> None:
        if threading.get_ident() == MAIN and _getsignal(_SIGINT) is signal.default_int_handler:
            signal.signal(signal.SIGINT, self.handler)

    def uninstall(self) -> None:
        if threading.get_ident() == MAIN and _getsignal(_SIGINT) is self.handler:
            signal.signal(signal.SIGINT, signal.default_int_handler)

    def enter(self) -> bool:
        """Start holding; False when this thread cannot be interrupted or another handler is set (then
        `swap_enter` is the slow, general way)."""
        if threading.get_ident() != MAIN or _getsignal(_SIGINT) is not self.handler:
            return False
        self.depth += 1
        return True

    def leave(self) -> None:
        self.depth -= 1
        if not self.depth and self.pending:
            self.pending = False
            raise KeyboardInterrupt


_getsignal = _signal.getsignal  # signal.getsignal without its conversion to an enum (~15 µs)
_SIGINT = int(signal.SIGINT)
MAIN = threading.main_thread().ident
"""The thread Python runs signal handlers in (Ctrl-C is raised there)."""
HOLD = InterruptHold()


class _Swap:
    """Hold Ctrl-C with a handler of our own for a moment, whatever Python handler is set (a kernel's: the
    slow way, two handler swaps; through `_signal`, as `signal.signal` converts each handler to an enum and
    back, ~5 µs). `needed()` says whether there is one to hold back."""

    def __enter__(self) -> None:
        self.held: list[FrameType | None] = []
        self.old = _setsignal(_SIGINT, self._hold)

    def _hold(self, signum: int, frame: FrameType | None) -> None:
        self.held.append(frame)

    def __exit__(self, *exc: object) -> None:
        _setsignal(_SIGINT, self.old)
        if self.held and callable(self.old):
            self.old(_SIGINT, self.held[0])

    @staticmethod
    def needed() -> bool:
        """Whether Ctrl-C would run Python code here: on the main thread, under a handler that is a function
        (not SIG_IGN, as in a background job, nor SIG_DFL, which ends the process whatever it was doing)."""
        return threading.get_ident() == MAIN and callable(_getsignal(_SIGINT))


_setsignal = _signal.signal


class Deferred:
    """Ctrl-C on the main thread held for a block, then reported as `pressed` instead of raised (when what
    it would have run raises KeyboardInterrupt): for a step whose caller must act on it, such as a call
    that was just sent, which is then interrupted on the workers rather than left running. The block's
    own error, if any, goes on (a Ctrl-C that came meanwhile is then dropped)."""

    def __enter__(self) -> Deferred:
        self.pressed = False
        self._held = HOLD.enter()
        self._swap = _Swap() if not self._held and _Swap.needed() else None
        if self._swap is not None:
            self._swap.__enter__()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        try:
            if self._held:
                HOLD.leave()
            elif self._swap is not None:
                self._swap.__exit__()
        except KeyboardInterrupt:
            self.pressed = exc_type is None
