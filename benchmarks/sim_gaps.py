"""What compute between collectives costs on a CPU mesh whose workers share the cores (a question the
simulator does not model yet): 16 whole-mesh reduces of 4 and 16 floats (the tutorial's `Net`'s biases
and weights), back to back, then with a few ops between each pair, as a DDP step on one stream has them.

Timed on the workers, per command (through the engine's `around` hook), in rounds that alternate the
cases. Reported per case: the reduces' time, the ops' own time (inside their commands), the span of the
whole batch on a worker (each the median over rounds of the mean over ranks), and how much the span grew
over the back-to-back case per second of the ops' own time.

    python benchmarks/sim_gaps.py [--workers 4] [--rounds 8]
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch

import monarch
from monarch.actor import this_host
from monarch.runtime.remote import RemoteFunction


def _timing(mesh, on: bool):
    """Start timing each command on the workers, or stop and return each rank's (name, start, end) list."""
    fn = RemoteFunction.by_name("monarch.runtime.worker.calibration", "time_ops" if on else "timed_ops", mesh)
    return fn.call_async().result()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=8)
    args = ap.parse_args()
    mesh = this_host().spawn_procs({"gpu": args.workers})
    try:
        with mesh.activate():
            small, big, c = torch.ones(4), torch.ones(16), torch.ones(4)
            m, w, out = torch.rand(96, 96), torch.rand(96, 96) / 96, torch.empty(96, 96)
        monarch.inspect(small)
        cases = {
            "back to back": lambda: None,
            "3 adds between": lambda: [c.add_(1) for _ in range(3)],
            "30 adds between": lambda: [c.add_(1) for _ in range(30)],
            "3 matmuls 96x96 between": lambda: [torch.mm(m, w, out=out) for _ in range(3)],
            "10 matmuls 96x96 between": lambda: [torch.mm(m, w, out=out) for _ in range(10)],
        }
        rows: dict[str, list[tuple[float, float, float]]] = {k: [] for k in cases}
        for _ in range(args.rounds):
            for name, between in cases.items():
                _timing(mesh, True)
                with mesh.activate():
                    for i in range(16):
                        (small if i % 2 == 0 else big).reduce_("gpu", "sum")
                        between()
                monarch.inspect(small)
                recs = [[(s, e, op == "Reduce") for op, s, e in sorted(r, key=lambda c: c[1])]
                        for r in _timing(mesh, False).values()]  # fmt: skip
                rows[name].append(
                    (
                        statistics.mean(sum(e - s for s, e, red in rec if red) for rec in recs),
                        statistics.mean(sum(e - s for s, e, red in rec if not red) for rec in recs),
                        statistics.mean(rec[-1][1] - rec[0][0] for rec in recs),
                    )
                )
    finally:
        mesh.exit()
    med = {k: [statistics.median(r[i] for r in v) for i in range(3)] for k, v in rows.items()}
    base = med["back to back"][2]
    print(f"{os.cpu_count()} cores, {args.workers} CPU workers, torch {torch.__version__}, {args.rounds} rounds")
    print(f"{'case':28} {'reduces ms':>10} {'ops ms':>8} {'span ms':>8}  span growth per ms of ops")
    for name, (red, ops, span) in med.items():
        growth = f"{(span - base) / ops:.1f}" if ops > 0 else "-"
        print(f"{name:28} {red * 1e3:10.1f} {ops * 1e3:8.1f} {span * 1e3:8.1f}  {growth}")


if __name__ == "__main__":
    main()
