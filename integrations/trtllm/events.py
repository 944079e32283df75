"""TensorRT-LLM KV-cache event JSON → kvplug's normalised events.

``POST /kv_cache_events`` answers a JSON array of envelopes (``KVCacheEventSerializer``)::

    {"event_id": N, "window_size": W, "attention_dp_rank": R?, "hash_algo": ...?,
     "data": {"type": "created" | "stored" | "removed" | "updated", ...}}

Rules (each tested in ``tests/test_trtllm_events.py``; PROTOCOLS.md §3.2–3.3):

* Index per (worker, ``attention_dp_rank``); a missing rank is rank 0.
* ``event_id`` counts from 0 per rank. A gap (lost events: the engine's buffer overflowed or
  a drained answer never reached us) or a step backwards → ``AllCleared`` for that rank and
  resync from the live stream (TRT-LLM has no replay).
* ``created`` (one per attention window at engine start) → ``AllCleared`` at the start of each
  run of ``created`` events (a restart), and the run's largest ``window_size`` is the window
  kvplug indexes: VSWA models emit every store once per window, only the full-attention
  (largest) window describes reusable prefixes.
* ``stored``: blocks in prefix order chained from ``parent_hash``. Tokens come from
  ``tokens[].token_id``. A block shorter than ``tokens_per_block`` is the partial tail: the
  chain stops there, its hash is remembered and its later ``removed`` swallowed. A block whose
  token ids are not integers (hex strings from V2 multimodal builds) stops the chain too and
  is counted. Blocks split into several ``BlockStored`` at every change of tier
  (``cache_level``), cache salt or LoRA.
* ``removed`` → ``BlockRemoved`` from any tier (TRT-LLM does not say which).
* ``updated`` with ``cache_level`` {old_value, new_value} → ``BlockMoved`` (0 = GPU, 1 = host);
  priority-only updates are ignored (counted).
* Hashes are uint64 (JSON integers up to 2**64 − 1); V2-hash builds may send hex strings,
  folded to their low 64 bits (an all-zero parent string means "no parent").
* ``mm_keys`` and non-zero ``token_extra_id`` fold into the block's ``block_extra`` so such
  blocks can never match a text-only request.
* LoRA: an event-level ``lora_name`` (some 2026 builds) names the adapter; otherwise a block's
  non-zero ``lora_id`` maps through ``lora_names`` (default ``trtllm-lora-<id>``).

Two readers, one set of rules. ``decode`` takes envelopes as a plain JSON decode gives them
(dicts: the checked reader) or as ``poller.parse_answer`` reads them (``read_envelope``): a
``stored`` envelope of the usual shape read by msgspec into typed structs
(``_StoredEnvelope``), which skips building a dict per token, most of the checked reader's
cost, and every other envelope (another kind, a field of another type) as a dict. Both feed
the same sequencing and store logic, so they give the same events, counts and state
(``tests/test_trtllm_typed_reader.py``; ``benchmarks/fuzz_decoders.py`` compares them).
"""

from __future__ import annotations

import hashlib
import logging
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
from kvplug.integrations.common import MASK64, EventDrop, full_blocks_stored, u64_hash

from kvplug import AllCleared, BlockMoved, BlockRemoved, BlockStored, KvEvent, Tier

log = logging.getLogger("kvplug.integrations.trtllm")

MAX_TOKEN = 1 << 32
MAX_PARTIAL_PER_RANK = 1 << 20
CACHE_LEVEL_TIERS = {0: Tier.DEVICE, 1: Tier.HOST}


@dataclass
class RankState:
    """What the decoder remembers about one (worker, attention DP rank) stream."""

    last_event_id: int | None = None
    window: int | None = None  # the window indexed (max of the last created run)
    in_created_run: bool = False
    partial: set[int] = field(default_factory=set)
    capacity_blocks: list[int] = field(default_factory=list)  # per cache level, from created


def parse_hash(value: Any, what: str, *, allow_none: bool = False) -> int | None:
    """A TRT-LLM block hash → u64. Integers (uint64, defensively int64) or hex strings."""
    if value is None:
        if allow_none:
            return None
        raise EventDrop("bad_hash", f"{what} is null")
    if isinstance(value, str):
        try:
            h = int(value, 16)
        except ValueError:
            raise EventDrop("bad_hash", f"{what} {value!r} is not hex") from None
        if allow_none and h == 0:
            return None  # V2 hashing writes an all-zero digest for "no parent"
        return h & MASK64
    return u64_hash(value, what)


