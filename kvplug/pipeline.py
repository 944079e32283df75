"""What the routing stages know about one request, and the per-stage load rules.

``Router._route`` runs eight named stages top to bottom; each fills in its part of one
:class:`RouteContext`, and the last stage (explain) assembles the :class:`~kvplug.Decision`
from what the others reported:

=========== ======================================================= ==========================
stage       does                                                    reports (RouteContext)
=========== ======================================================= ==========================
candidates  prompt size check; the stage's routable endpoints       ``cands``, ``static_excluded``
filters     hard filters, busy, labels, the policy's filters,       ``cands``, ``report``
            attribute thresholds                                    (exclusions, fallbacks,
                                                                    ages), ``penalised``
overlap     index query (+ approximate side index)                  ``hashes``, ``device``,
                                                                    ``host``, ``disk``,
                                                                    ``shared``
load        prompt blocks already active per candidate (dedup)      ``chain``, ``active_depth``
score       the policy's cost, score or load per candidate          ``trace``
pick        the policy's choice                                     ``chosen``, trace's
                                                                    probabilities
book        load tracking, approximate-mode record, decision id     ``cached_blocks``,
                                                                    ``decision_id``
explain     the Decision                                            --
=========== ======================================================= ==========================

Internal: import the public names from ``kvplug`` (docs/api.md).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvplug.decision import CandidateTrace, Exclusion
from kvplug.filters import FilterResult
from kvplug.request import RouteRequest, RoutingHints
from kvplug.workers import Stage


class StageRules:
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
        "default_terms",
    )

    def __init__(
        self,
        prefill_term: bool,  # the incoming prompt counts as prefill blocks
        track_prefill: bool,  # active prompt-side load is tracked and counted
        track_decode: bool,
        credit: float,
        assume_reuse: bool,
        params: Any,  # the core's CostParams
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
        # the seed cost's default terms (kv_cost's one compiled call), settled once per stage
        self.default_terms = (
            prefill_term and track_prefill and track_decode and assume_reuse and resident_credit
        )


class StageBase:
    """A stage's routable endpoints (draining and wrong-role workers left out, their
    exclusions precomputed) and its rules; cached by the router until workers change."""

    __slots__ = ("cands", "sel", "static_excluded", "rules")

    def __init__(
        self,
        cands: np.ndarray,
        static_excluded: tuple[Exclusion, ...],
        is_range: bool,  # cands are exactly 0..n-1
        rules: StageRules,
    ) -> None:
        self.cands = cands
        # how per-endpoint arrays are gathered for them: a slice when they are 0..n-1 (a view,
        # cheaper than fancy indexing)
        self.sel: slice | np.ndarray = slice(0, len(cands)) if is_range else cands
        self.static_excluded = static_excluded
        self.rules = rules


class RouteContext:
    """One request on its way through the stages. Fields are grouped by the stage that sets
    them; a later stage only reads what an earlier one wrote. Vectors are per candidate
    (aligned with ``cands``) unless named otherwise. A field a stage did not set keeps its
    class default (no __slots__ on purpose: one context per decision, built cheaply)."""

    # candidates (set by __init__)
    req: RouteRequest
    stage: Stage
    hints: RoutingHints
    now: float
    n_tokens: int
    full_blocks: int  # blocks of the prompt, a trailing partial block included
    rules: StageRules
    cands: np.ndarray  # candidate endpoint ids (the filters narrow them)
    sel: slice | np.ndarray  # gathers per-endpoint arrays for cands
    static_excluded: tuple[Exclusion, ...]  # draining / wrong role (shared, precomputed)
    prefill_tokens: np.ndarray  # active load per endpoint id (not per candidate) at ``now``
    decode_blocks: np.ndarray
    # filters
    report: FilterResult | None = None  # None: no filter ran (the common case)
    penalised: np.ndarray | None = None  # missing attribute under "penalise"
    # overlap (None: the index was not queried)
    hashes: np.ndarray | None = None
    device: np.ndarray | None = None
    host: np.ndarray | None = None
    disk: np.ndarray | None = None
    shared: np.ndarray | None = None  # shared-tier blocks beyond the local prefix
    # load
    chain: tuple[np.ndarray, Any] | None = None  # (hashes, ActiveBlocks walk)
    active_depth: np.ndarray | None = None  # leading blocks already active (owned)
    # score, pick
    booking: bool = True  # False for Router.preview: a policy must not remember the decision
    trace: CandidateTrace | None = None
    chosen: int = -1  # index into cands
    # book
    cached_blocks: int = 0  # of the pick, in any local tier
    cached_tokens: int = 0
    decision_id: int = 0

    def __init__(
        self,
        req: RouteRequest,
        now: float,
        n_tokens: int,
        block_size: int,
        base: StageBase,
        prefill_tokens: np.ndarray,
        decode_blocks: np.ndarray,
    ) -> None:
        self.req = req
        self.stage = req.stage
        self.hints = req.hints
        self.now = now
        self.n_tokens = n_tokens
        self.full_blocks = -(-n_tokens // block_size)
        self.rules = base.rules
        self.cands = base.cands
        self.sel = base.sel
        self.static_excluded = base.static_excluded
        self.prefill_tokens = prefill_tokens
        self.decode_blocks = decode_blocks


__all__ = ["RouteContext", "StageBase", "StageRules"]
