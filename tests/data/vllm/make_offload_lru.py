"""vLLM's own CPU offloading manager, driven as its offloading connector drives it: a fixture of
the order in which it evicts its copies (run with the vLLM venv's python, from outside the repo
so nothing shadows vLLM's imports).

    cd /tmp && ~/.cache/kvplug/vllm-venv/bin/python \
        /path/to/kvplug/tests/data/vllm/make_offload_lru.py [OUT.json]

``vllm.v1.kv_offload.cpu.manager.CPUOffloadingManager`` (6 chunks, the LRU policy, events on) is
called as vLLM 0.32.0's ``OffloadingConnectorScheduler`` calls it
(``distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py``): ``on_new_request``; a
prefix hit is ``lookup`` up to the first miss, then ``prepare_load`` and ``complete_load`` (the
connector never calls ``touch``); a store is ``prepare_store`` then ``complete_store`` (left in
flight once, to pin a write); a finish is ``on_request_finished``. Every eviction comes from
vLLM: ``prepare_store``'s ``evicted_keys``, checked against ``take_events()``; the residents'
order from the policy's ranks, and the whole eviction order from its own ``evict()`` on a copy.
Writes ``offload_lru-<vLLM version>.json`` beside this file by default; the simulator's inclusive
host tier is held to it by ``tests/test_sim_cache.py``.
"""

import copy
import json
import os
import sys

import vllm
from vllm.v1.kv_offload.base import (
    LookupResult,
    ReqContext,
    get_offload_block_hash,
    make_offload_key,
)
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

TOKENS_PER_CHUNK = 16  # only used for ReqContext positions, as the connector sets them
GROUP_IDX = 0


def key_of(i: int):
    """int -> OffloadKey (32-byte 'block hash' + 4-byte group index, base.py:29-31)."""
    return make_offload_key(i.to_bytes(32, "big"), GROUP_IDX)


def int_of(key) -> int:
    return int.from_bytes(get_offload_block_hash(key), "big")


class Driver:
    def __init__(self, use_touch: bool):
        self.use_touch = use_touch
        self.m = CPUOffloadingManager(
            num_chunks=6, cache_policy="lru", enable_events=True, store_threshold=1
        )
        self.ctx: dict[str, ReqContext] = {}
        self.ops: list[dict] = []

    # --- request lifecycle, mirroring OffloadingConnectorScheduler ---
    def new_request(self, req: str, prompt_keys: list[int]):
        # scheduler.py on_new_request -> _create_req_context + manager.on_new_request
        ctx = ReqContext(req_id=req)
        self.m.on_new_request(ctx)
        # scheduler.py RequestOffloadState.update_offload_keys: key positions
        for n, k in enumerate(prompt_keys, 1):
            ctx.set_offload_key_position(key_of(k), n * TOKENS_PER_CHUNK)
        self.ctx[req] = ctx

    def load(self, req: str, prompt_keys: list[int], note: str = ""):
        """Prefix lookup (stops at first MISS), then prepare_load + complete_load."""
        ctx = self.ctx[req]
        calls, lookups, hits = [], {}, []
        for k in prompt_keys:  # scheduler.py _maximal_prefix_lookup
            r = self.m.lookup(key_of(k), ctx)
            lookups[str(k)] = r.name
            calls.append(f"lookup({k})->{r.name}")
            if r is LookupResult.MISS:
                break
            hits.append(k)
        if hits:
            if self.use_touch:
                self.m.touch([key_of(k) for k in hits], ctx)
                calls.append(f"touch({hits})")
            # scheduler.py update_state_after_alloc -> prepare_load
            self.m.prepare_load([key_of(k) for k in hits], ctx)
            calls.append(f"prepare_load({hits})")
            # scheduler.py update_connector_output -> complete_load
            self.m.complete_load({key_of(k) for k in hits}, ctx)
            calls.append(f"complete_load({hits})")
        self._record("load", req, prompt_keys, calls, [], note, lookups=lookups, hit_keys=hits)
        return hits

    def store(self, req: str, keys: list[int], complete: bool = True, note: str = ""):
        ctx = self.ctx[req]
        # scheduler.py _build_store_jobs -> prepare_store
        out = self.m.prepare_store([key_of(k) for k in keys], ctx)
        calls = [f"prepare_store({keys})"]
        if out is None:
            calls[-1] += "->None"
            self._record("store", req, keys, calls, [], note, store_failed=True)
            return None
        stored = [int_of(k) for k in out.keys_to_store]
        evicted = [int_of(k) for k in out.evicted_keys]
        if complete:
            self.complete_store(req, stored, _calls=calls)
        self._record(
            "store", req, keys, calls, evicted, note, keys_to_store=stored, store_completed=complete
        )
        return stored

    def complete_store(self, req: str, keys: list[int], _calls=None, note=""):
        # scheduler.py update_connector_output -> complete_store(set(keys_to_store))
        self.m.complete_store({key_of(k) for k in keys}, self.ctx[req])
        if _calls is not None:
            _calls.append(f"complete_store({keys})")
        else:
            self._record("complete_store", req, keys, [f"complete_store({keys})"], [], note)

    def finish(self, req: str, note: str = ""):
        # scheduler.py build_connector_meta -> manager.on_request_finished
        self.m.on_request_finished(self.ctx[req])
        self._record("finish", req, [], ["on_request_finished()"], [], note)

    # --- introspection (read-only on the live manager) ---
    def _state(self):
        pol = self.m._policy
        resident = sorted(pol.chunks, key=lambda k: pol._ranks[k])
        pinned = {str(int_of(k)): c.ref_cnt for k, c in pol.chunks.items() if c.ref_cnt != 0}
        # Ask vLLM's LRUCachePolicy.evict itself, on a copy, for the full eviction order.
        probe = copy.deepcopy(pol)
        order = []
        while True:
            got = probe.evict(1, set())
            if not got:
                break
            order.append(int_of(got[0][0]))
        return {
            "resident_after": [int_of(k) for k in resident],
            "eviction_order_after": order,
            "pinned_after": pinned,
            "ranks_after": {str(int_of(k)): pol._ranks[k] for k in resident},
        }

    def _record(self, op, req, keys, calls, evicted, note, **extra):
        events = [
            # stored-event keys come from iterating the set the connector passes
            # to complete_store (hash-order), so sort them; removed keys keep
            # the order the policy evicted them in.
            {
                "removed": e.removed,
                "keys": [int_of(k) for k in e.keys]
                if e.removed
                else sorted(int_of(k) for k in e.keys),
            }
            for e in self.m.take_events()
        ]
        ev_from_events = [k for e in events if e["removed"] for k in e["keys"]]
        assert ev_from_events == evicted, (ev_from_events, evicted)
        entry = {"op": op, "request": req, "keys": keys, "evicted": evicted}
        entry.update(self._state())
        entry["calls"] = calls
        entry["events"] = events
        entry.update(extra)
        if note:
            entry["note"] = note
        self.ops.append(entry)


