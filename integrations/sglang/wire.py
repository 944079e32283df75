"""SGLang KV-event wire format → kvplug's normalised events.

SGLang publishes msgpack ``KVEventBatch`` messages over ZMQ (the same three frames as vLLM:
``[topic, seq (8-byte big-endian), payload]``). The payload is a positional batch
``[ts, events, attn_dp_rank | nil]`` (the rank slot is absent from some 0.5.x builds, which
trim trailing defaults). Events come in two encodings:

* sglang ≤ 0.5.19: tagged positional arrays —
  ``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium?,
  metadata?]``, ``["BlockRemoved", block_hashes, medium?]``, ``["AllBlocksCleared"]``; up to
  0.5.16 a nil trailing ``medium`` is omitted, 0.5.17 always sends it, and 0.5.18–0.5.19 add
  an eighth element ``{"cache_salt": ...}`` (``BlockStoredWithMetadata``) to salted stores;
* sglang ≥ 0.5.20: tagged maps — ``{"type": "BlockStored", "block_hashes": ..., ...}`` with
  optional fields omitted when nil.

What this module guarantees (each rule is tested in ``tests/test_sglang_wire.py``):

* Block hashes are signed int64 on the wire; they are kept opaque and folded to u64
  (``h & (2**64 - 1)``) — kvplug never recomputes SGLang's hash, it hashes ``token_ids``.
* One block = one SGLang page of ``page_size`` tokens (the size ``/server_info`` advertises).
  The last page of a radix node may be *partial* (``block_size < page_size``): such pages are
  never stored (a request can never match them), but their hashes are remembered per rank so
  the later ``BlockRemoved`` naming them is swallowed instead of counted as unknown, and a
  store chained onto a partial page is dropped and counted (its tokens start mid-page).
* ``medium``: ``GPU`` → device, ``CPU_PINNED`` → host, ``DISK`` → disk, ``EXTERNAL`` → the
  shared tier (``shared=True``); absent → device.
* EAGLE3 bigram pages carry ``token_ids`` as ``[t_j, t_j+1]`` pairs: the first element of each
  pair is the token at that position, so those are the tokens kvplug hashes.
* Anything malformed is dropped *per event* (or per batch when the envelope is broken),
  counted by reason in ``drops`` and logged with worker, rank and sequence number; nothing
  already decoded for the batch is lost and nothing raises.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence
from typing import Annotated, Any

import msgspec
from kvplug.integrations.common import (
    DECODE_ERRORS,
    MASK64,
    EventDrop,
    canonical_event,
    coalesce_removes,
    full_blocks_stored,
    hash_values,
    int64_hash,
    joined_remove,
    u64_hash,
)

from kvplug import AllCleared, BlockRemoved, BlockStored, KvEvent, Tier

log = logging.getLogger("kvplug.integrations.sglang")

MAX_TOKEN = 1 << 32
MAX_BLOCKS_PER_EVENT = 1 << 20  # far beyond any real radix node; bounds a hostile payload
MAX_PARTIAL_PER_RANK = 1 << 20  # partial pages whose removal was lost must not grow forever

# medium string -> (tier, shared)
MEDIUM_TIERS: dict[str, tuple[Tier, bool]] = {
    "GPU": (Tier.DEVICE, False),
    "CPU_PINNED": (Tier.HOST, False),
    "CPU": (Tier.HOST, False),  # defensive: the enum's Python name
    "DISK": (Tier.DISK, False),
    "EXTERNAL": (Tier.DEVICE, True),  # L4 shared pool (e.g. Mooncake): readable by every worker
}

_STORED_FIELDS = (  # positional order (the map form names the same fields)
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "metadata",  # 0.5.18-0.5.19: {"cache_salt": ...}
)
_REMOVED_FIELDS = ("block_hashes", "medium")

_decoder = msgspec.msgpack.Decoder()

try:  # the vLLM decoder's compiled token loop reads a store's raw token_ids into a u32 array
    from kvplug.integrations.vllm import _fastwire
except ImportError:  # pragma: no cover - source checkouts without a build
    _fastwire = None  # type: ignore[assignment]


class PartialPages(msgspec.Struct, frozen=True, kw_only=True):
    """Internal marker: partial tail pages a rank stored. Never leaves this package: the
    ``PartialPageFilter`` consumes it (decoding stays stateless; the per-rank memory lives in
    the filter, which runs after the subscriber has attributed the batch to its worker)."""

    worker_id: str
    dp_rank: int
    engine_hashes: Sequence[int]  # a list, or a uint64 array from the compiled reader


WireItem = KvEvent | PartialPages

# --- fast path: typed decoding (validation in C); anything it rejects goes the slow path ---
U32 = Annotated[int, msgspec.Meta(ge=0, lt=MAX_TOKEN)]
_TOKENS = msgspec.msgpack.Decoder(list[U32])
_HASHES = msgspec.msgpack.Decoder(list[int])
_BIGRAMS = msgspec.msgpack.Decoder(list[tuple[U32, int]])


class _StoredM(msgspec.Struct, tag="BlockStored", tag_field="type", gc=False):
    block_hashes: msgspec.Raw
    parent_block_hash: int | None = None
    token_ids: msgspec.Raw = msgspec.Raw()
    block_size: int = 0
    lora_id: int | None = None
    medium: str | None = None
    cache_salt: str | None = None
    session_id: str | None = None
    lora_name: str | None = None


class _RemovedM(msgspec.Struct, tag="BlockRemoved", tag_field="type", gc=False):
    block_hashes: msgspec.Raw
    medium: str | None = None


class _ClearedM(msgspec.Struct, tag="AllBlocksCleared", tag_field="type", gc=False):
    pass


class _Metadata(msgspec.Struct, gc=False):
    cache_salt: str | None = None


class _StoredA(msgspec.Struct, tag="BlockStored", array_like=True, gc=False):
    block_hashes: msgspec.Raw
    parent_block_hash: int | None = None
    token_ids: msgspec.Raw = msgspec.Raw()
    block_size: int = 0
    lora_id: int | None = None
    medium: str | None = None
    metadata: _Metadata | None = None

    @property
    def cache_salt(self) -> str | None:
        return None if self.metadata is None else self.metadata.cache_salt

    lora_name = None  # not in the positional form


class _RemovedA(msgspec.Struct, tag="BlockRemoved", array_like=True, gc=False):
    block_hashes: msgspec.Raw
    medium: str | None = None


class _ClearedA(msgspec.Struct, tag="AllBlocksCleared", array_like=True, gc=False):
    pass


class _BatchM(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[_StoredM | _RemovedM | _ClearedM]
    attn_dp_rank: int | None = None


class _BatchA(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[_StoredA | _RemovedA | _ClearedA]
    attn_dp_rank: int | None = None


_FAST: tuple[msgspec.msgpack.Decoder[Any], ...] = (
    msgspec.msgpack.Decoder(_BatchM),
    msgspec.msgpack.Decoder(_BatchA),
)


def _as_fields(raw: Any, names: Sequence[str], kind: str) -> dict[str, Any]:
    """Positional (≤0.5.15) or map (≥0.5.20) event body → field dict."""
    if isinstance(raw, dict):
        return raw
    values = raw[1:]  # raw[0] is the tag
    if len(values) > len(names):
        # a newer positional build with more trailing fields: keep the ones we know
        values = values[: len(names)]
    return dict(zip(names, values, strict=False))


def _hash_list(value: Any) -> list[int]:
    if not isinstance(value, list):
        raise EventDrop("bad_hash", "block_hashes is not a list")
    if len(value) > MAX_BLOCKS_PER_EVENT:
        raise EventDrop("too_many_blocks", f"{len(value)} block hashes in one event")
    return [u64_hash(h, f"block_hashes[{i}]") for i, h in enumerate(value)]


def _tokens(value: Any) -> list[int]:
    if not isinstance(value, list):
        raise EventDrop("bad_tokens", "token_ids is not a list")
    out: list[int] = []
    for i, t in enumerate(value):
        if isinstance(t, list) and len(t) == 2:  # EAGLE3 bigram page: (t_j, t_j+1)
            t = t[0]
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < MAX_TOKEN:
            raise EventDrop("bad_tokens", f"token_ids[{i}] = {t!r} is not a u32 token id")
        out.append(t)
    return out


def _medium(value: Any) -> tuple[Tier, bool]:
    if value is None:
        return Tier.DEVICE, False
    tier = MEDIUM_TIERS.get(value) if isinstance(value, str) else None
    if tier is None:
        raise EventDrop("unknown_medium", f"medium {value!r}")
    return tier


def _cache_salt(fields: dict[str, Any]) -> str | None:
    """``cache_salt`` (maps, ≥ 0.5.20) or ``metadata.cache_salt`` (arrays, 0.5.18–0.5.19)."""
    metadata = fields.get("metadata")
    if metadata is not None:
        if not isinstance(metadata, dict):
            raise EventDrop("bad_field", f"metadata is {type(metadata).__name__}, not a map")
        return _opt_str(metadata, "cache_salt")
    return _opt_str(fields, "cache_salt")


def _opt_str(fields: dict[str, Any], key: str) -> str | None:
    value = fields.get(key)
    if value is None:
        return None
    if not isinstance(value, str):
        raise EventDrop("bad_field", f"{key} is {type(value).__name__}, not a string")
    return value


class PartialPageFilter:
    """Per-worker memory of partial pages, applied to decoded items in stream order.

    Drops the ``PartialPages`` markers (remembering their hashes per rank), swallows removals of
    those hashes, drops a store chained onto one (``parent_partial``) and forgets a rank's
    pages when it is cleared.
    """

    def __init__(self, drops: Counter[str] | None = None, counts: Counter[str] | None = None):
        self.partial: dict[int, set[int]] = {}
        self.drops: Counter[str] = drops if drops is not None else Counter()
        self.counts: Counter[str] = counts if counts is not None else Counter()

    def apply(self, items: list[WireItem]) -> list[KvEvent]:
        out: list[KvEvent] = []
        for item in items:
            if isinstance(item, PartialPages):
                held = self.partial.setdefault(item.dp_rank, set())
                if len(held) + len(item.engine_hashes) > MAX_PARTIAL_PER_RANK:
                    held.clear()  # only costs a few "unknown remove" counts later
                    self.counts["partial_overflow"] += 1
                held.update(hash_values(item.engine_hashes))
            elif isinstance(item, BlockStored):
                partial = self.partial.get(item.dp_rank)
                if partial and item.parent_engine_hash in partial:
                    self.drops["parent_partial"] += 1
                    log.warning(
                        "sglang worker %s rank %d: store chained onto partial page %#x dropped",
                        item.worker_id,
                        item.dp_rank,
                        item.parent_engine_hash,
                    )
                    continue
                out.append(item)
            elif isinstance(item, BlockRemoved):
                partial = self.partial.get(item.dp_rank)
                if partial:
                    hashes = hash_values(item.engine_hashes)
                    kept = [h for h in hashes if h not in partial]
                    swallowed = len(hashes) - len(kept)
                    if swallowed:
                        self.counts["partial_removes_swallowed"] += swallowed
                        partial.difference_update(hashes)
                        if not kept:
                            continue
                        item = msgspec.structs.replace(item, engine_hashes=kept)
                out.append(item)
            else:
                if isinstance(item, AllCleared):
                    self.partial.pop(item.dp_rank, None)
                out.append(item)
        return out


class SglangDecoder:
    """Decodes one SGLang worker's event payloads (all its DP ranks) into normalised events.

    ``decode_items`` is stateless (it only counts); ``decode`` also runs the worker's
    ``PartialPageFilter``. ``page_size`` is the block size the worker advertises
    (``/server_info`` ``kv_events.block_size``) and the one kvplug hashes prompts with.
    """

    def __init__(self, worker_id: str, page_size: int) -> None:
        if page_size <= 0:
            raise ValueError(f"page_size must be positive, got {page_size}")
        self.worker_id = worker_id
        self.page_size = page_size
        self.drops: Counter[str] = Counter()
        self.counts: Counter[str] = Counter()
        self.filter = PartialPageFilter(self.drops, self.counts)
        self.last_error = ""
        self._fast_order = _FAST
        # token ids into uint32 arrays without a Python int each (its buffers are reused and it
        # learns the stream's id widths, so one per decoder)
        self._ids = _fastwire.FastDecoder() if _fastwire is not None else None
        self._join_removes = True  # False: one event per removal, as before (benchmarks)

    @property
    def partial(self) -> dict[int, set[int]]:
        return self.filter.partial

    # -- public ------------------------------------------------------------------------------
    def decode(self, payload: bytes, *, dp_rank: int = 0, seq: int | None = None) -> list[KvEvent]:
        """One message payload → events, partial pages filtered, consecutive removes gathered
        (``coalesce_removes``: each event is a call into the index)."""
        decoded = self.decode_items(payload, dp_rank=dp_rank, seq=seq)
        if decoded is None:
            return []
        events = self.filter.apply(decoded[1])
        return coalesce_removes(events) if self._join_removes else events

    def decode_items(
        self, payload: bytes, *, dp_rank: int = 0, seq: int | None = None
    ) -> tuple[int | None, list[WireItem]] | None:
        """One payload → (the batch's own rank or None, items). None = unreadable batch.

        ``dp_rank`` is the rank of the socket it came on, used when the batch's own
        ``attn_dp_rank`` slot is nil or absent."""
        fast = self._fast_items(payload, dp_rank)
        if fast is not None:
            return fast
        try:
            batch = _decoder.decode(payload)
        except (*DECODE_ERRORS, ValueError, TypeError) as exc:
            self._drop("bad_msgpack", dp_rank, seq, str(exc))
            return None
        if not isinstance(batch, list) or len(batch) < 2 or not isinstance(batch[1], list):
            self._drop("bad_batch", dp_rank, seq, f"not [ts, events, rank]: {type(batch)}")
            return None
        rank = batch[2] if len(batch) > 2 else None
        if rank is not None:
            if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
                self._drop("bad_batch", dp_rank, seq, f"attn_dp_rank {rank!r}")
                return None
            dp_rank = rank
        self.counts["batches"] += 1
        out: list[WireItem] = []
        for position, raw in enumerate(batch[1]):
            try:
                self._decode_event(raw, dp_rank, out)
            except EventDrop as drop:
                self._drop(drop.reason, dp_rank, seq, f"event {position}: {drop.detail}")
        return rank, out

    def _fast_items(self, payload: bytes, dp_rank: int) -> tuple[int | None, list[WireItem]] | None:
        """Typed decoding of a well-formed batch; None sends the payload down the slow path
        (which drops and counts per event). Counts are committed only on success."""
        batch = None
        for i, decoder in enumerate(self._fast_order):
            try:
                batch = decoder.decode(payload)
            except DECODE_ERRORS:
                continue
            if i:
                self._fast_order = self._fast_order[::-1]  # try this engine's form first
            break
        if batch is None:
            return None
        rank = batch.attn_dp_rank
        if rank is not None:
            if rank < 0:
                return None
            dp_rank = rank
        wid = self.worker_id
        out: list[WireItem] = []
        # counted in locals and committed on success (a Counter per event costs more)
        stored = partial = removed = cleared = 0
        join = self._join_removes
        # the removal event this decode made last (at out[open_at]) and the hashes of the
        # adjacent removals it gathers, joined into it once their run ends
        open_rm: Any = None
        open_at = 0
        run: list[Any] = []
        for ev in batch.events:
            kind = type(ev)
            if kind is _RemovedM or kind is _RemovedA:  # the commonest while caches are full
                if ev.medium is None:
                    tier, shared = None, False
                else:
                    medium = MEDIUM_TIERS.get(ev.medium)
                    if medium is None:
                        return None
                    tier, shared = medium
                    if shared:
                        tier = None
                hashes = self._hashes(ev.block_hashes)
                if hashes is None:
                    return None
                if not len(hashes):
                    continue
                removed += len(hashes)
                if (
                    join
                    and out
                    and out[-1] is open_rm
                    and open_rm.tier == tier
                    and open_rm.shared == shared
                ):
                    # one removal per evicted radix node, several in a row: one event (each
                    # is a call into the index); ``coalesce_removes`` joins the rest later
                    run.append(hashes)
                    continue
                if len(run) > 1:
                    out[open_at] = joined_remove(open_rm, run)
                open_rm = BlockRemoved(
                    worker_id=wid, dp_rank=dp_rank, tier=tier, engine_hashes=hashes, shared=shared
                )
                run = [hashes]
                open_at = len(out)
                out.append(open_rm)
            elif kind is _StoredM or kind is _StoredA:
                medium = (
                    MEDIUM_TIERS.get(ev.medium) if ev.medium is not None else (Tier.DEVICE, False)
                )
                bs = ev.block_size
                if medium is None or bs <= 0:
                    return None
                hashes = self._hashes(ev.block_hashes)
                if hashes is None:
                    return None
                if not len(hashes):
                    # nothing to store, but the checked path reads the ids all the same
                    if self._token_ids(ev.token_ids, 0) is None:
                        return None
                    continue
                if bs > self.page_size:  # before the ids: a hostile size must not size a read
                    return None
                tokens = self._token_ids(ev.token_ids, len(hashes) * bs)
                if tokens is None or len(tokens) != len(hashes) * bs:
                    return None
                if bs < self.page_size:
                    partial += len(hashes)
                    out.append(PartialPages(worker_id=wid, dp_rank=dp_rank, engine_hashes=hashes))
                    continue
                stored += len(hashes)
                parent = ev.parent_block_hash
                out.append(
                    full_blocks_stored(
                        wid,
                        dp_rank,
                        medium[0],
                        None if parent is None else parent & MASK64,
                        hashes,
                        tokens,
                        bs,
                        lora_name=ev.lora_name,
                        cache_salt=ev.cache_salt,
                        shared=medium[1],
                    )
                )
            else:
                cleared += 1
                out.append(AllCleared(worker_id=wid, dp_rank=dp_rank))
        if len(run) > 1:
            out[open_at] = joined_remove(open_rm, run)
        counts = self.counts
        counts["batches"] += 1
        for key, n in (
            ("stored_blocks", stored),
            ("partial_pages", partial),
            ("removed_blocks", removed),
            ("cleared", cleared),
        ):
            if n:
                counts[key] += n
        return rank, out

    def _hashes(self, raw: msgspec.Raw) -> Any:
        """An event's raw ``block_hashes`` folded to u64: a uint64 array from the compiled
        reader, else a list from msgspec (what the reader declines); None if neither reads it
        or there are more than MAX_BLOCKS_PER_EVENT."""
        if self._ids is not None:
            hashes = _fastwire.hash_array(raw, MAX_BLOCKS_PER_EVENT)
            if hashes is not None:
                return hashes
        try:
            values = _HASHES.decode(raw)
        except DECODE_ERRORS:
            return None
        if len(values) > MAX_BLOCKS_PER_EVENT:
            return None
        return [h & MASK64 for h in values]

    def _token_ids(self, raw: msgspec.Raw, expected: int) -> Any:
        """A store's raw ``token_ids``: a uint32 array from the compiled loop, else a list from
        msgspec (EAGLE3's pairs, or what the loop declines); None if neither reads it."""
        if self._ids is not None:
            tokens = self._ids.token_array(raw, expected)
            if tokens is not None:
                return tokens
        try:
            return _TOKENS.decode(raw)
        except DECODE_ERRORS:
            try:
                return [t for t, _ in _BIGRAMS.decode(raw)]
            except DECODE_ERRORS:
                return None

    def stats(self) -> dict[str, int]:
        s = {f"events_{k}": v for k, v in self.counts.items()}
        s.update({f"dropped_{k}": v for k, v in self.drops.items()})
        s["partial_pages_held"] = sum(len(p) for p in self.partial.values())
        return s

    # -- internals ---------------------------------------------------------------------------
    def _drop(self, reason: str, dp_rank: int, seq: int | None, detail: str) -> None:
        self.drops[reason] += 1
        self.last_error = f"{reason}: {detail}"
        n = self.drops[reason]
        if n <= 5 or n % 1000 == 0:  # counters keep the totals; the log stays readable
            log.warning(
                "sglang worker %s rank %s seq %s: dropped (%s, %d so far) %s",
                self.worker_id,
                dp_rank,
                seq,
                reason,
                n,
                detail,
            )

    def _decode_event(self, raw: Any, dp_rank: int, out: list[WireItem]) -> None:
        if isinstance(raw, dict):
            tag = raw.get("type")
        elif isinstance(raw, list) and raw:
            tag = raw[0]
        else:
            raise EventDrop("bad_event", f"event is {type(raw).__name__}")
        if tag == "BlockStored":
            self._stored(_as_fields(raw, _STORED_FIELDS, tag), dp_rank, out)
        elif tag == "BlockRemoved":
            self._removed(_as_fields(raw, _REMOVED_FIELDS, tag), dp_rank, out)
        elif tag == "AllBlocksCleared":
            self.counts["cleared"] += 1
            out.append(AllCleared(worker_id=self.worker_id, dp_rank=dp_rank))
        else:
            raise EventDrop("unknown_event", f"event type {tag!r}")

    def _stored(self, f: dict[str, Any], dp_rank: int, out: list[WireItem]) -> None:
        hashes = _hash_list(f.get("block_hashes"))
        parent_raw = f.get("parent_block_hash")
        parent = None if parent_raw is None else u64_hash(parent_raw, "parent_block_hash")
        tokens = _tokens(f.get("token_ids"))
        block_size = f.get("block_size")
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
            raise EventDrop("bad_block_size", f"block_size {block_size!r}")
        tier, shared = _medium(f.get("medium"))
        cache_salt = _cache_salt(f)
        lora_name = _opt_str(f, "lora_name")
        if not hashes:
            return
        if len(tokens) != len(hashes) * block_size:
            raise EventDrop(
                "length_mismatch",
                f"{len(tokens)} tokens for {len(hashes)} blocks of {block_size}",
            )
        if block_size < self.page_size:
            # the partial tail page of a radix node: never matchable, kept for its removal
            self.counts["partial_pages"] += len(hashes)
            out.append(
                PartialPages(worker_id=self.worker_id, dp_rank=dp_rank, engine_hashes=hashes)
            )
            return
        if block_size != self.page_size:
            raise EventDrop(
                "block_size_mismatch",
                f"block_size {block_size} but the worker advertised page size {self.page_size}",
            )
        self.counts["stored_blocks"] += len(hashes)
        out.append(
            full_blocks_stored(
                self.worker_id,
                dp_rank,
                tier,
                parent,
                hashes,
                tokens,
                block_size,
                lora_name=lora_name,
                cache_salt=cache_salt,
                shared=shared,
            )
        )

    def _removed(self, f: dict[str, Any], dp_rank: int, out: list[WireItem]) -> None:
        hashes = _hash_list(f.get("block_hashes"))
        medium = f.get("medium")
        tier, shared = _medium(medium)
        if not hashes:
            return
        self.counts["removed_blocks"] += len(hashes)
        # A medium names the tier the blocks left; without one (older builds) any tier.
        out.append(
            BlockRemoved(
                worker_id=self.worker_id,
                dp_rank=dp_rank,
                tier=None if shared or medium is None else tier,
                engine_hashes=hashes,
                shared=shared,
            )
        )


def compare_paths(
    payload: bytes, typed: SglangDecoder, checked: SglangDecoder, dp_rank: int = 0
) -> tuple[list[KvEvent], str | None]:
    """One payload through two decoders of one stream: ``typed`` as kvplug runs it and
    ``checked``, whose every batch goes the checked per-event path (``_fast_order = ()``).
    Where the typed path takes the batch, the checked one must give the same events (the
    compiled readers' arrays compared as lists), count the same and drop nothing; where it
    does not, both run the checked path. Returns (``typed``'s events, what differs or None).
    For the tests and the fuzzer.

    One difference is kept: a map key SGLang does not define is ignored whatever it holds
    (vLLM's decoders follow the same rule), while the checked path decodes the whole batch
    generically first, so a string there that is not valid UTF-8 drops the batch on that path
    alone (``bad_msgpack``)."""
    checked._fast_order = ()
    taken = SglangDecoder(typed.worker_id, typed.page_size)._fast_items(payload, dp_rank)
    drops, counts = dict(checked.drops), dict(typed.counts)
    a = typed.decode(payload, dp_rank=dp_rank)
    b = checked.decode(payload, dp_rank=dp_rank)
    if taken is None:
        return a, None
    dropped = {k: v - drops.get(k, 0) for k, v in checked.drops.items() if v != drops.get(k, 0)}
    if dropped:
        if set(dropped) == {"bad_msgpack"} and "UTF-8" in checked.last_error:
            checked.counts.update({k: v - counts.get(k, 0) for k, v in typed.counts.items()})
            checked.filter.partial = {r: set(h) for r, h in typed.partial.items()}
            return a, None  # the kept difference (docstring); the two streams re-aligned
        return a, f"the typed path took a batch the checked one dropped from: {checked.last_error}"
    ea, eb = [canonical_event(e) for e in a], [canonical_event(e) for e in b]
    if ea != eb:
        return a, f"events differ:\n typed   {ea}\n checked {eb}"
    if typed.counts != checked.counts:
        return a, f"counts differ: {dict(typed.counts)} vs {dict(checked.counts)}"
    if typed.partial != checked.partial:
        return a, "partial pages held differ"
    return a, None


# -------------------------------------------------------------------------------------------
# Encoder (simulated SGLang engines, tests): kvplug events -> the bytes a given SGLang sends
# -------------------------------------------------------------------------------------------

_TIER_MEDIUM = {Tier.DEVICE: "GPU", Tier.HOST: "CPU_PINNED", Tier.DISK: "DISK"}
_enc = msgspec.msgpack.Encoder()


def encode_batch(
    events: Sequence[KvEvent],
    form: str = "0.5.23",
    *,
    ts: float = 0.0,
    attn_dp_rank: int | None = 0,
) -> bytes:
    """One ``KVEventBatch`` payload as SGLang ``form`` encodes it: ``"0.5.15"`` (arrays, nil
    trailing fields omitted), ``"0.5.18"`` (arrays, salt in a metadata element) or
    ``"0.5.23"`` (maps). ``BlockMoved`` has no SGLang form (raises ValueError); a salt or
    LoRA name the form cannot carry raises ValueError too."""
    if form not in ("0.5.15", "0.5.18", "0.5.23"):
        raise ValueError(f"unknown SGLang form {form!r}")
    out: list[Any] = []
    for ev in events:
        if isinstance(ev, AllCleared):
            out.append({"type": "AllBlocksCleared"} if form == "0.5.23" else ["AllBlocksCleared"])
            continue
        if isinstance(ev, BlockStored | BlockRemoved):
            medium = "EXTERNAL" if ev.shared else _TIER_MEDIUM.get(ev.tier or Tier.DEVICE)
            hashes = [int64_hash(h) for h in ev.engine_hashes]
        if isinstance(ev, BlockStored):
            if ev.token_ids is None:
                raise ValueError("SGLang stores always carry token ids")
            parent = None if ev.parent_engine_hash is None else int64_hash(ev.parent_engine_hash)
            tokens = list(ev.token_ids)
            item: dict[str, Any] | list[Any]
            if form == "0.5.23":
                item = {
                    "type": "BlockStored",
                    "block_hashes": hashes,
                    "parent_block_hash": parent,
                    "token_ids": tokens,
                    "block_size": ev.block_size,
                    "lora_id": None,
                    "medium": medium,
                }
                if ev.cache_salt is not None:
                    item["cache_salt"] = ev.cache_salt
                if ev.lora_name is not None:
                    item["lora_name"] = ev.lora_name
            else:
                if ev.lora_name is not None or (ev.cache_salt is not None and form == "0.5.15"):
                    raise ValueError(f"SGLang {form} arrays cannot carry this namespace")
                item = ["BlockStored", hashes, parent, tokens, ev.block_size, None, medium]
                if ev.cache_salt is not None:
                    item = [*item, {"cache_salt": ev.cache_salt}]
            out.append(item)
        elif isinstance(ev, BlockRemoved):
            if form == "0.5.23":
                out.append({"type": "BlockRemoved", "block_hashes": hashes, "medium": medium})
            else:
                out.append(["BlockRemoved", hashes, medium])
        elif not isinstance(ev, AllCleared):
            raise ValueError(f"{type(ev).__name__} has no SGLang wire form")
    return _enc.encode([ts, out, attn_dp_rank])


def recorder_queue(events: Sequence[KvEvent]) -> list[KvEvent]:
    """``events`` grouped as SGLang 0.5.23 publishes them. Its radix cache records one store
    per page and one removal per evicted node, and its event recorder appends each to the last
    event queued when it can (``KVCacheEventRecorder.enqueue``, ``srt/mem_cache/events.py``):
    a store onto the store whose last page it chains to (same medium, LoRA, page size and
    salt), a removal onto a removal of the same medium. So a run of chained stores goes out
    as one event, and so does a run of removals. For encoders of SGLang's payloads in tests
    and benchmarks; ``tests/test_sglang_upstream.py`` checks it against the wheel's own
    recorder."""
    out: list[KvEvent] = []
    for e in events:
        last = out[-1] if out else None
        if type(e) is BlockRemoved and type(last) is BlockRemoved:
            if (last.tier, last.shared, last.dp_rank) == (e.tier, e.shared, e.dp_rank):
                hashes = [*last.engine_hashes, *e.engine_hashes]
                out[-1] = msgspec.structs.replace(last, engine_hashes=hashes)
                continue
        if (
            type(e) is BlockStored
            and type(last) is BlockStored
            and len(last.engine_hashes)
            and e.parent_engine_hash == last.engine_hashes[-1]
            and e.token_ids is not None
            and last.token_ids is not None
            and (e.tier, e.shared, e.dp_rank, e.block_size, e.cache_salt, e.lora_name)
            == (last.tier, last.shared, last.dp_rank, last.block_size, last.cache_salt,
                last.lora_name)
        ):  # fmt: skip
            out[-1] = msgspec.structs.replace(
                last,
                engine_hashes=[*last.engine_hashes, *e.engine_hashes],
                token_ids=[*last.token_ids, *e.token_ids],
            )
            continue
        out.append(e)
    return out
