"""Builds the SGLang golden payloads in this folder from SGLang's documented event schema.

The structs below restate the *shape* SGLang's ``kv_events.py`` declares (field names, order,
defaults and msgspec options) for the two encodings; no SGLang code is used. Run
``python tests/data/sglang/build.py`` to rewrite the ``*.msgpack`` files; the tests rebuild
them in memory and demand the committed bytes (so an accidental change of either side shows).

* ``v0_5_15_*``: events are tagged arrays (``array_like=True, omit_defaults=True``);
* ``v0_5_18_*``: tagged arrays without ``omit_defaults`` (0.5.17+), salted stores with the
  eighth ``metadata`` element ``{"cache_salt": ...}`` (0.5.18-0.5.19);
* ``v0_5_23_*``: events are tagged maps with nil optionals omitted; the batch always has three
  slots (rank may be nil).

Hashes are signed int64 as SGLang publishes them (SHA-256 prefix as ``int64``), some negative.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import msgspec

HERE = Path(__file__).resolve().parent

# --- 0.5.15: arrays -------------------------------------------------------------------------


class Batch15(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    attn_dp_rank: int | None = None


class Event15(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored15(Event15, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None = None


class BlockRemoved15(Event15, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None = None


class AllBlocksCleared15(Event15, tag="AllBlocksCleared"):
    pass


# --- 0.5.17-0.5.19: arrays without omit_defaults; 0.5.18+ salted stores carry metadata ---


class Batch18(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[Any]
    attn_dp_rank: int | None = None


class Event18(msgspec.Struct, array_like=True, gc=False, tag=True):
    pass


class BlockStored18(Event18, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None = None


class Metadata18(msgspec.Struct, omit_defaults=True, gc=False):
    cache_salt: str


class BlockStoredWithMetadata18(BlockStored18, tag="BlockStored", kw_only=True):
    metadata: Metadata18


class BlockRemoved18(Event18, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None = None


class AllBlocksCleared18(Event18, tag="AllBlocksCleared"):
    pass


# --- 0.5.20+: maps --------------------------------------------------------------------------


class Batch23(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[Any]
    attn_dp_rank: int | None = None


class Event23(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored23(Event23, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int | tuple[int, int]]
    block_size: int
    lora_id: int | None
    medium: str | None = None
    cache_salt: str | None = None
    session_id: str | None = None
    lora_name: str | None = None


class BlockRemoved23(Event23, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None = None


class AllBlocksCleared23(Event23, tag="AllBlocksCleared"):
    pass


# Page size 4 in every fixture. Hash values: arbitrary int64s, several negative.
H1, H2, H3, HP = -8_070_450_532_247_928_832, 1_234_567_890_123_456_789, -5, 42
H4, H5, HPX = 7_000_000_000_000_000_001, -9_223_372_036_854_775_808, -77
T1, T2, T3 = [1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]


def v0_5_15_stream() -> list[bytes]:
    enc = msgspec.msgpack.Encoder()
    return [
        # two root pages, coalesced; then a child page; then the node's partial tail page
        enc.encode(
            Batch15(
                ts=1700000000.25,
                events=[
                    BlockStored15([H1, H2], None, T1 + T2, 4, None, "GPU"),
                    BlockStored15([H3], H2, T3, 4, None, "GPU"),
                    BlockStored15([HP], H3, [13, 14], 2, None, "GPU"),
                ],
                attn_dp_rank=0,
            )
        ),
        # host copy of the root pages (hicache write-back), then eviction of the leaf node
        # (child page + partial page) from the GPU; the batch omits its nil rank slot
        enc.encode(
            Batch15(
                ts=1700000001.5,
                events=[
                    BlockStored15([H1, H2], None, T1 + T2, 4, None, "CPU_PINNED"),
                    BlockRemoved15([H3, HP], "GPU"),
                ],
            )
        ),
        # 0.5.5-style: no medium at all, then a flush
        enc.encode(
            Batch15(
                ts=1700000002.0,
                events=[BlockStored15([H4], None, [20, 21, 22, 23], 4, None), AllBlocksCleared15()],
                attn_dp_rank=0,
            )
        ),
    ]


def v0_5_23_stream() -> list[bytes]:
    enc = msgspec.msgpack.Encoder()
    return [
        # attention-DP rank 1: salted LoRA store, a bigram (EAGLE3) page, and a partial tail
        enc.encode(
            Batch23(
                ts=1800000000.0,
                events=[
                    BlockStored23(
                        [H1, H2],
                        None,
                        T1 + T2,
                        4,
                        None,
                        "GPU",
                        cache_salt="tenant-a",
                        session_id="s-1",
                        lora_name="sql-lora",
                    ),
                    BlockStored23(
                        [H4],
                        H2,
                        [(9, 10), (10, 11), (11, 12), (12, 99)],
                        4,
                        None,
                        "GPU",
                        cache_salt="tenant-a",
                        lora_name="sql-lora",
                    ),
                    BlockStored23([HPX], H4, [30], 1, None, "GPU", cache_salt="tenant-a"),
                ],
                attn_dp_rank=1,
            )
        ),
        # a page in the shared external pool, a disk copy of a salted LoRA page, removals
        enc.encode(
            Batch23(
                ts=1800000001.0,
                events=[
                    BlockStored23([H5], None, [40, 41, 42, 43], 4, None, "EXTERNAL"),
                    BlockStored23(
                        [H1], None, T1, 4, None, "DISK", cache_salt="tenant-a", lora_name="sql-lora"
                    ),
                    BlockRemoved23([HPX, H4], "GPU"),
                    BlockRemoved23([H5], "EXTERNAL"),
                ],
                attn_dp_rank=1,
            )
        ),
        # nil rank slot (publisher without DP attention): the socket's rank applies
        enc.encode(Batch23(ts=1800000002.0, events=[AllBlocksCleared23()], attn_dp_rank=None)),
    ]


def v0_5_18_stream() -> list[bytes]:
    enc = msgspec.msgpack.Encoder()
    return [
        # a salted store (eighth element: metadata), then an unsalted one without a medium
        # (0.5.17+ still sends the nil slot), a removal and a flush
        enc.encode(
            Batch18(
                ts=1750000000.0,
                events=[
                    BlockStoredWithMetadata18(
                        [H1, H2],
                        None,
                        T1 + T2,
                        4,
                        None,
                        "GPU",
                        metadata=Metadata18(cache_salt="tenant-b"),
                    ),
                    BlockStored18([H3], None, T3, 4, None),
                    BlockRemoved18([H3], "GPU"),
                    AllBlocksCleared18(),
                ],
                attn_dp_rank=0,
            )
        ),
    ]


STREAMS = {"v0_5_15": v0_5_15_stream, "v0_5_18": v0_5_18_stream, "v0_5_23": v0_5_23_stream}


def write() -> None:
    for name, build in STREAMS.items():
        for i, payload in enumerate(build()):
            (HERE / f"{name}_{i}.msgpack").write_bytes(payload)


if __name__ == "__main__":
    write()
    sys.exit(0)
