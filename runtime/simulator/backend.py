"""The simulator's backend: a mesh whose workers are simulated (see `model`), behind the same seam as real ones.

Tensor-engine batches are run on fake tensors against the device's cost model; process groups are noted;
a fetched value (`monarch.inspect`) is answered with a tensor of the right shape and dtype whose values
were not computed (NaN for floating point, zeros otherwise), and says so once. Live functions and
`%%mesh` cells need real workers: their calls fail, saying so.

The controller's own time counts: between two messages the controller's clock moves by the wall time the
user's program took (the simulator's own work left out), so what the controller does in Python — building
modules, autograd, computing metadata — is in the timeline as it would be in a real run. While it computes,
it slows down the workers of its host (`SimWorkers.controller_busy`), as it takes a share of their cores.
"""

from __future__ import annotations

import io
import pickle
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from monarch.runtime.backends.base import Backend
from monarch.runtime.common import helper_cpu
from monarch.runtime.common.shape import Shape
from monarch.runtime.simulator.devices import DeviceProfile
from monarch.runtime.simulator.model import SimWorkers
from monarch.runtime.wire import codec
from monarch.runtime.wire import protocol as P
from monarch.runtime.wire.protocol import Control

FETCH = ("monarch.runtime.worker.engine.table", "fetch")
"""The worker function `monarch.inspect` calls, by name."""


class _NoReplies:
    """A simulated mesh's replies go straight to the controller (`deliver`); nothing arrives here."""

    reply_fd = -1

    def __init__(self) -> None:
        self.recv_lock = threading.RLock()

    def recv(self, block: bool) -> Any:
        return None

    def poll_briefly(self, seconds: float) -> Any:
        return None

    def set_timeout(self, ms: int) -> None:
        pass

    def poke(self) -> None:
        pass