def _block_extra(mm_keys: Any, extra_ids: list[int]) -> int:
    """Per-block u64 extra key from multimodal keys and token extra ids; 0 = none."""
    mm = mm_keys or []
    if not mm and not any(extra_ids):
        return 0
    h = hashlib.blake2b(digest_size=8)
    if isinstance(mm, list):
        for key in mm:
            if isinstance(key, dict):
                h.update(f"mm:{key.get('hash')}:{key.get('start_offset')};".encode())
    if any(extra_ids):
        h.update(("x:" + ",".join(map(str, extra_ids))).encode())
    return int.from_bytes(h.digest(), "little") or 1


def _why_ids(ids: list) -> str | None:
    """The drop reason of the first unusable token id (in token order), None if all are."""
    for tid in ids:
        if isinstance(tid, str):
            return "hex_token_ids"
        if isinstance(tid, bool) or not isinstance(tid, int) or not 0 <= tid < MAX_TOKEN:
            return "bad_tokens"
    return None


# The typed read of a stored envelope. Each field is typed as narrowly as the checked reader
# accepts without a drop or a coercion, so whatever decodes here the checked reader would take
# the same way; everything else (a bool, a null where a number belongs, another kind) fails
# the typed read and goes the checked way. Unknown fields are ignored by both.
class _Token(msgspec.Struct, gc=False):
    token_id: int | str
    token_extra_id: int = 0


class _Block(msgspec.Struct, gc=False):
    block_hash: int | str
    tokens: list[_Token]
    cache_level: int = 0
    cache_salt: str | None = None
    lora_id: int | None = None
    mm_keys: Any = None


class _StoredData(msgspec.Struct, gc=False):
    type: str  # a plain field, not a msgspec tag: a tag may be absent, "type" may not
    blocks: list[_Block]
    parent_hash: int | str | None = None
    lora_name: str | None = None


class _StoredEnvelope(msgspec.Struct, gc=False):
    event_id: int
    data: _StoredData
    window_size: int | None = None
    attention_dp_rank: int | None = None
    hash_algo: str | None = None


_typed_envelope = msgspec.json.Decoder(_StoredEnvelope)
_any_json = msgspec.json.Decoder()


def read_envelope(raw: msgspec.Raw) -> Any:
    """One envelope's raw JSON → a ``_StoredEnvelope`` if it is a stored event of the usual
    shape, else what a plain JSON decode gives (for the checked reader). Raises what that
    plain decode raises (``msgspec.DecodeError``, ``RecursionError``)."""
    try:
        env = _typed_envelope.decode(raw)
        if env.data.type == "stored":
            return env
    except msgspec.ValidationError:
        pass
    return _any_json.decode(raw)


def _checked_block(block: Any, i: int) -> tuple[int, Any, Any, Any, Any, Any]:
    """A block dict → (hash, tokens list, raw cache_level, cache_salt, lora_id, mm_keys)."""
    if not isinstance(block, dict):
        raise EventDrop("bad_block", f"blocks[{i}] is not an object")
    h = parse_hash(block.get("block_hash"), f"blocks[{i}].block_hash")
    assert h is not None
    tokens = block.get("tokens")
    if not isinstance(tokens, list):
        raise EventDrop("bad_block", f"blocks[{i}] has no tokens list")
    return (
        h,
        tokens,
        block.get("cache_level", 0),
        block.get("cache_salt"),
        block.get("lora_id"),
        block.get("mm_keys"),
    )


def _typed_block(block: _Block, i: int) -> tuple[int, Any, Any, Any, Any, Any]:
    h = parse_hash(block.block_hash, f"blocks[{i}].block_hash")
    assert h is not None
    return h, block.tokens, block.cache_level, block.cache_salt, block.lora_id, block.mm_keys


def _checked_token_ids(tokens: list) -> tuple[list[int], list[int], str | None]:
    """Token dicts → (ids, extra ids, None), or a drop reason for the first bad token."""
    ids: list = []
    extra: list[int] = []
    for t in tokens:
        if not isinstance(t, dict):
            return ids, extra, _why_ids(ids) or "bad_tokens"
        ids.append(t.get("token_id"))
        e = t.get("token_extra_id", 0)
        extra.append(e if isinstance(e, int) and not isinstance(e, bool) else 0)
    return ids, extra, _why_ids(ids)


