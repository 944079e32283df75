"""How fast can anything hash token ids from a Python list? A loop that only reads them.

bench_core's hashing aim (kvplug >= 10x Dynamo on the token lists a decoded vLLM event gives)
is bounded by reading the list: every token is an item pointer, an int object's type and size
words and its digit, each checked (an exact int in [0, 2**32)) before any hashing. This
compiles that read alone (C, ``cc -O3``; no hashing; one C call over many lists, the cost of
the call itself taken off) and times it beside kvplug's ``seq_hashes`` on the same lists (one
Python call per list), kvplug's hashing of the same tokens from numpy (no int objects), and
Dynamo's ``compute_block_hash_for_seq`` when ``ai-dynamo`` is installed, in turns.

Three cases: 256 event-sized lists hashed pass after pass (~4 MB of int objects: out of the L2
cache, as bench_core's event lists are); 8 of them (in the cache); and the 256 as a subscriber
meets them, each read once right after it was decoded from msgpack (8 at a time, the decode off
the clock). The read loop is a reference, not a proven minimum; Dynamo's time per token over
the loop's is what a free hash on top of such a read would reach against Dynamo.

    python benchmarks/bench_list_read_floor.py [--rounds 5] [--passes 10]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import random
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout
sys.path.insert(0, str(Path(__file__).resolve().parent))  # hostinfo

from hostinfo import cpu_model  # noqa: E402

from kvplug import core  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "list_read_floor.json"
BS = 16

# Reads and checks every item as kvplug's list reader must (exact int, one digit or zero);
# sums the tokens in pairs so the loads cannot be dropped. Four independent lanes: no
# loop-carried chain but the sums.
READ_FLOOR_C = r"""
#include <Python.h>
#include <stdint.h>
static int read_items(PyObject *const *items, Py_ssize_t n, uint64_t *acc) {
    uint64_t x0 = 0, x1 = 0, bad = 0;
    Py_ssize_t i = 0;
    for (; i + 3 < n; i += 4) {
        uint64_t d[4];
        for (int k = 0; k < 4; k++) {
            PyObject *a = items[i + k];
            bad |= (uint64_t)(Py_TYPE(a) != &PyLong_Type);
            Py_ssize_t s = Py_SIZE(a);
            bad |= (uint64_t)((size_t)s > 1);
            d[k] = ((PyLongObject *)a)->ob_digit[0] & (uint64_t)(-(int64_t)s);
        }
        x0 += d[0] | (d[1] << 32);
        x1 += d[2] | (d[3] << 32);
    }
    for (; i < n; i++) {
        PyObject *a = items[i];
        bad |= (uint64_t)(Py_TYPE(a) != &PyLong_Type) | (uint64_t)((size_t)Py_SIZE(a) > 1);
        x0 += ((PyLongObject *)a)->ob_digit[0];
    }
    *acc ^= x0 ^ x1;
    return bad == 0;
}
int read_lists(PyObject *const *const *lists, const Py_ssize_t *ns, int count, uint64_t *acc) {
    int ok = 1;
    for (int j = 0; j < count; j++) ok &= read_items(lists[j], ns[j], acc);
    return ok;
}
"""


def layout_supported() -> bool:
    """The read loop reads CPython 3.10/3.11's int layout (3.12 changed it)."""
    return sys.implementation.name == "cpython" and sys.version_info < (3, 12)


def build_floor(workdir: Path) -> ctypes.PyDLL:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise SystemExit("bench_list_read_floor needs a C compiler (cc), as building kvplug does")
    src, lib = workdir / "read_floor.c", workdir / "read_floor.so"
    src.write_text(READ_FLOOR_C)
    include = sysconfig.get_paths()["include"]
    subprocess.run(
        [cc, "-O3", "-shared", "-fPIC", f"-I{include}", str(src), "-o", str(lib)], check=True
    )
    dll = ctypes.PyDLL(str(lib))
    dll.read_lists.argtypes = [
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_int,
        ctypes.POINTER(ctypes.c_uint64),
    ]
    return dll


