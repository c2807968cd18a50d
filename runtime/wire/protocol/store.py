"""The rendezvous store: worker -> controller requests, and the store's answer."""

from __future__ import annotations

from typing import Any

from monarch.runtime.wire.protocol.base import message


@message(14)
class StoreSet:
    key: str
    value: bytes


@message(15)
class StoreGet:
    """The value of `key`, waiting for it to be set (up to `timeout` seconds)."""

    key: str
    timeout: float


@message(16)
class StoreAdd:
    key: str
    amount: int


@message(17)
class StoreCompareSet:
    key: str
    expected: bytes
    desired: bytes


@message(18)
class StoreWait:
    keys: tuple[str, ...]
    timeout: float


@message(19)
class StoreCheck:
    keys: tuple[str, ...]


@message(20)
class StoreDelete:
    key: str


@message(21)
class StoreNumKeys:
    pass


@message(22)
class StoreAnswer:
    request: int
    """The sequence number of the request it answers (a late answer to an abandoned request is ignored)."""
    ok: bool
    value: Any
    """The result; or, when not `ok`, the error's text."""
