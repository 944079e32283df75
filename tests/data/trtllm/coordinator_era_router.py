"""Stand-in for TensorRT-LLM's ``tensorrt_llm/serve/router.py`` in the form with the disagg
coordinator (see tests/test_trtllm_conditional_disagg.py, which loads it as that module)."""

import asyncio
from abc import ABC, abstractmethod

import aiohttp


class Router(ABC):
    def __init__(
        self,
        server_role,
        servers,
        metadata_server_cfg,
        metadata_server,
        server_preparation_func=None,
        **kwargs,
    ):
        self._servers = servers or []
        self._metadata_server = metadata_server
        self._server_info = {}
        self._server_role = server_role
        self._lock = asyncio.Lock()
        self._session = None
        self._server_preparation_func = server_preparation_func
        self._prepared_ready_servers = set()

    async def close(self):
        if self._session:
            await self._session.close()
            self._session = None

    @abstractmethod
    def _on_servers_updated(self, old_servers, new_servers): ...

    @abstractmethod
    async def get_next_server(self, request, exclude_server=None, req_id=None): ...

    @abstractmethod
    async def finish_request(self, request, session=None, success=True, req_id=None): ...

    @property
    def session(self):
        if not self._session:
            self._session = aiohttp.ClientSession()
        return self._session


class RoundRobinRouter(Router):
    def __init__(
        self, server_role, servers=None, metadata_server_cfg=None, metadata_server=None, **kwargs
    ):
        super().__init__(server_role, servers, metadata_server_cfg, metadata_server, **kwargs)
        self._index = 0

    def _on_servers_updated(self, old_servers, new_servers):
        pass

    async def get_next_server(self, request, exclude_server=None, req_id=None):
        server = self._servers[self._index % len(self._servers)]
        self._index += 1
        return server, {}

    async def finish_request(self, request, session=None, success=True, req_id=None):
        pass


class KvCacheAwareRouter(Router):
    """Interface only: TRT-LLM's own KV-aware router is never placed with here."""

    def routing_key(self, request): ...

    async def get_next_server_by_key(self, routing_key, exclude_server=None, req_id=None): ...


class CoordinatorDelegatingRouter(Router):
    def __init__(self, coordinator_url, local_router, role, request_timeout_s=5.0):
        self._local = local_router
        self._role = role


def create_router(
    router_config,
    servers,
    metadata_server_cfg=None,
    metadata_server=None,
    server_preparation_func=None,
    disagg_node_id=0,
):
    router_map = {"round_robin": RoundRobinRouter, "kv_cache_aware": KvCacheAwareRouter}
    router_type = router_config.type if router_config else "round_robin"
    router_class = router_map.get(router_type.lower())
    if router_class is None:
        raise ValueError(
            f"Unsupported router type: {router_type}. "
            f"Supported types are: {list(router_map.keys())}"
        )
    extra_args = router_config.args if router_config else {}
    extra_args["disagg_node_id"] = disagg_node_id
    return router_class(
        router_config.server_role if router_config else None,
        servers,
        metadata_server_cfg,
        metadata_server,
        server_preparation_func=server_preparation_func,
        **extra_args,
    )