def item_pointers(lists: list[list[int]]) -> tuple[ctypes.Array, ctypes.Array]:
    """Each list's item array (CPython's ob_item, read through the C API's layout: the
    PyListObject header is three words, then the item pointer)."""
    if sys.implementation.name != "cpython":
        raise SystemExit("bench_list_read_floor reads CPython's list layout")
    offset = 3 * ctypes.sizeof(ctypes.c_void_p)
    ptrs = [ctypes.c_void_p.from_address(id(lst) + offset).value for lst in lists]
    return (ctypes.c_void_p * len(lists))(*ptrs), (ctypes.c_ssize_t * len(lists))(
        *[len(lst) for lst in lists]
    )


def event_lists(n: int, seed: int) -> list[list[int]]:
    """Event-sized token lists (8-42 blocks of 16, ids below 128 k), int objects made in
    list order as a decoder makes them."""
    rng = random.Random(seed)
    return [[rng.randrange(128_000) for _ in range(BS * rng.randint(8, 42))] for _ in range(n)]


def call_overhead(dll) -> float:
    """Seconds of one ``read_lists`` call that reads nothing (ctypes' own cost, ~0.7 µs),
    taken off the read loop's times: it is not reading."""
    ptrs, lens = (ctypes.c_void_p * 1)(), (ctypes.c_ssize_t * 1)()
    acc = ctypes.c_uint64(0)
    best = float("inf")
    for _ in range(200):
        t0 = time.perf_counter()
        dll.read_lists(ptrs, lens, 0, ctypes.byref(acc))
        best = min(best, time.perf_counter() - t0)
    return best


def time_best(run, prepared, passes: int) -> float:
    best = float("inf")
    for _ in range(passes):
        t0 = time.perf_counter()
        run(prepared)
        best = min(best, time.perf_counter() - t0)
    return best


def methods(dll, dynamo) -> dict[str, tuple[Callable, Callable]]:
    """name -> (prepare, run): ``prepare(lists)`` makes what the method is handed, off the
    clock; ``run`` of it is timed. The read loop is handed the lists' raw item arrays: their
    caller keeps the lists alive while it runs."""
    acc = ctypes.c_uint64(0)

    def read_loop(prepared: tuple[ctypes.Array, ctypes.Array, int]) -> None:
        ptrs, lens, count = prepared
        if not dll.read_lists(ptrs, lens, count, ctypes.byref(acc)):
            raise AssertionError("read floor: an item is not a small exact int")

    def hash_each(fn: Callable) -> Callable:
        def run(items: list) -> None:
            for x in items:
                fn(x, BS)

        return run

    def same(lists: list[list[int]]) -> list[list[int]]:
        return lists

    out: dict[str, tuple[Callable, Callable]] = {
        "read_floor": (lambda lists: (*item_pointers(lists), len(lists)), read_loop),
        "kvplug_list": (same, hash_each(core.seq_hashes)),
        "kvplug_numpy": (
            lambda lists: [np.array(x, np.uint32) for x in lists],
            hash_each(core.seq_hashes),
        ),
    }
    if dynamo is not None:
        out["dynamo_list"] = (same, hash_each(dynamo.compute_block_hash_for_seq))
    return out


def measure(lists: list[list[int]], dll, dynamo, passes: int, order: list[str]) -> dict:
    n_tok = sum(len(lst) for lst in lists)
    fns = methods(dll, dynamo)
    best = {}
    for name in order:
        if name in fns:
            prepare, run = fns[name]
            best[name] = time_best(run, prepare(lists), passes)
    overhead = call_overhead(dll)
    out = {"read_floor_raw": best["read_floor"] / n_tok * 1e9, "call_overhead_s": overhead}
    best["read_floor"] -= overhead  # one call per pass
    return {**out, **{name: t / n_tok * 1e9 for name, t in best.items()}}


