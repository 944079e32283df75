"""Workers discovered from the Kubernetes API: the EndpointSlices of a Service.

``kvplug serve --discovery kubernetes://NAMESPACE/SERVICE`` lists the Service's EndpointSlices
(``discovery.k8s.io/v1``, label ``kubernetes.io/service-name``) and watches them from the
list's ``resourceVersion``. Each endpoint is a worker: id = its Pod's name, URL = its address and
the Service's port (``?port=NAME`` picks a named port), labels ``zone`` and ``node``. Ready
endpoints route; serving-but-terminating ones are drained (in-flight requests finish, nothing
new goes there); others leave. A watch that ends is resumed, and a ``410 Gone`` (history
compacted) relists, as client-go's informers do.

Credentials are the Pod's service account (``KUBERNETES_SERVICE_HOST``, the mounted token and
CA), so the RBAC a deployment needs is ``get/list/watch`` on ``endpointslices``. HTTP is
aiohttp (a core dependency); the API's JSON is read as documented, with no client library.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import ssl
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import aiohttp

from kvplug.discovery.mirror import FleetMirror
from kvplug.errors import ConfigError
from kvplug.tasks import cancel_and_wait

log = logging.getLogger(__name__)

SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")


def parse_kubernetes_url(url: str) -> dict[str, str]:
    """``kubernetes://NAMESPACE/SERVICE[?port=NAME&engine=KIND&scheme=http]`` -> its parts."""
    parts = urlsplit(url)
    path = parts.path.strip("/")
    if parts.scheme not in ("kubernetes", "k8s") or not parts.netloc or not path or "/" in path:
        raise ConfigError(
            f"discovery URL {url!r}: expected kubernetes://NAMESPACE/SERVICE[?port=NAME]"
        )
    query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
    unknown = set(query) - {"port", "engine", "scheme"}
    if unknown:
        raise ConfigError(f"discovery URL {url!r}: unknown options {sorted(unknown)}")
    return {"namespace": parts.netloc, "service": path, **query}


def workers_from_slices(
    slices: dict[str, dict[str, Any]], port_name: str | None, scheme: str, engine: str | None
) -> dict[str, tuple[dict[str, Any], bool]]:
    """The workers a set of EndpointSlices describes: id -> (worker mapping, draining)."""
    wanted: dict[str, tuple[dict[str, Any], bool]] = {}
    for sl in slices.values():
        ports = sl.get("ports") or []
        port = next((p for p in ports if port_name is None or p.get("name") == port_name), None)
        if port is None or not isinstance(port.get("port"), int):
            continue  # no such port on this slice (yet)
        for ep in sl.get("endpoints") or []:
            addresses = ep.get("addresses") or []
            if not addresses:
                continue
            cond = ep.get("conditions") or {}
            ready = cond.get("ready") is not False  # unset means ready (API semantics)
            serving = cond.get("serving", ready) is not False
            terminating = cond.get("terminating") is True
            if not (ready or (serving and terminating)):
                continue
            address = str(addresses[0])
            host = f"[{address}]" if ":" in address else address
            ref = ep.get("targetRef") or {}
            worker_id = ref.get("name") if ref.get("kind") == "Pod" else None
            worker_id = str(worker_id or f"{address}:{port['port']}")
            labels = {}
            if ep.get("zone"):
                labels["zone"] = str(ep["zone"])
            if ep.get("nodeName"):
                labels["node"] = str(ep["nodeName"])
            mapping: dict[str, Any] = {"url": f"{scheme}://{host}:{port['port']}", "labels": labels}
            if engine:
                mapping["engine"] = engine
            wanted[worker_id] = (mapping, terminating and not ready)
    return wanted


