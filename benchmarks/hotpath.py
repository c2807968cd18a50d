"""Where a no-op call's time goes (issue 29, item 2): what each step of a message costs, the CPU per call and per op.

    python benchmarks/hotpath.py        # about 10 s on 2 cores

Four parts, each in a fresh process (`run.measure`):

- the steps, each measured alone in one process with our own code (`monarch.runtime.wire.codec`, `protocol`,
  `controller.fnblob`), as `RemoteFunction.start`, the controller's receiver and a worker's `_call` run them for
  a no-op `@monarch.remote` function (defined in `__main__`, so shipped by value, as in a notebook) called on N
  workers: on the controller, once per call, the function's pickle (`fnblob.function_blob`: its fingerprint
  checked, the kept pickle reused), the arguments (`codec.dumps(((), {}))`), `protocol.Call(...)` packed, and
  `codec.encode` (the header pickled, the frame signed: keyed BLAKE2b); then once per reply (N of them)
  `codec.decode` (signature checked, header unpickled), `protocol.unpack` and `codec.loads` of the result; on a
  worker, `codec.decode` of the Call (its topic cut off as `WorkerTransport.recv` does), `protocol.unpack`,
  `codec.loads` of the arguments, and `codec.encode` of the packed `Reply`. Medians over BATCHES batches of
  BATCH, in µs per step;
- the CPU per no-op call on a real mesh: `this_host().spawn_procs({"gpu": N})`, CALLS calls after 200 warm-up,
  the controller's CPU (`time.process_time()`, all its threads) and each worker's (utime + stime of all its
  threads from /proc/<pid>/stat, 10 ms ticks) per call, and each split by thread (main, libzmq's I/O and reaper
  threads, other) from /proc/<pid>/task; run twice, with
  the default reply spin and with `MONARCH_SPIN_US=0` (the caller sleeps on the socket at once);
- the same CPU figures for the floor's processes (benchmarks/floor.py `rtt`, CALLS round trips to N forks over
  the same socket kinds, children that only answer);
- the CPU per tensor-engine op (`x = x + 1` on 4 floats, OPS of them after 500, until the value is back):
  the controller's main thread (`time.thread_time()`) and each worker (/proc), and the wall time per op.
"""

from __future__ import annotations

import os
import sys
import textwrap

import floor  # benchmarks/floor.py
from run import N, header, measure  # benchmarks/run.py, next to this file

BATCHES, BATCH = 300, 100
CALLS = 3000
OPS = 20000

STEPS = textwrap.dedent(
    """
    import json, os, statistics, time
    from monarch.runtime.controller import fnblob
    from monarch.runtime.remote import _by_reference, _pickle
    from monarch.runtime.wire import codec, protocol


    def noop():
        return None


    TOPIC = 16
    R = range(BATCH)
    key = os.urandom(32)
    meshes = {1: (key, [0] * N)}


    def key_of(mesh_id, rank):  # as ControllerTransport._key_of: the key of the claimed sender's mesh
        mesh = meshes.get(mesh_id)
        return mesh[0] if mesh is not None and 0 <= rank < len(mesh[1]) else None


    names, sizes, ranks = ("gpu",), (N,), tuple(range(N))
    args = codec.dumps(((), {}))
    call = protocol.pack(protocol.Call(7, 1, names, sizes, ranks, None, None, None))
    call_frames = codec.encode(key, 1, codec.CONTROLLER, 9, call, args)
    on_wire = os.urandom(TOPIC) + call_frames[0]  # as a worker's XSUB receives it
    NONE = codec.dumps(None)
    reply_frames = codec.encode(key, 1, 3, 9, protocol.pack(protocol.Reply(7, True)), NONE)
    reply_env = codec.decode(key_of, reply_frames)
    call_env = codec.decode(key, [memoryview(on_wire)[TOPIC:]])


    def blob():
        fn = noop
        for _ in R:
            fnblob.function_blob(fn, lambda: _by_reference(fn), lambda obj: _pickle(obj, "function", fn))


    def arguments():
        for _ in R:
            codec.dumps(((), {}))


    def build():
        for _ in R:
            protocol.pack(protocol.Call(7, 1, names, sizes, ranks, None, None, None))


    def encode_call():
        for _ in R:
            codec.encode(key, 1, codec.CONTROLLER, 9, call, args)


    def decode_reply():
        for _ in R:
            codec.decode(key_of, reply_frames)


    def unpack_reply():
        m = reply_env.message
        for _ in R:
            protocol.unpack(m)


    def load_result():
        body = reply_env.body
        for _ in R:
            codec.loads(body, ())


    def decode_call():
        for _ in R:
            codec.decode(key, [memoryview(on_wire)[TOPIC:]])


    def unpack_call():
        m = call_env.message
        for _ in R:
            protocol.unpack(m)


    def load_arguments():
        body = call_env.body
        for _ in R:
            codec.loads(body, ())


    def encode_reply():
        for _ in R:
            codec.encode(key, 1, 3, 9, protocol.pack(protocol.Reply(7, True)), NONE)


    def per_step(body):
        for _ in range(5):
            body()
        ts = []
        for _ in range(BATCHES):
            t0 = time.perf_counter_ns(); body(); ts.append(time.perf_counter_ns() - t0)
        return statistics.median(ts) / BATCH / 1e3


    out = {name: per_step(f) for name, f in (
        ("blob", blob), ("arguments", arguments), ("build", build), ("encode_call", encode_call),
        ("decode_reply", decode_reply), ("unpack_reply", unpack_reply), ("load_result", load_result),
        ("decode_call", decode_call), ("unpack_call", unpack_call), ("load_arguments", load_arguments),
        ("encode_reply", encode_reply),
    )}
    out["call_bytes"], out["reply_bytes"] = len(on_wire), len(reply_frames[0])
    print(json.dumps(out), flush=True)
    """
)

