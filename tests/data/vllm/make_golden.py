"""Regenerate the golden vLLM KV-event payloads in this folder (run from the repo root).

    python tests/data/vllm/make_golden.py

Each payload is what one vLLM version puts in frame 2, built from the documented schema
(PROTOCOLS.md §1.3; vLLM's ``vllm/distributed/kv_events.py``): msgspec structs declared the way
vLLM declares them (tagged, ``omit_defaults``; ``array_like`` events before 0.24), one struct set
per version with that version's fields in declaration order. This file shares no code with
``integrations/vllm/wire.py``, so a test that decodes these payloads (and re-encodes the expected
events back to the same bytes) checks the integration against the schema, not against itself.
When the vLLM 0.32 venv is available (``.ci/setup_vllm.sh``), ``v0.32.0-vllm.bin`` is produced
by vLLM's own classes instead.

Output per case: ``<name>.bin`` (payload bytes) and ``<name>.json`` (version, hash form and the
expected normalised events).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgspec

HERE = Path(__file__).resolve().parent
TS = 1795997663.76

# The events every case carries (engine hashes as u64; the wire form varies per case).
H = [0x384A361AC53B1E2B, 0xF00DFACE12345678, 0x0123456789ABCDEF, 0x8000000000000001]
TOKENS = [(7 * i + 3) % 500 for i in range(64)]  # two blocks of 32


def wire_hash(h: int, form: str) -> Any:
    if form == "uint64":
        return h
    if form == "int64":
        return h - (1 << 64) if h >= (1 << 63) else h
    return bytes(range(24)) + h.to_bytes(8, "big")  # 32-byte digest, low 64 bits = h


def structs(version: tuple[int, int, int]):
    """vLLM's event classes as declared in ``version`` (fields in declaration order)."""
    array = version < (0, 24, 0)

    class Base(msgspec.Struct, omit_defaults=True, tag=True, array_like=array):
        pass

    ns: dict[str, Any] = {}
    stored = [
        ("block_hashes", list[Any], msgspec.NODEFAULT),
        ("parent_block_hash", Any, msgspec.NODEFAULT),
        ("token_ids", list[int], msgspec.NODEFAULT),
        ("block_size", int, msgspec.NODEFAULT),
        ("lora_id", Any, msgspec.NODEFAULT),
    ]
    removed = [("block_hashes", list[Any], msgspec.NODEFAULT)]
    if version >= (0, 10, 2):
        stored.append(("medium", Any, msgspec.NODEFAULT))
        removed.append(("medium", Any, msgspec.NODEFAULT))
    if version >= (0, 14, 0):
        stored.append(("lora_name", Any, msgspec.NODEFAULT))
    if version >= (0, 17, 0):
        stored.append(("extra_keys", Any, None))
    if version >= (0, 20, 0):
        stored.append(("group_idx", Any, None))
        removed.append(("group_idx", Any, None))
    if version >= (0, 22, 0):
        stored += [("kv_cache_spec_kind", Any, None), ("kv_cache_spec_sliding_window", Any, None)]
    if version >= (0, 26, 0):
        stored.append(("locality", Any, None))
        removed.append(("locality", Any, None))
    ns["BlockStored"] = msgspec.defstruct("BlockStored", stored, bases=(Base,))
    ns["BlockRemoved"] = msgspec.defstruct("BlockRemoved", removed, bases=(Base,))
    ns["AllBlocksCleared"] = msgspec.defstruct("AllBlocksCleared", [], bases=(Base,))
    batch_fields = [("ts", float), ("events", list[Any])]
    if version >= (0, 9, 2):
        batch_fields.append(("data_parallel_rank", Any, None))
    ns["Batch"] = msgspec.defstruct(
        "KVEventBatch", batch_fields, array_like=True, omit_defaults=True
    )
    return ns


