"""A job's directory: what a later process needs to attach to a job's host agents.

    <jobs>/<name>/            mode 0700 (jobs: MONARCH_JOBS_DIR, default ~/.monarch/jobs)
        job.json              what was asked for, the Slurm job id, the workspace
        secret.json           mode 0600: the job's signing key and CURVE key pairs (never on a command line)
        agents/<index>.json   mode 0600: written by each host's agent once it listens: host, address, endpoints
        slurm-<id>.out        the batch job's output (the agents' logs)

The directory must be one the hosts see at the same path (a shared home, as on most clusters).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from monarch.runtime.common import config
from monarch.runtime.wire.keys import AgentCurve


def jobs_root() -> Path:
    """Where jobs' directories live (`config.jobs_dir`, ``MONARCH_JOBS_DIR``)."""
    return config.jobs_dir()


def write_private(path: Path, data: Any) -> None:
    """JSON to `path`, mode 0600 from the start, replaced whole (a reader never sees half of it)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)


@dataclass(frozen=True)
class Secret:
    key: bytes
    """Signing key of the controller-agent links."""
    curve: AgentCurve

    @classmethod
    def new(cls) -> Secret:
        return cls(os.urandom(32), AgentCurve.new())

    def to_json(self) -> dict:
        c = self.curve
        return {
            "key": self.key.hex(),
            **{k: getattr(c, k).decode() for k in ("server_public", "server_secret", "client_public", "client_secret")},
        }

    @classmethod
    def from_json(cls, d: dict) -> Secret:
        keys = {k: d[k].encode() for k in ("server_public", "server_secret", "client_public", "client_secret")}
        return cls(bytes.fromhex(d["key"]), AgentCurve(**keys))


@dataclass
class AgentRecord:
    """One host's agent, as it wrote itself down."""

    index: int
    host: str
    addr: str
    pid: int
    endpoints: dict[str, str]
    """``ctl``, ``cmd``, ``reply``, ``store``: tcp://addr:port."""
    started: float = field(default_factory=time.time)


@dataclass
class JobDir:
    path: Path

    @classmethod
    def named(cls, name: str) -> JobDir:
        return cls(jobs_root() / name)

    @property
    def name(self) -> str:
        return self.path.name

    def create(self, meta: dict) -> Secret:
        """A new job directory with a new secret; refuses a name in use."""
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.path.mkdir(mode=0o700)  # FileExistsError: the name is taken
        (self.path / "agents").mkdir(mode=0o700)
        secret = Secret.new()
        write_private(self.path / "secret.json", secret.to_json())
        self.write_meta(meta)
        return secret

    def write_meta(self, meta: dict) -> None:
        write_private(self.path / "job.json", meta)

    def meta(self) -> dict:
        with open(self.path / "job.json") as f:
            return json.load(f)

    def secret(self) -> Secret:
        path = self.path / "secret.json"
        st = path.stat()
        if st.st_mode & 0o077 or st.st_uid != os.getuid():
            raise PermissionError(f"{path} must be this user's and mode 0600 (it is {oct(st.st_mode & 0o777)})")
        with open(path) as f:
            return Secret.from_json(json.load(f))

    def write_agent(self, record: AgentRecord) -> None:
        write_private(self.path / "agents" / f"{record.index}.json", asdict(record))

    def remove_agent(self, index: int) -> None:
        try:
            os.unlink(self.path / "agents" / f"{index}.json")
        except FileNotFoundError:
            pass

    def agents(self) -> list[AgentRecord]:
        out = []
        for f in sorted((self.path / "agents").glob("*.json"), key=lambda p: int(p.stem)):
            try:
                with open(f) as fh:
                    out.append(AgentRecord(**json.load(fh)))
            except (OSError, ValueError, TypeError):
                continue  # being written, or not ours
        return out


# -- the workspace: what a sync compares ------------------------------------------------------------------
_SKIP = {"__pycache__", ".git", ".ipynb_checkpoints", ".mypy_cache", ".pytest_cache", ".ruff_cache"}


class Manifest:
    """The files under a directory and the sha256 of each; hashes are kept by (size, mtime), so a file that
    did not change is not read again."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self._cache: dict[str, tuple[int, int, str]] = {}

    def files(self) -> dict[str, str]:
        """``{relative path: sha256 hex}`` of every regular file (caches and VCS folders left out)."""
        import hashlib

        out: dict[str, str] = {}
        for dirpath, dirnames, filenames in os.walk(self.root):
            dirnames[:] = sorted(d for d in dirnames if d not in _SKIP)
            for fname in filenames:
                full = os.path.join(dirpath, fname)
                try:
                    st = os.stat(full, follow_symlinks=False)
                except OSError:
                    continue
                if not os.path.isfile(full) or os.path.islink(full):
                    continue
                rel = os.path.relpath(full, self.root)
                cached = self._cache.get(rel)
                if cached is not None and cached[:2] == (st.st_size, st.st_mtime_ns):
                    out[rel] = cached[2]
                    continue
                with open(full, "rb") as f:
                    digest = hashlib.sha256(f.read()).hexdigest()
                self._cache[rel] = (st.st_size, st.st_mtime_ns, digest)
                out[rel] = digest
        return out

    def read(self, rel: str) -> bytes:
        with open(self.root / rel, "rb") as f:
            return f.read()

    def write(self, rel: str, data: bytes) -> None:
        """Write a file of the copy (no path may leave the root)."""
        target = (self.root / rel).resolve()
        if self.root.resolve() not in target.parents:
            raise ValueError(f"{rel!r} is outside the workspace")
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.{os.getpid()}.part")
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, target)
        self._cache.pop(rel, None)

    def remove(self, rel: str) -> None:
        target = (self.root / rel).resolve()
        if self.root.resolve() in target.parents:
            target.unlink(missing_ok=True)
        self._cache.pop(rel, None)
