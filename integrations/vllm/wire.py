"""vLLM's KV-event wire format: decode (vLLM 0.9 - 0.33) and encode (simulators, tests).

A ZMQ message is three frames ``[topic, seq (u64 big-endian), payload]`` (a publisher with
snapshots enabled appends its 16-byte lifetime id to the seq frame: ``parse_seq_frame``); the
payload is a msgpack ``KVEventBatch``: ``[ts, events]`` (0.9.0) or
``[ts, events, data_parallel_rank]`` (>= 0.9.2). Events are tagged by class name:

* 0.9 - 0.23: positional arrays, tag first, fields appended over time (any length is accepted:
  missing trailing fields take their defaults, unknown trailing elements are ignored);
* >= 0.24: maps with a ``"type"`` key; fields whose default is ``None`` are omitted; unknown
  keys are ignored.

Block hashes arrive as uint64 (default since 0.10.2), signed int64 (0.9 - 0.10.1 ``builtin``
hash, may be negative) or 32-byte digests (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``); all are
folded to the u64 vLLM itself publishes: the low 64 bits, i.e. the digest's last 8 bytes
big-endian, or the int64's two's complement.

A batch encoded as a map (``{"ts", "events", "data_parallel_rank"?}``, what vLLM's
``EventBatch`` struct gives without ``array_like``) decodes too.

The contract, on both decoding paths (the compiled ``_fastwire`` and msgspec; checked by
``compare_paths`` in a differential fuzz test): a field vLLM declares for an event kind must
have vLLM's type, or that event is malformed (dropped and counted; the rest of the batch is
kept); a field vLLM does not declare for the kind is ignored whatever it holds (vLLM's
``AllBlocksCleared`` declares none, so it always clears). The fast path may decline any batch;
then the msgspec path alone decides.

The decoder turns a batch into kvplug's normalised events (``kvplug.events``) and counts what
it could not use in ``DecodeStats``; it never raises on bad input, nesting deeper than the
interpreter's recursion limit included (``WireError`` is for frames the subscriber cannot
attribute at all).
"""

from __future__ import annotations

import hashlib
import time
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any

import msgspec
from kvplug.integrations.common import (
    DECODE_ERRORS,
    MASK64,
    canonical_event,
    coalesce_removes,
    full_blocks_stored,
    int64_hash,
    u64_hash,
)

from kvplug import AllCleared, BlockRemoved, BlockStored, KvEvent, Tier

SEQ_BYTES = 8  # a data message's sequence number: u64 big-endian
PUBLISHER_ID_BYTES = 16  # appended to it by snapshot-enabled publishers (parse_seq_frame)
END_SEQ = (-1).to_bytes(SEQ_BYTES, "big", signed=True)  # replay end marker
MAP_FORM_SINCE = (0, 24, 0)  # first vLLM version that encodes events as maps with "type"
DEFAULT_MAX_EVENT_TOKENS = 1 << 21  # one event carrying more tokens is dropped as absurd
# KV-cache group kinds whose blocks do not describe a reusable prompt prefix (hybrid models)
NON_PREFIX_KINDS = frozenset(
    {
        "sliding_window",
        "sliding_window_mla",
        "mamba",
        "chunked_local_attention",
        "encoder_only_attention",
        "cross_attention",
    }
)

# -------------------------------------------------------------------------------------------
# Decoding structs. Every field has a default so a short (old) array or a map missing optional
# keys decodes; extra trailing array elements and unknown map keys are ignored by msgspec.
# token_ids stays Raw: it is by far the largest part of a batch and we hand it on undecoded
# until the event passes its cheap checks.
# -------------------------------------------------------------------------------------------

Hash = int | bytes
# A batch's data_parallel_rank: a negative (or absurd) one cannot be attributed: batch malformed
Rank = Annotated[int, msgspec.Meta(ge=0, lt=1 << 31)]


# One field list per event kind; the array (<= 0.23) and map (>= 0.24) encodings differ only
# in msgspec's framing, so each is a tagged subclass of the same fields.
class _StoredFields(msgspec.Struct):
    block_hashes: list[Hash] = []
    parent_block_hash: Hash | None = None
    token_ids: msgspec.Raw = msgspec.Raw()
    block_size: int = 0
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[list[Any] | None] | None = None  # vLLM: list[tuple | None] | None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None


class _RemovedFields(msgspec.Struct):
    block_hashes: list[Hash] = []
    medium: str | None = None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class _ClearedFields(msgspec.Struct):
    pass  # vLLM's AllBlocksCleared has no fields: anything a sender adds is ignored


class _StoredA(_StoredFields, tag="BlockStored", array_like=True):
    pass


