"""Builds the TensorRT-LLM fixtures in this folder from TRT-LLM's documented JSON shapes.

TRT-LLM cannot be installed here (CUDA-only wheels), so these are kvplug-made: each envelope
has the keys, order and nesting ``tensorrt_llm._utils.KVCacheEventSerializer`` emits (1.x) or
that 2026 builds add (``hash_algo``, ``layer_group_id``, per-block ``cache_salt``, ``lora_id``,
``mm_keys``), and each file is rendered the way ``trtllm-serve`` answers (FastAPI
``JSONResponse``: compact separators, UTF-8). One file = one drained ``POST /kv_cache_events``
answer; ``*_drains.json`` files hold a list of consecutive answers for the poller tests.

``python tests/data/trtllm/build.py`` rewrites the files; the tests rebuild them in memory and
demand the committed bytes.

Fixture geometry: ``tokens_per_block`` 4 (TRT-LLM's default is 32; small blocks keep the
fixtures readable). Hashes are uint64, several above 2**63.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
BIG1 = 2**64 - 1
BIG2 = 2**63 + 12345
BIG3 = 18_000_000_000_000_000_000
TPB = 4


def render(value: Any) -> bytes:
    """What FastAPI's JSONResponse sends."""
    return json.dumps(
        value, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":")
    ).encode("utf-8")


def tok(ids: list[int | str], extra: int = 0) -> list[dict[str, Any]]:
    return [{"type": "unique_token", "token_id": t, "token_extra_id": extra} for t in ids]


def block_1x(h: int, ids: list[int], level: int = 0) -> dict[str, Any]:
    return {
        "type": "stored_block",
        "block_hash": h,
        "tokens": tok(ids),
        "cache_level": level,
        "priority": 35,
    }


def env_1x(
    event_id: int, data: dict[str, Any], window: int = 4096, rank: int | None = None
) -> dict[str, Any]:
    out: dict[str, Any] = {"event_id": event_id, "data": data, "window_size": window}
    if rank is not None:
        out["attention_dp_rank"] = rank
    return out


def diff(old: int, new: int) -> dict[str, Any]:
    return {"type": "event_diff", "new_value": new, "old_value": old}


def v1_events() -> list[dict[str, Any]]:
    """A 1.x-era drain: start-up, stores (one ending in a partial block), offload, eviction."""
    return [
        env_1x(0, {"type": "created", "num_blocks_per_cache_level": [1024, 4096]}),
        env_1x(
            1,
            {
                "type": "stored",
                "parent_hash": None,
                "blocks": [block_1x(101, [1, 2, 3, 4]), block_1x(BIG1, [5, 6, 7, 8])],
            },
        ),
        env_1x(
            2,
            {
                "type": "stored",
                "parent_hash": BIG1,
                "blocks": [block_1x(BIG2, [9, 10, 11, 12]), block_1x(103, [13, 14])],
            },
        ),
        env_1x(
            3,
            {
                "type": "updated",
                "block_hash": 101,
                "cache_level": diff(0, 1),
                "priority": diff(35, 35),
            },
        ),
        env_1x(
            4,
            {
                "type": "updated",
                "block_hash": BIG2,
                "cache_level": diff(0, 0),
                "priority": diff(35, 80),
            },
        ),
        env_1x(5, {"type": "removed", "block_hashes": [103, BIG2]}),
        env_1x(
            6,
            {
                "type": "stored",
                "parent_hash": None,
                "blocks": [block_1x(BIG3, [20, 21, 22, 23], level=1)],
            },
        ),
    ]


def block_2026(
    h: int,
    ids: list[int | str],
    *,
    level: int = 0,
    salt: str | None = None,
    lora: int | None = None,
    mm: list[dict[str, Any]] | None = None,
    extra: int = 0,
) -> dict[str, Any]:
    out: dict[str, Any] = {
        "type": "stored_block",
        "block_hash": h,
        "tokens": tok(ids, extra),
        "cache_level": level,
        "priority": 35,
    }
    if lora is not None:
        out["lora_id"] = lora
    if mm is not None:
        out["mm_keys"] = mm
    if salt is not None:
        out["cache_salt"] = salt
    return out


