"""Smoke run of benchmarks/bench_index_growth.py on a small fleet: both sides fill the same
caches round by round in alternating order, the summary is the median and range of the rounds,
and only the growing index's memory moves while it fills."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_alternating_rounds_and_their_summary(tmp_path):
    out = tmp_path / "growth.json"
    cmd = [sys.executable, str(ROOT / "benchmarks/bench_index_growth.py"), "--out", str(out)]
    cmd += ["--workers", "4", "--capacity", "3000", "--rounds", "2"]
    cmd += ["--plot", str(tmp_path / "growth.png")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["blocks"] == 12_000 and result["cpu_model"]
    rounds = result["rounds"]
    assert len(rounds) == 2
    for rd in rounds:
        assert rd["growing"]["presized"] is False and rd["presized"]["presized"] is True
        for side in ("growing", "presized"):
            assert rd[side]["blocks"] == 12_000 and rd[side]["calls"] == 12_000 // 128 + 1
            assert rd[side]["cpu_ns_per_block"] > 0
    for side in ("growing", "presized"):
        values = [rd[side]["cpu_ns_per_block"] for rd in rounds]
        got = result["summary"][side]["cpu_ns_per_block"]
        assert got == {"median": statistics.median(values), "min": min(values), "max": max(values)}
    assert "growing (before)" in proc.stdout and "pre-sized (now)" in proc.stdout
    assert (tmp_path / "growth.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_approximate_mode_fills_the_side_index_by_routing(tmp_path):
    """--approx: each call routes one 128-block prompt, until the side index holds the fleet's
    capacity on both sides (the run asserts it)."""
    out = tmp_path / "approx.json"
    cmd = [sys.executable, str(ROOT / "benchmarks/bench_index_growth.py"), "--out", str(out)]
    cmd += ["--approx", "--workers", "4", "--capacity", "3000", "--rounds", "1", "--plot", ""]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["approx"] is True
    (rd,) = result["rounds"]
    for side in ("growing", "presized"):
        assert rd[side]["blocks"] == 12_000 and rd[side]["calls"] == 12_000 // 128 + 1
    assert rd["growing"]["memory_mib"] >= rd["presized"]["memory_mib"] > 0
