"""Other routers' policies, re-implemented for the replay so one ``kvplug bench`` compares them.

Each class has the slice of :class:`kvplug.router.Router`'s interface the replay drives
(``add_worker``, ``route``, ``apply_event``, ``on_first_token``, ``on_output_progress``,
``on_finish``, ``set_attributes``). They see what their originals see: the routed requests, their
own in-flight counts, (vllm-router) the engines' KV events, through the same event link, and
(smg) the engines' load gauges, as the replay hands them to every router.

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
* ``smg-cache-aware``: smg 1.13.0's ``cache_aware`` policy (the SGLang Model Gateway, successor of
  sglang-router), as ``python -m smg.launch_router --policy cache_aware`` runs it over HTTP workers:
  the approximate string-tree path, ``select_worker_with_text`` (the PyPI sdist
  ``smg-1.13.0.tar.gz``: ``model_gateway/src/policies/cache_aware.rs``, ``least_load.rs``,
  ``cost/default.rs``, ``crates/kv_index/src/string_tree.rs``, ``worker/monitor.rs``,
  ``worker/overload.rs``, ``routers/common/placement.rs``; the launcher's defaults in
  ``src/smg/router_args.py``: ``cache_threshold`` 0.3, ``balance_abs_threshold`` 64,
  ``balance_rel_threshold`` 1.5, ``eviction_interval_secs`` 60, ``max_tree_size`` 2^26 characters
  for the whole tree, load poll every 10 s, worker overload protection at 8 waiting requests or 0.8
  KV usage). The simulated engines answer smg's backend detection as vLLM (their ``/version``) and
  its load poll with their ``/metrics`` gauges (running, waiting, KV usage): here the gauges the
  replay hands every router, the first delivery at or after each ``load_monitor_interval`` tick
  taken as the poll (``engine_loads=false``: no reports). A poll marks a worker overloaded (waiting
  >= 8 or KV usage >= 0.8) until the next; overloaded workers are left out, and if all are, the
  request goes to the fewest in flight (ties drawn) with nothing recorded in the tree. Otherwise it
  matches the prompt in one radix tree of routed text for all workers (``match_rate`` = matched over
  prompt characters); above ``cache_threshold`` the candidates are every eligible worker holding the
  deepest matched node (up to 8), else it is a miss. Candidates over the spill gate (in flight >
  ``balance_rel_threshold`` x the eligible workers' mean AND > the mean +
  min(``balance_abs_threshold``, max(ceil(2 sqrt(mean)), 4))) are dropped; if none is left the
  request spills to the eligible workers under the gate (all of them if none is). The pick among the
  candidates (or, on a miss, all eligible workers) is LeastLoad's expected wait, built with its
  fixed defaults whatever the ``--least-load-*`` flags say: with reports, ``((waiting + running +
  unaccounted) * 1024 + 1024 * dispatches since the poll) / 2000 + 0.15 k / (1 - k)`` (k the KV
  usage; unaccounted the router's in-flight count beyond the report and those dispatches); before
  any report, the in-flight count; waits within 1e-6 s tie and are drawn from uniformly. The chosen
  worker's tree gets the prompt. Every ``eviction_interval_secs``, while the tree's total size
  (summed over workers) is over ``max_tree_size``, the least recently used (node, worker) leaf goes,
  whole nodes at a time. The tree is a compressed radix tree, as smg's: an insert stamps only the
  node the prompt ends at (and a new suffix node) with a fresh epoch; a worker newly attached to an
  existing node gets epoch 0 there, and an older attachment keeps its epoch; a match stamps the
  deepest matched node's cached tenant one match in eight (smg's epoch counter, modelled). Not
  modelled: the KV-pressure imbalance fallback (off: thresholds 1.0), the warm-up slice and divert
  (event-driven mode only), overlap decay and selection temperature (0), accounting (off), the hash
  index, mesh sync, health checks and the circuit breaker. Differences: the tree holds prompt blocks
  (512-token hash ids) instead of characters, so only whole-block matches count and a prompt's
  partial last block is not inserted (sizes at 4 characters per token: 2^26 chars = 32,768 blocks of
  512, for all workers together); when more than 8 workers hold the matched node, the 8 are a seeded
  random choice (smg: the first 8 of a hash map); eviction runs at the first routed request after
  each interval rather than on its own thread.
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
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from kvplug.errors import NoCompatibleWorker
from kvplug.events import AllCleared, BlockMoved, BlockRemoved, BlockStored, Tier
from kvplug.pickers import inverse_cdf

CHARS_PER_TOKEN = 4  # to convert sglang-router's and smg's character sizes into blocks


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
    """Workers and the router-side in-flight count the baselines balance on."""

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
        """Overridden by the baselines that read engine gauges."""

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


# smg's fixed values: LeastLoadPolicy::new() (cache_aware's expected-wait scorer, built with the
# defaults of worker/expected_wait.rs whatever the --least-load-* flags say), the spill gate's
# MIN_ABSOLUTE_MARGIN, kv_index's MATCHED_TENANTS_CAP, and LeastLoad's dispatch tally cap
_SMG_KV_PRESSURE_WEIGHT = 0.15  # seconds
_SMG_MEAN_PREFILL_TOKENS = 1024  # what an HTTP (text) dispatch is credited
_SMG_DEFAULT_THROUGHPUT = 2000.0  # tokens/s (vLLM's /metrics carry no generation rate)
_SMG_TIE_EPSILON_S = 1e-6
_SMG_MIN_ABSOLUTE_MARGIN = 4.0
_SMG_MATCHED_TENANTS_CAP = 8
_SMG_SINCE_POLL_KEPT = 8192


def _f32(x: float) -> float:
    """``x`` rounded to an f32 (smg keeps its thresholds and the match rate in f32)."""
    return float(np.float32(x))


class _SmgNode:
    """A node of smg's string tree (``kv_index::string_tree``), over prompt blocks: the edge
    ``key`` (one or more blocks), each holder's last access epoch, the cached tenant."""

    __slots__ = ("key", "parent", "children", "tenants", "last_tenant")

    def __init__(self, key: list[int], parent: _SmgNode | None, last_tenant: str | None) -> None:
        self.key = key
        self.parent = parent
        self.children: dict[int, _SmgNode] = {}
        self.tenants: dict[str, int] = {}  # tenant -> epoch of its last access
        self.last_tenant = last_tenant