def env_2026(event_id: int, data: dict[str, Any], window: int, rank: int) -> dict[str, Any]:
    return {
        "event_id": event_id,
        "data": data,
        "window_size": window,
        "attention_dp_rank": rank,
        "hash_algo": "v1_block_key",
        "layer_group_id": 0,
    }


def v2026_vswa_adp_events() -> list[dict[str, Any]]:
    """A 2026 drain from an attention-DP (2 ranks), variable-sliding-window (512/8192) engine."""
    mm = [{"type": "mm_key", "hash": "ab" * 32, "start_offset": 0}]
    return [
        env_2026(0, {"type": "created", "num_blocks_per_cache_level": [64, 0]}, 512, 0),
        env_2026(1, {"type": "created", "num_blocks_per_cache_level": [2048, 8192]}, 8192, 0),
        env_2026(0, {"type": "created", "num_blocks_per_cache_level": [64, 0]}, 512, 1),
        env_2026(1, {"type": "created", "num_blocks_per_cache_level": [2048, 8192]}, 8192, 1),
        # the same store once per window: only the 8192 window is indexed
        env_2026(
            2,
            {
                "type": "stored",
                "parent_hash": None,
                "blocks": [block_2026(BIG1, [1, 2, 3, 4], salt="tenant-a", lora=3)],
            },
            512,
            0,
        ),
        env_2026(
            3,
            {
                "type": "stored",
                "parent_hash": None,
                "blocks": [
                    block_2026(BIG1, [1, 2, 3, 4], salt="tenant-a", lora=3),
                    block_2026(201, [5, 6, 7, 8], salt="tenant-a", lora=3),
                    block_2026(202, [9, 10, 11, 12], salt="tenant-a", lora=3, level=1),
                ],
            },
            8192,
            0,
        ),
        # rank 1: a multimodal block, then a block whose token ids are hex strings (V2 mm)
        env_2026(
            2,
            {
                "type": "stored",
                "parent_hash": None,
                "blocks": [
                    block_2026(301, [7, 7, 7, 7], mm=mm),
                    block_2026(302, ["0x1f", "0x20", "0x21", "0x22"]),
                    block_2026(303, [1, 1, 1, 1]),
                ],
            },
            8192,
            1,
        ),
        env_2026(
            3,
            {"type": "updated", "block_hash": 301, "cache_level": None, "priority": diff(35, 90)},
            8192,
            1,
        ),
        env_2026(4, {"type": "removed", "block_hashes": [202]}, 8192, 0),
    ]


def gap_restart_drains() -> list[list[dict[str, Any]]]:
    """Consecutive answers of one worker: normal, a gap (events 3-4 lost), an empty drain, an
    engine restart (ids back to 0 with created), then normal again."""
    return [
        [
            env_1x(0, {"type": "created", "num_blocks_per_cache_level": [100, 0]}),
            env_1x(
                1,
                {
                    "type": "stored",
                    "parent_hash": None,
                    "blocks": [block_1x(11, [1, 2, 3, 4]), block_1x(12, [5, 6, 7, 8])],
                },
            ),
            env_1x(
                2, {"type": "stored", "parent_hash": 12, "blocks": [block_1x(13, [9, 10, 11, 12])]}
            ),
        ],
        [
            env_1x(
                5, {"type": "stored", "parent_hash": None, "blocks": [block_1x(14, [1, 2, 3, 4])]}
            ),
            env_1x(
                6, {"type": "stored", "parent_hash": 14, "blocks": [block_1x(15, [30, 31, 32, 33])]}
            ),
        ],
        [],
        [
            env_1x(0, {"type": "created", "num_blocks_per_cache_level": [100, 0]}),
            env_1x(
                1,
                {"type": "stored", "parent_hash": None, "blocks": [block_1x(21, [40, 41, 42, 43])]},
            ),
        ],
        [env_1x(2, {"type": "removed", "block_hashes": [21]})],
    ]


