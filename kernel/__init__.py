"""The Jupyter kernel: `python -m monarch.kernel install` registers it; Jupyter launches it with `-f`."""

from __future__ import annotations

KERNEL_NAME = "monarch"
DISPLAY_NAME = "Monarch (PyTorch mesh)"