def case(name: str, version: str, form: str, *, salt: bool, rank: int = 0, extra: bool = False):
    v = tuple(int(x) for x in version.split("."))
    s = structs(v)
    fields = s["BlockStored"].__struct_fields__
    kw: dict[str, Any] = {
        "block_hashes": [wire_hash(h, form) for h in H[:2]],
        "parent_block_hash": None,
        "token_ids": TOKENS,
        "block_size": 32,
        "lora_id": None,
    }
    if "medium" in fields:
        kw["medium"] = "GPU"
    if "lora_name" in fields:
        kw["lora_name"] = None
    if "extra_keys" in fields and salt:
        kw["extra_keys"] = [("tenant-1",), None]
    if "group_idx" in fields:
        kw["group_idx"] = 0
    stored1 = s["BlockStored"](**kw)
    kw2 = dict(
        kw,
        block_hashes=[wire_hash(H[2], form)],
        token_ids=TOKENS[:32],
        parent_block_hash=wire_hash(H[1], form),
    )
    if "extra_keys" in kw2:
        kw2["extra_keys"] = None
    stored2 = s["BlockStored"](**kw2)
    rm_kw: dict[str, Any] = {"block_hashes": [wire_hash(H[0], form)]}
    if "medium" in s["BlockRemoved"].__struct_fields__:
        rm_kw["medium"] = "GPU"
    if "group_idx" in s["BlockRemoved"].__struct_fields__:
        rm_kw["group_idx"] = 0
    removed = s["BlockRemoved"](**rm_kw)
    rm2 = s["BlockRemoved"](**dict(rm_kw, block_hashes=[wire_hash(H[2], form)]))
    events = [stored1, stored2, removed, rm2, s["AllBlocksCleared"]()]
    batch_kw: dict[str, Any] = {"ts": TS, "events": events}
    if v >= (0, 9, 2):
        batch_kw["data_parallel_rank"] = rank
    payload = msgspec.msgpack.encode(s["Batch"](**batch_kw))
    worker = "w"
    expected = [
        {
            "kind": "BlockStored",
            "worker_id": worker,
            "dp_rank": rank,
            "tier": 0,
            "parent_engine_hash": None,
            "engine_hashes": H[:2],
            "token_ids": TOKENS,
            "block_size": 32,
            "lora_name": None,
            "cache_salt": "tenant-1" if salt and v >= (0, 17, 0) else None,
        },
        {
            "kind": "BlockStored",
            "worker_id": worker,
            "dp_rank": rank,
            "tier": 0,
            "parent_engine_hash": H[1],
            "engine_hashes": [H[2]],
            "token_ids": TOKENS[:32],
            "block_size": 32,
            "lora_name": None,
            "cache_salt": None,
        },
        {
            "kind": "BlockRemoved",
            "worker_id": worker,
            "dp_rank": rank,
            "tier": 0,
            "engine_hashes": [H[0], H[2]],
        },
        {"kind": "AllCleared", "worker_id": worker, "dp_rank": rank},
    ]
    (HERE / f"{name}.bin").write_bytes(payload)
    (HERE / f"{name}.json").write_text(
        json.dumps(
            {
                "version": version,
                "hash_form": form,
                "salt": salt,
                "dp_rank": rank,
                "expected": expected,
            },
            indent=1,
        )
        + "\n"
    )
    print(f"{name}: {len(payload)} bytes")


VLLM_SNIPPET = r"""
import sys, msgspec
from vllm.distributed.kv_events import KVEventBatch, BlockStored, BlockRemoved, AllBlocksCleared
H = [int(x) for x in sys.argv[1].split(",")]
T = [int(x) for x in sys.argv[2].split(",")]
ev = [BlockStored(block_hashes=H[:2], parent_block_hash=None, token_ids=T, block_size=32,
                  lora_id=None, medium="GPU", lora_name=None, extra_keys=[("tenant-1",), None],
                  group_idx=0),
      BlockStored(block_hashes=[H[2]], parent_block_hash=H[1], token_ids=T[:32], block_size=32,
                  lora_id=None, medium="GPU", lora_name=None, group_idx=0),
      BlockRemoved(block_hashes=[H[0]], medium="GPU", group_idx=0),
      BlockRemoved(block_hashes=[H[2]], medium="GPU", group_idx=0),
      AllBlocksCleared()]
sys.stdout.buffer.write(msgspec.msgpack.encode(KVEventBatch(ts=float(sys.argv[3]), events=ev,
                                                            data_parallel_rank=0)))
"""


def vllm_case(vllm_python: str) -> None:
    out = subprocess.run(
        [
            vllm_python,
            "-c",
            VLLM_SNIPPET,
            ",".join(map(str, H)),
            ",".join(map(str, TOKENS)),
            repr(TS),
        ],
        capture_output=True,
        check=True,
        cwd="/",
    ).stdout
    (HERE / "v0.32.0-vllm.bin").write_bytes(out)
    print(f"v0.32.0-vllm: {len(out)} bytes (vLLM's own encoder)")


if __name__ == "__main__":
    case("v0.9.0-int64", "0.9.0", "int64", salt=False)
    case("v0.9.2-int64", "0.9.2", "int64", salt=False, rank=1)
    case("v0.10.2-uint64", "0.10.2", "uint64", salt=False)
    case("v0.17.0-uint64", "0.17.0", "uint64", salt=True)
    case("v0.23.0-bytes", "0.23.0", "bytes", salt=True)
    case("v0.24.0-uint64", "0.24.0", "uint64", salt=True)
    case("v0.32.0-uint64", "0.32.0", "uint64", salt=True)
    case("v0.32.0-bytes", "0.32.0", "bytes", salt=True)
    if len(sys.argv) > 1:
        vllm_case(sys.argv[1])
