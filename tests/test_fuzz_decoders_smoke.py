"""A short run of benchmarks/fuzz_decoders.py: every decoder, zero escapes, zero bad events,
zero fast-path disagreements (the full run: 1,000,000 inputs per decoder, see the script)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.timeout(180)
def test_fuzz_decoders_short_run(tmp_path):
    out = tmp_path / "fuzz.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "fuzz_decoders.py"),
            "--inputs",
            "12000",
            "--atheris-inputs",
            "0",
            "--seed",
            "7",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=170,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["all_zero"] is True
    rows = {r["decoder"]: r for r in result["decoders"]}
    assert set(rows) == {"vllm-fast", "vllm-msgspec", "sglang", "trtllm-json"}
    for r in rows.values():
        assert r["inputs"] == 12000
        assert (r["crashes"], r["escapes"], r["bad_events"], r["disagreements"]) == (0, 0, 0, 0)
        assert r["accepted_batches"] > 1200  # the mutations stay near valid batches
    base = result["baseline_issue9_reproducers"]
    assert base["vllm-fast"]["inputs"] == 5 and base["trtllm-json"]["escapes"] == 0
