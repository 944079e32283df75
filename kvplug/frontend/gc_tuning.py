"""The garbage collector's settings for a serving process.

Each proxied request allocates a few hundred container objects (aiohttp's request, response,
headers and payload objects, kvplug's context, decision record and lifecycle), and CPython's
default first-generation threshold (700 allocations) runs a collection every couple of
requests. Measured with ``benchmarks/bench_frontend.py``'s engines and wrk at 16 connections
(docs/frontend.md, "Where the time goes"), a 10,000 threshold cuts kvplug serve's CPU per request
by ~12 %. Cyclic garbage is still collected: young cycles at the next first- or second-generation
pass, old ones by the full pass, which CPython runs only once the survivors since the last one
reach a quarter of the long-lived heap - so memory stays bounded by the live heap, as before.
``gc.freeze()`` once startup is done moves the modules, the app and the router's tables out of
every later pass.
"""

from __future__ import annotations

import gc

# (generation 0 allocations, generation 1 passes per generation-1 pass, per generation-2 pass)
SERVING_THRESHOLDS = (10_000, 10, 10)


def tune_for_serving() -> tuple[int, int, int]:
    """Freeze what startup built and raise the collection thresholds; returns the previous
    thresholds."""
    previous = gc.get_threshold()
    gc.collect()  # startup's garbage goes now, not frozen forever
    gc.freeze()
    gc.set_threshold(*SERVING_THRESHOLDS)
    return previous
