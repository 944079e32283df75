"""Shared helpers for the router tests (no tests here)."""

from __future__ import annotations

import inspect
import random

import numpy as np
import pytest

from kvplug.config import RouterConfig
from kvplug.events import BlockStored, Tier
from kvplug.router import Router
from kvplug.workers import Worker

BS = 16

# Index-dependent tests run on both core backends when KvIndex can pin one per instance.
try:
    from kvplug.index import KvIndex

    _PINNABLE = "backend" in inspect.signature(KvIndex.__init__).parameters
except ImportError:  # pragma: no cover
    KvIndex = None  # type: ignore[assignment]
    _PINNABLE = False
BACKENDS = ["c", "reference"] if _PINNABLE else [None]
_current = {"backend": None}


@pytest.fixture(params=BACKENDS, autouse=False)
def core_backend(request):
    """Use in a module with ``pytestmark = pytest.mark.usefixtures("core_backend")``."""
    if request.param == "c":
        from kvplug import core

        if core.backend != "c":
            pytest.skip("compiled core not active (KVPLUG_CORE=reference)")
    _current["backend"] = request.param
    yield request.param
    _current["backend"] = None


def current_backend() -> str | None:
    return _current["backend"]


class FakeClock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt


def make_router(workers=("w1", "w2", "w3"), seed=0, clock=None, profile=None, **cfg) -> Router:
    cfg.setdefault("kv_block_size", BS)
    # these tests pin down kv's cost (Dynamo's formula) and build other modes on it; the
    # default mode (affinity) is kv plus a pick stage, tested by name where it is meant
    cfg.setdefault("router_mode", "kv")
    index = None
    if _current["backend"] is not None:
        index = KvIndex(cfg["kv_block_size"], backend=_current["backend"])
    r = Router(
        RouterConfig(**cfg),
        clock=clock or FakeClock(),
        rng=random.Random(seed),
        profile=profile,
        index=index,
    )
    for w in workers:
        r.add_worker(w if isinstance(w, Worker) else Worker(w))
    return r


def tokens(n_blocks: int, start: int = 0) -> list[int]:
    return list(range(start, start + n_blocks * BS))


def store_prefix(
    r: Router,
    worker: str,
    toks,
    n_blocks: int,
    *,
    dp_rank: int = 0,
    tier: Tier = Tier.DEVICE,
    shared: bool = False,
    engine_base: int = 0,
) -> None:
    """Index the first n_blocks of toks on a worker, through a real BlockStored event."""
    h = np.asarray(r.index.request_hashes(np.asarray(toks, dtype=np.uint32)), dtype=np.uint64)
    r.apply_event(
        BlockStored(
            worker_id=worker,
            dp_rank=dp_rank,
            tier=tier,
            shared=shared,
            engine_hashes=[engine_base + i for i in range(n_blocks)],
            block_hashes=[int(x) for x in h[:n_blocks]],
        )
    )
