"""Reference block hashes from vLLM's own code (run with the vLLM venv's python).

    PYTHONHASHSEED=<seed or unset> ~/.cache/kvplug/vllm-venv/bin/python \
        tests/data/vllm/make_block_hashes.py CASES.json OUT.json

CASES.json: a list of {"algorithm", "block_size", "tokens", "cache_salt"}. For each case this
builds a real ``vllm.v1.request.Request`` whose block hasher is ``get_request_block_hasher`` with
``init_none_hash`` run for the algorithm (NONE_HASH from $PYTHONHASHSEED, else vLLM's default
seed), and records the digests (hex) and what an event carries with
``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`` on (``maybe_convert_block_hash``). Used by
``tests/test_sim_vllm_hashes.py`` (live, when the venv exists) and to regenerate
``block_hashes-0.32.0.json`` (``python tests/test_sim_vllm_hashes.py --regenerate``).
"""

import json
import os
import sys

os.environ.setdefault("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "1")

from vllm import SamplingParams  # noqa: E402
from vllm.utils.hashing import get_hash_fn_by_name  # noqa: E402
from vllm.v1.core import kv_cache_utils as kcu  # noqa: E402
from vllm.v1.request import Request  # noqa: E402


def main() -> None:
    cases = json.load(open(sys.argv[1]))
    out = []
    for i, case in enumerate(cases):
        fn = get_hash_fn_by_name(case["algorithm"])
        kcu.init_none_hash(fn)
        req = Request(
            request_id=f"ref-{i}",
            prompt_token_ids=list(case["tokens"]),
            sampling_params=SamplingParams(max_tokens=1),
            pooling_params=None,
            cache_salt=case.get("cache_salt"),
            block_hasher=kcu.get_request_block_hasher(case["block_size"], fn),
        )
        hashes = list(req.block_hashes)
        out.append(
            {
                **case,
                "seed": kcu.get_none_hash_seed(),
                "none_hash": bytes(kcu.NONE_HASH).hex(),
                "digests": [bytes(h).hex() for h in hashes],
                "int_hashes": [kcu.maybe_convert_block_hash(h) for h in hashes],
            }
        )
    json.dump(out, open(sys.argv[2], "w"), indent=1)


if __name__ == "__main__":
    main()
