"""The host agent: its link to the controller, and its host's workers.

One controller is attached at a time (the link's ROUTER says when its connection comes and goes; ZeroMQ's
heartbeats end a connection whose other end went silent). When the attached controller's connection is
gone (its kernel restarted, its host lost), the workers it started are killed: a controller that attaches
later starts fresh ones. The agent itself stays until Slurm ends the job.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import sys
import threading
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zmq
import zmq.utils.monitor

from monarch.runtime.agent.rack import RackLeader
from monarch.runtime.agent.relay import Relay
from monarch.runtime.common.config import Settings
from monarch.runtime.common.log import RateLimitedLog
from monarch.runtime.common.processes import batches, usable_cpus
from monarch.runtime.procs.jobfiles import AgentRecord, JobDir, Manifest, Secret
from monarch.runtime.procs.workers import WorkerProcs, fork_server_pid, private_dir, warm_fork_server
from monarch.runtime.wire import codec, protocol
from monarch.runtime.wire.keys import WorkerKeys
from monarch.runtime.wire.links import LinkEnd, heartbeat

_NOBLOCK = int(zmq.NOBLOCK)


@dataclass
class _Mesh:
    ranks: list[int]
    topics: list[bytes]
    stopping: bool = False


@dataclass
class AgentConfig:
    """How this agent was started (`python -m monarch.runtime.agent --help`)."""

    job_dir: str
    """The job's directory (shared with the controllers that attach)."""
    index: int
    """This host's index in the job (Slurm's node id): its workers are ``host=index``."""
    bind_addr: str
    """The address its sockets listen on (this host's, never all interfaces)."""
    interface: str
    """The network interface of `bind_addr`: workers' gloo and NCCL connections use it."""
    workspace: str = ""
    """This host's copy of the job's workspace ("" without one)."""
    env: dict = field(default_factory=dict)


