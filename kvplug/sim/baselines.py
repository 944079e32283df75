"""Other routers' policies, re-implemented for the replay so one ``kvplug bench`` compares them.

Each class has the slice of :class:`kvplug.router.Router`'s interface the replay drives
(``add_worker``, ``route``, ``apply_event``, ``on_first_token``, ``on_output_progress``,
``on_finish``, ``set_attributes``). They see what their originals see: the routed requests, their
own in-flight counts, and (vllm-router) the engines' KV events, through the same event link.

* ``sglang-cache-aware``: sglang-router's ``cache_aware`` policy, from
  ``sgl-project/sglang`` ``sgl-router/src/policies/cache_aware.rs`` and ``tree.rs`` (commits
  ``b6f20641ad6b`` / ``4d40eec0266b``), defaults from its CLI (``cache_threshold`` 0.3,
  ``balance_abs_threshold`` 64, ``balance_rel_threshold`` 1.5, ``eviction_interval`` 120 s,
  ``max_tree_size`` 2^26 characters). Loads are the router's in-flight request counts; when
  ``max - min > abs`` and ``max > rel * min`` it sends to the least-loaded worker; otherwise it
  matches the prompt in one multi-tenant radix tree of routed text and, if the matched share is
  above ``cache_threshold``, sends to a tenant of the deepest matched node (the original takes the
  first key of a hash map there: an arbitrary one; here a seeded random one), else to the tenant
  with the smallest tree. The chosen worker's tree gets the prompt either way. Every
  ``eviction_interval`` each tenant's least recently used leaves go until its size is at most
  ``max_tree_size``. Differences: the tree holds prompt blocks (512-token hash ids) instead of
  characters; sizes convert at 4 characters per token (2^26 chars = 32,768 blocks of 512).
* ``vllm-kv-aware``: vllm-router's ``kv_aware`` policy, from ``vllm-project/router``
  ``src/policies/kv_aware.rs``, ``src/kv_index/scorer.rs`` and ``index.rs`` (commits
  ``dda6063bf691`` / ``cc14dbb8d7d7`` / ``2ec0ff0c55df``). A block-hash -> workers index fed by
  BlockStored / BlockRemoved / AllBlocksCleared; the score of a worker is its contiguous
  leading run of the prompt's blocks; the highest score wins (ties: the last worker, as Rust's
  ``max_by_key``); if no worker has a block, the least-loaded (in-flight) one. The blocks the
  winner lacks are inserted speculatively for it with a 2 s TTL (``enable_speculative`` true by
  default). No load term at all once any worker holds a prefix.
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from kvplug.errors import NoCompatibleWorker
from kvplug.events import AllCleared, BlockRemoved, BlockStored

CHARS_PER_TOKEN = 4  # to convert sglang-router's character sizes into blocks


@dataclass
class BaselineConfig:
    """What the replay needs from a router config, plus the baseline's own settings."""

    name: str
    kv_block_size: int
    params: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class _Routed:
    worker_id: str
    cached_blocks: int = 0


class _InflightRouter:
    """Workers and the router-side in-flight count both baselines balance on."""

    DEFAULTS: ClassVar[dict[str, Any]] = {}  # the policy's settings and their defaults

    def __init__(self, config: BaselineConfig, clock: Callable[[], float], rng: random.Random):
        self.config = config
        self._clock = clock
        self._rng = rng
        self.workers: list[str] = []
        self.load: dict[str, int] = {}
        self._where: dict[str, str] = {}  # request id -> worker

    def add_worker(self, worker) -> None:
        self.workers.append(worker.worker_id)
        self.load[worker.worker_id] = 0

    def set_attributes(self, worker_id: str, values: dict, ts: float | None = None) -> None:
        """Neither baseline reads engine gauges."""

    def apply_event(self, event) -> None:
        """Overridden by the event-fed baseline."""

    def on_first_token(self, request_id: str) -> None:
        pass

    def on_output_progress(self, request_id: str, output_tokens: int) -> None:
        pass

    def on_finish(self, request_id: str) -> None:
        wid = self._where.pop(request_id, None)
        if wid is not None:
            self.load[wid] -= 1

    def _book(self, request_id: str, wid: str) -> None:
        self._where[request_id] = wid
        self.load[wid] += 1

    def _least_loaded(self) -> str:
        return min(self.workers, key=lambda w: self.load[w])  # first of the minima, as Rust

    @staticmethod
    def _blocks(req) -> list[int]:
        if req.block_hashes is None:
            raise ValueError("the baseline policies replay in hashes mode (--mode hashes)")
        return np.asarray(req.block_hashes, dtype=np.uint64).tolist()

    def stats(self) -> dict:
        return {}


