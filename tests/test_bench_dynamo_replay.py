"""benchmarks/bench_dynamo_replay.py on a slice: placements judged by Dynamo's own simulator.

Needs ai-dynamo-runtime (the `bench` extra, x86-64 only), which .ci/run installs: under CI=true
its absence fails the run."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_placements_split_by_engine_replay_as_the_whole_fleet_does(tmp_path):
    pytest.importorskip("dynamo._core")
    out, png = tmp_path / "dr.json", tmp_path / "dr.png"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_dynamo_replay.py"), "--limit", "400"]
    cmd += ["--rounds", "1", "--policies", "affinity-balance", "round-robin", "--steptime"]
    cmd += ["causal", "--json", str(out), "--plot", str(png)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(out.read_text())
    rows = {r["row"]: r for r in report["rows"]}
    # the method: Dynamo's own placement, split by engine and replayed one engine at a time,
    # gives back what its whole fleet did ...
    check = report["check"]
    assert check["split_replay"]["hit_rate"] == pytest.approx(check["closed_loop"]["hit_rate"])
    assert check["split_replay"]["requests"] == 400
    # ... and so does round robin: kvplug's placement is Dynamo's, engine for engine
    ours, theirs = rows["round-robin (causal)"], rows["Dynamo round_robin"]
    for key in ("hit_rate", "ttft_p50_s", "ttft_p99_s"):
        assert ours[key] == pytest.approx(theirs[key]), key
    # the two simulators' caches agree on what a placement reuses (kvplug's counts blocks,
    # the mocker tokens)
    for name in ("round-robin (causal)", "affinity-balance (causal)"):
        row = rows[name]
        assert abs(row["kvplug_sim_hit_rate"] - row["hit_rate"]) < 0.02, row
    assert rows["affinity-balance (causal)"]["hit_rate"] > theirs["hit_rate"]
    assert png.stat().st_size > 10_000
