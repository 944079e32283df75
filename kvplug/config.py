"""Router configuration: one dataclass, Dynamo's flag names and defaults, CLI and file loaders.

The frontend and the simulator call :func:`add_router_arguments` on their parsers and
:meth:`RouterConfig.from_args`, so every CLI spells the router flags the same way. A config
file (YAML or JSON) uses the same names, with or without the leading dashes, or the field names.
"""

from __future__ import annotations

import argparse
import numbers
import os
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from kvplug.errors import ConfigError

MODES = (
    "kv",
    "profile",
    "random",
    "round-robin",
    "direct",
    "least-loaded",
    "device-aware-weighted",
    "power-of-two",
)
MISSING_POLICIES = ("exclude", "penalise", "worst")
# linear: scale*adjusted_prefill + decode (the seed); lmetric: scale*adjusted_prefill * (decode+1)
SELECTION_POLICIES = ("linear", "lmetric")
# when to skip the remote prefill stage and serve a request on a decode worker (kvplug.disagg)
CONDITIONAL_DISAGG_POLICIES = ("off", "isl_bounding", "prefill_load", "isl_or_load")
PREFILL_LOAD_MODELS = ("none", "calibrated")
QUEUE_POLICIES = ("fcfs", "wspt", "lcfs")  # admission queue order (kvplug.admission)


@dataclass(frozen=True)
class AttributeThreshold:
    """Keep a worker only if ``attribute op value`` (e.g. ``gpu_utilization<=0.9``)."""

    attribute: str
    op: str
    value: float
    on_missing: str = "exclude"  # exclude | penalise | worst
    fallback_on_empty: bool = True

    OPS = ("<=", ">=", "<", ">", "==", "!=")

    def __post_init__(self) -> None:
        if self.op not in self.OPS:
            raise ConfigError(f"attribute threshold op {self.op!r} not in {self.OPS}")
        if self.on_missing not in MISSING_POLICIES:
            raise ConfigError(
                f"attribute {self.attribute}: on_missing {self.on_missing!r} "
                f"not in {MISSING_POLICIES}"
            )

    @classmethod
    def parse(
        cls, text: str, on_missing: str = "exclude", fallback: bool = True
    ) -> AttributeThreshold:
        for op in ("<=", ">=", "==", "!=", "<", ">"):
            if op in text:
                name, _, raw = text.partition(op)
                try:
                    return cls(name.strip(), op, float(raw), on_missing, fallback)
                except ValueError:
                    break
        raise ConfigError(f"attribute threshold {text!r} is not NAME<=VALUE (ops {cls.OPS})")


def parse_label_selector(text: str | dict[str, str] | None) -> dict[str, str]:
    """``"a=b,c=d"`` -> {"a": "b", "c": "d"}."""
    if not text:
        return {}
    if isinstance(text, dict):
        return {str(k): str(v) for k, v in text.items()}
    out = {}
    for part in str(text).split(","):
        k, sep, v = part.partition("=")
        if not sep or not k.strip():
            raise ConfigError(f"label selector term {part!r} is not KEY=VALUE")
        out[k.strip()] = v.strip()
    return out


