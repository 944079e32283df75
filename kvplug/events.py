"""Normalised KV-cache events: what every engine integration turns its wire format into.

Engine specifics stop in ``integrations/<engine>``; the router only ever sees these three
kinds. Engine block hashes are opaque unsigned 64-bit ids (integrations fold int64 / 32-byte
forms into u64 before building an event).
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import IntEnum

import msgspec


class Tier(IntEnum):
    """Where a worker holds a block. The shared tier is a separate pseudo-worker, not a tier."""

    DEVICE = 0
    HOST = 1
    DISK = 2


class BlockStored(msgspec.Struct, frozen=True, kw_only=True):
    """Full blocks entered a worker's cache, in chain order.

    Either ``token_ids`` (all blocks' tokens, concatenated; ``len == len(engine_hashes) *
    block_size``) or ``block_hashes`` (kvplug sequence hashes, precomputed) is given. Offload
    connectors sometimes send neither (``token_ids`` empty): the integration then resolves the
    engine hashes against what the worker already holds (a tier copy) via ``tier_copy=True``.
    """

    worker_id: str
    dp_rank: int = 0
    tier: Tier = Tier.DEVICE
    parent_engine_hash: int | None = None
    engine_hashes: Sequence[int]
    token_ids: Sequence[int] | None = None
    block_hashes: Sequence[int] | None = None
    block_size: int = 0
    lora_name: str | None = None
    cache_salt: str | None = None
    block_extra: Sequence[int] | None = None  # per-block u64 extra key (e.g. multimodal), 0 = none
    tier_copy: bool = False  # same blocks, another tier: resolve by engine hash, no tokens
    shared: bool = False  # stored in the shared tier (readable by every worker)


class BlockRemoved(msgspec.Struct, frozen=True, kw_only=True):
    """Blocks left a worker's cache. ``tier=None``: from whichever tier holds them."""

    worker_id: str
    dp_rank: int = 0
    tier: Tier | None = None
    engine_hashes: Sequence[int]
    shared: bool = False


class BlockMoved(msgspec.Struct, frozen=True, kw_only=True):
    """Blocks changed tier on one worker (TRT-LLM ``updated.cache_level``)."""

    worker_id: str
    dp_rank: int = 0
    from_tier: Tier
    to_tier: Tier
    engine_hashes: Sequence[int]


class AllCleared(msgspec.Struct, frozen=True, kw_only=True):
    """A worker (rank) dropped its whole cache: reset, restart, or a lost event stream."""

    worker_id: str
    dp_rank: int = 0


KvEvent = BlockStored | BlockRemoved | BlockMoved | AllCleared
