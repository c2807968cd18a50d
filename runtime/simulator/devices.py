"""What the simulator knows of a device: peak rates from datasheets, or a profile measured on this machine.

A `DeviceProfile` holds the numbers the cost model needs. The table's GPU entries come from NVIDIA's
datasheets (SXM parts, dense math) and typical interconnects: NVLink within a host, one InfiniBand port
per GPU across hosts. `monarch.Simulator.calibrate()` measures the local device and saves a profile as
JSON; pass its path (or ``device="local"``) to use it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
from dataclasses import dataclass, field
from pathlib import Path

from monarch.runtime.common import config

STEERING = (
    "op_overhead", "op_extra", "dispatch", "decode", "intra_latency", "reduce_floor", "reduce_overhead",
    "handoff", "after_reduce", "beside_reduce", "wire_latency", "fetch_latency", "controller_slowdown",
    "controller_load", "compute_contention", "flops", "mem_bw", "reduce_in_step", "cold_ops", "side_wait",
    "reduce_in_step_loaded",
)  # fmt: skip
"""The figures a simulated step's time follows (`op_extra`: the sum over the sample step's ops; `flops`:
float32's; `reduce_in_step`, `reduce_in_step_loaded`, `cold_ops`: their extras' sums), whose spread across passes `calibrate()` keeps."""
STALLED = 10.0
"""A `comm_contention` this high or higher: a collective beside compute made next to no progress (a worker's
stream thread got no core while its main thread computed); the simulator then begins a side stream's command
queued beside a compute op only once that op ends (`model.SimWorkers._postpone`), and shares the cores from
there."""
NOISY = 0.15
"""A calibration whose passes' figures simulate a sample training step this far apart (max - min over the
median) names the machine too noisy to calibrate."""


@dataclass(frozen=True)
class DeviceProfile:
    """Rates and overheads of one kind of worker (a GPU, or a CPU worker of this machine)."""

    name: str
    """``h100``, ``cpu``, or what a calibration called it."""
    kind: str
    """``gpu`` or ``cpu``: on a CPU worker the main stream runs on the thread that takes commands, so a
    wait on it holds back every later command; on a GPU a stream is a queue the thread only feeds."""
    flops: dict[str, float]
    """Peak FLOP/s per dtype name (``float32``, ``bfloat16``, ...); ``default`` for the rest."""
    mem_bw: float
    """Bytes per second an elementwise op moves (read plus write)."""
    efficiency: float
    """The share of peak FLOP/s a large matmul reaches."""
    op_overhead: float
    """Seconds every op costs on its stream beyond its FLOPs and bytes (a kernel launch, ATen's dispatch);
    calibrated as a tiny ``add_`` inside a training step."""
    dispatch: float
    """Seconds the worker's command thread spends per command (receiving it, finding its tensors)."""
    intra_latency: float
    """Seconds per step of a collective between workers of one host."""
    intra_bw: float
    """Bytes per second per worker between workers of one host (NVLink, shared memory)."""
    inter_latency: float
    """Seconds per step of a collective that crosses hosts."""
    inter_bw: float
    """Bytes per second per worker across hosts (its network port)."""
    wire_latency: float = 50e-6
    """Seconds from the controller to a worker, once (a batch's arrival; a fetched value's return too,
    unless `fetch_latency` is set)."""
    fetch_latency: float = 0.0
    """Seconds from a value's being ready on a worker to the controller's having it (0: `wire_latency`);
    measured by `calibrate()` at the end of a training step, when the cores are busy."""
    controller_slowdown: float = 1.0
    """How much slower the controller's Python runs while the workers compute: above 1 where they share its
    cores (CPU workers on the notebook's machine); measured by `calibrate()`."""
    controller_load: float = 1.0
    """How many times longer the workers' work takes while the controller runs the program's Python (issuing
    commands, autograd): above 1 where it takes its share of their cores (CPU workers on the notebook's
    machine; ranks of the first host); measured by `calibrate()`."""
    compute_contention: float = 1.0
    """How many times longer compute takes while a side stream of its worker runs a collective: on a CPU
    they share cores (the main thread against gloo's threads); measured by `calibrate()`."""
    comm_contention: float = 1.0
    """How many times longer a collective takes while its worker's main stream computes (on a CPU a ring
    waits for every worker's turn on the cores); measured by `calibrate()`."""
    side_wait: float = 0.0
    """Where a collective beside compute stalls (`STALLED`): seconds a CPU worker's side stream thread, given
    a command while its main thread computes, waits for a core before it begins it (the scheduler's turn on
    cores the host's threads outnumber: no wake-up preempts a `SCHED_BATCH` thread); it begins sooner if main
    pauses longer than a wake. Sets how much of a step's reduces overlap its backward. 0: at the end of the op
    main was running; measured by `calibrate()`."""
    handoff: float = 0.0
    """Seconds a CPU worker's main thread loses each time it waits for a side stream (a borrow's drop): it
    is woken, then wakes that stream's thread with the next command. Long on busy cores; measured by
    `calibrate()`."""
    reduce_floor: float = 0.0
    """Seconds a whole-host all-reduce of one element takes on CPU workers (0: not measured). gloo's ring cuts
    a tensor into two segments per rank and skips empty ones, so a tensor of fewer elements than that costs
    less than the ring's full latency (a 4-float bias among 4 workers: about half); measured by `calibrate()`."""
    op_extra: dict = field(default_factory=dict)
    """Seconds an op costs beyond `op_overhead`, by its name (``aten::mm``, ``aten::mul.Tensor``): what the op
    takes on tiny tensors less what a tiny ``add_`` takes, negative for views (cheaper than an ``add_``).
    ATen's dispatch differs from op to op (a reduction sets up more than an add; on a GPU some ops launch
    several kernels); measured by `calibrate()` on a sample training step, ops it did not meet cost none."""
    reduce_overhead: float = 0.0
    """Seconds a reduce costs its worker's thread beyond the collective (the engine's failure flag, the
    process group's own work; on a GPU the wait for the flag): what a reduce over one rank takes; measured
    by `calibrate()` (0: part of the latency)."""
    after_reduce: float = 0.0
    """Seconds a CPU worker's command thread loses in the ops after a reduce it ran itself (its caches and
    the cores' turn are gone while it waited on the ring: the first few ops after a reduce take several
    times as long as the same ops elsewhere in a step); measured by `calibrate()`."""
    beside_reduce: float = 0.0
    """Seconds a CPU worker's main thread loses in its ops while a reduce runs on a side stream of its worker
    (the threads take turns on the cores and on Python's lock), per reduce: the first op on main after the
    reduce was issued pays it, unless main waited for the reduce's drop first (then `handoff` is what the
    wait cost); measured by `calibrate()`."""
    reduce_in_step: list = field(default_factory=list)
    """``[[compute, extra], ...]`` (seconds, compute ascending): what a collective of CPU workers costs beyond
    its back-to-back time when each of its ranks computed for ``compute`` seconds since its last collective,
    as a step's gradients do (workers sharing cores arrive in turns, and gather from sleep and cold caches:
    the longer the compute, the more it costs); interpolated between the points, none after no compute;
    measured by `calibrate()` (empty: none)."""
    reduce_in_step_loaded: list = field(default_factory=list)
    """`reduce_in_step` measured with another process computing on the host meanwhile, as the controller runs a
    step's Python (autograd, issuing) beside its workers: the core it takes slows some ranks more than others,
    so they reach a collective further apart (on 2 cores, 4 workers: about 2 ms after 4 ms of compute,
    against 0.3 with the host otherwise idle). The model blends it in by the controller's CPU share since the
    ranks' last collective; measured by `calibrate()` (empty: `reduce_in_step` alone)."""
    cold_ops: list = field(default_factory=list)
    """``[[bytes, extra], ...]`` (bytes ascending): seconds an op on a CPU worker costs beyond its figures when
    the ops just before it (`model.COLD_WINDOW` of them) moved ``bytes`` in all: more than the caches hold
    (a step's matmuls and activations), and the interpreter's and ATen's working set is gone, which each
    kind of op pays to bring back (on 4 workers of 2 cores about 1, 3, 12 and 30 µs an op after 0.5, 1, 2
    and 8 MB); interpolated between the points, none after none; measured by `calibrate()` (empty: none)."""
    decode: float = 0.0
    """Seconds per command a worker spends decoding a batch when it arrives, before running its first
    command (0: part of `dispatch`); measured by `calibrate()`."""
    memory: int = 0
    """Bytes of device memory (0: not known); a rank that needs more is flagged."""
    alloc_round: int = 1
    """Allocations are rounded up to a multiple of this many bytes (512 on CUDA's caching allocator)."""
    source: str = "datasheet"
    """Where the numbers come from: ``datasheet``, or ``calibrated on HOST, DATE``."""
    measured: dict = field(default_factory=dict)
    """What a calibration measured, as it measured it (for people)."""
    spread: dict = field(default_factory=dict)
    """Per calibrated figure, how far the calibration's passes spread: (max - min) / median (empty: one pass,
    or a datasheet's). What the profile can be trusted to: two calibrations in a row agree within it."""

    def peak(self, dtype_name: str) -> float:
        return self.flops.get(dtype_name, self.flops.get("default", 1e12))

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=1)

    def describe(self) -> str:
        return f"{self.name} ({self.source}{self.trust()})"

    def trust(self) -> str:
        """``; its passes agree within 6% on a step`` or, when they did not, a warning; "" for one pass or a
        datasheet."""
        step = self.spread.get("step")
        if step is None:
            return ""
        if step > NOISY:
            return f"; NOISY: its passes simulate a step {100 * step:.0f}% apart, calibrate again on a quiet machine"
        return f"; its passes agree within {100 * step:.0f}% on a step"


