"""A short run of ``benchmarks/soak.py`` (a compressed day through ``kvplug serve`` in front of
``kvplug sim`` engines): every request answered, samples taken, JSON and plot written."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import soak  # noqa: E402

pytestmark = pytest.mark.timeout(120)


def test_soak_smoke(tmp_path):
    out, png = tmp_path / "soak.json", tmp_path / "soak.png"
    argv = ["--duration", "6", "--sample-every", "0.5", "--peak-rate", "15"]
    assert soak.main([*argv, "--out", str(out), "--plot", str(png)]) == 0
    report = json.loads(out.read_text())
    f = report["figures"]
    assert f["requests"] > 10 and f["errors"] == 0, f
    assert not f["drift"]["index_over_capacity"]
    samples = report["samples"]
    assert len(samples) >= 8 and samples[-1]["hour"] == 24.0
    assert samples[-1]["index_blocks"] > 0 and samples[-1]["rss_mb"] > 10
    assert any(s["decision_p99_us"] for s in samples)
    assert png.stat().st_size > 10_000