def _typed_token_ids(tokens: list[_Token]) -> tuple[list[int], list[int], str | None]:
    ids: list = [t.token_id for t in tokens]
    try:  # all ints in range, checked by two C loops; a str among ints raises TypeError
        usable = 0 <= min(ids) and max(ids) < MAX_TOKEN
    except (TypeError, ValueError):
        usable = False
    if not usable:
        return ids, [], _why_ids(ids) or "bad_tokens"
    return ids, [t.token_extra_id for t in tokens], None


class TrtllmDecoder:
    """Decodes one TRT-LLM worker's drained event arrays, keeping per-rank stream state."""

    def __init__(
        self,
        worker_id: str,
        tokens_per_block: int,
        *,
        lora_names: Mapping[int, str] | None = None,
    ) -> None:
        if tokens_per_block <= 0:
            raise ValueError(f"tokens_per_block must be positive, got {tokens_per_block}")
        self.worker_id = worker_id
        self.tokens_per_block = tokens_per_block
        self.lora_names = dict(lora_names or {})
        self.ranks: dict[int, RankState] = {}
        self.drops: Counter[str] = Counter()
        self.counts: Counter[str] = Counter()
        self.hash_algo: str | None = None

    # -- public ------------------------------------------------------------------------------
    def decode(self, envelopes: Any) -> list[KvEvent]:
        """One drained answer (the parsed JSON array) → events, in order."""
        out: list[KvEvent] = []
        if not isinstance(envelopes, list):
            self._drop("bad_batch", None, None, f"answer is {type(envelopes).__name__}")
            return out
        for envelope in envelopes:
            try:
                if type(envelope) is _StoredEnvelope:
                    self._typed_stored(envelope, out)
                else:
                    self._envelope(envelope, out)
            except EventDrop as drop:
                if isinstance(envelope, dict):
                    rank, eid = envelope.get("attention_dp_rank"), envelope.get("event_id")
                elif type(envelope) is _StoredEnvelope:
                    rank, eid = envelope.attention_dp_rank, envelope.event_id
                else:
                    rank = eid = None
                self._drop(drop.reason, rank, eid, drop.detail)
        return out

    def lost_stream(self) -> list[KvEvent]:
        """The poller lost track (worker unreachable, restarted): clear every known rank."""
        out: list[KvEvent] = []
        for rank, state in self.ranks.items():
            out.append(AllCleared(worker_id=self.worker_id, dp_rank=rank))
            state.last_event_id = None
            state.partial.clear()
            state.in_created_run = False
        self.counts["lost_stream"] += 1
        return out

    def stats(self) -> dict[str, int]:
        s = {f"events_{k}": v for k, v in self.counts.items()}
        s.update({f"dropped_{k}": v for k, v in self.drops.items()})
        s["partial_blocks_held"] = sum(len(r.partial) for r in self.ranks.values())
        return s

    # -- internals ---------------------------------------------------------------------------
    def _drop(self, reason: str, rank: Any, event_id: Any, detail: str) -> None:
        self.drops[reason] += 1
        n = self.drops[reason]
        if n <= 5 or n % 1000 == 0:  # counters keep the totals; the log stays readable
            log.warning(
                "trtllm worker %s rank %s event_id %s: dropped (%s, %d so far) %s",
                self.worker_id,
                rank,
                event_id,
                reason,
                n,
                detail,
            )

    def _clear(self, rank: int, state: RankState, out: list[KvEvent]) -> None:
        state.partial.clear()
        out.append(AllCleared(worker_id=self.worker_id, dp_rank=rank))

    def _envelope(self, env: Any, out: list[KvEvent]) -> None:
        """The checked reader: one envelope as a plain JSON decode gives it."""
        if not isinstance(env, dict):
            raise EventDrop("bad_event", f"envelope is {type(env).__name__}")
        if not env:
            # KVCacheEventSerializer renders a None event as {} (the LLM API's own tests skip
            # them with ``if event:``): nothing happened, and no event_id was used
            self.counts["empty_envelopes"] += 1
            return
        data = env.get("data")
        if not isinstance(data, dict):
            raise EventDrop("bad_event", "no data object")
        kind = data.get("type")
        entered = self._enter(
            kind,
            data,
            env.get("attention_dp_rank", 0),
            env.get("event_id"),
            env.get("window_size"),
            env.get("hash_algo"),
            out,
        )
        if entered is None:
            return
        rank, state = entered
        if kind == "stored":
            self._stored(
                data.get("parent_hash"), data.get("blocks"), data.get("lora_name"), False,
                rank, state, out,
            )  # fmt: skip
        elif kind == "removed":
            self._removed(data, rank, state, out)
        else:
            self._updated(data, rank, state, out)

    def _typed_stored(self, env: _StoredEnvelope, out: list[KvEvent]) -> None:
        """The typed reader: a stored envelope msgspec has read into structs."""
        data = env.data
        entered = self._enter(
            "stored", None, env.attention_dp_rank, env.event_id, env.window_size,
            env.hash_algo, out,
        )  # fmt: skip
        if entered is not None:
            rank, state = entered
            if not self._plain_store(data, rank, state, out):
                self._stored(data.parent_hash, data.blocks, data.lora_name, True, rank, state, out)

    def _plain_store(
        self, data: _StoredData, rank: int, state: RankState, out: list[KvEvent]
    ) -> bool:
        """The common store in whole: full device blocks with integer hashes and plain token
        ids, no salt, LoRA, multimodal key or extra id. Gives what ``_stored`` gives for it
        (one ``BlockStored``) with a few list-wide checks in place of a pass per block, and
        returns False, having done nothing, for any other store."""
        blocks = data.blocks
        n = self.tokens_per_block
        if not blocks or data.lora_name is not None:
            return False
        for b in blocks:
            if len(b.tokens) != n or b.cache_level or b.cache_salt is not None or b.lora_id:
                return False
            if b.mm_keys:
                return False
        hashes: list = [b.block_hash for b in blocks]
        ids: list = [t.token_id for b in blocks for t in b.tokens]
        try:  # a str among ints raises TypeError: the per-block path decides then
            lowest = min(hashes)
            if not (-(1 << 63) <= lowest and max(hashes) <= MASK64):
                return False
            if not (0 <= min(ids) and max(ids) < MAX_TOKEN):
                return False
        except TypeError:
            return False
        if any([t.token_extra_id for b in blocks for t in b.tokens]):
            return False
        parent = parse_hash(data.parent_hash, "parent_hash", allow_none=True)
        if parent is not None and parent in state.partial:
            return False
        if lowest < 0:  # int64 hashes fold to u64, as parse_hash folds them
            hashes = [h & MASK64 for h in hashes]
        out.append(full_blocks_stored(self.worker_id, rank, Tier.DEVICE, parent, hashes, ids, n))
        self.counts["stored_blocks"] += len(hashes)
        return True

    def _enter(
        self,
        kind: Any,
        data: dict | None,
        rank: Any,
        event_id: Any,
        window: Any,
        algo: Any,
        out: list[KvEvent],
    ) -> tuple[int, RankState] | None:
        """An envelope's header: checks, the rank's event_id sequence, ``created`` and the
        window. Returns the rank and its state for a stored/removed/updated event that the
        indexed window holds, else None (handled here, or another window's)."""
        if rank is None:
            rank = 0
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
            raise EventDrop("bad_event", f"attention_dp_rank {rank!r}")
        if isinstance(event_id, bool) or not isinstance(event_id, int) or event_id < 0:
            raise EventDrop("bad_event", f"event_id {event_id!r}")
        if window is not None and (isinstance(window, bool) or not isinstance(window, int)):
            raise EventDrop("bad_event", f"window_size {window!r}")
        if isinstance(algo, str):
            self.hash_algo = algo
        state = self.ranks.setdefault(rank, RankState())

        # sequence: a gap or a step back means we no longer know what the rank holds
        last = state.last_event_id
        state.last_event_id = event_id
        if last is not None and event_id != last + 1:
            if not (kind == "created" and event_id == 0):  # a restart clears below anyway
                self.counts["gaps" if event_id > last else "id_regressions"] += 1
                log.warning(
                    "trtllm worker %s rank %d: event_id %d after %d; clearing and resyncing",
                    self.worker_id,
                    rank,
                    event_id,
                    last,
                )
                self._clear(rank, state, out)
                state.in_created_run = False

        if kind == "created":
            assert data is not None
            self._created(data, rank, window, state, out)
            return None
        state.in_created_run = False
        if kind not in ("stored", "removed", "updated"):
            raise EventDrop("unknown_event", f"data.type {kind!r}")
        if window is not None:
            if state.window is None:
                state.window = window  # subscribed late: adopt the first window seen
            elif window > state.window and not state.capacity_blocks:
                # no created seen and a larger window shows up: index that one instead
                self._clear(rank, state, out)
                state.window = window
                self.counts["window_switches"] += 1
            if window != state.window:
                self.counts["other_window_skipped"] += 1
                return None
        return rank, state

    def _created(
        self, data: dict, rank: int, window: int | None, state: RankState, out: list[KvEvent]
    ) -> None:
        levels = data.get("num_blocks_per_cache_level")
        if not state.in_created_run:
            self._clear(rank, state, out)
            state.window = None
            state.in_created_run = True
            self.counts["created_runs"] += 1
        if window is not None:
            state.window = window if state.window is None else max(state.window, window)
            if window == state.window and isinstance(levels, list):
                state.capacity_blocks = [int(x) for x in levels if isinstance(x, int)]

    def _stored(
        self,
        parent_hash: Any,
        blocks: Any,
        data_lora: Any,  # some 2026 builds name the adapter per event
        typed: bool,  # blocks are _Block structs (the typed reader), else dicts
        rank: int,
        state: RankState,
        out: list[KvEvent],
    ) -> None:
        parent = parse_hash(parent_hash, "parent_hash", allow_none=True)
        if not isinstance(blocks, list):
            raise EventDrop("bad_event", "stored without a blocks list")
        if parent is not None and parent in state.partial:
            raise EventDrop("parent_partial", f"parent {parent:#x} is a partial block")
        if data_lora is not None and not isinstance(data_lora, str):
            raise EventDrop("bad_field", f"lora_name {data_lora!r}")
        run_key: tuple | None = None
        run_hashes: list[int] = []
        run_tokens: list[int] = []
        run_extra: list[int] = []
        run_parent = parent

        def flush() -> None:
            nonlocal run_hashes, run_tokens, run_extra, run_parent
            if not run_hashes:
                return
            tier, salt, lora = run_key  # type: ignore[misc]
            out.append(
                full_blocks_stored(
                    self.worker_id,
                    rank,
                    tier,
                    run_parent,
                    run_hashes,
                    run_tokens,
                    self.tokens_per_block,
                    cache_salt=salt,
                    lora_name=lora,
                    block_extra=run_extra if any(run_extra) else None,
                )
            )
            self.counts["stored_blocks"] += len(run_hashes)
            run_parent = run_hashes[-1]
            run_hashes, run_tokens, run_extra = [], [], []

        read_block = _typed_block if typed else _checked_block
        token_ids = _typed_token_ids if typed else _checked_token_ids
        for i, block in enumerate(blocks):
            try:
                h, tokens, level, salt, lora_id, mm_keys = read_block(block, i)
            except EventDrop as drop:
                self._drop(drop.reason, rank, None, drop.detail)
                break
            if len(tokens) < self.tokens_per_block:
                if len(state.partial) >= MAX_PARTIAL_PER_RANK:
                    state.partial.clear()
                state.partial.add(h)
                self.counts["partial_blocks"] += 1
                break
            if len(tokens) > self.tokens_per_block:
                self._drop(
                    "block_size_mismatch",
                    rank,
                    None,
                    f"blocks[{i}] has {len(tokens)} tokens, tokens_per_block is "
                    f"{self.tokens_per_block}",
                )
                break
            ids, extra_ids, why = token_ids(tokens)
            if why is not None:
                self._drop(why, rank, None, f"blocks[{i}]: token ids unusable")
                break
            tier = CACHE_LEVEL_TIERS.get(level) if isinstance(level, int) else None
            if tier is None:
                self._drop("bad_cache_level", rank, None, f"blocks[{i}] cache_level {level!r}")
                break
            salt = str(salt) if salt is not None else None
            try:
                lora = data_lora or self._lora_name(lora_id)
            except EventDrop as drop:
                self._drop(drop.reason, rank, None, f"blocks[{i}]: {drop.detail}")
                break
            key = (tier, salt, lora)
            if key != run_key:
                flush()
                run_key = key
            run_hashes.append(h)
            run_tokens.extend(ids)
            run_extra.append(_block_extra(mm_keys, extra_ids))
        flush()

    def _lora_name(self, lora_id: Any) -> str | None:
        if lora_id is None or lora_id == 0 or isinstance(lora_id, bool):
            return None
        if not isinstance(lora_id, int):
            raise EventDrop("bad_field", f"lora_id {lora_id!r}")
        return self.lora_names.get(lora_id, f"trtllm-lora-{lora_id}")

    def _removed(self, data: dict, rank: int, state: RankState, out: list[KvEvent]) -> None:
        raw = data.get("block_hashes")
        if not isinstance(raw, list):
            raise EventDrop("bad_event", "removed without block_hashes")
        hashes = []
        for i, value in enumerate(raw):
            h = parse_hash(value, f"block_hashes[{i}]")
            assert h is not None
            if h in state.partial:
                state.partial.discard(h)
                self.counts["partial_removes_swallowed"] += 1
            else:
                hashes.append(h)
        if hashes:
            self.counts["removed_blocks"] += len(hashes)
            out.append(BlockRemoved(worker_id=self.worker_id, dp_rank=rank, engine_hashes=hashes))

    def _updated(self, data: dict, rank: int, state: RankState, out: list[KvEvent]) -> None:
        h = parse_hash(data.get("block_hash"), "block_hash")
        assert h is not None
        diff = data.get("cache_level")
        if not isinstance(diff, dict):
            self.counts["priority_updates_ignored"] += 1
            return
        old, new = diff.get("old_value"), diff.get("new_value")
        src = CACHE_LEVEL_TIERS.get(old) if isinstance(old, int) else None
        dst = CACHE_LEVEL_TIERS.get(new) if isinstance(new, int) else None
        if src is None or dst is None:
            raise EventDrop("bad_cache_level", f"cache_level {old!r} -> {new!r}")
        if h in state.partial or src == dst:
            return
        self.counts["moved_blocks"] += 1
        out.append(
            BlockMoved(
                worker_id=self.worker_id,
                dp_rank=rank,
                from_tier=src,
                to_tier=dst,
                engine_hashes=[h],
            )
        )