class _RemovedA(_RemovedFields, tag="BlockRemoved", array_like=True):
    pass


class _ClearedA(_ClearedFields, tag="AllBlocksCleared", array_like=True):
    pass


class _StoredM(_StoredFields, tag="BlockStored", tag_field="type"):
    session_id: str | None = None  # map form only
    # EAGLE block-drop: not read; a match may credit the last block one too many (docs/vllm.md)
    lookahead_token_ids: msgspec.Raw = msgspec.Raw()


class _RemovedM(_RemovedFields, tag="BlockRemoved", tag_field="type"):
    pass


class _ClearedM(_ClearedFields, tag="AllBlocksCleared", tag_field="type"):
    pass


_ArrayEvent = _StoredA | _RemovedA | _ClearedA
_MapEvent = _StoredM | _RemovedM | _ClearedM


class _BatchA(msgspec.Struct, array_like=True):
    ts: float
    events: list[_ArrayEvent]
    data_parallel_rank: Rank | None = None


class _BatchM(msgspec.Struct, array_like=True):
    ts: float
    events: list[_MapEvent]
    data_parallel_rank: Rank | None = None


class _BatchRaw(msgspec.Struct, array_like=True):
    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: Rank | None = None


# The batch as a map (``{"ts", "events", "data_parallel_rank"?}``): what vLLM's own
# ``EventBatch`` encodes to where it is not ``array_like`` (vllm-project/vllm 0181ea31,
# vllm/distributed/kv_events.py); every release kvplug has seen sends the array.
class _BatchMapM(msgspec.Struct):
    ts: float
    events: list[_MapEvent]
    data_parallel_rank: Rank | None = None


class _BatchMapA(msgspec.Struct):
    ts: float
    events: list[_ArrayEvent]
    data_parallel_rank: Rank | None = None


class _BatchMapRaw(msgspec.Struct):
    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: Rank | None = None


_DEC_A = msgspec.msgpack.Decoder(_BatchA)
_DEC_M = msgspec.msgpack.Decoder(_BatchM)
_DEC_RAW = msgspec.msgpack.Decoder(_BatchRaw)
_DEC_MAP_M = msgspec.msgpack.Decoder(_BatchMapM)
_DEC_MAP_A = msgspec.msgpack.Decoder(_BatchMapA)
_DEC_MAP_RAW = msgspec.msgpack.Decoder(_BatchMapRaw)
_DEC_EV_A = msgspec.msgpack.Decoder(_ArrayEvent)
_DEC_EV_M = msgspec.msgpack.Decoder(_MapEvent)
_DEC_TOKENS = msgspec.msgpack.Decoder(list[int])
_DEC_ANY = msgspec.msgpack.Decoder()
_TIERS = (Tier.DEVICE, Tier.HOST, Tier.DISK)

try:  # the compiled one-pass decoder (built by setup.py); msgspec does everything without it
    from kvplug.integrations.vllm import _fastwire as _fast
except ImportError:  # pragma: no cover - source checkouts without a build
    _fast = None  # type: ignore[assignment]
FAST_PATH = _fast is not None

# -------------------------------------------------------------------------------------------
# Hashes, media
# -------------------------------------------------------------------------------------------


def fold_hash(h: int | bytes) -> int:
    """Any published form of a vLLM block hash -> the u64 vLLM publishes by default."""
    if isinstance(h, bytes):
        if not h:
            raise ValueError("empty block hash")
        return int.from_bytes(h[-8:], "big")
    return u64_hash(h, "block hash")  # EventDrop is a ValueError


def fold_hashes(hs: list) -> list[int]:
    """Fold a hash list; the common all-uint64 case returns the list itself (no copy)."""
    for h in hs:
        if type(h) is not int or h < 0:
            return [fold_hash(x) for x in hs]
    return hs


MEDIUM_TIERS: dict[str, Tier] = {
    "GPU": Tier.DEVICE,
    "CUDA": Tier.DEVICE,
    "XPU": Tier.DEVICE,
    "HPU": Tier.DEVICE,
    "TPU": Tier.DEVICE,
    "DEVICE": Tier.DEVICE,
    "CPU": Tier.HOST,
    "CPU_PINNED": Tier.HOST,
    "HOST": Tier.HOST,
    "LOCALCPUBACKEND": Tier.HOST,  # LMCache backend names
    "STORAGE": Tier.DISK,
    "DISK": Tier.DISK,
    "SSD": Tier.DISK,
    "NVME": Tier.DISK,
    "LOCALDISKBACKEND": Tier.DISK,
}


