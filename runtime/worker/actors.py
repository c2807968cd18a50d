"""The actors living in this worker process: made and called through functions the controller calls by name
(`monarch.runtime.actors`). One message loop serves them, so the messages one sender sends an actor run in
the order sent; an `async def` endpoint runs to completion on this process's event loop (a thread of its own)."""

from __future__ import annotations

import asyncio
import inspect
import threading
from typing import Any

from monarch.runtime.common import actors as shared
from monarch.runtime.common import context

_actors: dict[str, tuple[Any, shared.ActorInstance]] = {}
_loop: asyncio.AbstractEventLoop | None = None


def spawn(name: str, cls: type, args: tuple, kwargs: dict) -> None:
    """Construct this process's actor `name`."""
    if name in _actors:
        raise ValueError(f"an actor named {name!r} already runs on this process (spawn it under another name)")
    instance = shared.ActorInstance(name, context.current_rank())
    token = _enter(instance)
    try:
        _actors[name] = (cls(*args, **kwargs), instance)
    finally:
        shared.current = token


def invoke(name: str, endpoint: str, args: tuple, kwargs: dict) -> Any:
    """Run endpoint `endpoint` of actor `name` (its result, awaited if it is a coroutine)."""
    got = _actors.get(name)
    if got is None:
        raise RuntimeError(f"no actor named {name!r} on this process (it was stopped, or its spawn failed here)")
    actor, instance = got
    method = getattr(actor, endpoint, None)
    if method is None or not getattr(method, shared.ENDPOINT, False):
        raise AttributeError(f"{type(actor).__name__} has no endpoint {endpoint!r}")
    token = _enter(instance)
    try:
        result = method(*args, **kwargs)
        if inspect.isawaitable(result):
            result = _await(result)
        return result
    finally:
        shared.current = token


def stop(name: str) -> bool:
    """Forget actor `name` (its object goes when nothing else holds it); whether there was one."""
    return _actors.pop(name, None) is not None


def running() -> list[tuple[str, str]]:
    """(name, class name) of each actor on this process."""
    return [(name, type(actor).__name__) for name, (actor, _) in _actors.items()]


def _enter(instance: shared.ActorInstance) -> shared.Context | None:
    before = shared.current
    shared.current = shared.Context(instance, context.current_rank())
    return before


def _await(awaitable: Any) -> Any:
    """Run `awaitable` on this process's event loop and wait for it; Ctrl-C (the call interrupted) cancels it."""
    global _loop
    if _loop is None:
        _loop = asyncio.new_event_loop()
        threading.Thread(target=_loop.run_forever, name="monarch-actors-loop", daemon=True).start()

    async def run() -> Any:
        return await awaitable

    future = asyncio.run_coroutine_threadsafe(run(), _loop)
    try:
        return future.result()
    except KeyboardInterrupt:
        future.cancel()
        raise