def context_response() -> dict[str, Any]:
    """A context-only completion answer (1.2-era shape; ``encoded_opaque_state`` is opaque)."""
    return {
        "id": "cmpl-ctx-1",
        "object": "text_completion",
        "created": 1760000000,
        "model": "llama",
        "choices": [
            {
                "index": 0,
                "text": " the",
                "token_ids": None,
                "logprobs": None,
                "context_logits": None,
                "finish_reason": "length",
                "stop_reason": None,
                "disaggregated_params": {
                    "request_type": "context_only",
                    "first_gen_tokens": [279],
                    "ctx_request_id": 4611686018427387905,
                    "encoded_opaque_state": "AAECAwQFBgcICQ==",
                    "draft_tokens": None,
                    "disagg_request_id": 4611686018427387905,
                    "ctx_dp_rank": 1,
                    "ctx_info_endpoint": None,
                    "schedule_style": None,
                },
                "avg_decoded_tokens_per_iter": None,
            }
        ],
        "usage": {
            "prompt_tokens": 6,
            "total_tokens": 7,
            "completion_tokens": 1,
            "prompt_tokens_details": {"cached_tokens": 4},
        },
        "prompt_token_ids": [1, 450, 4996, 17354, 1701, 29916],
    }


def iteration_stats() -> list[dict[str, Any]]:
    """Two drained ``GET /metrics`` iteration-stat entries; the last one is current."""

    def it(n: int, active: int, queued: int, used: int) -> dict[str, Any]:
        return {
            "iter": n,
            "iterLatencyMS": 12.5,
            "numActiveRequests": active,
            "numQueuedRequests": queued,
            "maxNumActiveRequests": 64,
            "gpuMemUsage": 123456789,
            "cpuMemUsage": 0,
            "pinnedMemUsage": 0,
            "kvCacheStats": {
                "maxNumBlocks": 1000,
                "freeNumBlocks": 1000 - used,
                "usedNumBlocks": used,
                "tokensPerBlock": 32,
                "allocTotalBlocks": used,
                "allocNewBlocks": 1,
                "reusedBlocks": 30,
                "missedBlocks": 10,
                "cacheHitRate": 0.75,
            },
            "inflightBatchingStats": {
                "numScheduledRequests": active,
                "numContextRequests": 1,
                "numGenRequests": active - 1,
                "numPausedRequests": 0,
                "numCtxTokens": 128,
                "microBatchId": 0,
                "avgNumDecodedTokensPerIter": 1.0,
            },
        }

    return [it(41, 3, 1, 200), it(42, 5, 2, 250)]


PROMETHEUS = """\
# HELP trtllm_num_requests_running Number of requests currently running.
# TYPE trtllm_num_requests_running gauge
trtllm_num_requests_running{model_name="llama",engine_type="trtllm"} 5.0
# HELP trtllm_num_requests_waiting Number of requests waiting.
# TYPE trtllm_num_requests_waiting gauge
trtllm_num_requests_waiting{model_name="llama",engine_type="trtllm"} 2.0
# HELP trtllm_kv_cache_utilization KV cache utilization.
# TYPE trtllm_kv_cache_utilization gauge
trtllm_kv_cache_utilization{model_name="llama",engine_type="trtllm"} 0.25
# HELP trtllm_kv_cache_hit_rate KV cache hit rate.
# TYPE trtllm_kv_cache_hit_rate gauge
trtllm_kv_cache_hit_rate{model_name="llama",engine_type="trtllm"} 0.75
# HELP trtllm_kv_cache_tokens_per_block Tokens per KV cache block.
# TYPE trtllm_kv_cache_tokens_per_block gauge
trtllm_kv_cache_tokens_per_block{model_name="llama",engine_type="trtllm"} 32.0
# HELP trtllm_kv_cache_max_blocks Maximum KV cache blocks.
# TYPE trtllm_kv_cache_max_blocks gauge
trtllm_kv_cache_max_blocks{model_name="llama",engine_type="trtllm"} 1000.0
# HELP trtllm_request_success_total Count of successfully processed requests.
# TYPE trtllm_request_success_total counter
trtllm_request_success_total{model_name="llama",engine_type="trtllm",finished_reason="stop"} 17.0
"""

FILES = {
    "v1_events.json": lambda: render(v1_events()),
    "v2026_vswa_adp_events.json": lambda: render(v2026_vswa_adp_events()),
    "gap_restart_drains.json": lambda: render(gap_restart_drains()),
    "context_response.json": lambda: render(context_response()),
    "iteration_stats.json": lambda: render(iteration_stats()),
    "prometheus_metrics.txt": lambda: PROMETHEUS.encode(),
}


def write() -> None:
    for name, build in FILES.items():
        (HERE / name).write_bytes(build())


if __name__ == "__main__":
    write()
