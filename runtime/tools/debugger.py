"""`monarch debug` (or `python -m monarch debug`): the terminal client of a script's debugger.

A script whose workers hit `breakpoint()` keeps their pdb prompts for this client
(`controller/debugger.py`); so does a rank whose code, debugged, then raised (pdb post-mortem). It finds
the script's socket (`wire/debug.py`), then reads commands at a ``monarch_dbg>`` prompt, Monarch's
commands in Monarch's forms (``attach debugee 13``, ``cast debugee ranks(2:7:2) s``) and shorter ones:
`list` the paused ranks, `attach` to one (each line typed goes to its pdb, its answer and next prompt
come back, `detach` returns), `cast` one pdb command to several ranks (each rank's output labelled),
`continue` them all. Leaving (`quit`, end of input) lets go of the script: its ranks stay paused for the
next client. Mistakes get a message that says what is allowed, never a traceback. Nothing here imports
torch or zmq: the client starts in a blink.
"""

from __future__ import annotations

import argparse
import os
import select
import socket
import sys
from typing import Any

from monarch.runtime.wire import debug as debugwire

PROMPT = "monarch_dbg> "
COMMANDS = "list, attach [<actor>] <rank>, cast [<actor>] <ranks> <pdb command>, continue, help, quit"
HELP = f"""\
commands (Monarch's, with their short forms):
  list (l)                          the paused ranks: rank, coordinates, the call each runs, where each is
                                    paused (a post-mortem, after an error, says so), its prompt
  attach (a) [<actor>] <rank>       talk to one rank's pdb, e.g. attach debugee 13 or attach 13;
                                    'detach' (or Ctrl-D) comes back here; [mesh=<id>] when two meshes have it
  cast [<actor>] <ranks> <pdb cmd>  send one pdb command to several paused ranks and show their output, e.g.
                                    cast debugee ranks(0,1) n      cast ranks(2:7:2) s      cast * p x
                                    <ranks>: ranks(3)  ranks(1,3)  ranks(1:3)  ranks(2:7:2)  ranks(gpu=0:2)
                                    ranks(host=2:4, gpu=1:3)  ranks(gpu=(1,3))  *   (a:b leaves b out, as
                                    in Python)
  continue (c)                      clear every breakpoint set with 'b' and continue every paused rank (a
                                    post-mortem's error then goes on to the caller)
  help (h)                          this text
  quit (q)                          leave; paused ranks stay paused for the next client
(commands: {COMMANDS})"""


class Closed(Exception):
    """The script closed the connection (it ended, or another client is attached)."""


class UsageError(ValueError):
    """Something typed that cannot be done; the message says what is allowed."""