def measure_decoded(
    encoded: list[bytes], dll, dynamo, passes: int, order: list[str], chunk: int = 8
) -> dict:
    """As a subscriber meets them: every method reads lists it has just decoded from msgpack
    (fresh int objects, read once), `chunk` at a time; best of `passes` totals."""
    import msgspec

    dec = msgspec.msgpack.Decoder(list[int])
    fns = methods(dll, dynamo)
    overhead = call_overhead(dll)  # one read_lists call per chunk
    n_tok = 0
    best: dict[str, float] = {}
    for p in range(passes):
        total = dict.fromkeys(fns, 0.0)
        for i in range(0, len(encoded), chunk):
            for name in order if (p + i // chunk) % 2 == 0 else order[::-1]:
                if name not in fns:
                    continue
                prepare, run = fns[name]
                lists = [dec.decode(b) for b in encoded[i : i + chunk]]
                if p == 0 and name == "read_floor":
                    n_tok += sum(len(lst) for lst in lists)
                prepared = prepare(lists)
                t0 = time.perf_counter()
                run(prepared)
                total[name] += time.perf_counter() - t0 - (overhead if name == "read_floor" else 0)
        for name, t in total.items():
            best[name] = min(best.get(name, float("inf")), t)
    calls = -(-len(encoded) // chunk)  # one read_lists call per chunk
    raw = (best["read_floor"] + calls * overhead) / n_tok * 1e9
    return {
        "read_floor_raw": raw,
        "call_overhead_s": overhead,
        **{name: t / n_tok * 1e9 for name, t in best.items()},
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--passes", type=int, default=10, help="best of this many per round")
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args(argv)
    if not layout_supported():
        raise SystemExit("bench_list_read_floor reads CPython 3.10/3.11's int layout")
    try:
        import dynamo._core as dynamo  # ai-dynamo-runtime (benchmarks extra)
    except ImportError:
        dynamo = None
        print("Dynamo not installed: kvplug and the read floor only", file=sys.stderr)
    import msgspec

    built = event_lists(256, 1)
    cases = {
        "out_of_cache_256_lists": built,
        "in_cache_8_lists": built[:8],
        "as_decoded_256_lists": built,  # each read once, just decoded, 8 at a time
    }
    encoded = [msgspec.msgpack.encode(lst) for lst in built]
    names = ["read_floor", "kvplug_list", "kvplug_numpy", "dynamo_list"]
    rounds: dict[str, list[dict]] = {c: [] for c in cases}
    with tempfile.TemporaryDirectory() as tmp:
        dll = build_floor(Path(tmp))
        for r in range(args.rounds):
            order = names if r % 2 == 0 else names[::-1]
            for case, lists in cases.items():
                if case.startswith("as_decoded"):
                    rd = measure_decoded(encoded, dll, dynamo, args.passes, order)
                else:
                    rd = measure(lists, dll, dynamo, args.passes, order)
                rounds[case].append(rd)
            print(f"round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    out: dict = {
        "benchmark": "bench_list_read_floor",
        "command": "python benchmarks/bench_list_read_floor.py " + " ".join(argv or sys.argv[1:]),
        "python": sys.version.split()[0],
        "core_backend": core.backend,
        "cpu_model": cpu_model(),
        "rounds": args.rounds,
        "passes": args.passes,
        "cases": {},
    }
    print("ns per token (range over rounds; best of passes in each round)")
    print(f"{'case':24} {'method':14} {'ns/token':>14}")
    for case, rds in rounds.items():
        lists = cases[case]
        summary: dict = {
            "lists": len(lists),
            "tokens": sum(len(lst) for lst in lists),
            "ns_per_token": {},
        }
        for name in names:
            if name not in rds[0]:
                continue
            xs = [rd[name] for rd in rds]
            summary["ns_per_token"][name] = {
                "min": min(xs),
                "median": statistics.median(xs),
                "max": max(xs),
            }
            print(f"{case:24} {name:14} {min(xs):6.3f}-{max(xs):6.3f}")
        if dynamo is not None:
            ceiling = [rd["dynamo_list"] / rd["read_floor"] for rd in rds]
            kvplug = [rd["dynamo_list"] / rd["kvplug_list"] for rd in rds]
            summary["dynamo_over_read_floor"] = {"min": min(ceiling), "max": max(ceiling)}
            summary["dynamo_over_kvplug_list"] = {"min": min(kvplug), "max": max(kvplug)}
            print(
                f"{case:24} Dynamo / read loop {min(ceiling):.1f}-{max(ceiling):.1f}x,"
                f" Dynamo / kvplug {min(kvplug):.1f}-{max(kvplug):.1f}x"
            )
        summary["rounds"] = rds
        out["cases"][case] = summary
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
