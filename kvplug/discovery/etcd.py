"""Workers discovered through etcd: engines register with a lease, router replicas watch.

An engine (or the kvplug plugin running beside it) writes its worker spec - the same mapping
the workers YAML and the admin API take - as JSON under ``/kvplug/<namespace>/workers/<id>``,
attached to a lease it keeps alive. Every ``kvplug serve --discovery etcd://...`` replica reads
the prefix, adds those workers, and watches it from the next revision on: a put adds or
updates a worker, a delete removes it. When an engine dies its lease expires, etcd deletes the
key, and the worker leaves every replica at once. Workers given on the command line or through
the admin API are never touched by discovery.

Client: ``aetcd`` (asyncio over etcd's v3 gRPC API), the ``replicas`` extra.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any
from urllib.parse import urlsplit

from kvplug.discovery.mirror import FleetMirror
from kvplug.errors import ConfigError
from kvplug.tasks import cancel_and_wait

log = logging.getLogger(__name__)


def workers_prefix(namespace: str) -> str:
    return f"/kvplug/{namespace}/workers/"


def parse_etcd_url(url: str) -> tuple[str, int]:
    """``etcd://host:port`` (or http://) -> (host, port); ``ConfigError`` otherwise."""
    parts = urlsplit(url)
    if parts.scheme not in ("etcd", "http") or not parts.hostname:
        raise ConfigError(f"discovery URL {url!r}: expected etcd://HOST:PORT")
    try:
        port = parts.port or 2379
    except ValueError:
        raise ConfigError(f"discovery URL {url!r}: bad port") from None
    return parts.hostname, port


async def _client(url: str, timeout: float) -> Any:
    import aetcd  # the replicas extra

    host, port = parse_etcd_url(url)
    client = aetcd.Client(host=host, port=port, timeout=int(max(timeout, 1)))
    try:
        await asyncio.wait_for(client.connect(), timeout)
        await asyncio.wait_for(client.status(), timeout)  # proves the server answers
    except Exception as exc:
        await client.close()
        raise ConnectionError(f"no etcd server answered at {url}: {exc}") from None
    return client


class EtcdRegistration:
    """The engine side: keep ``spec`` registered under a lease for as long as this runs."""

    def __init__(
        self, url: str, spec: dict[str, Any], *, namespace: str = "default", ttl: int = 10
    ) -> None:
        worker_id = spec.get("id") or spec.get("worker_id")
        if not isinstance(worker_id, str) or not worker_id:
            raise ConfigError("an etcd registration needs the worker's 'id'")
        self.url = url
        self.spec = spec
        self.key = (workers_prefix(namespace) + worker_id).encode()
        self.ttl = ttl
        self._client: Any = None
        self._lease: Any = None
        self._keepalive: asyncio.Task | None = None
        self.reregistrations = 0  # times the lease was found expired and the entry put again

    async def start(self, timeout: float = 5.0) -> None:
        self._client = await _client(self.url, timeout)
        await self._register()
        self._keepalive = asyncio.create_task(self._refresh(), name="kvplug-etcd-keepalive")
        log.info("registered %s in etcd (lease %d s)", self.key.decode(), self.ttl)

    async def _register(self) -> None:
        """A fresh lease and the entry under it."""
        self._lease = await self._client.lease(self.ttl)
        await self._client.put(self.key, json.dumps(self.spec).encode(), lease=self._lease)

    async def update(self, spec: dict[str, Any]) -> None:
        """Rewrite the entry under the same lease (e.g. ``"draining": true`` before leaving)."""
        self.spec = spec
        await self._client.put(self.key, json.dumps(spec).encode(), lease=self._lease)

    async def _refresh(self) -> None:
        while True:
            await asyncio.sleep(self.ttl / 3)
            try:
                reply = await self._lease.refresh()
                if reply is not None and reply.TTL <= 0:
                    # etcd answers a keep-alive of an expired (or revoked) lease with TTL 0,
                    # not an error, and has deleted the entry: etcd was away or this process
                    # stalled for longer than the TTL. The engine is alive, so register again
                    log.warning("etcd lease of %s expired; registering again", self.key.decode())
                    await self._register()
                    self.reregistrations += 1
            except Exception as exc:  # etcd away: the key expires unless it comes back in time
                log.warning("etcd lease refresh failed: %s", exc)

    async def close(self, revoke: bool = True) -> None:
        """Deregister (``revoke``) or just stop refreshing (the lease then expires)."""
        if self._keepalive is not None:
            await cancel_and_wait([self._keepalive])
        if self._client is not None:
            if revoke and self._lease is not None:
                try:
                    await self._lease.revoke()
                except Exception as exc:
                    log.warning("etcd lease revoke failed: %s", exc)
            await self._client.close()
            self._client = None