class Connection:
    """The socket to one script's debug server: requests out, messages (JSON lines) in."""

    def __init__(self, path: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(path)
        if debugwire.peer_uid(self.sock) != os.getuid():  # (the directory is ours; this is a second lock)
            self.sock.close()
            raise PermissionError(f"{path} is served by another user: not talking to it")
        self.reader = debugwire.LineReader(self.sock)
        self.queue: list[dict[str, Any]] = []

    def send(self, message: dict[str, Any]) -> None:
        try:
            self.sock.sendall(debugwire.encode(message))
        except OSError as e:
            raise Closed(str(e)) from None

    def next(self, timeout: float | None = None) -> dict[str, Any] | None:
        """The next message; None if none came within `timeout` seconds; `Closed` if the script went away."""
        while not self.queue:
            if self.reader.closed:
                raise Closed("the script closed the connection")
            ready, _, _ = select.select([self.sock], [], [], timeout)
            if not ready:
                return None
            self.queue += self.reader.read()
        return self.queue.pop(0)

    def ask(self, message: dict[str, Any], answer: str) -> dict[str, Any]:
        """Send a request and return its answer (the message whose ``ev`` is `answer`)."""
        self.send(message)
        while True:
            got = self.next()
            if got is not None and got.get("ev") == answer:
                return got
            if got is not None and got.get("ev") == "error":
                raise UsageError(got.get("message", "the script refused"))


# -- choosing ranks ------------------------------------------------------------------------------------
Span = tuple[int, int | None, int]
"""Ranks or coordinates from `start` up to `stop` (left out; None: no end), every `step`."""


def _span(text: str, what: str) -> Span:
    """``"3"`` -> (3, 4, 1); ``"1:3"`` -> (1, 3, 1); ``"2:"`` -> (2, None, 1); ``":2"`` -> (0, 2, 1);
    ``"2:7:2"`` -> (2, 7, 2), as Python slices them."""
    text = text.strip()
    try:
        if ":" not in text:
            n = int(text)
            return n, n + 1, 1
        parts = text.split(":")
        if len(parts) > 3:
            raise ValueError
        start = int(parts[0]) if parts[0].strip() else 0
        stop = int(parts[1]) if parts[1].strip() else None
        step = int(parts[2]) if len(parts) == 3 and parts[2].strip() else 1
    except ValueError:
        raise UsageError(f"{what}: {text!r} is not a number or a range a:b or a:b:step") from None
    if step < 1:
        raise UsageError(f"{what}: {text!r} has step {step}; a step is 1 or more")
    return start, stop, step


def _inside(value: int, span: Span) -> bool:
    start, stop, step = span
    return start <= value and (stop is None or value < stop) and (value - start) % step == 0


def _split_top(text: str, what: str) -> list[str]:
    """`text` split at the commas outside parentheses (``host=0, gpu=(1,3)`` -> two items)."""
    items, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
            if depth < 0:
                raise UsageError(f"{what}: a ')' closes nothing")
        elif ch == "," and depth == 0:
            items.append(text[start:i].strip())
            start = i + 1
    if depth:
        raise UsageError(f"{what}: a '(' is not closed")
    items.append(text[start:].strip())
    return [i for i in items if i]


def _spans(value: str, what: str) -> list[Span]:
    """A dimension's value: ``2``, ``1:3``, ``0:8:2``, or a list ``(1,3)``."""
    value = value.strip()
    if value.startswith("(") and value.endswith(")"):
        inner = _split_top(value[1:-1], what)
        if not inner:
            raise UsageError(f"{what}: () lists no value")
        return [_span(v, what) for v in inner]
    return [_span(value, what)]


def select_ranks(spec: str, paused: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The paused ranks `spec` names: ``*``, ``ranks(1,3)``, ``ranks(1:3)``, ``ranks(2:7:2)``,
    ``ranks(gpu=0:2)``, ``ranks(host=0, gpu=(1,3))``. A rank named on its own that is not paused, or a
    selection that matches no paused rank, is a `UsageError` (nothing is sent)."""
    spec = spec.strip()
    if spec == "*":
        return list(paused)
    if not (spec.startswith("ranks(") and spec.endswith(")")):
        raise UsageError(f"{spec!r} names no ranks; use ranks(1,3), ranks(1:3), ranks(2:7:2), ranks(gpu=0:2) or *")
    items = _split_top(spec[len("ranks(") : -1], spec)
    if not items:
        raise UsageError("ranks() is empty; e.g. ranks(1,3), ranks(1:3), ranks(gpu=0:2)")
    if any("=" in i for i in items):
        if not all("=" in i for i in items):
            raise UsageError(
                f"{spec}: give either rank numbers or dim=value, not both (a dimension's list goes in parentheses: "
                "gpu=(1,3))"
            )
        dims = {}
        for item in items:
            name, _, value = item.partition("=")
            dims[name.strip()] = _spans(value, spec)
        known = {d for e in paused for d in e["coords"]}
        unknown = sorted(set(dims) - known) if paused else []
        if unknown:
            raise UsageError(f"{spec}: no dimension {', '.join(unknown)}; the mesh has {', '.join(sorted(known))}")
        chosen = [
            e for e in paused if all(any(_inside(e["coords"].get(d, -1), s) for s in ss) for d, ss in dims.items())
        ]
    else:
        spans = [_span(i, spec) for i in items]
        for item, span in zip(items, spans):
            if ":" not in item and not any(e["rank"] == span[0] for e in paused):
                raise UsageError(f"rank {span[0]} is not paused; {_paused_list(paused)}")
        chosen = [e for e in paused if any(_inside(e["rank"], s) for s in spans)]
    if not chosen:
        raise UsageError(f"no paused rank matches {spec}; {_paused_list(paused)}")
    return chosen


def of_actor(name: str, paused: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The paused ranks on which actor `name` lives (Monarch's ``attach <actor> <rank>``), or whose call is
    named `name` (a live function). `UsageError` when there is none, naming what the paused ranks run."""
    chosen = [e for e in paused if name in e.get("actors", ()) or name == e.get("call")]
    if not chosen:
        names = sorted({str(n) for e in paused for n in [*e.get("actors", ()), e.get("call") or ""]} - {""})
        known = f"the paused ranks run: {', '.join(names)}" if names else _paused_list(paused)
        raise UsageError(f"no paused rank runs actor {name!r}; {known}")
    return chosen


def _closing(text: str, at: int) -> int:
    """Where the ')' that closes the '(' at `text[at]` is; -1 if none does."""
    depth = 0
    for i in range(at, len(text)):
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        if depth == 0:
            return i
    return -1


def _paused_list(paused: list[dict[str, Any]]) -> str:
    if not paused:
        return "no rank is paused"
    return "paused: " + ", ".join(f"{e['rank']} ({e['label']})" for e in paused)


def _name(e: dict[str, Any]) -> str:
    return f"rank {e['rank']} ({e['label']})"


def _runs_on(e: dict[str, Any], why: str) -> str:
    """What became of a rank that is no longer paused, in words (`why` as the server says it)."""
    if why == debugwire.STOPPED_WAITING:
        return f"{_name(e)} still runs that command; you stopped waiting (the script says when it pauses again)"
    if why in ("continued", "quit pdb"):
        after = "; its error goes on to the caller" if e.get("post_mortem") else ""
        return f"{_name(e)} {why}: it is no longer paused{after}"
    return f"{_name(e)} is no longer paused: {why}"


def table(paused: list[dict[str, Any]]) -> str:
    """The paused ranks as a table (a mesh column only when ranks of several meshes are paused, a host
    column only when they are on several hosts)."""
    if not paused:
        return "no rank is paused"
    meshes = len({e["mesh"] for e in paused}) > 1
    hosts = len({e.get("host", "") for e in paused}) > 1
    head = (["mesh"] if meshes else []) + ["rank", "coords"] + (["host"] if hosts else [])
    head += ["call", "paused at", "prompt"]
    rows = [
        ([str(e["mesh"])] if meshes else [])
        + [str(e["rank"]), e["label"]]
        + ([e.get("host", "")] if hosts else [])
        + [e.get("call") or "-", e["where"] or "?", e["prompt"].strip()]
        for e in paused
    ]
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in [head, *rows])


# -- the session ---------------------------------------------------------------------------------------
class Session:
    """One client's conversation with a script's debug server."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.line_start: dict[tuple[int, int], bool] = {}

    def paused(self) -> list[dict[str, Any]]:
        return self.conn.ask({"op": "list"}, "list")["ranks"]

    def send(self, targets: list[dict[str, Any]], line: str, labelled: bool) -> dict[tuple[int, int], dict]:
        """Send one pdb line to `targets`; show their output as it comes (each line labelled with its rank
        if `labelled`) until each is paused again or runs on. Returns each rank's last word (a ``paused``
        or ``running`` message). Ctrl-C stops waiting; the ranks go on."""
        self.conn.send({"op": "send", "targets": [[e["mesh"], e["rank"]] for e in targets], "line": line})
        last: dict[tuple[int, int], dict] = {}
        stopping = False
        while True:
            try:
                got = self.conn.next()
            except KeyboardInterrupt:
                if not stopping:
                    stopping = True
                    self.conn.send({"op": "stop"})
                continue
            if got is None:
                continue
            ev = got.get("ev")
            if ev == "done":
                break
            if ev == "output":
                self._show_output(got, labelled)
            elif ev in ("paused", "running"):
                last[(got["mesh"], got["rank"])] = got
            elif ev == "waiting":
                labels = ", ".join(got.get("labels", []))
                print(f"({labels} still running; Ctrl-C stops waiting, the ranks go on)", flush=True)
            elif ev == "error":
                print(f"monarch debug: {got.get('message')}", flush=True)
        self._end_lines()
        return last

    def _show_output(self, got: dict[str, Any], labelled: bool) -> None:
        text = got.get("text", "")
        if labelled:
            key = (got["mesh"], got["rank"])
            start = self.line_start.get(key, True)
            parts = []
            for piece in text.splitlines(keepends=True):
                parts.append(f"[{got['label']}] {piece}" if start else piece)
                start = piece.endswith("\n")
            self.line_start[key] = start
            text = "".join(parts)
        sys.stdout.write(text)
        sys.stdout.flush()

    def _end_lines(self) -> None:
        if not all(self.line_start.values()):
            print(flush=True)
        self.line_start.clear()

    # -- commands ----------------------------------------------------------------------------------
    def run(self, line: str) -> bool:
        """Do one command typed at ``monarch_dbg>``; False when it was `quit`."""
        word, _, rest = line.strip().partition(" ")
        rest = rest.strip()
        if not word:
            return True
        if word in ("quit", "exit", "q"):
            return False
        if word in ("help", "h", "?"):
            print(HELP)
        elif word in ("list", "ls", "l"):
            print(table(self.paused()))
        elif word in ("attach", "a"):
            self.attach(rest)
        elif word == "cast":
            self.cast(rest)
        elif word in ("continue", "cont", "c"):
            self.continue_all()
        elif word == "detach":
            print("not attached to a rank; attach <rank> first")
        else:
            raise UsageError(
                f"unknown command {word!r}; commands: {COMMANDS}"
                + (" (pdb commands go to a rank: attach <rank>, or cast <ranks> <command>)" if word else "")
            )
        return True

    def attach(self, rest: str) -> None:
        """``attach [<actor>] <rank> [mesh=<id>]``: talk to that rank's pdb until it runs on or `detach`."""
        paused = self.paused()
        args = rest.split()
        mesh = None
        if args and args[-1].startswith("mesh="):
            try:
                mesh = int(args.pop()[len("mesh=") :])
            except ValueError:
                raise UsageError(f"{rest.split()[-1]!r}: mesh=<id> takes a number") from None
        if len(args) not in (1, 2):
            raise UsageError(
                f"attach takes one rank: attach <rank> or attach <actor> <rank> [mesh=<id>]; {_paused_list(paused)}"
            )
        try:
            rank = int(args[-1])
        except ValueError:
            raise UsageError(
                f"attach takes a rank number, e.g. attach 1 or attach <actor> 1; {_paused_list(paused)}"
            ) from None
        candidates = of_actor(args[0], paused) if len(args) == 2 else paused
        found = [e for e in candidates if e["rank"] == rank and (mesh is None or e["mesh"] == mesh)]
        if not found:
            of = f" of actor {args[0]!r}" if len(args) == 2 and any(e["rank"] == rank for e in paused) else ""
            raise UsageError(f"rank {rank}{of} is not paused; {_paused_list(paused)}")
        if len(found) > 1:
            meshes = ", ".join(str(e["mesh"]) for e in found)
            raise UsageError(f"rank {rank} is paused in meshes {meshes}; say which: attach {rank} mesh=<id>")
        entry = found[0]
        where = f", paused at {entry['where']}" if entry["where"] else ""
        print(f"attached to {_name(entry)}{where}; pdb commands go to it, 'detach' comes back", flush=True)
        prompt = entry["prompt"]
        key = (entry["mesh"], entry["rank"])
        while True:
            try:
                line = input(f"[{entry['label']}] {prompt}")
            except EOFError:
                print()
                return
            except KeyboardInterrupt:
                print("\n(Ctrl-C: type 'detach' to come back to monarch_dbg>)", flush=True)
                continue
            if line.strip() == "detach":
                return
            last = self.send([entry], line, labelled=False).get(key)
            if last is None:  # (the script said why)
                return
            if last["ev"] == "running":
                print(_runs_on(entry, last["why"]), flush=True)
                return
            entry, prompt = last, last["prompt"]

    def cast(self, rest: str) -> None:
        """``cast [<actor>] <ranks> <pdb command>``: one pdb command to several paused ranks."""
        example = "e.g. cast ranks(1,3) p x, or cast <actor> ranks(1,3) p x"
        paused_of = None
        if not rest.startswith(("*", "ranks(")):  # Monarch's form: the actor's name first
            name, _, rest = rest.partition(" ")
            rest = rest.strip()
            if not rest.startswith(("*", "ranks(")):
                raise UsageError(
                    f"cast needs ranks(...) or * (after the actor's name, if any), then a pdb command; {example}"
                )
            paused_of = name
        if rest.startswith("*"):
            spec, command = "*", rest[1:].strip()
        else:
            end = _closing(rest, len("ranks"))
            if end < 0:
                raise UsageError(f"ranks( has no closing ); {example}")
            spec, command = rest[: end + 1], rest[end + 1 :].strip()
        if not command:
            raise UsageError(f"cast needs a pdb command after {spec}; {example}")
        paused = self.paused()
        targets = select_ranks(spec, of_actor(paused_of, paused) if paused_of is not None else paused)
        last = self.send(targets, command, labelled=True)
        for e in targets:
            got = last.get((e["mesh"], e["rank"]))
            if got is not None and got["ev"] == "running":
                print(_runs_on(e, got["why"]), flush=True)

    def continue_all(self) -> None:
        """Clear the breakpoints of every paused rank and continue it (Monarch's `continue`)."""
        paused = self.paused()
        if not paused:
            print("no rank is paused")
            return
        self.send(paused, debugwire.CONTINUE_LINE, labelled=True)
        print("continued: " + ", ".join(_name(e) for e in paused), flush=True)
        failed = [_name(e) for e in paused if e.get("post_mortem")]
        if failed:
            errors, go = ("errors", "go") if len(failed) > 1 else ("error", "goes")
            print(f"(post-mortem: the {errors} of {', '.join(failed)} {go} on to the caller)", flush=True)

    def repl(self) -> None:
        while True:
            try:
                line = input(PROMPT)
            except EOFError:
                print()
                return
            except KeyboardInterrupt:
                print()
                continue
            try:
                if not self.run(line):
                    return
            except UsageError as e:
                print(f"monarch debug: {e}", flush=True)
            except KeyboardInterrupt:
                print(flush=True)


