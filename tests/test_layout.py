"""The layout's promises that import-linter cannot check (it runs in ./run test, before pytest)."""

import ast
import os

from conftest import REPO


def _sources(*folders: str):
    for folder in folders:
        for name in sorted(os.listdir(os.path.join(REPO, folder))):
            if name.endswith(".py"):
                path = os.path.join(REPO, folder, name)
                with open(path) as f:
                    yield f"{folder}/{name}", ast.parse(f.read(), path)


def test_kernel_extension_and_widgets_use_the_runtime_through_public_names_only():
    """No `from monarch.runtime... import _private`, and no `obj._private` on anything but `self`/`cls`
    (IPython's display protocol, `_repr_*_`, is public)."""
    found = []
    for name, tree in _sources("kernel", "extension", "widgets"):
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("monarch"):
                found += [f"{name}:{node.lineno} imports {a.name}" for a in node.names if a.name.startswith("_")]
            elif isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.endswith("_"):
                owner = node.value.id if isinstance(node.value, ast.Name) else None
                if owner not in ("self", "cls"):
                    found.append(f"{name}:{node.lineno} uses .{node.attr}")
    assert found == []


def test_no_module_of_the_runtime_signs_or_checks_messages_but_the_wire():
    folders = sorted({os.path.relpath(d, REPO) for d, _, files in os.walk(os.path.join(REPO, "runtime"))
                      if any(f.endswith(".py") for f in files)})  # fmt: skip
    found = []
    for name, tree in _sources(*folders):
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr in ("encode", "decode"):
                if isinstance(node.value, ast.Name) and node.value.id in ("codec", "wire"):
                    found.append(f"{name}:{node.lineno}")
    assert found and all(f.startswith("runtime/wire/") for f in found), found


def test_only_mesh_py_touches_a_views_spawned_mesh_by_its_private_name():
    """Everything else uses `ProcMesh.spawned`, the typed accessor."""
    found = []
    for top in ("runtime", "kernel", "extension", "widgets", "monarch"):
        for d, _, files in os.walk(os.path.join(REPO, top)):
            for f in files:
                path = os.path.join(d, f)
                if f.endswith(".py") and os.path.relpath(path, REPO) != "runtime/mesh.py":
                    with open(path) as fh:
                        found += [f"{path}:{i}" for i, line in enumerate(fh, 1) if "_spawned" in line]
    assert found == []
