"""A simulated engine's KV events as the real-engine comparisons read them."""

from __future__ import annotations

from kvplug.events import BlockRemoved, BlockStored
from kvplug.sim.engine import SimEngine


def step_changes(engine: SimEngine, names: dict[int, str]) -> list[str]:
    """Each step's stored (+) and removed (-) blocks, named by ``names`` (engine hash -> name),
    one string per step that changed any, in the order the step reported them: what a vLLM
    engine publishes as one batch per step."""
    by_step: dict[float, list[str]] = {}
    for kind, t, ev in engine.outputs:
        if kind == "kv" and isinstance(ev, (BlockStored, BlockRemoved)):
            sign = "+" if isinstance(ev, BlockStored) else "-"
            by_step.setdefault(t, []).extend(sign + names[h] for h in ev.engine_hashes)
    return [" ".join(c) for _t, c in sorted(by_step.items())]
