"""bench_fleet_conditions.py's verdicts: the bar and 'beaten on both axes' as it states them."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_fleet_conditions as bench  # noqa: E402


def report(rows: dict[str, tuple[float, float]], bound: float = 0.2) -> dict:
    return {
        "trace": {"fleet_lru_hit_rate": bound},
        "results": [{"policy": p, "hit_rate": h, "ttft_p99_s": t} for p, (h, t) in rows.items()],
    }


def test_bar_and_beaten_on_both_axes():
    default = bench.DEFAULT
    policies = [default, "kv", "a", "b", "c"]
    rows = {
        default: (0.19, 5.0),  # 95 % of the bound, p99 equal to kv's: meets the bar
        "kv": (0.15, 5.0),
        "a": (0.195, 5.0),  # more hits at the same p99: beats it
        "b": (0.195, 5.01),  # more hits, a higher p99: does not
        "c": (0.19, 4.0),  # the same hits, a lower p99: does not (not more hits)
    }
    v = bench.verdicts(report(rows), policies)
    assert v["meets_bar"] and v["beaten_by"] == ["a"]
    assert abs(v["verdicts"]["kv"]["share_of_bound"] - 0.75) < 1e-12
    assert v["verdicts"][default]["ttft_p99_vs_kv"] == 1.0
    rows[default] = (0.1899, 4.0)  # under 95 %; only c has more hits at p99 <= 4
    v = bench.verdicts(report(rows), policies)
    assert not v["meets_bar"] and v["beaten_by"] == ["c"]
    rows[default] = (0.19, 5.0001)  # over kv's p99 by a hair: misses the bar
    assert not bench.verdicts(report(rows), policies)["meets_bar"]