def scenario(d: Driver):
    d.new_request("A", [1, 2, 3])
    d.store("A", [1, 2, 3])
    d.finish("A", "finish re-ranks A's keys in reverse prefix order: tail 3 is now LRU")

    d.new_request("B", [4, 5, 6])
    d.store("B", [4, 5, 6])
    d.finish("B")

    d.new_request("C", [1, 2, 7, 8])
    d.load("C", [1, 2, 7, 8], "prefix hit on 1,2; 7 MISS ends the lookup")
    d.store(
        "C",
        [7, 8],
        note="C's new chunks; 1,2 are unpinned again and C has not "
        "finished, so its hit is not yet counted as a use",
    )
    d.finish("C")

    d.new_request("D", [9, 10, 11])
    d.store("D", [9, 10, 11])
    d.finish("D")

    d.new_request("E", [1, 2, 12])
    d.load("E", [1, 2, 12], "partial hit: 1 HIT, 2 MISS")
    d.store("E", [2, 12], note="chunks after the loaded prefix")
    d.finish("E")

    d.new_request("F", [9, 10, 11, 13])
    d.store(
        "F",
        [9, 10, 11, 13],
        note="9,10,11 came from the GPU prefix cache, so the "
        "connector offers them again (next_stored_chunk_idx stays 0): re-store of "
        "present keys; they are protected during this call only",
    )
    d.finish("F", "re-offered keys 9,10,11 refreshed here, not at prepare_store")

    d.new_request("G", [14, 15])
    d.store("G", [14, 15], complete=False, note="write in flight (ref_cnt -1)")
    d.new_request("H", [16, 17, 18])
    d.store("H", [16, 17, 18], note="G's in-flight 14,15 cannot be evicted")
    d.complete_store("G", [14, 15], note="G's write done; G not finished")
    d.new_request("J", [19, 20])
    d.store(
        "J",
        [19, 20],
        note="G and H unfinished but their completed chunks are "
        "evictable, ordered by insertion rank (head first)",
    )
    d.finish("G")
    d.finish("H")
    d.finish("J")


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else None
    for use_touch, desc in [
        (False, "calls as vLLM's OffloadingConnectorScheduler makes them (no manager.touch)")
    ]:
        d = Driver(use_touch)
        scenario(d)
        doc = {
            "vllm_version": vllm.__version__,
            "source": "vllm.v1.kv_offload.cpu.manager.CPUOffloadingManager lru",
            "manager_args": {
                "num_chunks": 6,
                "cache_policy": "lru",
                "enable_events": True,
                "store_threshold": 1,
            },
            "call_sequence": desc,
            "key_encoding": "make_offload_key(int.to_bytes(32,'big'), group_idx=0); ints recorded",
            "fields": {
                "resident_after": "resident keys by policy rank, oldest first",
                "eviction_order_after": "order LRUCachePolicy.evict() would evict "
                "(run on a deepcopy); excludes pinned keys",
                "pinned_after": "ref_cnt != 0 (-1 = write in flight, >0 = loading)",
            },
            "ops": d.ops,
        }
        name = out or os.path.join(
            os.path.dirname(os.path.abspath(__file__)), f"offload_lru-{vllm.__version__}.json"
        )
        with open(name, "w") as f:
            json.dump(doc, f, indent=1)
            f.write("\n")
        print(name)
        for e in d.ops:
            print(
                f"  {e['op']:14} {e['request']} {e['keys']!s:16} evicted={e['evicted']!s:12}"
                f" order={e['eviction_order_after']} pinned={e['pinned_after']}"
            )


if __name__ == "__main__":
    sys.exit(main())
