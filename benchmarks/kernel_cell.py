"""Notebook cell latency through real kernels: a trivial `%%mesh gpu=8` cell vs ipyparallel's `%%px`.

    python benchmarks/kernel_cell.py [--n 200]

monarch: the `monarch` kernel; one warm-up `%%mesh gpu=8` cell spawns the mesh, then N timed runs of
`%%mesh gpu=8` / `x = 1`. ipyparallel: a `python3` ipykernel that first starts a cluster of 8 engines
(`ipp.Cluster(n=8)`, `rc.activate()`), one warm-up `%%px` cell, then N timed runs of `%%px` / `x = 1`.
Each cell is timed the same way: from sending its execute_request to the kernel's `status: idle` for
that request on iopub. Ratios are peer / monarch (higher is better). The kernels, the cluster and every
process they started are stopped at the end (checked in /proc).
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import tempfile
import time
import uuid

from run import before_env, ensure_ipyparallel, header, print_rows  # benchmarks/run.py, next to this file

N_CELLS = 200
WORKERS = 8


def run_cell(kc, code: str, timeout: float = 60) -> float:
    """Run `code`; seconds from sending the execute_request to `status: idle` for it on iopub."""
    t0 = time.perf_counter()
    msg_id = kc.execute(code)
    while True:
        msg = kc.get_iopub_msg(timeout=timeout)
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
            dt = time.perf_counter() - t0
            break
    while True:
        reply = kc.get_shell_msg(timeout=timeout)
        if reply["parent_header"].get("msg_id") == msg_id:
            break
    if reply["content"]["status"] != "ok":
        c = reply["content"]
        raise RuntimeError(f"cell failed: {code!r}: {c.get('ename')}: {c.get('evalue')}")
    return dt


def _procs() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, start time) for every process in /proc."""
    out = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                out[int(d)] = (int(fields[1]), fields[19])
            except (OSError, IndexError):
                pass
    return out


def _environ_has(pid: int, marker: bytes) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return marker in f.read().split(b"\0")
    except OSError:
        return False


def _ours(root: int, marker: bytes | None = None) -> dict[int, str]:
    """Processes under `root` (by parent links), plus any whose environment holds `marker`: pid -> start time."""
    procs = _procs()
    mine = {root} if root in procs else set()
    grew = True
    while grew:
        new = {p for p, (pp, _) in procs.items() if pp in mine and p not in mine}
        grew = bool(new)
        mine |= new
    if marker:
        mine |= {p for p in procs if _environ_has(p, marker)}
    return {p: procs[p][1] for p in mine}


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()[:100]
    except OSError:
        return "?"


def _gone(before: dict[int, str], marker: bytes | None, wait: float = 15) -> list[str]:
    """Wait until none of `before` (same pid and start time) nor any `marker` process lives; kill what remains."""
    deadline = time.monotonic() + wait
    while True:
        procs = _procs()
        left = [p for p, st in before.items() if p in procs and procs[p][1] == st]
        if marker:
            left += [p for p in procs if p not in left and _environ_has(p, marker)]
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    names = [f"{p} {_cmdline(p)}" for p in left]
    for p in left:
        try:
            os.kill(p, signal.SIGKILL)
        except OSError:
            pass
    return names


def _side(
    kernel_name: str, setup: list[str], cell: str, teardown: str | None, n: int, marker: bytes | None, env=None
) -> dict:
    from jupyter_client.manager import start_new_kernel

    # run outside the checkout, so that `import monarch` means the installed package
    km, kc = start_new_kernel(
        kernel_name=kernel_name, startup_timeout=120, cwd=tempfile.gettempdir(), **({"env": env} if env else {})
    )
    before: dict[int, str] = {}
    try:
        first = sum(run_cell(kc, code, timeout=300) for code in setup)  # starts the workers, runs the first cell
        ts = [run_cell(kc, cell) for _ in range(n)]
        before = _ours(km.provisioner.process.pid, marker)
        if teardown:
            run_cell(kc, teardown, timeout=120)
    finally:
        before = before or _ours(km.provisioner.process.pid, marker)
        kc.stop_channels()
        km.shutdown_kernel()
    leftover = _gone(before, marker)
    return {"first": first, "median": statistics.median(ts), "p90": statistics.quantiles(ts, n=10)[-1],
            "leftover": leftover}  # fmt: skip


def measure(n: int = N_CELLS, before: str | None = None) -> dict:
    """Both sides' figures (seconds): first (start of the workers + first cell), median, p90; leftover processes."""
    ensure_ipyparallel()
    cid = f"kernel-cell-bench-{uuid.uuid4().hex[:8]}"
    mesh = f"%%mesh gpu={WORKERS}\nx = 1"
    start_ipp = (
        f"import logging, ipyparallel as ipp\n"
        f"cluster = ipp.Cluster(n={WORKERS}, cluster_id={cid!r}, log_level=logging.ERROR)\n"
        f"rc = cluster.start_and_connect_sync()\n"
        f"rc.wait_for_engines({WORKERS}, timeout=120)\n"
        f"rc.activate()"
    )
    stop_ipp = "rc.close()\ncluster.stop_cluster_sync()"
    if before:
        from run import abba

        now, earlier = abba(
            lambda: _side("monarch", [mesh], mesh, None, n, None),
            lambda: _side("monarch", [mesh], mesh, None, n, None, before_env(before)),
        )
        results = {"monarch": now, "monarch before": earlier}
    else:
        results = {"monarch": _side("monarch", [mesh], mesh, None, n, None)}
    results["ipyparallel"] = _side("python3", [start_ipp, "%%px\nx = 1"], "%%px\nx = 1", stop_ipp, n,
                                   f"IPP_CLUSTER_ID={cid}".encode())  # fmt: skip
    return results


def report(results: dict, n: int) -> None:
    rows = [
        (f"trivial cell on {WORKERS} workers, execute_request to idle (median of {n})", "median", "ms", 1e3),
        (f"trivial cell on {WORKERS} workers, execute_request to idle (p90 of {n})", "p90", "ms", 1e3),
        (f"first cell, {WORKERS} workers started from the kernel (one-time)", "first", "s", 1),
    ]
    print_rows(results, rows)
    for peer, res in results.items():
        if res["leftover"]:
            print(f"  ({peer}: {len(res['leftover'])} processes outlived shutdown, killed: {res['leftover']})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=N_CELLS, help="timed cells per side (default %(default)s)")
    args = ap.parse_args()
    header()
    t0 = time.perf_counter()
    results = measure(args.n)
    report(results, args.n)
    print(f"(whole run {time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