@dataclass
class RouterConfig:
    """Every router setting, named as Dynamo's flags (``router_mode`` is
    ``--router-mode``); validated on construction (``ConfigError``). Build one directly, or
    with ``from_dict`` / ``from_file`` (YAML or JSON, dashed or underscored keys) or
    ``from_args`` after :func:`add_router_arguments`. docs/router.md describes each flag."""

    # --- mode and selection
    router_mode: str = "affinity"
    kv_block_size: int = 16
    router_temperature: float = 0.0
    router_selection_policy: str = "linear"  # how prefill and decode combine (SELECTION_POLICIES)
    # --- the routing seed's cost (PROTOCOLS.md §4.1)
    router_kv_overlap_score_credit: float = 1.0
    router_kv_overlap_score_credit_decay: float = 0.0  # credit x 1/(1 + decay*excess)
    router_decode_active_request_weight: float = 0.0  # decode blocks per active request
    router_prefill_load_scale: float = 1.0
    router_host_cache_hit_weight: float = 0.75
    router_disk_cache_hit_weight: float = 0.25
    shared_cache_multiplier: float = 0.5
    # --- active-load tracking (PROTOCOLS.md §4.3)
    router_track_active_blocks: bool = True
    router_track_prefill_tokens: bool = True
    router_assume_kv_reuse: bool = True  # active blocks deduplicated by hash (Dynamo)
    # with reuse assumed: the request's device-resident prefix is not new decode load either
    # (kvplug; Dynamo counts only in-flight blocks). Measured better in the replay sim.
    router_decode_resident_credit: bool = True
    router_track_output_blocks: bool = False
    router_prefill_load_model: str = "none"
    # --- busy thresholds (all unset by default, as Dynamo); OR-ed
    active_decode_blocks_threshold: float | None = None  # fraction of kv_capacity_blocks
    active_prefill_tokens_threshold: int | None = None  # absolute tokens
    active_prefill_tokens_threshold_frac: float | None = None  # x max_batched_tokens
    busy_threshold_fallback: bool = False  # False: AllWorkersOverloaded, as Dynamo
    # --- admission queue (kvplug.admission; off by default, as Dynamo since v1.4)
    router_queue_threshold: float | None = None  # hold while all eligible > this x max_batched
    router_queue_policy: str = "fcfs"  # fcfs | wspt | lcfs
    router_queue_max_length: int = 0  # waiting requests; 0 = no cap
    router_queue_max_wait: float = 0.0  # seconds before a waiting request fails; 0 = no limit
    # --- conditional disaggregation (PROTOCOLS.md §4.6; kvplug.disagg; Dynamo's defaults)
    router_conditional_disagg: str = "off"  # CONDITIONAL_DISAGG_POLICIES
    router_conditional_disagg_eff_isl_threshold: int = 2048  # tokens, strict <
    router_conditional_disagg_eff_isl_ratio_threshold: float = 0.7  # effective/raw, strict <
    # prefill_load: chosen prefill worker busy if active prefill tokens > this x max_batched;
    # None = inherit router_queue_threshold (None too: no load signal, never busy)
    router_conditional_disagg_prefill_busy_threshold: float | None = None
    # decode-busy guard: no bypass if the decode worker's projected decode blocks > this x
    # kv_capacity_blocks (unknown capacity: no bypass); None = guard off
    router_conditional_disagg_decode_busy_threshold: float | None = None
    # --- events / approximate mode (PROTOCOLS.md §4.4)
    router_kv_events: bool = True
    router_ttl_secs: float = 120.0
    router_max_tree_size: int = 1 << 20
    router_predicted_ttl_secs: float = 0.0  # >0: predict-on-route side index even with events
    router_max_index_entries: int = 0  # LRU bound of the event-fed index (0 = unbounded)
    # --- attributes, labels (llm-d style)
    router_label_selector: dict[str, str] = field(default_factory=dict)
    router_attribute_thresholds: list[AttributeThreshold] = field(default_factory=list)
    router_attribute_max_age: float = 2.0  # seconds; older = stale = missing
    router_missing_attribute_penalty: float = 0.5  # "penalise": cost x (1 + p), score - p
    # --- other modes
    router_accelerator_weight: float = 8.0  # DYN_ENCODER_CUDA_TO_CPU_RATIO
    router_profile: str | None = None  # scheduling profile YAML (mode "profile")
    # mode "affinity": a named setting and changes to it (kvplug.affinity.AFFINITY_PRESETS)
    router_affinity: str = "affinity-fitted"
    router_max_prompt_tokens: int = 1 << 20

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        self._check_types()
        from kvplug.policies import policy_class  # the built-in MODES and any registered

        policy_class(self.router_mode)  # raises ConfigError naming the known modes
        if self.router_mode == "affinity":
            from kvplug.affinity import parse_affinity

            try:
                parse_affinity(self.router_affinity)
            except ValueError as exc:
                raise ConfigError(f"--router-affinity: {exc}") from None
        if self.router_selection_policy not in SELECTION_POLICIES:
            raise ConfigError(
                f"--router-selection-policy {self.router_selection_policy!r} "
                f"is not one of {SELECTION_POLICIES}"
            )
        if self.kv_block_size <= 0:
            raise ConfigError(f"--kv-block-size must be positive, got {self.kv_block_size}")
        if self.router_temperature < 0:
            raise ConfigError(f"--router-temperature must be >= 0, got {self.router_temperature}")
        for name in (
            "router_kv_overlap_score_credit",
            "router_kv_overlap_score_credit_decay",
            "router_decode_active_request_weight",
            "router_prefill_load_scale",
            "router_host_cache_hit_weight",
            "router_disk_cache_hit_weight",
            "shared_cache_multiplier",
            "router_ttl_secs",
            "router_predicted_ttl_secs",
            "router_attribute_max_age",
            "router_missing_attribute_penalty",
        ):
            if getattr(self, name) < 0:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 0")
        if self.router_prefill_load_model not in PREFILL_LOAD_MODELS:
            raise ConfigError(
                f"--router-prefill-load-model {self.router_prefill_load_model!r} "
                f"not in {PREFILL_LOAD_MODELS}"
            )
        for name in (
            "active_decode_blocks_threshold",
            "active_prefill_tokens_threshold",
            "active_prefill_tokens_threshold_frac",
        ):
            v = getattr(self, name)
            if v is not None and v < 0:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 0, got {v}")
        if self.router_queue_threshold is not None and self.router_queue_threshold < 0:
            raise ConfigError(
                f"--router-queue-threshold must be >= 0, got {self.router_queue_threshold}"
            )
        if self.router_conditional_disagg not in CONDITIONAL_DISAGG_POLICIES:
            raise ConfigError(
                f"--router-conditional-disagg {self.router_conditional_disagg!r} "
                f"not in {CONDITIONAL_DISAGG_POLICIES}"
            )
        if self.router_conditional_disagg_eff_isl_threshold < 0:
            raise ConfigError("--router-conditional-disagg-eff-isl-threshold must be >= 0")
        if not 0.0 <= self.router_conditional_disagg_eff_isl_ratio_threshold <= 1.0:
            raise ConfigError(
                "--router-conditional-disagg-eff-isl-ratio-threshold must be in [0, 1]"
            )
        for name in (
            "router_conditional_disagg_prefill_busy_threshold",
            "router_conditional_disagg_decode_busy_threshold",
        ):
            v = getattr(self, name)
            if v is not None and v < 0:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 0, got {v}")
        if self.router_queue_policy not in QUEUE_POLICIES:
            raise ConfigError(
                f"--router-queue-policy {self.router_queue_policy!r} not in {QUEUE_POLICIES}"
            )
        if self.router_queue_max_length < 0 or self.router_queue_max_wait < 0:
            raise ConfigError("--router-queue-max-length and --router-queue-max-wait must be >= 0")
        if self.router_accelerator_weight <= 0:
            raise ConfigError("--router-accelerator-weight must be > 0")
        if self.router_max_tree_size < 0 or self.router_max_index_entries < 0:
            raise ConfigError("index size bounds must be >= 0")
        self.router_label_selector = parse_label_selector(self.router_label_selector)
        self.router_attribute_thresholds = [
            t if isinstance(t, AttributeThreshold) else _threshold_from(t)
            for t in self.router_attribute_thresholds
        ]

    def _check_types(self) -> None:
        """Numbers and switches are what their fields say (a config file or a CLI override
        may carry any text): ConfigError naming the flag, not a TypeError later."""
        for f in fields(self):
            v = getattr(self, f.name)
            kind = str(f.type)
            if v is None and "None" in kind:
                continue
            flag = f"--{f.name.replace('_', '-')}"
            if kind.startswith("bool"):
                ok = not isinstance(v, (float, str)) and v in (0, 1)  # numpy bools, 0/1 too
            elif kind.startswith("int"):
                ok = isinstance(v, numbers.Integral) and not isinstance(v, bool)
            elif kind.startswith("float"):
                ok = isinstance(v, numbers.Real) and not isinstance(v, bool)
            else:
                continue
            if not ok:
                what = kind.split(" ")[0]
                raise ConfigError(f"{flag} must be {_ARTICLE[what]} {what}, got {v!r}")

    @property
    def approximate(self) -> bool:
        """A predict-on-route side index is kept (no events, or a predicted TTL is set)."""
        return (not self.router_kv_events) or self.router_predicted_ttl_secs > 0

    @property
    def approx_ttl(self) -> float:
        return self.router_ttl_secs if not self.router_kv_events else self.router_predicted_ttl_secs

    # ---------------------------------------------------------------- loaders
    @classmethod
    def from_args(cls, args: argparse.Namespace) -> RouterConfig:
        base: dict[str, Any] = {}
        if getattr(args, "router_config", None):
            base = _file_values(args.router_config)
        for f in fields(cls):
            v = getattr(args, f.name, None)
            if v is not None:
                base[f.name] = v
        missing = _missing_policies(getattr(args, "router_attribute_missing", None) or [])
        parsed = [_threshold_from(t) for t in base.get("router_attribute_thresholds") or []]
        base["router_attribute_thresholds"] = [
            replace(t, on_missing=missing[t.attribute]) if t.attribute in missing else t
            for t in parsed
        ]
        return cls(**base)

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> RouterConfig:
        return cls(**_file_values(path))

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> RouterConfig:
        return cls(**_normalise_keys(values))


