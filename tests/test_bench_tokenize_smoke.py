"""benchmarks/bench_tokenize.py: a short real run checks the cached ids and writes its JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_bench_tokenize_short_run(tmp_path):
    out = tmp_path / "tok.json"
    run = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_tokenize.py")]
        + ["--rounds", "1", "--prompts", "200", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    rows = json.loads(out.read_text())["rows"]
    assert rows and all(r["cache_stats_last_round"]["enabled"] for r in rows)
    assert all(r["cpu_us_off"][0] > 0 and r["cpu_us_on"][0] > 0 for r in rows)
    assert "| tokenizer |" in run.stdout
