"""Smoke run of benchmarks/ab_fastwire_builds.py (two builds of the vLLM event decoder taking
turns) with this tree's own build on both sides, and the checks it relies on."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import numpy as np
import pytest
from test_ab_core_builds import _load

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def ab():
    return _load("ab_fastwire_builds", ROOT / "benchmarks/ab_fastwire_builds.py")


def test_same_build_on_both_sides_times_every_kind(ab, tmp_path):
    out = tmp_path / "ab.json"
    args = ["--base", str(ROOT), "--new", str(ROOT), "--rounds", "2", "--passes", "1"]
    assert ab.main([*args, "--batches", "3", "--out", str(out)]) == 0
    kinds = json.loads(out.read_text())["kinds"]
    assert set(kinds) == set(ab.KINDS)
    for got in kinds.values():
        assert got["ids"] == 3 * 8 * 26 * ab.BS
        assert [r["order"] for r in got["rounds"]] == [["base", "new"], ["new", "base"]]
        for r in got["rounds"]:
            for name in ("base", "new"):
                # timed, not compared: one pass over 3 batches is noise (the parse alone once
                # measured slower than a whole decode when run after the other A/B tests)
                assert 0 < r[f"{name}_parse_ns_per_id"] < float("inf")
                assert 0 < r[f"{name}_decode_ns_per_id"] < float("inf")


def test_the_token_id_mixes_have_the_widths_they_are_named_for(ab):
    rng = np.random.default_rng(0)
    for kind, wide_share in (("uniform-32k", (0, 0)), ("zipf-128k", (0.03, 0.08))):
        ids = ab.token_ids(rng, kind, 50_000)
        assert ids.min() >= 0 and ids.max() < (32_000 if kind == "uniform-32k" else 128_256)
        share = float((ids > 65_535).mean())  # the 5-byte msgpack form
        assert wide_share[0] <= share <= wide_share[1]
    zipf = ab.token_ids(rng, "zipf-128k", 50_000)
    assert 0.3 < float((zipf < 128).mean()) < 0.6  # 1-byte fixints mixed with the rest
    uniform = ab.token_ids(rng, "uniform-128k", 50_000)
    assert 0.45 < float((uniform > 65_535).mean()) < 0.55


def test_a_different_decode_is_caught(ab):
    fastwire = ab.load_fastwire(str(ROOT))
    work, _ = ab.payloads("zipf-128k", 2, seed=1)
    first = ab.decode_all(fastwire.FastDecoder(), work)
    again = ab.decode_all(fastwire.FastDecoder(), work)
    assert ab.same_events(first, again)
    # one token id changed in the last event of the second batch
    batch = msgspec.msgpack.decode(work[1])
    batch[1][-1]["token_ids"][-1] ^= 1
    changed = ab.decode_all(fastwire.FastDecoder(), [work[0], msgspec.msgpack.encode(batch)])
    assert not ab.same_events(first, changed)
