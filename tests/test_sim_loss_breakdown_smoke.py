"""Smoke run of benchmarks/sim_loss_breakdown.py on a small generated workload: the parts it
reports add up (hits + held-not-used + held nowhere cover the bound), and kv, which moves
follow-ups whenever another engine costs less, forgoes held blocks where the default keeps
them."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORKLOAD = "multi-turn:duration=240"


def _load():
    spec = importlib.util.spec_from_file_location(
        "sim_loss_breakdown", ROOT / "benchmarks/sim_loss_breakdown.py"
    )
    mod = importlib.util.module_from_spec(spec)
    sys.modules["sim_loss_breakdown"] = mod
    spec.loader.exec_module(mod)
    return mod


def _run(mod, tmp_path, policy):
    out = tmp_path / f"{policy}.json"
    args = ["--workload", WORKLOAD, "--engines", "4", "--policy", policy, "--json", str(out)]
    assert mod.main(args) == 0
    return json.loads(out.read_text())


def test_breakdown_adds_up(tmp_path, capsys):
    mod = _load()
    kv = _run(mod, tmp_path, "kv")
    default = _run(mod, tmp_path, "affinity-balance")
    for r in (kv, default):
        assert 0 < r["hit_blocks"] and r["held_blocks"] <= r["prompt_blocks"]
        not_used = sum(r["held_not_used_blocks"].values())
        # what the chosen engines held and did not hit at admission was evicted meanwhile
        assert r["held_blocks"] - not_used - r["hit_blocks"] <= r["evicted_before_admission_blocks"]
        assert r["held_nowhere_blocks"] >= r["bound_blocks"] - r["held_blocks"]
    assert set(kv["held_not_used_blocks"]) <= {"moved"}
    assert set(default["held_not_used_blocks"]) <= {
        "guarded",
        "balanced",
        "protected",
        "rescued",
        "spread",
        "affinity",
        "kept_kv",
    }
    assert sum(kv["held_not_used_blocks"].values()) > sum(default["held_not_used_blocks"].values())
    printed = capsys.readouterr().out
    assert "held, not used" in printed and "held nowhere" in printed
