"""Paged KV cache with prefix caching, LRU eviction of unreferenced blocks, optional host tier.

Blocks are identified by the engine's block hash (opaque u64, chained so equal hash = equal prefix).
Device capacity counts every block in use: cached blocks (referenced or not) plus anonymous blocks
reserved for tokens not computed yet. Eviction follows vLLM's free-queue order: unreferenced cached
blocks are evicted least recently freed first, and a finished sequence frees its blocks tail first,
so a prompt's tail is evicted before its prefix. With a host tier, an evicted device block is
offloaded to host memory (its own LRU); a prefix hit on host reloads the block to the device.
With ``host_inclusive`` the host tier is a copy instead, as vLLM's default offloading connector
keeps it: every block computed on the device is copied to the host when stored
(:meth:`BlockCache.store_host`), a device eviction drops the device copy only, and a host hit is
copied back, its host copy staying.

Evictions and tier changes are reported through ``sink`` as (kind, tier, hashes):
``("removed", DEVICE | HOST, hs)``, ``("moved", (from, to), hs)`` and, for an inclusive host's
new copies, ``("host_stored", HOST, hs)``; newly stored device blocks are returned by
:meth:`BlockCache.commit` (the engine builds their events, which need tokens or parents). The
engine turns all of them into normalised kvplug events.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

from kvplug.events import Tier

CacheSink = Callable[[str, object, list[int]], None]


class CacheFull(Exception):
    """Not enough free device blocks for an allocation (caller keeps the request waiting)."""


class BlockCache:
    """Device tier of ``capacity`` blocks, optional host tier of ``host_capacity`` blocks."""

    def __init__(
        self,
        capacity: int,
        host_capacity: int = 0,
        sink: CacheSink | None = None,
        host_inclusive: bool = False,
    ):
        if capacity <= 0:
            raise ValueError(f"capacity must be positive, got {capacity}")
        if host_capacity < 0:
            raise ValueError(f"host_capacity must be >= 0, got {host_capacity}")
        self.capacity = capacity
        self.host_capacity = host_capacity
        self.host_inclusive = host_inclusive and host_capacity > 0
        self.sink = sink
        self._refs: dict[int, int] = {}  # cached device block -> reference count
        self._free_lru: OrderedDict[int, None] = (
            OrderedDict()
        )  # refcount-0 cached blocks, oldest first
        self._host: OrderedDict[int, None] = OrderedDict()  # host tier, oldest first
        self.reserved = 0  # anonymous blocks (tokens allocated, not computed or not hashed)
        self.counters = {"evicted": 0, "offloaded": 0, "reloaded": 0, "host_evicted": 0}

    # -- views --------------------------------------------------------------------------------
    @property
    def used(self) -> int:
        return len(self._refs) + self.reserved

    @property
    def free(self) -> int:
        """Blocks allocatable now: never used, plus evictable (unreferenced cached) ones."""
        return self.capacity - self.used + len(self._free_lru)

    @property
    def active(self) -> int:
        """Blocks referenced by running sequences (the KV usage an engine reports)."""
        return len(self._refs) - len(self._free_lru) + self.reserved

    def on_device(self, h: int) -> bool:
        return h in self._refs

    def on_host(self, h: int) -> bool:
        return h in self._host

    def device_blocks(self) -> list[int]:
        return list(self._refs)

    def host_blocks(self) -> list[int]:
        return list(self._host)

    def lru_order(self) -> list[int]:
        """Evictable device blocks, next victim first."""
        return list(self._free_lru)

    def match_prefix(self, hashes: Sequence[int]) -> tuple[int, int]:
        """(device blocks, host-only blocks) in the longest prefix held on either tier.

        The prefix stops at the first block held nowhere.
        """
        dev = host = 0
        refs, hst = self._refs, self._host
        for h in hashes:
            if h in refs:
                dev += 1
            elif h in hst:
                host += 1
            else:
                break
        return dev, host

    def split_prefix(self, hashes: Sequence[int]) -> tuple[list[int], list[int]]:
        """The cached prefix split into (device-held hashes, host-only hashes)."""
        dev: list[int] = []
        host: list[int] = []
        refs, hst = self._refs, self._host
        for h in hashes:
            if h in refs:
                dev.append(h)
            elif h in hst:
                host.append(h)
            else:
                break
        return dev, host

    # -- allocation ---------------------------------------------------------------------------
    def _emit(self, kind: str, tier: object, hashes: list[int]) -> None:
        if self.sink is not None and hashes:
            self.sink(kind, tier, hashes)

    def _make_room(self, n: int) -> None:
        """Evict until ``n`` more blocks fit; raises CacheFull (changing nothing) if impossible."""
        over = self.used + n - self.capacity
        if over <= 0:
            return
        if over > len(self._free_lru):
            raise CacheFull(f"need {n} blocks, {self.free} allocatable of {self.capacity}")
        victims = []
        for _ in range(over):
            h, _ = self._free_lru.popitem(last=False)
            del self._refs[h]
            victims.append(h)
        self.counters["evicted"] += len(victims)
        if self.host_capacity and not self.host_inclusive:
            self._offload(victims)
        else:
            self._emit("removed", Tier.DEVICE, victims)

    def _offload(self, victims: list[int]) -> None:
        fresh = [h for h in victims if h not in self._host]
        for h in victims:
            self._host[h] = None
            self._host.move_to_end(h)
        self.counters["offloaded"] += len(victims)
        already = [h for h in victims if h not in fresh]
        self._emit("moved", (Tier.DEVICE, Tier.HOST), fresh)
        self._emit(
            "removed", Tier.DEVICE, already
        )  # host already had a copy: device copy just goes
        self._trim_host()

    def _trim_host(self) -> None:
        """Evict the host tier's least recently used blocks beyond its capacity."""
        drop = []
        while len(self._host) > self.host_capacity:
            h, _ = self._host.popitem(last=False)
            drop.append(h)
        self.counters["host_evicted"] += len(drop)
        self._emit("removed", Tier.HOST, drop)

    def store_host(self, hashes: Sequence[int]) -> None:
        """``host_inclusive``: copy device blocks to the host tier, as vLLM's CPU offloading
        manager stores what a request offers (``prepare_store``): the ones it lacks go in as its
        most recent, in order, reported as ``("host_stored", HOST, new)``; the ones it has are
        left where they are (used again only when the request finishes, :meth:`host_finished`).
        Its least recently used blocks make room, never one offered here; when too few could,
        nothing is stored (vLLM's store fails)."""
        host = self._host
        new = [h for h in dict.fromkeys(hashes) if h not in host]
        if not new:
            return
        over = len(host) + len(new) - self.host_capacity
        if over > 0:
            offered = set(hashes)
            drop = []
            for h in host:  # oldest first
                if h not in offered:
                    drop.append(h)
                    if len(drop) == over:
                        break
            if len(drop) < over:
                return
            for h in drop:
                del host[h]
            self.counters["host_evicted"] += len(drop)
            self._emit("removed", Tier.HOST, drop)
        for h in new:
            host[h] = None
        self.counters["offloaded"] += len(new)
        self._emit("host_stored", Tier.HOST, new)

    def host_finished(self, hashes: Sequence[int]) -> None:
        """``host_inclusive``: a request that loaded or offered ``hashes`` (its blocks, in
        prefix order) finished: those the host holds become its most recently used, the last
        block first, so the prefix's head is evicted last (vLLM's LRU policy,
        ``on_request_finished``)."""
        host = self._host
        for h in reversed(hashes):
            if h in host:
                host.move_to_end(h)

    def admit(
        self,
        device_hits: Sequence[int],
        host_hits: Sequence[int],
        n_new: int,
        fits: int | None = None,
    ) -> None:
        """Atomically: reference the device hits, reload the host hits, reserve ``n_new`` blocks.

        Raises CacheFull and changes nothing when the blocks do not fit, or when ``fits`` blocks
        (default ``n_new``) beyond the hits would not: vLLM admits a request when its whole
        prompt fits but allocates only what a step computes.
        """
        unreferenced_hits = sum(1 for h in device_hits if self._refs[h] == 0)
        wanted = len(host_hits) + (n_new if fits is None else max(n_new, fits))
        if wanted > self.free - unreferenced_hits:
            raise CacheFull(f"need {wanted} blocks, {self.free - unreferenced_hits} allocatable")
        self.acquire_cached(device_hits)
        if host_hits:
            self.reload(host_hits)
        self.reserve(n_new)

    def reserve(self, n: int) -> None:
        """Allocate ``n`` anonymous blocks (evicting as needed)."""
        self._make_room(n)
        self.reserved += n

    def unreserve(self, n: int) -> None:
        if n > self.reserved:
            raise ValueError(f"unreserve {n} > reserved {self.reserved}")
        self.reserved -= n

    def acquire_cached(self, hashes: Sequence[int]) -> None:
        """Reference device-cached blocks (a prefix hit): they leave the free queue."""
        refs, lru = self._refs, self._free_lru
        for h in hashes:
            r = refs[h]
            if r == 0:
                del lru[h]
            refs[h] = r + 1

    def reload(self, hashes: Sequence[int]) -> None:
        """Bring host-tier blocks to the device, referenced (one copy per block: the host copy
        goes). Raises CacheFull, changing nothing, when the device cannot make room."""
        if len(hashes) > self.free:
            raise CacheFull(f"reload of {len(hashes)} blocks, {self.free} allocatable")
        missing = [h for h in hashes if h not in self._host]
        if missing:
            raise KeyError(f"blocks not on the host tier: {missing[:4]}")
        if self.host_inclusive:  # copied back; the host copy stays (used again at the finish)
            self._make_room(len(hashes))
            for h in hashes:
                self._refs[h] = 1
            self.counters["reloaded"] += len(hashes)
            return  # the engine reports the device copies as stored (it has their parents)
        # leave the host tier first: the offloads that make room must not evict these
        for h in hashes:
            del self._host[h]
        self._make_room(len(hashes))
        for h in hashes:
            self._refs[h] = 1
        self.counters["reloaded"] += len(hashes)
        self._emit("moved", (Tier.HOST, Tier.DEVICE), list(hashes))

    def commit(self, hashes: Sequence[int]) -> list[bool]:
        """Freshly computed blocks replace as many reserved anonymous blocks, now cached.

        A hash already on the device (another sequence computed it meanwhile) is referenced
        instead and the duplicate anonymous block is returned. Returns, per hash, whether it
        was newly stored.
        """
        if len(hashes) > self.reserved:
            raise ValueError(f"commit {len(hashes)} blocks > reserved {self.reserved}")
        self.reserved -= len(hashes)
        refs, lru = self._refs, self._free_lru
        flags = []
        host = self._host
        host_dropped = []
        for h in hashes:
            r = refs.get(h)
            if r is None:
                refs[h] = 1
                flags.append(True)
                # recomputed on the device although a host copy existed: one copy, on the device
                # (an inclusive host keeps its copy)
                if host and h in host and not self.host_inclusive:
                    del host[h]
                    host_dropped.append(h)
            else:
                if r == 0:
                    del lru[h]
                refs[h] = r + 1
                flags.append(False)
        self._emit("removed", Tier.HOST, host_dropped)
        return flags

    def release(self, hashes: Sequence[int]) -> None:
        """Drop one reference per block; blocks reaching zero join the free queue tail first."""
        refs, lru = self._refs, self._free_lru
        for h in reversed(hashes):
            r = refs[h] - 1
            refs[h] = r
            if r == 0:
                lru[h] = None

    def clear(self) -> None:
        """Reset the cache (engine restart). Referenced blocks must have been released."""
        self._refs.clear()
        self._free_lru.clear()
        self._host.clear()
        self.reserved = 0
