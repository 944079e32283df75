"""Other routers' policies, re-implemented for the replay so one ``kvplug bench`` compares them.

Each class has the slice of :class:`kvplug.router.Router`'s interface the replay drives
(``add_worker``, ``route``, ``apply_event``, ``on_first_token``, ``on_output_progress``,
``on_finish``, ``set_attributes``). They see what their originals see: the routed requests, their
own in-flight counts, and (vllm-router) the engines' KV events, through the same event link.

* ``sglang-cache-aware``: sglang-router 0.3.2's ``cache_aware`` policy, from its released source
  (the PyPI sdist ``sglang_router-0.3.2.tar.gz``: ``src/policies/cache_aware.rs``, ``tree.rs``,
  CLI defaults in ``src/main.rs``: ``cache_threshold`` 0.3, ``balance_abs_threshold`` 64,
  ``balance_rel_threshold`` 1.5, ``eviction_interval`` 120 s, ``max_tree_size`` 2^26
  characters). Loads are the router's in-flight request counts; when ``max - min > abs`` and
  ``max > rel * min`` it sends to the least-loaded worker; otherwise it matches the prompt in
  one multi-tenant radix tree of routed text and, if the matched share is above
  ``cache_threshold``, sends to the deepest matched node's cached tenant (the one that created
  the node, while it still holds it; else the first key of a hash map, an arbitrary one: here a
  seeded random one, then cached), else to the least-loaded worker. The chosen worker's tree
  gets the prompt either way. Every ``eviction_interval`` each tenant's least recently used
  leaves go until its size is at most ``max_tree_size``. Differences: the tree holds prompt
  blocks (512-token hash ids) instead of characters; sizes convert at 4 characters per token
  (2^26 chars = 32,768 blocks of 512); a match refreshes the node's timestamp every time, not
  one time in eight. Earlier sources (``b6f20641ad6b`` / ``4d40eec0266b``, which this replay
  modelled before) sent a low match to the tenant with the smallest tree.
* ``vllm-kv-aware``: vllm-router 0.1.17's ``kv_aware`` policy, from its released source (the
  PyPI sdist ``vllm_router-0.1.17.tar.gz``: ``src/policies/kv_aware.rs``,
  ``src/kv_index/indexer.rs``, ``types.rs``). An index of which worker holds each block in
  which tier (device, host, disk; external for a shared pool) fed by the engines' stored /
  removed / cleared events. Per worker, the tokens it would compute: the prompt less its
  leading run of device blocks (capped so the block holding the last prompt token is never
  credited) and the longest continuation from there in another tier at that tier's credit
  (host 0.8, external 0.6, disk 0.3), at least one token. Its cost is ``(those tokens + the
  uncached tokens of its requests still in prefill) * (its in-flight requests + 1)``, both
  counted by the router (a request's prefill tokens leave at its first output, the request at
  its end); the lowest cost wins (ties: the first worker, as Rust's ``min_by``), or with
  ``temperature`` > 0 a softmax draw over ``-(cost - min) / temperature``. Settings:
  ``temperature``, ``penalty_host``, ``penalty_external``, ``penalty_disk`` (its CLI's
  defaults). Not modelled: the optional session affinity (off by default). Earlier releases
  (the source at ``dda6063bf691``, which this replay modelled before) had no load term once a
  prefix matched anywhere.
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from kvplug.errors import NoCompatibleWorker
from kvplug.events import AllCleared, BlockMoved, BlockRemoved, BlockStored, Tier
from kvplug.pickers import inverse_cdf

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
    __slots__ = ("parent", "children", "tenants", "last_tenant")

    def __init__(self, parent: _Node | None, creator: str | None = None) -> None:
        self.parent = parent
        self.children: dict[int, _Node] = {}
        self.tenants: dict[str, float] = {}  # tenant -> last access time
        self.last_tenant = creator  # the tenant a match answers while it still holds the node


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
        self.counters = {"cache_routed": 0, "least_loaded": 0, "balanced": 0, "evictions": 0}

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
                child = node.children[h] = _Node(node, tenant)
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
        tenant = node.last_tenant
        if tenant not in node.tenants:  # the original takes the first key of a hash map
            tenants = sorted(node.tenants)
            tenant = node.last_tenant = tenants[int(self._rng.random() * len(tenants))]
        node.tenants[tenant] = now  # (the original refreshes it one match in eight)
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
                wid = self._least_loaded()
                self.counters["least_loaded"] += 1
        self._insert(blocks, wid, now)
        self._book(req.request_id, wid)
        return _Routed(wid)

    def stats(self) -> dict:
        return {**self.counters, "tree_blocks": sum(self.size.values())}


# the storage tiers vllm-router's index tells apart (bits of a worker's entry per block), and
# the credit kv_aware gives a block of each (its TransferCredits defaults; the device's is 1)
_DEVICE, _HOST, _DISK, _EXTERNAL = 1, 2, 4, 8
_TIER_BIT = {Tier.DEVICE: _DEVICE, Tier.HOST: _HOST, Tier.DISK: _DISK}


class VllmKvAware(_InflightRouter):
    """vllm-router 0.1.17 ``kv_aware`` (see the module docstring)."""

    DEFAULTS: ClassVar[dict[str, Any]] = {
        "temperature": 0.0,  # --router-temperature
        "penalty_host": 0.8,  # --kv-penalty-host
        "penalty_external": 0.6,  # --kv-penalty-external
        "penalty_disk": 0.3,  # --kv-penalty-disk
    }

    def __init__(self, config: BaselineConfig, clock, rng) -> None:
        super().__init__(config, clock, rng)
        p = {**self.DEFAULTS, **config.params}
        self.temperature = float(p["temperature"])
        # non-device tiers in the order their continuations are compared (ties: higher credit)
        self.credits = sorted(
            (
                (_HOST, float(p["penalty_host"])),
                (_EXTERNAL, float(p["penalty_external"])),
                (_DISK, float(p["penalty_disk"])),
            ),
            key=lambda tc: -tc[1],
        )
        self.block_size = config.kv_block_size
        # block hash -> {worker: bits of the tiers it holds the block in}
        self.index: dict[int, dict[str, int]] = {}
        self.active_prefill: dict[str, int] = {}  # worker -> uncached prompt tokens in prefill
        self._prefilling: dict[str, tuple[str, int]] = {}  # request -> (worker, its tokens)
        self.counters = {"prefix_cost": 0, "cost_ties": 0}

    def add_worker(self, worker) -> None:
        super().add_worker(worker)
        self.active_prefill[worker.worker_id] = 0

    def _add(self, wid: str, hashes, bit: int) -> None:
        for h in hashes:
            where = self.index.setdefault(int(h), {})
            where[wid] = where.get(wid, 0) | bit

    def _drop(self, wid: str, hashes, bits: int) -> None:
        for h in hashes:
            where = self.index.get(int(h))
            if where is None or wid not in where:
                continue
            left = where[wid] & ~bits
            if left:
                where[wid] = left
            else:
                del where[wid]
                if not where:
                    del self.index[int(h)]

    def apply_event(self, event) -> None:
        # what the engines' vLLM wire gives it: a stored or removed block per medium (a move
        # between tiers arrives as a store in one and a removal from the other)
        wid = event.worker_id
        if isinstance(event, BlockStored):
            bit = _EXTERNAL if event.shared else _TIER_BIT[event.tier]
            self._add(wid, event.engine_hashes, bit)
        elif isinstance(event, BlockRemoved):
            any_tier = _DEVICE | _HOST | _DISK | _EXTERNAL
            bits = any_tier if event.tier is None else _TIER_BIT[event.tier]
            self._drop(wid, event.engine_hashes, bits)
        elif isinstance(event, BlockMoved):
            self._add(wid, event.engine_hashes, _TIER_BIT[event.to_tier])
            self._drop(wid, event.engine_hashes, _TIER_BIT[event.from_tier])
        elif isinstance(event, AllCleared):
            for h in list(self.index):
                where = self.index[h]
                where.pop(wid, None)
                if not where:
                    del self.index[h]

    def new_prefill_tokens(self, blocks: list[int], input_tokens: int) -> dict[str, int]:
        """Per worker, the prompt tokens it would compute: the prompt less its leading run of
        device blocks (never the block holding the last prompt token, whose logits vLLM
        recomputes) and the longest continuation from there in another tier, at that tier's
        credit; at least one token (``credited_tokens`` / ``request_prefill_tokens``)."""
        chain = []  # per prompt block, while anyone holds it: {worker: tier bits}
        for h in blocks:
            where = self.index.get(h)
            if not where:
                break
            chain.append(where)
        out = dict.fromkeys(self.workers, input_tokens)
        if not chain:
            return out
        bs, n = self.block_size, len(chain)
        device_cap = max(input_tokens - 1, 0) // bs
        for wid in chain[0]:
            device = 0
            while device < n and chain[device].get(wid, 0) & _DEVICE:
                device += 1
            device = min(device, device_cap)
            extra, credit = 0, 0.0
            for bit, tier_credit in self.credits:
                k = device
                while k < n and chain[k].get(wid, 0) & bit:
                    k += 1
                if k - device > extra:
                    extra, credit = k - device, tier_credit
            credited = min((device + extra * credit) * bs, max(input_tokens - 1, 0))
            out[wid] = math.ceil(max(input_tokens - credited, 0.0))
        return out

    def route(self, req) -> _Routed:
        if not self.workers:
            raise NoCompatibleWorker("no worker is registered")
        input_tokens = len(req.token_ids)
        new = self.new_prefill_tokens(self._blocks(req), input_tokens)
        ptoken = [new[w] + self.active_prefill[w] for w in self.workers]
        batch = [self.load[w] for w in self.workers]
        costs = [float(p * (b + 1)) for p, b in zip(ptoken, batch, strict=True)]
        if 0.0 in costs and (self.temperature <= 0.0 or all(c == 0.0 for c in costs)):
            # zero work (an empty prompt on an idle engine): least projected load
            zero = [i for i, c in enumerate(costs) if c == 0.0]
            i = min(zero, key=lambda k: (ptoken[k] if input_tokens else 0, batch[k]))
        elif self.temperature <= 0.0:
            low = min(costs)
            i = costs.index(low)  # the first of the minima, as Rust's min_by
            self.counters["cost_ties"] += costs.count(low) > 1
        else:  # vllm-router's softmax: of -(cost - min) / T, not over the cost's range
            weights = np.exp(-(np.asarray(costs) - min(costs)) / self.temperature)
            i = inverse_cdf(weights / weights.sum(), self._rng.random())
        wid = self.workers[i]
        self.counters["prefix_cost"] += 1
        self.active_prefill[wid] += new[wid]
        self._prefilling[req.request_id] = (wid, new[wid])
        self._book(req.request_id, wid)
        return _Routed(wid)

    def _prefill_done(self, request_id: str) -> None:
        booked = self._prefilling.pop(request_id, None)
        if booked is not None:
            wid, tokens = booked
            self.active_prefill[wid] = max(0, self.active_prefill[wid] - tokens)

    def on_first_token(self, request_id: str) -> None:
        self._prefill_done(request_id)  # the first streamed frame: begin_decode

    def on_finish(self, request_id: str) -> None:
        self._prefill_done(request_id)  # a request that never streamed releases both
        super().on_finish(request_id)

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
