"""The router: workers, KV index, active load, and the routing pipeline that turns them into
explainable decisions.

A request's path is ``Router._route``: eight named stages read top to bottom (candidates,
filters, overlap, load, score, pick, book, explain; kvplug.pipeline describes what each one
reports). Score and pick belong to the routing policy of ``--router-mode`` (kvplug.policies),
one object per mode behind one interface.

Transport-agnostic: no HTTP, no sockets. The clock (seconds, monotonic) and the random source
are injected, so the frontend (wall clock), the simulator (virtual time) and the tests (fixed
seeds) drive the same object. Not thread-safe: call it from one thread (or one event loop).
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from kvplug import filters as flt
from kvplug.approx import ApproxIndex
from kvplug.config import RouterConfig
from kvplug.decision import Decision, Exclusion
from kvplug.errors import (
    AllWorkersOverloaded,
    ConfigError,
    InvalidRequest,
    KvplugError,
    NoCompatibleWorker,
    PinnedWorkerOverloaded,
    UnknownWorker,
)
from kvplug.events import AllCleared, KvEvent
from kvplug.index import reserve_room
from kvplug.load import LoadTracker
from kvplug.pipeline import RouteContext, StageBase, StageRules
from kvplug.policies import RoutingPolicy, policy_class
from kvplug.prefill_model import PrefillPredictor, make_predictor
from kvplug.request import NO_HINTS, RouteRequest, RoutingHints
from kvplug.workers import Attribute, AttributeTable, Role, Stage, Worker, WorkerState, role_serves

__all__ = ["Router", "RouteRequest", "RoutingHints", "Stage", "Worker", "Role", "Decision"]

log = logging.getLogger("kvplug.router")
_EMPTY = np.zeros(0, dtype=np.int64)
# The index is pre-sized for at most this many blocks from the workers' KV capacity: a
# reservation touches ~12 bytes a block up front, and a capacity typed or reported wrong must not
# take the router's memory (33.5 M blocks: 512 engines of an 8B model on H200s, 16-token blocks)
INDEX_PRESIZE_MAX = 1 << 25


def _gather_f64(sel: slice | np.ndarray, *arrays: np.ndarray) -> tuple[np.ndarray, ...]:
    """``arrays[j][sel]`` as new float64 arrays (the reference backend's twin of
    ``_core.gather_f64``)."""
    return tuple(a[sel].astype(np.float64) for a in arrays)


class Router:
    """The KV-cache-aware router: register workers (``add_worker``), feed KV events
    (``apply_event``), then per request ``route`` -> :class:`~kvplug.Decision` and the
    lifecycle calls (``on_first_token``, ``on_output_progress``, ``on_finish``) that keep the
    active load exact. ``clock`` (seconds, monotonic) and ``rng`` are injected so the
    simulator and tests can drive it; not thread-safe (one thread or one event loop)."""

    def __init__(
        self,
        config: RouterConfig | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
        index: Any | None = None,
        prefill_predictor: PrefillPredictor | None = None,
        profile: Any | None = None,
    ) -> None:
        from kvplug import core  # the active core backend (compiled, or KVPLUG_CORE=reference)

        self.config = cfg = config if config is not None else RouterConfig()
        # costs and selection on the same backend as the index (tests pin one per index)
        backend = getattr(index, "backend", None) or core.backend
        self._core = core if backend == core.backend else core.load_backend(backend)
        self._backend = backend
        # the candidates' rows of the index's answer as float64: one compiled call, or numpy's
        self._gather = getattr(self._core, "gather_f64", None) or _gather_f64
        self._clock = clock
        self._rng = rng if rng is not None else random.Random()
        if index is None:
            from kvplug.index import KvIndex

            index = KvIndex(cfg.kv_block_size, max_entries=cfg.router_max_index_entries)
        index_cls = type(index)

        def side_index(block_size: int, max_entries: int) -> Any:
            """A second index of the same kind and backend (approximate mode)."""
            try:
                return index_cls(block_size, max_entries=max_entries, backend=backend)
            except TypeError:
                return index_cls(block_size, max_entries=max_entries)

        self._index_factory = side_index
        if index.block_size != cfg.kv_block_size:
            raise ConfigError(
                f"index block size {index.block_size} != --kv-block-size {cfg.kv_block_size}"
            )
        self.index = index
        self.block_size = cfg.kv_block_size
        predictor = prefill_predictor or make_predictor(cfg.router_prefill_load_model)
        trie = getattr(self._core, "ActiveBlocks", None)  # compiled only; else the reference
        self.load = LoadTracker(self.block_size, predictor, trie() if trie is not None else None)
        self._approx: ApproxIndex | None = None
        if cfg.approximate:
            self._approx = ApproxIndex(
                self._index_factory, self.block_size, cfg.approx_ttl, cfg.router_max_tree_size
            )
        self._busy = flt.BusyThresholds(
            cfg.active_decode_blocks_threshold,
            cfg.active_prefill_tokens_threshold,
            cfg.active_prefill_tokens_threshold_frac,
            cfg.busy_threshold_fallback,
        )
        from kvplug.profiles import load_profile

        if profile is not None and not hasattr(profile, "get"):
            profile = load_profile(profile)  # a mapping or a path
        if profile is None and cfg.router_profile:
            profile = load_profile(cfg.router_profile)
        self._profile = profile
        self._workers: dict[str, WorkerState] = {}
        # per endpoint id, read by filters and policies (kvplug.filters.EndpointView);
        # copy-on-write tuples: a Decision keeps a reference, not a copy. Read-only outside.
        self.ep_worker: tuple[str | None, ...] = ()
        self.ep_rank: tuple[int, ...] = ()
        self.ep_state: tuple[WorkerState | None, ...] = ()
        self.ep_rank_arr = np.zeros(0, dtype=np.int64)
        self._side_ep = np.zeros(0, dtype=np.int64)  # endpoint id -> approx side-index id
        self.kv_capacity = np.zeros(0)
        self.max_batched = np.zeros(0)
        self.long_prefill = np.zeros(0)  # each endpoint's long_prefill_token_threshold (0: off)
        # ... the endpoints whose engine floors it (--long-prefill-token-threshold-adaptive)
        self._adaptive_eps: set[int] = set()
        self._is_cpu = np.zeros(0, dtype=bool)
        self.attrs = AttributeTable()  # dynamic attributes by endpoint id
        self.decode_limit = np.zeros(0)  # busy limits by endpoint id (filters.busy_limits)
        self.prefill_limit = np.zeros(0)
        self._base: dict[Stage, StageBase] = {}  # per stage: routable endpoints, rules
        self._seq = 0
        self._index_presized = 0  # blocks the index was last pre-sized for (_presize_index)
        self._rules = self._make_stage_rules()
        # the routing mode: scores and picks (kvplug.policies); built last, it reads the above
        self._policy: RoutingPolicy = policy_class(cfg.router_mode)(self)
        self._policy_filters = type(self._policy).filters is not RoutingPolicy.filters
        self._queries_index = self._policy.uses_overlap or self._approx is not None
        self._filters_configured = False  # any filter beyond the request's own hints
        self._refresh_filters_configured()
        self._refresh_limits()
        self.counters = {
            "decisions": 0,
            "events_applied": 0,
            "events_dropped_unknown_worker": 0,
            "events_dropped_invalid": 0,
            # AllCleared for a worker or rank not registered: nothing of it is indexed (a
            # rank's blocks go when it does), so this is not a drop; e.g. an engine restarted
            # with fewer DP ranks, whose subscriber clears every rank it consumed
            "clears_of_unregistered": 0,
            "attributes_dropped": 0,
            "fallback_decisions": 0,
            "no_compatible_worker": 0,
            "all_workers_overloaded": 0,
            "pinned_worker_overloaded": 0,
            "invalid_requests": 0,
            "previews": 0,
        }

    # ================================================================ workers
    def add_worker(self, worker: Worker) -> None:
        """Register (or re-register: metadata updated, load kept) a worker and its DP ranks."""
        if not isinstance(worker, Worker):
            raise TypeError(f"add_worker expects a kvplug.workers.Worker, got {type(worker)}")
        old = self._workers.get(worker.worker_id)
        state = WorkerState(
            worker, [], draining=False, attributes=old.attributes if old is not None else {}
        )
        eps = [int(self.index.add_endpoint(worker.worker_id, r)) for r in worker.dp_ranks]
        state.endpoint_ids = eps
        if old is not None:
            gone = [
                (rank, ep)
                for rank, ep in zip(old.worker.dp_ranks, old.endpoint_ids, strict=True)
                if ep not in eps
            ]
            for rank, ep in gone:  # ranks that went away: their load and cache with them
                self.load.drop_endpoint(ep)
                self.index.apply(AllCleared(worker_id=worker.worker_id, dp_rank=rank))
            self._set_endpoints([(ep, None, 0, None) for _rank, ep in gone])
        n = max(eps) + 1
        self._ensure(n)
        self._set_endpoints(
            [
                (ep, worker.worker_id, rank, state)
                for rank, ep in zip(worker.dp_ranks, eps, strict=True)
            ]
        )
        for rank, ep in zip(worker.dp_ranks, eps, strict=False):
            if self._approx is not None:  # the side index numbers endpoints its own way
                self._side_ep[ep] = self._approx.add_endpoint(worker.worker_id, rank)
        self._workers[worker.worker_id] = state
        self._base.clear()
        self._refresh_limits()
        self._presize_index()

    def endpoint_of(self, worker_id: str, dp_rank: int) -> int | None:
        """The endpoint id of a worker's DP rank, or None if this router does not know it."""
        st = self._workers.get(worker_id)
        if st is None:
            return None
        for rank, ep in zip(st.worker.dp_ranks, st.endpoint_ids, strict=False):
            if rank == dp_rank:
                return ep
        return None

    def drain_worker(self, worker_id: str) -> None:
        """No new requests; in-flight ones finish and release their load normally."""
        self._state(worker_id).draining = True
        self._base.clear()

    def undrain_worker(self, worker_id: str) -> None:
        self._state(worker_id).draining = False
        self._base.clear()

    def remove_worker(self, worker_id: str) -> None:
        """Forget the worker: its index entries, its load, its in-flight requests."""
        st = self._state(worker_id)
        for ep in st.endpoint_ids:
            self.load.drop_endpoint(ep)
        self._set_endpoints([(ep, None, 0, None) for ep in st.endpoint_ids])
        self.index.remove_worker(worker_id)
        if self._approx is not None:
            self._approx.remove_worker(worker_id)
        del self._workers[worker_id]
        self._base.clear()
        self._refresh_limits()

    def set_attributes(
        self, worker_id: str, values: dict[str, float], ts: float | None = None
    ) -> None:
        """Dynamic attributes (queue_depth, running_requests, kv_usage, gpu_utilization, ...).
        ``ts`` is the observation time on the router's clock (default: now)."""
        st = self._state(worker_id)
        when = self._clock() if ts is None else float(ts)
        for name, raw in values.items():
            try:
                v = float(raw)
            except (TypeError, ValueError):
                v = math.nan
            if not math.isfinite(v):
                self.counters["attributes_dropped"] += 1
                log.warning(
                    "worker %s: attribute %s=%r is not a finite number; dropped",
                    worker_id,
                    name,
                    raw,
                )
                continue
            a = st.attributes.get(name)
            if a is None:
                st.attributes[name] = Attribute(v, when)
            else:
                a.value, a.ts = v, when
            self.attrs.set(st.endpoint_ids, name, v, when)

    def set_busy_thresholds(
        self,
        *,
        decode_frac: float | None = None,
        prefill_tokens: float | None = None,
        prefill_frac: float | None = None,
        fallback: bool | None = None,
    ) -> None:
        """Runtime update (Dynamo's ``POST /busy_threshold``); None unsets a threshold."""
        for v in (decode_frac, prefill_tokens, prefill_frac):
            if v is not None and v < 0:
                raise ConfigError("busy thresholds must be >= 0")
        self._busy = flt.BusyThresholds(
            decode_frac,
            prefill_tokens,
            prefill_frac,
            self._busy.fallback if fallback is None else fallback,
        )
        self._refresh_limits()
        self._refresh_filters_configured()

    @property
    def is_cpu(self) -> np.ndarray:
        """Per endpoint id: the worker's device is a CPU (device-aware-weighted mode)."""
        return self._is_cpu

    # what routing policies read (kvplug.policies)
    @property
    def rng(self) -> random.Random:
        """The injected random source: every random pick draws from it."""
        return self._rng

    @property
    def core(self) -> Any:
        """The core module (costs, select) of the index's backend."""
        return self._core

    @property
    def backend(self) -> str:
        """The index's core backend: "c" or "reference"."""
        return self._backend

    @property
    def profile(self) -> Any:
        """The scheduling profile set (``--router-profile``), or None."""
        return self._profile

    @property
    def policy(self) -> RoutingPolicy:
        """The routing mode's policy object."""
        return self._policy

    @property
    def busy_thresholds(self) -> flt.BusyThresholds:
        return self._busy

    @property
    def workers(self) -> dict[str, Worker]:
        return {wid: st.worker for wid, st in self._workers.items()}

    def worker_state(self, worker_id: str) -> WorkerState:
        return self._state(worker_id)

    # ================================================================ events
    def apply_event(self, event: KvEvent) -> None:
        """Feed one normalised KV event to the index. An unknown worker or rank, or a malformed
        event, is a counted and logged drop: what is indexed already stays (a clear for an
        unknown worker or rank has nothing to clear: counted apart, not logged)."""
        if not self._from_known_worker(event):
            return
        try:
            self.index.apply(event)
        except (KvplugError, ValueError, TypeError) as e:
            self.counters["events_dropped_invalid"] += 1
            log.warning(
                "dropped %s from worker %s rank %d: %s",
                type(event).__name__,
                event.worker_id,
                event.dp_rank,
                e,
            )
            return
        self.counters["events_applied"] += 1

    def _from_known_worker(self, event: KvEvent) -> bool:
        """Whether the event's (worker, rank) is registered; if not, a counted, logged drop
        (a clear of what is not registered has nothing to clear: counted apart, not logged)."""
        st = self._workers.get(getattr(event, "worker_id", None))  # type: ignore[arg-type]
        if st is not None and getattr(event, "dp_rank", None) in st.worker.dp_ranks:
            return True
        if isinstance(event, AllCleared):
            self.counters["clears_of_unregistered"] += 1
            return False
        self.counters["events_dropped_unknown_worker"] += 1
        log.warning(
            "dropped %s for unknown worker %r rank %r",
            type(event).__name__,
            getattr(event, "worker_id", None),
            getattr(event, "dp_rank", None),
        )
        return False

    def apply_events(self, events: Iterable[KvEvent]) -> int:
        """Feed a batch of events (a subscriber's backlog) with the per-event checks of
        ``apply_event`` but one pass through the index (``KvIndex.apply_many``): the ingestion
        benchmark's path. Returns how many were applied; drops are counted as in
        ``apply_event`` (the index logs its drops rate-limited)."""
        known = [event for event in events if self._from_known_worker(event)]
        report = self.index.apply_many(known)
        self.counters["events_dropped_invalid"] += report.dropped
        self.counters["events_applied"] += report.applied
        return report.applied

    # ================================================================ lifecycle
    def on_first_token(self, request_id: str, measured: bool = True) -> None:
        """Prefill is done: release the request's prompt-side (prefill) load. ``measured``:
        the first token was seen as it came (a stream's first event; a P/D prefill's answer),
        not with a whole answer after its decode, so its time may teach the routing policy."""
        now = self._clock()
        if measured and self._policy.hears_first_tokens:
            request = self.load.requests.get(request_id)
            if request is not None and not request.prefill_done:
                self._policy.heard_first_token(request, now)
        self.load.first_token(request_id, now)

    def hears_output_progress(self) -> bool:
        """Whether routing reads a stream's output as it grows (output-block tracking, or a
        policy that weighs the outputs in flight), not only its total at the end."""
        return self.config.router_track_output_blocks or self._policy.reads_output_progress

    def on_output_progress(self, request_id: str, output_tokens: int) -> None:
        """``output_tokens`` = total generated so far (drives output-block tracking)."""
        self.load.output_progress(request_id, output_tokens, self._clock())

    def on_finish(self, request_id: str) -> None:
        """Success or failure: release everything the request holds."""
        self.load.finish(request_id, self._clock())

    # ================================================================ routing
    def route(self, req: RouteRequest) -> Decision:
        """Pick a worker (and DP rank) for one request and start tracking its load."""
        try:
            d = self._route(req)
        except NoCompatibleWorker:
            self.counters["no_compatible_worker"] += 1
            raise
        except PinnedWorkerOverloaded:
            self.counters["pinned_worker_overloaded"] += 1
            raise
        except AllWorkersOverloaded:
            self.counters["all_workers_overloaded"] += 1
            raise
        except InvalidRequest:
            self.counters["invalid_requests"] += 1
            raise
        if d.fallback:
            self.counters["fallback_decisions"] += 1
        return d

    def preview(self, req: RouteRequest) -> Decision:
        """The decision ``route`` would make now, without booking it: no load is tracked, no
        approximate-mode record, ``decision_id`` 0 (e.g. conditional disaggregation asks where a
        request would go before choosing its path). Raises what ``route`` raises."""
        return self._route(req, book=False)

    def _route(self, req: RouteRequest, book: bool = True) -> Decision:
        """The routing pipeline: eight named stages, top to bottom (kvplug.pipeline). Each
        stage fills in its part of ``ctx``; explain assembles the Decision from them."""
        t0 = time.perf_counter()
        ctx = self._candidates(req)
        ctx.booking = book
        self._filters(ctx)
        self._overlap(ctx)
        self._load(ctx)
        policy = self._policy
        ctx.trace = trace = policy.score(ctx)
        ctx.chosen = policy.pick(ctx, trace)
        self._book(ctx, book)
        return self._explain(ctx, t0)

    def _candidates(self, req: RouteRequest) -> RouteContext:
        """Stage 1: the prompt's size, the stage's routable endpoints (draining and wrong-role
        workers are left out, with reasons precomputed per stage) and the load at ``now``."""
        cfg = self.config
        n_tokens = len(req.token_ids) if req.token_ids is not None else 0
        if n_tokens == 0 and req.block_hashes is not None:
            n_tokens = len(req.block_hashes) * self.block_size
        if n_tokens > cfg.router_max_prompt_tokens:
            raise InvalidRequest(
                f"request {req.request_id}: prompt of {n_tokens} tokens exceeds "
                f"--router-max-prompt-tokens {cfg.router_max_prompt_tokens}"
            )
        base = self._base.get(req.stage)
        if base is None:
            base = self._base_candidates(req.stage)
        now = self._clock()
        load = self.load
        prefill = load.prefill_tokens if load.predictor is None else load.prefill_tokens_at(now)
        return RouteContext(req, now, n_tokens, self.block_size, base, prefill, load.decode_blocks)

    def _filters(self, ctx: RouteContext) -> None:
        """Stage 2 (kvplug.filters, in this order): the request's hard constraints (allow-list,
        exclusions, pin, DP rank, taints), busy thresholds and label selectors, the policy's
        own filters, attribute thresholds. Each exclusion lands in ``ctx.report``."""
        req, hints = ctx.req, ctx.hints
        hard = req.exclude_workers or (hints is not NO_HINTS and not hints.is_empty())
        if not hard and len(ctx.cands) == 0:
            raise NoCompatibleWorker(
                f"request {req.request_id}: no {ctx.stage.value}-capable worker is "
                "registered (or all are draining)"
            )
        if not (hard or self._filters_configured):
            return  # the common case: nothing to filter (the report stays None)
        report = ctx.report = flt.FilterResult(ctx.cands)
        if hard:
            ctx.cands = flt.hard_filters(
                self,
                ctx.cands,
                hints,
                req.exclude_workers,
                self._workers,
                report,
                req.exclusion_reasons,
            )
        self._busy_and_label_filters(ctx, report)
        self._threshold_filters(ctx, report)
        ctx.sel = cands = ctx.cands  # filtered: per-endpoint arrays are gathered by id
        if report.penalised:
            ctx.penalised = np.fromiter(
                (int(e) in report.penalised for e in cands.tolist()), bool, len(cands)
            )

    def _busy_and_label_filters(self, ctx: RouteContext, report: flt.FilterResult) -> None:
        """Busy thresholds, then the configured and the request's label selectors."""
        busy = self._busy
        selector = self.config.router_label_selector
        hints = ctx.hints
        if hints.labels:
            selector = {**selector, **hints.labels}
        if busy.active or selector:
            ctx.cands = flt.apply_busy_and_labels(
                self,
                ctx.cands,
                busy,
                selector,
                ctx.prefill_tokens,
                ctx.decode_blocks,
                hints.pinned_worker_id is not None,
                report,
            )

    def _threshold_filters(self, ctx: RouteContext, report: flt.FilterResult) -> None:
        """The policy's own filters (a profile's label selector and attribute thresholds),
        then every attribute threshold, the configured ones first."""
        cfg = self.config
        thresholds = cfg.router_attribute_thresholds
        extra = self._policy.filters(ctx.stage) if self._policy_filters else None
        if extra is not None:
            thresholds = [*thresholds, *extra.attribute_thresholds]
            if extra.label_selector:
                ctx.cands = flt.label_filter(self, ctx.cands, extra.label_selector, report)
                if len(ctx.cands) == 0:
                    raise NoCompatibleWorker(
                        flt._empty_message(
                            "no worker matches the profile's label selector", report.excluded
                        )
                    )
        for th in thresholds:
            ctx.cands = flt.attribute_filter(
                self, ctx.cands, th, ctx.now, cfg.router_attribute_max_age, report
            )

    def _overlap(self, ctx: RouteContext) -> None:
        """Stage 3: the prompt's block hashes and, per candidate, how much of it the index holds
        (device, host, disk, shared tier beyond the local prefix). In approximate mode blocks
        predicted by earlier decisions count as device blocks."""
        if not self._queries_index:
            return
        req, sel = ctx.req, ctx.sel
        hashes = req.block_hashes
        if hashes is None:
            hashes = self.index.request_hashes(req.token_ids, req.lora_name, req.cache_salt)
        ctx.hashes = hashes
        ov = self.index.query(hashes)  # reused by the next query: copy out what we keep
        dev, shared, ctx.host, ctx.disk = self._gather(
            sel, ov.device, ov.shared_beyond, ov.host, ov.disk
        )
        if self._approx is not None:
            self._approx.expire(ctx.now)
            ova = self._approx.query(hashes)
            predicted = ova.local[self._side_ep[ctx.cands]] - ov.local[sel]
            extra = np.maximum(predicted, 0).astype(np.float64)
            if np.count_nonzero(extra):  # predicted blocks count as device blocks; max per endpoint
                dev = dev + extra
                shared = np.maximum(shared - extra, 0.0)
        ctx.device, ctx.shared = dev, shared

    def _load(self, ctx: RouteContext) -> None:
        """Stage 4: with --router-assume-kv-reuse, the prompt's leading blocks already active
        on each candidate (Dynamo's active-sequence dedup: not new decode load there). The
        policy reads these and the load at ``now`` (stage 1)."""
        rules = ctx.rules
        hashes = ctx.hashes
        if not (rules.track_decode and rules.assume_reuse and hashes is not None):
            return
        if ctx.req.block_hashes is not None:  # the caller's buffer: the trie keeps views of it
            hashes = np.array(hashes, dtype=np.uint64, copy=True)
        active = self.load.active
        walk = active.walk(hashes)
        ctx.chain = (hashes, walk)
        if walk:
            # a fresh buffer, not a reused one: the decision's trace keeps a view of it (a
            # stored trace must not change with later decisions)
            depths = active.depths(walk, np.empty(len(self.load.inflight)))
            ctx.active_depth = depths[ctx.sel]

    def _book(self, ctx: RouteContext, book: bool) -> None:
        """Stage 7: track the request's load on the pick (and, in approximate mode, record its
        blocks there); a preview books nothing."""
        i = ctx.chosen
        dev = ctx.device
        cached = 0
        if dev is not None:  # the pick's prompt blocks in any local tier
            cached = int(dev[i] + ctx.host[i] + ctx.disk[i])  # type: ignore[index]
        ctx.cached_blocks = cached
        ctx.cached_tokens = min(cached * self.block_size, ctx.n_tokens)
        if not book:
            self.counters["previews"] += 1
            return
        ep = int(ctx.cands[i])
        full_blocks = ctx.full_blocks
        # deduplicated: the hashed chain is counted by the tracker; only a trailing partial
        # block is the request's own
        chain = ctx.chain
        own_blocks = full_blocks if chain is None else max(full_blocks - len(chain[0]), 0)
        rules = ctx.rules
        now = ctx.now
        self.load.add(
            ctx.req.request_id,
            ep,
            ctx.n_tokens,
            ctx.cached_tokens,
            track_prefill=rules.track_prefill,
            track_decode=rules.track_decode,
            decode_blocks=float(own_blocks),
            expected_osl=ctx.hints.expected_osl,
            track_output=self.config.router_track_output_blocks,
            now=now,
            chain=chain,
        )
        if self._approx is not None and ctx.hashes is not None:
            self._approx.record(self.ep_worker[ep] or "?", self.ep_rank[ep], ctx.hashes, now)
        self._seq += 1
        ctx.decision_id = self._seq
        self.counters["decisions"] += 1

    def _explain(self, ctx: RouteContext, t0: float) -> Decision:
        """Stage 8: the Decision, assembled from what each stage reported."""
        ep = int(ctx.cands[ctx.chosen])
        d = Decision.assemble(
            ctx,
            self.ep_worker[ep] or "?",  # a candidate always has a worker
            self.ep_rank[ep],
            ep,
            self._policy.name,
            (time.perf_counter() - t0) * 1e6,
        )
        if log.isEnabledFor(logging.DEBUG):
            log.debug("%s %s", ctx.req.request_id, d.explain())
        return d

    # ---------------------------------------------------------------- introspection
    def active_load(self, worker_id: str) -> dict[int, dict[str, float]]:
        """Per DP rank: active prefill tokens, decode blocks, in-flight requests."""
        st = self._state(worker_id)
        now = self._clock()
        pt = self.load.prefill_tokens_at(now)
        return {
            rank: {
                "prefill_tokens": float(pt[ep]),
                "decode_blocks": float(self.load.decode_blocks[ep]),
                "inflight": int(self.load.inflight[ep]),
            }
            for rank, ep in zip(st.worker.dp_ranks, st.endpoint_ids, strict=False)
        }

    def endpoint_load(self, endpoint_id: int) -> dict[str, float]:
        """Active prefill tokens, decode blocks and in-flight requests of one endpoint id."""
        if not 0 <= endpoint_id < len(self.load.inflight):
            return {"prefill_tokens": 0.0, "decode_blocks": 0.0, "inflight": 0}
        return {
            "prefill_tokens": float(self.load.prefill_tokens_at(self._clock())[endpoint_id]),
            "decode_blocks": float(self.load.decode_blocks[endpoint_id]),
            "inflight": int(self.load.inflight[endpoint_id]),
        }

    def stats(self) -> dict[str, Any]:
        s: dict[str, Any] = dict(self.counters)
        s["workers"] = len(self._workers)
        s["active_requests"] = self.load.active_count()
        s.update({f"load_{k}": v for k, v in self.load.counters.items()})
        s["index"] = self.index.stats()
        s["index_presized_blocks"] = self._index_presized  # room reserved (_presize_index)
        if self._approx is not None:
            s["approx"] = self._approx.stats()
        policy_stats = self._policy.stats()
        if policy_stats is not None:
            s[self._policy.name] = policy_stats
        replica_stats = getattr(self.load.listener, "stats_dict", None)
        if replica_stats is not None:  # replicas sharing load (kvplug.replica_sync)
            s["replica_sync"] = replica_stats()
        return s

    # ---------------------------------------------------------------- internals
    def _state(self, worker_id: str) -> WorkerState:
        st = self._workers.get(worker_id)
        if st is None:
            raise UnknownWorker(f"unknown worker {worker_id!r}")
        return st

    def _ensure(self, n: int) -> None:
        self.load.ensure(n)
        self.attrs.ensure(n)
        if n > len(self.kv_capacity):
            cap = max(n, 2 * len(self.kv_capacity), 16)
            for name, dtype in (
                ("kv_capacity", np.float64),
                ("max_batched", np.float64),
                ("long_prefill", np.float64),
                ("_is_cpu", bool),
            ):
                old = getattr(self, name)
                new = np.zeros(cap, dtype=dtype)
                new[: len(old)] = old
                setattr(self, name, new)
            ranks = np.zeros(cap, dtype=np.int64)
            ranks[: len(self.ep_rank_arr)] = self.ep_rank_arr
            self.ep_rank_arr = ranks
            side = np.zeros(cap, dtype=np.int64)
            side[: len(self._side_ep)] = self._side_ep[:cap]
            self._side_ep = side
        if n > len(self.ep_worker):
            pad = n - len(self.ep_worker)
            self.ep_worker = self.ep_worker + (None,) * pad
            self.ep_rank = self.ep_rank + (0,) * pad
            self.ep_state = self.ep_state + (None,) * pad

    def _set_endpoints(self, items: list[tuple[int, str | None, int, WorkerState | None]]) -> None:
        """Set many endpoints with one copy of the lookup tuples (a worker's DP ranks: linear
        in its dp_size, not quadratic)."""
        if not items:
            return
        self._ensure(max(ep for ep, *_ in items) + 1)
        w, r, s = list(self.ep_worker), list(self.ep_rank), list(self.ep_state)
        for ep, wid, rank, st in items:
            w[ep], r[ep], s[ep] = wid, rank, st
        self.ep_worker, self.ep_rank, self.ep_state = tuple(w), tuple(r), tuple(s)
        for ep, _wid, rank, st in items:
            self._fill_endpoint(ep, rank, st)

    def chunk_tokens(self, ep: int) -> float:
        """Endpoint ``ep``'s prefill chunk (its worker's ``max_num_batched_tokens``); 0 when
        unknown (a prediction then takes a prompt in one pass)."""
        return self.max_batched.item(ep) if ep < len(self.max_batched) else 0.0

    def long_prefill_tokens(self, ep: int, inflight: int | None = None) -> float:
        """Endpoint ``ep``'s ``long_prefill_token_threshold`` (its worker's; 0 = off or
        unknown): the most tokens of a step one prompt takes while others run or wait. An
        adaptive one is floored as vLLM floors it, at the budget over the engine's running and
        waiting requests: here the router's requests in flight there (``inflight``, else
        those now) and this one."""
        if ep >= len(self.long_prefill):
            return 0.0
        cap = self.long_prefill.item(ep)
        if cap and ep in self._adaptive_eps:
            if inflight is None:
                inflight = self.load.inflight.item(ep)
            share = self.max_batched.item(ep) // (inflight + 1)
            if share > cap:
                cap = share
        return cap

    def long_prefill_now(self) -> np.ndarray:
        """``long_prefill_tokens`` of every endpoint, as one array (the same floats; the
        compiled predictions read it). The thresholds themselves unless one is adaptive."""
        if not self._adaptive_eps:
            return self.long_prefill
        caps = self.long_prefill.copy()
        eps = np.fromiter(self._adaptive_eps, dtype=np.intp, count=len(self._adaptive_eps))
        share = self.max_batched[eps] // (self.load.inflight[eps] + 1)
        caps[eps] = np.maximum(caps[eps], share)
        return caps

    def _fill_endpoint(self, ep: int, rank: int, st: WorkerState | None) -> None:
        self.ep_rank_arr[ep] = rank
        if st is not None:
            self.kv_capacity[ep] = st.worker.kv_capacity_blocks
            self.max_batched[ep] = st.worker.max_batched_tokens
            self.long_prefill[ep] = st.worker.long_prefill_token_threshold
            if (
                st.worker.long_prefill_token_threshold_adaptive
                and st.worker.long_prefill_token_threshold > 0
            ):
                self._adaptive_eps.add(ep)
            else:
                self._adaptive_eps.discard(ep)
            self._is_cpu[ep] = st.worker.is_cpu
            self.attrs.clear([ep])
            for name, a in st.attributes.items():  # a re-registered worker keeps its attributes
                self.attrs.set([ep], name, a.value, a.ts)
        else:
            self.kv_capacity[ep] = 0
            self.max_batched[ep] = 0
            self.long_prefill[ep] = 0
            self._adaptive_eps.discard(ep)
            self.attrs.clear([ep])

    def _refresh_filters_configured(self) -> None:
        cfg = self.config
        self._filters_configured = bool(
            self._busy.active
            or cfg.router_label_selector
            or cfg.router_attribute_thresholds
            or self._policy_filters
        )

    def _presize_index(self) -> None:
        """Pre-size the index for the fleet's KV capacity (the sum of its endpoints' device
        blocks, configured or reported by the engine; within ``--router-max-index-entries``
        and INDEX_PRESIZE_MAX), so that filling it never stops to rehash: a table's growth
        step rehashes it whole, on the event loop that applies events and routes (~0.2 s at
        5 M blocks). Room only grows; blocks beyond it (host tiers, unknown capacity) grow
        the tables as before."""
        capacity = int(self.kv_capacity.sum())
        if self._approx is not None:  # its side index fills from routing at the same pace
            self._approx.presize(min(capacity, INDEX_PRESIZE_MAX))
        bound = self.config.router_max_index_entries
        want = (
            min(capacity, bound, INDEX_PRESIZE_MAX) if bound else min(capacity, INDEX_PRESIZE_MAX)
        )
        self._index_presized = reserve_room(self.index, want, self._index_presized, "the index")

    def _refresh_limits(self) -> None:
        self.decode_limit, self.prefill_limit = flt.busy_limits(
            self._busy, self.kv_capacity, self.max_batched
        )

    def _base_candidates(self, stage: Stage) -> StageBase:
        """The stage's routable endpoints (cached until workers change)."""
        eps: list[int] = []
        static: list[Exclusion] = []
        for wid, st in self._workers.items():
            if st.draining:
                static.append(Exclusion(wid, None, "drain", "worker is draining"))
            elif not role_serves(st.worker.role, stage):
                static.append(
                    Exclusion(
                        wid,
                        None,
                        "role",
                        f"role {st.worker.role.value} does not serve the {stage.value} stage",
                    )
                )
            else:
                eps.extend(st.endpoint_ids)
        eps.sort()
        arr = np.asarray(eps, dtype=np.int64) if eps else _EMPTY
        is_range = bool(len(arr)) and int(arr[-1]) == len(arr) - 1
        base = self._base[stage] = StageBase(arr, tuple(static), is_range, self._rules[stage])
        return base

    def _make_stage_rules(self) -> dict[Stage, StageRules]:
        cfg = self.config
        CostParams = self._core.CostParams

        def params(credit: float) -> Any:
            return CostParams(
                overlap_score_credit=credit,
                host_cache_hit_weight=cfg.router_host_cache_hit_weight,
                disk_cache_hit_weight=cfg.router_disk_cache_hit_weight,
                shared_cache_multiplier=cfg.shared_cache_multiplier,
                prefill_load_scale=cfg.router_prefill_load_scale,
            )

        credit = cfg.router_kv_overlap_score_credit
        rules = {
            Stage.AGGREGATED: StageRules(
                True,
                cfg.router_track_prefill_tokens,
                cfg.router_track_active_blocks,
                credit,
                cfg.router_assume_kv_reuse,
                params(credit),
                cfg.router_decode_resident_credit,
            ),
            # prefill stage: no decode-side load, full credit, reuse assumed
            Stage.PREFILL: StageRules(
                True, cfg.router_track_prefill_tokens, False, 1.0, True, params(1.0)
            ),
            # decode stage: no prefill tokens, no credit, no reuse assumption
            Stage.DECODE: StageRules(
                False, False, cfg.router_track_active_blocks, 0.0, False, params(0.0)
            ),
        }
        for r in rules.values():
            r.params_dict = self._params_dict(r.credit)
        return rules

    def _params_dict(self, credit: float) -> dict[str, float]:
        cfg = self.config
        return {
            "overlap_score_credit": credit,
            "host_cache_hit_weight": cfg.router_host_cache_hit_weight,
            "disk_cache_hit_weight": cfg.router_disk_cache_hit_weight,
            "shared_cache_multiplier": cfg.shared_cache_multiplier,
            "prefill_load_scale": cfg.router_prefill_load_scale,
            "temperature": cfg.router_temperature,
            "missing_penalty": cfg.router_missing_attribute_penalty,
            "lmetric": float(cfg.router_selection_policy == "lmetric"),
        }
