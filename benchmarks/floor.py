"""The hardware floor, measured in the same run as our figures (issue 29, item 1).

    python benchmarks/floor.py      # prints the floors alone; `./run bench` measures them once per run

Each floor runs in a fresh process that imports only the standard library and pyzmq (no monarch, no torch),
printing one JSON line (`run.measure`), so it is what this machine's processes, sockets and Python cost
before any of our code runs:

- `rtt`: a round trip between one process and N forked processes over IPC with the socket kinds our runtime
  uses (`runtime/wire/controller_end.py`, `worker_end.py`): the parent binds an XPUB (`XPUB_MANUAL`,
  `XPUB_NODROP`) and a PULL; each child connects an XSUB, subscribes a 16-byte mesh topic and a topic of its
  own (upstream `\\x01` + topic, applied by the parent by hand, as ours are), connects a PUSH and says hello up
  it (a plain hello up the XSUB breaks libzmq 4.3's XPUB_MANUAL pairing of subscriptions with connections; our
  workers' hello up the XSUB is subscription-shaped for that reason, `runtime/wire/keys.py`'s `HELLO`). One round trip:
  one 100-byte message on the mesh topic (one send reaches all N), and one 80-byte answer from each child up
  the PULL. Median of ROUND_TRIPS after 50 warm-up. `rtt_one`: the same to one child on its own topic (the
  floor of a call to one worker, `monarch.inspect`). With `cpu_rounds`, that many more round trips to all N, with the parent's CPU
  (`time.process_time`, all its threads) and each child's (utime + stime from /proc/<pid>/stat) per round, and
  both split by thread (main, libzmq's, other) from /proc/<pid>/task.
- `rtt_unix`, `rtt_unix_one`: the same round trips over Unix stream socket pairs, the kind our lanes are
  (`runtime/wire/lanes.py`: a local worker's commands and replies): one write to each child, an answer
  from each, read through one epoll. No ZeroMQ I/O threads between the processes: the floor under the one
  above, which issue 29's targets are set against.
- `rtt_router`: the raw ROUTER/DEALER echo that benchmarks/actors.py has reported as its floor since issue 28
  (a ROUTER bound by the parent, a DEALER in each child; one small message to each, each echoes it).
- `sign`: per message, pickle (protocol 5) of a small tuple message (a no-op `Call`'s header) + HMAC-SHA256
  (`hmac.digest`) of 150 bytes; `check`: the same HMAC, `hmac.compare_digest`, and `pickle.loads` of the
  header. Each also alone (`pickle`, `hmac`, `unpickle`). Medians over 1,000 batches of 100 (100k messages),
  so the timer's own cost is spread over 100.
- `spawn`: N processes forked by a process that imported only the standard library and pyzmq; each child
  makes a zmq context, connects a PUSH to the parent's PULL (bound before) and says hello; from the first
  fork until all N hellos arrived. Median of 5.
- `torch_import`: `import torch` alone in a fresh process of the same Python (median of 3), the one floor that
  imports torch: what a cold spawn of workers with torch imported pays at least once, wherever it imports it
  (issue 29 compares our cold spawn, torch imported, with torchmonarch's, which imports no torch).

`floors()` runs them all and returns the figures, in seconds (`sign`, `check` & co.: seconds per message).
"""

from __future__ import annotations

import sys
import textwrap

from run import N, header, measure  # benchmarks/run.py, next to this file

CPU_OF = textwrap.dedent(
    """
    def cpu_of(pid):
        # utime + stime of every thread of process `pid`, in seconds (clock ticks: 10 ms each)
        with open(f"/proc/{pid}/stat") as f:
            rest = f.read().rsplit(")", 1)[1].split()
        return (int(rest[11]) + int(rest[12])) / os.sysconf("SC_CLK_TCK")


    def threads_of(pid):
        # the same split by thread: {"main": s, "zmq": s (libzmq's I/O and reaper threads), "other": s}
        out = {"main": 0.0, "zmq": 0.0, "other": 0.0}
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{tid}/stat") as f:
                    name, rest = f.read().split("(", 1)[1].rsplit(")", 1)
            except OSError:
                continue  # (gone meanwhile)
            rest = rest.split()
            kind = "main" if int(tid) == pid else "zmq" if name.startswith("ZMQbg") else "other"
            out[kind] += (int(rest[11]) + int(rest[12])) / os.sysconf("SC_CLK_TCK")
        return out


    def threads_delta(after, before, n):
        return {k: (after[k] - before[k]) / n for k in after}
    """
)

