"""Smoke run of benchmarks/ab_query_builds.py (two builds' query times alternating) on a tiny
workload, with this tree's own build on both sides."""

from __future__ import annotations

import json
from pathlib import Path

from test_ab_core_builds import _load

ROOT = Path(__file__).resolve().parents[1]


def test_same_build_on_both_sides_answers_alike_in_every_round(tmp_path):
    _load("bench_core", ROOT / "benchmarks/bench_core.py")
    ab = _load("ab_query_builds", ROOT / "benchmarks/ab_query_builds.py")
    out = tmp_path / "ab.json"
    args = ["--base", str(ROOT), "--new", str(ROOT), "--workers", "8", "--blocks", "4000"]
    assert ab.main([*args, "--rounds", "2", "--prompts", "20", "--out", str(out)]) == 0
    (res,) = json.loads(out.read_text())["results"]
    assert len(res["rounds"]) == 2
    for rd in res["rounds"]:
        for n in (1024, 8192):
            assert rd[f"base_{n}_median_us"] > 0 and rd[f"new_{n}_median_us"] > 0
    assert 0 < res["median_walked_blocks"]["8192"] <= 512
