"""Types of the compiled wire (`_fastwire.c`): the signed one-frame message's check, signer and unpacker."""

from collections.abc import Callable
from typing import Any

def one_sender(
    mesh_id: int,
    rank: int,
    seen: list[int],
    envelope: type,
    names: tuple[str, ...],
    blake2b: Callable[..., Any],
    mac: dict[str, Any],
    loads: Callable[[Any], Any],
) -> Callable[[memoryview], Any]: ...
def one_signer(
    mesh_id: int, rank: int, blake2b: Callable[..., Any], mac: dict[str, Any], dumps: Callable[[Any], bytes]
) -> Callable[[int, Any, bytes | memoryview], list[bytes] | None]: ...
def unpacker(types: list[Any], names: list[Any]) -> Callable[[Any], Any]: ...
