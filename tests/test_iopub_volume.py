"""How many bytes a flood of `%%mesh` output puts on iopub: each printed byte should cross once (live, in
the per-rank areas), plus a bounded static render when the cell ends. (Sent as thousands of small messages,
the flood also overran iopub's queue and lost messages, sometimes the cell's end: then `run` timed out.)"""

from __future__ import annotations

import json

import pytest

from conftest import wait_gone
from helpers.kernel_client import monarch_kernel

PER_RANK = 8 << 20
LINE = 100
RANKS = 2
SLACK = 1 << 20
"""Bytes allowed beyond 1.25x the printed text: the bounded final render (a tail of each rank), the widget,
the cell's status and result messages."""


@pytest.mark.timeout(120)
def test_output_flood_crosses_iopub_once():
    lines = PER_RANK // LINE
    code = (
        f"%%mesh gpu={RANKS}\n"
        "import sys\n"
        f"line = 'x' * {LINE - 1 - 12}\n"
        f"for i in range({lines}):\n"
        "    sys.stdout.write(f'{rank}:{i:010d}{line}\\n')\n"
        "sys.stdout.flush()\n"
    )
    with monarch_kernel() as k:
        r = k.run(code, timeout=90)
        assert r.status == "ok", r.text()[-2000:]
        pids = k.worker_pids()
        k.km.shutdown_kernel(now=False)
        assert wait_gone(pids) == []

    printed = RANKS * lines * LINE
    sent = sum(len(json.dumps(m["content"])) for m in r.msgs)
    by_type: dict[str, int] = {}
    for m in r.msgs:
        by_type[m["msg_type"]] = by_type.get(m["msg_type"], 0) + len(json.dumps(m["content"]))
    print(f"printed {printed} B, iopub {sent} B ({sent / printed:.2f}x): {by_type}")
    # every line reached the live view, once and in order per rank
    live = r.custom_items()
    for g in range(RANKS):
        text = "".join(it["t"] for it in live if it["r"] == g)
        assert text == "".join(f"{g}:{i:010d}" + "x" * (LINE - 13) + "\n" for i in range(lines))
    assert sent <= 1.25 * printed + SLACK, f"iopub carried {sent / printed:.2f}x the printed bytes: {by_type}"
    # the final render shows each rank's last lines and says how many it left out
    (final,) = [d for d in r.final_outputs() if "monarch-ranks" in d.get("text/html", "")]
    for g in range(RANKS):
        assert f"[gpu={g}] {g}:{lines - 1:010d}" in final["text/plain"]
        assert f"{g}:{lines - 1:010d}" in final["text/html"]
    assert "not shown" in final["text/plain"] and "not shown" in final["text/html"]
