"""Trace loading, slicing, expansion to tokens, block hashes and the oracle bound."""

import gzip
import json
import lzma

import numpy as np
import pytest

from kvplug.sim.traces import (
    block_hashes_of,
    expand_tokens,
    iter_trace,
    load_trace,
    oracle_hit_rate,
)


def _write(path, records, gz=False):
    text = "".join(json.dumps(r) + "\n" for r in records)
    if gz:
        with gzip.open(path, "wt") as fh:
            fh.write(text)
    else:
        path.write_text(text)


RECS = [
    {"timestamp": 1000, "input_length": 1100, "output_length": 5, "hash_ids": [1, 2, 3]},
    {"timestamp": 1500, "input_length": 1536, "output_length": 7, "hash_ids": [1, 2, 4]},
    {"timestamp": 4000, "input_length": 600, "output_length": 1, "hash_ids": [9, 10]},
]


def test_bundled_trace_matches_its_documented_statistics():
    recs = load_trace()
    assert len(recs) == 12_031
    assert recs[-1].arrival_s == pytest.approx(3536.999)
    oracle = oracle_hit_rate(recs)
    assert oracle["all_id_hit_rate"] == pytest.approx(0.366, abs=0.001)  # the trace README's 36.6 %


def test_slicing_and_rebasing(tmp_path):
    p = tmp_path / "t.jsonl.gz"
    _write(p, RECS, gz=True)
    recs = load_trace(p, start_s=1.2, speedup=2.0)
    assert [r.input_length for r in recs] == [1536, 600]
    assert [r.arrival_s for r in recs] == [0.0, pytest.approx(1.25)]
    assert (
        len(load_trace(p, duration_s=2.0)) == 2
    )  # trace time [0, 2) s and len(load_trace(p, limit=1)) == 1


def test_xz_traces_read_as_gzip_ones_do(tmp_path):
    text = "".join(json.dumps(r) + "\n" for r in RECS)
    gz, xz = tmp_path / "t.jsonl.gz", tmp_path / "t.jsonl.xz"
    _write(gz, RECS, gz=True)
    xz.write_bytes(lzma.compress(text.encode()))
    assert load_trace(xz) == load_trace(gz) and len(load_trace(xz)) == 3


@pytest.mark.parametrize("suffix, pack", [(".gz", gzip.compress), (".xz", lzma.compress)])
def test_a_broken_compressed_trace_is_a_value_error_naming_the_file(tmp_path, suffix, pack):
    # many records, so the break comes after the first ones were read
    text = "".join(json.dumps(RECS[i % 3]) + "\n" for i in range(3000)).encode()
    truncated = tmp_path / f"cut.jsonl{suffix}"
    truncated.write_bytes(pack(text)[:-40])
    with pytest.raises(ValueError, match=r"cut.jsonl.*unreadable trace file"):
        list(iter_trace(truncated))
    not_packed = tmp_path / f"plain.jsonl{suffix}"  # plain JSON under a compressed name
    not_packed.write_bytes(text)
    with pytest.raises(ValueError, match=r"plain.jsonl.*:1: unreadable trace file"):
        list(iter_trace(not_packed))


