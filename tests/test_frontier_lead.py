"""frontier_lead.py: who beats the default, sorted as the README states it."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import frontier_lead  # noqa: E402

DEFAULT = frontier_lead.DEFAULT


def rows(**policies: tuple[float, float]) -> list[dict]:
    return [
        {"policy": p.replace("_", "-"), "hit_rate": h, "ttft_p99_s": t}
        for p, (h, t) in policies.items()
    ]


def test_each_winner_is_sorted_into_its_group_with_its_margin():
    verdict = frontier_lead.judge(
        [
            *rows(kv=(0.20, 5.0), round_robin=(0.08, 7.0)),
            *rows(**{DEFAULT.replace("-", "_"): (0.24, 5.0)}),
            *rows(smg_cache_aware=(0.245, 5.0)),  # more hits, the same p99: beats it
            *rows(sglang_cache_aware=(0.26, 5.01)),  # more hits, a higher p99: does not
            *rows(affinity_balance=(0.2425, 4.9)),  # kvplug's own setting: beats it
        ]
    )
    assert verdict is not None
    assert verdict["beaten_by_other_project"] == ["smg-cache-aware"]
    assert verdict["beaten_by_own"] == ["affinity-balance"]
    assert verdict["beaten_by_baseline"] == []
    assert abs(verdict["other_margin_points"] - 0.5) < 1e-9
    assert abs(verdict["own_margin_points"] - 0.25) < 1e-9
    # the head to head's other side: fewer hits at a p99 no lower (kv, round-robin)
    assert sorted(verdict["default_beats"]) == ["kv", "round-robin"]


def test_a_run_names_the_other_projects_routers_it_lacks():
    # the default "leads" a run no other project's router was in: the verdict says so
    alone = frontier_lead.judge(rows(kv=(0.20, 5.0), **{DEFAULT.replace("-", "_"): (0.24, 5.0)}))
    assert alone is not None and alone["beaten_by"] == []
    assert alone["other_projects_missing"] == [
        "sglang-cache-aware",
        "smg-cache-aware",
        "vllm-kv-aware",
    ]
    complete = frontier_lead.judge(complete_rows())
    assert complete is not None and complete["other_projects_missing"] == []
    # a mocker replay: Dynamo's own router too, in any of its rounds
    mocker = [
        *complete_rows(),
        {"policy": "Dynamo round_robin #0", "hit_rate": 0.1, "ttft_p99_s": 9.0},
    ]
    assert frontier_lead.judge(mocker)["other_projects_missing"] == ["Dynamo kv_router"]
    mocker.append({"policy": "Dynamo kv_router, defaults #2", "hit_rate": 0.2, "ttft_p99_s": 5.5})
    assert frontier_lead.judge(mocker)["other_projects_missing"] == []


def complete_rows() -> list[dict]:
    return rows(
        kv=(0.20, 5.0),
        sglang_cache_aware=(0.2, 6.0),
        smg_cache_aware=(0.2, 6.0),
        vllm_kv_aware=(0.2, 6.0),
        **{DEFAULT.replace("-", "_"): (0.24, 5.0)},
    )


def test_every_committed_run_has_every_other_projects_router():
    """The README's count of runs another project's router wins covers every run."""
    out = json.loads((ROOT / "benchmarks/results/frontier_lead.json").read_text())
    lacking = [
        (s["source"], r["run"], r["other_projects_missing"])
        for s in out["sources"]
        for r in s["per_run"]
        if r["other_projects_missing"]
    ]
    assert lacking == []


def test_a_run_without_the_default_is_not_judged():
    assert frontier_lead.judge(rows(kv=(0.2, 5.0), affinity=(0.3, 4.0))) is None


def test_the_views_of_a_bench_report():
    ideal = {"spec": {"link": {"event_loss": 0.0, "metrics_delay_s": 0.0}}}
    realistic = {"spec": {"link": {"event_loss": 0.01, "metrics_delay_s": 1.0}}}
    assert frontier_lead.view_of(ideal, ideal) == "ideal"
    assert frontier_lead.view_of(realistic, realistic) == "realistic"
    assert frontier_lead.view_of({"view": "realistic"}, ideal) == "realistic"


def test_the_committed_results_give_the_committed_totals(tmp_path, capsys):
    out = tmp_path / "frontier_lead.json"
    assert frontier_lead.main(["--out", str(out)]) == 0
    committed = json.loads((ROOT / "benchmarks/results/frontier_lead.json").read_text())
    assert json.loads(out.read_text())["total"] == committed["total"]
    assert "the default leads" in capsys.readouterr().out
