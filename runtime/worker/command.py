"""`monarch.job.exec_command` on a worker: run a command (or a Python script) in a process of its own, with this
worker's coordinates in its environment, and give its return code and output."""

from __future__ import annotations

import os
import subprocess
import sys

from monarch.runtime.common import context


def run_command(
    cmd: list[str], env: dict[str, str], workdir: str | None, client_cwd: str, output_dir: str | None
) -> dict[str, object]:
    """Run `cmd` (a ``.py`` file or ``["-m", module, ...]``: with this worker's Python); ``{"returncode",
    "stdout", "stderr"}``, the output empty when it went to files under `output_dir` (``$SUBDIR`` replaced
    by this worker's coordinates)."""
    coords, sizes = dict(context.current_rank()), dict(context.current_size())
    full_env = {
        **os.environ,
        **{f"MONARCH_RANK_{k}": str(v) for k, v in coords.items()},
        **{f"MONARCH_SIZE_{k}": str(v) for k, v in sizes.items()},
        **env,
    }
    cwd = workdir or (client_cwd if os.path.isdir(client_cwd) else None)
    argv = [sys.executable, *cmd] if cmd[0] == "-m" or cmd[0].endswith(".py") else list(cmd)
    if output_dir is None:
        done = subprocess.run(argv, env=full_env, cwd=cwd, capture_output=True, text=True)
        return {"returncode": done.returncode, "stdout": done.stdout, "stderr": done.stderr}
    folder = output_dir.replace("$SUBDIR", "_".join(f"{k}_{v}" for k, v in coords.items()))
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "stdout.txt"), "w") as out, open(os.path.join(folder, "stderr.txt"), "w") as err:
        done = subprocess.run(argv, env=full_env, cwd=cwd, stdout=out, stderr=err)
    return {"returncode": done.returncode, "stdout": "", "stderr": ""}
