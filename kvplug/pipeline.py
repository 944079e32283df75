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

_NO_LOAD = np.zeros(0)


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


class StageBase:
    """A stage's routable endpoints (draining and wrong-role workers left out, their
    exclusions precomputed) and its rules; cached by the router until workers change."""

    __slots__ = ("cands", "static_excluded", "is_range", "rules")

    def __init__(
        self,
        cands: np.ndarray,
        static_excluded: tuple[Exclusion, ...],
        is_range: bool,  # cands are exactly 0..n-1
        rules: StageRules,
    ) -> None:
        self.cands = cands
        self.static_excluded = static_excluded
        self.is_range = is_range
        self.rules = rules


class RouteContext:
    """One request on its way through the stages. Fields are grouped by the stage that sets
    them; a later stage only reads what an earlier one wrote. Vectors are per candidate
    (aligned with ``cands``) unless named otherwise."""

    __slots__ = (
        # candidates
        "req",
        "stage",
        "hints",
        "now",
        "n_tokens",
        "block_size",
        "full_blocks",
        "rules",
        "cands",
        "sel",
        "static_excluded",
        # filters
        "report",
        "penalised",
        "prefill_tokens",
        "decode_blocks",
        # overlap
        "hashes",
        "device",
        "host",
        "disk",
        "shared",
        # load
        "chain",
        "active_depth",
        # score, pick
        "trace",
        "chosen",
        # book
        "cached_blocks",
        "decision_id",
    )

    def __init__(
        self, req: RouteRequest, now: float, n_tokens: int, block_size: int, base: StageBase
    ) -> None:
        self.req = req
        self.stage: Stage = req.stage
        self.hints: RoutingHints = req.hints
        self.now = now
        self.n_tokens = n_tokens
        self.block_size = block_size
        self.full_blocks = -(-n_tokens // block_size)  # a trailing partial block counts
        self.rules = base.rules
        # candidate endpoint ids; ``sel`` gathers per-endpoint arrays for them: a slice while
        # they are exactly 0..n-1 (a view, cheaper than fancy indexing), else ``cands``
        self.cands = cands = base.cands
        self.sel: slice | np.ndarray = slice(0, len(cands)) if base.is_range else cands
        self.static_excluded = base.static_excluded
        self.report: FilterResult | None = None  # None: no filter ran (the common case)
        self.penalised: np.ndarray | None = None  # missing attribute under "penalise"
        # active load per endpoint id (not per candidate), read once at ``now``
        self.prefill_tokens: np.ndarray = _NO_LOAD
        self.decode_blocks: np.ndarray = _NO_LOAD
        self.hashes: np.ndarray | None = None
        self.device: np.ndarray | None = None  # None: the index was not queried
        self.host: np.ndarray | None = None
        self.disk: np.ndarray | None = None
        self.shared: np.ndarray | None = None  # shared-tier blocks beyond the local prefix
        self.trace: CandidateTrace | None = None
        self.chosen = -1  # index into cands
        self.chain: tuple[np.ndarray, Any] | None = None  # (hashes, ActiveBlocks walk)
        self.active_depth: np.ndarray | None = None  # leading blocks already active (owned)
        self.cached_blocks = 0  # of the pick, in any local tier
        self.decision_id = 0


__all__ = ["RouteContext", "StageBase", "StageRules"]