# -- finding the script --------------------------------------------------------------------------------
def _command_line(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return "?"


def _find(pid: int | None) -> tuple[int, str] | str:
    """The (pid, socket) to talk to, or the message saying why there is none."""
    directory = debugwire.socket_dir()
    try:
        servers = debugwire.find_servers(debugwire.private_dir(create=False))
    except FileNotFoundError:
        servers = []
    if pid is not None:
        mine = [s for s in servers if s[0] == pid]
        if mine:
            return mine[0]
        return f"no monarch script with pid {pid} waits for a debugger (looked in {directory})"
    if not servers:
        return f"no monarch script has a rank paused in pdb (looked in {directory})"
    if len(servers) > 1:
        lines = ["several monarch scripts wait for a debugger; pick one with --pid:"]
        lines += [f"  --pid {p}   {_command_line(p)}" for p, _ in servers]
        return "\n".join(lines)
    return servers[0]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="monarch debug",
        description="Attach to a Python script whose monarch workers are paused in pdb: at a breakpoint(), or "
        "post-mortem where code debugged in pdb then raised.",
    )
    ap.add_argument("--pid", type=int, help="the script's process id, when several scripts wait")
    ap.add_argument("--host", help=argparse.SUPPRESS)  # (Monarch's: refused below, saying what to type)
    ap.add_argument("--port", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.host is not None or args.port is not None:
        print(
            "monarch debug: --host and --port name Monarch's TCP debug server (MONARCH_DEBUG_SERVER_HOST/PORT); "
            "here each script's debugger listens on a private Unix socket that monarch debug finds by itself: "
            "type 'monarch debug' (with --pid PID when several scripts wait)",
            file=sys.stderr,
        )
        return 2
    try:
        found = _find(args.pid)
    except debugwire.UnsafeDirError as e:
        print(f"monarch debug: not using the debugger's directory: {e}", file=sys.stderr)
        return 1
    if isinstance(found, str):
        print(f"monarch debug: {found}", file=sys.stderr)
        return 1
    pid, path = found
    try:
        conn = Connection(path)
        hello = conn.next(10)
    except (OSError, Closed) as e:
        print(f"monarch debug: cannot talk to the script (pid {pid}): {e}", file=sys.stderr)
        return 1
    if hello is None or hello.get("ev") != "hello":
        why = hello.get("message") if hello else "it did not answer"
        print(f"monarch debug: the script (pid {pid}) refused: {why}", file=sys.stderr)
        return 1
    n = hello.get("paused", 0)
    print(f"connected to {hello.get('script') or 'a script'} (pid {pid}): {n} rank{'s' * (n != 1)} paused in pdb")
    print("type 'help' for the commands, 'list' for the paused ranks", flush=True)
    if sys.stdin.isatty():
        try:
            import readline  # noqa: F401  (line editing and history for input())
        except ImportError:
            pass
    try:
        Session(conn).repl()
    except Closed:
        print(f"monarch debug: the script (pid {pid}) closed the connection (it ended?)", file=sys.stderr)
    return 0
