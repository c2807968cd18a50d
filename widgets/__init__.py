"""Notebook views of meshes and their values (ipywidgets via anywidget, with static HTML fallbacks)."""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "RankOutput": "monarch.widgets.rank_output",
    "RankLog": "monarch.widgets.rank_output",
    "MeshTableWidget": "monarch.widgets.mesh_table",
    "ValueMeshView": "monarch.widgets.value_mesh",
    "TensorView": "monarch.widgets.value_mesh",
    "DebuggerView": "monarch.widgets.debugger",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'monarch.widgets' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
