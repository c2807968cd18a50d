"""The simulator's error against real steps measured once: each round of a `benchmarks/simulator.py --json` run
simulated again, with that round's calibrated profile and the model as it is now, against the real steps that
round measured.

A change to the model is judged on the same real steps as the code before it. On a shared VM the real side moves
by ±10% within a minute, so a fresh run of the benchmark cannot show a change of a few points; replaying one
run's rounds under both versions can. The simulated side moves too: the simulator times the controller's Python
live (about half of a small DDP step), so a replay in a slower spell of the machine reads every simulated step
longer. Compare versions replayed back to back, more than once. `--set` changes one of the profile's figures in
every round (what a calibration change would do) and replays each round as calibrated and with the change in
turns, so that both see the same machine; `--repeats` simulates each round more than once (the median).

    python benchmarks/simulator.py --rounds 5 --json run.json
    python benchmarks/sim_replay.py run.json [more.json ...] [--only NAME] [--repeats 3] [--set handoff=0.00025]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import statistics
import sys
import tempfile

import monarch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from simulator import MOVED, held_steady, programs, sim_side  # noqa: E402  (the benchmark's programs and sides)


def _figure(text: str) -> tuple[str, object]:
    """``name=value`` (the value as JSON: ``0.00025``, ``[[2, 1e-4]]``) -> (name, value)."""
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"--set takes name=value (a profile's figure), got {text!r}")
    try:
        return name, json.loads(value)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"--set {name}: {value!r} is not a JSON value ({e})") from None


Rounds = list[tuple[float, bool]]
"""Each round's error ((simulated - real) / real) and whether the machine held steady then."""


def replay(runs: list[dict], only: str, repeats: int, changes: dict) -> list[tuple[str, Rounds, Rounds | None]]:
    """Per program: its rounds as calibrated, and with `changes` (None without any), replayed in turns."""
    chosen = {k: v for k, v in programs(monarch.Stream("comms")).items() if only in k}
    out = []
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "profile.json")

        def simulate(profile: dict, workers: int, make, train, data) -> float:
            with open(path, "w") as f:
                json.dump(profile, f)
            with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
                return sim_side(path, 1, workers, make, train, data, 20)["step"]

        for name, (make, train, data) in chosen.items():
            plain: Rounds = []
            changed: Rounds = []
            for run in runs:
                for real, calibration in zip(run["real"].get(name, []), run["calibrations"]):
                    steady = held_steady(real)
                    profiles = [calibration["profile"]]
                    if changes:
                        profiles.append({**calibration["profile"], **changes})
                    steps: list[list[float]] = [[] for _ in profiles]
                    for i in range(repeats):  # (in turns, first one first then the other: both see the same machine)
                        for which in range(len(profiles)) if i % 2 == 0 else reversed(range(len(profiles))):
                            steps[which].append(simulate(profiles[which], run["workers"], make, train, data))
                    plain.append((statistics.median(steps[0]) / real["step"] - 1, steady))
                    if changes:
                        changed.append((statistics.median(steps[1]) / real["step"] - 1, steady))
            out.append((name, plain, changed if changes else None))
    return out


def _row(label: str, rounds: Rounds) -> str:
    errors = [e for e, _ in rounds]
    held = [e for e, steady in rounds if steady]
    per_round = " ".join(f"{100 * e:+.0f}{'' if steady else '*'}" for e, steady in rounds)
    return (f"{label:<42} median {100 * statistics.median(errors):+4.0f}  worst {100 * max(errors, key=abs):+4.0f}  "
            f"worst steady {f'{100 * max(held, key=abs):+4.0f}' if held else '   -'}  {per_round}")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("runs", nargs="+", help="files written by benchmarks/simulator.py --json")
    ap.add_argument("--only", default="", help="replay the programs whose name contains this")
    ap.add_argument("--repeats", type=int, default=1, help="simulate each round this many times; the median")
    ap.add_argument("--set", type=_figure, action="append", default=[], help="name=value: a profile figure")
    args = ap.parse_args()
    if args.repeats < 1:
        ap.error(f"--repeats must be 1 or more, got {args.repeats}")
    runs = []
    for p in args.runs:
        with open(p) as f:
            run = json.load(f)
        if not run.get("calibrations"):
            sys.exit(f"{p}: no calibrated profiles in it (a run with --profile has one profile for all rounds)")
        run.setdefault("workers", run["calibrations"][0]["profile"]["measured"].get("workers", 4))
        runs.append(run)
    changes = dict(args.set)
    unknown = set(changes) - set(runs[0]["calibrations"][0]["profile"])
    if unknown:
        sys.exit(f"--set: no such figure in a profile: {', '.join(sorted(unknown))}")
    said = f" with {', '.join(f'{k}={v}' for k, v in changes.items())}" if changes else ""
    print(f"{sum(len(r['calibrations']) for r in runs)} rounds replayed{said}; error per round, %")
    for name, plain, changed in replay(runs, args.only, args.repeats, changes):
        print(_row(name, plain))
        if changed is not None:
            print(_row(f"  {said.strip()}"[:42], changed))
    print(f"(* the machine moved by more than {100 * MOVED:.0f}% during that round, or its steps spread)")


if __name__ == "__main__":
    main()
