"""`monarch.fetch` (Monarch's module of the same name): getting a distributed tensor's values back.
`fetch_shard(t, **coords)` is a future of one worker's value; `inspect(t, **coords)` the value itself;
`show(t)` shows it (a widget in a notebook)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # (imported when first used: `import monarch.fetch` imports no torch)
    from monarch.extension.show import show
    from monarch.runtime.fetch import fetch_shard, inspect

__all__ = ["fetch_shard", "inspect", "show"]


def __getattr__(name: str) -> Any:
    if name in ("fetch_shard", "inspect"):
        from monarch.runtime import fetch

        return getattr(fetch, name)
    if name == "show":
        from monarch.extension.show import show

        return show
    raise AttributeError(f"module 'monarch.fetch' has no attribute {name!r}")
