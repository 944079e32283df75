"""Decode throughput of the SGLang and TRT-LLM event decoders (bytes in → normalised events,
and → KvIndex applied), against the checked per-event path measured in the same run.

Workload (seeded): batches of 200 BlockStored events of 8 pages × 16 tokens each (SGLang
0.5.23 map form; the same stores as TRT-LLM JSON envelopes), token ids < 32,000.

    python benchmarks/bench_sglang.py           # default sizes (a few seconds)
    python benchmarks/bench_sglang.py --rounds 5

Writes benchmarks/results/bench_sglang.json and prints a table.
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


def workload(seed: int) -> tuple[bytes, bytes, int]:
    rng = random.Random(seed)
    events, envelopes, h = [], [], 1
    for i in range(EVENTS):
        hashes = list(range(h, h + PAGES))
        h += PAGES
        tokens = [rng.randrange(32000) for _ in range(BLOCK * PAGES)]
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


def rate(fn, blocks: int, rounds: int) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(rounds):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return blocks / best


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    sg, trt, blocks = workload(args.seed)

    fast = SglangDecoder("w", BLOCK)
    slow = SglangDecoder("w", BLOCK)
    slow._fast_order = ()  # the checked, per-event path: the baseline

    def trt_decode():
        TrtllmDecoder("w", BLOCK).decode(msgspec.json.decode(trt))

    rows = [
        ("sglang decode (typed fast path)", rate(lambda: fast.decode(sg), blocks, args.rounds)),
        (
            "sglang decode (checked path, baseline)",
            rate(lambda: slow.decode(sg), blocks, args.rounds),
        ),
        ("trtllm JSON parse (msgspec) + decode", rate(trt_decode, blocks, args.rounds)),
    ]
    try:
        from kvplug.index import KvIndex

        def sg_apply():
            index = KvIndex(block_size=BLOCK)
            index.add_endpoint("w", 0)
            index.apply_many(fast.decode(sg))

        rows.append(("sglang decode + KvIndex.apply_many", rate(sg_apply, blocks, args.rounds)))
    except ImportError as exc:  # no compiled core built
        print(f"(KvIndex unavailable: {exc})")
    base = rows[1][1]
    print(f"{'path':42s} {'blocks/s':>12s} {'tokens/s':>14s} {'vs baseline':>12s}")
    for name, r in rows:
        print(f"{name:42s} {r:12,.0f} {r * BLOCK:14,.0f} {r / base:11.2f}x")
    out = Path(__file__).resolve().parent / "results" / "bench_sglang.json"
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
                },
                "machine": platform.platform(),
                "python": platform.python_version(),
                "results": [
                    {"path": n, "blocks_per_s": r, "vs_baseline": r / base} for n, r in rows
                ],
            },
            indent=2,
        )
    )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
