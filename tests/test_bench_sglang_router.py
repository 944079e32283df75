"""Smoke run of benchmarks/bench_sglang_router.py: sglang-router and kvplug's launcher, each in
front of simulated SGLang engines, on a few trace requests; and its per-round ranges (which
bench_vllm_router.py shares)."""

from __future__ import annotations

import json

import pytest
from script_loader import load_script


def _bench():
    return load_script("bench_sglang_router")


@pytest.mark.timeout(120)
def test_bench_runs_both_routers_and_writes_its_table(tmp_path, capsys):
    bench = _bench()
    out = tmp_path / "r.json"
    argv = ["--limit", "4", "--speedup", "50", "--max-output", "4", "--out", str(out)]
    routers = ["sglang-router", "kvplug", "kvplug-protect"]
    assert bench.main([*argv, "--routers", *routers]) == 0
    report = json.loads(out.read_text())
    rows = {r["router"]: r for r in report["results"]}
    assert set(rows) == set(routers) and report["baseline"] == "sglang-router"
    for r in rows.values():
        assert r["errors"] == 0 and r["requests"] == 4 and sum(r["per_engine_requests"]) >= 4
        assert 0 < r["ttft_p50_s"] <= r["ttft_p99_s"]
    assert "sglang-router" in capsys.readouterr().out


def test_ranges_take_each_ratio_within_its_round():
    """A p99 ratio is a router's over the baseline's in the same round, never across rounds."""
    bench = _bench()

    def row(router, hit, p99):
        return {"router": router, "hit_rate": hit, "ttft_p99_s": p99}

    by_round = [
        [row("base", 0.5, 2.0), row("kvplug", 0.6, 1.0)],
        [row("kvplug", 0.7, 4.0), row("base", 0.4, 8.0)],
    ]
    got = {s["router"]: s for s in bench.ranges(by_round, ["base", "kvplug"], "base")}
    assert got["kvplug"]["hit_rate"] == [0.6, 0.7]
    assert got["kvplug"]["ttft_p99_s"] == [1.0, 4.0]
    assert got["kvplug"]["ttft_p99_vs_base"] == [0.5, 0.5]  # across rounds it would be 0.125-2
    assert got["base"]["ttft_p99_vs_base"] == [1.0, 1.0]
    assert "0.50-0.50x" in bench.range_table(list(got.values()))


def test_rounds_flip_the_order():
    bench = _bench()
    rows = bench.run_rounds(["a", "b", "c"], 3, lambda name: {"router": name}, "x")
    order = [(r["round"], r["router"]) for r in rows]
    assert order == [(1, "a"), (1, "b"), (1, "c"), (2, "c"), (2, "b"), (2, "a")] + [
        (3, "a"),
        (3, "b"),
        (3, "c"),
    ]