def medium_tier(medium: str | None) -> Tier | None:
    """vLLM ``medium`` -> kvplug tier; ``None`` medium (before 0.10.2) = the engine's own pool.

    Returns None for a medium we cannot place: the caller drops such stores (claiming a device
    hit we cannot place would steer requests wrongly) and removes from whichever tier holds it.
    """
    if medium is None:
        return Tier.DEVICE
    return MEDIUM_TIERS.get(medium.upper())


# -------------------------------------------------------------------------------------------
# extra_keys -> cache_salt, multimodal per-block extra
# -------------------------------------------------------------------------------------------


def _stable_u64(obj: Any) -> int:
    """A stable 64-bit digest of a msgpack-able value (non-zero: 0 means 'no extra')."""
    d = hashlib.blake2b(msgspec.msgpack.encode(obj), digest_size=8).digest()
    return int.from_bytes(d, "big") or 1


def split_extra_keys(
    extra_keys: list | None,
    n_blocks: int,
    lora_name: str | None,
    first_block_is_root: bool,
    lora_id: int | None = None,
) -> tuple[str | None, list[int] | None]:
    """(cache_salt, per-block extra u64) from vLLM's untagged per-block extra keys.

    Per vLLM's docstring each block's entry holds, in order: the LoRA identity (its name;
    ``lora_int_id`` up to 0.11), ``[mm_id, offset]`` pairs, the cache salt (block 0 only),
    prompt-embeds digests. The LoRA identity is carried by the event's ``lora_name`` instead;
    the salt is the plain string left on block 0 and only matters at the chain root (a
    continuation inherits its parent's namespace). Multimodal pairs and digests fold into a
    per-block u64 extra so such blocks never match a text-only request.
    """
    if not extra_keys:
        return None, None
    salt: str | None = None
    extras: list[int] | None = None
    for i, entry in enumerate(extra_keys[:n_blocks]):
        if not entry:
            continue
        items = list(entry) if isinstance(entry, (list, tuple)) else [entry]
        if items and (
            (lora_name is not None and items[0] == lora_name)
            or (lora_id is not None and items[0] == lora_id and not isinstance(items[0], bool))
        ):
            items = items[1:]
        rest = []
        for it in items:
            if i == 0 and first_block_is_root and isinstance(it, str) and salt is None:
                salt = it
            else:
                rest.append(it)
        if rest:
            if extras is None:
                extras = [0] * n_blocks
            extras[i] = _stable_u64(rest)
    return salt, extras


def _fast_extra_keys(
    raw: bytes, n_blocks: int, lora_name: str | None, is_root: bool
) -> tuple[str | None, list[int] | None] | None:
    """The compiled decoder's callback for a store's non-trivial ``extra_keys`` (msgpack
    bytes): (cache_salt, per-block extra), or None to leave the batch to the msgspec path."""
    try:
        keys = _DEC_ANY.decode(raw)
        if not isinstance(keys, list):
            return None  # the msgspec path rejects and counts it
        return split_extra_keys(keys, n_blocks, lora_name, is_root)
    except (*DECODE_ERRORS, ValueError, TypeError):
        return None  # whatever it is, the msgspec path says what (and counts it)


def lora_namespace(lora_name: str | None, lora_id: int | None) -> str | None:
    """The LoRA namespace of an event: its name, or (vLLM <= 0.13 sends only the int id) a
    name derived from the id, so adapter blocks never match base-model requests."""
    if lora_name is not None:
        return lora_name
    return None if lora_id is None else f"lora-id:{lora_id}"


# -------------------------------------------------------------------------------------------
# Decoder
# -------------------------------------------------------------------------------------------


def _is_map(buf: bytes | memoryview) -> bool:
    """Whether a msgpack value is a map (by its first byte)."""
    return len(buf) > 0 and (0x80 <= buf[0] <= 0x8F or buf[0] in (0xDE, 0xDF))


@dataclass
class DecodeStats:
    """What the decoder saw and what it dropped (each drop is also logged by the subscriber)."""

    batches: int = 0
    events: int = 0
    stored_blocks: int = 0
    removed_blocks: int = 0
    cleared: int = 0
    malformed_batches: int = 0
    malformed_events: int = 0
    unknown_event_kinds: int = 0
    unknown_medium: int = 0
    bad_token_counts: int = 0
    oversized_events: int = 0
    skipped_groups: int = 0
    block_size_mismatch: int = 0
    tier_copies: int = 0
    fast_batches: int = 0  # decoded by the compiled one-pass path
    array_form_batches: int = 0
    map_form_batches: int = 0
    last_error: str = ""
    by_kind: dict[str, int] = field(default_factory=dict)

    # what drops an event (or a batch) the engine sent, as opposed to progress counters
    DROP_FIELDS = (
        "malformed_batches",
        "malformed_events",
        "unknown_event_kinds",
        "unknown_medium",
        "bad_token_counts",
        "oversized_events",
        "block_size_mismatch",
    )

    def drops(self) -> dict[str, int]:
        """Drop counters by reason (for ``/metrics``)."""
        return {k: getattr(self, k) for k in self.DROP_FIELDS}

    def as_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in self.__dict__.items() if k != "by_kind"}
        d["unknown_kinds"] = dict(self.by_kind)
        return d


