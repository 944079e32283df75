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


def test_a_runs_condition_is_its_label_without_its_seed():
    c = frontier_lead.condition_of
    # a trace's arrival seeds, and the seed fields after the step-time end
    assert c("routing_quality_aiperf: prefix-x2 seed 3 causal 3") == c(
        "routing_quality_aiperf: prefix-x2 causal 0"
    )
    assert c("routing_quality_aiperf: prefix-x2 causal 0") != c(
        "routing_quality_aiperf: prefix-x2 cached 0"
    )
    assert c("routing_quality_aiperf: prefix-x2 causal 0") != c(
        "routing_quality_aiperf: prefix-x2-roots-x2 causal 0"
    )
    # a fleet condition's replay seeds, run into a file of their own beside the first run
    assert c("fleet_conditions_fitted_seeds: 4 engines, replay seed 2 cached 2") == c(
        "fleet_conditions: 4 engines cached 0"
    )
    assert c("fleet_conditions: 4 engines cached 0") != c("fleet_conditions: 6 engines cached 0")
    # a generated workload drawn again
    assert c("routing_quality_workload_seeds: doc-qa workload seed 2 causal 0") == c(
        "routing_quality_default: doc-qa causal 0"
    )
    assert c("routing_quality_workload_seeds_long_prefill: doc-qa workload seed 1 causal 0") == (
        c("routing_quality_long_prefill: doc-qa causal 0")
    )
    # kvplug bench --seeds: the file is the condition, each seed's run one of its runs
    assert (
        c("sim_bench_host_tier/seed3")
        == c("sim_bench_host_tier/seed0")
        != c("sim_bench_host_tier_stored/seed0")
    )


def test_a_several_seed_bench_file_is_read_run_by_run(tmp_path):
    """kvplug bench --seeds writes the means and every seed's run: the frontier is judged on the
    runs (one per seed, one condition), not on the means."""
    runs = [rows(kv=(0.20, 5.0), affinity_fitted=(0.24 + s / 100, 5.0)) for s in range(3)]
    doc = {
        "spec": {"link": None},
        "seeds": [4, 5, 6],
        "results": rows(kv=(0.20, 5.0), affinity_fitted=(0.25, 5.0)),
        "seed_runs": [{"seed": 4 + i, "results": r} for i, r in enumerate(runs)],
    }
    path = tmp_path / "sim_bench_x.json"
    path.write_text(json.dumps(doc))
    got = frontier_lead.runs_of(path)
    labels = [label for label, _, _ in got]
    assert labels == [f"sim_bench_x/seed{s}" for s in (4, 5, 6)]
    assert [r for _, _, r in got] == runs and {view for _, view, _ in got} == {"ideal"}
    assert {frontier_lead.condition_of(label) for label in labels} == {"sim_bench_x:"}


def test_seeds_averaged_judge_the_default_on_the_means_with_a_paired_test():
    # the rival hits more on average and its p99 is lower: it beats the default on the means,
    # but by less than the seeds move the difference
    noisy = [
        rows(kv=(0.20, 5.0), affinity_fitted=(0.250, 4.0), affinity_balance=(0.253, 3.9)),
        rows(kv=(0.20, 5.0), affinity_fitted=(0.250, 4.0), affinity_balance=(0.245, 3.9)),
        rows(kv=(0.20, 5.0), affinity_fitted=(0.250, 4.0), affinity_balance=(0.254, 3.9)),
    ]
    v = frontier_lead.judge_seeds(noisy)
    assert v["runs"] == 3 and v["beaten_by"] == ["affinity-balance"]
    assert abs(v["paired_hit_difference"]["affinity-balance"]["mean_points"] - 0.0667) < 1e-3
    assert v["beaten_beyond_noise_by"] == []
    # the same lead in every seed: beyond noise
    steady = [
        rows(kv=(0.20, 5.0), affinity_fitted=(0.250, 4.0), sglang_cache_aware=(0.252 + d, 4.0))
        for d in (0.0, 0.0005, 0.001)
    ]
    v = frontier_lead.judge_seeds(steady)
    assert v["beaten_by_other_project"] == ["sglang-cache-aware"]
    assert v["beaten_beyond_noise_by"] == ["sglang-cache-aware"]
    # a policy one seed's run lacks is left out of the means, not averaged over fewer runs
    partial = [*steady[:2], rows(kv=(0.20, 5.0), affinity_fitted=(0.25, 4.0))]
    assert frontier_lead.judge_seeds(partial)["beaten_by"] == []
    # a worse mean p99 is no win, whatever the hits
    slower = [rows(affinity_fitted=(0.25, 4.0), smg_cache_aware=(0.30, 4.1 + d)) for d in (0, 0.1)]
    assert frontier_lead.judge_seeds(slower)["beaten_by"] == []


def test_the_committed_results_give_the_committed_totals(tmp_path, capsys):
    out, plot = tmp_path / "frontier_lead.json", tmp_path / "frontier_lead.png"
    assert frontier_lead.main(["--out", str(out), "--plot", str(plot)]) == 0
    assert plot.stat().st_size > 10_000
    committed = json.loads((ROOT / "benchmarks/results/frontier_lead.json").read_text())
    assert json.loads(out.read_text())["total"] == committed["total"]
    assert (
        json.loads(out.read_text())["seeds_averaged"]["total"]
        == committed["seeds_averaged"]["total"]
    )
    assert "the default leads" in capsys.readouterr().out
