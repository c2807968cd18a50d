"""A normal install works: the sdist builds a wheel holding every module, the wheel installs (not editable)
into a fresh virtual environment, every module imports from there, and its kernel runs a `%%mesh` cell.

The suite itself runs against an editable install, which never showed that a hand-written package list had
left `monarch.runtime.simulator.backend` out of every wheel (issue 25).
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile

import pytest
from jupyter_client.manager import start_new_kernel

from conftest import REPO, wait_gone
from helpers.kernel_client import Kernel

FOLDERS = ("monarch", "runtime", "kernel", "extension", "widgets")
"""The checkout's folders that make up the package `monarch` (setup.py maps them)."""
SKIP = shutil.ignore_patterns(".git", "build", "dist", "*.egg-info", "__pycache__", ".venv", "test-artifacts")


def _run(*cmd: str, cwd: str | None = None, env: dict | None = None) -> str:
    out = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, f"{' '.join(cmd)}: rc {out.returncode}\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}"
    return out.stdout


def _modules_in_checkout() -> set[str]:
    """Every module of the package, as the checkout's folders hold it (`runtime/x.py` is `monarch.runtime.x`)."""
    names = set()
    for folder in FOLDERS:
        top = "monarch" if folder == "monarch" else f"monarch.{folder}"
        for path in glob.glob(os.path.join(REPO, folder, "**", "*.py"), recursive=True):
            rel = os.path.relpath(path, os.path.join(REPO, folder))[: -len(".py")].split(os.sep)
            if rel[-1] == "__init__":
                rel = rel[:-1]
            names.add(".".join([top, *rel]))
    return names


@pytest.mark.timeout(300)
def test_the_wheel_built_from_the_sdist_installs_imports_and_runs_a_mesh_cell(tmp_path):
    src, dist = tmp_path / "src", tmp_path / "dist"
    shutil.copytree(REPO, src, ignore=SKIP)  # (a build writes build/ and *.egg-info into its source tree)
    _run(sys.executable, "-m", "build", "-q", "--outdir", str(dist), str(src))  # the sdist, then the wheel from it
    (wheel,) = glob.glob(str(dist / "*.whl"))
    (sdist,) = glob.glob(str(dist / "*.tar.gz"))
    with tarfile.open(sdist) as t:
        assert any(n.endswith("/setup.py") for n in t.getnames()), "the sdist lacks setup.py (its package map)"
    with zipfile.ZipFile(wheel) as z:
        files = z.namelist()
    in_wheel = {f[: -len(".py")].replace("/", ".").removesuffix(".__init__") for f in files if f.endswith(".py")}
    expected = _modules_in_checkout()
    assert expected - in_wheel == set(), f"modules missing from the wheel: {sorted(expected - in_wheel)}"
    assert "share/jupyter/kernels/monarch/kernel.json" in "\n".join(files)

    # A fresh environment, the wheel installed into it; its dependencies (torch among them) are this one's,
    # seen through a path file (only the directories: the editable install's hook in them does not run).
    venv = tmp_path / "venv"
    _run(sys.executable, "-m", "venv", "--without-pip", str(venv))
    python = str(venv / "bin" / "python")
    inner = _run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])").strip()
    outer = [p for p in sys.path if p.rstrip("/").endswith(("site-packages", "dist-packages")) and os.path.isdir(p)]
    with open(os.path.join(inner, "outer-environment.pth"), "w") as f:
        f.write("\n".join(outer) + "\n")
    _run(python, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--ignore-installed", wheel)
    check = (
        "import importlib, importlib.util, sys\n"
        "for name in sorted(sys.argv[2:]):\n"
        "    if name.endswith('.__main__'):  # (runs on import: found, not run)\n"
        "        importlib.import_module(name.rsplit('.', 1)[0])\n"
        "        where = importlib.util.find_spec(name).origin\n"
        "    else:\n"
        "        where = importlib.import_module(name).__file__\n"
        "    assert where.startswith(sys.argv[1]), (name, where)\n"
        "print('IMPORTED', len(sys.argv) - 2)\n"
    )
    out = _run(python, "-c", check, str(venv), *sorted(expected), cwd=str(tmp_path))  # (not the checkout's cwd)
    assert f"IMPORTED {len(expected)}" in out

    # Its kernel, registered in its own prefix, runs a %%mesh cell on workers that import the installed package.
    _run(python, "-m", "monarch.kernel", "install", "--sys-prefix", cwd=str(tmp_path))
    spec = venv / "share" / "jupyter" / "kernels" / "monarch" / "kernel.json"
    assert python in spec.read_text()
    env = dict(os.environ, JUPYTER_PATH=str(venv / "share" / "jupyter"))
    old = dict(os.environ)
    os.environ.update(env)
    try:
        km, kc = start_new_kernel(kernel_name="monarch", startup_timeout=90, cwd=str(tmp_path))
    finally:
        os.environ.clear()
        os.environ.update(old)
    k = Kernel(km, kc)
    try:
        r = k.run("%%mesh gpu=2\nimport monarch, torch\nprint('FROM', monarch.__file__)\nrank * 10", timeout=120)
        assert r.status == "ok", r.text()[-3000:]
        shown = "\n".join(it.get("t", "") for it in r.custom_items()) + r.text()
        assert shown.count(f"FROM {venv}") >= 2, shown[-3000:]
        assert "10" in r.text()
        pids = k.worker_pids()
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=False)
    assert wait_gone(pids) == []