@dataclass
class _SmgMatch:
    depth: int  # matched blocks
    holders: list[str]  # the deepest matched node's tenants (up to 8); [] when nothing matched
    path: list[_SmgNode]  # the fully matched nodes, root excluded
    rest: int  # index of the first block past the fully matched nodes


class SmgStringTree:
    """smg 1.13.0's approximate string tree (``crates/kv_index/src/string_tree.rs``) over prompt
    blocks instead of characters: a compressed radix tree of every worker's routed prompts with a
    global epoch counter, ``match_and_insert_with``'s match-then-insert, and
    ``evict_tenant_by_size``'s tree-wide budget (see the module docstring)."""

    def __init__(self, order: dict[str, float]) -> None:
        self.root = _SmgNode([], None, None)
        self.size: dict[str, int] = {}  # tenant -> blocks held
        self.total = 0
        self.epoch = 0  # the next value of smg's EPOCH_COUNTER
        self.evicted = 0  # blocks
        self._order = order  # tenant -> rank standing in for hash-map iteration order

    def _next_epoch(self) -> int:
        self.epoch += 1
        return self.epoch - 1

    def _add(self, tenant: str, blocks: int) -> None:
        self.size[tenant] = self.size.get(tenant, 0) + blocks
        self.total += blocks

    def _map_order(self, tenants) -> list[str]:
        return sorted(tenants, key=self._order.__getitem__)

    def add_tenant(self, tenant: str) -> None:
        """``insert_text("", url)``: the tenant at the root, with an epoch."""
        self.root.tenants.setdefault(tenant, 0)
        self.size.setdefault(tenant, 0)
        self._insert_from(self.root, [], 0, tenant)

    def match(self, blocks: list[int]) -> _SmgMatch:
        """The match half of ``match_and_insert_with``, with its side effect: the deepest
        matched node's cached tenant is stamped when the epoch is a multiple of 8."""
        node, i, n = self.root, 0, len(blocks)
        path: list[_SmgNode] = []
        partial: _SmgNode | None = None
        matched = 0
        while i < n:
            child = node.children.get(blocks[i])
            if child is None:
                break
            key, k = child.key, 0
            while k < len(key) and i + k < n and key[k] == blocks[i + k]:
                k += 1
            matched += k
            if k < len(key):
                partial = child  # the match ends inside this node
                break
            path.append(child)
            node, i = child, i + k
        curr = partial if partial is not None else node
        tenant = curr.last_tenant
        if tenant is None or tenant not in curr.tenants:  # the cache is stale: the map's first
            first = self._map_order(curr.tenants)[:1]
            tenant = first[0] if first else None
            curr.last_tenant = tenant
        epoch = self._next_epoch()
        if epoch & 7 == 0 and tenant is not None:
            curr.tenants[tenant] = epoch
        holders: list[str] = []
        if matched:
            holders = list(curr.tenants)
            if len(holders) > _SMG_MATCHED_TENANTS_CAP:
                holders = self._map_order(holders)[:_SMG_MATCHED_TENANTS_CAP]
        return _SmgMatch(matched, holders, path, i)

    def insert(self, blocks: list[int], m: _SmgMatch, tenant: str) -> None:
        """The insert half: ``tenant`` joins the fully matched nodes at epoch 0 where it is new
        (an older attachment keeps its epoch), then the rest goes in below them; the node the
        prompt ends at gets a fresh epoch."""
        self.root.tenants.setdefault(tenant, 0)
        self.size.setdefault(tenant, 0)
        for node in m.path:
            if tenant not in node.tenants:
                node.tenants[tenant] = 0
                self._add(tenant, len(node.key))
        below = m.path[-1] if m.path else self.root
        self._insert_from(below, blocks, m.rest, tenant)

    def _insert_from(self, prev: _SmgNode, blocks: list[int], i: int, tenant: str) -> None:
        n = len(blocks)
        while i < n:
            child = prev.children.get(blocks[i])
            if child is None:  # a new leaf holding the whole rest
                leaf = _SmgNode(blocks[i:], prev, tenant)
                self._add(tenant, n - i)
                leaf.tenants[tenant] = self._next_epoch()
                prev.children[blocks[i]] = leaf
                return
            key, k = child.key, 0
            while k < len(key) and i + k < n and key[k] == blocks[i + k]:
                k += 1
            if k < len(key):  # split: the prefix node inherits the tenants and their epochs
                head = _SmgNode(key[:k], prev, child.last_tenant)
                head.tenants = dict(child.tenants)
                child.key = key[k:]
                child.parent = head
                head.children[child.key[0]] = child
                prev.children[blocks[i]] = head
                child = head
            if tenant not in child.tenants:
                child.tenants[tenant] = 0
                self._add(tenant, len(child.key))
            prev, i = child, i + k
        prev.tenants[tenant] = self._next_epoch()

    def evict(self, max_blocks: int) -> None:
        """``evict_tenant_by_size``: while the total is over ``max_blocks``, the oldest
        (node, tenant) leaf goes (a node is a leaf for a tenant when no child holds the tenant),
        the node with it once nobody holds it, and a parent it leaves bare joins the queue."""
        if self.total <= max_blocks:
            return
        heap: list[tuple[int, int, str, _SmgNode]] = []
        seq = 0
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            for t, ts in node.tenants.items():
                if not any(t in c.tenants for c in node.children.values()):
                    seq += 1
                    heap.append((ts, seq, t, node))
        heapq.heapify(heap)
        while self.total > max_blocks and heap:
            _, _, t, node = heapq.heappop(heap)
            if t not in node.tenants or any(t in c.tenants for c in node.children.values()):
                continue
            del node.tenants[t]
            held = min(len(node.key), self.size[t])
            self.size[t] -= held
            self.total -= held
            self.evicted += len(node.key)
            parent = node.parent
            if parent is None:
                continue
            if not node.children and not node.tenants:
                if parent.children.get(node.key[0]) is node:
                    del parent.children[node.key[0]]
            if (
                parent is not self.root
                and t in parent.tenants
                and not any(t in c.tenants for c in parent.children.values())
            ):
                seq += 1
                heapq.heappush(heap, (parent.tenants[t], seq, t, parent))