MESH = floor.CPU_OF + textwrap.dedent(
    """
    import json, os, time
    import torch  # (a program with torch: workers set it up at spawn)
    import monarch
    from monarch.actor import this_host


    @monarch.remote
    def noop():
        return None


    @monarch.remote
    def pid():
        return os.getpid()


    mesh = this_host().spawn_procs({"gpu": N})
    pids = pid.on(mesh)().values()
    f = noop.on(mesh)
    for _ in range(200):
        f()
    before, split = [cpu_of(p) for p in pids], [threads_of(p) for p in [os.getpid(), *pids]]
    cpu, t0 = time.process_time(), time.perf_counter()
    for _ in range(CALLS):
        f()
    out = {
        "wall": (time.perf_counter() - t0) / CALLS,
        "controller": (time.process_time() - cpu) / CALLS,
        "workers": [(cpu_of(p) - b) / CALLS for p, b in zip(pids, before)],
    }
    after = [threads_of(p) for p in [os.getpid(), *pids]]
    out["controller_threads"] = threads_delta(after[0], split[0], CALLS)
    each = [threads_delta(a, b, CALLS) for a, b in zip(after[1:], split[1:])]
    out["worker_threads"] = {k: sum(d[k] for d in each) / N for k in each[0]}  # (the mean worker)
    mesh.exit()
    print(json.dumps(out), flush=True)
    """
)

OPS_LOOP = floor.CPU_OF + textwrap.dedent(
    """
    import json, os, time
    import torch
    import monarch
    from monarch.actor import this_host


    @monarch.remote
    def pid():
        return os.getpid()


    mesh = this_host().spawn_procs({"gpu": N})
    pids = pid.on(mesh)().values()


    def loop(n):
        with mesh.activate():
            x = torch.zeros(4)
            for _ in range(n):
                x = x + 1
        monarch.inspect(x)


    loop(500)
    before = [cpu_of(p) for p in pids]
    cpu, t0 = time.thread_time(), time.perf_counter()
    loop(OPS)
    out = {
        "wall": (time.perf_counter() - t0) / OPS,
        "controller": (time.thread_time() - cpu) / OPS,
        "workers": [(cpu_of(p) - b) / OPS for p, b in zip(pids, before)],
    }
    mesh.exit()
    print(json.dumps(out), flush=True)
    """
)

CONTROLLER_STEPS = (
    ("blob", "fnblob.function_blob of the no-op function (fingerprint checked, kept pickle)", 1),
    ("arguments", "codec.dumps(((), {})), the arguments", 1),
    ("build", "protocol.Call(...) + protocol.pack", 1),
    ("encode_call", "codec.encode of the Call (header pickled, signed)", 1),
    ("decode_reply", f"codec.decode of a Reply (signature checked, header unpickled), x {N}", N),
    ("unpack_reply", f"protocol.unpack of a Reply, x {N}", N),
    ("load_result", f"codec.loads of a result (None), x {N}", N),
)
WORKER_STEPS = (
    ("decode_call", "codec.decode of the Call (topic cut off, signature checked, header unpickled)", 1),
    ("unpack_call", "protocol.unpack of the Call", 1),
    ("load_arguments", "codec.loads of the arguments", 1),
    ("encode_reply", "protocol.pack(Reply(...)) + codec.encode", 1),
)


