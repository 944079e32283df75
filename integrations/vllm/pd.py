"""vLLM disaggregated prefill/decode (NixlConnector, pull mode): the two request bodies.

Hop 1 (router -> prefill engine): the client's request, not streamed, one output token, with
``kv_transfer_params`` asking the engine to keep the KV for a remote decoder. Hop 2 (router ->
decode engine): the client's original request plus the prefill answer's ``kv_transfer_params``
*unchanged* — its keys grew over versions (``remote_block_ids`` per KV group, expiry, transfer
mode...), so it is opaque JSON here. Both hops carry the same ``X-Request-Id``: vLLM pairs the
transfer by it.
"""

from __future__ import annotations

import uuid
from typing import Any

from kvplug.adapters import VLLM_PREFILL_KV_TRANSFER_PARAMS as PREFILL_KV_TRANSFER_PARAMS
from kvplug.adapters import PDProtocolError, vllm_prefill_body, vllm_transfer_params

__all__ = [
    "PREFILL_KV_TRANSFER_PARAMS",
    "MissingTransferParams",
    "decode_body",
    "new_request_id",
    "pd_headers",
    "prefill_body",
    "transfer_params",
]


class MissingTransferParams(PDProtocolError):
    """The prefill answer has no ``kv_transfer_params`` (engine not a kv_producer?)."""


def new_request_id() -> str:
    return str(uuid.uuid4())


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The prefill hop's body (the client's body is not modified)."""
    return vllm_prefill_body(body)


def transfer_params(prefill_response: dict[str, Any] | None) -> dict[str, Any]:
    """The prefill answer's ``kv_transfer_params`` (top level; some builds nest it in choices)."""
    params = vllm_transfer_params(prefill_response)
    if params is None:
        raise MissingTransferParams(
            "prefill answer has no kv_transfer_params: is the prefill engine started with a "
            "NixlConnector in kv_role kv_producer (--kv-transfer-config)?"
        )
    return params


def decode_body(body: dict[str, Any], prefill_response: dict[str, Any] | None) -> dict[str, Any]:
    """The decode hop's body: the client's request plus the prefill's params, unchanged."""
    out = dict(body)
    out["kv_transfer_params"] = transfer_params(prefill_response)
    return out


def pd_headers(request_id: str, headers: dict[str, str] | None = None) -> dict[str, str]:
    """Headers for both hops: the caller's plus the shared ``X-Request-Id``."""
    out = dict(headers or {})
    out = {k: v for k, v in out.items() if k.lower() != "x-request-id"}
    out["X-Request-Id"] = request_id
    return out
