"""`kvplug demo` and `kvplug bench` (table, JSON, plots, sweep) through the real command."""

import json

import pytest

from kvplug.cli import main


def test_demo_writes_table_json_and_plots(tmp_path, capsys):
    out = tmp_path / "demo.json"
    rc = main(
        [
            "demo",
            "--limit",
            "200",
            "--jobs",
            "1",
            "--no-progress",
            "--json",
            str(out),
            "--plots",
            str(tmp_path),
        ]
    )
    assert rc == 0
    text = capsys.readouterr().out
    assert "round-robin" in text and "oracle" in text and "affinity-fitted vs kv" in text
    report = json.loads(out.read_text())
    assert [r["policy"] for r in report["results"]] == [
        "affinity-fitted",
        "kv",
        "round-robin",
        "random",
    ]
    assert report["spec"]["n_engines"] == 4 and report["trace"]["requests"] == 200
    assert {p.name for p in tmp_path.glob("*.png")} == {
        "demo_ttft_cdf.png",
        "demo_hit_rate.png",
        "demo_load.png",
        "demo_frontier.png",
    }


def test_bench_sweep_grid(tmp_path, capsys):
    out = tmp_path / "sweep.json"
    rc = main(
        [
            "bench",
            "--sweep",
            "credit=0.5,1",
            "temperature=0",
            "--limit",
            "120",
            "--engines",
            "2",
            "--jobs",
            "1",
            "--no-progress",
            "--json",
            str(out),
            "--plots",
            str(tmp_path),
        ]
    )
    assert rc == 0
    sweep = json.loads(out.read_text())
    assert sweep["x_values"] == [0.5, 1.0] and sweep["y_values"] == [0.0]
    assert len(sweep["grid"]) == 1 and len(sweep["grid"][0]) == 2
    runs = json.loads((tmp_path / "sweep_runs.json").read_text())
    assert [r["policy"] for r in runs["results"]] == [
        "kv:credit=0.5,temperature=0",
        "kv:credit=1,temperature=0",
        "round-robin",
    ]
    assert (tmp_path / "sweep.png").stat().st_size > 10_000
    assert "hit rate: rows router_temperature" in capsys.readouterr().out


def test_bench_rejects_a_bad_policy_before_replaying(capsys):
    argv = ["bench", "--policies", "kv", "nonsense", "--limit", "10", "--json", ""]
    assert main([*argv, "--no-progress", "--jobs", "1"]) == 2  # a usage error
    err = capsys.readouterr().err
    assert "not kv" in err and err.count("\n") == 1 and "replay" not in err


def test_bench_steptime_and_realism_flags_reach_the_replay(tmp_path):
    out = tmp_path / "b.json"
    argv = ["bench", "--limit", "60", "--engines", "2", "--policies", "kv", "--jobs", "1"]
    argv += ["--no-progress", "--json", str(out), "--steptime", "cached"]
    argv += ["--realism", "realistic", "--event-loss", "0.05"]
    assert main(argv) == 0
    report = json.loads(out.read_text())
    spec = report["spec"]
    assert spec["steptime"] == "cached"
    assert spec["link"]["event_loss"] == 0.05  # the flag overrides the preset
    assert spec["link"]["metrics_delay_s"] == 1.0  # the rest is the realistic preset
    assert report["results"][0]["event_batches"] > 0
    for bad in (["--steptime", "fast"], ["--event-loss", "1.5"]):
        assert main(["bench", "--limit", "5", "--json", "", "--no-progress", *bad]) == 2


def test_bench_slowdowns_make_a_mixed_fleet(tmp_path, capsys):
    """``--slowdowns 1,2``: every other engine twice as slow, recorded in the report; bad lists
    are usage errors before any replay."""
    out = tmp_path / "m.json"
    argv = ["bench", "--limit", "200", "--engines", "4", "--policies", "round-robin"]
    argv += ["--jobs", "1", "--no-progress", "--json", str(out), "--slowdowns", "1,2"]
    assert main(argv) == 0
    report = json.loads(out.read_text())
    assert report["spec"]["slowdowns"] == [1.0, 2.0]
    capsys.readouterr()
    for bad in ("1,0", "fast", "1,,2", "-1", "nan"):
        argv = ["bench", "--limit", "5", "--json", "", "--no-progress", "--slowdowns", bad]
        assert main(argv) == 2
        assert "--slowdowns" in capsys.readouterr().err


def test_bench_seeds_report_each_policys_mean_and_range_over_its_runs(tmp_path, capsys):
    """``--seeds 3 --seed 1``: seeds 1-3, each run the one ``--seed N`` gives alone, the results
    their means with [min, max]; the table shows the ranges, the frontier plot is drawn."""
    out, alone = tmp_path / "s.json", tmp_path / "alone.json"
    argv = ["bench", "--limit", "300", "--engines", "4", "--policies", "kv", "round-robin"]
    argv += ["--jobs", "1", "--no-progress", "--realism", "realistic"]
    assert main([*argv, "--seeds", "3", "--seed", "1", "--json", str(out)]) == 0
    assert main([*argv, "--seed", "2", "--json", str(alone), "--plots", ""]) == 0
    table = capsys.readouterr().out
    report, single = json.loads(out.read_text()), json.loads(alone.read_text())
    assert report["seeds"] == [1, 2, 3] and [r["seed"] for r in report["seed_runs"]] == [1, 2, 3]
    timed = ("wall_s", "route_us_mean")  # the host's time, not the replay's

    def replayed(results: list[dict]) -> list[dict]:
        return [{k: v for k, v in r.items() if k not in timed} for r in results]

    assert replayed(report["seed_runs"][1]["results"]) == replayed(single["results"])
    hits = [[r["hit_rate"] for r in run["results"]] for run in report["seed_runs"]]
    assert len({tuple(h) for h in hits}) > 1  # the seed reaches the replay
    for i, row in enumerate(report["results"]):
        for key in ("hit_rate", "ttft_p99_s"):
            per_run = [run["results"][i][key] for run in report["seed_runs"]]
            assert row[key] == pytest.approx(sum(per_run) / 3)
            assert row["over_seeds"][key] == [min(per_run), max(per_run)]
    kv = report["results"][0]
    lo, hi = kv["over_seeds"]["hit_rate"]
    assert f"{kv['hit_rate']:.1%} ({lo:.1%}".rstrip("%") + f"–{hi:.1%})" in table
    assert "means over 3 runs, seeds 1, 2, 3" in table
    capsys.readouterr()
    plots = tmp_path / "plots"
    assert main([*argv, "--seeds", "2", "--json", "", "--plots", str(plots)]) == 0
    assert (plots / "sim_frontier.png").stat().st_size > 10_000
    assert main([*argv, "--seeds", "0", "--json", ""]) == 2
    assert main([*argv, "--seeds", "2", "--sweep", "credit=1", "temperature=0"]) == 2
    assert "--seeds" in capsys.readouterr().err
