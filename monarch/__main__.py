"""`python -m monarch <command>` (also the `monarch` console script).

Commands: ``debug`` attaches to a script whose workers are paused in pdb (`monarch.runtime.tools.debugger`).
Each command's module is imported only when it runs, so this stays as light as `import monarch`.
"""

from __future__ import annotations

import sys

USAGE = """usage: monarch <command> [options]

commands:
  debug [--pid PID]   attach to a script whose workers wait in pdb (at a breakpoint(), or post-mortem after an
                      error their debugged code raised); see 'monarch debug --help'"""


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0 if args else 2
    command, rest = args[0], args[1:]
    if command == "debug":
        from monarch.runtime.tools.debugger import main as debug

        return debug(rest)
    print(f"monarch: unknown command {command!r}\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
