"""Active load per endpoint, from the request lifecycle (the routing seed's load model).

* prefill tokens: uncached prompt tokens of requests routed to the endpoint that have not
  produced their first token yet (released by ``first_token``);
* decode blocks: blocks of the endpoint's active requests (released by ``finish``); with KV reuse
  assumed, the prompt blocks are counted once per distinct block hash on the endpoint
  (:mod:`kvplug.active_blocks`), so requests sharing a prefix share its blocks; plus, with
  output tracking, one placeholder block per block boundary generation crosses, weighted by
  ``1 - progress`` toward the expected output length when one is given (full weight otherwise);
* in-flight: active request count (least-loaded, device-aware, power-of-two, running scorer);
* context tokens: prompt plus output tokens of the endpoint's active requests, and its requests
  still in prefill in routing order (the affinity policy's predictions read both: kept here so a
  decision reads its endpoints, not every request in flight);
* prefill-duration model (optional): the oldest active prefill on each endpoint decays linearly
  over its predicted duration, counted from when it became the oldest.

Everything is a dense numpy vector indexed by endpoint id so a decision gathers it in one step.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from kvplug.active_blocks import ActiveBlocks, Walk, _Node
from kvplug.prefill_model import PrefillPredictor


@dataclass(slots=True)
class ActiveRequest:
    request_id: str
    endpoint: int
    prompt_tokens: int
    prefill_tokens: int  # uncached tokens counted as prefill load (0 if not tracked)
    decode_blocks: float  # prompt-side blocks counted as decode load (0 if not tracked);
    # with a deduplicated chain: only the blocks outside it (the trailing partial block)
    expected_osl: int | None
    track_output: bool
    routed_at: float
    prefill_duration: float = 0.0  # predicted seconds (prefill model on)
    prefill_done: bool = False
    output_tokens: int = 0
    output_contrib: float = 0.0  # weighted placeholder blocks currently counted
    chain: _Node | None = None  # tail of its deduplicated prompt chain (ActiveBlocks)
    deduplicated: bool = False
    # the affinity policy's (chunk tokens, predicted prefill seconds, steps, prefill model) of
    # its prefill, kept so that every decision while it waits does not compute it again
    prefill_estimate: tuple[float, float, float, tuple[float, float, float]] | None = None
    # no other request of this router's was in prefill on its endpoint when it was added: its
    # first token then times its own prefill (kvplug.prefill_fit learns from those)
    alone: bool = False
    # this router's other requests in flight on its endpoint when it was added: an engine run
    # with vLLM's --long-prefill-token-threshold caps its prefill's share of a step when any
    # are (the affinity policy's fit then learns it at the capped chunk, as it predicts it)
    others_inflight: int = 0


class LoadListener(Protocol):
    """Hears this router's own request lifecycle (router replicas share it: kvplug.replica_sync).
    Requests folded in from other replicas are applied with ``notify=False`` and not heard."""

    def added(self, request: ActiveRequest) -> None: ...
    def first_token(self, request_id: str) -> None: ...
    def finished(self, request_id: str) -> None: ...


class LoadTracker:
    def __init__(
        self,
        block_size: int,
        predictor: PrefillPredictor | None = None,
        active: ActiveBlocks | None = None,
    ) -> None:
        self.listener: LoadListener | None = None
        self.block_size = block_size
        self.predictor = predictor
        self._cap = 0
        self.prefill_tokens = np.zeros(0)
        self.decode_blocks = np.zeros(0)
        self.inflight = np.zeros(0, dtype=np.int64)
        self.context_tokens = np.zeros(0, dtype=np.int64)
        # per endpoint, its requests without a first token yet, in the order they were added
        self.prefilling: dict[int, dict[str, ActiveRequest]] = {}
        # per endpoint, a number that changes whenever its ``prefilling`` does (readers that
        # summarise an endpoint's prefills keep the summary until it changes; an array, so a
        # reader finds the changed ones among many endpoints in one comparison)
        self.prefilling_versions = np.zeros(0, dtype=np.int64)
        self._prefilling_changes = 0
        # prefill-duration model: per endpoint, the queue of pending prefills (oldest first)
        self.head_tokens = np.zeros(0)
        self.head_start = np.zeros(0)
        self.head_duration = np.ones(0)
        self._pending: dict[int, deque[str]] = {}
        self.requests: dict[str, ActiveRequest] = {}
        # deduplicated prompt blocks (--router-assume-kv-reuse); the router passes the compiled
        # twin (kvplug._core.ActiveBlocks) when its core is compiled
        self.active = active if active is not None else ActiveBlocks()
        self.counters = {"unknown_request_updates": 0, "duplicate_request_ids": 0}

    # ------------------------------------------------------------------ sizing
    def ensure(self, n_endpoints: int) -> None:
        if n_endpoints <= self._cap:
            return
        cap = max(n_endpoints, 2 * self._cap, 16)

        def grow(a: np.ndarray, fill: float = 0.0) -> np.ndarray:
            out = np.full(cap, fill, dtype=a.dtype)
            out[: len(a)] = a
            return out

        self.prefill_tokens = grow(self.prefill_tokens)
        self.decode_blocks = grow(self.decode_blocks)
        self.inflight = grow(self.inflight)
        self.context_tokens = grow(self.context_tokens)
        self.prefilling_versions = grow(self.prefilling_versions)
        self.head_tokens = grow(self.head_tokens)
        self.head_start = grow(self.head_start)
        self.head_duration = grow(self.head_duration, 1.0)
        self._cap = cap

    # ------------------------------------------------------------------ views
    def prefill_tokens_at(self, now: float) -> np.ndarray:
        """Active prefill tokens per endpoint, with the head-of-line decay when modelled."""
        if self.predictor is None:
            return self.prefill_tokens
        frac = np.clip((now - self.head_start) / self.head_duration, 0.0, 1.0)
        return np.maximum(self.prefill_tokens - self.head_tokens * frac, 0.0)

    def active_count(self) -> int:
        return len(self.requests)

    # ------------------------------------------------------------------ lifecycle
    def add(
        self,
        request_id: str,
        endpoint: int,
        prompt_tokens: int,
        cached_tokens: int,
        *,
        track_prefill: bool,
        track_decode: bool,
        decode_blocks: float,
        expected_osl: int | None,
        track_output: bool,
        now: float,
        chain: tuple[np.ndarray, Walk] | None = None,
        notify: bool = True,
    ) -> ActiveRequest:
        """Start tracking a request. ``chain`` = (its block hashes, their ``ActiveBlocks.walk``)
        deduplicates its prompt blocks by hash on the endpoint: ``decode_blocks`` then counts
        only the blocks outside the hashed chain (a trailing partial block)."""
        if request_id in self.requests:
            # a retry with the same id: the old attempt's load goes, the new one counts
            self.counters["duplicate_request_ids"] += 1
            self.finish(request_id)
            if chain is not None:  # releasing the old attempt may have reshaped the trie
                chain = (chain[0], self.active.walk(chain[0]))
        uncached = max(prompt_tokens - cached_tokens, 0) if track_prefill else 0
        r = ActiveRequest(
            request_id,
            endpoint,
            prompt_tokens,
            uncached,
            decode_blocks if track_decode else 0.0,
            expected_osl,
            track_output and track_decode,
            now,
        )
        # per-endpoint updates as ``a[ep] = a.item(ep) + x``: the same double (or int64)
        # arithmetic as ``a[ep] += x`` without numpy scalars (~40 ns each, every request)
        blocks = self.decode_blocks
        if chain is not None and track_decode:
            r.chain, new = self.active.add(endpoint, chain[0], chain[1])
            r.deduplicated = True
            blocks[endpoint] = blocks.item(endpoint) + new
        self.requests[request_id] = r
        r.others_inflight = self.inflight.item(endpoint)
        self.inflight[endpoint] = r.others_inflight + 1
        self.context_tokens[endpoint] = self.context_tokens.item(endpoint) + prompt_tokens
        blocks[endpoint] = blocks.item(endpoint) + r.decode_blocks
        if uncached > 0:
            self.prefill_tokens[endpoint] = self.prefill_tokens.item(endpoint) + uncached
            queued = self.prefilling.setdefault(endpoint, {})
            r.alone = not queued
            queued[request_id] = r
            self._prefilling_changed(endpoint)
            if self.predictor is not None:
                r.prefill_duration = max(
                    float(self.predictor.predict(uncached, cached_tokens)), 1e-6
                )
                q = self._pending.setdefault(endpoint, deque())
                q.append(request_id)
                if len(q) == 1:
                    self._set_head(endpoint, r, now)
        else:
            r.prefill_done = True
        if notify and self.listener is not None:
            self.listener.added(r)
        return r

    def first_token(self, request_id: str, now: float, notify: bool = True) -> bool:
        r = self.requests.get(request_id)
        if r is None:
            self.counters["unknown_request_updates"] += 1
            return False
        if notify and self.listener is not None and not r.prefill_done:
            self.listener.first_token(request_id)
        self._release_prefill(r, now)
        return True

    def output_progress(self, request_id: str, output_tokens: int, now: float) -> bool:
        r = self.requests.get(request_id)
        if r is None:
            self.counters["unknown_request_updates"] += 1
            return False
        if not r.prefill_done:  # output implies the first token came
            self._release_prefill(r, now)
        grown = int(output_tokens) - r.output_tokens
        if grown > 0:
            r.output_tokens += grown
            ep = r.endpoint
            self.context_tokens[ep] = self.context_tokens.item(ep) + grown
        if not r.track_output:
            return True
        bs = self.block_size
        crossed = (r.prompt_tokens + r.output_tokens) // bs - r.prompt_tokens // bs
        if r.expected_osl:
            weight = max(0.0, 1.0 - r.output_tokens / r.expected_osl)
        else:
            weight = 1.0
        new = crossed * weight
        self.decode_blocks[r.endpoint] += new - r.output_contrib
        r.output_contrib = new
        return True

    def finish(self, request_id: str, now: float = 0.0, notify: bool = True) -> bool:
        r = self.requests.pop(request_id, None)
        if r is None:
            self.counters["unknown_request_updates"] += 1
            return False
        if notify and self.listener is not None:
            self.listener.finished(request_id)
        self._release_prefill(r, now)
        ep = r.endpoint
        blocks = self.decode_blocks  # updated as in ``add``
        if r.deduplicated:
            blocks[ep] = blocks.item(ep) - self.active.release(ep, r.chain)
        blocks[ep] = blocks.item(ep) - (r.decode_blocks + r.output_contrib)
        inflight = self.inflight.item(ep) - 1
        self.inflight[ep] = inflight
        self.context_tokens[ep] = self.context_tokens.item(ep) - (r.prompt_tokens + r.output_tokens)
        if inflight == 0:  # no float drift survives an idle endpoint
            blocks[ep] = 0.0
            self.prefill_tokens[ep] = 0.0
        return True

    def drop_endpoint(self, endpoint: int) -> list[str]:
        """Forget every request on a removed endpoint; returns their ids."""
        ids = [rid for rid, r in self.requests.items() if r.endpoint == endpoint]
        for rid in ids:
            self.finish(rid)
        self._pending.pop(endpoint, None)
        if endpoint < self._cap:
            self.prefill_tokens[endpoint] = 0.0
            self.decode_blocks[endpoint] = 0.0
            self.inflight[endpoint] = 0
            self.context_tokens[endpoint] = 0
            self.head_tokens[endpoint] = 0.0
        self.prefilling.pop(endpoint, None)
        self._prefilling_changed(endpoint)
        return ids

    # ------------------------------------------------------------------ internals
    def _prefilling_changed(self, ep: int) -> None:
        self._prefilling_changes += 1
        if ep < self._cap:
            self.prefilling_versions[ep] = self._prefilling_changes

    def _set_head(self, ep: int, r: ActiveRequest, now: float) -> None:
        self.head_tokens[ep] = r.prefill_tokens
        self.head_start[ep] = now
        self.head_duration[ep] = r.prefill_duration

    def _release_prefill(self, r: ActiveRequest, now: float) -> None:
        if r.prefill_done:
            return
        r.prefill_done = True
        ep = r.endpoint
        prefilling = self.prefilling.get(ep)
        if prefilling is not None and prefilling.pop(r.request_id, None) is not None:
            self._prefilling_changed(ep)
            if not prefilling:
                del self.prefilling[ep]
        left = self.prefill_tokens.item(ep) - r.prefill_tokens  # as in ``add``
        self.prefill_tokens[ep] = 0.0 if left < 1e-9 else left
        if self.predictor is None:
            return
        q = self._pending.get(ep)
        if not q:
            return
        was_head = q[0] == r.request_id
        try:
            q.remove(r.request_id)
        except ValueError:
            return
        if was_head:
            if q:
                self._set_head(ep, self.requests[q[0]], now)
            else:
                self.head_tokens[ep] = 0.0
