"""Smoke run of benchmarks/ab_seq_hashes.py (two builds of the core in one process, taking turns):
the installed build against itself on a few short lists."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import kvplug

ROOT = Path(__file__).resolve().parents[1]


def test_ab_seq_hashes_runs_and_reports_every_round(tmp_path):
    spec = importlib.util.spec_from_file_location(
        "ab_seq_hashes", ROOT / "benchmarks/ab_seq_hashes.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    build = str(Path(kvplug.__file__).resolve().parents[1])  # the folder holding kvplug/_core.*.so
    out = tmp_path / "ab.json"
    res = mod.main(
        [
            "--a",
            build,
            "--b",
            build,
            "--rounds",
            "2",
            "--repeat",
            "2",
            "--lists",
            "4",
            "--out",
            str(out),
        ]
    )
    assert json.loads(out.read_text()) == res
    assert len(res["ns_per_token_a"]) == len(res["ns_per_token_b"]) == len(res["a_over_b"]) == 2
    assert all(x > 0 for x in res["ns_per_token_a"] + res["ns_per_token_b"])
    assert res["tokens_per_list_mean"] >= 64
