"""llm-d style scheduling profiles from YAML: filters, weighted scorers, one picker.

Each scorer's output is clamped to [0, 1], multiplied by its weight and summed (as llm-d's
``scheduler_profile.go``); the picker turns the totals into one candidate. A file may hold
several profiles; one named after a stage (``prefill``/``decode``/``aggregated``) is used for
that stage, otherwise ``default`` (or the first). See docs/router.md for the format.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvplug import pickers
from kvplug.config import AttributeThreshold, _threshold_from, parse_label_selector
from kvplug.errors import ConfigError
from kvplug.scoring import SCORERS, Scorer, ScoringContext
from kvplug.workers import Stage

FILTER_TYPES = (
    "gpu-utilization-filter",
    "endpoint-attribute-filter",
    "attribute-filter",
    "utilization-filter",
    "label-selector-filter",
)
PICKER_TYPES = ("max-score-picker", "weighted-random-picker", "softmax-picker", "random-picker")


@dataclass
class Profile:
    name: str
    attribute_filters: list[AttributeThreshold] = field(default_factory=list)
    label_selector: dict[str, str] = field(default_factory=dict)
    scorers: list[tuple[str, Scorer, float]] = field(default_factory=list)
    picker: str = "max-score-picker"
    temperature: float = 1.0  # softmax-picker

    def score(self, ctx: ScoringContext) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        total = np.zeros(len(ctx.endpoints))
        parts: dict[str, np.ndarray] = {}
        for name, scorer, weight in self.scorers:
            s = np.clip(np.nan_to_num(scorer.score(ctx), nan=0.0), 0.0, 1.0) * weight
            parts[name] = s
            total = total + s
        return total, parts

    def pick(self, total: np.ndarray, rng: random.Random) -> tuple[int, np.ndarray | None]:
        if self.picker == "max-score-picker":
            return pickers.argmax_random_tie(total, rng), None
        if self.picker == "weighted-random-picker":
            return pickers.weighted_random(total, rng)
        if self.picker == "softmax-picker":
            probs = pickers.softmax_score_probs(total, self.temperature)
            return pickers.inverse_cdf(probs, rng.random()), probs
        idx = rng.randrange(len(total))
        return idx, np.full(len(total), 1.0 / len(total))


@dataclass
class ProfileSet:
    profiles: dict[str, Profile]
    default: str

    def get(self, stage: Stage) -> Profile:
        return self.profiles.get(stage.value) or self.profiles[self.default]


def load_profile(source: str | os.PathLike[str] | dict[str, Any]) -> ProfileSet:
    """Parse a profile file (YAML/JSON) or an already-loaded mapping."""
    if isinstance(source, dict):
        data = source
        where = "<profile>"
    else:
        import yaml

        where = str(source)
        try:
            data = yaml.safe_load(Path(source).read_text())
        except OSError as e:
            raise ConfigError(f"scheduling profile {where}: {e}") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"scheduling profile {where} is not valid YAML: {e}") from None
    if (
        isinstance(data, dict)
        and "plugins" not in data
        and ("filters" in data or "scorers" in data)
    ):
        data = _from_short_form(data, where)
    if not isinstance(data, dict) or not isinstance(data.get("plugins"), list):
        raise ConfigError(f"scheduling profile {where}: needs a 'plugins' list")
    plugins: dict[str, dict[str, Any]] = {}
    for i, p in enumerate(data["plugins"]):
        if not isinstance(p, dict) or "type" not in p:
            raise ConfigError(f"scheduling profile {where}: plugin #{i} needs a 'type'")
        name = str(p.get("name") or p["type"])
        if name in plugins:
            raise ConfigError(f"scheduling profile {where}: duplicate plugin name {name!r}")
        params = p.get("parameters") or {}
        if not isinstance(params, dict):
            raise ConfigError(f"plugin {name}: parameters must be a mapping")
        plugins[name] = {"type": str(p["type"]), "parameters": params}
    specs = data.get("schedulingProfiles")
    if not specs:
        specs = [{"name": "default", "plugins": [{"pluginRef": n} for n in plugins]}]
    profiles: dict[str, Profile] = {}
    for spec in specs:
        if not isinstance(spec, dict) or not isinstance(spec.get("plugins"), list):
            raise ConfigError(f"scheduling profile {where}: each profile needs a plugins list")
        prof = Profile(str(spec.get("name", "default")))
        pickers_seen = 0
        for ref in spec["plugins"]:
            pname = ref.get("pluginRef") if isinstance(ref, dict) else ref
            if pname not in plugins:
                raise ConfigError(f"profile {prof.name}: pluginRef {pname!r} is not defined")
            ptype = plugins[pname]["type"]
            params = plugins[pname]["parameters"]
            weight = float(ref.get("weight", 1.0)) if isinstance(ref, dict) else 1.0
            if weight < 0:
                raise ConfigError(f"profile {prof.name}: weight of {pname} must be >= 0")
            if ptype in SCORERS:
                prof.scorers.append((pname, SCORERS[ptype](params), weight))
            elif ptype in PICKER_TYPES:
                pickers_seen += 1
                prof.picker = ptype
                prof.temperature = float(params.get("temperature", 1.0))
                if prof.temperature <= 0:
                    raise ConfigError(f"profile {prof.name}: softmax temperature must be > 0")
            elif ptype == "label-selector-filter":
                prof.label_selector.update(parse_label_selector(params.get("selector")))
            elif ptype == "gpu-utilization-filter":
                # maxPercent of an attribute in [0, 1] (``scale: percent`` for 0..100 values)
                pct = float(params.get("maxPercent", 90))
                scale = 1.0 if params.get("scale", "fraction") == "percent" else 100.0
                prof.attribute_filters.append(
                    _threshold_from(
                        {
                            "attribute": params.get("attribute", "gpu_utilization"),
                            "op": "<=",
                            "value": pct / scale,
                            "onMissing": params.get("onMissing", "exclude"),
                            "fallbackOnEmpty": params.get("fallbackOnEmpty", True),
                        }
                    )
                )
            elif ptype == "utilization-filter":
                for cond in params.get("conditions", []):
                    prof.attribute_filters.append(
                        _threshold_from(
                            {
                                "attribute": cond["metric"],
                                "op": "<=",
                                "value": cond["maxValue"],
                                "onMissing": params.get("onMissing", "exclude"),
                                "fallbackOnEmpty": params.get("fallbackOnEmpty", True),
                            }
                        )
                    )
            elif ptype in ("endpoint-attribute-filter", "attribute-filter"):
                prof.attribute_filters.append(_threshold_from(dict(params)))
            else:
                raise ConfigError(
                    f"profile {prof.name}: unknown plugin type {ptype!r}; known: "
                    f"{sorted([*SCORERS, *PICKER_TYPES, *FILTER_TYPES])}"
                )
        if pickers_seen > 1:
            raise ConfigError(f"profile {prof.name}: more than one picker")
        if not prof.scorers:
            raise ConfigError(f"profile {prof.name}: needs at least one scorer")
        profiles[prof.name] = prof
    default = "default" if "default" in profiles else next(iter(profiles))
    return ProfileSet(profiles, default)


def _from_short_form(data: dict[str, Any], where: str) -> dict[str, Any]:
    """The short form (as in the llm-d GPU-routing article): top-level ``filters`` and
    ``scorers`` lists with parameters inline, optional ``picker``. Scorers with an
    ``attributeKey`` and no type are attribute scorers; ``weight`` defaults to 1."""
    plugins: list[dict[str, Any]] = []
    refs: list[dict[str, Any]] = []
    for section in ("filters", "scorers"):
        items = data.get(section) or []
        if not isinstance(items, list):
            raise ConfigError(f"scheduling profile {where}: '{section}' must be a list")
        for i, item in enumerate(items):
            if not isinstance(item, dict):
                raise ConfigError(f"scheduling profile {where}: {section}[{i}] is not a mapping")
            params = {k: v for k, v in item.items() if k not in ("type", "name", "weight")}
            ptype = item.get("type") or (
                "endpoint-attribute-scorer" if "attributeKey" in item else None
            )
            if ptype is None:
                raise ConfigError(f"scheduling profile {where}: {section}[{i}] needs a 'type'")
            name = str(item.get("name") or f"{ptype}-{section}-{i}")
            plugins.append({"type": ptype, "name": name, "parameters": params})
            ref: dict[str, Any] = {"pluginRef": name}
            if "weight" in item:
                ref["weight"] = item["weight"]
            refs.append(ref)
    picker = data.get("picker")
    if picker is not None:
        ptype = picker if isinstance(picker, str) else picker.get("type")
        params = {} if isinstance(picker, str) else {k: v for k, v in picker.items() if k != "type"}
        plugins.append({"type": ptype, "name": "picker", "parameters": params})
        refs.append({"pluginRef": "picker"})
    return {"plugins": plugins, "schedulingProfiles": [{"name": "default", "plugins": refs}]}
