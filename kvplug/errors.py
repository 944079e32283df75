"""kvplug's exceptions. Each also inherits the matching builtin, so callers may catch either.

Messages say *where*: which worker, which DP rank, which block position, which event sequence.
"""

from __future__ import annotations


class KvplugError(Exception):
    """Base class of every kvplug error."""


class ConfigError(KvplugError, ValueError):
    """A flag, config file or scheduling profile is invalid."""


class InvalidTokens(KvplugError, ValueError):
    """Token ids that cannot be hashed (out of range, wrong type, too many)."""


class InvalidArgument(KvplugError, ValueError):
    """A core call with a bad argument (endpoint id, tier, block size, mismatched lengths)."""


class InvalidEvent(KvplugError, ValueError):
    """A KV event that cannot be applied (malformed, inconsistent lengths, bad tier)."""


class UnknownWorker(KvplugError, KeyError):
    """A worker id (or worker, DP rank) the router does not know."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else "unknown worker"


class InvalidRequest(KvplugError, ValueError):
    """A routing request that cannot be served as asked (bad hints, oversized prompt)."""


class RoutingError(KvplugError, RuntimeError):
    """No worker could be chosen. Subclasses keep the class of the failure."""


class NoCompatibleWorker(RoutingError):
    """The hard filters (allow-list, pin, DP bounds, taints, labels) left no candidate."""


class AllWorkersOverloaded(RoutingError):
    """Every eligible worker is over a busy threshold."""


class PinnedWorkerOverloaded(RoutingError):
    """The request pinned a worker that is over a busy threshold; it is not rerouted."""
