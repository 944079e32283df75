"""Mirror discovered workers into the frontend's fleet.

A discovery source (etcd, Kubernetes) says which workers exist, as the same mappings the
workers YAML and the admin API take; the mirror adds, updates, drains and removes them in the
``Fleet``. It only ever touches the workers it added: a worker given on the command line or
through the admin API is left alone (a discovered entry with its id is refused and counted).
Invalid entries are counted and logged, never raised.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

from kvplug.errors import ConfigError

log = logging.getLogger(__name__)


@dataclass
class DiscoveryStats:
    added: int = 0
    updated: int = 0
    removed: int = 0
    drained: int = 0
    invalid: int = 0  # entries that are not a valid worker spec: counted, logged, skipped
    watch_restarts: int = 0


class FleetMirror:
    def __init__(self, fleet: Any, source: str, default_engine: str = "vllm") -> None:
        self.fleet = fleet
        self.source = source  # for log lines: "etcd", "kubernetes"
        self.default_engine = default_engine
        self.stats = DiscoveryStats()
        self._mine: dict[str, str] = {}  # worker id -> canonical JSON of the spec it came from

    @property
    def workers(self) -> set[str]:
        return set(self._mine)

    def _invalid(self, worker_id: str, why: str) -> None:
        self.stats.invalid += 1
        log.warning("%s discovery: skipped worker %r: %s", self.source, worker_id, why)

    async def put(self, worker_id: str, mapping: Any, draining: bool = False) -> None:
        """Add ``worker_id`` or bring it up to date (re-added if its spec changed)."""
        from kvplug.frontend.config import spec_from_mapping

        if not isinstance(mapping, dict):
            return self._invalid(worker_id, "not a JSON object")
        mapping = {"id": worker_id, **mapping}
        if mapping["id"] != worker_id:
            return self._invalid(worker_id, f"its id {mapping['id']!r} is not its key's")
        try:
            text = json.dumps(mapping, sort_keys=True)
            spec = spec_from_mapping(
                mapping, f"{self.source} worker {worker_id}", self.default_engine
            )
        except (ValueError, TypeError, ConfigError) as exc:
            return self._invalid(worker_id, str(exc))
        if worker_id in self.fleet.workers and worker_id not in self._mine:
            return self._invalid(worker_id, "a worker of that id is configured statically")
        if self._mine.get(worker_id) != text:
            if worker_id in self._mine:
                await self.fleet.remove(worker_id)
                self.stats.updated += 1
            else:
                self.stats.added += 1
            try:
                await self.fleet.add(spec)
            except ConfigError as exc:
                self._mine.pop(worker_id, None)
                return self._invalid(worker_id, str(exc))
            self._mine[worker_id] = text
            log.info("%s discovery: worker %s (%s) joined", self.source, worker_id, spec.url)
        entry = self.fleet.workers.get(worker_id)
        if draining and entry is not None and not entry.draining:
            self.fleet.drain(worker_id)
            self.stats.drained += 1

    async def delete(self, worker_id: str) -> None:
        if self._mine.pop(worker_id, None) is None:
            return
        if worker_id in self.fleet.workers:
            await self.fleet.remove(worker_id)
        self.stats.removed += 1
        log.info("%s discovery: worker %s left", self.source, worker_id)

    async def replace_all(self, wanted: dict[str, tuple[dict[str, Any], bool]]) -> None:
        """Make the discovered workers exactly ``wanted`` (id -> (mapping, draining))."""
        for worker_id in sorted(self.workers - set(wanted)):
            await self.delete(worker_id)
        for worker_id, (mapping, draining) in wanted.items():
            await self.put(worker_id, mapping, draining)