@dataclass
class DecodedBatch:
    ts: float
    dp_rank: int | None
    events: list[KvEvent]
    dropped: int  # events dropped from this batch (details in the decoder's stats.last_error)


class BatchDecoder:
    """Decodes one engine's payloads into normalised events for ``worker_id``.

    ``dp_rank`` is the rank to use when the batch carries none (0.9.0) — the subscriber knows it
    from the socket. ``full_attention_only``: hybrid models publish a store per KV-cache group;
    only full-attention groups describe reusable prefixes, so others are skipped (remove events
    only carry ``group_idx``: the kinds are learned from the stores).
    ``block_size``: the engine's configured block size; a store of another size (Mamba partial
    blocks) is skipped and counted. 0 = accept any.
    """

    def __init__(
        self,
        worker_id: str,
        *,
        block_size: int = 0,
        max_event_tokens: int = DEFAULT_MAX_EVENT_TOKENS,
        full_attention_only: bool = True,
    ) -> None:
        self.worker_id = worker_id
        self.block_size = block_size
        self.use_fast = True
        self.max_event_tokens = max_event_tokens
        self.full_attention_only = full_attention_only
        self.stats = DecodeStats()
        self._map_form_first = True  # which decoder to try first; flips to what the engine sends
        self._group_kind: dict[int, str] = {}
        self._fast = _fast.FastDecoder() if _fast is not None else None  # reused buffers

    # -- batch level ----------------------------------------------------------------------
    def decode(self, payload: bytes | memoryview, dp_rank: int = 0) -> DecodedBatch | None:
        """Decode one payload; None when the batch itself is unreadable (counted)."""
        if self._fast is not None and self.use_fast and not self._group_kind:
            got = self._fast.decode(
                payload,
                self.max_event_tokens,
                self.block_size,
                self.worker_id,
                dp_rank,
                _fast_extra_keys,
            )
            if got is not None:
                ts, wire_rank, events, n_wire, stored, removed, cleared, copies = got
                st = self.stats
                st.batches += 1
                st.fast_batches += 1
                st.events += n_wire
                st.stored_blocks += stored
                st.removed_blocks += removed
                st.cleared += cleared
                st.tier_copies += copies
                return DecodedBatch(ts, wire_rank, events, 0)
        return self.decode_msgspec(payload, dp_rank)

    def decode_msgspec(self, payload: bytes | memoryview, dp_rank: int = 0) -> DecodedBatch | None:
        """The general decoder (every shape, every error counted); ``decode`` uses it whenever
        the compiled fast path declines a batch."""
        st = self.stats
        batch: Any = None
        first: msgspec.msgpack.Decoder[Any]
        second: msgspec.msgpack.Decoder[Any]
        if _is_map(payload):
            first, second = (_DEC_MAP_M, _DEC_MAP_A)
        elif self._map_form_first:
            first, second = (_DEC_M, _DEC_A)
        else:
            first, second = (_DEC_A, _DEC_M)
        try:
            batch = first.decode(payload)
        except DECODE_ERRORS:
            try:
                batch = second.decode(payload)
                if second is _DEC_M or second is _DEC_A:
                    self._map_form_first = not self._map_form_first
            except DECODE_ERRORS:
                batch = None
        if batch is None:
            return self._decode_slow(payload, dp_rank)
        st.batches += 1
        if isinstance(batch, (_BatchM, _BatchMapM)):
            st.map_form_batches += 1
        else:
            st.array_form_batches += 1
        rank = batch.data_parallel_rank if batch.data_parallel_rank is not None else dp_rank
        out: list[KvEvent] = []
        dropped = 0
        for ev in batch.events:
            dropped += self._convert(ev, rank, out)
        st.events += len(batch.events)
        return DecodedBatch(batch.ts, batch.data_parallel_rank, coalesce_removes(out), dropped)

    def _decode_slow(self, payload: bytes | memoryview, dp_rank: int) -> DecodedBatch | None:
        """Event-by-event decode: salvages a batch with unknown kinds or one bad event."""
        st = self.stats
        try:
            batch = (_DEC_MAP_RAW if _is_map(payload) else _DEC_RAW).decode(payload)
        except DECODE_ERRORS as e:
            st.malformed_batches += 1
            st.last_error = f"malformed batch: {e}"
            return None
        st.batches += 1
        rank = batch.data_parallel_rank if batch.data_parallel_rank is not None else dp_rank
        out: list[KvEvent] = []
        dropped = 0
        for raw in batch.events:
            st.events += 1
            ev = self._decode_one(raw)
            if ev is None:
                dropped += 1
                continue
            dropped += self._convert(ev, rank, out)
        return DecodedBatch(batch.ts, batch.data_parallel_rank, coalesce_removes(out), dropped)

    def _decode_one(self, raw: msgspec.Raw) -> Any:
        st = self.stats
        buf = bytes(raw)
        is_map = _is_map(buf)
        dec = _DEC_EV_M if is_map else _DEC_EV_A
        try:
            return dec.decode(buf)
        except DECODE_ERRORS as e:
            kind = self._kind_of(buf, is_map)
            if kind is not None and kind not in ("BlockStored", "BlockRemoved", "AllBlocksCleared"):
                st.unknown_event_kinds += 1
                st.by_kind[kind] = st.by_kind.get(kind, 0) + 1
                st.last_error = f"unknown event kind {kind!r}"
            else:
                st.malformed_events += 1
                st.last_error = f"malformed {kind or 'event'}: {e}"
            return None

    @staticmethod
    def _kind_of(buf: bytes, is_map: bool) -> str | None:
        try:
            obj = _DEC_ANY.decode(buf)
        except DECODE_ERRORS:
            return None
        if is_map and isinstance(obj, dict):
            k = obj.get("type")
        elif isinstance(obj, list) and obj:
            k = obj[0]
        else:
            return None
        return k if isinstance(k, str) else None

    # -- event level ------------------------------------------------------------------------
    def _convert(self, ev: Any, rank: int, out: list[KvEvent]) -> int:
        """Append the normalised form of one wire event; return 1 if it was dropped."""
        st = self.stats
        if isinstance(ev, (_RemovedM, _RemovedA)):
            if self._skip_group(ev.group_idx, None):
                return 0
            try:
                hashes = fold_hashes(ev.block_hashes)
            except ValueError as e:
                st.malformed_events += 1
                st.last_error = f"BlockRemoved: {e}"
                return 1
            if not hashes:
                return 0
            tier = medium_tier(ev.medium)  # unknown medium: remove from whichever tier holds it
            st.removed_blocks += len(hashes)
            out.append(
                BlockRemoved(
                    worker_id=self.worker_id, dp_rank=rank, tier=tier, engine_hashes=hashes
                )
            )
            return 0
        if isinstance(ev, (_StoredM, _StoredA)):
            return self._convert_stored(ev, rank, out)
        if isinstance(ev, (_ClearedM, _ClearedA)):
            st.cleared += 1
            out.append(AllCleared(worker_id=self.worker_id, dp_rank=rank))
            return 0
        st.unknown_event_kinds += 1  # pragma: no cover - the unions above are exhaustive
        return 1

    def _skip_group(self, group_idx: int | None, kind: str | None) -> bool:
        if group_idx is None or not self.full_attention_only:
            return False
        if kind is not None:
            self._group_kind[group_idx] = kind
        else:
            kind = self._group_kind.get(group_idx)
        if kind is not None and kind in NON_PREFIX_KINDS:
            self.stats.skipped_groups += 1
            return True
        return False

    def _convert_stored(self, ev: Any, rank: int, out: list[KvEvent]) -> int:
        st = self.stats
        if self._skip_group(ev.group_idx, ev.kv_cache_spec_kind):
            return 0
        try:
            hashes = fold_hashes(ev.block_hashes)
            parent = None if ev.parent_block_hash is None else fold_hash(ev.parent_block_hash)
        except ValueError as e:
            st.malformed_events += 1
            st.last_error = f"BlockStored: {e}"
            return 1
        tier = medium_tier(ev.medium)
        if tier is None:
            st.unknown_medium += 1
            st.last_error = f"BlockStored with unknown medium {ev.medium!r} dropped"
            return 1
        n = len(hashes)
        if n == 0:
            return 0
        raw = ev.token_ids
        if len(raw) > 5 * self.max_event_tokens + 5:  # msgpack ints take at most 5 bytes here
            st.oversized_events += 1
            st.last_error = f"BlockStored with {len(raw)} bytes of token ids dropped"
            return 1
        try:
            # array('I') checks every id is a u32 at C speed and is a buffer the core reads
            tokens = array("I", _DEC_TOKENS.decode(raw)) if len(raw) else array("I")
        except (*DECODE_ERRORS, OverflowError, TypeError) as e:
            st.malformed_events += 1
            st.last_error = f"BlockStored token_ids: {e}"
            return 1
        if not tokens:
            # offload connectors publish CPU/STORAGE copies of blocks by hash only
            st.tier_copies += 1
            st.stored_blocks += n
            out.append(
                BlockStored(
                    worker_id=self.worker_id,
                    dp_rank=rank,
                    tier=tier,
                    parent_engine_hash=parent,
                    engine_hashes=hashes,
                    tier_copy=True,
                )
            )
            return 0
        bs = ev.block_size
        if len(tokens) > self.max_event_tokens:
            st.oversized_events += 1
            st.last_error = f"BlockStored with {len(tokens)} tokens dropped"
            return 1
        if self.block_size and bs != self.block_size:
            st.block_size_mismatch += 1
            st.last_error = f"BlockStored of block_size {bs} (engine uses {self.block_size})"
            return 1
        if bs <= 0 or len(tokens) != n * bs:
            st.bad_token_counts += 1
            st.last_error = (
                f"BlockStored: {len(tokens)} token ids for {n} blocks of block_size {bs}"
            )
            return 1
        salt, extras = split_extra_keys(ev.extra_keys, n, ev.lora_name, parent is None, ev.lora_id)
        st.stored_blocks += n
        out.append(
            full_blocks_stored(
                self.worker_id,
                rank,
                tier,
                parent,
                hashes,
                tokens,
                bs,
                lora_name=lora_namespace(ev.lora_name, ev.lora_id),
                cache_salt=salt,
                block_extra=extras,
            )
        )
        return 0


