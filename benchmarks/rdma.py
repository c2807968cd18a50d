"""`RDMABuffer` bandwidth against a memcpy floor: `read_into` and `write_from` between two worker processes.

    python benchmarks/rdma.py [--reps 10] [--sizes 1,16,64]

One owner process (an actor holding a uint8 tensor of each size and a buffer over it) and two reader
processes, each a mesh of its own on this machine: one reads through shared memory (the default path on one
host), one has ``MONARCH_RDMA_PATH=transport`` (the path a reader on another host takes: a signed message to
the owner's inbox, the bytes in the answer). Inside each reader's endpoint: `read_into` of the whole buffer
into a local tensor, then `write_from` of a local tensor into it, each `--reps` times after 2 warm-ups, each
waited for (`.get()`), the median taken. The floor: a plain `dst.copy_(src)` of the same size between two
tensors of the reader's own process (the same warm-ups and median), measured in the same run.

Each row: the median time, the bandwidth (bytes / time), the floor's, and ours as a share of the floor's
bandwidth (1.0 = as fast as a copy in one process). The controller's reads (shared memory and the transport,
the latter a live-function call on the owner's rank) are timed the same way from the script.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

from monarch.actor import Actor, endpoint, this_host
from monarch.rdma import RDMABuffer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from run import header  # noqa: E402  (benchmarks/run.py, next to this file)

WARMUPS = 2


def _median(fn, reps: int) -> float:
    for _ in range(WARMUPS):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


class Owner(Actor):
    def __init__(self, sizes_mb: list[int]) -> None:
        self.data = {mb: torch.randint(0, 255, (mb << 20,), dtype=torch.uint8) for mb in sizes_mb}
        self.bufs = {mb: RDMABuffer(t) for mb, t in self.data.items()}

    @endpoint
    def buffers(self) -> dict[int, RDMABuffer]:
        return self.bufs


class Reader(Actor):
    @endpoint
    def measure(self, buf: RDMABuffer, reps: int) -> dict[str, float]:
        n = buf.size()
        dst = torch.empty(n, dtype=torch.uint8)
        src = torch.randint(0, 255, (n,), dtype=torch.uint8)
        got = {
            "read": _median(lambda: buf.read_into(dst).get(), reps),
            "write": _median(lambda: buf.write_from(src).get(), reps),
            "floor": _median(lambda: dst.copy_(src), reps),
        }
        buf.read_into(dst).get()
        assert torch.equal(dst, src), "the bytes written are not the bytes read back"
        return got


def _spawn(env: dict[str, str]):
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        return this_host().spawn_procs({"gpu": 1})
    finally:
        for k, v in old.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)


def _row(label: str, seconds: float, floor: float, nbytes: int) -> str:
    bw, floor_bw = nbytes / seconds / 1e9, nbytes / floor / 1e9
    return f"| {label} | {seconds * 1e3:.3g} ms | {bw:.3g} GB/s | {floor_bw:.3g} GB/s | {bw / floor_bw:.2f} |"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--sizes", default="1,16,64", help="buffer sizes in MB (comma-separated)")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    header()
    owner_procs = _spawn({})
    shm_procs = _spawn({})
    transport_procs = _spawn({"MONARCH_RDMA_PATH": "transport"})
    try:
        owner = owner_procs.spawn("owner", Owner, sizes)
        readers = {
            "shared memory": shm_procs.spawn("reader", Reader),
            "transport": transport_procs.spawn("reader", Reader),
        }
        bufs = owner.buffers.call_one().get()
        print("\n| size, op, path (reader: a worker process) | time | bandwidth | floor (torch copy) | ÷ floor |")
        print("| --- | --- | --- | --- | --- |")
        for mb in sizes:
            for path, reader in readers.items():
                got = reader.measure.call_one(bufs[mb], args.reps).get()
                for op in ("read", "write"):
                    name = "read_into" if op == "read" else "write_from"
                    print(_row(f"{mb} MB {name}, {path}", got[op], got["floor"], mb << 20), flush=True)
        print("\n| size, path (reader: the controller) | time | bandwidth | floor (torch copy here) | ÷ floor |")
        print("| --- | --- | --- | --- | --- |")
        for mb in sizes:
            dst, src = torch.empty(mb << 20, dtype=torch.uint8), torch.empty(mb << 20, dtype=torch.uint8)
            floor = _median(lambda dst=dst, src=src: dst.copy_(src), args.reps)
            for path in ("shared memory", "transport"):
                os.environ["MONARCH_RDMA_PATH"] = "auto" if path == "shared memory" else "transport"
                t = _median(lambda mb=mb, dst=dst: bufs[mb].read_into(dst).get(), args.reps)
                print(_row(f"{mb} MB read_into, {path}", t, floor, mb << 20), flush=True)
            os.environ.pop("MONARCH_RDMA_PATH")
    finally:
        for m in (owner_procs, shm_procs, transport_procs):
            m.exit()


if __name__ == "__main__":
    main()
