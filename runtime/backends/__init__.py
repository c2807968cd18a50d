"""Backends: what runs a controller's workers (see `base.Backend`)."""

from __future__ import annotations

from monarch.runtime.backends.base import Backend, LostCallback
from monarch.runtime.common.config import Settings


def create(settings: Settings, on_lost: LostCallback) -> Backend:
    """The backend for this process's controller: workers on this machine."""
    from monarch.runtime.backends.local import LocalBackend

    return LocalBackend(settings, on_lost)