class _Node:
    __slots__ = ("parent", "children", "tenants")

    def __init__(self, parent: _Node | None) -> None:
        self.parent = parent
        self.children: dict[int, _Node] = {}
        self.tenants: dict[str, float] = {}  # tenant -> last access time


class SglangCacheAware(_InflightRouter):
    """sglang-router ``cache_aware`` (see the module docstring)."""

    DEFAULTS: ClassVar[dict[str, Any]] = {
        "cache_threshold": 0.3,
        "balance_abs_threshold": 64,
        "balance_rel_threshold": 1.5,
        "eviction_interval": 120.0,
        "max_tree_size": 1 << 26,  # characters
    }

    def __init__(self, config: BaselineConfig, clock, rng) -> None:
        super().__init__(config, clock, rng)
        p = {**self.DEFAULTS, **config.params}
        self.cache_threshold = float(p["cache_threshold"])
        self.abs_threshold = float(p["balance_abs_threshold"])
        self.rel_threshold = float(p["balance_rel_threshold"])
        self.eviction_interval = float(p["eviction_interval"])
        chars_per_block = CHARS_PER_TOKEN * config.kv_block_size
        self.max_blocks = max(1, int(p["max_tree_size"]) // chars_per_block)
        self.root = _Node(None)
        self.size: dict[str, int] = {}  # tenant -> blocks held in the tree
        self._next_eviction = self.eviction_interval
        self.counters = {"cache_routed": 0, "smallest_tree": 0, "balanced": 0, "evictions": 0}

    def add_worker(self, worker) -> None:
        super().add_worker(worker)
        self.size[worker.worker_id] = 0
        self.root.tenants[worker.worker_id] = self._clock()

    def _insert(self, blocks: list[int], tenant: str, now: float) -> None:
        node = self.root
        node.tenants[tenant] = now
        for h in blocks:
            child = node.children.get(h)
            if child is None:
                child = node.children[h] = _Node(node)
            if tenant not in child.tenants:
                self.size[tenant] += 1
            child.tenants[tenant] = now
            node = child

    def _match(self, blocks: list[int], now: float) -> tuple[int, str | None]:
        node, depth = self.root, 0
        for h in blocks:
            child = node.children.get(h)
            if child is None:
                break
            node, depth = child, depth + 1
        if not node.tenants:
            return depth, None
        tenants = sorted(node.tenants)
        tenant = tenants[int(self._rng.random() * len(tenants))]
        walk: _Node | None = node
        while walk is not None:  # the original refreshes the path to the root for that tenant
            walk.tenants[tenant] = now
            walk = walk.parent
        return depth, tenant

    def _evict(self) -> None:
        """Per tenant over its size: drop its least recently used leaves (a node is a leaf for a
        tenant when no child holds the tenant), newly exposed parents included."""
        over = {t for t, s in self.size.items() if s > self.max_blocks}
        if not over:
            return
        heap: list[tuple[float, int, str, _Node]] = []
        seq = 0
        stack = [self.root]
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            if node is self.root:
                continue
            for t, ts in node.tenants.items():
                if t in over and not any(t in c.tenants for c in node.children.values()):
                    seq += 1
                    heap.append((ts, seq, t, node))
        heapq.heapify(heap)
        while heap:
            ts, _, t, node = heapq.heappop(heap)
            if self.size[t] <= self.max_blocks or t not in node.tenants:
                continue
            del node.tenants[t]
            self.size[t] -= 1
            self.counters["evictions"] += 1
            parent = node.parent
            if not node.tenants and not node.children and parent is not None:
                for k, c in list(parent.children.items()):
                    if c is node:
                        del parent.children[k]
                        break
            if (
                parent is not None
                and parent is not self.root
                and t in parent.tenants
                and not any(t in c.tenants for c in parent.children.values())
            ):
                seq += 1
                heapq.heappush(heap, (parent.tenants[t], seq, t, parent))

    def route(self, req) -> _Routed:
        if not self.workers:
            raise NoCompatibleWorker("no worker is registered")
        now = self._clock()
        if self.eviction_interval > 0 and now >= self._next_eviction:
            self._evict()
            self._next_eviction = now + self.eviction_interval
        blocks = self._blocks(req)
        loads = [self.load[w] for w in self.workers]
        hi, lo = max(loads), min(loads)
        if hi - lo > self.abs_threshold and hi > lo * self.rel_threshold:
            wid = self._least_loaded()
            self.counters["balanced"] += 1
        else:
            depth, tenant = self._match(blocks, now)
            rate = depth / len(blocks) if blocks else 0.0
            if rate > self.cache_threshold and tenant is not None:
                wid = tenant
                self.counters["cache_routed"] += 1
            else:
                wid = min(self.workers, key=lambda w: self.size[w])
                self.counters["smallest_tree"] += 1
        self._insert(blocks, wid, now)
        self._book(req.request_id, wid)
        return _Routed(wid)

    def stats(self) -> dict:
        return {**self.counters, "tree_blocks": sum(self.size.values())}


class VllmKvAware(_InflightRouter):
    """vllm-router ``kv_aware`` (see the module docstring)."""

    DEFAULTS: ClassVar[dict[str, Any]] = {"speculative": True, "speculative_ttl": 2.0}

    def __init__(self, config: BaselineConfig, clock, rng) -> None:
        super().__init__(config, clock, rng)
        p = {**self.DEFAULTS, **config.params}
        self.speculative = bool(p["speculative"])
        self.ttl = float(p["speculative_ttl"])
        # block hash -> {worker: expiry time (inf for a real entry)}
        self.index: dict[int, dict[str, float]] = {}
        self.counters = {"prefix_routed": 0, "least_loaded": 0, "speculative_blocks": 0}

    def apply_event(self, event) -> None:
        wid = event.worker_id
        if isinstance(event, BlockStored):
            for h in event.engine_hashes:
                self.index.setdefault(int(h), {})[wid] = float("inf")
        elif isinstance(event, BlockRemoved):
            for h in event.engine_hashes:
                where = self.index.get(int(h))
                if where is not None:
                    where.pop(wid, None)
                    if not where:
                        del self.index[int(h)]
        elif isinstance(event, AllCleared):
            for h in list(self.index):
                self.index[h].pop(wid, None)
                if not self.index[h]:
                    del self.index[h]

    def route(self, req) -> _Routed:
        if not self.workers:
            raise NoCompatibleWorker("no worker is registered")
        now = self._clock()
        blocks = self._blocks(req)
        if not blocks:
            wid = self._least_loaded()
            self._book(req.request_id, wid)
            return _Routed(wid)
        scores = dict.fromkeys(self.workers, 0)
        alive: set[str] | None = None
        for i, h in enumerate(blocks):
            where = self.index.get(h)
            holding = {w for w, exp in where.items() if exp > now} if where else set()
            alive = holding if alive is None else alive & holding
            if not alive:
                break
            for w in alive:
                scores[w] = i + 1
        best = max(scores.values())
        if best == 0:
            wid = self._least_loaded()
            self.counters["least_loaded"] += 1
        else:
            wid = [w for w in self.workers if scores[w] == best][-1]  # Rust max_by_key: last
            self.counters["prefix_routed"] += 1
        if self.speculative and best < len(blocks):
            for h in blocks[best:]:
                where = self.index.setdefault(h, {})
                if where.get(wid) != float("inf"):
                    where[wid] = now + self.ttl
                    self.counters["speculative_blocks"] += 1
        self._book(req.request_id, wid)
        return _Routed(wid, best)

    def stats(self) -> dict:
        return {**self.counters, "indexed_blocks": len(self.index)}


BASELINES: dict[str, tuple[type[_InflightRouter], bool]] = {
    # name -> (class, consumes KV events)
    "sglang-cache-aware": (SglangCacheAware, False),
    "vllm-kv-aware": (VllmKvAware, True),
}


def baseline_factory(name: str) -> Callable[..., _InflightRouter]:
    cls = BASELINES[name][0]

    def make(config: BaselineConfig, clock, rng) -> _InflightRouter:
        return cls(config, clock, rng)

    return make