RTT = CPU_OF + textwrap.dedent(
    """
    import json, os, shutil, statistics, tempfile, time
    import zmq

    TOPIC = 16
    MESSAGE = bytes(100)  # about a signed no-op Call's first frame (topic apart)
    ANSWER = bytes(80)  # about a signed Reply's
    d = tempfile.mkdtemp(prefix="floor-")
    cmd_addr, reply_addr = f"ipc://{d}/cmd", f"ipc://{d}/reply"
    mesh = os.urandom(TOPIC)
    own = [os.urandom(TOPIC) for _ in range(N)]
    ctx = zmq.Context()
    cmd = ctx.socket(zmq.XPUB)
    cmd.setsockopt(zmq.XPUB_MANUAL, 1)
    cmd.setsockopt(zmq.XPUB_NODROP, 1)
    cmd.setsockopt(zmq.LINGER, 0)
    cmd.bind(cmd_addr)
    reply = ctx.socket(zmq.PULL)
    reply.setsockopt(zmq.LINGER, 0)
    reply.bind(reply_addr)

    pids = []
    for i in range(N):
        pid = os.fork()
        if pid == 0:  # the child: one answer per message, until told to stop
            c = zmq.Context()
            sub = c.socket(zmq.XSUB)
            sub.setsockopt(zmq.RCVHWM, 0)
            sub.connect(cmd_addr)
            sub.send(b"\\x01" + mesh)
            sub.send(b"\\x01" + own[i])
            push = c.socket(zmq.PUSH)
            push.connect(reply_addr)
            push.send(b"hello")
            while sub.recv()[TOPIC:] != b"exit":
                push.send(ANSWER)
            push.close(linger=1000); sub.close(linger=0); c.term()
            os._exit(0)
        pids.append(pid)
    try:
        cmd.setsockopt(zmq.RCVTIMEO, 10_000)  # (a lost message fails the run, not hangs it)
        reply.setsockopt(zmq.RCVTIMEO, 10_000)
        for _ in range(2 * N):  # each subscription, applied as it comes (to the connection it came on)
            m = cmd.recv()
            assert m[:1] == b"\\x01", m
            cmd.setsockopt(zmq.SUBSCRIBE, m[1:])
        for _ in range(N):
            reply.recv()
    except BaseException:
        for pid in pids:
            os.kill(pid, 9)
        raise


    def round_trip(topic, n):
        cmd.send(topic + MESSAGE)
        for _ in range(n):
            reply.recv()


    def median(topic, n):
        for _ in range(50):
            round_trip(topic, n)
        ts = []
        for _ in range(ROUND_TRIPS):
            t0 = time.perf_counter(); round_trip(topic, n); ts.append(time.perf_counter() - t0)
        return statistics.median(ts)


    try:
        out = {"rtt": median(mesh, N), "rtt_one": median(own[0], 1)}
        if CPU_ROUNDS:
            before, split = [cpu_of(p) for p in pids], [threads_of(p) for p in [os.getpid(), *pids]]
            cpu, t0 = time.process_time(), time.perf_counter()
            for _ in range(CPU_ROUNDS):
                round_trip(mesh, N)
            out["wall_per_round"] = (time.perf_counter() - t0) / CPU_ROUNDS
            out["parent_cpu"] = (time.process_time() - cpu) / CPU_ROUNDS
            out["child_cpu"] = [(cpu_of(p) - b) / CPU_ROUNDS for p, b in zip(pids, before)]
            after = [threads_of(p) for p in [os.getpid(), *pids]]
            out["parent_threads"] = threads_delta(after[0], split[0], CPU_ROUNDS)
            kids = [threads_delta(a, b, CPU_ROUNDS) for a, b in zip(after[1:], split[1:])]
            out["child_threads"] = {k: sum(d[k] for d in kids) / N for k in kids[0]}  # (the mean child)
    except BaseException:
        for pid in pids:
            os.kill(pid, 9)
        raise
    cmd.send(mesh + b"exit")
    for pid in pids:
        os.waitpid(pid, 0)
    shutil.rmtree(d, ignore_errors=True)
    print(json.dumps(out), flush=True)
    """
)

