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
    for r in (kv, default):
        assert 0 <= r["duplicate_share_of_device_blocks"] < 1


def test_duplicate_share_counts_copies_after_the_first_tenth():
    mod = _load()
    # (t, device blocks held, distinct): the first tenth (one sample of ten) is left out
    samples = [(0.0, 10, 1)] + [(float(t), 100, 90) for t in range(1, 10)]
    assert mod.duplicate_share(samples) == 0.1
    assert mod.duplicate_share([]) is None


def test_cache_lifetime_is_capacity_over_evictions_per_window():
    mod = _load()
    capacity = {"a": 1000, "b": 1000}
    evicted_at = [
        (0.0, {"a": 0, "b": 0}),
        (300.0, {"a": 50, "b": 0}),  # inside the first window
        (600.0, {"a": 100, "b": 50}),  # a: 100 evictions in 600 s -> 6,000 s; b: 12,000 s
        (1200.0, {"a": 100, "b": 80}),  # a evicted nothing: no lifetime for this window
    ]
    got = mod.cache_lifetimes(evicted_at, capacity)
    assert got == {0.0: {"a": 6000.0, "b": 12000.0}}
