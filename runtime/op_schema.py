"""What a torch op writes, read from its schema: shared by the controller (borrow rules, known values)
and the workers (poisoning). Takes op objects; imports nothing."""

from __future__ import annotations

from typing import Any

_UNANNOTATED_WRITES = {
    f"aten::{op}": ((3, 4), 5) for op in ("native_batch_norm", "cudnn_batch_norm", "miopen_batch_norm")
}
"""Ops that write arguments their schema does not mark: (positions, the `training` flag's position)."""


def written_args(op: Any, args: tuple, kwargs: dict) -> list:
    """The arguments op `op` writes (handles or Refs, or lists of them for foreach ops): those its schema
    marks, and those it writes without saying so (batch norm's running stats, when training)."""
    written = []
    spec = _UNANNOTATED_WRITES.get(op.name())
    if spec is not None and len(args) > spec[1] and args[spec[1]]:
        written += [args[i] for i in spec[0]]
    schema = op._schema
    for i, arg in enumerate(schema.arguments if schema.is_mutable else ()):
        if arg.alias_info is not None and arg.alias_info.is_write:
            written.append(args[i] if i < len(args) else kwargs.get(arg.name))
    return written
