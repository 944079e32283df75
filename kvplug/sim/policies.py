"""Routing policies for the replay, written ``NAME[:key=value,...]`` on the command line.

``NAME`` is ``kv``, ``affinity``, ``affinity-rescue``, ``affinity-soonest``, ``affinity-protect``,
``affinity-balance`` or ``affinity-fitted`` (:mod:`kvplug.affinity`, the last five named settings
of it), ``lmetric`` (kv mode with ``--router-selection-policy lmetric``), ``approx``
(kv mode without engine events: the router records what it routed, with a TTL), ``profile``
(an llm-d-style scheduling profile; default: the bundled ``data/profile_llmd.yaml``, or
``profile:router_profile=FILE``), a simple mode
(``round-robin``, ``random``, ``least-loaded``, ``power-of-two``), or another router's policy
re-implemented in :mod:`kvplug.sim.baselines` (``sglang-cache-aware``, ``smg-cache-aware``,
``vllm-kv-aware``; keys are their own settings, e.g. ``sglang-cache-aware:cache_threshold=0.5``).
Keys are :class:`kvplug.config.RouterConfig` fields or the short aliases below, e.g.
``kv:credit=0.5,temperature=0.1``.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from importlib import resources
from pathlib import Path
from typing import Any

from kvplug.affinity import AFFINITY_KEYS, AFFINITY_PRESETS

ALIASES = {
    "credit": "router_kv_overlap_score_credit",
    "credit_decay": "router_kv_overlap_score_credit_decay",
    "temperature": "router_temperature",
    "temp": "router_temperature",
    "prefill_scale": "router_prefill_load_scale",
    "host_weight": "router_host_cache_hit_weight",
    "disk_weight": "router_disk_cache_hit_weight",
    "track_output": "router_track_output_blocks",
    "prefill_model": "router_prefill_load_model",
    "ttl": "router_ttl_secs",
    "assume_reuse": "router_assume_kv_reuse",
    "resident_credit": "router_decode_resident_credit",
    "selection": "router_selection_policy",
}
SIMPLE_MODES = ("round-robin", "random", "least-loaded", "power-of-two")
NAMES = ("kv", "lmetric", "approx", "profile", *SIMPLE_MODES)  # what NAME may be
DEFAULT_POLICIES = (
    "affinity-fitted",  # kvplug serve's default routing
    "affinity-balance",  # the default before issue 14's twenty-fourth pass (the shipped model)
    "kv",
    "affinity",
    "affinity-soonest",
    "affinity-protect",
    "sglang-cache-aware",
    "smg-cache-aware",
    "vllm-kv-aware",
    "kv:credit=1.5",
    "kv:temperature=0.1",
    "approx",
    "profile",
    "round-robin",
    "random",
    "least-loaded",
    "power-of-two",
)
DEMO_POLICIES = ("affinity-fitted", "kv", "round-robin", "random")
BASELINE_MODE = "baseline"


@dataclass(frozen=True)
class Policy:
    name: str  # as written
    mode: str
    overrides: dict[str, Any]
    feed_events: bool  # does the router consume the engines' KV events?
    affinity: dict[str, Any] | None = None  # AffinityParams: the affinity policy (its mode)

    def router_factory(self):
        """None for kvplug's Router; a builder for the affinity policy and the baselines."""
        if self.affinity is not None:
            # kvplug serve's --router-mode affinity, one pass per decision (the same decisions
            # as kvplug.affinity.AffinityRouter around a kv router: tests/test_affinity_policy.py)
            from dataclasses import replace

            from kvplug.affinity import AffinityParams, affinity_setting
            from kvplug.router import Router

            setting = affinity_setting(AffinityParams(**self.affinity))

            def make(config, clock, rng):
                config = replace(config, router_mode="affinity", router_affinity=setting)
                return Router(config, clock=clock, rng=rng)

            return make
        if self.mode != BASELINE_MODE:
            return None
        from kvplug.sim.baselines import baseline_factory

        return baseline_factory(self.name.split(":", 1)[0])

    def router_config(self, block_size: int):
        from kvplug.config import RouterConfig

        if self.mode == BASELINE_MODE:
            from kvplug.sim.baselines import BaselineConfig

            return BaselineConfig(self.name.split(":", 1)[0], block_size, dict(self.overrides))

        values: dict[str, Any] = {"router_mode": self.mode, "kv_block_size": block_size}
        if self.name.split(":", 1)[0] == "approx":
            values["router_kv_events"] = False
        if self.name.split(":", 1)[0] == "lmetric":
            values["router_selection_policy"] = "lmetric"
        if self.mode == "profile":
            values["router_profile"] = str(bundled_profile_path())
        values.update(self.overrides)
        return RouterConfig(**values)


def bundled_profile_path() -> Path:
    return Path(str(resources.files("kvplug.sim") / "data" / "profile_llmd.yaml"))


def _coerce(raw: str) -> Any:
    low = raw.lower()
    if low in ("true", "yes", "on"):
        return True
    if low in ("false", "no", "off"):
        return False
    for conv in (int, float):
        try:
            return conv(raw)
        except ValueError:
            pass
    return raw


def parse_policy(text: str) -> Policy:
    """``kv:credit=0.5,temperature=0.1`` -> Policy; ValueError with the reason otherwise."""
    from kvplug.config import RouterConfig

    base, _, rest = text.strip().partition(":")
    from kvplug.sim.baselines import BASELINES

    if base in BASELINES:
        cls, feed = BASELINES[base]
        params: dict[str, Any] = {}
        for term in filter(None, (t.strip() for t in rest.split(","))):
            key, sep, raw = term.partition("=")
            key = key.strip().replace("-", "_")
            if not sep or key not in cls.DEFAULTS:
                raise ValueError(
                    f"policy {text!r}: {term!r} is not KEY=VALUE with KEY one of "
                    f"{', '.join(cls.DEFAULTS)}"
                )
            params[key] = _coerce(raw.strip())
        return Policy(text.strip(), BASELINE_MODE, params, feed)
    affinity: dict[str, Any] | None = None
    if base in AFFINITY_PRESETS:
        mode = "kv"
        affinity = dict(AFFINITY_PRESETS[base])
    elif base in ("approx", "lmetric"):
        mode = "kv"
    elif base in ("kv", "profile", *SIMPLE_MODES):
        mode = base
    else:
        raise ValueError(
            f"policy {text!r}: {base!r} is not kv, {', '.join(AFFINITY_PRESETS)}, lmetric, "
            "approx, profile, one of "
            f"{SIMPLE_MODES} or a baseline ({', '.join(BASELINES)})"
        )
    known = {f.name for f in fields(RouterConfig)}
    overrides: dict[str, Any] = {}
    for term in filter(None, (t.strip() for t in rest.split(","))):
        key, sep, raw = term.partition("=")
        key = ALIASES.get(key.strip(), key.strip().replace("-", "_"))
        if affinity is not None and sep and key in AFFINITY_KEYS:
            affinity[key] = _coerce(raw.strip())
            continue
        if not sep or key not in known:
            raise ValueError(f"policy {text!r}: {term!r} is not KEY=VALUE with a router setting")
        overrides[key] = _coerce(raw.strip())
    feed = mode in ("kv", "profile") and base != "approx"
    if "router_kv_events" in overrides:
        feed = bool(overrides["router_kv_events"]) and mode in ("kv", "profile")
    if affinity is not None:
        from kvplug.affinity import AffinityParams

        AffinityParams(**affinity)  # ValueError on a bad value
    return Policy(text.strip(), mode, overrides, feed, affinity)
