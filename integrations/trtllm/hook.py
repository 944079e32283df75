"""``router: {type: kvplug}`` in ``trtllm-serve disaggregated``: kvplug as its router on
every ``tensorrt_llm/serve/router.py`` form read, including those with no ``remote_http``
or one that sends block hashes (``docs/trtllm.md`` §5).

``install()`` puts a finder on ``sys.meta_path`` that waits for ``tensorrt_llm.serve.router``
(the module ``trtllm-serve disaggregated`` picks each server role's router from). Right after
that module has run, ``patch`` wraps its ``create_router``: a config whose ``type`` is
``kvplug`` gets a ``KvplugRouter``, a subclass of the module's own ``Router`` ABC; every other
type goes to TRT-LLM's factory unchanged. ``KvplugRouter`` places each request by asking a
running ``kvplug serve`` (the ``remote_http`` protocol of ``remote_router.py``, on the role's
path ``/trtllm/{context|generation}/get_next_server``) and reports the end of each request
(``POST /trtllm/finish_request``), so kvplug's booked load is released exactly.

The hook never breaks TRT-LLM's import: if the module does not look like the interface it was
written against (``Router`` with ``get_next_server`` / ``finish_request`` /
``_on_servers_updated``, a callable ``create_router``), or anything in the patching raises, it
logs one warning and leaves the module as it was.

Interface pinned to NVIDIA/TensorRT-LLM ``tensorrt_llm/serve/router.py`` at
00895e31dc5f9865c6bdfd2dd0508a9d6d964e9d (``create_router(router_config, servers,
metadata_server_cfg, metadata_server, server_preparation_func, disagg_node_id)``; ``Router``
takes ``(server_role, servers, metadata_server_cfg, metadata_server, **kwargs)``). The later
form with the disagg coordinator (``CoordinatorDelegatingRouter``; ``get_next_server(request,
exclude_server=None, req_id=None)`` and ``finish_request(request, session=None, success=True,
req_id=None)``) keeps that constructor; ``KvplugRouter`` takes ``req_id`` through ``**kwargs``
and, like upstream's own routers outside the coordinator path, keys a placement by the request
object. It has no ``get_next_server_by_key``, so a ``CoordinatorClient`` places with it locally
in every orchestrator process (kvplug serve is the shared state) instead of delegating.

Conditional disaggregation (``conditional_disagg_config``): TRT-LLM lets only a
``KvCacheAwareRouter`` be the generation router and asks it for a prefix match; the forms read
in upstream's ``openai_disagg_service.py`` / ``openai_disagg_server.py`` check
``isinstance(gen_router, KvCacheAwareRouter)`` (a ``ValueError`` at start, an ``assert`` or a
``TypeError`` per request) and read ``info["match_length"]`` / ``info["num_tokens"]`` (newer) or
``sum(info["matches"])`` / the lengths of ``info["token_lists"]`` (older). ``KvplugRouter`` is
registered as a virtual subclass of the module's ``KvCacheAwareRouter`` (ABC ``register``:
``isinstance`` holds, nothing of its block tables or coordinator delegation is inherited) and
answers those keys with kvplug serve's own match (``matched_tokens`` / ``num_tokens``).

Activation (nothing is installed outside the ``kvplug`` name): ``KVPLUG_TRTLLM_HOOK=1`` in the
orchestrator's environment, read by the one-line ``kvplug_trtllm.pth`` the wheel puts in
site-packages (with the variable unset that line costs one dict lookup at interpreter start);
or ``python -m kvplug.integrations.trtllm.serve ...`` in place of ``trtllm-serve ...``; or
``kvplug.integrations.trtllm.hook.install()`` in a program that imports TRT-LLM itself.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import logging
import sys
from abc import ABCMeta
from types import ModuleType
from typing import Any

log = logging.getLogger("kvplug.trtllm.hook")

TARGET = "tensorrt_llm.serve.router"
ROUTER_TYPE = "kvplug"
ENV_VAR = "KVPLUG_TRTLLM_HOOK"
_PATCHED = "_kvplug_patched"
_ROLE_PATHS = {"CONTEXT": "context", "GENERATION": "generation"}


def router_class(upstream: ModuleType) -> type:
    """``KvplugRouter``: ``upstream.Router`` placing requests through a ``kvplug serve``."""
    import aiohttp

    base: Any = upstream.Router

    class KvplugRouter(base):  # type: ignore[misc,valid-type]
        def __init__(
            self,
            server_role: Any = None,
            servers: list[str] | None = None,
            metadata_server_cfg: Any = None,
            metadata_server: Any = None,
            url: str | None = None,
            request_timeout_s: float = 5.0,
            **kwargs: Any,
        ) -> None:
            super().__init__(server_role, servers, metadata_server_cfg, metadata_server, **kwargs)
            if not url:
                raise ValueError(
                    "router type 'kvplug' needs args.url: the kvplug serve URL "
                    "(e.g. http://kvplug-host:8000)"
                )
            base_url = url.rstrip("/")
            role = _ROLE_PATHS.get(getattr(server_role, "name", ""))
            self._kvplug_role = role
            self._place_url = (
                f"{base_url}/trtllm/{role}/get_next_server"
                if role
                else f"{base_url}/get_next_server"
            )
            self._finish_url = f"{base_url}/trtllm/finish_request"
            self._timeout = aiohttp.ClientTimeout(total=request_timeout_s)
            self._placements: dict[int, str] = {}  # id(request) -> kvplug's placement id

        def _on_servers_updated(self, old_servers: Any, new_servers: Any) -> None:
            pass  # kvplug serve owns the worker list (its --worker-config / admin API)

        async def get_next_server(
            self, request: Any, exclude_server: str | None = None, **kwargs: Any
        ) -> tuple[str, dict]:
            # ``req_id`` (the coordinator form's disagg request id) arrives in kwargs: unused,
            # placements are keyed by the request object as in upstream's standalone routers
            payload = request.model_dump(exclude_none=True)
            if exclude_server is not None:
                payload["exclude_server"] = exclude_server
            params = {"token_ids": "1"} if self._wants_token_ids(request) else None
            try:
                async with self.session.post(
                    self._place_url, json=payload, params=params, timeout=self._timeout
                ) as resp:
                    if resp.status != 200:
                        raise ValueError(f"kvplug returned {resp.status}: {await resp.text()}")
                    body = await resp.json()
            except ValueError:
                raise
            except Exception as exc:  # the orchestrator treats ValueError as "no server"
                raise ValueError(f"kvplug at {self._place_url} unreachable: {exc}") from exc
            server = body["server"]
            placement = body.get("request_id")
            if isinstance(placement, str):
                self._placements[id(request)] = placement
            matched_tokens = int(body.get("matched_tokens", 0))
            token_ids = body.get("token_ids")
            return server, {
                "matched_blocks": body.get("matched_blocks", 0),
                "server_info": self._server_info.get(server, {}),
                # conditional disaggregation's prefix match, in the keys each upstream form
                # reads: match_length / num_tokens, else sum(matches) / len of token_lists
                "match_length": matched_tokens,
                "num_tokens": int(body.get("num_tokens", 0)),
                "matches": [matched_tokens],
                "token_lists": [token_ids] if isinstance(token_ids, list) else [],
            }

        def _wants_token_ids(self, request: Any) -> bool:
            """Only the generation router, asked about a request that has not been through a
            context server (the conditional-disaggregation check), needs the prompt tokens
            back: older orchestrators count them from ``info["token_lists"]``."""
            if self._kvplug_role != "generation":
                return False
            params = getattr(request, "disaggregated_params", None)
            return getattr(params, "request_type", None) != "generation_only"

        async def finish_request(
            self, request: Any, session: Any = None, success: bool = True, **kwargs: Any
        ) -> None:
            placement = self._placements.pop(id(request), None)
            if placement is None:
                return
            try:
                async with self.session.post(
                    self._finish_url, json={"request_id": placement}, timeout=self._timeout
                ) as resp:
                    await resp.read()
            except Exception as exc:  # kvplug releases the booking on its own timer anyway
                log.debug("kvplug finish_request for %s failed: %s", placement, exc)

    KvplugRouter.__qualname__ = KvplugRouter.__name__ = "KvplugRouter"
    _pass_kv_cache_aware_gate(upstream, KvplugRouter)
    return KvplugRouter


def _pass_kv_cache_aware_gate(upstream: ModuleType, kvplug_router: type) -> None:
    """Make ``isinstance(router, upstream.KvCacheAwareRouter)`` hold for ``KvplugRouter``
    (conditional disaggregation's gate) without inheriting from it: a real subclass would
    carry TRT-LLM's own block tables and ``get_next_server_by_key``, on which a
    ``CoordinatorClient`` delegates placement to TRT-LLM's coordinator, bypassing kvplug."""
    kv_aware = getattr(upstream, "KvCacheAwareRouter", None)
    if isinstance(kv_aware, ABCMeta):
        kv_aware.register(kvplug_router)
    else:
        log.info(
            "kvplug: %s has no KvCacheAwareRouter ABC; router type %r cannot be the "
            "generation router of conditional disaggregation",
            upstream.__name__,
            ROUTER_TYPE,
        )


def _check_interface(module: ModuleType) -> None:
    router = getattr(module, "Router", None)
    if not isinstance(router, type):
        raise TypeError("no Router class")
    for name in ("get_next_server", "finish_request", "_on_servers_updated", "session"):
        if not hasattr(router, name):
            raise TypeError(f"Router has no {name}")
    if not callable(getattr(module, "create_router", None)):
        raise TypeError("no create_router function")


def patch(module: ModuleType) -> bool:
    """Teach ``module.create_router`` the ``kvplug`` type; False (module untouched, one
    warning) if the module is not the interface this was written against."""
    if getattr(module, _PATCHED, False):
        return True
    try:
        _check_interface(module)
        kvplug_router = router_class(module)
        original = module.create_router

        def create_router(router_config: Any, servers: Any, *args: Any, **kwargs: Any) -> Any:
            kind = getattr(router_config, "type", None)
            if not (isinstance(kind, str) and kind.lower() == ROUTER_TYPE):
                return original(router_config, servers, *args, **kwargs)
            metadata_server_cfg = args[0] if args else kwargs.get("metadata_server_cfg")
            metadata_server = args[1] if len(args) > 1 else kwargs.get("metadata_server")
            prepare = args[2] if len(args) > 2 else kwargs.get("server_preparation_func")
            extra = dict(getattr(router_config, "args", None) or {})
            return kvplug_router(
                getattr(router_config, "server_role", None),
                servers,
                metadata_server_cfg,
                metadata_server,
                server_preparation_func=prepare,
                **extra,
            )

        create_router.__wrapped__ = original  # type: ignore[attr-defined]
        create_router.__doc__ = original.__doc__
        module.KvplugRouter = kvplug_router  # type: ignore[attr-defined]
        module.create_router = create_router  # type: ignore[attr-defined]
        setattr(module, _PATCHED, True)
    except Exception as exc:
        log.warning(
            "kvplug: %s is not the router interface kvplug knows (%s); router type %r is "
            "unavailable, TRT-LLM's routers are unchanged",
            module.__name__,
            exc,
            ROUTER_TYPE,
        )
        return False
    log.info("kvplug: router type %r available in %s", ROUTER_TYPE, module.__name__)
    return True


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.loader.exec_module(module)  # TRT-LLM's own errors propagate as they would
        patch(module)  # never raises


class RouterHook(importlib.abc.MetaPathFinder):
    """Finds ``tensorrt_llm.serve.router`` through the other finders and patches it once it
    has run."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != TARGET:
            return None
        try:
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(fullname, path, target)
                if spec is not None and spec.loader is not None:
                    spec.loader = _PatchingLoader(spec.loader)
                    return spec
        except Exception as exc:
            log.warning("kvplug: could not hook %s (%s); it loads unpatched", TARGET, exc)
        return None


def install() -> None:
    """Patch ``tensorrt_llm.serve.router`` now if imported, else when it is (idempotent)."""
    module = sys.modules.get(TARGET)
    if module is not None:
        patch(module)
        return
    if not any(isinstance(f, RouterHook) for f in sys.meta_path):
        sys.meta_path.insert(0, RouterHook())


def uninstall() -> None:
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, RouterHook)]