_TF = 1e12
_GB = 1e9
DEVICES: dict[str, DeviceProfile] = {
    "a100": DeviceProfile(
        name="a100",
        kind="gpu",
        flops={
            "float32": 19.5 * _TF,
            "tfloat32": 156 * _TF,
            "bfloat16": 312 * _TF,
            "float16": 312 * _TF,
            "float64": 9.7 * _TF,
            "int8": 624 * _TF,
            "default": 19.5 * _TF,
        },  # fmt: skip
        mem_bw=2039 * _GB,
        efficiency=0.75,
        op_overhead=5e-6,
        dispatch=15e-6,
        intra_latency=8e-6,
        intra_bw=240 * _GB,
        inter_latency=12e-6,
        inter_bw=23 * _GB,
        memory=80 * 2**30,
        alloc_round=512,
    ),
    "h100": DeviceProfile(
        name="h100",
        kind="gpu",
        flops={
            "float32": 67 * _TF,
            "tfloat32": 495 * _TF,
            "bfloat16": 989 * _TF,
            "float16": 989 * _TF,
            "float8_e4m3fn": 1979 * _TF,
            "float64": 34 * _TF,
            "int8": 1979 * _TF,
            "default": 67 * _TF,
        },  # fmt: skip
        mem_bw=3350 * _GB,
        efficiency=0.7,
        op_overhead=4e-6,
        dispatch=12e-6,
        intra_latency=6e-6,
        intra_bw=370 * _GB,
        inter_latency=10e-6,
        inter_bw=46 * _GB,
        memory=80 * 2**30,
        alloc_round=512,
    ),
    "cpu": DeviceProfile(
        name="cpu",
        kind="cpu",
        flops={"float32": 50e9, "float64": 25e9, "bfloat16": 10e9, "float16": 5e9, "default": 50e9},
        mem_bw=10 * _GB,
        efficiency=0.8,
        op_overhead=10e-6,
        dispatch=25e-6,
        intra_latency=60e-6,
        intra_bw=2 * _GB,
        inter_latency=120e-6,
        inter_bw=1 * _GB,
        source="a typical core, not measured: monarch.Simulator.calibrate() measures this machine",
    ),
}
DEVICES["h200"] = dataclasses.replace(DEVICES["h100"], name="h200", mem_bw=4800 * _GB, memory=141 * 2**30)
DEVICES = {k: DEVICES[k] for k in ("a100", "h100", "h200", "cpu")}
"""Devices by name. GPU rates: NVIDIA's datasheets (SXM, dense); NVLink and InfiniBand bandwidth per GPU
as a collective sees it (bus bandwidth), a little under the links' peak."""