def test_bad_lines_name_their_line(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text(json.dumps(RECS[0]) + "\n{not json\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:2"):
        list(iter_trace(p))
    p.write_text(json.dumps({"timestamp": 0, "input_length": 5}) + "\n")
    with pytest.raises(ValueError, match=":1"):
        list(iter_trace(p))


def test_oracle_by_hand(tmp_path):
    p = tmp_path / "t.jsonl"
    _write(p, RECS)
    o = oracle_hit_rate(load_trace(p))
    # full blocks: r0 has 2 (ids 1, 2), r1 has 3 (1, 2, 4: 1 and 2 seen), r2 has 1 (9)
    assert o["full_blocks"] == 6 and o["full_block_hit_rate"] == pytest.approx(2 / 6)
    assert o["all_ids"] == 8 and o["all_id_hit_rate"] == pytest.approx(2 / 8)


def test_token_expansion_preserves_prefixes_and_only_them():
    a = expand_tokens([1, 2, 3], 1100)
    b = expand_tokens([1, 2, 4], 1536)
    assert a.dtype == np.uint32 and len(a) == 1100 and len(b) == 1536
    assert np.array_equal(a[:1024], b[:1024])  # shared ids -> shared tokens
    assert not np.array_equal(a[1024:1100], b[1024:1100])
    assert int(a.max()) < 128_000
    with pytest.raises(ValueError):
        expand_tokens([1], 600)  # one 512-token id cannot cover 600 tokens


def test_block_hashes_are_per_id_and_deterministic():
    h1 = block_hashes_of([5, 6, 7], 2)
    assert len(h1) == 2 and h1 == block_hashes_of([5, 6, 8], 2)
    assert len(set(block_hashes_of(list(range(1000))))) == 1000


def test_shared_prefix_workload():
    from kvplug.sim.traces import parse_workload, synthetic_shared_prefix

    recs = synthetic_shared_prefix(groups=4, system=1024, question=600, requests=200, seed=1)
    assert recs == synthetic_shared_prefix(
        groups=4, system=1024, question=600, requests=200, seed=1
    )
    assert len(recs) == 200 and all(r.input_length == 1624 for r in recs)
    assert all(b.arrival_s >= a.arrival_s for a, b in zip(recs, recs[1:], strict=False))
    heads = {r.hash_ids[:2] for r in recs}
    assert len(heads) == 4  # one shared 2-block prefix per group
    tails = [r.hash_ids[2:] for r in recs]
    assert len(set(tails)) == 200  # the rest is unique to each request
    # 3 full blocks per request, 2 shared: hit rate = 2/3 minus each group's first request
    assert oracle_hit_rate(recs)["full_block_hit_rate"] == pytest.approx((200 * 2 - 4 * 2) / 600)
    assert len(parse_workload("shared-prefix:groups=2,requests=10")) == 10
    with pytest.raises(ValueError):
        parse_workload("shared-prefix:colour=3")
    with pytest.raises(ValueError):
        parse_workload("zipf")


def test_multi_turn_sessions_extend_their_own_prefix():
    from kvplug.sim.traces import oracle_hit_rate, parse_workload, synthetic_multi_turn

    recs = synthetic_multi_turn(512, session_rate=0.2, duration=300, think=5.0, seed=3)
    assert recs == synthetic_multi_turn(512, session_rate=0.2, duration=300, think=5.0, seed=3)
    assert all(a.arrival_s <= b.arrival_s for a, b in zip(recs, recs[1:], strict=False))
    for r in recs:
        assert len(r.hash_ids) == -(-r.input_length // 512)
    # a later turn of a session starts with the earlier turn's full blocks
    by_first_user_block: dict[int, list] = {}
    for r in recs:
        if len(r.hash_ids) > 4:  # beyond the 2,048-token system prompt
            by_first_user_block.setdefault(r.hash_ids[4], []).append(r)
    follow_ups = [rs for rs in by_first_user_block.values() if len(rs) > 1]
    assert follow_ups
    for rs in follow_ups:
        a, b = rs[0], rs[1]
        full = a.input_length // 512
        assert b.hash_ids[:full] == a.hash_ids[:full]
        if a.input_length % 512:  # the partial tail changed content: a new id
            assert a.hash_ids[full] not in b.hash_ids
    assert oracle_hit_rate(recs)["full_block_hit_rate"] > 0.5
    agentic = parse_workload("agentic:duration=60,seed=1")
    assert agentic and min(r.input_length for r in agentic) > 8192  # tool definitions
    with pytest.raises(ValueError, match="unknown"):
        parse_workload("multi-turn:sessions=3")


def test_doc_qa_sessions_share_only_their_document_and_arrive_in_bursts():
    from kvplug.sim.traces import parse_workload, synthetic_doc_qa

    kw = dict(docs=20, doc=6000, session_rate=0.5, burst=5.0, burst_period=100, duration=600)
    kw.update(think=0.1, output=8)  # questions follow their session's start closely
    recs = synthetic_doc_qa(512, seed=2, **kw)
    assert recs == synthetic_doc_qa(512, seed=2, **kw)
    assert all(a.arrival_s <= b.arrival_s for a, b in zip(recs, recs[1:], strict=False))
    for r in recs:
        assert len(r.hash_ids) == -(-r.input_length // 512)
    # requests about one document share its full blocks and nothing after them
    by_doc: dict[int, list] = {}
    for r in recs:
        by_doc.setdefault(r.hash_ids[0], []).append(r)
    hot = max(by_doc.values(), key=len)
    assert len(hot) > len(recs) / 20  # popularity is skewed: one document is hot
    shared = len(set.intersection(*(set(r.hash_ids) for r in hot)))
    assert all(r.hash_ids[:shared] == hot[0].hash_ids[:shared] for r in hot)
    tails = [i for r in hot for i in r.hash_ids[shared:]]  # the questions: never shared
    assert len(set(tails)) == len(tails) >= len(hot)
    # sessions start 5x as often in the first fifth of each 100 s cycle as in the rest
    starts = [r.arrival_s for r in recs]
    in_burst = sum(1 for t in starts if t % 100 < 20)
    assert in_burst > 0.4 * len(starts)  # 5 / (5 + 4) = 56 % of sessions; 20 % if unbursty
    assert len(parse_workload("doc-qa:duration=60,seed=1")) > 0
    with pytest.raises(ValueError, match="unknown"):
        parse_workload("doc-qa:pages=3")
    with pytest.raises(ValueError):
        parse_workload("doc-qa:burst=0.5")
