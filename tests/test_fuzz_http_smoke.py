"""A short run of benchmarks/fuzz_http.py (hostile HTTP clients against a real ``kvplug serve``
process in front of stub engines): no 5xx, no crash, no server traceback, every kind sent."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.timeout(120)


def test_fuzz_http_short_run(tmp_path):
    out = tmp_path / "fuzz_http.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "fuzz_http.py"),
            "--seconds",  # the slow-loris connections need the time; the count follows the machine
            "8",
            "--concurrency",
            "16",
            "--slow-connections",
            "2",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["requests"] >= 400, res  # ~3,000 on a quiet machine; 50/s is a slow one
    assert res["5xx"] == 0 and res["crashes"] == 0, proc.stdout[-3000:]
    assert res["server_tracebacks_logged"] == 0
    assert res["healthy_at_end"] and res["valid_request_after"] == 200
    assert all(k["requests"] > 0 for k in res["kinds"].values()), res["kinds"]
    assert res["unexpected_status"] == 0, {
        name: k["unexpected_examples"] for name, k in res["kinds"].items() if k["unexpected_status"]
    }
    assert proc.returncode == 0