_ARTICLE = {"bool": "a", "int": "an", "float": "a"}
_FIELD_NAMES = {f.name for f in fields(RouterConfig)}
# Dynamo spellings that differ from the field name.
_ALIASES = {
    "kv_cache_block_size": "kv_block_size",
    "router_kv_overlap_score_weight": "router_prefill_load_scale",
    "no_router_kv_events": None,  # handled in _normalise_keys
}


def _threshold_from(value: Any) -> AttributeThreshold:
    if isinstance(value, str):
        return AttributeThreshold.parse(value)
    if isinstance(value, dict):
        d = dict(value)
        if "op" not in d and "threshold" in d:  # llm-d: {attribute, threshold, operator}
            d["op"] = {
                "LessThanOrEqual": "<=",
                "LessThan": "<",
                "GreaterThan": ">",
                "GreaterThanOrEqual": ">=",
                "Equal": "==",
                "NotEqual": "!=",
            }.get(d.pop("operator", "LessThanOrEqual"), "<=")
            d["value"] = d.pop("threshold")
        d.setdefault("on_missing", d.pop("onMissing", "exclude"))
        d.setdefault("fallback_on_empty", d.pop("fallbackOnEmpty", True))
        try:
            return AttributeThreshold(
                str(d["attribute"]),
                str(d["op"]),
                float(d["value"]),
                str(d["on_missing"]).lower(),
                bool(d["fallback_on_empty"]),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError(f"attribute threshold {value!r}: {e}") from None
    raise ConfigError(f"attribute threshold {value!r} is neither 'NAME<=V' nor a mapping")


def _missing_policies(items: list[str]) -> dict[str, str]:
    out = {}
    for item in items:
        name, sep, policy = item.partition("=")
        if not sep or policy not in MISSING_POLICIES:
            raise ConfigError(
                f"--router-attribute-missing {item!r} is not NAME=exclude|penalise|worst"
            )
        out[name.strip()] = policy
    return out


def _normalise_keys(values: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for raw_key, v in values.items():
        key = str(raw_key).lstrip("-").replace("-", "_")
        if key == "no_router_kv_events":
            out["router_kv_events"] = not bool(v)
            continue
        key = _ALIASES.get(key, key) or key
        if key not in _FIELD_NAMES:
            raise ConfigError(f"unknown router config key {raw_key!r}")
        out[key] = v
    return out


def _file_values(path: str | os.PathLike[str]) -> dict[str, Any]:
    import yaml

    p = Path(path)
    try:
        data = yaml.safe_load(p.read_text())
    except OSError as e:
        raise ConfigError(f"router config {p}: {e}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"router config {p} is not valid YAML/JSON: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"router config {p} must be a mapping of flag names to values")
    if isinstance(data.get("router"), dict):  # allow a `router:` section in a larger file
        data = data["router"]
    return _normalise_keys(data)


def _bool_flag(parser: Any, name: str, help_text: str) -> None:
    dest = name.lstrip("-").replace("-", "_")
    parser.add_argument(
        name, dest=dest, action=argparse.BooleanOptionalAction, default=None, help=help_text
    )


def add_router_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the router's flags (defaults = RouterConfig's; None means 'not given')."""
    d = RouterConfig()
    g = parser.add_argument_group("router")
    g.add_argument("--router-config", default=None, help="YAML/JSON file with the flags below")
    from kvplug.affinity import AFFINITY_PRESETS
    from kvplug.policies import policy_names

    g.add_argument(
        "--router-mode", choices=policy_names(), default=None, help=f"default {d.router_mode}"
    )
    g.add_argument(
        "--kv-block-size",
        "--kv-cache-block-size",
        dest="kv_block_size",
        type=int,
        default=None,
        help=f"tokens per KV block (= engine block size); default {d.kv_block_size}",
    )
    g.add_argument(
        "--router-temperature",
        type=float,
        default=None,
        help="0: lowest cost wins; >0: softmax over normalised cost logits",
    )
    g.add_argument(
        "--router-selection-policy",
        choices=SELECTION_POLICIES,
        default=None,
        help="kv cost: linear = scale*adjusted_prefill + decode (default); "
        "lmetric = scale*adjusted_prefill * (decode + 1)",
    )
    g.add_argument(
        "--router-kv-overlap-score-credit",
        type=float,
        default=None,
        help="credit per device-overlap block; default 1.0",
    )
    g.add_argument(
        "--router-kv-overlap-score-credit-decay",
        type=float,
        default=None,
        help="decay the device credit of workers whose active prefill exceeds the least "
        "loaded: credit x 1/(1 + decay x excess/request tokens); default 0 (off)",
    )
    g.add_argument(
        "--router-decode-active-request-weight",
        type=float,
        default=None,
        help="extra decode blocks per active request on a worker; default 0",
    )
    g.add_argument("--router-prefill-load-scale", type=float, default=None, help="default 1.0")
    g.add_argument("--router-host-cache-hit-weight", type=float, default=None, help="default 0.75")
    g.add_argument("--router-disk-cache-hit-weight", type=float, default=None, help="default 0.25")
    g.add_argument("--shared-cache-multiplier", type=float, default=None, help="default 0.5")
    _bool_flag(g, "--router-track-active-blocks", "decode load from in-flight blocks (default on)")
    _bool_flag(g, "--router-track-prefill-tokens", "prompt tokens until first token (default on)")
    _bool_flag(
        g,
        "--router-assume-kv-reuse",
        "count in-flight prompt blocks once per block hash on a worker: a request's blocks "
        "already active there are not new decode load (Dynamo; default on)",
    )
    _bool_flag(
        g,
        "--router-decode-resident-credit",
        "with --router-assume-kv-reuse, the request's device-cached prefix is not new decode "
        "load either (kvplug; default on; off = Dynamo's exact active-only dedup)",
    )
    _bool_flag(g, "--router-track-output-blocks", "placeholder output blocks (default off)")
    g.add_argument(
        "--router-prefill-load-model",
        choices=PREFILL_LOAD_MODELS,
        default=None,
        help="decay the oldest active prefill over its predicted duration (default none)",
    )
    g.add_argument(
        "--active-decode-blocks-threshold",
        type=float,
        default=None,
        help="busy if active decode blocks > this fraction of KV capacity",
    )
    g.add_argument(
        "--active-prefill-tokens-threshold",
        type=int,
        default=None,
        help="busy if active prefill tokens > this",
    )
    g.add_argument(
        "--active-prefill-tokens-threshold-frac",
        type=float,
        default=None,
        help="busy if active prefill tokens > this x max_batched_tokens",
    )
    _bool_flag(
        g,
        "--busy-threshold-fallback",
        "when every worker is busy route to the least busy instead of failing (default off)",
    )
    _bool_flag(g, "--router-kv-events", "use engine KV events (--no-router-kv-events: approximate)")
    g.add_argument("--router-ttl-secs", type=float, default=None, help="approximate-mode TTL; 120")
    g.add_argument(
        "--router-max-tree-size",
        type=int,
        default=None,
        help="approximate side index size cap in blocks; default 2^20",
    )
    g.add_argument(
        "--router-predicted-ttl-secs",
        type=float,
        default=None,
        help=">0: also record routed prompts for this long even with events",
    )
    g.add_argument(
        "--router-max-index-entries",
        type=int,
        default=None,
        help="LRU bound of the event-fed index (0 = unbounded)",
    )
    g.add_argument("--router-label-selector", default=None, help="KEY=VALUE[,KEY=VALUE]")
    g.add_argument(
        "--router-attribute-threshold",
        dest="router_attribute_thresholds",
        action="append",
        default=None,
        help="e.g. gpu_utilization<=0.9 (repeatable)",
    )
    g.add_argument(
        "--router-attribute-missing",
        action="append",
        default=None,
        help="NAME=exclude|penalise|worst for a missing/stale attribute (default exclude)",
    )
    g.add_argument(
        "--router-attribute-max-age",
        type=float,
        default=None,
        help="seconds after which an attribute is stale (= missing); default 2",
    )
    g.add_argument(
        "--router-missing-attribute-penalty",
        type=float,
        default=None,
        help="'penalise': kv cost x (1+p), profile score - p; default 0.5",
    )
    g.add_argument(
        "--router-accelerator-weight",
        type=float,
        default=_env_float("DYN_ENCODER_CUDA_TO_CPU_RATIO"),
        help="device-aware-weighted: accelerator throughput weight vs CPU; default 8",
    )
    g.add_argument("--router-profile", default=None, help="llm-d style scheduling profile YAML")
    g.add_argument(
        "--router-affinity",
        default=None,
        metavar="NAME[:KEY=VALUE,...]",
        help=f"--router-mode affinity's setting: one of {', '.join(AFFINITY_PRESETS)}, then "
        f"changes to it (default {d.router_affinity}; docs/router.md)",
    )
    g.add_argument(
        "--router-conditional-disagg",
        choices=CONDITIONAL_DISAGG_POLICIES,
        default=None,
        help="disaggregated fleets: serve a request on a decode worker (local prefill) instead "
        "of the remote prefill stage when isl_bounding (effective ISL on the best decode "
        "worker small and mostly cached), prefill_load (best prefill worker busy) or "
        "isl_or_load says so; default off",
    )
    g.add_argument(
        "--router-conditional-disagg-eff-isl-threshold",
        type=int,
        default=None,
        help="isl_bounding: effective ISL (prompt - cached on the decode worker) must be "
        "below this many tokens; default 2048",
    )
    g.add_argument(
        "--router-conditional-disagg-eff-isl-ratio-threshold",
        type=float,
        default=None,
        help="isl_bounding: effective ISL / prompt tokens must be below this; default 0.7",
    )
    g.add_argument(
        "--router-conditional-disagg-prefill-busy-threshold",
        type=float,
        default=None,
        help="prefill_load: the best prefill worker is busy when its active prefill tokens "
        "exceed this x max_batched_tokens; default: --router-queue-threshold",
    )
    g.add_argument(
        "--router-conditional-disagg-decode-busy-threshold",
        type=float,
        default=None,
        help="no bypass when the decode worker's projected decode blocks exceed this "
        "fraction of its KV capacity; default unset (guard off)",
    )
    g.add_argument(
        "--router-max-prompt-tokens",
        type=int,
        default=None,
        help="reject longer prompts with InvalidRequest",
    )
    return parser


def _env_float(name: str) -> float | None:
    v = os.environ.get(name)
    if v is None:
        return None
    try:
        return float(v)
    except ValueError:
        raise ConfigError(f"${name}={v!r} is not a number") from None
