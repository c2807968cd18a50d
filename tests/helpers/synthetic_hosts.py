"""A load harness: host agents whose workers are synthetic, so that this 2-core machine drives thousands of
ranks from one controller over real sockets.

Each agent process is a real host agent (its CURVE link with heartbeats, its relays, the job's directory) whose
`StartWorkers` starts no process: one thread per mesh serves all of the mesh's ranks on that host, speaking the
workers' protocol on the relay's sockets (the subscriptions, a signed `Ready` per rank, then per rank `Output`
and `Reply`, each with that rank's own sequence numbers). A rank runs the live functions it is sent, in that
thread; the workloads below read the rank they run as from `RANK`. What the controller sees is what it sees of
real hosts: it is what is measured (`benchmarks/scale.py`), not the workers.

    job = SyntheticJob(tmp_path, "scale", hosts=8, ranks_per_host=64); job.start()
    mesh = monarch.notebook.job(job.name).spawn_procs({"gpu": 64})   # 512 ranks
    noop.on(mesh)()
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import cloudpickle

import monarch
from monarch.actor import Actor, endpoint

from conftest import wait_for
from helpers.agent_job import AgentJob

HELPERS = Path(__file__).resolve().parent
RANK = -1
"""The rank the synthetic worker runs as, while it runs a workload."""
_said: list[str] = []


# -- workloads (live functions; the synthetic ranks run them) ---------------------------------------------
@monarch.remote
def noop() -> None:
    return None


@monarch.remote
def rank_of() -> int:
    return RANK


@monarch.remote
def a_list() -> list[int]:
    return [1]


@monarch.remote
def say(text: str) -> None:
    """Prints `text` (a line of output from every rank)."""
    _said.append(f"{text}\n")


@monarch.remote
def fail_on(rank: int) -> None:
    if RANK == rank:
        raise ValueError(f"rank {rank} fails on purpose")


class Counter(Actor):
    """An actor on every synthetic rank (spawned and called as on real workers)."""

    def __init__(self) -> None:
        self.n = 0

    @endpoint
    def incr(self) -> int:
        self.n += 1
        return self.n

    @endpoint
    def rank(self) -> int:
        return RANK

    @endpoint
    def fail_on(self, rank: int) -> None:
        if RANK == rank:
            raise ValueError(f"actor {rank} fails on purpose")


# -- the agent side -------------------------------------------------------------------------------------
class SyntheticRanks(threading.Thread):
    """All of one mesh's ranks on one host, served by one thread."""

    def __init__(self, agent: Any, msg: Any) -> None:
        super().__init__(name=f"synthetic-mesh-{msg.mesh_id}", daemon=True)
        import zmq

        from monarch.runtime.wire import protocol

        self.zmq, self.protocol = zmq, protocol
        self.mesh_id = msg.mesh_id
        self.ranks = [s[0] for s in msg.starts]
        self.key = msg.starts[0][4][0]
        self.seq = dict.fromkeys(self.ranks, 0)
        self.by_topic: dict[bytes, list[int]] = {msg.starts[0][4][1]: self.ranks}
        for rank, *_, (_, _, rank_topic) in msg.starts:
            self.by_topic[rank_topic] = [rank]
        self.fns: dict[int, Any] = {}
        self.namespaces: dict[int, dict[str, Any]] = {}
        """Rank -> the namespace its `%%mesh` cells run in."""
        self.actors: dict[tuple[int, str], Any] = {}
        """(rank, name) -> that rank's actor: what the workers' `monarch.runtime.worker.actors` keeps per process."""
        self.seen = dict.fromkeys(self.ranks, 0)
        """Rank -> the last command number it took (as each worker keeps its own)."""
        self.stopped = threading.Event()
        relay = agent.relay
        self.cmd = agent.ctx.socket(zmq.XSUB)
        self.cmd.setsockopt(zmq.RCVHWM, 0)
        self.cmd.setsockopt(zmq.LINGER, 0)
        self.cmd.connect(relay.local["cmd"])  # (what is sent before the connection is made waits in its queue)
        self.out = agent.ctx.socket(zmq.PUSH)
        self.out.setsockopt(zmq.SNDHWM, 0)
        self.out.setsockopt(zmq.LINGER, 2000)
        self.out.connect(agent.reply_addr)
        for topic in self.by_topic:
            self.cmd.send(b"\x01" + topic)
        from monarch.runtime.wire.keys import HELLO

        info = {"pid": os.getpid(), "host": socket.gethostname(), "device": "cpu", "torch": True}
        for rank in self.ranks:  # (behind the subscriptions, on their connection: as a worker's `hello`)
            (frame,) = self._encode(rank, protocol.Ready(info), None)
            self.cmd.send(HELLO + frame)
            self.cmd.send(b"\x00" + HELLO[1:] + frame)

    def _encode(self, rank: int, message: Any, body: Any) -> list:
        from monarch.runtime.wire import codec

        self.seq[rank] += 1
        return codec.encode(self.key, self.mesh_id, rank, self.seq[rank], self.protocol.pack(message), body)

    def _send(self, rank: int, message: Any, body: Any = None) -> None:
        self.out.send_multipart(self._encode(rank, message, body), copy=False)

    def run(self) -> None:
        from monarch.runtime.wire import codec
        from monarch.runtime.wire.keys import TOPIC

        poller = self.zmq.Poller()
        poller.register(self.cmd, self.zmq.POLLIN)
        while not self.stopped.is_set():
            try:
                if not poller.poll(100):
                    continue
            except self.zmq.ZMQError:  # (the agent is ending: its context was closed)
                return
            frame = self.cmd.recv(copy=False)
            topic = bytes(frame.buffer[:TOPIC])
            frames = [frame.buffer[TOPIC:]]
            while frame.more:
                frame = self.cmd.recv(copy=False)
                frames.append(frame)
            try:
                env = codec.decode(self.key, frames)
            except codec.BadSignature:
                continue
            if env.mesh_id != self.mesh_id or env.rank != codec.CONTROLLER:
                continue
            # (a message for several ranks' topics comes once per topic, with one number: each rank takes it once)
            ranks = [r for r in self.by_topic.get(topic, []) if env.seq > self.seen[r]]
            for r in ranks:
                self.seen[r] = env.seq
            message = self.protocol.unpack(env.message)
            if type(message) is self.protocol.Call:
                self._call(message, env, ranks)
            elif type(message) is self.protocol.Exit:
                break
        self.cmd.close(0)
        self.out.close(2000)

    def _call(self, msg: Any, env: Any, ranks: list[int]) -> None:
        global RANK
        from monarch.runtime.wire import codec
        from monarch.runtime.worker.describe import describe

        if msg.fn is not None:
            fn = cloudpickle.loads(msg.fn)
            module = getattr(fn, "__module__", "")
            if module == "monarch.runtime.worker.actors":  # (actors: a worker's own functions)
                fn = getattr(self, f"_actor_{fn.__name__}")
            elif module == "monarch.runtime.worker.cells":  # (a %%mesh cell)
                fn = getattr(self, f"_cell_{fn.__name__}")
            self.fns[msg.fid] = fn
        fn = self.fns[msg.fid]
        args, kwargs = codec.loads(env.body, env.buffers)
        called = set(msg.ranks)  # (the mesh's topic brings calls on views too: only the view's ranks run them)
        for rank in ranks:
            if rank not in called:
                continue
            RANK = rank
            try:
                value = fn(*args, **kwargs)
                ok, body = True, codec.dumps(value)
            except Exception as e:
                ok, body = False, codec.dumps(describe(e))
            while _said:
                self._send(rank, self.protocol.Output(msg.call_id, "stdout", _said.pop(0)))
            self._send(rank, self.protocol.Reply(msg.call_id, ok), body)

    # the workers' actor functions (`monarch.runtime.worker.actors`), for many ranks in one process
    def _actor_spawn(self, name: str, cls: type, args: tuple, kwargs: dict) -> str:
        self.actors[(RANK, name)] = cls(*args, **kwargs)
        return f"synthetic rank {RANK}"

    def _actor_invoke(self, name: str, endpoint: str, args: tuple, kwargs: dict, *_: Any) -> Any:
        from monarch.runtime.worker.actors import _method

        method, *_ = _method(self.actors[(RANK, name)], endpoint)
        return method(*args, **kwargs)

    def _actor_stop(self, name: str) -> bool:
        return self.actors.pop((RANK, name), None) is not None

    # a `%%mesh` cell (`monarch.runtime.worker.cells.run_cell`): run in the rank's namespace, what it prints sent
    def _cell_run_cell(self, source: str, filename: str) -> None:
        import contextlib
        import io

        ns = self.namespaces.setdefault(RANK, {"__name__": "__main__", "rank": RANK})
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(compile(source, filename, "exec"), ns)
        if out.getvalue():
            _said.append(out.getvalue())


