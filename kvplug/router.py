"""The router: workers, KV index, active load, filters, scoring, picking, explainable decisions.

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
from kvplug import pickers
from kvplug.approx import ApproxIndex
from kvplug.config import RouterConfig
from kvplug.decision import CandidateTrace, Decision, Exclusion
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
from kvplug.load import LoadTracker
from kvplug.prefill_model import PrefillPredictor, make_predictor
from kvplug.request import RouteRequest, RoutingHints
from kvplug.scoring import ScoringContext
from kvplug.workers import Attribute, AttributeTable, Role, Stage, Worker, WorkerState, role_serves

__all__ = ["Router", "RouteRequest", "RoutingHints", "Stage", "Worker", "Role", "Decision"]

log = logging.getLogger("kvplug.router")
_EMPTY = np.zeros(0, dtype=np.int64)


class _StageRules:
    """Per-stage load/credit rules (PROTOCOLS.md §4.6)."""

    __slots__ = (
        "params_dict",
        "prefill_term",
        "track_prefill",
        "track_decode",
        "credit",
        "assume_reuse",
        "resident_credit",
        "params",
    )

    def __init__(
        self,
        prefill_term: bool,  # the incoming prompt counts as prefill blocks
        track_prefill: bool,  # active prompt-side load is tracked and counted
        track_decode: bool,
        credit: float,
        assume_reuse: bool,
        params: Any,
        resident_credit: bool = False,
    ) -> None:
        self.prefill_term = prefill_term
        self.track_prefill = track_prefill
        self.track_decode = track_decode
        self.credit = credit
        self.assume_reuse = assume_reuse  # dedupe active blocks by hash
        self.resident_credit = resident_credit  # and the device-resident prefix is not new
        self.params = params
        self.params_dict: dict[str, float] = {}  # the same numbers, for explanations


class Router:
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
        # the pure-Python reference takes sequences; the compiled core takes numpy buffers
        self._as_seq = backend == "reference"
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
        self.load = LoadTracker(self.block_size, predictor)
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
        if cfg.router_mode == "profile" and profile is None:
            raise ConfigError("--router-mode profile needs --router-profile FILE (or profile=)")
        self._workers: dict[str, WorkerState] = {}
        # per endpoint id (copy-on-write tuples: a Decision keeps a reference, not a copy)
        self._ep_worker: tuple[str | None, ...] = ()
        self._ep_rank: tuple[int, ...] = ()
        self._ep_state: tuple[WorkerState | None, ...] = ()
        self.ep_rank_arr = np.zeros(0, dtype=np.int64)
        self._side_ep = np.zeros(0, dtype=np.int64)  # endpoint id -> approx side-index id
        self.kv_capacity = np.zeros(0)
        self.max_batched = np.zeros(0)
        self._is_cpu = np.zeros(0, dtype=bool)
        self.attrs = AttributeTable()  # dynamic attributes by endpoint id
        self.decode_limit = np.zeros(0)  # busy limits by endpoint id (filters.busy_limits)
        self.prefill_limit = np.zeros(0)
        self._base: dict[Stage, np.ndarray] = {}
        self._base_is_range: dict[Stage, bool] = {}
        self._base_static: dict[Stage, tuple[Exclusion, ...]] = {}
        self._rr = 0
        self._seq = 0
        self._depth_buf = np.zeros(0)  # ActiveBlocks.depths output, per endpoint id
        self._lmetric = cfg.router_selection_policy == "lmetric"
        self._rules = self._make_stage_rules()
        self._refresh_limits()
        self.counters = {
            "decisions": 0,
            "events_applied": 0,
            "events_dropped_unknown_worker": 0,
            "events_dropped_invalid": 0,
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

    # the filters' view of endpoints (kvplug.filters.EndpointView)
    @property
    def ep_worker(self) -> tuple[str | None, ...]:
        return self._ep_worker

    @property
    def ep_rank(self) -> tuple[int, ...]:
        return self._ep_rank

    @property
    def ep_state(self) -> tuple[WorkerState | None, ...]:
        return self._ep_state

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
        event, is a counted and logged drop: what is indexed already stays."""
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
        """Whether the event's (worker, rank) is registered; if not, a counted, logged drop."""
        st = self._workers.get(getattr(event, "worker_id", None))  # type: ignore[arg-type]
        if st is not None and getattr(event, "dp_rank", None) in st.worker.dp_ranks:
            return True
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
    def on_first_token(self, request_id: str) -> None:
        """Prefill is done: release the request's prompt-side (prefill) load."""
        self.load.first_token(request_id, self._clock())

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
        t0 = time.perf_counter()
        now = self._clock()
        cfg = self.config
        bs = self.block_size
        stage = req.stage
        n_tokens = len(req.token_ids) if req.token_ids is not None else 0
        if n_tokens == 0 and req.block_hashes is not None:
            n_tokens = len(req.block_hashes) * bs
        if n_tokens > cfg.router_max_prompt_tokens:
            raise InvalidRequest(
                f"request {req.request_id}: prompt of {n_tokens} tokens exceeds "
                f"--router-max-prompt-tokens {cfg.router_max_prompt_tokens}"
            )
        cands = self._base.get(stage)
        if cands is None:
            cands = self._base_candidates(stage)
        hints = req.hints
        res: flt.FilterResult | None = None
        if req.exclude_workers or not hints.is_empty():
            res = flt.FilterResult(cands)
            cands = flt.hard_filters(self, cands, hints, req.exclude_workers, self._workers, res)
        elif len(cands) == 0:
            raise NoCompatibleWorker(
                f"request {req.request_id}: no {stage.value}-capable worker is registered"
                " (or all are draining)"
            )
        load = self.load
        prefill_tok = load.prefill_tokens_at(now)
        decode_blk = load.decode_blocks
        busy = self._busy
        selector = cfg.router_label_selector
        if hints.labels:
            selector = {**selector, **hints.labels}
        if busy.active or selector:
            if res is None:
                res = flt.FilterResult(cands)
            cands = flt.apply_busy_and_labels(
                self,
                cands,
                busy,
                selector,
                prefill_tok,
                decode_blk,
                hints.pinned_worker_id is not None,
                res,
            )
        thresholds = cfg.router_attribute_thresholds
        profile = (
            self._profile.get(stage)
            if cfg.router_mode == "profile" and self._profile is not None
            else None
        )
        if profile is not None:
            thresholds = [*thresholds, *profile.attribute_filters]
            if profile.label_selector:
                if res is None:
                    res = flt.FilterResult(cands)
                cands = flt.label_filter(self, cands, profile.label_selector, res)
                if len(cands) == 0:
                    raise NoCompatibleWorker(
                        flt._empty_message(
                            "no worker matches the profile's label selector", res.excluded
                        )
                    )
        for th in thresholds:
            if res is None:
                res = flt.FilterResult(cands)
            cands = flt.attribute_filter(self, cands, th, now, cfg.router_attribute_max_age, res)

        mode = cfg.router_mode
        rules = self._rules[stage]
        # unfiltered candidates 0..n-1: gather with a slice (a view, cheaper than fancy indexing)
        sel: slice | np.ndarray = cands
        if res is None and self._base_is_range.get(stage):
            sel = slice(0, len(cands))
        hashes = None
        dev: Any = None  # overlap vectors (float64 per candidate) when the index was queried
        host: Any = None
        disk: Any = None
        shared: Any = None
        if mode in ("kv", "profile") or self._approx is not None:
            hashes = req.block_hashes
            if hashes is None:
                hashes = self.index.request_hashes(req.token_ids, req.lora_name, req.cache_salt)
            ov = self.index.query(hashes)
            dev = ov.device[sel].astype(np.float64)
            host = ov.host[sel].astype(np.float64)
            disk = ov.disk[sel].astype(np.float64)
            shared = ov.shared_beyond[sel].astype(np.float64)
            if self._approx is not None:
                self._approx.expire(now)
                ova = self._approx.query(hashes)
                local = ov.local[sel]
                extra = np.maximum(ova.local[self._side_ep[cands]] - local, 0).astype(np.float64)
                if extra.any():  # predicted blocks count as device blocks; max per endpoint
                    dev = dev + extra
                    shared = np.maximum(shared - extra, 0.0)
        full_blocks = -(-n_tokens // bs)
        # --router-assume-kv-reuse: prompt blocks already active on an endpoint (by hash) are
        # not new decode load there (Dynamo's active-sequence dedup)
        chain: tuple[np.ndarray, Any] | None = None
        active_depth: np.ndarray | None = None  # per candidate, leading blocks already active
        if rules.track_decode and rules.assume_reuse and hashes is not None:
            chain_hashes = hashes
            if req.block_hashes is not None:  # the caller's buffer: the trie keeps views of it
                chain_hashes = np.array(hashes, dtype=np.uint64, copy=True)
            walk = load.active.walk(chain_hashes)
            chain = (chain_hashes, walk)
            if walk:
                buf = self._depth_buf
                if len(buf) < len(load.inflight):
                    buf = self._depth_buf = np.zeros(len(load.inflight))
                active_depth = load.active.depths(walk, buf)[sel]
        penalised = None
        if res is not None and res.penalised:
            penalised = np.fromiter(
                (int(e) in res.penalised for e in cands.tolist()), bool, len(cands)
            )

        probs = None
        if mode == "kv":
            prefill_vec, decode_vec = self._load_vectors(
                rules, sel, dev, active_depth, prefill_tok, decode_blk, n_tokens
            )
            inputs = {
                "device": dev,
                "host": host,
                "disk": disk,
                "shared_beyond": shared,
                "prefill_blocks": prefill_vec,
                "decode_blocks": decode_vec,
            }
            if active_depth is not None:
                inputs["active_prefix"] = active_depth
            credited = dev
            if cfg.router_kv_overlap_score_credit_decay > 0 and rules.credit > 0:
                factor = self._credit_factor(prefill_tok[sel], n_tokens)
                credited = dev * factor
                inputs["credit_factor"] = factor
            values = self._kv_costs(rules, prefill_vec, credited, host, disk, shared, decode_vec)
            if penalised is not None:
                values = np.where(
                    penalised, values * (1.0 + cfg.router_missing_attribute_penalty), values
                )
            temp = cfg.router_temperature
            idx = int(self._select(values, temp, self._rng.random()))
            if temp > 0:
                probs = pickers.softmax_cost_probs(values, temp)
            trace = CandidateTrace(
                self._ep_worker,
                self._ep_rank,
                cands,
                "cost",
                values,
                inputs,
                rules.params_dict,
                probs,
                penalised,
            )
        elif mode == "profile":
            idx, trace, res = self._profile_pick(
                profile,
                req,
                cands,
                dev,
                host,
                disk,
                shared,
                prefill_tok,
                decode_blk,
                n_tokens,
                rules,
                penalised,
                now,
                res,
                active_depth,
            )
        else:
            idx, trace = self._simple_pick(mode, req, cands, hints)

        ep = int(cands[idx])
        wid = self._ep_worker[ep] or "?"  # a candidate always has a worker
        rank = self._ep_rank[ep]
        cached_blocks = int(dev[idx] + host[idx] + disk[idx]) if dev is not None else 0
        # deduplicated: the hashed chain is counted by the tracker; only a trailing partial
        # block is the request's own
        incoming_blocks = full_blocks if chain is None else max(full_blocks - len(chain[0]), 0)
        cached_tokens = min(cached_blocks * bs, n_tokens)
        if book:
            load.add(
                req.request_id,
                ep,
                n_tokens,
                cached_tokens,
                track_prefill=rules.track_prefill,
                track_decode=rules.track_decode,
                decode_blocks=float(max(incoming_blocks, 0)),
                expected_osl=hints.expected_osl,
                track_output=cfg.router_track_output_blocks,
                now=now,
                chain=chain,
            )
            if self._approx is not None and hashes is not None:
                self._approx.record(wid, rank, hashes, now)
            self._seq += 1
            self.counters["decisions"] += 1
        else:
            self.counters["previews"] += 1
        if res is None:
            excluded, fb, ages = [], [], []
        else:
            excluded, fb, ages = res.excluded, res.fallback_filters, res.attribute_ages
        d = Decision(
            worker_id=wid,
            dp_rank=rank,
            endpoint_id=ep,
            decision_id=self._seq if book else 0,
            request_id=req.request_id,
            mode=mode,
            stage=stage,  # a str enum: compares and serialises as its value
            fallback=bool(fb),
            fallback_filters=fb,
            excluded=excluded,
            static_excluded=self._base_static[stage],
            elapsed_us=(time.perf_counter() - t0) * 1e6,
            attribute_ages=ages,
            overlap_blocks=cached_blocks,
            cached_tokens=cached_tokens,
            prompt_tokens=n_tokens,
            request_blocks=full_blocks,
            chosen_index=idx,
            trace=trace,
        )
        if log.isEnabledFor(logging.DEBUG):
            log.debug("%s %s", req.request_id, d.explain())
        return d

    # ---------------------------------------------------------------- other modes
    def _simple_pick(
        self, mode: str, req: RouteRequest, cands: np.ndarray, hints: RoutingHints
    ) -> tuple[int, CandidateTrace]:
        rng = self._rng
        inflight = self.load.inflight[cands].astype(np.float64)
        inputs = {"inflight": inflight}
        extra: dict[str, float] = {}
        if mode == "random":
            idx = rng.randrange(len(cands))
        elif mode == "round-robin":
            idx = self._rr % len(cands)
            self._rr += 1
        elif mode == "direct":
            if hints.pinned_worker_id is None:
                raise InvalidRequest(
                    f"request {req.request_id}: --router-mode direct needs a pinned worker id"
                )
            idx = pickers.argmin_random_tie(inflight, rng)  # least-loaded rank of the pinned worker
        elif mode == "least-loaded":
            idx = pickers.argmin_random_tie(inflight, rng)
        elif mode == "power-of-two":
            idx = pickers.power_of_two(inflight, rng)
        elif mode == "device-aware-weighted":
            idx, extra = pickers.device_aware_weighted(
                inflight, self._is_cpu[cands], self.config.router_accelerator_weight, rng
            )
            inputs["cpu"] = self._is_cpu[cands].astype(np.float64)
        else:  # pragma: no cover - RouterConfig validates modes
            raise ConfigError(f"unknown router mode {mode!r}")
        return idx, CandidateTrace(
            self._ep_worker, self._ep_rank, cands, "load", inflight, inputs, extra
        )

    def _profile_pick(
        self,
        profile: Any,
        req: RouteRequest,
        cands: np.ndarray,
        dev: Any,
        host: Any,
        disk: Any,
        shared: Any,
        prefill_tok: np.ndarray,
        decode_blk: np.ndarray,
        n_tokens: int,
        rules: _StageRules,
        penalised: np.ndarray | None,
        now: float,
        res: flt.FilterResult | None,
        active_depth: np.ndarray | None,
    ) -> tuple[int, CandidateTrace, Any]:
        bs = self.block_size
        full_blocks = -(-n_tokens // bs)
        cache: dict[str, np.ndarray] = {}

        def kv_cost() -> np.ndarray:
            if "c" not in cache:
                pv, dv = self._load_vectors(
                    rules, cands, dev, active_depth, prefill_tok, decode_blk, n_tokens
                )
                credited = dev
                if self.config.router_kv_overlap_score_credit_decay > 0 and rules.credit > 0:
                    credited = dev * self._credit_factor(prefill_tok[cands], n_tokens)
                cache["c"] = self._kv_costs(rules, pv, credited, host, disk, shared, dv)
            return cache["c"]

        ctx = ScoringContext(
            endpoints=cands,
            attrs=self.attrs,
            ep_worker=self._ep_worker,
            now=now,
            max_age=self.config.router_attribute_max_age,
            request_blocks=float(full_blocks),
            device=dev,
            host=host,
            disk=disk,
            shared_beyond=shared,
            inflight=self.load.inflight[cands],
            kv_cost=kv_cost,
        )
        total, parts = profile.score(ctx)
        if penalised is not None:
            total = np.where(penalised, total - self.config.router_missing_attribute_penalty, total)
        idx, probs = profile.pick(total, self._rng)
        if ctx.ages:
            if res is None:
                res = flt.FilterResult(cands)
            res.attribute_ages.extend(ctx.ages)
        trace = CandidateTrace(
            self._ep_worker,
            self._ep_rank,
            cands,
            "score",
            total,
            {
                "device": dev,
                "host": host,
                "disk": disk,
                "shared_beyond": shared,
                "inflight": self.load.inflight[cands].astype(np.float64),
            },
            {},
            probs,
            penalised,
            parts,
        )
        return idx, trace, res

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
        if self._approx is not None:
            s["approx"] = self._approx.stats()
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
        if n > len(self._ep_worker):
            pad = n - len(self._ep_worker)
            self._ep_worker = self._ep_worker + (None,) * pad
            self._ep_rank = self._ep_rank + (0,) * pad
            self._ep_state = self._ep_state + (None,) * pad

    def _set_endpoints(self, items: list[tuple[int, str | None, int, WorkerState | None]]) -> None:
        """Set many endpoints with one copy of the lookup tuples (a worker's DP ranks: linear
        in its dp_size, not quadratic)."""
        if not items:
            return
        self._ensure(max(ep for ep, *_ in items) + 1)
        w, r, s = list(self._ep_worker), list(self._ep_rank), list(self._ep_state)
        for ep, wid, rank, st in items:
            w[ep], r[ep], s[ep] = wid, rank, st
        self._ep_worker, self._ep_rank, self._ep_state = tuple(w), tuple(r), tuple(s)
        for ep, _wid, rank, st in items:
            self._fill_endpoint(ep, rank, st)

    def _fill_endpoint(self, ep: int, rank: int, st: WorkerState | None) -> None:
        self.ep_rank_arr[ep] = rank
        if st is not None:
            self.kv_capacity[ep] = st.worker.kv_capacity_blocks
            self.max_batched[ep] = st.worker.max_batched_tokens
            self._is_cpu[ep] = st.worker.is_cpu
            self.attrs.clear([ep])
            for name, a in st.attributes.items():  # a re-registered worker keeps its attributes
                self.attrs.set([ep], name, a.value, a.ts)
        else:
            self.kv_capacity[ep] = 0
            self.max_batched[ep] = 0
            self.attrs.clear([ep])

    def _refresh_limits(self) -> None:
        self.decode_limit, self.prefill_limit = flt.busy_limits(
            self._busy, self.kv_capacity, self.max_batched
        )

    def _base_candidates(self, stage: Stage) -> np.ndarray:
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
        self._base[stage] = arr
        self._base_static[stage] = tuple(static)
        self._base_is_range[stage] = bool(len(arr)) and int(arr[-1]) == len(arr) - 1
        return arr

    def _make_stage_rules(self) -> dict[Stage, _StageRules]:
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
            Stage.AGGREGATED: _StageRules(
                True,
                cfg.router_track_prefill_tokens,
                cfg.router_track_active_blocks,
                credit,
                cfg.router_assume_kv_reuse,
                params(credit),
                cfg.router_decode_resident_credit,
            ),
            # prefill stage: no decode-side load, full credit, reuse assumed
            Stage.PREFILL: _StageRules(
                True, cfg.router_track_prefill_tokens, False, 1.0, True, params(1.0)
            ),
            # decode stage: no prefill tokens, no credit, no reuse assumption
            Stage.DECODE: _StageRules(
                False, False, cfg.router_track_active_blocks, 0.0, False, params(0.0)
            ),
        }
        for r in rules.values():
            r.params_dict = self._params_dict(r.credit)
        return rules

    def _load_vectors(
        self,
        rules: _StageRules,
        sel: np.ndarray | slice,  # candidate endpoint ids, or a slice when they are 0..n-1
        dev: np.ndarray,  # per candidate: device-resident prefix blocks
        active_depth: np.ndarray | None,  # per candidate: leading blocks already active (dedup)
        prefill_tok: np.ndarray,
        decode_blk: np.ndarray,
        n_tokens: int,
    ) -> tuple[np.ndarray, np.ndarray]:
        """(prefill blocks, decode blocks) per candidate, the seed's load terms:
        prefill = active uncached prompt tokens / block size + the request's tokens / block size;
        decode = active blocks + the request's blocks, minus, when KV reuse is assumed, those of
        its chain already active on the endpoint (Dynamo's dedup by block hash) or, with the
        resident credit, already cached on its device (whichever prefix is longer)."""
        bs = self.block_size
        n = len(dev)
        # few numpy ops on purpose: each costs ~1 us at these sizes
        if rules.prefill_term and rules.track_prefill:
            prefill_vec = prefill_tok[sel] * (1.0 / bs)
            prefill_vec += n_tokens / bs
        elif rules.prefill_term:
            prefill_vec = np.full(n, n_tokens / bs)
        else:
            prefill_vec = np.zeros(n)
        if rules.track_decode:
            if not rules.assume_reuse:
                decode_vec = decode_blk[sel] + 0.0
            elif rules.resident_credit:  # cached or in flight: either way no new KV memory
                shared = dev if active_depth is None else np.maximum(active_depth, dev)
                decode_vec = decode_blk[sel] - shared
            elif active_depth is not None:
                decode_vec = decode_blk[sel] - active_depth
            else:
                decode_vec = decode_blk[sel] + 0.0
            decode_vec += -(-n_tokens // bs)
            weight = self.config.router_decode_active_request_weight
            if weight > 0:
                decode_vec += weight * self.load.inflight[sel]
        else:
            decode_vec = np.zeros(n)
        return prefill_vec, decode_vec

    def _kv_costs(
        self,
        rules: _StageRules,
        prefill_vec: np.ndarray,
        credited: np.ndarray,
        host: np.ndarray,
        disk: np.ndarray,
        shared: np.ndarray,
        decode_vec: np.ndarray,
    ) -> np.ndarray:
        """The cost per candidate under --router-selection-policy: linear (the seed's
        ``scale*adjusted_prefill + decode``, one core call) or lmetric
        (``scale*adjusted_prefill * (decode + 1)``: the core's cost with no decode term is
        exactly the scaled adjusted prefill)."""
        if self._lmetric:
            zeros = np.zeros(len(decode_vec))
            prefill_cost = np.asarray(
                self._core.costs(prefill_vec, credited, host, disk, shared, zeros, rules.params),
                dtype=np.float64,
            )
            return prefill_cost * (decode_vec + 1.0)
        return np.asarray(
            self._core.costs(prefill_vec, credited, host, disk, shared, decode_vec, rules.params),
            dtype=np.float64,
        )

    def _credit_factor(self, prefill_tokens: np.ndarray, n_tokens: int) -> np.ndarray:
        """Dynamo's credit decay: 1/(1 + decay * excess), excess = active prefill tokens over
        the least-loaded candidate's, in units of this request's size."""
        excess = (prefill_tokens - prefill_tokens.min()) / max(n_tokens, 1)
        return 1.0 / (1.0 + self.config.router_kv_overlap_score_credit_decay * excess)

    def _select(self, values: np.ndarray, temperature: float, u: float) -> int:
        return self._core.select(values.tolist() if self._as_seq else values, temperature, u)

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
