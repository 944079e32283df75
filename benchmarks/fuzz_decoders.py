"""Fuzz every engine's KV-event decoder: inputs tried, crashes, escaped exceptions, malformed
events out, compiled-vs-msgspec disagreements. Every figure but the first must be zero.

Decoders (each gets ``--inputs`` inputs; the contract is "never raises, counts what it drops"):

* ``vllm-fast``: ``BatchDecoder.decode`` (the compiled one-pass path, msgspec behind it); every
  batch the compiled path accepts is also decoded by the msgspec path and must give the same
  events (``compare_paths``: one contract for both);
* ``vllm-msgspec``: ``BatchDecoder.decode_msgspec`` alone;
* ``sglang``: ``SglangDecoder.decode`` (typed fast path with the compiled token and hash
  readers, per-event slow path, partial pages); every input also goes to a second decoder of
  the same stream whose batches all take the checked path, which must give the same events,
  counts and partial pages wherever the typed path took the batch (``compare_paths``);
* ``trtllm-json``: what the TRT-LLM poller does with a drained answer's body:
  ``parse_answer`` (JSON) then ``TrtllmDecoder.decode`` (per-rank state kept across inputs);
  every answer also goes, as a plain JSON decode, to a second decoder of the same stream (the
  checked reader), which must give the same events, counts and state (``compare_readers``).

Inputs (seeded): valid batches from kvplug's encoders (every vLLM version and hash form, the
map-encoded batch, SGLang's three forms, the TRT-LLM fixtures), then mutated: structured
(decode, replace / drop / add / duplicate a random node with a hostile value: wrong types,
huge ints, deep nesting, huge claimed lengths, NaN) and byte-level (flip, insert, delete,
truncate, splice two inputs). Part of each decoder's budget (``--atheris-inputs``) runs
coverage-guided under atheris (libFuzzer) in a subprocess, seeded with the same valid batches,
the Python decoders instrumented; a libFuzzer-detected crash (or a hang) counts as a crash.

Figures per decoder: inputs (random + atheris), inputs/s, batches accepted, crashes, escapes
(an exception out of the decoder), bad events (an output event breaking kvplug's event
invariants), disagreements (``vllm-fast``, ``sglang``, ``trtllm-json``). Baseline in the same
run: the reproducers issue 9 filed (deep nesting, the four fast-path disagreements) go through
the same checks first.

    python benchmarks/fuzz_decoders.py                       # 1,000,000 inputs per decoder
    python benchmarks/fuzz_decoders.py --inputs 20000 --atheris-inputs 0 --out /tmp/f.json
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import logging
import math
import os
import platform
import random
import struct
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

if "--atheris-worker" in sys.argv:  # coverage-guided worker: the decoders are instrumented
    import atheris

    _decoders_import: Any = atheris.instrument_imports(include=["kvplug.integrations"])
else:
    _decoders_import = contextlib.nullcontext()
with _decoders_import:
    from kvplug.integrations.sglang.wire import SglangDecoder
    from kvplug.integrations.sglang.wire import compare_paths as sglang_compare_paths
    from kvplug.integrations.sglang.wire import encode_batch as sglang_batch
    from kvplug.integrations.trtllm.events import TrtllmDecoder
    from kvplug.integrations.trtllm.poller import compare_readers
    from kvplug.integrations.vllm.wire import FAST_PATH, BatchDecoder, compare_paths
    from kvplug.integrations.vllm.wire import encode_batch as vllm_batch

    from kvplug.events import AllCleared, BlockMoved, BlockRemoved, BlockStored, Tier

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data"
RESULTS = ROOT / "benchmarks" / "results"
DECODERS = ("vllm-fast", "vllm-msgspec", "sglang", "trtllm-json")
MASK64 = (1 << 64) - 1
BS = 4  # block size / page size / tokens_per_block of every generated store
_mp = msgspec.msgpack.Encoder()
_mp_any = msgspec.msgpack.Decoder()

# -------------------------------------------------------------------------------------------
# Valid seeds
# -------------------------------------------------------------------------------------------


def _kv_events(rng: random.Random, *, tier_copies: bool = True) -> list:
    evs: list = []
    for _ in range(rng.randrange(0, 6)):
        r = rng.random()
        n = rng.randrange(0, 4)
        hs = [rng.getrandbits(64) for _ in range(n)]
        if r < 0.5:
            evs.append(
                BlockStored(
                    worker_id="w",
                    engine_hashes=hs,
                    block_size=BS,
                    parent_engine_hash=rng.choice([None, rng.getrandbits(64)]),
                    token_ids=[
                        rng.randrange(rng.choice([128, 70000, 2**32])) for _ in range(BS * n)
                    ],
                    tier=rng.choice(list(Tier)),
                    lora_name=rng.choice([None, None, "ad"]),
                    cache_salt=rng.choice([None, None, "s"]),
                )
            )
        elif r < 0.6 and tier_copies:
            evs.append(BlockStored(worker_id="w", engine_hashes=hs, tier_copy=True, tier=Tier.HOST))
        elif r < 0.95:
            evs.append(BlockRemoved(worker_id="w", engine_hashes=hs, tier=rng.choice(list(Tier))))
        else:
            evs.append(AllCleared(worker_id="w"))
    return evs


VLLM_VERSIONS = ["0.9.0", "0.9.2", "0.10.2", "0.17.0", "0.20.0", "0.23.0", "0.24.0", "0.32.0"]


def vllm_seed(rng: random.Random) -> bytes:
    version = rng.choice(VLLM_VERSIONS)
    payload = vllm_batch(
        _kv_events(rng),
        version,
        ts=rng.random() * 1e9,
        dp_rank=rng.randrange(3),
        hash_form=rng.choice(["uint64", "int64", "bytes"]),
    )
    if rng.random() < 0.15:  # the map-encoded batch (issue 11)
        ts, events, *rank = _mp_any.decode(payload)
        batch: dict[str, Any] = {"ts": ts, "events": events}
        if rank and rank[0] is not None:
            batch["data_parallel_rank"] = rank[0]
        payload = _mp.encode(batch)
    return payload


def sglang_seed(rng: random.Random) -> bytes:
    form = rng.choice(["0.5.15", "0.5.18", "0.5.23"])
    evs = []
    for e in _kv_events(rng, tier_copies=False):
        if isinstance(e, BlockStored):
            if form != "0.5.23":
                e = msgspec.structs.replace(e, lora_name=None)
            if form == "0.5.15":
                e = msgspec.structs.replace(e, cache_salt=None)
            if rng.random() < 0.1:  # a partial tail page
                e = msgspec.structs.replace(
                    e, engine_hashes=e.engine_hashes[:1], token_ids=[1], block_size=1
                )
        evs.append(e)
    return sglang_batch(evs, form, ts=rng.random(), attn_dp_rank=rng.choice([None, 0, 1]))


def _trt_envelopes(rng: random.Random, next_id: Iterator[int]) -> list:
    out = []
    for _ in range(rng.randrange(0, 5)):
        eid = next(next_id)
        r = rng.random()
        if r < 0.05:
            data: dict = {"type": "created", "num_blocks_per_cache_level": [1024, 4096]}
        elif r < 0.55:
            blocks = []
            for _ in range(rng.randrange(1, 4)):
                toks = BS if rng.random() < 0.9 else rng.randrange(1, BS)
                blocks.append(
                    {
                        "type": "stored_block",
                        "block_hash": rng.getrandbits(64),
                        "tokens": [
                            {
                                "type": "unique_token",
                                "token_id": rng.randrange(70000),
                                "token_extra_id": 0,
                            }
                            for _ in range(toks)
                        ],
                        "cache_level": rng.choice([0, 0, 1]),
                        "priority": 35,
                        "lora_id": rng.choice([None, 0, 3]),
                    }
                )
            data = {
                "type": "stored",
                "parent_hash": rng.choice([None, rng.getrandbits(64)]),
                "blocks": blocks,
            }
        elif r < 0.85:
            data = {
                "type": "removed",
                "block_hashes": [rng.getrandbits(64) for _ in range(rng.randrange(1, 4))],
            }
        else:
            data = {
                "type": "updated",
                "block_hash": rng.getrandbits(64),
                "cache_level": {"old_value": 0, "new_value": 1},
            }
        env = {"event_id": eid, "data": data, "window_size": 4096}
        if rng.random() < 0.3:
            env["attention_dp_rank"] = rng.randrange(2)
        out.append(env)
    return out


_TRT_FIXTURES = [
    json.dumps(json.loads((DATA / "trtllm" / name).read_bytes())).encode()
    for name in ("v1_events.json", "v2026_vswa_adp_events.json")
]
_SG_FIXTURES = [p.read_bytes() for p in sorted((DATA / "sglang").glob("*.msgpack"))]


_TRT_EVENT_IDS = itertools.count()  # consecutive across answers, as one engine's stream


def trtllm_seed(rng: random.Random) -> bytes:
    if rng.random() < 0.05:
        return rng.choice(_TRT_FIXTURES)
    return json.dumps(_trt_envelopes(rng, _TRT_EVENT_IDS)).encode()


# -------------------------------------------------------------------------------------------
# Mutation
# -------------------------------------------------------------------------------------------


def _deep(rng: random.Random) -> Any:
    v: Any = None
    for _ in range(rng.choice([40, 400, 1200, 3000])):
        v = [v]
    return v


_WORDS = [
    "GPU",
    "CPU",
    "CPU_PINNED",
    "STORAGE",
    "DISK",
    "EXTERNAL",
    "gpu",
    "full_attention",
    "sliding_window",
    "BlockStored",
    "BlockRemoved",
    "AllBlocksCleared",
    "stored",
    "removed",
    "updated",
    "created",
    "é",
]
_HOSTILE: list[Callable[[random.Random], Any]] = [
    lambda rng: None,
    lambda rng: True,
    lambda rng: -1,
    lambda rng: 0,
    lambda rng: rng.getrandbits(64),
    lambda rng: -(2**63),
    lambda rng: 2**64,  # past u64: msgpack cannot carry it (the mutation is skipped)
    lambda rng: 1.5,
    lambda rng: float("nan"),
    lambda rng: "",
    lambda rng: "x" * rng.randrange(1, 40),
    lambda rng: rng.choice(_WORDS),
    lambda rng: b"",
    lambda rng: rng.randbytes(rng.choice([1, 8, 32, 33])),
    lambda rng: [],
    lambda rng: {},
    lambda rng: [rng.randrange(2**32) for _ in range(rng.randrange(1, 9))],
    lambda rng: [None, [1, "s"]],
    lambda rng: {"type": rng.choice(["BlockStored", "stored"]), "a": 1},
    _deep,
    lambda rng: [[rng.getrandbits(64)]],
    lambda rng: list(range(rng.choice([1, 100, 5000]))),
]


def _hostile(rng: random.Random) -> Any:
    return rng.choice(_HOSTILE)(rng)


def _mutate_tree(obj: Any, rng: random.Random) -> Any:
    """Replace, drop, add or duplicate one random node of a decoded value."""
    if isinstance(obj, list) and obj and rng.random() < 0.8:
        i = rng.randrange(len(obj))
        r = rng.random()
        if r < 0.55:
            obj[i] = _mutate_tree(obj[i], rng)
        elif r < 0.75:
            obj[i] = _hostile(rng)
        elif r < 0.85:
            del obj[i]
        elif r < 0.93:
            obj.insert(i, obj[i] if rng.random() < 0.5 else _hostile(rng))
        else:
            obj.append(_hostile(rng))
        return obj
    if isinstance(obj, dict) and obj and rng.random() < 0.8:
        k = rng.choice(list(obj))
        r = rng.random()
        if r < 0.55:
            obj[k] = _mutate_tree(obj[k], rng)
        elif r < 0.75:
            obj[k] = _hostile(rng)
        elif r < 0.85:
            del obj[k]
        else:
            obj[
                rng.choice(
                    [
                        k + "_",
                        "type",
                        "medium",
                        "lora_id",
                        "extra_keys",
                        "future",
                        "event_id",
                        "attention_dp_rank",
                        "data_parallel_rank",
                    ]
                )
            ] = _hostile(rng)
        return obj
    return _hostile(rng)


def _encode(obj: Any, as_json: bool) -> bytes | None:
    try:
        if as_json:
            return json.dumps(obj).encode()  # NaN becomes the non-standard NaN token: good too
        return _mp.encode(obj)
    except (TypeError, OverflowError, ValueError, RecursionError, UnicodeEncodeError):
        return None


def _dup_map_key(payload: bytes, rng: random.Random) -> bytes:
    """A fixmap header whose count is one higher: a key repeated or a value read as a key."""
    idx = [i for i, b in enumerate(payload[:200]) if 0x81 <= b <= 0x8E]
    if not idx:
        return payload
    i = rng.choice(idx)
    return payload[:i] + bytes([payload[i] + 1]) + payload[i + 1 :]


def mutate_bytes(payload: bytes, rng: random.Random, other: bytes) -> bytes:
    b = bytearray(payload)
    for _ in range(rng.choice([1, 1, 1, 2, 4])):
        r = rng.random()
        n = len(b)
        if r < 0.3 and n:
            b[rng.randrange(n)] = rng.getrandbits(8)
        elif r < 0.45:
            i = rng.randrange(n + 1)
            b[i:i] = rng.randbytes(rng.randrange(1, 5))
        elif r < 0.6 and n:
            i = rng.randrange(n)
            del b[i : i + rng.randrange(1, 9)]
        elif r < 0.7 and n:
            del b[rng.randrange(n) :]
        elif r < 0.8:
            i = rng.randrange(n + 1)
            j = rng.randrange(len(other) + 1)
            b = b[:i] + bytearray(other[j:])
        elif r < 0.9 and n:  # an interesting byte: a length header or a type marker
            b[rng.randrange(n)] = rng.choice(
                [
                    0xC0,
                    0xC1,
                    0xC2,
                    0xCB,
                    0xCF,
                    0xD3,
                    0xDC,
                    0xDD,
                    0xDE,
                    0xDF,
                    0xDB,
                    0xC6,
                    0x91,
                    0x81,
                    0xFF,
                    0x7F,
                    ord("["),
                    ord("{"),
                    ord('"'),
                    ord("-"),
                    ord("9"),
                ]
            )
        else:
            b = bytearray(_dup_map_key(bytes(b), rng))
    return bytes(b)


class Inputs:
    """The seeded input stream of one decoder: seeds, structured and byte-level mutations."""

    def __init__(self, seed_fn: Callable[[random.Random], bytes], as_json: bool, seed: int):
        self.rng = random.Random(seed)
        self.seed_fn = seed_fn
        self.as_json = as_json
        self.pool = [seed_fn(self.rng) for _ in range(64)]
        if not as_json and seed_fn is sglang_seed:
            self.pool += _SG_FIXTURES

    def __next__(self) -> bytes:
        rng = self.rng
        base = rng.choice(self.pool)
        r = rng.random()
        if r < 0.1:
            out = self.seed_fn(rng)
            self.pool[rng.randrange(len(self.pool))] = out  # keep the pool moving
            return out
        if r < 0.65:
            try:
                obj = json.loads(base) if self.as_json else _mp_any.decode(base)
            except (ValueError, RecursionError):
                return mutate_bytes(base, rng, rng.choice(self.pool))
            for _ in range(rng.choice([1, 1, 2, 3])):
                obj = _mutate_tree(obj, rng)
            enc = _encode(obj, self.as_json)
            if enc is not None:
                return enc
        return mutate_bytes(base, rng, rng.choice(self.pool))


# -------------------------------------------------------------------------------------------
# Targets: run one input, check the output
# -------------------------------------------------------------------------------------------


def _check_events(events: list, *, ranks_ok: bool = True) -> str | None:
    """kvplug's event invariants: what the index may assume of any decoder's output."""
    for e in events:
        if isinstance(e, AllCleared):
            if not isinstance(e.dp_rank, int) or (ranks_ok and e.dp_rank < 0):
                return f"AllCleared rank {e.dp_rank!r}"
            continue
        if not isinstance(e, (BlockStored, BlockRemoved, BlockMoved)):
            return f"not an event: {type(e).__name__}"
        hs = [int(h) for h in e.engine_hashes]
        if not hs or any(not 0 <= h <= MASK64 for h in hs):
            return f"{type(e).__name__} hashes {hs[:4]}"
        if isinstance(e, BlockStored):
            if e.parent_engine_hash is not None and not 0 <= e.parent_engine_hash <= MASK64:
                return f"parent {e.parent_engine_hash}"
            if e.tier_copy:
                continue
            toks = [int(t) for t in e.token_ids]
            if e.block_size <= 0 or len(toks) != len(hs) * e.block_size:
                return f"{len(toks)} tokens for {len(hs)} blocks of {e.block_size}"
            if any(not 0 <= t < 2**32 for t in toks):
                return "token outside u32"
            if e.block_extra is not None and len(e.block_extra) != len(hs):
                return "block_extra length"
    return None


class Target:
    """One decoder under test; ``run`` returns (accepted, bad-event reason, disagreement)."""

    name = ""
    as_json = False

    def seed_fn(self, rng: random.Random) -> bytes:
        raise NotImplementedError

    def run(self, payload: bytes) -> tuple[bool, str | None, str | None]:
        raise NotImplementedError


class VllmFast(Target):
    name = "vllm-fast"

    def __init__(self) -> None:
        self.n = 0
        self.dec = BatchDecoder("w")

    def seed_fn(self, rng):
        return vllm_seed(rng)

    def run(self, payload):
        self.n += 1
        if self.n % 5000 == 0:
            self.dec = BatchDecoder("w")  # group kinds learned: keep the fast path reachable
        before = self.dec.stats.fast_batches
        got = self.dec.decode(payload, 1)
        accepted = got is not None
        bad = None if got is None else _check_events(got.events)
        disagree = None
        if self.dec.stats.fast_batches != before:
            disagree = compare_paths(payload, 0, 1)
        return accepted, bad, disagree


class VllmMsgspec(Target):
    name = "vllm-msgspec"

    def __init__(self) -> None:
        self.n = 0
        self.dec = BatchDecoder("w")

    def seed_fn(self, rng):
        return vllm_seed(rng)

    def run(self, payload):
        self.n += 1
        if self.n % 5000 == 0:
            self.dec = BatchDecoder("w")
        got = self.dec.decode_msgspec(payload, 1)
        return got is not None, None if got is None else _check_events(got.events), None


class Sglang(Target):
    name = "sglang"

    def __init__(self) -> None:
        self.n = 0
        self.dec = SglangDecoder("w", BS)
        self.checked = SglangDecoder("w", BS)  # the same stream, every batch checked per event

    def seed_fn(self, rng):
        return sglang_seed(rng)

    def run(self, payload):
        self.n += 1
        if self.n % 5000 == 0:
            self.dec, self.checked = SglangDecoder("w", BS), SglangDecoder("w", BS)
        before = self.dec.counts["batches"]
        events, disagree = sglang_compare_paths(payload, self.dec, self.checked, dp_rank=1)
        return self.dec.counts["batches"] != before, _check_events(events), disagree


class TrtllmJson(Target):
    name = "trtllm-json"
    as_json = True

    def __init__(self) -> None:
        self.n = 0
        self.dec = TrtllmDecoder("w", BS)
        self.checked = TrtllmDecoder("w", BS)  # the same stream as dicts: the checked reader

    def seed_fn(self, rng):
        return trtllm_seed(rng)

    def run(self, payload):
        self.n += 1
        if self.n % 5000 == 0:
            self.dec, self.checked = TrtllmDecoder("w", BS), TrtllmDecoder("w", BS)
        events, disagree = compare_readers(payload, self.dec, self.checked)
        if events is None:
            return False, None, disagree
        return True, _check_events(events), disagree


TARGETS: dict[str, type[Target]] = {t.name: t for t in (VllmFast, VllmMsgspec, Sglang, TrtllmJson)}


class Tally:
    def __init__(self) -> None:
        self.inputs = 0
        self.accepted = 0
        self.escapes = 0
        self.bad_events = 0
        self.disagreements = 0
        self.examples: list[dict[str, str]] = []

    def one(self, target: Target, payload: bytes) -> None:
        self.inputs += 1
        try:
            accepted, bad, disagree = target.run(payload)
        except Exception as exc:  # the contract says never: record it
            self.escapes += 1
            self._example(
                "escape", payload, f"{type(exc).__name__}: {exc}\n" + traceback.format_exc(limit=-3)
            )
            return
        self.accepted += accepted
        if bad is not None:
            self.bad_events += 1
            self._example("bad_event", payload, bad)
        if disagree is not None:
            self.disagreements += 1
            self._example("disagreement", payload, disagree)

    def _example(self, kind: str, payload: bytes, why: str) -> None:
        if sum(e["kind"] == kind for e in self.examples) < 5:
            self.examples.append({"kind": kind, "hex": payload[:2000].hex(), "why": why[:2000]})


# -------------------------------------------------------------------------------------------
# atheris (coverage-guided): a worker subprocess per decoder
# -------------------------------------------------------------------------------------------


def atheris_available() -> bool:
    try:
        import atheris  # noqa: F401
    except ImportError:
        return False
    return True


def atheris_worker(target_name: str, runs: int, stats_path: Path, corpus: Path) -> None:
    import atheris

    target = TARGETS[target_name]()
    tally = Tally()

    def flush() -> None:
        stats_path.write_text(json.dumps(tally.__dict__))

    def one_input(data: bytes) -> None:
        found = tally.escapes + tally.bad_events + tally.disagreements
        tally.one(target, data)
        # libFuzzer exits without Python's shutdown: write often enough to lose nothing
        if (
            tally.inputs % 1000 == 0
            or tally.inputs >= runs - 1
            or found != (tally.escapes + tally.bad_events + tally.disagreements)
        ):
            flush()

    flush()
    atheris.Setup(
        [
            sys.argv[0],
            f"-runs={runs}",
            "-seed=1",
            "-max_len=8192",
            "-timeout=20",
            "-rss_limit_mb=3072",
            "-print_final_stats=1",
            str(corpus),
        ],
        one_input,
    )
    atheris.Fuzz()


def run_atheris(target_name: str, runs: int, seed_fn, seed: int, log: Path) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix=f"fuzz-{target_name}-") as tmp:
        corpus = Path(tmp) / "corpus"
        corpus.mkdir()
        rng = random.Random(seed)
        for i in range(200):
            (corpus / f"seed{i}").write_bytes(seed_fn(rng))
        stats = Path(tmp) / "stats.json"
        t0 = time.perf_counter()
        proc = subprocess.run(
            [
                sys.executable,
                __file__,
                "--atheris-worker",
                target_name,
                "--inputs",
                str(runs),
                "--stats",
                str(stats),
                "--corpus",
                str(corpus),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            cwd=tmp,
        )
        seconds = time.perf_counter() - t0
        out = proc.stdout.decode(errors="replace")
        log.write_text(out)
        done = [line for line in out.splitlines() if line.startswith("Done ")]
        tally = json.loads(stats.read_text()) if stats.exists() else {}
        executed = int(done[-1].split()[1]) if done else tally.get("inputs", 0)
        return {
            "inputs": executed,
            "seconds": seconds,
            "crashed": proc.returncode != 0,
            "returncode": proc.returncode,
            "tally": tally,
            "coverage": next((line for line in reversed(out.splitlines()) if " cov: " in line), ""),
        }


# -------------------------------------------------------------------------------------------
# Main
# -------------------------------------------------------------------------------------------

ISSUE_9 = [
    b"\x92\xcb" + struct.pack(">d", 1.0) + b"\x91" * 2000 + b"\xc0",
    bytes.fromhex(
        "93cb3ff00000000000009182a474797065b0416c6c426c6f636b73436c6561726564a66d656469756d0500"
    ),
    _mp.encode([1.0, [["BlockStored", [7], None, [1], 1, [1], "GPU", "ad"]], 0]),
    _mp.encode(
        [
            1.0,
            [
                {
                    "type": "BlockStored",
                    "block_hashes": [7],
                    "parent_block_hash": None,
                    "token_ids": [1],
                    "block_size": 1,
                    "lora_id": None,
                    "medium": "GPU",
                    "lora_name": None,
                    "kv_cache_spec_sliding_window": "x",
                }
            ],
            0,
        ]
    ),
    _mp.encode(
        [
            1.0,
            [
                {
                    "type": "BlockStored",
                    "block_hashes": [7],
                    "parent_block_hash": None,
                    "token_ids": [],
                    "block_size": 0,
                    "lora_id": None,
                    "medium": "CPU",
                    "lora_name": None,
                    "extra_keys": 5,
                }
            ],
            0,
        ]
    ),
]
ISSUE_9_JSON = [b"[" * 5000 + b"]" * 5000]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--inputs", type=int, default=1_000_000, help="inputs per decoder")
    ap.add_argument(
        "--atheris-inputs",
        type=int,
        default=50_000,
        help="of each decoder's inputs, how many run coverage-guided (0: none)",
    )
    ap.add_argument("--decoders", default=",".join(DECODERS))
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", type=Path, default=RESULTS / "fuzz_decoders.json")
    ap.add_argument("--atheris-worker", help=argparse.SUPPRESS)
    ap.add_argument("--stats", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--corpus", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    sys.setrecursionlimit(1000)  # the interpreter's default, whatever the caller set
    logging.disable(logging.CRITICAL)  # every drop is logged (rate-limited): counted here instead
    if args.atheris_worker:
        atheris_worker(args.atheris_worker, args.inputs, args.stats, args.corpus)
        return 0

    names = [n for n in args.decoders.split(",") if n]
    if not FAST_PATH and "vllm-fast" in names:
        print(
            "compiled fast path not built: vllm-fast would test the msgspec path", file=sys.stderr
        )
        return 2
    use_atheris = args.atheris_inputs > 0 and atheris_available()
    if args.atheris_inputs > 0 and not use_atheris:
        print("atheris not installed (pip install 'kvplug[fuzz]'): random mutation only")
    print(
        f"fuzz_decoders: {args.inputs:,} inputs per decoder, seed {args.seed}, "
        f"{args.atheris_inputs if use_atheris else 0:,} of them coverage-guided (atheris)"
    )

    # baseline: issue 9's reproducers through the same checks
    baseline = {}
    for name in names:
        target, tally = TARGETS[name](), Tally()
        for payload in ISSUE_9_JSON if TARGETS[name].as_json else ISSUE_9:
            tally.one(target, payload)
        baseline[name] = {k: v for k, v in tally.__dict__.items() if k != "examples"}
        baseline[name]["examples"] = tally.examples

    rows = []
    header = (
        f"{'decoder':<13} {'inputs':>10} {'random':>10} {'atheris':>9} {'inputs/s':>9} "
        f"{'accepted':>9} {'crashes':>7} {'escapes':>7} {'bad ev':>6} {'disagree':>8}"
    )
    for i, name in enumerate(names):
        target = TARGETS[name]()
        n_ath = min(args.inputs, args.atheris_inputs) if use_atheris else 0
        n_rand = args.inputs - n_ath
        inputs = Inputs(target.seed_fn, target.as_json, args.seed * 1000 + i)
        tally = Tally()
        t0 = time.perf_counter()
        last = t0
        for k in range(n_rand):
            tally.one(target, next(inputs))
            if k % 2048 == 0 and time.perf_counter() - last > 5:
                last = time.perf_counter()
                rate = tally.inputs / (last - t0)
                print(
                    f"  {name:<13} {tally.inputs:>10,}/{n_rand:,} random  {rate:>8,.0f}/s  "
                    f"escapes {tally.escapes}  bad {tally.bad_events}  "
                    f"disagree {tally.disagreements}",
                    flush=True,
                )
        rand_s = time.perf_counter() - t0
        ath: dict[str, Any] = {"inputs": 0, "seconds": 0.0, "crashed": False, "tally": {}}
        if n_ath:
            print(f"  {name:<13} atheris: {n_ath:,} coverage-guided inputs ...", flush=True)
            log = Path(tempfile.gettempdir()) / f"fuzz_decoders-{name}-atheris.log"
            ath = run_atheris(name, n_ath, target.seed_fn, args.seed, log)
            ath["log"] = str(log)
            print(
                f"  {name:<13} atheris: {ath['inputs']:,} inputs in {ath['seconds']:.0f} s, "
                f"{ath.get('coverage', '').strip()}",
                flush=True,
            )
        at = ath["tally"]
        total = tally.inputs + ath["inputs"]
        secs = rand_s + ath["seconds"]
        row = {
            "decoder": name,
            "inputs": total,
            "random_inputs": tally.inputs,
            "atheris_inputs": ath["inputs"],
            "seconds": round(secs, 1),
            "inputs_per_s": round(total / secs) if secs else None,
            "random_inputs_per_s": round(tally.inputs / rand_s) if rand_s else None,
            "accepted_batches": tally.accepted + at.get("accepted", 0),
            "crashes": int(ath["crashed"]),
            "escapes": tally.escapes + at.get("escapes", 0),
            "bad_events": tally.bad_events + at.get("bad_events", 0),
            "disagreements": tally.disagreements + at.get("disagreements", 0),
            "atheris_coverage": ath.get("coverage", ""),
            "examples": tally.examples + at.get("examples", []),
        }
        rows.append(row)
        print(header if i == 0 else "", end="\n" if i == 0 else "")
        print(
            f"{name:<13} {total:>10,} {tally.inputs:>10,} {ath['inputs']:>9,} "
            f"{row['inputs_per_s'] or 0:>9,} {row['accepted_batches']:>9,} {row['crashes']:>7} "
            f"{row['escapes']:>7} {row['bad_events']:>6} {row['disagreements']:>8}",
            flush=True,
        )

    print("\n" + header)
    for r in rows:
        print(
            f"{r['decoder']:<13} {r['inputs']:>10,} {r['random_inputs']:>10,} "
            f"{r['atheris_inputs']:>9,} {r['inputs_per_s'] or 0:>9,} {r['accepted_batches']:>9,} "
            f"{r['crashes']:>7} {r['escapes']:>7} {r['bad_events']:>6} {r['disagreements']:>8}"
        )
    print(
        "baseline (issue 9's reproducers): "
        + ", ".join(
            f"{n}: {b['inputs']} in, {b['escapes']} escapes, {b['disagreements']} disagreements"
            for n, b in baseline.items()
        )
    )
    failures = sum(r["crashes"] + r["escapes"] + r["bad_events"] + r["disagreements"] for r in rows)
    failures += sum(b["escapes"] + b["bad_events"] + b["disagreements"] for b in baseline.values())
    result = {
        "benchmark": "fuzz_decoders",
        "command": "python benchmarks/fuzz_decoders.py " + " ".join(sys.argv[1:]),
        "params": {
            "inputs_per_decoder": args.inputs,
            "atheris_inputs": args.atheris_inputs,
            "atheris_used": use_atheris,
            "seed": args.seed,
            "decoders": names,
        },
        "machine": {
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
        },
        "baseline_issue9_reproducers": baseline,
        "decoders": rows,
        "all_zero": failures == 0,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            result,
            indent=2,
            default=lambda o: None if isinstance(o, float) and math.isnan(o) else str(o),
        )
        + "\n"
    )
    print(
        f"wrote {args.out}; crashes, escapes, bad events, disagreements all zero: {failures == 0}"
    )
    return 0 if failures == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