def _agent_class() -> type:
    from monarch.runtime.agent import agent as agent_module
    from monarch.runtime.wire import protocol

    agent_module.warm_fork_server = lambda: []  # (no worker process is ever forked here: no torch to warm)

    class SyntheticAgent(agent_module.Agent):
        """A real host agent whose meshes' ranks are `SyntheticRanks`."""

        synthetic: dict[int, SyntheticRanks]

        def _start(self, msg: protocol.StartWorkers) -> None:
            self.synthetic = getattr(self, "synthetic", {})
            _, self.reply_addr = self.admit(msg)
            for p in msg.sys_path:  # (the workloads' module, by reference)
                if p not in sys.path and os.path.isdir(p):
                    sys.path.append(p)
            ranks = SyntheticRanks(self, msg)
            self.synthetic[msg.mesh_id] = ranks
            ranks.start()

        def _signal(self, msg: protocol.SignalWorkers) -> None:
            pass  # (synthetic ranks are never busy between messages: nothing to interrupt or release)

        def _end(self, mesh_id: int) -> dict[int, int]:
            ranks = getattr(self, "synthetic", {}).pop(mesh_id, None)
            mesh = self.meshes.pop(mesh_id, None)
            if mesh is not None:
                self.relay.forbid(mesh.topics)
            if ranks is None:
                return {}
            ranks.stopped.set()
            ranks.join(5)
            return dict.fromkeys(ranks.ranks, 0)

        def _stop(self, msg: protocol.StopWorkers) -> None:
            self._send(protocol.WorkersStopped(msg.mesh_id, self._end(msg.mesh_id)))

        def _detach(self) -> None:
            for mesh_id in list(self.meshes):
                self._end(mesh_id)
            if self.rack is not None:
                self.rack.stop_leading()
            self.attached, self.attached_fd, self.controller = None, -1, ""

    return SyntheticAgent


