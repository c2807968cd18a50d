"""A process's set-up before a mesh is used (`spawn_procs(bootstrap=, proc_bind=)`): the CPUs it may run on,
then the user's bootstrap function."""

from __future__ import annotations

import asyncio
import inspect
import os
from collections.abc import Callable
from typing import Any

from monarch.runtime.common import context


def bootstrap(fn: Callable[[], Any] | None, binds: list[set[int]] | None) -> None:
    """Bind this process to its CPUs (its rank's entry of `binds`), then run `fn()` (awaited if a coroutine)."""
    if binds is not None:
        assert context.worker is not None
        os.sched_setaffinity(0, binds[context.worker.rank])
    if fn is not None:
        result = fn()
        if inspect.isawaitable(result):
            asyncio.run(_awaited(result))


async def _awaited(awaitable: Any) -> Any:
    return await awaitable