def profile_dir() -> Path:
    """Where `calibrate()` saves profiles (`config.sim_profiles_dir`, ``MONARCH_SIM_PROFILES``)."""
    return config.sim_profiles_dir()


def local_profile_path() -> Path:
    return profile_dir() / f"{socket.gethostname()}.json"


def load(path: str | os.PathLike) -> DeviceProfile:
    """A profile saved by `calibrate()`; ValueError naming the file if it is not one."""
    p = Path(path)
    try:
        data = json.loads(p.read_text())
        fields = dataclasses.fields(DeviceProfile)
        required = {
            f.name for f in fields if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        }
        missing = required - set(data)
        if missing:
            raise ValueError(f"missing {', '.join(sorted(missing))}")
        return DeviceProfile(**{k: v for k, v in data.items() if k in {f.name for f in fields}})
    except (OSError, ValueError, TypeError, AttributeError) as e:  # (AttributeError: JSON that is no object)
        raise ValueError(
            f"Simulator: {p} is not a device profile saved by monarch.Simulator.calibrate(): {e}"
        ) from None


def resolve(device: str | DeviceProfile) -> DeviceProfile:
    """`device` as a profile: a table name, ``"local"`` (this machine's calibration), or a profile's path."""
    if isinstance(device, DeviceProfile):
        return device
    allowed = (
        f"{', '.join(DEVICES)}, 'local' (this machine, after monarch.Simulator.calibrate()), or a profile's .json path"
    )
    if not isinstance(device, str | os.PathLike):
        raise ValueError(f"Simulator: device must be a name, got {device!r}; use one of {allowed}")
    name = str(device)
    if name.lower() in DEVICES:
        return DEVICES[name.lower()]
    if name == "local":
        path = local_profile_path()
        if not path.exists():
            raise ValueError(
                f"Simulator: device='local' needs a calibration of this machine, and {path} does not exist; "
                "run monarch.Simulator.calibrate() first"
            )
        return load(path)
    if name.endswith(".json"):
        if not Path(name).exists():
            raise ValueError(f"Simulator: device profile {name} does not exist")
        return load(name)
    raise ValueError(f"Simulator: unknown device {name!r}; use one of {allowed}")