def main() -> None:
    import argparse
    import signal

    from monarch.runtime.agent.agent import AgentConfig
    from monarch.runtime.common.config import settings

    ap = argparse.ArgumentParser(description="a host agent whose workers are synthetic (the load harness)")
    ap.add_argument("--job-dir", required=True)
    ap.add_argument("--index", type=int, required=True)
    ap.add_argument("--bind", required=True)
    args = ap.parse_args()
    agent = _agent_class()(AgentConfig(args.job_dir, args.index, args.bind, ""), settings())

    def stop(signum: int, frame: Any) -> None:
        agent.close()
        os._exit(0)

    signal.signal(signal.SIGTERM, stop)
    agent.register()
    agent.serve()


class Came:
    """Bundles (and their items) the controller took during a `with` block."""

    def __enter__(self) -> Came:
        from monarch.runtime.controller import get_controller

        self.transport = get_controller().backend.transport
        self.start = (self.transport.bundles, self.transport.bundled)
        return self

    def __exit__(self, *exc: object) -> None:
        self.bundles = self.transport.bundles - self.start[0]
        self.items = self.transport.bundled - self.start[1]


# -- the controller side: a job of synthetic hosts ---------------------------------------------------------
class SyntheticJob(AgentJob):
    """`hosts` synthetic agents on this machine (127.0.0.1, .2, ...), registered as a job in `root`."""

    def start(self, timeout: float = 120) -> float:
        """Start the agents; returns the seconds until all were up."""
        t0 = time.monotonic()
        env = dict(self.env, PYTHONPATH=os.pathsep.join([str(HELPERS.parent), self.env.get("PYTHONPATH", "")]))
        for i in range(self.hosts):
            cmd = [sys.executable, "-m", "helpers.synthetic_hosts", "--job-dir", str(self.dir.path),
                   "--index", str(i), "--bind", f"127.0.{i // 250}.{i % 250 + 1}"]  # fmt: skip
            with open(self.root / f"{self.name}-agent-{i}.err", "w") as err:  # (read if it exits; never a full pipe)
                self.procs.append(subprocess.Popen(cmd, env=env, stderr=err))

        def up() -> bool:
            for i, p in enumerate(self.procs):
                if p.poll() is not None:
                    err = (self.root / f"{self.name}-agent-{i}.err").read_text()
                    raise RuntimeError(f"synthetic agent {i} exited: {err}")
            return len(self.dir.agents()) >= self.hosts

        wait_for(up, timeout, what=f"{self.hosts} synthetic agents up")
        return time.monotonic() - t0


if __name__ == "__main__":  # (run as the module its workloads are pickled from: one RANK, one `_said`)
    from helpers import synthetic_hosts

    synthetic_hosts.main()
