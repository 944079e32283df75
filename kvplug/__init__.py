"""kvplug: a KV-cache-aware router for LLM serving with a C hot path.

The names below are kvplug's public API: import them from here (``from kvplug import Router``).
Every submodule (``kvplug.router``, ``kvplug.filters``, ...) is an implementation detail that
may change between releases; docs/api.md shows how another server embeds the router.

* :class:`Router` routes one :class:`RouteRequest` to a worker and returns a
  :class:`Decision` (the pick, every candidate's score, and why the others were excluded).
* :class:`RouterConfig` holds its settings (Dynamo's flag names); :func:`add_router_arguments`
  adds the same flags to an ``argparse`` parser.
* :class:`Worker` describes one engine (role, DP ranks, capacity, labels).
* The KV events (:class:`BlockStored`, :class:`BlockRemoved`, :class:`BlockMoved`,
  :class:`AllCleared`) feed the :class:`KvIndex` through :meth:`Router.apply_event`.
* :class:`RoutingPolicy` and :func:`register_policy` add a routing mode by name; a policy
  reads one request's :class:`RouteContext`.
* ``backend`` names the active core ("c" or "reference"); see :mod:`kvplug.core`.

Importing kvplug stays light: no networking modules (aiohttp, zmq) are imported here.
"""

from kvplug.config import AttributeThreshold, RouterConfig, add_router_arguments
from kvplug.core import backend
from kvplug.decision import CandidateTrace, Decision, Exclusion
from kvplug.errors import (
    AllWorkersOverloaded,
    ConfigError,
    InvalidArgument,
    InvalidEvent,
    InvalidRequest,
    InvalidTokens,
    KvplugError,
    NoCompatibleWorker,
    PinnedWorkerOverloaded,
    RoutingError,
    UnknownWorker,
)
from kvplug.events import AllCleared, BlockMoved, BlockRemoved, BlockStored, KvEvent, Tier
from kvplug.index import KvIndex, Overlaps
from kvplug.pipeline import RouteContext
from kvplug.policies import RoutingPolicy, register_policy
from kvplug.request import RouteRequest, RoutingHints
from kvplug.router import Router
from kvplug.workers import Role, Stage, Worker

__version__ = "0.1.0"

__all__ = [
    "AllCleared",
    "AllWorkersOverloaded",
    "AttributeThreshold",
    "BlockMoved",
    "BlockRemoved",
    "BlockStored",
    "CandidateTrace",
    "ConfigError",
    "Decision",
    "Exclusion",
    "InvalidArgument",
    "InvalidEvent",
    "InvalidRequest",
    "InvalidTokens",
    "KvEvent",
    "KvIndex",
    "KvplugError",
    "NoCompatibleWorker",
    "Overlaps",
    "PinnedWorkerOverloaded",
    "Role",
    "RouteContext",
    "RouteRequest",
    "Router",
    "RouterConfig",
    "RoutingError",
    "RoutingHints",
    "RoutingPolicy",
    "Stage",
    "Tier",
    "UnknownWorker",
    "Worker",
    "__version__",
    "add_router_arguments",
    "backend",
    "register_policy",
]
