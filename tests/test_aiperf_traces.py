"""The committed AIPerf-synthesized traces (benchmarks/data/aiperf/) are what their manifest
says: the same bytes (sha256 of each uncompressed file), the same statistics, the original's
new-token rate (the load match), and readable by the simulator's trace reader. AIPerf itself is
not needed: benchmarks/synthesize_traces.py imports it only to synthesize."""

from __future__ import annotations

import hashlib
import json
import lzma
from pathlib import Path

import pytest
from script_loader import load_script

from kvplug.sim.traces import load_trace

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "benchmarks" / "data" / "aiperf"
MANIFEST = json.loads((DATA / "manifest.json").read_text())


def test_the_manifest_names_every_variant_the_script_makes():
    assert list(MANIFEST["traces"]) == list(load_script("synthesize_traces").VARIANTS)
    assert MANIFEST["tool"].startswith("aiperf 0.13.0") and MANIFEST["match_load"]


@pytest.mark.parametrize("name", list(MANIFEST["traces"]))
def test_each_trace_is_its_manifest_entry(name):
    entry = MANIFEST["traces"][name]
    body = lzma.decompress((DATA / entry["file"]).read_bytes())
    assert hashlib.sha256(body).hexdigest() == entry["sha256_uncompressed"]
    records = [json.loads(line) for line in body.decode().splitlines()]
    stats = load_script("synthesize_traces").trace_stats(records)
    assert stats == entry["stats"]
    # the load match: the variant's new-token rate is the original's (to the speedup's rounding)
    source = MANIFEST["source_stats"]["new_tokens_per_s"]
    assert stats["new_tokens_per_s"] == pytest.approx(source, rel=2e-3)
    assert stats["requests"] == MANIFEST["source_stats"]["requests"]
    # the simulator reads it: one request per record, in the file's order
    loaded = load_trace(DATA / entry["file"])
    assert len(loaded) == len(records)
    assert loaded[-1].hash_ids == tuple(records[-1]["hash_ids"])


def test_padding_makes_a_shared_tail_whole_and_leaves_the_rest():
    pad = load_script("synthesize_traces").pad_shared_tails
    trace = [
        # ends in a partial block another request shares: padded to 2 whole blocks
        {"input_length": 700, "hash_ids": [1, 2]},
        {"input_length": 900, "hash_ids": [1, 2]},
        # its unshared last block may be partial
        {"input_length": 600, "hash_ids": [1, 3]},
    ]
    assert pad(trace) == (2, 2 * 1024 - 700 - 900)
    assert [r["input_length"] for r in trace] == [1024, 1024, 600]