RTT_ROUTER = textwrap.dedent(
    """
    import json, os, signal, statistics, tempfile, time
    import zmq

    addr = "ipc://" + os.path.join(tempfile.mkdtemp(prefix="floor-"), "echo")
    pids = []
    for i in range(N):
        pid = os.fork()
        if pid == 0:  # the child: echo every message until told to stop
            ctx = zmq.Context()
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.IDENTITY, b"w%d" % i)
            s.connect(addr)
            s.send(b"ready")
            while (m := s.recv()) != b"exit":
                s.send(m)
            s.close(linger=0); ctx.term()
            os._exit(0)
        pids.append(pid)
    ctx = zmq.Context()
    r = ctx.socket(zmq.ROUTER)
    r.bind(addr)
    ids = [r.recv_multipart()[0] for _ in range(N)]


    def round_trip():
        for i in ids:
            r.send_multipart([i, b"x"])
        for _ in ids:
            r.recv_multipart()


    for _ in range(50):
        round_trip()
    ts = []
    for _ in range(ROUND_TRIPS):
        t0 = time.perf_counter(); round_trip(); ts.append(time.perf_counter() - t0)
    for i in ids:
        r.send_multipart([i, b"exit"])
    for pid in pids:
        os.waitpid(pid, 0)
    print(json.dumps({"floor": statistics.median(ts)}), flush=True)
    """
)

RTT_UNIX = textwrap.dedent(
    """
    import json, os, select, socket, statistics, time

    MESSAGE = bytes(120)  # about a no-op Call on a lane (its length header included)
    ANSWER = bytes(100)  # about a Reply's
    socks, pids = [], []
    for i in range(N):
        a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        pid = os.fork()
        if pid == 0:  # the child: one answer per message, until its socket ends
            for s in socks:
                s.close()
            a.close()
            while b.recv(65536):
                b.sendall(ANSWER)
            os._exit(0)
        b.close()
        socks.append(a)
        pids.append(pid)
    ep = select.epoll()
    for s in socks:
        ep.register(s.fileno(), select.EPOLLIN)


    def round_trip(to):
        for s in to:
            s.send(MESSAGE)
        got, want = 0, len(to) * len(ANSWER)  # (bytes: a read may hold part of an answer)
        while got < want:
            events = ep.poll(10)
            assert events, "an answer was lost"
            for fd, _ in events:
                got += len(os.read(fd, 65536))


    def median(to):
        for _ in range(50):
            round_trip(to)
        ts = []
        for _ in range(ROUND_TRIPS):
            t0 = time.perf_counter(); round_trip(to); ts.append(time.perf_counter() - t0)
        return statistics.median(ts)


    try:
        out = {"rtt_unix": median(socks), "rtt_unix_one": median(socks[:1])}
    finally:
        for s in socks:
            s.close()
        for pid in pids:
            os.waitpid(pid, 0)
    print(json.dumps(out), flush=True)
    """
)

SIGN = textwrap.dedent(
    """
    import hmac, json, os, pickle, statistics, time

    BATCHES, BATCH = 1000, 100
    key = os.urandom(32)
    MESSAGE = (0, 1234, 7, ("gpu",), (8,), (0, 1, 2, 3, 4, 5, 6, 7), None, None, None)  # a no-op Call, packed
    DATA = os.urandom(150)  # what is signed: envelope, header, body
    HEADER = pickle.dumps(MESSAGE, protocol=5)
    MAC = hmac.digest(key, DATA, "sha256")
    R = range(BATCH)
    dumps, loads, digest, same = pickle.dumps, pickle.loads, hmac.digest, hmac.compare_digest


    def sign():
        for _ in R:
            dumps(MESSAGE, 5); digest(key, DATA, "sha256")


    def check():
        for _ in R:
            same(MAC, digest(key, DATA, "sha256")); loads(HEADER)


    def pickle_():
        for _ in R:
            dumps(MESSAGE, 5)


    def hmac_():
        for _ in R:
            digest(key, DATA, "sha256")


    def unpickle():
        for _ in R:
            loads(HEADER)


    def empty():
        for _ in R:
            pass


    def per_message(body):
        ts = []
        for _ in range(BATCHES):
            t0 = time.perf_counter_ns(); body(); ts.append(time.perf_counter_ns() - t0)
        return statistics.median(ts) / BATCH / 1e9


    out = {name: per_message(f) for name, f in
           (("sign", sign), ("check", check), ("pickle", pickle_), ("hmac", hmac_), ("unpickle", unpickle),
            ("loop", empty))}
    out["header_bytes"], out["signed_bytes"] = len(HEADER), len(DATA)
    print(json.dumps(out), flush=True)
    """
)

SPAWN = textwrap.dedent(
    """
    import json, os, shutil, statistics, tempfile, time
    import zmq

    d = tempfile.mkdtemp(prefix="floor-")
    addr = "ipc://" + os.path.join(d, "hello")
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.setsockopt(zmq.LINGER, 0)
    pull.setsockopt(zmq.RCVTIMEO, 10_000)  # (a lost hello fails the run, not hangs it)
    pull.bind(addr)


    def spawn():
        t0 = time.perf_counter()
        pids = []
        for i in range(N):
            pid = os.fork()
            if pid == 0:  # the child: a context, a socket, hello
                c = zmq.Context()
                s = c.socket(zmq.PUSH)
                s.connect(addr)
                s.send(b"hello %d" % i)
                s.close(linger=5000); c.term()
                os._exit(0)
            pids.append(pid)
        try:
            for _ in range(N):
                pull.recv()
        except BaseException:
            for pid in pids:
                os.kill(pid, 9)
            raise
        t = time.perf_counter() - t0
        for pid in pids:
            os.waitpid(pid, 0)
        return t


    ts = [spawn() for _ in range(5)]
    shutil.rmtree(d, ignore_errors=True)
    print(json.dumps({"spawn": statistics.median(ts), "spawns": ts}), flush=True)
    """
)