def compare_paths(payload: bytes, block_size: int = 0, dp_rank: int = 0) -> str | None:
    """The two decoding paths' one contract, checked on one payload: where the compiled path
    accepts a batch, the msgspec path must decode it to the same events, drop nothing and
    agree on ts and rank. Returns what differs, or None (also when the fast path declines:
    then the msgspec path alone decides). For the differential tests and the fuzzer."""
    if _fast is None:
        return None
    fast = BatchDecoder("w", block_size=block_size)
    a = fast.decode(payload, dp_rank)
    if not fast.stats.fast_batches:
        return None
    slow = BatchDecoder("w", block_size=block_size)
    b = slow.decode_msgspec(payload, dp_rank)
    if a is None or b is None:
        return f"fast path accepted, msgspec path {'rejected the batch' if b is None else 'ok'}"
    if b.dropped:
        return f"msgspec path dropped {b.dropped} event(s): {slow.stats.last_error}"
    same_ts = a.ts == b.ts or (a.ts != a.ts and b.ts != b.ts)  # NaN is NaN on both
    if not same_ts or a.dp_rank != b.dp_rank:
        return f"ts/rank {(a.ts, a.dp_rank)} vs {(b.ts, b.dp_rank)}"
    ea, eb = [canonical_event(e) for e in a.events], [canonical_event(e) for e in b.events]
    if ea != eb:
        return f"events differ:\n fast    {ea}\n msgspec {eb}"
    for counter in ("stored_blocks", "removed_blocks", "cleared", "tier_copies"):
        if getattr(fast.stats, counter) != getattr(slow.stats, counter):
            return f"stats.{counter} differ"
    return None


