"""What the controller watches for on its own: calls that hang in a collective, and (when asked for) every
rank's stacks now and then. Both ask the workers' control threads, which answer whatever their main thread
is doing; the wording of what they report lives here too."""

from __future__ import annotations

import itertools
import sys
import threading
import time
import traceback
from typing import TYPE_CHECKING

from monarch.runtime.controller.calls import say_ranks
from monarch.runtime.wire import protocol

if TYPE_CHECKING:
    from monarch.runtime.common.stacks import Frame
    from monarch.runtime.controller.core import Controller
    from monarch.runtime.controller.state import PendingCall, SpawnedMesh
    from monarch.runtime.wire import codec

HANG_SAMPLES = 5
"""How many times the ranks of a call past `MONARCH_HANG_REPORT` are asked where they are, `HANG_EVERY`
seconds apart, before a picture that stayed the same is reported."""
HANG_EVERY = 0.5


class Watchdogs:
    """The hang watchdog (`MONARCH_HANG_REPORT`), the periodic stack report (`CONTROLLER_PYSPY_REPORT_INTERVAL`),
    and the stacks requests both (and `ProcMesh.stacks`) make."""

    def __init__(self, controller: Controller) -> None:
        self.controller = controller
        self._stack_replies: dict[int, dict[int, list[tuple[str, list[Frame]]]]] = {}
        """Request number -> {rank: its threads' stacks}, while `stacks` waits for them."""
        self._stack_tokens = itertools.count(1)
        settings = controller.settings
        if settings.hang_report:
            threading.Thread(target=self._watch_hangs, name="monarch-hang-watch", daemon=True).start()
        if settings.stack_report:
            threading.Thread(target=self._report_stacks, name="monarch-stack-report", daemon=True).start()

    # -- where ranks are ----------------------------------------------------------------------------
    def stacks(
        self, mesh: SpawnedMesh, ranks: tuple[int, ...], wait: float = 1.0
    ) -> dict[int, list[tuple[str, list[Frame]]] | None]:
        """{rank: its threads' stacks (`stacks.thread_stacks`), or None if it did not answer within `wait`}."""
        token = next(self._stack_tokens)
        got = self._stack_replies[token] = {}
        try:
            if mesh.state == "running":
                mesh.backend.control(mesh.mesh_id, ranks, token, protocol.Control.STACKS)
                deadline = time.monotonic() + wait
                while len(got) < len(ranks) and time.monotonic() < deadline:
                    time.sleep(0.01)
            return {r: got.get(r) for r in ranks}
        finally:
            self._stack_replies.pop(token, None)

    def took_stacks(self, env: codec.Envelope) -> None:
        """A rank's `protocol.Stacks` (the receiving thread)."""
        got = self._stack_replies.get(env.message.token)
        if got is not None:
            got[env.rank] = env.message.threads

    def _report_stacks(self) -> None:
        """`CONTROLLER_PYSPY_REPORT_INTERVAL`: every so often, everyone's stacks on the real stderr."""
        c = self.controller
        while not c.closed:
            time.sleep(c.settings.stack_report)
            try:
                self._print_stacks()
            except Exception:  # (a report is never worth the thread)
                traceback.print_exc(file=sys.__stderr__)

    def _print_stacks(self) -> None:
        from monarch.runtime.common.stacks import StackReport, thread_stacks

        for mesh in list(self.controller.meshes.values()):
            if mesh.state == "running":
                report = StackReport(thread_stacks(), self.stacks(mesh, tuple(range(mesh.size))),
                                     dict(enumerate(mesh.labels)))  # fmt: skip
                stamp = time.strftime("%H:%M:%S")
                print(
                    f"monarch: stacks of mesh {mesh.shape.describe()}, {stamp}\n{report}",
                    file=sys.__stderr__,
                    flush=True,
                )

    # -- hangs --------------------------------------------------------------------------------------
    def _watch_hangs(self) -> None:
        """Calls that have run `hang_report` seconds while ranks of theirs wait in a collective: say once,
        where the call's output goes, which ranks wait where and for whom."""
        c = self.controller
        limit = c.settings.hang_report
        while not c.closed:
            time.sleep(min(1.0, limit / 4))
            # In a frame of its own: a loop variable left bound here would keep the last call looked at,
            # and its replies (a large result's frames), alive while this thread sleeps.
            self._look_for_hangs(limit)

    def _look_for_hangs(self, limit: float) -> None:
        now = time.monotonic()
        for pending in self.controller.calls.all():
            due = max(pending.started + limit, pending.next_hang_check)
            if not pending.hang_reported and now >= due and not pending.future.done():
                pending.next_hang_check = now + limit  # (a healthy loop is looked at again only later)
                try:
                    self._report_hang(pending)
                except Exception:
                    traceback.print_exc(file=sys.__stderr__)

    def _report_hang(self, pending: PendingCall) -> None:
        """Look HANG_SAMPLES times, HANG_EVERY seconds apart: only a picture that stays the same (the same
        ranks waiting in the same collective at the same line, the others at the same lines) is reported. A
        loop that is merely busy, its ranks meeting in collectives many times a second, is not."""
        c, mesh = self.controller, pending.mesh
        first: dict[int, tuple[str, str]] | None = None
        said: dict[int, protocol.Busy] = {}
        busy: list[int] = []
        for i in range(HANG_SAMPLES):
            if i:
                time.sleep(HANG_EVERY)
            if mesh.state != "running" or pending.future.done():
                return
            asked = c.calls.ask_busy(mesh, only=pending)
            if not asked:
                return
            busy = asked[0][1]
            said = {r: pending.busy[r] for r in busy if r in pending.busy}
            picture = {r: (b.collective, b.where) for r, b in said.items()}
            if not any(col for col, _ in picture.values()) or (first is not None and picture != first):
                return  # (nobody waits in a collective, or things move: looked at again later)
            first = picture
        pending.hang_reported = True
        c.receiver.notice(pending, *_hang_report(pending, said, busy))