def run_all() -> dict:
    prelude = f"BATCHES = {BATCHES}\nBATCH = {BATCH}\nCALLS = {CALLS}\nOPS = {OPS}\n"
    return {
        "ops": measure(sys.executable, prelude + OPS_LOOP),
        "steps": measure(sys.executable, prelude + STEPS),
        "mesh": measure(sys.executable, prelude + MESH),
        "mesh_nospin": measure(sys.executable, prelude + MESH, dict(os.environ, MONARCH_SPIN_US="0")),
        "floor": floor.rtt(cpu_rounds=CALLS),
        "sign": floor.sign(),
    }


def _us(x: float) -> str:
    return f"{x:.2f}" if x < 10 else f"{x:.0f}"


def report(r: dict) -> None:
    steps = r["steps"]
    if steps:
        print(
            f"per step, our code in isolation (median of {BATCHES} batches of {BATCH}; a no-op call's Call is "
            f"{steps['call_bytes']} bytes with its topic, a Reply {steps['reply_bytes']}):"
        )
        print("| step | µs |\n| --- | --- |")
        for title, rows in (("controller, per call", CONTROLLER_STEPS), ("worker, per call", WORKER_STEPS)):
            total = 0.0
            for key, what, times in rows:
                total += steps[key] * times
                each = f" ({_us(steps[key])} each)" if times > 1 else ""
                print(f"| {what} | {_us(steps[key] * times)}{each} |")
            print(f"| **{title}, these steps together** | **{_us(total)}** |")
    else:
        print("per step: failed (above)")
    sign = r["sign"]
    if sign:
        print(
            f"| floor: pickle + hmac.digest of 150 bytes (stdlib alone) | {_us(sign['sign'] * 1e6)} |\n"
            f"| floor: hmac.digest + compare_digest + pickle.loads | {_us(sign['check'] * 1e6)} |"
        )
    print()
    print(
        f"CPU per call on a real mesh of {N} ({CALLS} no-op calls after 200; utime + stime from /proc, 10 ms ticks; "
        "by thread: main / libzmq's I/O and reaper / other):"
    )
    print("| process | wall per call, µs | CPU per call, µs | by thread, µs |\n| --- | --- | --- | --- |")
    for key, name in (("mesh", "monarch"), ("mesh_nospin", "monarch, MONARCH_SPIN_US=0")):
        m = r[key]
        if not m:
            print(f"| {name} | failed (above) | | |")
            continue
        print(
            f"| {name}: controller, all threads | {_us(m['wall'] * 1e6)} | {_us(m['controller'] * 1e6)} | "
            f"{_split(m['controller_threads'])} |"
        )
        print(
            f"| {name}: each worker (min-max; all {N}) | | {_spread(m['workers'])} | {_split(m['worker_threads'])} (the mean worker) |"
        )
    f = r["floor"]
    if f and "child_cpu" in f:
        print(
            f"| floor (raw pyzmq, same socket kinds): parent | {_us(f['wall_per_round'] * 1e6)} | "
            f"{_us(f['parent_cpu'] * 1e6)} | {_split(f['parent_threads'])} |"
        )
        print(
            f"| floor: each child (min-max; all {N}) | | {_spread(f['child_cpu'])} | {_split(f['child_threads'])} (the mean child) |"
        )
        print(f"(the floor's round trip in the same run, median of 500: {f['rtt'] * 1e6:.0f} µs)")
    else:
        print("| floor | failed (above) | | |")
    o = r["ops"]
    print()
    if o:
        print(
            f"CPU per tensor-engine op on a real mesh of {N} (`x = x + 1` x {OPS} after 500, issued and run: "
            f"{_us(o['wall'] * 1e6)} µs per op, {1 / o['wall']:,.0f} per second): the controller's main thread "
            f"{_us(o['controller'] * 1e6)} µs; each worker {_spread(o['workers'])} µs (utime + stime, 10 ms ticks)"
        )
    else:
        print("CPU per tensor-engine op: failed (above)")


def _spread(cpu: list[float]) -> str:
    return f"{_us(min(cpu) * 1e6)}-{_us(max(cpu) * 1e6)} ({_us(sum(cpu) * 1e6)})"


def _split(threads: dict) -> str:
    return " / ".join(_us(threads[k] * 1e6) for k in ("main", "zmq", "other"))


def main() -> None:
    header()
    report(run_all())


if __name__ == "__main__":
    main()