class EtcdDiscovery:
    """The router side: mirror the registered workers into a ``Fleet``."""

    def __init__(
        self,
        fleet: Any,
        url: str,
        *,
        namespace: str = "default",
        default_engine: str = "vllm",
        timeout: float = 5.0,
    ) -> None:
        self.mirror = FleetMirror(fleet, "etcd", default_engine)
        self.stats = self.mirror.stats
        self.url = url
        self.prefix = workers_prefix(namespace).encode()
        self.timeout = timeout
        self.synced = asyncio.Event()  # the first full read is applied
        self._client: Any = None
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        self._client = await _client(self.url, self.timeout)
        revision = await self._read_all()
        self.synced.set()
        self._task = asyncio.create_task(self._watch(revision), name="kvplug-etcd-watch")
        log.info(
            "discovery: %d workers from %s%s",
            len(self.mirror.workers),
            self.url,
            self.prefix.decode(),
        )

    async def close(self) -> None:
        await cancel_and_wait([self._task])
        if self._client is not None:
            await self._client.close()
            self._client = None

    async def _read_all(self) -> int:
        got = await self._client.get_prefix(self.prefix)
        wanted = {}
        for kv in got:
            worker_id = self._worker_id(kv.key)
            mapping = self._decode(worker_id, kv.value)
            if mapping is not None:
                wanted[worker_id] = (mapping, bool(mapping.pop("draining", False)))
        await self.mirror.replace_all(wanted)  # also removes workers deleted while unwatched
        return int(got.header.revision)

    async def _watch(self, revision: int) -> None:
        while True:
            try:
                watch = await self._client.watch_prefix(self.prefix, start_revision=revision + 1)
                async for event in watch:
                    revision = max(revision, int(event.kv.mod_revision))
                    worker_id = self._worker_id(event.kv.key)
                    if event.kind == "PUT":
                        mapping = self._decode(worker_id, event.kv.value)
                        if mapping is not None:
                            draining = bool(mapping.pop("draining", False))
                            await self.mirror.put(worker_id, mapping, draining)
                    else:
                        await self.mirror.delete(worker_id)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # compaction, etcd restart: re-read, then watch again
                self.stats.watch_restarts += 1
                log.warning("discovery: watch of %s ended (%s); re-reading", self.url, exc)
                await asyncio.sleep(1.0)
                try:
                    revision = await self._read_all()
                except Exception as exc2:
                    log.warning("discovery: re-read failed: %s", exc2)

    def _worker_id(self, key: bytes) -> str:
        return key[len(self.prefix) :].decode("utf-8", "replace")

    def _decode(self, worker_id: str, value: bytes) -> Any:
        """The worker mapping (``"draining"`` is etcd-only: the mirror drains the worker)."""
        try:
            mapping = json.loads(value.decode("utf-8"))
        except ValueError as exc:
            self.mirror._invalid(worker_id, f"not JSON: {exc}")
            return None
        if not isinstance(mapping, dict):
            self.mirror._invalid(worker_id, "not a JSON object")
            return None
        return mapping