# -- encoders (tests and benchmarks): events as TRT-LLM's serializer renders them ---------------
def stored_event_data(parent_hash: int | None, blocks: Sequence[tuple[int, Sequence[int]]]) -> dict:
    """A ``stored`` event's ``data`` as ``KVCacheEventSerializer`` renders it: device blocks of
    (hash, token ids), priority 35, no extra ids."""
    return {
        "type": "stored",
        "parent_hash": parent_hash,
        "blocks": [
            {
                "type": "stored_block",
                "block_hash": h,
                "tokens": [
                    {"type": "unique_token", "token_id": int(t), "token_extra_id": 0}
                    for t in tokens
                ],
                "cache_level": 0,
                "priority": 35,
            }
            for h, tokens in blocks
        ],
    }


def encode_answer(
    events: Sequence[KvEvent], first_event_id: int, tokens_per_block: int, window_size: int = 4096
) -> tuple[bytes, int]:
    """Device-tier stores and removals as one drained ``/kv_cache_events`` answer (compact JSON,
    as ``trtllm-serve`` sends it), event ids from ``first_event_id``; and how many envelopes. A
    removal right after a removal joins it, as TRT-LLM's ``KVCacheEventManager`` does."""
    envelopes: list[dict[str, Any]] = []
    for ev in events:
        if isinstance(ev, BlockRemoved):
            last = envelopes[-1]["data"] if envelopes else None
            if last is not None and last["type"] == "removed":
                last["block_hashes"].extend(ev.engine_hashes)
                continue
            data: dict[str, Any] = {"type": "removed", "block_hashes": list(ev.engine_hashes)}
        elif isinstance(ev, BlockStored):
            tokens = list(ev.token_ids or [])
            n = tokens_per_block
            blocks = [(h, tokens[j * n : (j + 1) * n]) for j, h in enumerate(ev.engine_hashes)]
            data = stored_event_data(ev.parent_engine_hash, blocks)
        else:
            raise TypeError(f"no TRT-LLM form for {type(ev).__name__} here")
        event_id = first_event_id + len(envelopes)
        envelopes.append({"event_id": event_id, "data": data, "window_size": window_size})
    return msgspec.json.encode(envelopes), len(envelopes)