def rtt(cpu_rounds: int = 0) -> dict | None:
    """`rtt`, `rtt_one` (seconds); with `cpu_rounds`, also `parent_cpu`, `child_cpu` (a list), `wall_per_round`."""
    return measure(sys.executable, f"CPU_ROUNDS = {cpu_rounds}\n" + RTT)


def rtt_unix() -> dict | None:
    """`rtt_unix`, `rtt_unix_one` (seconds): the same round trips over Unix stream sockets (our lanes' kind)."""
    return measure(sys.executable, RTT_UNIX)


def rtt_router() -> float | None:
    """The ROUTER/DEALER echo to N children (benchmarks/actors.py's floor), median, seconds."""
    got = measure(sys.executable, RTT_ROUTER)
    return got["floor"] if got else None


def sign() -> dict | None:
    """Seconds per message: `sign`, `check`, `pickle`, `hmac`, `unpickle` (and `loop`, the empty loop's share)."""
    return measure(sys.executable, SIGN)


def spawn() -> float | None:
    """Seconds from the first of N forks to the N-th hello, median of 5."""
    got = measure(sys.executable, SPAWN)
    return got["spawn"] if got else None


TORCH_IMPORT = textwrap.dedent(
    """
    import json, statistics, subprocess, sys
    code = "import time; t0 = time.perf_counter(); import torch; print(time.perf_counter() - t0)"
    runs = [float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
            for _ in range(3)]
    print(json.dumps({"torch_import": statistics.median(runs)}))
    """
)


def torch_import() -> float | None:
    """Seconds `import torch` takes in a fresh process of this Python, alone (median of 3): what a cold spawn
    of workers that have torch imported pays once at least, wherever it is imported."""
    got = measure(sys.executable, TORCH_IMPORT)
    return got["torch_import"] if got else None


def floors() -> dict:
    """Every floor, in seconds; a floor whose measurement failed is missing (the failure was printed)."""
    out: dict = {}
    got = rtt()
    if got:
        out.update(got)
    unix = rtt_unix()
    if unix:
        out.update(unix)
    router = rtt_router()
    if router is not None:
        out["rtt_router"] = router
    signed = sign()
    if signed:
        out.update({k: signed[k] for k in ("sign", "check", "pickle", "hmac", "unpickle")})
    spawned = spawn()
    if spawned is not None:
        out["spawn"] = spawned
    imported = torch_import()
    if imported is not None:
        out["torch_import"] = imported
    return out


def describe(f: dict) -> str:
    """One line for a run's report: every floor measured."""
    parts = []
    if "rtt" in f:
        parts.append(
            f"round trip to {N} forked processes (XPUB/XSUB down, PUSH/PULL up, as ours) {f['rtt'] * 1e3:.3g} ms"
        )
        parts.append(f"to one of them {f['rtt_one'] * 1e3:.3g} ms")
    if "rtt_unix" in f:
        parts.append(
            f"the same over Unix stream sockets (as our lanes) {f['rtt_unix'] * 1e3:.3g} ms, "
            f"to one {f['rtt_unix_one'] * 1e3:.3g} ms"
        )
    if "rtt_router" in f:
        parts.append(f"ROUTER/DEALER echo to {N} {f['rtt_router'] * 1e3:.3g} ms")
    if "spawn" in f:
        parts.append(f"spawn of {N} bare forks to their hellos {f['spawn'] * 1e3:.3g} ms")
    if "torch_import" in f:
        parts.append(f"`import torch` alone in a fresh process {f['torch_import']:.3g} s")
    if "sign" in f:
        parts.append(f"pickle + sign {f['sign'] * 1e6:.2g} µs, check + unpickle {f['check'] * 1e6:.2g} µs per message")
    return "floor, same run (stdlib + pyzmq only, benchmarks/floor.py): " + ("; ".join(parts) or "failed (above)")


def main() -> None:
    header()
    f = floors()
    print(describe(f))
    for k, v in f.items():
        print(f"  {k}: {v * 1e6:.3f} µs")


if __name__ == "__main__":
    main()
