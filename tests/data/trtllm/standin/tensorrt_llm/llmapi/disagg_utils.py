"""Stand-in: the names ``tensorrt_llm/serve/router.py`` imports from ``llmapi.disagg_utils``."""

from dataclasses import dataclass, field
from enum import IntEnum


class ServerRole(IntEnum):
    CONTEXT = 0
    GENERATION = 1
    MM_ENCODER = 2


@dataclass
class RouterConfig:
    type: str = "round_robin"
    args: dict = field(default_factory=dict)
    server_role: ServerRole | None = None


@dataclass
class MetadataServerConfig:
    server_type: str = "etcd"
    hostname: str = "localhost"
    port: int = 2379
    health_check_timeout: float = 5.0