class SmgCacheAware(_InflightRouter):
    """smg 1.13.0 ``cache_aware`` over HTTP workers (see the module docstring)."""

    DEFAULTS: ClassVar[dict[str, Any]] = {
        "cache_threshold": 0.3,
        "balance_abs_threshold": 64,
        "balance_rel_threshold": 1.5,
        "eviction_interval_secs": 60.0,
        "max_tree_size": 1 << 26,  # characters, the whole tree (every worker's share summed)
        "load_monitor_interval": 10.0,  # seconds between load polls
        "worker_overload_protection": True,
        "worker_overload_waiting_requests": 8,
        "worker_overload_token_usage": 0.8,
        "engine_loads": True,  # the engines answer the load poll (the sim's vLLM /metrics)
    }

    def __init__(self, config: BaselineConfig, clock, rng) -> None:
        super().__init__(config, clock, rng)
        p = {**self.DEFAULTS, **config.params}
        self.cache_threshold = _f32(p["cache_threshold"])
        self.abs_threshold = float(int(p["balance_abs_threshold"]))
        self.rel_threshold = _f32(p["balance_rel_threshold"])
        self.eviction_interval = float(p["eviction_interval_secs"])
        self.block_size = config.kv_block_size
        self.max_blocks = int(p["max_tree_size"]) // (CHARS_PER_TOKEN * self.block_size)
        self.poll_interval = max(1.0, float(p["load_monitor_interval"]))
        self.protect = bool(p["worker_overload_protection"])
        self.max_waiting = int(p["worker_overload_waiting_requests"])
        self.max_kv = float(p["worker_overload_token_usage"])
        self.engine_loads = bool(p["engine_loads"])
        self._order: dict[str, float] = {}
        self.tree = SmgStringTree(self._order)
        self.reports: dict[str, tuple[float, float, float]] = {}  # running, waiting, KV usage
        self.overloaded: dict[str, bool] = {}
        self._since: dict[str, deque[float]] = {}  # dispatch times since the worker's report
        self._next_poll: float | None = None
        self._poll_at: float | None = None
        self._next_eviction = self.eviction_interval
        self.counters = {
            "cache_hit": 0,
            "spill": 0,
            "miss": 0,
            "all_overloaded": 0,
            "polls": 0,
            "overloaded_verdicts": 0,
        }

    def add_worker(self, worker) -> None:
        super().add_worker(worker)
        wid = worker.worker_id
        self._order[wid] = self._rng.random()
        self.overloaded[wid] = False
        self._since[wid] = deque(maxlen=_SMG_SINCE_POLL_KEPT)
        self.tree.add_tenant(wid)

    # -- the load poll --------------------------------------------------------------------------
    def set_attributes(self, worker_id: str, values: dict, ts: float | None = None) -> None:
        """A gauge snapshot; one is taken as smg's poll every ``load_monitor_interval`` (the
        report stamped at receipt, as ``poll_group_once`` stamps ``sampled_at``)."""
        if not self.engine_loads or worker_id not in self.load:
            return
        now = self._clock()
        if self._next_poll is None or now >= self._next_poll:
            self._poll_at = now
            self._next_poll = now if self._next_poll is None else self._next_poll
            while self._next_poll <= now:
                self._next_poll += self.poll_interval
            self.counters["polls"] += 1
        if now != self._poll_at:
            return
        running = float(values.get("num_requests_running", 0.0))
        waiting = float(values.get("num_requests_waiting", 0.0))
        usage = float(values.get("kv_cache_usage", 0.0))
        self.reports[worker_id] = (running, waiting, usage)
        since = self._since[worker_id]
        while since and since[0] <= now:  # the report saw them: release their credit
            since.popleft()
        if self.protect:
            over = waiting >= self.max_waiting or usage >= self.max_kv
            self.overloaded[worker_id] = over
            self.counters["overloaded_verdicts"] += over

    # -- LeastLoad's expected wait -----------------------------------------------------------------
    def expected_wait(self, wid: str, baseline: float = 0.0) -> float:
        """Seconds (requests, with no report anywhere: see ``_pick``)."""
        rep = self.reports.get(wid)
        if rep is None:
            return baseline + self.load[wid] * _SMG_MEAN_PREFILL_TOKENS / _SMG_DEFAULT_THROUGHPUT
        running, waiting, usage = rep
        since = len(self._since[wid])
        unaccounted = max(0.0, self.load[wid] - (running + waiting) - since)
        queued = (waiting + running + unaccounted) * _SMG_MEAN_PREFILL_TOKENS
        k = min(max(usage, 0.0), 0.999)
        return (queued + since * _SMG_MEAN_PREFILL_TOKENS) / _SMG_DEFAULT_THROUGHPUT + (
            _SMG_KV_PRESSURE_WEIGHT * k / (1.0 - k)
        )

    def _pick(self, pool: list[str], now: float) -> str:
        """``select_min_expected_wait_with_freshness``: the lowest expected wait (ties within
        1e-6 drawn uniformly, reservoir style), credited with one mean prefill until the next
        report. No report from any of ``pool``: the fewest in flight."""
        reporting = [w for w in pool if w in self.reports]
        if not reporting:
            scores = [float(self.load[w]) for w in pool]
        else:
            baseline = 0.0
            if len(reporting) < len(pool):
                baseline = min(self.expected_wait(w) for w in reporting)
            scores = [self.expected_wait(w, baseline) for w in pool]
        best, best_score, tied = 0, scores[0], 1
        for i in range(1, len(pool)):
            s = scores[i]
            if s < best_score - _SMG_TIE_EPSILON_S:
                best, best_score, tied = i, s, 1
            elif abs(s - best_score) <= _SMG_TIE_EPSILON_S:
                tied += 1
                best_score = min(best_score, s)
                if int(self._rng.random() * tied) == 0:
                    best = i
        wid = pool[best]
        self._since[wid].append(now)
        return wid

    def _fewest_in_flight(self) -> str:
        """``fallback_if_all_vetoed``: the least loaded, ties drawn uniformly."""
        best, tied = self.workers[0], 0
        for w in self.workers[1:]:
            if self.load[w] < self.load[best]:
                best, tied = w, 0
            elif self.load[w] == self.load[best]:
                tied += 1
                if int(self._rng.random() * (tied + 1)) == 0:
                    best = w
        return best

    # -- the spill gate ----------------------------------------------------------------------------
    def absolute_margin(self, avg_load: float) -> float:
        swing = float(math.ceil(2.0 * math.sqrt(avg_load)))
        return min(self.abs_threshold, max(swing, _SMG_MIN_ABSOLUTE_MARGIN))

    def over_gate(self, wid: str, avg_load: float) -> bool:
        load = self.load[wid]
        return load > avg_load * self.rel_threshold and load > avg_load + self.absolute_margin(
            avg_load
        )

    def route(self, req) -> _Routed:
        if not self.workers:
            raise NoCompatibleWorker("no worker is registered")
        now = self._clock()
        if self.eviction_interval > 0 and now >= self._next_eviction:
            self.tree.evict(self.max_blocks)
            while self._next_eviction <= now:
                self._next_eviction += self.eviction_interval
        blocks = self._blocks(req)
        eligible = [w for w in self.workers if not self.overloaded[w]]
        if not eligible:  # the placement's veto fallback: the policy is not asked
            wid = self._fewest_in_flight()
            self.counters["all_overloaded"] += 1
            self._book(req.request_id, wid)
            return _Routed(wid)
        avg = sum(self.load[w] for w in eligible) / len(eligible)
        m = self.tree.match(blocks)
        tokens = len(req.token_ids)
        rate = _f32(_f32(m.depth * self.block_size) / _f32(tokens)) if tokens else 0.0
        holders = set(m.holders) if rate > self.cache_threshold else set()
        candidates = [w for w in eligible if w in holders]
        if candidates:
            pool = [w for w in candidates if not self.over_gate(w, avg)]
            if pool:
                self.counters["cache_hit"] += 1
            else:
                pool = [w for w in eligible if not self.over_gate(w, avg)] or eligible
                self.counters["spill"] += 1
        else:
            pool = eligible
            self.counters["miss"] += 1
        wid = self._pick(pool, now)
        self.tree.insert(blocks, m, wid)
        self._book(req.request_id, wid)
        return _Routed(wid)

    def stats(self) -> dict:
        return {
            **self.counters,
            "evicted_blocks": self.tree.evicted,
            "tree_blocks": self.tree.total,
            "overloaded_now": sum(self.overloaded.values()),
        }


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