class Agent:
    def __init__(self, cfg: AgentConfig, settings: Settings) -> None:
        self.cfg = cfg
        self.settings = settings
        self.job = JobDir(Path(cfg.job_dir))
        self.secret: Secret = self.job.secret()
        self.log = RateLimitedLog(f"monarch agent {cfg.index}")
        self.ctx = zmq.Context()
        self._auth = _authenticate(self.ctx, self.secret.curve.client_public)
        self.dir = private_dir("monarch-agent-")
        self.ctl = self.ctx.socket(zmq.ROUTER)
        self.ctl.setsockopt(zmq.LINGER, 0)
        self.secret.curve.serve(self.ctl)
        self.monitor = self.ctl.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        heartbeat(self.ctl, settings.heartbeat_timeout)
        self.ctl.bind(f"tcp://{cfg.bind_addr}:0")
        self.relay = Relay(
            self.ctx,
            cfg.bind_addr,
            self.secret.curve,
            self.dir,
            self.log,
            cfg.index,
            settings.bundle_wait,
            settings.heartbeat_timeout,
        )
        self.procs = WorkerProcs(settings, self.dir, self._lost)
        self.meshes: dict[int, _Mesh] = {}
        self.attached: bytes | None = None
        """The attached controller's connection (its identity on the link's ROUTER)."""
        self.attached_fd = -1
        """Its socket (ZeroMQ reports a connection's end by fd)."""
        self.controller = ""
        self.link = LinkEnd(self.secret.key, cfg.index, codec.CONTROLLER)
        self._outbox: list[Any] = []
        self._outbox_lock = threading.Lock()
        self._wake = self.ctx.socket(zmq.PULL)
        self._wake.bind(f"inproc://agent-wake-{id(self)}")
        self._poke = self.ctx.socket(zmq.PUSH)
        self._poke.connect(f"inproc://agent-wake-{id(self)}")
        self._poke_lock = threading.Lock()
        self.closed = False
        self._handlers = {
            protocol.StartWorkers: self._start,
            protocol.SignalWorkers: self._signal,
            protocol.StopWorkers: self._stop,
            protocol.SyncOffer: self._sync_offer,
            protocol.SyncFiles: self._sync_files,
            protocol.Lead: self._lead,
            protocol.RackMesh: self._rack_mesh,
        }
        self.rack: RackLeader | None = None
        """This host's rack's merger, once a controller made it the rack's leader."""
        self.workspace = Manifest(cfg.workspace) if cfg.workspace else None
        self._sync_removed: list[str] = []
        self._sync_wanted: list[str] = []
        # torch imported (in the fork server, not here) before the agent says it is up: a mesh starts at once
        self.gpus = warm_fork_server()
        self.record = AgentRecord(
            cfg.index, socket.gethostname(), cfg.bind_addr, os.getpid(),
            {"ctl": self.ctl.getsockopt_string(zmq.LAST_ENDPOINT), **self.relay.endpoints},
        )  # fmt: skip

    def register(self) -> None:
        """Write this agent down in the job's directory: controllers find it there."""
        self.job.write_agent(self.record)

    # -- the link ----------------------------------------------------------------------------------------
    def _send(self, message: Any) -> None:
        """To the attached controller (the control loop's thread only)."""
        if self.attached is None:
            return
        frames = self.link.encode(message)
        with contextlib.suppress(zmq.ZMQError):
            self.ctl.send_multipart([self.attached, *frames], _NOBLOCK)

    def post(self, message: Any) -> None:
        """`_send` from any thread: queued for the control loop."""
        with self._outbox_lock:
            self._outbox.append(message)
        with self._poke_lock:
            with contextlib.suppress(zmq.ZMQError):
                self._poke.send(b"", _NOBLOCK)

    def serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self.ctl, zmq.POLLIN)
        poller.register(self._wake, zmq.POLLIN)
        poller.register(self.monitor, zmq.POLLIN)
        while not self.closed:
            try:
                ready = dict(poller.poll(1000))
                if self._wake in ready:
                    while True:
                        try:
                            self._wake.recv(_NOBLOCK)
                        except zmq.Again:
                            break
                with self._outbox_lock:
                    out, self._outbox = self._outbox, []
                for message in out:
                    self._send(message)
                if self.monitor in ready:
                    while self.monitor.poll(0):
                        event = zmq.utils.monitor.recv_monitor_message(self.monitor)
                        if event["event"] == zmq.EVENT_DISCONNECTED and event["value"] == self.attached_fd:
                            self._detach()  # its kernel ended, or heartbeats stopped: its workers go
                if self.ctl in ready:
                    while True:
                        try:
                            frames = self.ctl.recv_multipart(_NOBLOCK, copy=False)
                        except zmq.Again:
                            break
                        self._receive(frames)
            except zmq.ContextTerminated:
                return
            except Exception:
                self.log("a message", traceback.format_exc(limit=4))

    def _receive(self, frames: list) -> None:
        ident, frames = frames[0].bytes, frames[1:]
        if not frames:
            return
        try:
            env = self.link.decode(frames, fresh=ident != self.attached)
        except (codec.BadSignature, ValueError) as e:
            self.log("a message", str(e))
            return
        message = env.message
        if type(message) is protocol.AgentHello:
            self._hello(ident, frames[0].get(zmq.SRCFD), env, message)
            return
        if ident != self.attached:
            self.log("a message", "from a controller that is not attached")
            return
        self.link.accept(env)
        handler = self._handlers.get(type(message))
        if handler is None:
            self.log("a message", f"{type(message).__name__} is not for agents")
            return
        if type(message) is protocol.SyncFiles:
            handler(message, self.link.body(env))
        else:
            handler(message)

    def _hello(self, ident: bytes, fd: int, env: Any, msg: protocol.AgentHello) -> None:
        if self.attached is not None and self.attached != ident and msg.controller == self.controller:
            # The same controller on a new link: it closed the old one (a detach, then an attach), but on a loaded
            # machine its new hello can be read before the old link's end is: the old link's workers go now.
            self._detach()
        if self.attached is not None and self.attached != ident:
            refused = f"the job is in use by the controller {self.controller} (detach it first)"
            frames = self.link.encode(self._info(refused))
            with contextlib.suppress(zmq.ZMQError):
                self.ctl.send_multipart([ident, *frames], _NOBLOCK)
            return
        self.attached, self.attached_fd, self.controller = ident, fd, msg.controller
        self.link.accept(env)
        self._send(self._info(""))

    def _info(self, refused: str) -> protocol.AgentInfo:
        return protocol.AgentInfo(
            self.record.host,
            self.cfg.bind_addr,
            os.getpid(),
            self.gpus,
            os.cpu_count() or 1,
            self.cfg.workspace,
            refused,
        )

    def _detach(self) -> None:
        """The attached controller is gone: its workers go too."""
        for mesh_id in list(self.meshes):
            self.procs.kill(mesh_id)
            threading.Thread(target=self._reap, args=(mesh_id, 0.0, False), daemon=True).start()
        if self.rack is not None:
            self.rack.stop_leading()
        self.attached, self.attached_fd, self.controller = None, -1, ""

    # -- leading a rack ----------------------------------------------------------------------------------
    def _lead(self, msg: protocol.Lead) -> None:
        if self.rack is None:
            self.rack = RackLeader(
                self.ctx, self.cfg.bind_addr, self.secret.curve, self.cfg.index, self.log, self.settings.bundle_wait,
                self.settings.heartbeat_timeout, lambda endpoints, missing: self.post(protocol.Leading(endpoints, missing)),
            )  # fmt: skip
        self.rack.lead(msg.members)

    def _rack_mesh(self, msg: protocol.RackMesh) -> None:
        if self.rack is not None:
            self.rack.set_mesh(msg.mesh_id, msg.key, msg.ranks)

    # -- workers -----------------------------------------------------------------------------------------
    def admit(self, msg: protocol.StartWorkers) -> tuple[list[int], str]:
        """This host's ranks of the mesh `msg` starts, their topics allowed, and the address they send replies to:
        bundled by this agent when the mesh has more than `Settings.bundle_above` ranks and this host several."""
        ranks = [s[0] for s in msg.starts]
        topics = [msg.starts[0][4][1]] + [s[4][2] for s in msg.starts] if msg.starts else []
        self.meshes[msg.mesh_id] = _Mesh(ranks, topics)
        if not msg.starts:
            return ranks, self.relay.local["reply"]
        bundled = msg.size > self.settings.bundle_above and len(ranks) > 1
        return ranks, self.relay.add_mesh(msg.mesh_id, msg.starts[0][4][0], ranks, topics, bundled, msg.size)

    def _start(self, msg: protocol.StartWorkers) -> None:
        ranks, reply = self.admit(msg)
        path = self.procs.add(msg.mesh_id, msg.size, len(ranks))
        self.procs.started(msg.mesh_id, True)  # every exit from now on is news for the controller
        local = len(msg.starts)
        threads = int(self.cfg.env.get("OMP_NUM_THREADS") or max(1, (os.cpu_count() or 1) // max(local, 1)))
        base = dict(os.environ, **self.cfg.env, **msg.env)
        if self.cfg.interface:
            base.setdefault("GLOO_SOCKET_IFNAME", self.cfg.interface)
            base.setdefault("NCCL_SOCKET_IFNAME", self.cfg.interface)
        cwd = self.cfg.workspace or (msg.cwd if os.path.isdir(msg.cwd) else os.getcwd())
        sys_path = ([self.cfg.workspace] if self.cfg.workspace else []) + list(sys.path)
        sys_path += [p for p in msg.sys_path if p not in sys_path and os.path.isdir(p)]  # (a shared home's)
        addrs = (self.relay.local["cmd"], reply, self.relay.local["store"])
        batch = batches(local, usable_cpus())
        for rank, coords, label, local_rank, (key, mesh_topic, rank_topic) in msg.starts:
            keys = WorkerKeys(msg.mesh_id, rank, key, mesh_topic, rank_topic, *addrs)
            env = dict(base, RANK=str(rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(msg.size),
                       LOCAL_WORLD_SIZE=str(local))  # fmt: skip
            cfg = protocol.WorkerStart(
                keys, coords, msg.sizes, local_rank, label, path, env, cwd, sys_path, threads, fork_server_pid(),
                os.getpid(), msg.group_timeout, 0,  # (no controller on this host to yield to)
                batch=batch,
            )  # fmt: skip
            try:
                self.procs.fork(msg.mesh_id, rank, cfg)
            except Exception as e:
                self._send(protocol.WorkerLost(msg.mesh_id, rank, f"could not be started on its host: {e}"))
                return

    def _signal(self, msg: protocol.SignalWorkers) -> None:
        if msg.kind == protocol.Control.INTERRUPT:
            self.procs.interrupt(msg.mesh_id, msg.ranks, msg.call_id)
        else:
            self.procs.control(msg.mesh_id, msg.ranks, msg.call_id, msg.kind)

    def _stop(self, msg: protocol.StopWorkers) -> None:
        mesh = self.meshes.get(msg.mesh_id)
        if mesh is None:
            self._send(protocol.WorkersStopped(msg.mesh_id, {}))
            return
        mesh.stopping = True
        self.procs.stopping(msg.mesh_id)
        threading.Thread(target=self._reap, args=(msg.mesh_id, msg.grace, True), daemon=True).start()

    def _reap(self, mesh_id: int, grace: float, answer: bool) -> None:
        codes = self.procs.wait_exit(mesh_id, grace)
        mesh = self.meshes.pop(mesh_id, None)
        if mesh is not None:
            self.relay.forbid(mesh.topics)
        if answer:
            self.post(protocol.WorkersStopped(mesh_id, codes))

    # -- the workspace -----------------------------------------------------------------------------------
    def _sync_offer(self, msg: protocol.SyncOffer) -> None:
        """Compare the controller's workspace with this host's copy: remove what it no longer has, ask for
        what differs."""
        if self.workspace is None:
            self._send(protocol.SyncWant([]))
            self._send(protocol.Synced([]))
            return
        mine = self.workspace.files()
        self._sync_removed = sorted(p for p in mine if p not in msg.files)
        for rel in self._sync_removed:
            self.workspace.remove(rel)
        self._sync_wanted = sorted(p for p, h in msg.files.items() if mine.get(p) != h)
        self._send(protocol.SyncWant(self._sync_wanted))
        if not self._sync_wanted:
            self._send(protocol.Synced(self._sync_removed))

    def _sync_files(self, msg: protocol.SyncFiles, contents: list) -> None:
        assert self.workspace is not None, "files sent to a host without a workspace"
        for rel, data in zip(msg.paths, contents):
            self.workspace.write(rel, data)
        self._send(protocol.Synced(sorted(set(msg.paths) | set(self._sync_removed))))

    def _lost(self, mesh_id: int, rank: int, cause: str) -> None:
        """A worker exited or froze (the monitor thread): the controller decides what that means."""
        mesh = self.meshes.get(mesh_id)
        if mesh is not None and not mesh.stopping:
            self.post(protocol.WorkerLost(mesh_id, rank, cause))

    # -- the end -----------------------------------------------------------------------------------------
    def close(self) -> None:
        """Kill every worker, take this agent out of the job's directory, close the sockets."""
        if self.closed:
            return
        self.closed = True
        for mesh_id in list(self.meshes):
            self.procs.kill(mesh_id)
        for mesh_id in list(self.meshes):
            self.procs.wait_exit(mesh_id, 2)
        self.job.remove_agent(self.cfg.index)
        self.procs.close()
        if self.rack is not None:
            self.rack.close()
        self.relay.close()
        self._auth.stop()
        self.ctx.destroy(linger=0)
        shutil.rmtree(self.dir, ignore_errors=True)


def _authenticate(ctx: zmq.Context, client_public: bytes):
    """A ZAP handler on `ctx` that admits only the job's client key (the CURVE sockets would take any)."""
    from zmq.auth.thread import ThreadAuthenticator

    auth = ThreadAuthenticator(ctx, log=_Quiet())
    auth.start()

    class Keys:
        def callback(self, domain: str, key: bytes) -> bool:
            return key == client_public

    auth.configure_curve_callback(domain="monarch-agent", credentials_provider=Keys())
    return auth


class _Quiet:
    def debug(self, *a, **k) -> None:
        pass

    info = warning = error = exception = debug
