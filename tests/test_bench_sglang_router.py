"""Smoke run of benchmarks/bench_sglang_router.py: sglang-router and kvplug's launcher, each in
front of simulated SGLang engines, on a few trace requests."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.timeout(120)
def test_bench_runs_both_routers_and_writes_its_table(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location(
        "bench_sglang_router", ROOT / "benchmarks" / "bench_sglang_router.py"
    )
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "r.json"
    argv = ["--limit", "4", "--speedup", "50", "--max-output", "4", "--out", str(out)]
    assert bench.main([*argv, "--routers", "sglang-router", "kvplug"]) == 0
    report = json.loads(out.read_text())
    rows = {r["router"]: r for r in report["results"]}
    assert set(rows) == {"sglang-router", "kvplug"} and report["baseline"] == "sglang-router"
    for r in rows.values():
        assert r["errors"] == 0 and r["requests"] == 4 and sum(r["per_engine_requests"]) >= 4
        assert 0 < r["ttft_p50_s"] <= r["ttft_p99_s"]
    assert "sglang-router" in capsys.readouterr().out
