"""IPython glue: the `%%mesh` / `%mesh` magics, per-rank output areas, stdin for remote pdb.

Works in any IPython (`%load_ext monarch`); the Monarch kernel loads it at start.
"""

from __future__ import annotations


def load_ipython_extension(ip) -> None:
    from monarch.extension.magics import load

    load(ip)


def unload_ipython_extension(ip) -> None:
    from monarch.extension.magics import unload

    unload(ip)
