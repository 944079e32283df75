"""benchmarks/bench_deadline.py: a short real run writes its table and JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(sys.version_info < (3, 11), reason="within() is wait_for on 3.10")
def test_bench_deadline_short_run(tmp_path):
    out = tmp_path / "deadline.json"
    run = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_deadline.py")]
        + ["--rounds", "1", "--calls", "200", "--repeats", "1", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    table = json.loads(out.read_text())["us_per_call"]
    assert "asyncio" in table
    for forms in table.values():
        assert set(forms) == {"no deadline", "asyncio.timeout", "within"}
        assert all(len(xs) == 1 and xs[0] > 0 for xs in forms.values())
    assert "within" in run.stdout
