"""rerun_default.py puts the default's replayed rows in place, derives what depends on them
again, and refuses to write when the rerun's runs or its kv check differ from the file's;
bench_saturation.py's run on a small slice."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_saturation  # noqa: E402
import rerun_default as rerun  # noqa: E402

DEFAULT = rerun.DEFAULT


def quality_run(default: tuple[float, float], kv=(0.15, 5.0), other=(0.19, 5.0)) -> dict:
    rows = {DEFAULT: default, "kv": kv, "sglang-cache-aware": other}
    results = [
        {"policy": p, "hit_rate": h, "ttft_p99_s": t, "ttft_p50_s": 0.2, "prefill_tokens": 1}
        for p, (h, t) in rows.items()
    ]
    run = {
        "workload": "w",
        "spread_seed": 0,
        "view": "ideal",
        "steptime": "causal",
        "trace": {"fleet_lru_hit_rate": 0.2},
        "results": results,
        "verdicts": {},
    }
    return run


def test_quality_rows_are_replaced_and_their_verdicts_derived_again():
    old = {"runs": [quality_run((0.18, 5.0))]}  # the other router beats the default
    new = {"runs": [quality_run((0.196, 4.9))]}  # the rerun's default: more hits, lower p99
    changed = rerun.merge_quality(old, new, DEFAULT)
    assert len(changed) == 1 and "beaten by none" in changed[0]
    run = old["runs"][0]
    by = {r["policy"]: r for r in run["results"]}
    assert by[DEFAULT]["hit_rate"] == 0.196 and by["sglang-cache-aware"]["hit_rate"] == 0.19
    assert run["verdicts"][DEFAULT]["share_of_bound"] == pytest.approx(0.98)
    assert run["verdicts"][DEFAULT]["ttft_p99_vs_kv"] == pytest.approx(0.98)
    # the same figures again: nothing reported as changed
    assert rerun.merge_quality(old, copy.deepcopy(new), DEFAULT) == []


def test_quality_merge_refuses_a_kv_that_replays_differently_or_another_run():
    old = {"runs": [quality_run((0.18, 5.0))]}
    with pytest.raises(SystemExit, match="kv's hit_rate"):
        rerun.merge_quality(old, {"runs": [quality_run((0.19, 5.0), kv=(0.151, 5.0))]}, DEFAULT)
    other = quality_run((0.19, 5.0))
    other["spread_seed"] = 1
    with pytest.raises(SystemExit, match="is not the rerun's"):
        rerun.merge_quality(old, {"runs": [other]}, DEFAULT)
    # a field only one file records (an option added later) does not tell runs apart
    newer = quality_run((0.19, 5.0))
    newer["long_prefill_token_threshold"] = 0
    assert rerun.same_run(old["runs"][0], newer)


def fleet_run(default: tuple[float, float], rival=(0.97, 0.99)) -> dict:
    verdicts = {
        DEFAULT: {"share_of_bound": default[0], "ttft_p99_vs_kv": default[1]},
        "kv": {"share_of_bound": 0.8, "ttft_p99_vs_kv": 1.0},
        "affinity-balance": {"share_of_bound": rival[0], "ttft_p99_vs_kv": rival[1]},
    }
    return {
        "condition": "4 engines",
        "steptime": "causal",
        "seed": 0,
        "bound": 0.25,
        "verdicts": verdicts,
        "meets_bar": default[0] >= 0.95 and default[1] <= 1.0,
        "beaten_by": [],
    }


def test_fleet_verdicts_bar_and_beaten_by_follow_the_new_default():
    old = {"runs": [fleet_run((0.96, 0.98))]}
    new = {"runs": [fleet_run((0.94, 0.97))]}
    new["runs"][0]["verdicts"].pop("affinity-balance")  # the rerun replays the default and kv
    changed = rerun.merge_fleet(old, new, DEFAULT)
    run = old["runs"][0]
    assert len(changed) == 1 and not run["meets_bar"]
    assert run["beaten_by"] == []  # the rival's p99 (0.99) is higher than the default's (0.97)
    run["verdicts"]["affinity-balance"]["ttft_p99_vs_kv"] = 0.96
    rerun.merge_fleet(old, copy.deepcopy(new), DEFAULT)
    assert old["runs"][0]["beaten_by"] == ["affinity-balance"]
    bad = copy.deepcopy(new)
    bad["runs"][0]["verdicts"]["kv"]["share_of_bound"] = 0.81
    with pytest.raises(SystemExit, match="kv replays differently"):
        rerun.merge_fleet(old, bad, DEFAULT)


def test_saturation_run_on_a_small_slice(tmp_path):
    run = bench_saturation.run_rate(
        "agentic:user=3000,systems=32,duration=40",
        0.5,
        0,
        "ideal",
        "causal",
        [bench_saturation.DEFAULT, "kv"],
    )
    assert run["requests"] > 0 and 0 < run["bound"] <= 1
    assert {r["policy"] for r in run["results"]} == {bench_saturation.DEFAULT, "kv"}
    for r in run["results"]:
        assert r["share_of_bound"] == pytest.approx(r["hit_rate"] / run["bound"])
    assert isinstance(run["beaten_by"], list)
    assert "session rate 0.5/s" in bench_saturation.table(run)


def test_a_setting_other_than_the_default_leaves_the_defaults_bar():
    old = {"runs": [fleet_run((0.96, 0.98))]}  # the default meets the bar
    new = {"runs": [fleet_run((0.94, 0.97), rival=(0.97, 0.95))]}  # the rerun: a better rival
    new["runs"][0]["meets_bar"] = False  # the rerun's own default, not the one merged here
    rerun.merge_fleet(old, new, "affinity-balance")
    run = old["runs"][0]
    assert run["meets_bar"] and run["verdicts"][DEFAULT]["share_of_bound"] == 0.96
    assert run["verdicts"]["affinity-balance"]["share_of_bound"] == 0.97
    assert run["beaten_by"] == ["affinity-balance"]  # more hits at a lower p99 than the default
