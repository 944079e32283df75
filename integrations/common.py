"""Normalisation shared by the engine integrations' event decoders and test encoders.

Engines publish 64-bit block hashes as uint64 or int64 (msgpack picks the signed form for
values with the top bit set when the engine hashes into a signed type); kvplug keys them as
u64. A malformed field costs one event, counted by ``reason``, never the batch or the thread.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec
import numpy as np

from kvplug import BlockRemoved, BlockStored, KvEvent, Tier

MASK64 = (1 << 64) - 1
# What decoding hostile bytes may raise: msgspec's errors, and RecursionError for values nested
# past the interpreter's recursion limit (a few bytes of b"\x91" make thousands of levels).
DECODE_ERRORS: tuple[type[Exception], ...] = (msgspec.DecodeError, RecursionError)


class EventDrop(ValueError):
    """One event (or batch) is unusable; ``reason`` is the counter key, ``detail`` the why."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(detail or reason)
        self.reason = reason
        self.detail = detail


def u64_hash(value: Any, what: str) -> int:
    """An integer hash in int64 or uint64 range -> u64; anything else raises
    ``EventDrop("bad_hash")`` naming ``what``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise EventDrop("bad_hash", f"{what} is {type(value).__name__}, not an integer")
    if not -(1 << 63) <= value <= MASK64:
        raise EventDrop("bad_hash", f"{what} {value} is outside int64/uint64")
    return value & MASK64


def int64_hash(h: int) -> int:
    """u64 -> the signed int64 an engine puts on the wire (inverse of ``u64_hash``)."""
    h &= MASK64
    return h - (1 << 64) if h >= 1 << 63 else h


def full_blocks_stored(
    worker_id: str,
    dp_rank: int,
    tier: Tier,
    parent: int | None,
    hashes: Sequence[int],
    tokens: Sequence[int],
    block_size: int,
    *,
    lora_name: str | None = None,
    cache_salt: str | None = None,
    block_extra: Sequence[int] | None = None,
    shared: bool = False,
) -> BlockStored:
    """The ``BlockStored`` every engine's decoder builds once it has checked a store: full
    blocks (``len(tokens) == len(hashes) * block_size``), hashes already folded to u64."""
    return BlockStored(
        worker_id=worker_id,
        dp_rank=dp_rank,
        tier=tier,
        shared=shared,
        parent_engine_hash=parent,
        engine_hashes=hashes,
        token_ids=tokens,
        block_size=block_size,
        lora_name=lora_name,
        cache_salt=cache_salt,
        block_extra=block_extra,
    )


def canonical_event(ev: KvEvent) -> tuple:
    """An event as plain values, to compare what two decoders gave: the compiled readers'
    arrays and the msgspec paths' lists compare alike."""
    out: list[Any] = [type(ev).__name__]
    for name in ev.__struct_fields__:
        v = getattr(ev, name)
        if v is not None and not isinstance(v, (str, int, float)):
            v = [int(x) for x in v]
        out.append((name, v))
    return tuple(out)


def hash_values(hashes: Sequence[int]) -> Sequence[int]:
    """An event's engine hashes as Python ints, for sets: a compiled decoder's uint64 array
    becomes a list (one C loop, where iterating it would make a numpy scalar per hash)."""
    return hashes.tolist() if type(hashes) is np.ndarray else hashes


def join_hashes(parts: list[Sequence[int]]) -> Sequence[int]:
    """The engine hashes of several events as one sequence: one uint64 array if every part is
    one (what the compiled decoders give), else one list."""
    if len(parts) == 1:
        return parts[0]
    if all(type(p) is np.ndarray for p in parts):
        return np.concatenate(parts)
    out: list[int] = []
    for p in parts:
        out.extend(hash_values(p))
    return out


def joined_remove(removed: BlockRemoved, parts: list[Sequence[int]]) -> BlockRemoved:
    """``removed`` carrying the hashes of a run of removals (``join_hashes`` of ``parts``)."""
    return msgspec.structs.replace(removed, engine_hashes=join_hashes(parts))


def coalesce_removes(events: list[KvEvent]) -> list[KvEvent]:
    """One batch's removes gathered into as few events as the index allows (each is a call).

    vLLM sends one ``BlockRemoved`` per evicted hash and SGLang one per evicted radix node,
    interleaved with the stores of the requests that needed the room. Each removed hash joins
    the batch's open remove (the last one; same tier and rank, no clear since), i.e. moves
    earlier past the stores in between, unless one of those stores holds or chains to
    (``parent``) it; then the order matters, and that hash and the rest of its event start a
    new open remove. Decided hash by hash, so the result does not depend on how the removes
    came grouped: a decoder that already joined adjacent removes (SGLang's typed decode) gets
    what joining them here one by one gives. vLLM's compiled decoder applies the same rule.
    The events given are not changed: a joined remove is a new event, its hashes one list, or
    one uint64 array where every part was one.
    """
    out: list[KvEvent] = []
    rm: BlockRemoved | None = None  # the open remove, at out[rm_at]; its parts' hashes
    rm_at = 0
    parts: list[Sequence[int]] = []
    touched: set[int] = set()

    def close() -> None:
        if len(parts) > 1 and rm is not None:  # rm is out[rm_at] until the next one opens
            out[rm_at] = joined_remove(rm, parts)

    for e in events:
        if type(e) is BlockRemoved:
            hashes = e.engine_hashes
            if (
                rm is not None
                and rm.tier == e.tier
                and rm.dp_rank == e.dp_rank
                and rm.shared == e.shared
            ):
                if not touched or touched.isdisjoint(hash_values(hashes)):
                    parts.append(hashes)
                    continue
                # the hashes before the first one a store touched still move; from it on
                # they start the next open remove
                first = next(i for i, h in enumerate(hash_values(hashes)) if h in touched)
                if first:
                    parts.append(hashes[:first])
                    hashes = hashes[first:]
                    e = msgspec.structs.replace(e, engine_hashes=hashes)
            close()
            rm, rm_at, parts = e, len(out), [hashes]
            touched = set()
            out.append(e)
            continue
        if type(e) is BlockStored:
            if rm is not None:
                touched.update(hash_values(e.engine_hashes))
                if e.parent_engine_hash is not None:
                    touched.add(e.parent_engine_hash)
        else:
            close()
            rm, parts = None, []  # a clear (or anything else) is a barrier
        out.append(e)
    close()
    return out
