"""KvIndex: the router's view of the core index, keyed by worker and DP rank.

* Endpoint ids: every (worker_id, dp_rank) gets a dense int id (``add_endpoint``); ids freed by
  ``remove_worker`` are reused lowest first, so per-endpoint arrays stay short.
* Events: ``apply`` takes the normalised events of kvplug.events and raises InvalidEvent /
  UnknownWorker naming the worker, rank and (for tokens) the position; ``apply_many`` never
  raises for a bad event: it counts and logs the drop and keeps going. A bad event never
  changes what is already indexed (the core validates before it mutates).
* Hash namespace: ``namespace_seed(lora_name, cache_salt)`` roots the chain of a prompt (and of
  an event without a parent), so requests and events meet in the index.
* Queries: ``query`` returns one reused ``Overlaps`` (dense numpy int32 arrays indexed by
  endpoint id). It is overwritten by the next query on the same KvIndex.

Threading: one thread applies events and queries (the router's event loop); the compiled core
also locks internally so a second thread cannot corrupt it, but results are shared buffers.
"""

from __future__ import annotations

import heapq
import logging
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvplug import core
from kvplug.errors import InvalidEvent, KvplugError, UnknownWorker
from kvplug.events import AllCleared, BlockMoved, BlockRemoved, BlockStored, KvEvent
from kvplug.hashing import namespace_seed

log = logging.getLogger(__name__)

SHARED = core.SHARED
_TIERS = (0, 1, 2)
_LOG_FIRST = 10  # drops logged individually per reason before sampling
_LOG_EVERY = 1000


class Overlaps:
    """How much of one request each endpoint holds (the answer of KvIndex.query).

    ``local, device, host, disk, shared_beyond``: numpy int32 arrays indexed by endpoint id,
    length >= the number of endpoint ids. ``local`` = leading blocks held in any local tier,
    split by best tier into device/host/disk; ``shared_beyond`` = shared-tier blocks
    continuing right after the local prefix. ``shared_prefix`` = shared-tier run from block 0;
    ``walked`` = positions the walk visited.
    """

    __slots__ = ("local", "device", "host", "disk", "shared_beyond", "shared_prefix", "walked")

    def __init__(self, capacity: int = 0) -> None:
        self._set_arrays(*(np.zeros(capacity, np.int32) for _ in range(5)))
        self.shared_prefix = 0
        self.walked = 0

    def _set_arrays(self, local, device, host, disk, shared_beyond) -> None:
        self.local, self.device, self.host, self.disk = local, device, host, disk
        self.shared_beyond = shared_beyond

    def row(self, ep: int) -> tuple[int, int, int, int, int]:
        """(local, device, host, disk, shared_beyond) of one endpoint id."""
        if 0 <= ep < len(self.local):
            return (
                int(self.local[ep]),
                int(self.device[ep]),
                int(self.host[ep]),
                int(self.disk[ep]),
                int(self.shared_beyond[ep]),
            )
        return (0, 0, 0, 0, self.shared_prefix)

    def endpoints(self) -> np.ndarray:
        """Endpoint ids holding at least the first block."""
        return np.flatnonzero(self.local)

    def __repr__(self) -> str:
        rows = {int(e): self.row(int(e)) for e in self.endpoints()}
        return f"Overlaps(walked={self.walked}, shared_prefix={self.shared_prefix}, rows={rows})"


def _empty_counter() -> Counter:
    # an empty Counter without Counter.__init__'s update() call (4x cheaper; apply_many makes
    # one per batch); Counter keeps no state beyond the dict itself
    return Counter.__new__(Counter)


def reserve_room(index: Any, blocks: int, reserved: int, what: str) -> int:
    """Room for ``blocks`` in ``index`` (``KvIndex.reserve``) when that is more than the
    ``reserved`` already: returns the room reserved now. An index of another kind (no
    ``reserve``) or a failed reservation (logged; its tables then grow as they fill) keeps
    ``reserved``."""
    reserve = getattr(index, "reserve", None)
    if blocks <= reserved or reserve is None:
        return reserved
    try:
        reserve(blocks)
    except (KvplugError, MemoryError) as e:
        log.warning("could not pre-size %s for %d blocks: %s", what, blocks, e)
        return reserved
    return blocks