# -------------------------------------------------------------------------------------------
# Frames
# -------------------------------------------------------------------------------------------


class WireError(ValueError):
    """A ZMQ message that is not a vLLM KV-event message at all."""


def parse_seq_frame(seq_b: bytes) -> tuple[int, bytes | None]:
    """A data message's sequence frame -> (seq, publisher id or None); WireError otherwise.

    8 bytes: the seq (u64 big-endian). 24 bytes: the seq, then the 16 bytes that identify one
    publisher lifetime, which vLLM sends when ``KVEventsConfig.snapshot_endpoint`` is set (the
    wire contract in vLLM's ``docs/features/kv_events.md`` at commit 0aa3ce85, after 0.34.0)."""
    if len(seq_b) == SEQ_BYTES:
        return int.from_bytes(seq_b, "big"), None
    if len(seq_b) == SEQ_BYTES + PUBLISHER_ID_BYTES:
        return int.from_bytes(seq_b[:SEQ_BYTES], "big"), bytes(seq_b[SEQ_BYTES:])
    raise WireError(
        f"sequence frame of {len(seq_b)} bytes (want {SEQ_BYTES}, or "
        f"{SEQ_BYTES + PUBLISHER_ID_BYTES} with a publisher id)"
    )


def split_frames(frames: Sequence[bytes]) -> tuple[bytes, int, bytes, bytes | None]:
    """``[topic, seq, payload]`` -> (topic, seq, payload, publisher id or None); WireError on
    any other shape. Every live message passes here: a plain tuple, the common 8-byte seq
    read inline (the general parse costs ~0.3 us more per message)."""
    if len(frames) != 3:
        raise WireError(f"expected 3 frames [topic, seq, payload], got {len(frames)}")
    topic, seq_b, payload = frames
    if len(seq_b) == SEQ_BYTES:
        return topic, int.from_bytes(seq_b, "big"), payload, None
    seq, publisher = parse_seq_frame(seq_b)
    return topic, seq, payload, publisher