class SimBackend(Backend):
    """Runs one simulated mesh of ``{"host": hosts, "gpu": gpus}`` workers on `dev`."""

    def __init__(self, dev: DeviceProfile, gpus_per_host: int, deliver: Callable[[Any], Any]) -> None:
        self.dev = dev
        self.gpus_per_host = gpus_per_host
        self.deliver = deliver
        """The controller's handler of messages from workers (`Receiver.handle`)."""
        self.replies = _NoReplies()
        self.workers: SimWorkers | None = None
        self.mesh_id = -1
        self.fns: dict[int, tuple[str, str] | None] = {}
        """Function id -> (module, name) of a worker function called by name, or None (a live function)."""
        self.lock = threading.Lock()
        self.clock = 0.0
        """The controller's simulated time (seconds)."""
        self._mark = time.perf_counter()
        self._cpu_mark = (threading.get_ident(), time.thread_time(), helper_cpu.spent())
        """The thread that sent last, its CPU time then, and the program's helper threads' (`helper_cpu`)."""
        self.controller_spans: list[tuple[float, float, str]] = []
        self.warned = False
        self._seq = 0

    # -- the controller's clock ----------------------------------------------------------------------
    def _enter(self) -> None:
        elapsed = time.perf_counter() - self._mark
        start, self.clock = self.clock, self._advance(elapsed)
        if self.workers is not None and self.workers.watched and elapsed > 0:
            self.workers.controller_busy(start, self.clock, self._cpu_share(elapsed))

    def _advance(self, elapsed: float) -> float:
        """The controller's clock after `elapsed` wall seconds of its own: slowed down by
        `controller_slowdown` while simulated workers still compute (they share its cores)."""
        f = self.dev.controller_slowdown
        w = self.workers
        if f <= 1.0 or w is None:
            return self.clock + elapsed
        busy = max(float(w.dispatch.max()), *(float(s.max()) for s in w.streams.values())) - self.clock
        if busy <= 0:
            return self.clock + elapsed
        if elapsed * f <= busy:
            return self.clock + elapsed * f
        return self.clock + busy + (elapsed - busy / f)

    def _cpu_share(self, elapsed: float) -> float:
        """The share of `elapsed` (since the last message) the program computed: the sending thread, and the
        threads that compute for it while it waits (`grad_generator`'s autograd: `helper_cpu`); none while it
        slept; all of it when another thread sent last."""
        thread, cpu, helpers = self._cpu_mark
        if thread != threading.get_ident():
            return 1.0
        return min(1.0, (time.thread_time() - cpu + helper_cpu.spent() - helpers) / elapsed)

    def _leave(self) -> None:
        self._mark = time.perf_counter()
        self._cpu_mark = (threading.get_ident(), time.thread_time(), helper_cpu.spent())

    def now(self) -> float:
        """The controller's simulated time now (its wall time since the last message included)."""
        with self.lock:
            return self._advance(time.perf_counter() - self._mark)

    # -- the seam ------------------------------------------------------------------------------------
    def start(self, mesh_id: int, shape: Shape, labels: list[str], progress=None) -> list[dict]:
        assert self.workers is None, "one mesh per simulator"
        self.mesh_id = mesh_id
        n = len(shape)
        self.workers = SimWorkers(self.dev, n, np.arange(n) // self.gpus_per_host)
        device = "cpu" if self.dev.kind == "cpu" else "cuda:{}"
        return [
            {
                "pid": "-",
                "host": f"sim-host{r // self.gpus_per_host}",
                "device": device.format(r % self.gpus_per_host),
                "simulated": self.dev.name,
            }  # fmt: skip
            for r in range(n)
        ]

    def send(self, mesh_id: int, ranks: tuple[int, ...] | None, message: Any, body: list | None = None) -> None:
        w = self.workers
        assert w is not None and mesh_id == self.mesh_id
        reply = None
        # The controller sends from user code, maybe under `mesh.activate()`: the simulated workers' own torch
        # calls (fake tensors, placeholders) must not be captured by its modes as new commands.
        with self.lock, torch.utils._python_dispatch._disable_current_modes(), torch._C.DisableTorchFunction():
            self._enter()
            try:
                idx = np.arange(w.size) if ranks is None else np.asarray(ranks, dtype=np.int64)
                t = type(message)
                if t is P.RunOps:
                    batch = P.unpack_commands(codec.loads(body[0], body[1:]))
                    sent = self.clock
                    arrival = sent + self.dev.wire_latency
                    w.run_batch(idx, batch, arrival)
                    self.controller_spans.append((sent, sent, f"sent {len(batch)} commands"))
                elif t is P.MakeGroups:
                    w.groups[message.gid] = message.partition
                elif t is P.Call:
                    reply = self._call(message, body)
                elif t not in IGNORED:
                    reply = self._unsupported(message, idx)
            finally:
                self._leave()
        if reply is not None:
            for env in reply:
                self.deliver(env)

    def _unsupported(self, message: Any, ranks: Any) -> list:
        """A message the simulator does not model: a request (it has a `call_id`) gets an error reply from
        each rank, so that its caller raises instead of waiting; anything else raises here."""
        why = (
            f"{type(message).__name__} is not simulated: a simulated mesh models "
            f"{', '.join(sorted(c.__name__ for c in (*HANDLED, *IGNORED)))}"
        )
        call_id = getattr(message, "call_id", None)
        if call_id is None:
            raise NotImplementedError(why)
        err = codec.dumps(P.ErrorInfo("NotImplementedError", why, ""))
        return [self._envelope(int(r), P.Reply(call_id, False), err) for r in ranks]

    def _call(self, msg: P.Call, body: list | None) -> list:
        if msg.fn is not None:
            self.fns[msg.fid] = _named(msg.fn)
        name = self.fns.get(msg.fid)
        w = self.workers
        out = []
        if name == FETCH:
            (ref,), _ = codec.loads(body[0], body[1:])
            ready = max(w.synced(r) for r in msg.ranks)
            start = self.clock
            self.clock = max(self.clock, ready + (self.dev.fetch_latency or self.dev.wire_latency))
            self.controller_spans.append((start, self.clock, "fetch a value"))
            if not self.warned:
                self.warned = True
                out.append(self._envelope(msg.ranks[0], P.Output(msg.call_id, "stderr", _NOT_COMPUTED)))
            fake = w.fake_of(ref)
            for r in msg.ranks:
                if fake is None:
                    err = P.ErrorInfo(
                        "KeyError",
                        f"tensor {ref} is not on this simulated worker (freed, or an op that made it failed)",
                        "",
                    )
                    out.append(self._envelope(r, P.Reply(msg.call_id, False), codec.dumps(err)))
                else:
                    out.append(self._envelope(r, P.Reply(msg.call_id, True), codec.dumps(_placeholder(fake))))
            return out
        if name is None:
            what = "a live function"
        elif name[0] == "monarch.runtime.worker.cells":
            what = "a %%mesh cell" if name[1] == "run_cell" else f"%mesh {name[1]}"
        else:
            what = f"{name[0]}.{name[1]}"
        err = P.ErrorInfo(
            "RuntimeError",
            f"{what} cannot run on a simulated mesh: it has no worker processes, only a cost model of the tensor "
            "engine's commands. Run it on a mesh from this_host().spawn_procs(...)",
            "",
        )
        return [self._envelope(r, P.Reply(msg.call_id, False), codec.dumps(err)) for r in msg.ranks]

    def _envelope(self, rank: int, message: Any, body: list | None = None) -> codec.Envelope:
        self._seq += 1
        body = body or [b""]
        return codec.Envelope(self.mesh_id, rank, self._seq, message, body[0], list(body[1:]))

    def interrupt(self, mesh_id: int, ranks: tuple[int, ...], call_id: int) -> None:
        pass  # a simulated call ends as it is sent

    def control(self, mesh_id: int, ranks: tuple[int, ...], call_id: int, kind: Control) -> None:
        pass

    def stop(self, mesh_id: int, graceful: bool) -> dict[int, int | None]:
        n = self.workers.size if self.workers is not None else 0
        return dict.fromkeys(range(n), 0)

    def kill(self, mesh_id: int) -> None:
        pass

    def mark_gone(self, mesh_id: int) -> None:
        pass

    def close(self) -> None:
        pass


HANDLED = (P.RunOps, P.MakeGroups, P.Call)
"""What a simulated mesh models; `SimBackend.send` answers anything else with an error (`tests/test_wire_tags.py`
checks that every message the controller sends is one or the other)."""
IGNORED = (P.StdinReply, P.Exit, P.ReformGroups, P.Cast, P.ReadyTorch)
"""What needs nothing from a simulated mesh: no simulated call asks for input, `stop` ends the mesh, a
broadcast to actors answers nothing (and a simulated mesh runs no actor code), and no
simulated rank is ever released from a collective (so groups are never torn down to re-form)."""

_NOT_COMPUTED = (
    "monarch.Simulator: values are not computed on a simulated mesh; monarch.inspect returns a tensor of the "
    "right shape and dtype filled with NaN (zeros for integers and booleans)\n"
)


def _placeholder(fake: Any) -> torch.Tensor:
    shape, dtype = tuple(fake.shape), fake.dtype
    if dtype.is_floating_point or dtype.is_complex:
        return torch.full(shape, float("nan"), dtype=dtype)
    return torch.zeros(shape, dtype=dtype)


class _Peek(pickle.Unpickler):
    """Reads a pickled function only as far as its name, if it is a worker function called by name."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("monarch.runtime.wire.codec", "import_function"):
            return lambda mod, qual: (mod, qual)
        raise pickle.UnpicklingError("a function shipped by value")


def _named(blob: bytes) -> tuple[str, str] | None:
    try:
        got = _Peek(io.BytesIO(blob)).load()
    except Exception:
        return None
    return got if isinstance(got, tuple) else None
