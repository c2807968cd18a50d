"""What a torch op writes and which results share an input's memory, read from its schema: shared by the
controller (borrow rules, known values), the workers (poisoning) and the simulator (a view is no
allocation). Takes op objects; imports nothing."""

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


def may_write_unannotated(op: Any) -> bool:
    """Whether `op` is one that writes arguments its schema does not mark (see `written_args`)."""
    return op.name() in _UNANNOTATED_WRITES


_alias_plans: dict[Any, list[tuple[int, int, str]]] = {}


def alias_plan(op: Any) -> list[tuple[int, int, str]]:
    """(result position, argument position, argument name) for each result of `op` that shares an argument's
    memory: views and in-place results. Used by the controller (borrow rules cover views) and the simulator
    (a view is no allocation)."""
    plan = _alias_plans.get(op)
    if plan is None:
        plan = []
        schema = getattr(op, "_schema", None)
        if schema is not None:
            for r, ret in enumerate(schema.returns):
                if ret.alias_info is None:
                    continue
                sets = ret.alias_info.before_set
                for i, a in enumerate(schema.arguments):
                    if a.alias_info is None:
                        continue
                    if sets & a.alias_info.before_set or (not sets and ret.type.kind() == "ListType"):
                        plan.append((r, i, a.name))  # (`Tensor(a)[]`, split and unbind: its sets are not exposed)
        if str(op) == "aten._unsafe_view.default":  # a view whose schema says it is not
            plan = [(0, 0, "self")]
        _alias_plans[op] = plan
    return plan