@dataclass(slots=True)
class ApplyReport:
    """What ``apply_many`` did: events applied, events dropped (by reason), blocks in them."""

    applied: int = 0
    dropped: int = 0
    blocks: int = 0
    reasons: Counter = field(default_factory=_empty_counter)


class KvIndex:
    """The global KV prefix index over (worker, dp_rank) endpoints."""

    def __init__(
        self,
        block_size: int,
        max_entries: int = 0,
        *,
        auto_add: bool = False,
        backend: str | None = None,
    ) -> None:
        if not isinstance(block_size, int) or block_size <= 0:
            raise InvalidEvent(f"block_size must be a positive int, got {block_size!r}")
        self.block_size = block_size
        self.auto_add = auto_add  # unknown (worker, rank) in an event: register it (vs. raise)
        # backend: "c" / "reference" to pin one (tests); None = the active kvplug.core backend
        self.backend = backend or core.backend
        self._impl = core.load_backend(self.backend)
        self.core = self._impl.Index(max_entries)
        self._ids: dict[tuple[str, int], int] = {}
        self._keys: dict[int, tuple[str, int]] = {}
        self._free: list[int] = []
        self._next_id = 0
        self._overlaps = Overlaps()
        self._result = self._impl.QueryResult() if self.backend == "c" else None
        self.drops: Counter = Counter()
        self.unresolved_tier_copies = 0
        self._handlers: dict[type, Callable[[Any], None]] = {
            BlockStored: self._stored,
            BlockRemoved: self._removed,
            BlockMoved: self._moved,
            AllCleared: self._cleared,
        }

    def reserve(self, blocks: int) -> None:
        """Pre-size the compiled index for ``blocks`` distinct blocks (e.g. the fleet's total KV
        capacity) so that filling it never pauses to rehash: its block table, records and
        canonical engine map, which holds the mappings of every engine that agrees with the
        first on a block's engine hash (docs/core.md). Per-endpoint maps, for engines that
        disagree, grow as they fill. No-op on the reference."""
        if hasattr(self.core, "reserve"):
            self.core.reserve(blocks, 0)

    # -- endpoints -------------------------------------------------------------------------------
    def add_endpoint(self, worker_id: str, dp_rank: int = 0) -> int:
        """Dense endpoint id of (worker_id, dp_rank); idempotent."""
        key = (worker_id, int(dp_rank))
        ep = self._ids.get(key)
        if ep is not None:
            return ep
        if not isinstance(worker_id, str) or not worker_id:
            raise UnknownWorker(f"worker id must be a non-empty string, got {worker_id!r}")
        if key[1] < 0:
            raise UnknownWorker(f"worker {worker_id!r}: dp_rank {dp_rank} is negative")
        if self._free:
            ep = heapq.heappop(self._free)
        else:
            ep = self._next_id
            if ep >= core.MAX_ENDPOINT:
                raise UnknownWorker(f"too many endpoints (limit {core.MAX_ENDPOINT})")
            self._next_id += 1
        self._ids[key] = ep
        self._keys[ep] = key
        return ep

    def endpoint_id(self, worker_id: str, dp_rank: int = 0) -> int | None:
        return self._ids.get((worker_id, dp_rank))

    def endpoint_key(self, ep: int) -> tuple[str, int] | None:
        """(worker_id, dp_rank) of an endpoint id."""
        return self._keys.get(ep)

    def endpoints(self) -> dict[tuple[str, int], int]:
        return dict(self._ids)

    @property
    def n_endpoint_ids(self) -> int:
        """Length every Overlaps array has at least (1 + the largest id ever handed out)."""
        return self._next_id

    def worker_blocks(self) -> dict[str, int]:
        """Blocks the index holds per worker, summed over its DP ranks (one table pass)."""
        counts = self.core.held_counts(self._next_id)
        out: dict[str, int] = {}
        for (w, _), ep in self._ids.items():
            out[w] = out.get(w, 0) + int(counts[ep])
        return out

    def remove_worker(self, worker_id: str) -> None:
        """Forget every rank of a worker: its cached blocks and its endpoint ids."""
        for key in [k for k in self._ids if k[0] == worker_id]:
            ep = self._ids.pop(key)
            del self._keys[ep]
            self.core.clear(ep)
            heapq.heappush(self._free, ep)

    def _endpoint(self, worker_id: str, dp_rank: int) -> int:
        ep = self._ids.get((worker_id, dp_rank))
        if ep is not None:
            return ep
        if self.auto_add:
            return self.add_endpoint(worker_id, dp_rank)
        raise UnknownWorker(f"worker {worker_id!r} dp_rank {dp_rank} is not registered")

    # -- events ----------------------------------------------------------------------------------
    def apply(self, event: KvEvent) -> None:
        """Apply one event. Raises InvalidEvent / UnknownWorker (naming worker and rank)."""
        handler = self._handlers.get(type(event))
        if handler is None:
            raise InvalidEvent(f"not a kvplug event: {type(event).__name__}")
        handler(event)

    def apply_many(self, events: Iterable[KvEvent]) -> ApplyReport:
        """Apply events in order; a bad event is counted, logged and skipped, never raised.

        Runs of consecutive plain token stores (the stores ``apply`` takes its fast path for:
        a registered endpoint, tokens given, not shared, not a tier copy) go to the core in one
        ``store_tokens_many`` call; any other event first flushes the run, so the order is
        kept. Outcomes, counters, drop reasons and log lines are those of ``apply`` per event.
        """
        report = ApplyReport()
        handlers = self._handlers
        ids = self._ids
        bs = self.block_size
        run: list[BlockStored] = []  # the pending run of plain token stores
        rows: list[tuple] = []  # their store_tokens arguments
        add_run, add_row = run.append, rows.append
        # (worker_id, dp_rank) and endpoint id of the previous store (a batch is usually one
        # worker's); forgotten after any other event (with auto_add it may register one)
        last_key: tuple | None = None
        last_ep = None
        for ev in events:
            if type(ev) is BlockStored:
                try:
                    key = (ev.worker_id, ev.dp_rank)
                    if key == last_key:
                        ep = last_ep
                    else:
                        ep = ids.get(key)
                        last_key, last_ep = key, ep
                    tokens = ev.token_ids
                    if (
                        ep is not None
                        and tokens is not None
                        and not ev.shared
                        and not ev.tier_copy
                        and ev.block_hashes is None
                        and ev.tier in _TIERS
                        and (not ev.block_size or ev.block_size == bs)
                        and (len(tokens) > 0 or len(ev.engine_hashes) == 0)
                    ):
                        lora, salt = ev.lora_name, ev.cache_salt
                        seed = namespace_seed(lora, salt) if (lora or salt) else 0
                        add_row(
                            (
                                ep,
                                ev.tier,
                                ev.parent_engine_hash,
                                ev.engine_hashes,
                                tokens,
                                seed,
                                ev.block_extra,
                            )
                        )
                        add_run(ev)
                        continue
                except Exception:  # noqa: BLE001 - the general path below reports it
                    pass
            if run:
                blocks, failures = self.core.store_tokens_many(rows, bs)
                if failures:
                    self._drop_failed_stores(report, run, failures)
                report.applied += len(run) - len(failures)
                report.blocks += blocks
                run.clear()
                rows.clear()
            last_key = None
            handler = handlers.get(type(ev))
            try:
                if handler is None:
                    raise InvalidEvent(f"not a kvplug event: {type(ev).__name__}")
                handler(ev)
            except (KvplugError, ValueError, TypeError, OverflowError) as err:
                self._drop(report, ev, err)
                continue
            report.applied += 1
            hashes = getattr(ev, "engine_hashes", None)
            if hashes is not None:
                report.blocks += len(hashes)
        if run:
            blocks, failures = self.core.store_tokens_many(rows, bs)
            if failures:
                self._drop_failed_stores(report, run, failures)
            report.applied += len(run) - len(failures)
            report.blocks += blocks
        return report

    def _drop_failed_stores(
        self, report: ApplyReport, run: list[BlockStored], failures: list[tuple[int, Exception]]
    ) -> None:
        """Drop the stores of a run that store_tokens_many reported as failed, exactly as
        ``_stored`` raises them (InvalidEvent naming worker and rank, the core's reason)."""
        for i, err in failures:
            ev = run[i]
            wrapped = InvalidEvent(f"{self._where(ev)}: {err}")
            wrapped.__cause__ = err
            self._drop(report, ev, wrapped)

    def _drop(self, report: ApplyReport, ev: object, err: Exception) -> None:
        reason = type(err).__name__
        report.dropped += 1
        report.reasons[reason] += 1
        self.drops[reason] += 1
        n = self.drops[reason]
        if n <= _LOG_FIRST or n % _LOG_EVERY == 0:
            log.warning(
                "dropped %s from worker %r rank %r (%s #%d): %s",
                type(ev).__name__,
                getattr(ev, "worker_id", None),
                getattr(ev, "dp_rank", None),
                reason,
                n,
                err,
            )

    def _where(self, ev) -> str:
        return f"{type(ev).__name__} from worker {ev.worker_id!r} rank {ev.dp_rank}"

    def _tier(self, ev, tier) -> int:
        if tier not in _TIERS:
            raise InvalidEvent(f"{self._where(ev)}: tier {tier!r} is not device/host/disk")
        return int(tier)

    def _stored(self, ev: BlockStored) -> None:
        ep = self._ids.get((ev.worker_id, ev.dp_rank))
        tokens = ev.token_ids
        if (
            ep is not None
            and tokens is not None
            and not ev.shared
            and not ev.tier_copy
            and ev.block_hashes is None
            and ev.tier in _TIERS
            and (not ev.block_size or ev.block_size == self.block_size)
            and (len(tokens) > 0 or len(ev.engine_hashes) == 0)
        ):
            # the common case, one worker's new blocks by tokens, without the general dispatch
            lora, salt = ev.lora_name, ev.cache_salt
            seed = namespace_seed(lora, salt) if (lora or salt) else 0
            try:
                self.core.store_tokens(
                    ep,
                    ev.tier,
                    ev.parent_engine_hash,
                    ev.engine_hashes,
                    tokens,
                    self.block_size,
                    seed,
                    ev.block_extra,
                )
            except (KvplugError, ValueError, TypeError, OverflowError) as err:
                raise InvalidEvent(f"{self._where(ev)}: {err}") from err
            return
        self._stored_general(ev)

    def _stored_general(self, ev: BlockStored) -> None:
        own = self._endpoint(ev.worker_id, ev.dp_rank)
        ep = SHARED if ev.shared else own
        tier = self._tier(ev, ev.tier)
        ehs = ev.engine_hashes
        n = len(ehs)
        if ev.block_size and ev.block_size != self.block_size:
            raise InvalidEvent(
                f"{self._where(ev)}: block_size {ev.block_size}, "
                f"but the index uses {self.block_size}"
            )
        try:
            if ev.tier_copy:
                self._tier_copy(own, ep, tier, ehs)
            elif ev.block_hashes is not None:
                if len(ev.block_hashes) != n:
                    raise InvalidEvent(
                        f"{self._where(ev)}: {n} engine hashes, {len(ev.block_hashes)} block hashes"
                    )
                self.core.store(ep, tier, ehs, ev.block_hashes)
            elif ev.token_ids is not None and (n == 0 or len(ev.token_ids) > 0):
                self._store_tokens(ev, own, ep, tier)
            elif n:
                raise InvalidEvent(f"{self._where(ev)}: neither token_ids nor block_hashes")
        except InvalidEvent:
            raise
        except (KvplugError, ValueError, TypeError, OverflowError) as err:
            raise InvalidEvent(f"{self._where(ev)}: {err}") from err

    def _store_tokens(self, ev: BlockStored, own: int, ep: int, tier: int) -> None:
        seed = namespace_seed(ev.lora_name, ev.cache_salt)
        parent = ev.parent_engine_hash
        tokens = ev.token_ids
        assert tokens is not None  # the caller dispatches token stores only
        if ep == SHARED and parent is not None and self.core.resolve(SHARED, parent) is None:
            # a shared copy of a chain whose parent only the worker itself holds
            root = self.core.resolve(own, parent)
            if root is not None:
                _, seq = self._impl.hash_blocks(tokens, self.block_size, root, ev.block_extra)
                if len(seq) * self.block_size != len(tokens) or len(seq) != len(ev.engine_hashes):
                    raise InvalidEvent(
                        f"{self._where(ev)}: {len(tokens)} tokens for "
                        f"{len(ev.engine_hashes)} blocks of {self.block_size}"
                    )
                self.core.store(ep, tier, ev.engine_hashes, seq)
                return
        self.core.store_tokens(
            ep, tier, parent, ev.engine_hashes, ev.token_ids, self.block_size, seed, ev.block_extra
        )

    def _tier_copy(self, own: int, ep: int, tier: int, ehs) -> None:
        keep_e, keep_h = [], []
        resolve = self.core.resolve
        for eh in ehs:
            h = resolve(own, eh)
            if h is None and ep == SHARED:
                h = resolve(SHARED, eh)
            if h is None:
                self.unresolved_tier_copies += 1
                continue
            keep_e.append(eh)
            keep_h.append(h)
        if keep_e:
            self.core.store(ep, tier, keep_e, keep_h)

    def _removed(self, ev: BlockRemoved) -> None:
        own = self._endpoint(ev.worker_id, ev.dp_rank)
        ep = SHARED if ev.shared else own
        tier = None if ev.tier is None else self._tier(ev, ev.tier)
        try:
            self.core.remove(ep, ev.engine_hashes, tier)
        except (KvplugError, ValueError, TypeError, OverflowError) as err:
            raise InvalidEvent(f"{self._where(ev)}: {err}") from err

    def _moved(self, ev: BlockMoved) -> None:
        ep = self._endpoint(ev.worker_id, ev.dp_rank)
        src, dst = self._tier(ev, ev.from_tier), self._tier(ev, ev.to_tier)
        try:
            self.core.move(ep, ev.engine_hashes, src, dst)
        except (KvplugError, ValueError, TypeError, OverflowError) as err:
            raise InvalidEvent(f"{self._where(ev)}: {err}") from err

    def _cleared(self, ev: AllCleared) -> None:
        self.core.clear(self._endpoint(ev.worker_id, ev.dp_rank))

    # -- requests --------------------------------------------------------------------------------
    def request_hashes(
        self, token_ids, lora_name=None, cache_salt=None, block_extra=None
    ) -> np.ndarray:
        """Sequence hashes (numpy uint64) of a request's full blocks, in its namespace."""
        seed = namespace_seed(lora_name, cache_salt)
        if self.backend == "c":
            return self._impl.seq_hashes(token_ids, self.block_size, seed, block_extra)
        return np.asarray(
            self._impl.seq_hashes(token_ids, self.block_size, seed, block_extra), np.uint64
        )

    def query(self, block_hashes) -> Overlaps:
        """Per endpoint overlaps of a request; the returned object is reused by the next query."""
        ov = self._overlaps
        need = self._next_id
        if self._result is not None:
            res = self._result
            res.reserve(need)
            self.core.query(block_hashes, res)
            if res.local is not ov.local:
                ov._set_arrays(res.local, res.device, res.host, res.disk, res.shared_beyond)
            ov.shared_prefix = res.shared_prefix
            ov.walked = res.walked
            return ov
        r = self.core.query(block_hashes)
        if len(ov.local) < need:
            cap = max(need, 2 * len(ov.local))
            ov._set_arrays(*(np.zeros(cap, np.int32) for _ in range(5)))
        for arr in (ov.local, ov.device, ov.host, ov.disk):
            arr[:] = 0
        ov.shared_beyond[:] = r.shared_prefix
        for ep, n in r.local.items():
            if ep < len(ov.local):
                ov.local[ep] = n
                ov.device[ep] = r.device[ep]
                ov.host[ep] = r.host[ep]
                ov.disk[ep] = r.disk[ep]
                ov.shared_beyond[ep] = r.shared_beyond[ep]
        ov.shared_prefix = r.shared_prefix
        ov.walked = r.walked
        return ov

    def stats(self) -> dict:
        s = dict(self.core.stats())
        s["endpoints"] = len(self._ids)
        s["dropped_events"] = sum(self.drops.values())
        s["unresolved_tier_copies"] = self.unresolved_tier_copies
        if hasattr(self.core, "memory_bytes"):
            s["memory_bytes"] = self.core.memory_bytes()
        return s


__all__ = ["ApplyReport", "KvIndex", "Overlaps"]
