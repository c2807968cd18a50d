"""notebooks/torch_native_parallelism.ipynb runs on 8 CPU workers and every section's check passes.

Each section of the notebook compares a parallel run (DeviceMesh, FSDP2, HSDP, tensor, sequence and loss
parallel, 3D, an MoE dispatch) with a one-process reference computed in the same cell; its `check` raises on
every rank on a mismatch, and otherwise rank 0 alone prints one line,
``ok: WHAT match the one-process reference (max diff D on 8 ranks)``. Here: no cell fails (`run_notebook`),
and each expected line appears exactly once, from rank 0, in the cell that makes that check.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from test_notebooks import _code_cells, _text, run_notebook

from conftest import REPO

NOTEBOOK = Path(REPO, "notebooks", "torch_native_parallelism.ipynb")

CHECKS = [
    "all_to_all_single received numbers (uneven splits)",
    "device mesh layouts, coordinates and the tp group's all_reduce",
    "fsdp2 losses, grads and updated params",
    "hsdp losses, grads and updated params",
    "tensor parallel (dp 2 x tp 4) losses, grads and updated params",
    "sequence + loss parallel (dp 2 x tp 4) losses, grads and updated params",
    "3d (hsdp 2 x 2 + tp 2) losses, grads and updated params",
    "moe dispatch: counts and received tokens",
    "moe combine: outputs and expert grads",
]
"""What each `check(...)` in the notebook says, in the order the notebook makes them."""

OK = re.compile(r"^\[gpu=(\d+)\] ok: (.+) match the one-process reference \(max diff (\S+) on (\d+) ranks\)$", re.M)


@pytest.mark.timeout(300)
def test_parallelism_notebook(tmp_path):
    nb = run_notebook(NOTEBOOK, tmp_path)
    cells = _code_cells(nb)
    assert cells[0].source.startswith("%%mesh gpu=8\n")

    found = [(i, *m) for i, cell in enumerate(cells) for m in OK.findall(_text(cell))]
    assert [what for _, _, what, _, _ in found] == CHECKS, found
    for i, gpu, what, diff, ranks in found:
        assert f'check(\n    "{what}"' in cells[i].source or f'check("{what}"' in cells[i].source, (what, i)
        assert (gpu, ranks) == ("0", "8"), (what, gpu, ranks)
        assert float(diff) <= 1e-5, (what, diff)
    # nothing else looks like an ok line (another rank's, or a reworded one)
    assert sum(_text(cell).count(" ok: ") for cell in cells) == len(CHECKS)
