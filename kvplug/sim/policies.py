"""Routing policies for the replay, written ``NAME[:key=value,...]`` on the command line.

``NAME`` is ``kv``, ``lmetric`` (kv mode with ``--router-selection-policy lmetric``), ``approx``
(kv mode without engine events: the router records what it routed, with a TTL), ``profile``
(an llm-d-style scheduling profile; default: the bundled ``data/profile_llmd.yaml``, or
``profile:router_profile=FILE``), or a simple mode
(``round-robin``, ``random``, ``least-loaded``, ``power-of-two``).
Keys are :class:`kvplug.config.RouterConfig` fields or the short aliases below, e.g.
``kv:credit=0.5,temperature=0.1``.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from importlib import resources
from pathlib import Path
from typing import Any

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
    "kv",
    "kv:credit=1.5",
    "kv:temperature=0.1",
    "approx",
    "profile",
    "round-robin",
    "random",
    "least-loaded",
    "power-of-two",
)
DEMO_POLICIES = ("kv", "round-robin", "random")


@dataclass(frozen=True)
class Policy:
    name: str  # as written
    mode: str
    overrides: dict[str, Any]
    feed_events: bool  # does the router consume the engines' KV events?

    def router_config(self, block_size: int):
        from kvplug.config import RouterConfig

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
    if base in ("approx", "lmetric"):
        mode = "kv"
    elif base in ("kv", "profile", *SIMPLE_MODES):
        mode = base
    else:
        raise ValueError(
            f"policy {text!r}: {base!r} is not kv, lmetric, approx, profile or one of "
            f"{SIMPLE_MODES}"
        )
    known = {f.name for f in fields(RouterConfig)}
    overrides: dict[str, Any] = {}
    for term in filter(None, (t.strip() for t in rest.split(","))):
        key, sep, raw = term.partition("=")
        key = ALIASES.get(key.strip(), key.strip().replace("-", "_"))
        if not sep or key not in known:
            raise ValueError(f"policy {text!r}: {term!r} is not KEY=VALUE with a router setting")
        overrides[key] = _coerce(raw.strip())
    feed = mode in ("kv", "profile") and base != "approx"
    if "router_kv_events" in overrides:
        feed = bool(overrides["router_kv_events"]) and mode in ("kv", "profile")
    return Policy(text.strip(), mode, overrides, feed)