@dataclass(frozen=True)
class ReplayItem:
    topic: bytes | None  # None in the 0.9-0.25 framing
    seq: int
    payload: bytes
    publisher: bytes | None = None  # the publisher's lifetime id (parse_seq_frame), or None


def parse_replay_reply(frames: Sequence[bytes]) -> ReplayItem | None:
    """One replay reply as a DEALER sees it. None = the end marker.

    0.9-0.25: ``[b"", seq8, payload]``, end ``[b"", END_SEQ, b""]``;
    >= 0.26: ``[b"", topic, seq8, payload]``, end ``[b"", b"", END_SEQ, b""]``;
    a snapshot-enabled publisher's data replies carry its id after the seq, as live ones do.
    """
    fr = [bytes(f) for f in frames]
    if fr and fr[0] == b"":
        fr = fr[1:]
    if len(fr) == 2:
        topic, (seq_b, payload) = None, fr
    elif len(fr) == 3:
        topic, seq_b, payload = fr
    else:
        raise WireError(f"replay reply with {len(frames)} frames")
    if seq_b[:SEQ_BYTES] == END_SEQ:  # the end marker (8 bytes; with an id, as a data frame)
        return None
    seq, publisher = parse_seq_frame(seq_b)
    return ReplayItem(topic, seq, payload, publisher)


def replay_request(start_seq: int) -> list[bytes]:
    """Frames a DEALER sends to ask for batches from ``start_seq`` on."""
    return [b"", int(start_seq).to_bytes(8, "big")]


# -------------------------------------------------------------------------------------------
# Encoder (simulated engines, tests): kvplug events -> the bytes a given vLLM version sends
# -------------------------------------------------------------------------------------------


def parse_version(version: str | tuple[int, ...]) -> tuple[int, int, int]:
    """'0.10.2' -> (0, 10, 2); missing parts are 0; suffixes like '.post1' are ignored."""
    parts = list(version) if isinstance(version, tuple) else version.lstrip("v").split(".")[:3]
    try:
        nums = [int(str(p).split("+")[0].split("rc")[0]) for p in parts]
    except ValueError:
        raise ValueError(f"bad vLLM version {version!r}") from None
    return tuple((nums + [0, 0, 0])[:3])  # type: ignore[return-value]


_TIER_MEDIUM = {Tier.DEVICE: "GPU", Tier.HOST: "CPU", Tier.DISK: "STORAGE"}

# Fields of BlockStored in declaration order, with the (major, minor, patch) version that added
# them.
_STORED_FIELDS: tuple[tuple[str, tuple[int, int, int]], ...] = (
    ("block_hashes", (0, 9, 0)),
    ("parent_block_hash", (0, 9, 0)),
    ("token_ids", (0, 9, 0)),
    ("block_size", (0, 9, 0)),
    ("lora_id", (0, 9, 0)),
    ("medium", (0, 10, 2)),
    ("lora_name", (0, 14, 0)),
    ("extra_keys", (0, 17, 0)),
    ("group_idx", (0, 20, 0)),
    ("kv_cache_spec_kind", (0, 22, 0)),
    ("kv_cache_spec_sliding_window", (0, 22, 0)),
    ("locality", (0, 26, 0)),
    ("ownership", (0, 29, 0)),
    ("session_id", (0, 30, 0)),
)
_REMOVED_FIELDS = (
    ("block_hashes", (0, 9, 0)),
    ("medium", (0, 10, 2)),
    ("group_idx", (0, 20, 0)),
    ("locality", (0, 26, 0)),
    ("ownership", (0, 29, 0)),
)
DP_RANK_SINCE = (0, 9, 2)
# Fields without a default (always present, even when None); the rest are omitted when None.
_REQUIRED = {
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
}