def _hang_report(pending: PendingCall, said: dict[int, protocol.Busy], busy: list[int]) -> tuple[int, str]:
    """(the rank in whose place it is shown, the report) for a call whose picture stayed the same."""
    mesh = pending.mesh
    waiting = {r: b for r, b in said.items() if b.collective}
    places: dict[tuple[str, str], list[int]] = {}
    for r, b in waiting.items():
        places.setdefault((b.collective, b.where), []).append(r)
    seconds = time.monotonic() - pending.started
    span = HANG_EVERY * (HANG_SAMPLES - 1)
    lines = [f"monarch: {pending.name or 'this call'} has run {seconds:.0f} s; for the last {span:.0f} s:"]
    for (collective, at), ranks in places.items():
        lines.append(f"  {say_ranks(ranks)} {'waits' if len(ranks) == 1 else 'wait'} in {collective} at {at}")
    elsewhere = [r for r in said if r not in waiting]
    done = [r for r in pending.ranks if r in pending.replies]
    for r in elsewhere:
        lines.append(f"  rank {r} ({mesh.labels[r]}) is at {said[r].where}, in no collective")
    if elsewhere:
        one = len(elsewhere) == 1
        lines.append(f"  {say_ranks(elsewhere)} lag{'s' if one else ''}: the others wait for {'it' if one else 'them'}")
    elif done:
        they = "it" if len(done) == 1 else "they"
        lines.append(
            f"  {say_ranks(done)} already finished this call: a collective {they} skipped waits for "
            f"{'it' if len(done) == 1 else 'them'}"
        )
    elif len(places) > 1:
        lines.append("  the ranks wait in different collectives or places: mismatched collectives")
    mute = [r for r in busy if r not in said]
    if mute:
        lines.append(f"  {say_ranks(mute)} did not say where {'it is' if len(mute) == 1 else 'they are'}")
    lines.append("  (Interrupt the kernel or press Ctrl-C to stop it; mesh.stacks() shows every stack.)")
    return (elsewhere or sorted(waiting))[0], "\n".join(lines) + "\n"