class FixedPlacement(_InflightRouter):
    """Sends request ``r{i}`` to the ``placement[i]``-th engine of the fleet (in the order the
    replay registers them): a placement decided elsewhere, e.g. by Dynamo's router in its own
    simulator (``benchmarks/bench_dynamo_replay.py``), judged by this one. Aggregated fleets
    only: a request is placed once."""

    def __init__(self, config: BaselineConfig, clock, rng, placement: Sequence[int]) -> None:
        super().__init__(config, clock, rng)
        self.placement = placement

    def route(self, req) -> _Routed:
        rid = req.request_id
        if not (rid.startswith("r") and rid[1:].isdigit()):
            raise ValueError(f"a fixed placement places whole requests, not {rid!r}")
        wid = self.workers[self.placement[int(rid[1:])]]
        self._book(rid, wid)
        return _Routed(wid)


BASELINES: dict[str, tuple[type[_InflightRouter], bool]] = {
    # name -> (class, consumes KV events)
    "sglang-cache-aware": (SglangCacheAware, False),
    "smg-cache-aware": (SmgCacheAware, False),
    "vllm-kv-aware": (VllmKvAware, True),
}


def baseline_factory(name: str) -> Callable[..., _InflightRouter]:
    cls = BASELINES[name][0]

    def make(config: BaselineConfig, clock, rng) -> _InflightRouter:
        return cls(config, clock, rng)

    return make