def _wire_hash(value: int | bytes, hash_form: str) -> int | bytes:
    if isinstance(value, bytes):  # a whole digest (vLLM's own hashes): sent as is, or folded
        if hash_form == "bytes":
            return value
        value = int.from_bytes(value, "big")
    h = value & MASK64
    if hash_form == "uint64":
        return h
    if hash_form == "int64":
        return int64_hash(h)
    if hash_form == "bytes":
        # 32-byte digest whose low 64 bits are h; the high bytes are a fixed filler
        return b"\x5a" * 24 + h.to_bytes(8, "big")
    raise ValueError(f"hash_form must be uint64, int64 or bytes, not {hash_form!r}")


def _hash_value(h: Any) -> int | bytes:
    return h if isinstance(h, bytes) else int(h)


def _event_fields(ev: KvEvent, v: tuple[int, int, int], hash_form: str) -> tuple[str, list] | None:
    medium_since = (0, 10, 2)
    if isinstance(ev, BlockStored):
        tokens = [] if ev.tier_copy or ev.token_ids is None else [int(t) for t in ev.token_ids]
        extra_keys = None
        if ev.cache_salt is not None:
            n = len(ev.engine_hashes)
            extra_keys = [[ev.cache_salt]] + [None] * (n - 1)
        values = {
            "block_hashes": [_wire_hash(_hash_value(h), hash_form) for h in ev.engine_hashes],
            "parent_block_hash": None
            if ev.parent_engine_hash is None
            else _wire_hash(_hash_value(ev.parent_engine_hash), hash_form),
            "token_ids": tokens,
            "block_size": 0 if ev.tier_copy else ev.block_size,
            "lora_id": None,
            "medium": _TIER_MEDIUM[Tier(ev.tier)] if v >= medium_since else None,
            "lora_name": ev.lora_name,
            "extra_keys": extra_keys,
            "group_idx": 0,
            "kv_cache_spec_kind": None,  # block_pool stores leave it unset (0.32)
            "kv_cache_spec_sliding_window": None,
        }
        return "BlockStored", [(k, values.get(k)) for k, since in _STORED_FIELDS if v >= since]
    if isinstance(ev, BlockRemoved):
        tier = Tier.DEVICE if ev.tier is None else Tier(ev.tier)
        values = {
            "block_hashes": [_wire_hash(_hash_value(h), hash_form) for h in ev.engine_hashes],
            "medium": _TIER_MEDIUM[tier],
            "group_idx": 0,
        }
        return "BlockRemoved", [(k, values.get(k)) for k, since in _REMOVED_FIELDS if v >= since]
    if isinstance(ev, AllCleared):
        return "AllBlocksCleared", []
    return None


def encode_event(ev: KvEvent, version: str = "0.32", hash_form: str = "uint64") -> Any:
    """One event as the msgpack-ready value the given vLLM version would send."""
    v = parse_version(version)
    got = _event_fields(ev, v, hash_form)
    if got is None:
        raise TypeError(f"vLLM has no wire form for {type(ev).__name__}")
    tag, fields = got
    if v >= MAP_FORM_SINCE:
        d: dict[str, Any] = {"type": tag}
        for k, val in fields:
            if val is not None or k in _REQUIRED:
                d[k] = val
        return d
    # msgspec (0.18 - 0.23 checked) writes every field of an array_like struct, defaults too
    return [tag] + [val for _, val in fields]


_ENC = msgspec.msgpack.Encoder()


def encode_batch(
    events: Iterable[KvEvent],
    version: str = "0.32",
    *,
    ts: float | None = None,
    dp_rank: int = 0,
    hash_form: str = "uint64",
) -> bytes:
    """kvplug events -> one msgpack ``KVEventBatch`` payload as vLLM ``version`` encodes it.

    ``BlockMoved`` has no vLLM form (raises TypeError). ``hash_form``: ``uint64`` (default),
    ``int64`` (0.9 - 0.10.1 builtin hash) or ``bytes`` (32-byte digests). An engine hash given
    as a whole 32-byte digest (vLLM's own, from ``kvplug sim --block-hashes vllm``) is sent as is
    in the ``bytes`` form and folded to its low 64 bits otherwise, as vLLM does.
    """
    v = parse_version(version)
    evs = [encode_event(e, version, hash_form) for e in events]
    batch: list[Any] = [time.time() if ts is None else float(ts), evs]
    if v >= DP_RANK_SINCE:
        batch.append(dp_rank)
    return _ENC.encode(batch)


def encode_frames(topic: str | bytes, seq: int, payload: bytes) -> list[bytes]:
    """The three frames a vLLM publisher sends."""
    t = topic.encode() if isinstance(topic, str) else topic
    return [t, int(seq).to_bytes(8, "big"), payload]