class KubernetesDiscovery:
    def __init__(
        self,
        fleet: Any,
        *,
        api_url: str,
        namespace: str,
        service: str,
        token: str | None = None,
        ca_file: str | None = None,
        port_name: str | None = None,
        scheme: str = "http",
        engine: str | None = None,
        default_engine: str = "vllm",
        timeout: float = 10.0,
        watch_timeout_s: int = 300,
    ) -> None:
        self.mirror = FleetMirror(fleet, "kubernetes", default_engine)
        self.stats = self.mirror.stats
        self.api_url = api_url.rstrip("/")
        self.namespace = namespace
        self.service = service
        self.token = token
        self.ca_file = ca_file
        self.port_name = port_name
        self.scheme = scheme
        self.engine = engine
        self.timeout = timeout
        self.watch_timeout_s = watch_timeout_s
        self.slices: dict[str, dict[str, Any]] = {}
        self.synced = asyncio.Event()
        self._session: aiohttp.ClientSession | None = None
        self._task: asyncio.Task | None = None

    @classmethod
    def from_url(cls, fleet: Any, url: str, default_engine: str = "vllm") -> KubernetesDiscovery:
        """In-cluster: the API server and credentials of the Pod's service account."""
        opts = parse_kubernetes_url(url)
        host = os.environ.get("KUBERNETES_SERVICE_HOST")
        port = os.environ.get("KUBERNETES_SERVICE_PORT", "443")
        if not host:
            raise ConfigError(
                f"--discovery {url}: not running in a Kubernetes Pod (KUBERNETES_SERVICE_HOST "
                "is not set)"
            )
        token_file = SERVICE_ACCOUNT / "token"
        ca = SERVICE_ACCOUNT / "ca.crt"
        return cls(
            fleet,
            api_url=f"https://{host}:{port}",
            namespace=opts["namespace"],
            service=opts["service"],
            token=token_file.read_text().strip() if token_file.exists() else None,
            ca_file=str(ca) if ca.exists() else None,
            port_name=opts.get("port"),
            scheme=opts.get("scheme", "http"),
            engine=opts.get("engine"),
            default_engine=default_engine,
        )

    # -- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> None:
        ssl_ctx: ssl.SSLContext | bool = True
        if self.ca_file:
            ssl_ctx = ssl.create_default_context(cafile=self.ca_file)
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        self._session = aiohttp.ClientSession(
            headers=headers, connector=aiohttp.TCPConnector(ssl=ssl_ctx)
        )
        try:
            version = await self._list()
        except Exception as exc:
            await self._session.close()
            raise ConnectionError(f"cannot list EndpointSlices at {self.api_url}: {exc}") from None
        self.synced.set()
        self._task = asyncio.create_task(self._watch_loop(version), name="kvplug-k8s-watch")
        log.info(
            "kubernetes discovery: %d workers from service %s/%s",
            len(self.mirror.workers),
            self.namespace,
            self.service,
        )

    async def close(self) -> None:
        await cancel_and_wait([self._task])
        if self._session is not None:
            await self._session.close()

    # -- the API -------------------------------------------------------------------------------
    def _url(self) -> str:
        return f"{self.api_url}/apis/discovery.k8s.io/v1/namespaces/{self.namespace}/endpointslices"

    def _selector(self) -> dict[str, str]:
        return {"labelSelector": f"kubernetes.io/service-name={self.service}"}

    async def _list(self) -> str:
        assert self._session is not None
        timeout = aiohttp.ClientTimeout(total=self.timeout)
        async with self._session.get(self._url(), params=self._selector(), timeout=timeout) as r:
            if r.status != 200:
                raise ConnectionError(f"list answered {r.status}: {(await r.text())[:200]}")
            body = await r.json(content_type=None)
        self.slices = {}
        for item in body.get("items") or []:
            name = (item.get("metadata") or {}).get("name")
            if isinstance(name, str):
                self.slices[name] = item
            else:
                self.stats.invalid += 1
        await self._apply()
        return str((body.get("metadata") or {}).get("resourceVersion", ""))

    async def _apply(self) -> None:
        await self.mirror.replace_all(
            workers_from_slices(self.slices, self.port_name, self.scheme, self.engine)
        )

    async def _watch_loop(self, version: str) -> None:
        while True:
            try:
                version = await self._watch(version)
            except asyncio.CancelledError:
                raise
            except _Gone:
                log.info("kubernetes discovery: watch history gone (410); relisting")
                version = await self._relist()
            except Exception as exc:
                self.stats.watch_restarts += 1
                log.warning("kubernetes discovery: watch failed (%s); relisting", exc)
                await asyncio.sleep(1.0)
                version = await self._relist()

    async def _relist(self) -> str:
        while True:
            try:
                return await self._list()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("kubernetes discovery: list failed (%s); retrying", exc)
                await asyncio.sleep(2.0)

    async def _watch(self, version: str) -> str:
        """One watch request; returns the last resourceVersion seen (to resume from)."""
        assert self._session is not None
        params = {
            **self._selector(),
            "watch": "1",
            "allowWatchBookmarks": "true",
            "resourceVersion": version,
            "timeoutSeconds": str(self.watch_timeout_s),
        }
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.timeout)
        async with self._session.get(self._url(), params=params, timeout=timeout) as r:
            if r.status == 410:
                raise _Gone()
            if r.status != 200:
                raise ConnectionError(f"watch answered {r.status}")
            async for line in r.content:
                if not line.strip():
                    continue
                version = await self._event(line, version)
        return version

    async def _event(self, line: bytes, version: str) -> str:
        try:
            event = json.loads(line)
            kind = event["type"]
            obj = event["object"]
            meta = obj.get("metadata") or {}
        except (ValueError, KeyError, TypeError, AttributeError):
            self.stats.invalid += 1
            return version
        if kind == "ERROR":
            if obj.get("code") == 410:
                raise _Gone()
            raise ConnectionError(f"watch error: {obj.get('message')}")
        version = str(meta.get("resourceVersion") or version)
        if kind == "BOOKMARK":
            return version
        name = meta.get("name")
        if not isinstance(name, str):
            self.stats.invalid += 1
            return version
        if kind == "DELETED":
            self.slices.pop(name, None)
        elif kind in ("ADDED", "MODIFIED"):
            self.slices[name] = obj
        else:
            self.stats.invalid += 1
            return version
        await self._apply()
        return version


class _Gone(Exception):
    """The API server no longer has the requested resourceVersion (HTTP 410)."""
