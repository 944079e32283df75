"""Stand-in for ``tensorrt_llm/serve/router.py`` at 00895e31: the ``Router`` ABC (constructor,
``session``, abstract ``get_next_server`` / ``finish_request`` / ``_on_servers_updated``), one
concrete router and ``create_router`` with its fixed type map (no ``remote_http``)."""

import asyncio
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable

import aiohttp

from tensorrt_llm.llmapi.disagg_utils import MetadataServerConfig, RouterConfig, ServerRole


class Router(ABC):
    def __init__(
        self,
        server_role: ServerRole,
        servers: list[str],
        metadata_server_cfg: MetadataServerConfig | None,
        metadata_server,
        server_preparation_func: Callable[[str], Awaitable[None]] | None = None,
        **kwargs,
    ):
        self._servers = servers or []
        self._metadata_server = metadata_server
        self._server_info: dict = {}
        self._server_role = server_role
        self._lock = asyncio.Lock()
        self._session = None
        self._server_preparation_func = server_preparation_func

    async def close(self):
        if self._session:
            await self._session.close()
            self._session = None

    @abstractmethod
    def _on_servers_updated(self, old_servers, new_servers): ...

    @property
    def servers(self) -> list[str]:
        return self._servers

    @abstractmethod
    async def get_next_server(self, request, exclude_server: str | None = None): ...

    @abstractmethod
    async def finish_request(self, request, session=None, success: bool = True): ...

    @property
    def session(self) -> aiohttp.ClientSession:
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

    async def get_next_server(self, request, exclude_server=None):
        server = self._servers[self._index % len(self._servers)]
        self._index += 1
        return server, {}

    async def finish_request(self, request, session=None, success=True):
        pass


def create_router(
    router_config: RouterConfig | None,
    servers: list[str] | None,
    metadata_server_cfg: MetadataServerConfig | None = None,
    metadata_server=None,
    server_preparation_func=None,
    disagg_node_id: int = 0,
) -> Router:
    router_map = {"round_robin": RoundRobinRouter}
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
