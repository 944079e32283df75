"""Smoke run of benchmarks/ab_route_cost.py (two trees' route + on_finish, alternating child
processes): this tree on both sides gives the same decisions; a tree whose policy picks
differently is reported (and the run fails)."""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _load():
    spec = importlib.util.spec_from_file_location(
        "ab_route_cost", ROOT / "benchmarks/ab_route_cost.py"
    )
    mod = importlib.util.module_from_spec(spec)
    sys.modules["ab_route_cost"] = mod
    spec.loader.exec_module(mod)
    return mod


ARGS = ["--workers", "2", "--inflight", "0", "16", "--rounds", "2", "--requests", "300"]


def test_same_tree_on_both_sides(tmp_path, capsys):
    out = tmp_path / "ab.json"
    assert _load().main(["--base", str(ROOT), "--new", str(ROOT), *ARGS, "--out", str(out)]) == 0
    cases = json.loads(out.read_text())["cases"]
    assert [(c["workers"], c["inflight"]) for c in cases] == [(2, 0), (2, 16)]
    for c in cases:
        assert c["same_decisions"] is True
        assert len(c["base_us"]) == len(c["new_us"]) == len(c["base_over_new"]) == 2
        assert min(c["base_us"] + c["new_us"]) > 0
    assert "| 2 | 16 |" in capsys.readouterr().out


def test_a_tree_that_decides_differently_is_caught(tmp_path):
    other = tmp_path / "other"
    shutil.copytree(ROOT / "kvplug", other / "kvplug", ignore=shutil.ignore_patterns("*.c"))
    policy = other / "kvplug/policies/kv_cost.py"
    text = policy.read_text()
    assert "        return idx\n" in text
    policy.write_text(text.replace("        return idx\n", "        return len(values) - 1\n"))
    out = tmp_path / "ab.json"
    args = ["--base", str(ROOT), "--new", str(other), *ARGS[:4], "--rounds", "1"]
    assert _load().main([*args, "--requests", "100", "--out", str(out)]) == 1
    (case,) = json.loads(out.read_text())["cases"]
    assert case["same_decisions"] is False
