"""Decode throughput of the SGLang and TRT-LLM event decoders (bytes in → normalised events,
and → KvIndex applied), against the checked per-event path measured in the same run.

Workload (seeded): batches of 200 BlockStored events of 8 pages × 16 tokens each (SGLang
0.5.23 map form; the same stores as TRT-LLM JSON envelopes), token ids below ``--vocab``
(default 32,000; 128,256 is Llama 3's, whose ids over 65,535 take 5 bytes in msgpack).

The SGLang typed path reads a store's token ids with the vLLM decoder's compiled loop
(``_fastwire``) into a uint32 array; the same path with msgspec reading them into a list of
Python ints (what it did before) runs beside it. Every path is timed once per round, the
paths taking turns in an order that rotates every round; a path's figure is its best round,
and the compiled-ids / msgspec-ids ratio is given per round.

    python benchmarks/bench_sglang.py           # default sizes (a few seconds)
    python benchmarks/bench_sglang.py --rounds 5 --vocab 128256

Writes benchmarks/results/bench_sglang.json (``--out``) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import time
from pathlib import Path

import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvplug.integrations.sglang.wire import SglangDecoder  # noqa: E402
from kvplug.integrations.trtllm.events import TrtllmDecoder  # noqa: E402

BLOCK = 16
PAGES = 8
EVENTS = 200


def workload(seed: int, vocab: int = 32000) -> tuple[bytes, bytes, int]:
    rng = random.Random(seed)
    events, envelopes, h = [], [], 1
    for i in range(EVENTS):
        hashes = list(range(h, h + PAGES))
        h += PAGES
        tokens = [rng.randrange(vocab) for _ in range(BLOCK * PAGES)]
        events.append(
            {
                "type": "BlockStored",
                "block_hashes": hashes,
                "parent_block_hash": None,
                "token_ids": tokens,
                "block_size": BLOCK,
                "lora_id": None,
                "medium": "GPU",
            }
        )
        envelopes.append(
            {
                "event_id": i,
                "window_size": 4096,
                "data": {
                    "type": "stored",
                    "parent_hash": None,
                    "blocks": [
                        {
                            "type": "stored_block",
                            "block_hash": bh,
                            "tokens": [
                                {"type": "unique_token", "token_id": t, "token_extra_id": 0}
                                for t in tokens[j * BLOCK : (j + 1) * BLOCK]
                            ],
                            "cache_level": 0,
                            "priority": 35,
                        }
                        for j, bh in enumerate(hashes)
                    ],
                },
            }
        )
    sg = msgspec.msgpack.encode([1.0, events, 0])
    trt = json.dumps(envelopes, separators=(",", ":")).encode()
    return sg, trt, EVENTS * PAGES


# the rows: compiled token ids against msgspec's, decode alone and with the index applied
DECODE = "sglang decode (typed, compiled token ids)"
DECODE_BEFORE = "sglang decode (typed, msgspec token ids: before)"
BASELINE = "sglang decode (checked path, baseline)"
APPLY = "sglang decode + KvIndex.apply_many (compiled token ids)"
APPLY_BEFORE = "sglang decode + KvIndex.apply_many (msgspec token ids: before)"


def timed(path) -> float:
    """One timed run of ``path``: ``(setup, run)``, ``run(setup())`` timed (setup: None)."""
    setup, run = path
    state = setup() if setup is not None else None
    t = time.perf_counter()
    run(state)
    return time.perf_counter() - t


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vocab", type=int, default=32000, help="token ids drawn below this")
    ap.add_argument(
        "--out", default=str(Path(__file__).resolve().parent / "results" / "bench_sglang.json")
    )
    args = ap.parse_args()
    sg, trt, blocks = workload(args.seed, args.vocab)

    fast = SglangDecoder("w", BLOCK)
    msgspec_ids = SglangDecoder("w", BLOCK)
    msgspec_ids._ids = None  # token ids read by msgspec into Python ints: the path before
    slow = SglangDecoder("w", BLOCK)
    slow._fast_order = ()  # the checked, per-event path: the baseline

    def trt_decode(_):
        TrtllmDecoder("w", BLOCK).decode(msgspec.json.decode(trt))

    paths = {
        DECODE: (None, lambda _: fast.decode(sg)),
        DECODE_BEFORE: (None, lambda _: msgspec_ids.decode(sg)),
        BASELINE: (None, lambda _: slow.decode(sg)),
        "trtllm JSON parse (msgspec) + decode": (None, trt_decode),
    }
    try:
        from kvplug.index import KvIndex

        def fresh_index():  # made before the clock: the rows time decode and apply alone
            index = KvIndex(block_size=BLOCK)
            index.add_endpoint("w", 0)
            return index

        def applied(dec):
            return fresh_index, lambda index: index.apply_many(dec.decode(sg))

        paths[APPLY] = applied(fast)
        paths[APPLY_BEFORE] = applied(msgspec_ids)
    except ImportError as exc:  # no compiled core built
        print(f"(KvIndex unavailable: {exc})")
    names = list(paths)
    for path in paths.values():
        timed(path)  # warm-up
    secs: dict[str, list[float]] = {n: [] for n in names}
    for r in range(args.rounds):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            secs[name].append(timed(paths[name]))
    best = {n: blocks / min(v) for n, v in secs.items()}
    base = best[BASELINE]
    print(
        f"workload: {blocks} blocks of {BLOCK} tokens, ids below {args.vocab:,}; "
        f"{args.rounds} rounds"
    )
    print(f"{'path':62s} {'blocks/s':>12s} {'tokens/s':>14s} {'vs baseline':>12s}")
    for name in names:
        print(
            f"{name:62s} {best[name]:12,.0f} {best[name] * BLOCK:14,.0f} {best[name] / base:11.2f}x"
        )
    ratios = {}
    for what, (before, after) in {
        "decode": (DECODE_BEFORE, DECODE),
        "decode_apply": (APPLY_BEFORE, APPLY),
    }.items():
        if before not in secs:
            continue
        per_round = [b / a for b, a in zip(secs[before], secs[after], strict=True)]
        ratios[what] = {"min": min(per_round), "max": max(per_round), "per_round": per_round}
        print(
            f"compiled token ids against msgspec's, {what}: {min(per_round):.2f}-"
            f"{max(per_round):.2f}x by round"
        )
    out = Path(args.out)
    out.parent.mkdir(exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "workload": {
                    "events": EVENTS,
                    "pages_per_event": PAGES,
                    "block_size": BLOCK,
                    "seed": args.seed,
                    "rounds": args.rounds,
                    "vocab": args.vocab,
                },
                "machine": platform.platform(),
                "python": platform.python_version(),
                "results": [
                    {"path": n, "blocks_per_s": best[n], "vs_baseline": best[n] / base}
                    for n in names
                ],
                "compiled_over_msgspec_ids": ratios,
            },
            indent=2,
        )
    )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
