"""What a caller asks the router: one request (or one stage of a disaggregated request)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from kvplug.workers import Stage


@dataclass(frozen=True)
class RoutingHints:
    """Constraints a caller puts on where one request may go: an allow-list, a pinned
    worker and DP rank, a label selector, required taints; ``expected_osl`` (expected output
    tokens) only informs the load estimate."""

    allowed_worker_ids: frozenset[str] | None = None  # None = any
    pinned_worker_id: str | None = None
    pinned_dp_rank: int | None = None
    expected_osl: int | None = None  # nvext.agent_hints.osl
    labels: dict[str, str] = field(default_factory=dict)  # label selector: all must match
    required_taints: frozenset[str] = frozenset()  # worker must carry every one

    def is_empty(self) -> bool:
        """No constraint on where the request may go (expected_osl is not a constraint)."""
        return self is NO_HINTS or (
            self.allowed_worker_ids is None
            and self.pinned_worker_id is None
            and self.pinned_dp_rank is None
            and not self.labels
            and not self.required_taints
        )


NO_HINTS = RoutingHints()


@dataclass
class RouteRequest:
    """One request (or one stage of a disaggregated request) to route.

    ``token_ids`` (a numpy uint32 array is fastest) or ``block_hashes`` (precomputed by the
    caller; skips hashing); ``lora_name`` and ``cache_salt`` select the hash namespace, as the
    engines do. ``exclude_workers`` leaves workers out (a retry after a failure, unhealthy
    workers), ``exclusion_reasons`` says why, per worker, in the decision's trace."""

    request_id: str
    token_ids: Sequence[int] | np.ndarray
    block_hashes: np.ndarray | None = None  # precomputed (sim): skips hashing
    lora_name: str | None = None
    cache_salt: str | None = None
    stage: Stage = Stage.AGGREGATED
    hints: RoutingHints = NO_HINTS
    exclude_workers: frozenset[str] = frozenset()  # e.g. retry after a failed worker
    # why a worker of exclude_workers is excluded (the decision trace says so); a worker not
    # named here is "excluded by the caller (retry)"
    exclusion_reasons: Mapping[str, str] = field(default_factory=dict)
