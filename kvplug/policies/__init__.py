"""Routing policies (``--router-mode``): each mode is one object behind one interface.

A policy scores the candidates the filters left (a cost, a score or a load per candidate)
and picks one. The built-in ones live one family per file here; a new policy is a new file
with a :class:`RoutingPolicy` subclass decorated with :func:`register_policy`, imported
before the router is built (docs/api.md shows one).
"""

from kvplug.policies.base import (
    PolicyFilters,
    RoutingPolicy,
    policy_class,
    policy_names,
    register_policy,
)

# the built-in policies register themselves on import, the seed's cost first
# isort: off
from kvplug.policies import kv_cost, affinity, scheduling_profile, by_load  # noqa: E402, F401
# isort: on

__all__ = ["PolicyFilters", "RoutingPolicy", "policy_class", "policy_names", "register_policy"]
