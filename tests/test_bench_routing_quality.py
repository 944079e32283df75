"""Smoke run of benchmarks/bench_routing_quality.py: tables, verdicts, JSON and the frontier plot
come out of one small run (the full run is the benchmark itself)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_routing_quality.py"


def _load(name: str = "bench_routing_quality"):
    spec = importlib.util.spec_from_file_location(name, SCRIPT.with_name(f"{name}.py"))
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_smoke_run_writes_verdicts_and_a_frontier_plot(tmp_path, capsys):
    bench = _load()
    out = tmp_path / "rq.json"
    rc = bench.main(
        [
            "--smoke",
            "--workloads",
            "conversation",
            "shared-prefix",
            "--settings",
            "realistic",
            "--steptime",
            "cached",
            "--policies",
            "kv",
            "affinity",
            "sglang-cache-aware",
            "--jobs",
            "1",
            "--json",
            str(out),
            "--plots",
            str(tmp_path),
        ]
    )
    assert rc == 0
    data = json.loads((tmp_path / "rq_smoke.json").read_text())
    assert [r["workload"] for r in data["runs"]] == ["conversation", "shared-prefix"]
    for run in data["runs"]:
        assert run["view"] == "realistic" and run["steptime"] == "cached"
        assert set(run["verdicts"]) == {"kv", "affinity", "sglang-cache-aware"}
        assert run["verdicts"]["kv"]["ttft_p99_vs_kv"] == 1.0
        assert all(r["requests"] == 300 for r in run["results"])
        assert any(r["event_batches"] > 0 for r in run["results"])  # the lossy link ran
    drawn = tmp_path / "frontier_cached_realistic_smoke.png"
    assert drawn.stat().st_size > 10_000
    assert "of the bound" in capsys.readouterr().out

    # --plot-only draws the same plot again from the JSON, replaying nothing
    from matplotlib.image import imread

    again = tmp_path / "again"
    rc = bench.main(
        ["--plot-only", "--json", str(tmp_path / "rq_smoke.json"), "--plots", str(again)]
    )
    assert rc == 0
    assert (imread(again / "frontier_cached_realistic.png") == imread(drawn)).all()
    with pytest.raises(SystemExit) as err:  # no such JSON: a usage error, not a traceback
        bench.main(["--plot-only", "--json", str(tmp_path / "none.json"), "--plots", str(again)])
    assert err.value.code == 2


def test_replay_scale_smoke(tmp_path):
    spec = importlib.util.spec_from_file_location(
        "bench_replay_scale", SCRIPT.with_name("bench_replay_scale.py")
    )
    assert spec and spec.loader
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "rs.json"
    args = ["--sizes", "4", "16", "--per-engine", "15", "--rounds", "2", "--million", "300"]
    png = tmp_path / "rs.png"
    assert bench.main([*args, "--json", str(out), "--plot", str(png)]) == 0
    assert png.stat().st_size > 10_000
    doc = json.loads(out.read_text())
    rows = doc["rows"]
    assert [r["engines"] for r in rows] == [4, 16]
    for r in rows:
        assert r["requests"] == 15 * r["engines"] and len(r["rounds"]) == 2
        assert min(r["event_req_per_cpu_s"]) > 0 and min(r["scan_req_per_cpu_s"]) > 0
    # the long run: exactly the requests asked for, on 1,024 engines, all replayed
    assert (doc["million"]["requests"], doc["million"]["engines"]) == (300, 1024)
    assert doc["million"]["req_per_cpu_s"] > 0 and doc["million"]["hit_rate"] >= 0


def test_sensitivity_smoke(tmp_path):
    spec = importlib.util.spec_from_file_location(
        "bench_sim_sensitivity", SCRIPT.with_name("bench_sim_sensitivity.py")
    )
    assert spec and spec.loader
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "s.json"
    argv = ["--limit", "80", "--jobs", "1", "--only", "report delay", "--json", str(out)]
    assert bench.main(argv) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["assumption"] for r in rows] == ["defaults", "report delay"]
    assert all(r["kv"]["ttft_p99_s"] > 0 for r in rows)


def test_verdict_table_marks_the_runs_that_meet_the_bar_and_counts_them():
    bench = _load()

    def run(workload, share, p99):
        bound, kv_p99 = 0.25, 8.0
        return {
            "workload": workload,
            "steptime": "causal",
            "view": "ideal",
            "verdicts": {
                "kv": {"share_of_bound": 0.8, "ttft_p99_vs_kv": 1.0},
                "new": {"share_of_bound": share, "ttft_p99_vs_kv": p99},
            },
            "results": [
                {"policy": "kv", "hit_rate": 0.8 * bound, "ttft_p99_s": kv_p99},
                {"policy": "new", "hit_rate": share * bound, "ttft_p99_s": p99 * kv_p99},
            ],
        }

    runs = [run("a", 0.97, 0.5), run("b", 0.9496, 0.9), run("c", 0.99, 1.004)]
    lines = bench.verdict_table(runs, ["kv", "new"]).splitlines()
    assert "**97.0% / 0.50×**" in lines[2]
    # rounding would show 95.0 % and 1.00x: one more digit shows which side of the bar
    assert "94.96% / 0.90×" in lines[3] and "**" not in lines[3].split("|")[5]
    assert "99.0% / 1.004×" in lines[4] and "**" not in lines[4].split("|")[5]
    # "new" hits more at a lower p99 in a and b (beating kv, the first policy), not in c
    assert [line.split("|")[6].strip() for line in lines[2:5]] == ["new", "new", "none"]
    assert lines[-1].endswith("| 0/3 | 1/3 | kv beaten in 2/3 |")


def _two_workloads_smoke(tmp_path) -> list[str]:
    """The trace and one generated workload, kv alone, one view and end: rq_smoke.json."""
    argv = ["--smoke", "--workloads", "conversation", "shared-prefix", "--settings", "ideal"]
    out = str(tmp_path / "rq.json")
    return argv + ["--steptime", "causal", "--policies", "kv", "--jobs", "1", "--json", out]


def test_spread_seeds_add_runs_of_the_trace_with_its_arrivals_spread(tmp_path):
    bench = _load()
    argv = _two_workloads_smoke(tmp_path)
    assert bench.main([*argv, "--plots", "", "--spread-seeds", "0", "1"]) == 0
    runs = json.loads((tmp_path / "rq_smoke.json").read_text())["runs"]
    # only the trace has same-timestamp arrivals to spread: no seeded generated workload
    assert [(r["workload"], r["spread_seed"]) for r in runs] == [
        ("conversation", 0),
        ("conversation seed 1", 1),
        ("shared-prefix", 0),
    ]
    stamped, spread = (r["results"][0] for r in runs[:2])
    assert stamped["requests"] == spread["requests"] == 300
    assert stamped["ttft_p50_s"] != spread["ttft_p50_s"]  # other arrival times, other waits


def test_workload_seeds_draw_the_generated_workloads_again(tmp_path):
    bench = _load()
    argv = _two_workloads_smoke(tmp_path)
    assert bench.main([*argv, "--plots", "", "--workload-seeds", "0", "2"]) == 0
    runs = json.loads((tmp_path / "rq_smoke.json").read_text())["runs"]
    # a trace is not drawn again; a generated workload once per seed, the seed recorded
    assert [(r["workload"], r.get("workload_seed")) for r in runs] == [
        ("conversation", None),
        ("shared-prefix", None),
        ("shared-prefix workload seed 2", 2),
    ]
    first, again = runs[1:]
    assert first["trace"]["requests"] == again["trace"]["requests"] == 300
    # other sessions and prompts: another arrival span and bound
    assert first["trace"]["span_s"] != again["trace"]["span_s"]
    assert first["trace"]["oracle_hit_rate"] != again["trace"]["oracle_hit_rate"]
    with pytest.raises(SystemExit):
        bench.main([*argv, "--plots", "", "--workload-seeds", "-1"])


def test_tail_floor_smoke_and_no_request_beats_its_own_prefill(tmp_path, capsys):
    floor = _load("bench_tail_floor")
    out = tmp_path / "tf.json"
    argv = ["--limit", "300", "--policies", "kv", "affinity-soonest", "--json", str(out)]
    assert floor.main(argv) == 0
    data = json.loads(out.read_text())
    kv, soonest = data["rows"]
    assert (kv["policy"], soonest["policy"]) == ("kv", "affinity-soonest")
    assert kv["ttft_p99_s"] == data["kv_ttft_p99_s"] and kv["requests"] == 300
    for row in data["rows"]:
        assert row["floor_p99_s"] <= row["ttft_p99_s"]
        assert (
            row["floor_above_kv_p99"] + row["waited_cold"] + row["waited_followup"]
            == (row["above_kv_p99"])
        )
    assert "floor p99 s" in capsys.readouterr().out

    # the floor is a lower bound: a request's first token never comes before its own prefill
    from kvplug.sim.bench import BenchSpec
    from kvplug.sim.policies import parse_policy
    from kvplug.sim.steptime import parse_steptime
    from kvplug.sim.virtual import replay

    spec = BenchSpec(policies=["kv"], limit=300, steptime="cached")
    pol = parse_policy("kv")
    cfg = spec.replay_config(pol.feed_events)
    res = replay(spec.records(), pol.router_config(spec.block_tokens), cfg)
    model, budget = parse_steptime("cached"), cfg.engine.max_batched_tokens
    gaps = [
        (r.first_token - r.arrival) - floor.floor_seconds(r, model, spec.block_tokens, budget)
        for r in res.requests
        if not r.rejected
    ]
    assert min(gaps) >= -1e-9
    assert sum(g < 1e-6 for g in gaps) > 10  # ... and many run alone at exactly their floor


def test_a_trace_file_is_a_workload_of_its_own(tmp_path, capsys):
    """--trace NAME=PATH replays a Mooncake-format file (here the synthetic trace kept in
    benchmarks/data) as workload NAME, alone unless --workloads names others."""
    bench = _load()
    trace = SCRIPT.parent / "data" / "mooncake_synthetic_trace.jsonl.gz"
    out = tmp_path / "rq.json"
    argv = ["--smoke", "--settings", "ideal", "--steptime", "causal", "--policies", "kv"]
    argv += ["--jobs", "1", "--json", str(out), "--plots", "", "--trace", f"synthetic={trace}"]
    assert bench.main(argv) == 0
    runs = json.loads((tmp_path / "rq_smoke.json").read_text())["runs"]
    assert [r["workload"] for r in runs] == ["synthetic"]
    assert runs[0]["trace"]["requests"] == 300
    assert runs[0]["trace"]["fleet_lru_hit_rate"] > 0  # the file's multi-turn prefixes repeat


def test_a_bad_trace_argument_is_refused(tmp_path):
    bench = _load()
    for bad in ("synthetic", f"x={tmp_path / 'missing.jsonl'}"):
        with pytest.raises(SystemExit):
            bench.main(["--smoke", "--trace", bad, "--plots", "", "--json", str(tmp_path / "j")])
    with pytest.raises(SystemExit):
        bench.main(["--smoke", "--workloads", "nope", "--plots", "", "--json", str(tmp_path / "j")])


def test_the_engines_threshold_is_recorded_per_run_and_a_negative_one_refused(tmp_path, capsys):
    """--long-prefill-token-threshold T (and --long-prefill-token-threshold-adaptive) runs every
    engine with vLLM's flags: each run's JSON says so, and the replay differs from the one
    without them (here the TTFTs); T < 0 is a usage error."""
    bench = _load()
    argv = ["--smoke", "--settings", "ideal", "--steptime", "cached", "--policies", "kv"]
    argv += ["--workloads", "conversation", "--jobs", "1", "--plots", ""]
    runs = {}
    for cap, adaptive in ((0, []), (1024, []), (1024, ["--long-prefill-token-threshold-adaptive"])):
        name = f"rq{cap}{len(adaptive)}"
        more = ["--long-prefill-token-threshold", str(cap), *adaptive]
        assert bench.main(argv + more + ["--json", str(tmp_path / f"{name}.json")]) == 0
        runs[cap, bool(adaptive)] = json.loads((tmp_path / f"{name}_smoke.json").read_text())[
            "runs"
        ]
    recorded = [
        (r["long_prefill_token_threshold"], r["long_prefill_token_threshold_adaptive"])
        for rs in runs.values()
        for r in rs
    ]
    assert recorded == [(0, False), (1024, False), (1024, True)]
    ttft = [r[0]["results"][0]["ttft_mean_s"] for r in runs.values()]
    assert len(set(ttft)) == 3  # the flags change the replay
    with pytest.raises(SystemExit) as exc:
        bench.main(argv + ["--long-prefill-token-threshold", "-1", "--json", str(tmp_path / "j")])
    assert exc.value.code == 2 and "T is >= 0" in capsys.readouterr().err
