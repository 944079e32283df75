"""Smoke run of benchmarks/bench_router.py on a small index: every round of every fleet size is
in the JSON, and each figure is the median of its rounds with their range beside it."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_rounds_medians_and_ranges(tmp_path):
    out = tmp_path / "router.json"
    cmd = [sys.executable, str(ROOT / "benchmarks/bench_router.py"), "--out", str(out)]
    cmd += ["--workers", "2", "4", "--blocks", "4000", "--decisions", "60", "--rounds", "3"]
    cmd += ["--prompt-tokens", "512", "--inflight", "4"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["params"]["rounds"] == 3 and result["cpu_model"]
    assert [row["workers"] for row in result["rows"]] == [2, 4]
    for row in result["rows"]:
        rounds = row["rounds"]
        assert len(rounds) == 3 and {r["workers"] for r in rounds} == {row["workers"]}
        # the default and the previous default, timed on the same fleet and index
        assert row["default_mode"] == "affinity:affinity-fitted"
        assert row["previous_default_mode"] == "affinity:affinity-balance"
        assert row["capped_threshold"] == 2048
        for key in (
            "kv_median_us",
            "default_inflight_median_us",
            "previous_default_inflight_median_us",
            "capped_default_inflight_median_us",
            "round_robin_median_us",
        ):
            values = [r[key] for r in rounds]
            assert row[key] == statistics.median(values)
            assert row[f"{key}_range"] == [min(values), max(values)]
            assert all(v > 0 for v in values)
        # the printed table is the medians
        assert f"{row['kv_median_us']:>8.1f}" in proc.stdout


def test_a_figure_missing_from_some_rounds_is_the_median_of_the_others():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_router

    rounds = [{"split_us": None, "workers": 8}, {"split_us": 2.0, "workers": 8}]
    rounds.append({"split_us": 4.0, "workers": 8})
    row = bench_router.median_row(rounds)
    assert row["split_us"] == 3.0 and row["split_us_range"] == [2.0, 4.0]
    assert row["workers"] == 8 and row["rounds"] == rounds
