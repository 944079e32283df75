"""benchmarks/gc_per_request.py: a short real run against ``kvplug serve`` from this tree, whose
requests leave nothing for the collector (the regression it measures)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(shutil.which("wrk") is None, reason="wrk is not installed (.ci/run)")
def test_gc_per_request_quick_run(tmp_path):
    out = tmp_path / "gc.json"
    subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gc_per_request.py"), "--quick"]
        + ["--out", str(out)],
        check=True,
        capture_output=True,
        text=True,
        timeout=120,
    )
    (target,) = json.loads(out.read_text())["targets"]
    (run,) = target["runs"]
    assert run["requests"] > 0 and run["cpu_ms_per_request"] > 0
    # no request object is left in a cycle: the collector frees nothing of kvplug's
    kvplug_garbage = {k: v for k, v in target["garbage_1s"].items() if k.startswith("kvplug.")}
    assert kvplug_garbage == {}
    assert run["gen0_collected_per_request"] < 1.0
