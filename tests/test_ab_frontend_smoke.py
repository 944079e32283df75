"""benchmarks/ab_frontend.py: a short real run (the floor proxy against this tree's kvplug
serve), its JSON and its round-by-round comparison."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(shutil.which("wrk") is None, reason="wrk is not installed (.ci/run)")
def test_ab_frontend_quick_run(tmp_path):
    out = tmp_path / "ab.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "ab_frontend.py"), "floor", f"this={ROOT}"]
        + [f"default={ROOT},--router-mode,affinity"]
        + ["--rounds", "2", "--seconds", "1", "--out", str(out)],
        check=True,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "floor below this in" in proc.stdout
    targets = json.loads(out.read_text())["targets"]
    assert [t["target"] for t in targets] == ["floor", "this", "default"]
    # which routing each target ran is said, not assumed: a serve target without a
    # --router-mode runs kv's cost, as bench_frontend's kvplug rows do
    routing = {t["target"]: t["routing"] for t in targets}
    assert routing == {
        "floor": "proxy (no routing)",
        "this": "--router-mode kv",
        "default": "--router-mode affinity",
    }
    assert "default: --router-mode affinity: " in proc.stdout
    for t in targets:
        assert len(t["cpu_ms_per_request_rounds"]) == 2
        assert all(r > 0 for r in t["requests_per_s_rounds"])


@pytest.mark.skipif(shutil.which("wrk") is None, reason="wrk is not installed (.ci/run)")
def test_ab_frontend_runs_the_native_lane_alone_against_the_native_serve(tmp_path):
    pytest.importorskip("kvplug._lane")
    out = tmp_path / "ab.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "ab_frontend.py")]
        + [f"lane={ROOT},floor,--native", f"native={ROOT},--data-path,native"]
        + ["--rounds", "2", "--seconds", "1", "--out", str(out)],
        check=True,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert "lane below native in" in proc.stdout
    targets = json.loads(out.read_text())["targets"]
    assert [t["target"] for t in targets] == ["lane", "native"]
    for t in targets:
        assert len(t["cpu_ms_per_request_rounds"]) == 2
        assert all(r > 0 for r in t["requests_per_s_rounds"])
