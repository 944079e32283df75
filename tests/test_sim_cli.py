"""`kvplug demo` and `kvplug bench` (table, JSON, plots, sweep) through the real command."""

import json

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
