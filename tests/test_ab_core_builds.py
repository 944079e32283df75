"""Smoke run of benchmarks/ab_core_builds.py (two builds of the C core alternating) on a tiny
workload, with this tree's own build on both sides."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def test_same_build_on_both_sides_gives_equal_memory_and_every_round(tmp_path):
    _load("bench_core", ROOT / "benchmarks/bench_core.py")
    ab = _load("ab_core_builds", ROOT / "benchmarks/ab_core_builds.py")
    out = tmp_path / "ab.json"
    args = ["--base", str(ROOT), "--new", str(ROOT), "--workers", "8", "--blocks", "4000"]
    assert ab.main([*args, "--rounds", "2", "--memory-rounds", "1", "--out", str(out)]) == 0
    res = json.loads(out.read_text())["workers"]["8"]
    assert len(res["apply_rounds"]) == 2
    for rd in res["apply_rounds"]:
        assert rd["base_ns"] > 0 and rd["new_ns"] > 0
        assert rd["base_own_mib_per_m"] == rd["new_own_mib_per_m"] > 0  # the same build
        assert rd["base_clear_ms"] >= 0 and rd["new_clear_ms"] >= 0
    assert [rd["clear_ep"] for rd in res["apply_rounds"]] == [0, 1]  # a different one per round
    (base,), (new,) = res["memory"]["base"], res["memory"]["new"]  # fresh subprocesses
    assert base["own_mib_per_million_blocks"] == new["own_mib_per_million_blocks"] > 0
    assert {"rss_mib_per_million_blocks"} <= base.keys() & new.keys()  # tiny: may be ~0


def test_disagree_gives_every_worker_its_own_engine_hashes():
    """--disagree: the same blocks, each worker's engine hashes distinct from every other's (the
    index's fallback path), in the apply rounds and in the memory subprocesses alike."""
    bc = _load("bench_core", ROOT / "benchmarks/bench_core.py")
    ab = _load("ab_core_builds", ROOT / "benchmarks/ab_core_builds.py")
    wl = bc.make_workload(8, 4000, seed=1008)
    agree, disagree = ab.store_inputs(wl, False), ab.store_inputs(wl, True)
    assert [(w, s) for w, _, s in agree] == [(w, s) for w, _, s in disagree]
    owners: dict[int, int] = {}
    for (w, e_agree, _), (_, e_dis, _) in zip(agree, disagree, strict=True):
        assert e_agree != e_dis
        for e in e_dis:
            assert owners.setdefault(e, w) == w  # no engine hash shared between workers
    from kvplug.core import load_backend

    idx = load_backend("c").Index()
    for w, eng, seq in disagree:
        idx.store(w, 0, eng, seq)
    assert idx.stats()["engine_mappings"] == wl.blocks and idx._verify() == 0


def test_presized_reserves_inside_the_clock_in_rounds_and_memory_children(tmp_path):
    """--presized: the index reserves the workload's blocks before its first store, in the timed
    rounds and in the memory subprocesses alike (the reservation shows in the index's own bytes)."""
    _load("bench_core", ROOT / "benchmarks/bench_core.py")
    ab = _load("ab_core_builds", ROOT / "benchmarks/ab_core_builds.py")
    outs = {}
    for presized in (False, True):
        out = tmp_path / f"ab{presized}.json"
        args = ["--base", str(ROOT), "--new", str(ROOT), "--workers", "8", "--blocks", "4000"]
        args += ["--rounds", "1", "--memory-rounds", "1", "--out", str(out)]
        assert ab.main(args + ["--presized"] * presized) == 0
        outs[presized] = json.loads(out.read_text())
    assert outs[True]["args"]["presized"] and not outs[False]["args"]["presized"]
    grown, reserved = (outs[p]["workers"]["8"] for p in (False, True))
    assert (
        reserved["apply_rounds"][0]["new_own_mib_per_m"]
        != grown["apply_rounds"][0]["new_own_mib_per_m"]
    )
    mem = [w["memory"]["new"][0]["own_mib_per_million_blocks"] for w in (grown, reserved)]
    assert mem[0] != mem[1]
