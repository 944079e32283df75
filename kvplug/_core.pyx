# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""kvplug._core: the compiled twin of kvplug._reference (same names, same answers).

Token inputs: numpy int32/uint32/int64/uint64 arrays, array.array, memoryviews of those, bytes /
bytearray / byte memoryviews (little-endian u32 tokens) are read in place; other integer
buffers and Python sequences are converted once. Hash inputs: numpy uint64/int64 (a view, no
copy) or any integer sequence (folded to u64 like the reference). The GIL is released around
large loops; a per-index lock keeps concurrent Python threads from interleaving inside C.
"""

import operator
from array import array

import numpy as np

cimport numpy as cnp
from cpython.long cimport PyLong_AsUnsignedLongLongMask, PyLong_CheckExact
from cpython.dict cimport PyDict_SetItem
from cpython.list cimport PyList_GET_ITEM
from cpython.ref cimport Py_REFCNT, PyObject


from libc.stdint cimport int32_t, int64_t, uint32_t, uint64_t
from libc.string cimport memset


cdef extern from "Python.h":
    long PyLong_AsLongAndOverflow(object obj, int *overflow) except? -1
    int PySlice_Unpack(object slice, Py_ssize_t *start, Py_ssize_t *stop,
                       Py_ssize_t *step) except -1
    dict _PyDict_NewPresized(Py_ssize_t minused)  # what Cython's own dict literals use

# Reading a list of ints is most of the cost of hashing or querying from Python lists (a vLLM
# event's tokens, a request's hashes): the generic conversions check and convert each int
# through the C API (~5-10 ns each). These read the int objects' digits directly (exact ints,
# 30-bit digits, CPython's layout) and give up (return 0) on anything else, which sends the
# caller to the generic path, so the answers and errors stay exactly those of that path.
cdef extern from *:
    """
    #include "kvp_internal.h"
    #if PYLONG_BITS_IN_DIGIT == 30 && !defined(PYPY_VERSION)
    #define KVPY_FAST_INTS 1
    #if PY_VERSION_HEX >= 0x030C0000
    /* 3.12+: lv_tag = ndigits << 3 | sign (0 positive, 1 zero, 2 negative) */
    #define KVPY_NDIGITS(o) ((Py_ssize_t)(((PyLongObject *)(o))->long_value.lv_tag >> 3))
    #define KVPY_NEGATIVE(o) ((((PyLongObject *)(o))->long_value.lv_tag & 3) == 2)
    #define KVPY_DIGITS(o) (((PyLongObject *)(o))->long_value.ob_digit)
    #else
    #define KVPY_NDIGITS(o) (Py_SIZE(o) < 0 ? -Py_SIZE(o) : Py_SIZE(o))
    #define KVPY_NEGATIVE(o) (Py_SIZE(o) < 0)
    #define KVPY_DIGITS(o) (((PyLongObject *)(o))->ob_digit)
    #endif
    #else
    #define KVPY_FAST_INTS 0
    #endif

    /* items[0..n) as u32: 1 if every item is an exact int in [0, 2**32), else 0. */
    static int kvpy_ints_to_u32(PyObject *const *restrict items, Py_ssize_t n,
                                uint32_t *restrict out) {
    #if KVPY_FAST_INTS
        for (Py_ssize_t i = 0; i < n; i++) {
            PyObject *o = items[i];
            if (Py_TYPE(o) != &PyLong_Type || KVPY_NEGATIVE(o)) return 0;
            Py_ssize_t nd = KVPY_NDIGITS(o);
            const digit *d = KVPY_DIGITS(o);
            if (nd <= 1) {
                out[i] = nd ? (uint32_t)d[0] : 0u;
            } else if (nd == 2 && d[1] < 4u) {
                out[i] = (uint32_t)d[0] | ((uint32_t)d[1] << 30);
            } else {
                return 0;
            }
        }
        return 1;
    #else
        (void)items; (void)n; (void)out;
        return 0;
    #endif
    }

    /* Ask for the int objects of items[0..n) ahead of reading them: a call's few dozen objects
     * (a store's two lists) then come from memory in parallel, not one miss at a time. */
    static inline void kvpy_prefetch_items(PyObject *const *items, Py_ssize_t n) {
        for (Py_ssize_t i = 0; i < n; i++) __builtin_prefetch(items[i]);
    }

    /* items[0..n) as u64: 1 if every item is an exact int in [0, 2**64), else 0. */
    static int kvpy_ints_to_u64(PyObject *const *restrict items, Py_ssize_t n,
                                uint64_t *restrict out) {
    #if KVPY_FAST_INTS
        for (Py_ssize_t i = 0; i < n; i++) {
            PyObject *o = items[i];
            if (Py_TYPE(o) != &PyLong_Type || KVPY_NEGATIVE(o)) return 0;
            Py_ssize_t nd = KVPY_NDIGITS(o);
            const digit *d = KVPY_DIGITS(o);
            switch (nd) {
            case 0: out[i] = 0; break;
            case 1: out[i] = d[0]; break;
            case 2: out[i] = (uint64_t)d[0] | ((uint64_t)d[1] << 30); break;
            case 3:
                if (d[2] >= 16u) return 0;
                out[i] = (uint64_t)d[0] | ((uint64_t)d[1] << 30) | ((uint64_t)d[2] << 60);
                break;
            default: return 0;
            }
        }
        return 1;
    #else
        (void)items; (void)n; (void)out;
        return 0;
    #endif
    }

    /* items[0..n) as 64-bit words of two u32 tokens each (out[k] = t[2k] | t[2k+1] << 32, the
     * high half of the last word 0 when n is odd): 1 if every item is an exact int in
     * [0, 2**32), else 0. */
    static inline int kvpy_ints_to_w64(PyObject *const *restrict items, Py_ssize_t n,
                                       uint64_t *restrict out) {
    #if KVPY_FAST_INTS
        uint32_t t[2];
        for (Py_ssize_t i = 0; i < n; i += 2) {
            for (int k = 0; k < 2; k++) {
                t[k] = 0;
                if (i + k >= n) break;
                PyObject *o = items[i + k];
                if (Py_TYPE(o) != &PyLong_Type || KVPY_NEGATIVE(o)) return 0;
                Py_ssize_t nd = KVPY_NDIGITS(o);
                const digit *d = KVPY_DIGITS(o);
                if (nd == 1) t[k] = (uint32_t)d[0];
                else if (nd == 2 && d[1] < 4u) t[k] = (uint32_t)d[0] | ((uint32_t)d[1] << 30);
                else if (nd != 0) return 0;
            }
            out[i / 2] = (uint64_t)t[0] | ((uint64_t)t[1] << 32);
        }
        return 1;
    #else
        (void)items; (void)n; (void)out;
        return 0;
    #endif
    }

    #if KVPY_FAST_INTS
    /* An exact int's size word (3.12+: lv_tag = ndigits << 3 | sign; earlier: ob_size, negative
     * for negative ints) and its value for a positive one-digit int. */
    #if PY_VERSION_HEX >= 0x030C0000
    #define KVPY_SIZE_WORD(o) ((uintptr_t)((PyLongObject *)(o))->long_value.lv_tag)
    #define KVPY_ONE_DIGIT_WORD ((uintptr_t)1 << 3)
    #else
    #define KVPY_SIZE_WORD(o) ((uintptr_t)Py_SIZE(o))
    #define KVPY_ONE_DIGIT_WORD ((uintptr_t)1)
    #endif
    /* The digit of an exact positive one-digit int; bad != 0 after anything else. An exact
     * int always has a first digit (CPython allocates one even for 0), so only the type needs a
     * branch (laid out as the fall-through: tokens are ints), and the size word is checked
     * without one. Another type's memory is not read. */
    static inline uint32_t kvpy_small_digit(PyObject *o, uint64_t *bad) {
        if (__builtin_expect(Py_TYPE(o) == &PyLong_Type, 1)) {
            *bad |= (uint64_t)(KVPY_SIZE_WORD(o) ^ KVPY_ONE_DIGIT_WORD);
            return (uint32_t)KVPY_DIGITS(o)[0];
        }
        *bad |= 1;
        return 0;
    }
    #endif

    /* items[0..n) as words (as kvpy_ints_to_w64). Tokens of a vocabulary (< 2**30) are
     * one-digit ints: read those without a branch per item, and everything else (0, larger
     * ints, non-ints) through kvpy_ints_to_w64's exact checks. */
    static inline int kvpy_tokens_to_w64(PyObject *const *restrict items, size_t n,
                                         uint64_t *restrict out) {
    #if KVPY_FAST_INTS
        uint64_t bad = 0;
        size_t i = 0;
        for (; i + 2 <= n; i += 2) {
            const uint64_t a = kvpy_small_digit(items[i], &bad);
            const uint64_t b = kvpy_small_digit(items[i + 1], &bad);
            out[i / 2] = a | (b << 32);
        }
        if (i < n) out[i / 2] = kvpy_small_digit(items[i], &bad);
        return !bad || kvpy_ints_to_w64(items, (Py_ssize_t)n, out);
    #else
        (void)items; (void)n; (void)out;
        return 0;
    #endif
    }

    #if KVPY_FAST_INTS && defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) \
        && defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    /* The 16-token block reader below (x86-64, GCC/clang, CPython's layout). Per token: the item
     * pointer, the type compared (the one branch), the size word folded into two block-wide
     * accumulators by two load-ops, the digit; ~5 instructions against ~7.5 for
     * kvpy_tokens_to_w64. The loop is bound by how many blocks fit in the core's reorder window
     * (a block's reads, local hash and chain step are one long dependency chain), so fewer
     * instructions per block is what pays, more than fewer loads. */
    #define KVPY_BLOCK16 1
    #define KVPY_CHAIN_LAG 2
    /* The size word sits right before the first digit on every layout read here (3.11's ob_size,
     * 3.12+'s lv_tag): the 8 bytes ending with the first digit are the size word's high half
     * (zero for a one-digit int: the block check below proves it) and the digit, i.e. digit << 32.
     * So a token pair's word t[2k] | t[2k+1] << 32 is two loads and one or. */
    #if PY_VERSION_HEX >= 0x030C0000
    _Static_assert(offsetof(PyLongObject, long_value.ob_digit) ==
                   offsetof(PyLongObject, long_value.lv_tag) + 8, "lv_tag precedes the digits");
    #else
    _Static_assert(offsetof(PyLongObject, ob_digit) == offsetof(PyVarObject, ob_size) + 8,
                   "ob_size precedes the digits");
    #endif
    /* or_acc |= size word; and_acc &= size word: two load-ops (as C the compiler loads once and
     * spends two more instructions). */
    #define KVPY_FOLD_SIZE(or_acc, and_acc, o)                                                  \
        __asm__("orq %2, %0; andq %2, %1"                                                     \
                : "+r"(or_acc), "+r"(and_acc)                                                   \
                : "m"(*(const uint64_t *)((const char *)KVPY_DIGITS(o) - 8)))
    /* One block of 16 items as 8 words (kph_local_w64's input): 1 when every item is an exact
     * positive one-digit int, 0 (words unspecified) otherwise. Every item's type is checked
     * before anything else of it is read: the size word and digit only of exact ints. A block
     * passes when the size words' or and and are both the one-digit word: KVPY_ONE_DIGIT_WORD is
     * a single bit, so every size word has that bit (the and) and no other (the or), i.e. each is
     * exactly a one-digit size (a zero, a negative, a two-digit int all fail and go through the
     * exact reader). */
    static inline int kvpy_block16_words(PyObject *const *restrict items, uint64_t w[8]) {
        const PyTypeObject *const int_type = &PyLong_Type;
        uint64_t or_acc = 0, and_acc = ~(uint64_t)0;
        for (int k = 0; k < 8; k++) {
            PyObject *const a = items[2 * k], *const b = items[2 * k + 1];
            if (__builtin_expect(Py_TYPE(a) != int_type, 0)) return 0;
            if (__builtin_expect(Py_TYPE(b) != int_type, 0)) return 0;
            KVPY_FOLD_SIZE(or_acc, and_acc, a);
            KVPY_FOLD_SIZE(or_acc, and_acc, b);
            uint64_t hi;
            memcpy(&hi, (const char *)KVPY_DIGITS(b) - 4, 8);
            w[k] = (uint64_t)KVPY_DIGITS(a)[0] | hi;
        }
        return ((or_acc ^ KVPY_ONE_DIGIT_WORD) | (and_acc ^ KVPY_ONE_DIGIT_WORD)) == 0;
    }
    /* Block b's local hash read exactly (kvpy_ints_to_w64: zeros, two-digit ints) when the fast
     * reader turns the block down; out of line, so the fast path's words stay in registers. */
    static __attribute__((noinline)) int kvpy_block16_exact(PyObject *const *items, uint64_t *h) {
        uint64_t w[8];
        if (!kvpy_ints_to_w64(items, 16, w)) return 0;
        *h = kph_local_w64((const unsigned char *)w, 16, 0);
        return 1;
    }

    /* kvpy_hash_items for 16-token blocks. The chained hash of block b - KVPY_CHAIN_LAG is taken
     * after block b's local hash (parked meanwhile in seq[b]): a block's local hash needs only
     * its own tokens, so the serial chain no longer waits on the latest block's reads and
     * multiplies, and the core overlaps more blocks. Inlined twice (lo NULL or not) so the test
     * leaves the loop. */
    static inline __attribute__((always_inline)) int kvpy_hash16(
            PyObject *const *items, size_t nb, uint64_t prev, uint64_t *lo, uint64_t *seq) {
        for (size_t b = 0; b < nb; b++) {
            uint64_t w[8], h;
            if (__builtin_expect(kvpy_block16_words(items + b * 16, w), 1))
                h = kph_local_w64((const unsigned char *)w, 16, 0);
            else if (!kvpy_block16_exact(items + b * 16, &h))
                return 0;
            seq[b] = h;
            if (b >= KVPY_CHAIN_LAG) {
                const size_t c = b - KVPY_CHAIN_LAG;
                const uint64_t hc = seq[c];
                prev = kvp_chain_hash_inline(prev, hc, 0);
                if (lo) lo[c] = hc;
                seq[c] = prev;
            }
        }
        for (size_t c = nb > KVPY_CHAIN_LAG ? nb - KVPY_CHAIN_LAG : 0; c < nb; c++) {
            const uint64_t hc = seq[c];
            prev = kvp_chain_hash_inline(prev, hc, 0);
            if (lo) lo[c] = hc;
            seq[c] = prev;
        }
        return 1;
    }
    #else
    #define KVPY_BLOCK16 0
    #endif

    /* Sequence (and, with lo, local) hashes of every full block of items[0..n), a list's or
     * tuple's items, read block by block from the int objects and hashed as they are read: no
     * token array, and for 16-token blocks (vLLM's and Dynamo's default) a block's tokens stay
     * in registers. The same hashes as kvp_hash_blocks (kph1's local hash,
     * kvp_chain_hash_inline). 1 if every item, the tail after the last full block too, is an
     * exact int in [0, 2**32); else 0 and the caller takes the generic path (which names the bad
     * token). bs <= KVPY_FUSED_MAX_BS. */
    #define KVPY_FUSED_MAX_BS 256
    static int kvpy_hash_items(PyObject *const *items, Py_ssize_t n, size_t bs, uint64_t seed,
                               uint64_t *lo, uint64_t *seq) {
    #if KVPY_FAST_INTS
        uint64_t buf[KVPY_FUSED_MAX_BS / 2];
        const size_t nb = (size_t)n / bs, tail = (size_t)n - nb * bs;
        uint64_t prev = seed;
        if (bs == 16) {
    #if KVPY_BLOCK16
            if (!(lo ? kvpy_hash16(items, nb, prev, lo, seq)
                     : kvpy_hash16(items, nb, prev, NULL, seq)))
                return 0;
    #else
            for (size_t b = 0; b < nb; b++) {
                uint64_t w[8];
                if (!kvpy_tokens_to_w64(items + b * 16, 16, w)) return 0;
                const uint64_t h = kph_local_w64((const unsigned char *)w, 16, 0);
                prev = kvp_chain_hash_inline(prev, h, 0);
                if (lo) lo[b] = h;
                seq[b] = prev;
            }
    #endif
        } else {
            for (size_t b = 0; b < nb; b++) {
                if (!kvpy_tokens_to_w64(items + b * bs, bs, buf)) return 0;
                const uint64_t h = kph_local_w64((const unsigned char *)buf, bs, 0);
                prev = kvp_chain_hash_inline(prev, h, 0);
                if (lo) lo[b] = h;
                seq[b] = prev;
            }
        }
        return tail == 0 || kvpy_tokens_to_w64(items + nb * bs, tail, buf);
    #else
        (void)items; (void)n; (void)bs; (void)seed; (void)lo; (void)seq;
        return 0;
    #endif
    }
    """
    int kvpy_ints_to_u32(PyObject **items, Py_ssize_t n, uint32_t *out)
    size_t KVPY_FUSED_MAX_BS
    int kvpy_hash_items(PyObject **items, Py_ssize_t n, size_t bs, uint64_t seed, uint64_t *lo,
                        uint64_t *seq)
    int kvpy_ints_to_u64(PyObject **items, Py_ssize_t n, uint64_t *out)
    void kvpy_prefetch_items(PyObject **items, Py_ssize_t n)
    PyObject **PySequence_Fast_ITEMS(object o)
from cpython.buffer cimport PyBUF_C_CONTIGUOUS, PyBUF_FORMAT, PyBuffer_Release, PyObject_CheckBuffer, PyObject_GetBuffer
from cpython.pythread cimport NOWAIT_LOCK, WAIT_LOCK, PyThread_acquire_lock, PyThread_allocate_lock, PyThread_free_lock, PyThread_release_lock, PyThread_type_lock
from libc.math cimport ceil, copysign, floor, fmod
from libc.stdlib cimport free, malloc, realloc
from libc.string cimport memcpy, memmove

from kvplug._reference import CostParams, softmax_probs  # pure arithmetic, identical on both
from kvplug.errors import InvalidArgument, InvalidTokens, KvplugError
from kvplug.events import Tier as _Tier

cnp.import_array()

cdef extern from "kvplug.h" nogil:
    ctypedef uint64_t kvp_engine_hash_t
    ctypedef uint64_t kvp_hash_t
    ctypedef uint32_t kvp_endpoint_t
    ctypedef enum kvp_status:
        KVP_OK
        KVP_E_NULL
        KVP_E_ARG
        KVP_E_TOKEN
        KVP_E_ENDPOINT
        KVP_E_TIER
        KVP_E_NOMEM
        KVP_E_BUFFER
        KVP_E_OVERFLOW
    ctypedef enum kvp_dtype:
        KVP_DT_U32
        KVP_DT_I32
        KVP_DT_U64
        KVP_DT_I64
        KVP_DT_LE32
    ctypedef struct kvp_index:
        pass
    ctypedef struct kvp_stats:
        uint64_t stored_blocks, duplicate_stores, conflicting_stores, orphan_stores
        uint64_t removed_blocks, unknown_removes, moved_blocks, unknown_moves
        uint64_t evicted_blocks, evicted_entries, cleared_endpoints
        uint64_t reannounced_blocks
        uint64_t blocks, entries, engine_mappings, memory_bytes
    ctypedef struct kvp_query_out:
        int32_t *local
        int32_t *device
        int32_t *host
        int32_t *disk
        int32_t *shared_beyond
        uint32_t *touched
        size_t cap
        size_t n_touched
        int32_t shared_fill
        int32_t shared_prefix
        size_t walked
    ctypedef struct kvp_cost_params:
        double overlap_score_credit, host_cache_hit_weight, disk_cache_hit_weight
        double shared_cache_multiplier, prefill_load_scale

    const char *kvp_status_str(kvp_status s)
    kvp_hash_t kvp_chain_hash(kvp_hash_t prev, kvp_hash_t local, uint64_t extra)
    kvp_status kvp_local_hash(const void *tokens, kvp_dtype dt, size_t n, uint64_t seed,
                              kvp_hash_t *out, size_t *err_pos)
    kvp_status kvp_hash_blocks(const void *tokens, kvp_dtype dt, size_t n_tokens, size_t bs,
                               uint64_t seed, const uint64_t *extra, size_t n_extra,
                               kvp_hash_t *local_out, kvp_hash_t *seq_out, size_t out_cap,
                               size_t *err_pos)
    kvp_status kvp_index_new(uint64_t max_entries, kvp_index **out)
    void kvp_index_free(kvp_index *idx)
    size_t kvp_index_endpoint_limit(const kvp_index *idx)
    kvp_status kvp_index_reserve(kvp_index *idx, size_t n_blocks, size_t n_mappings)
    kvp_status kvp_index_reserve_endpoint(kvp_index *idx, kvp_endpoint_t ep, size_t n_mappings)
    kvp_status kvp_index_store(kvp_index *idx, kvp_endpoint_t ep, int tier,
                               const kvp_engine_hash_t *ehs, const kvp_hash_t *hs, size_t n)
    kvp_status kvp_index_store_tokens(kvp_index *idx, kvp_endpoint_t ep, int tier, int has_parent,
                                      kvp_engine_hash_t parent, const kvp_engine_hash_t *ehs,
                                      size_t n_blocks, const void *tokens, kvp_dtype dt,
                                      size_t n_tokens, size_t block_size, uint64_t seed,
                                      const uint64_t *extra, size_t n_extra, int *stored,
                                      size_t *err_pos)
    ctypedef struct kvp_store_tokens_req:
        kvp_endpoint_t ep
        int tier
        int has_parent
        kvp_engine_hash_t parent
        const kvp_engine_hash_t *engine_hashes
        size_t n_blocks
        const void *tokens
        kvp_dtype dt
        size_t n_tokens
        uint64_t seed
        const uint64_t *extra
        size_t n_extra
    ctypedef struct kvp_store_result:
        kvp_status status
        int stored
        size_t err_pos
    kvp_status kvp_index_store_tokens_batch(kvp_index *idx, size_t block_size,
                                            const kvp_store_tokens_req *reqs, size_t n,
                                            kvp_store_result *results, size_t *n_done,
                                            size_t *n_failed)
    kvp_status kvp_index_remove(kvp_index *idx, kvp_endpoint_t ep, int tier,
                                const kvp_engine_hash_t *ehs, size_t n)
    kvp_status kvp_index_move(kvp_index *idx, kvp_endpoint_t ep, int from_tier, int to_tier,
                              const kvp_engine_hash_t *ehs, size_t n)
    kvp_status kvp_index_clear(kvp_index *idx, kvp_endpoint_t ep)
    kvp_status kvp_index_resolve(const kvp_index *idx, kvp_endpoint_t ep, kvp_engine_hash_t eh,
                                 kvp_hash_t *out, int *found)
    kvp_status kvp_index_query(kvp_index *idx, const kvp_hash_t *hs, size_t n,
                               kvp_query_out *out)
    kvp_status kvp_index_query_begin(kvp_index *idx, size_t n, kvp_query_out *out)
    kvp_status kvp_index_query_feed(kvp_index *idx, const kvp_hash_t *hs, size_t n,
                                    kvp_query_out *out, int *more)
    kvp_status kvp_index_query_end(kvp_index *idx, kvp_query_out *out)
    kvp_status kvp_index_stats(const kvp_index *idx, kvp_stats *out)
    kvp_status kvp_index_holdings(const kvp_index *idx, kvp_endpoint_t ep, kvp_hash_t *hashes,
                                  uint32_t *counts, size_t cap, size_t *n_out)
    kvp_status kvp_index_held_counts(const kvp_index *idx, uint64_t *counts, size_t n)
    int kvp_index_verify(const kvp_index *idx)
    kvp_status kvp_costs(const double *prefill, const double *device, const double *host,
                         const double *disk, const double *shared_beyond, const double *decode,
                         size_t n, const kvp_cost_params *p, double *out)
    kvp_status kvp_select(const double *cost, size_t n, double temperature, double u,
                          size_t *chosen)

DEVICE = 0
HOST = 1
DISK = 2
N_TIERS = 3
SHARED = 0xFFFFFFFF
MAX_ENDPOINT = 1 << 20
MASK64 = (1 << 64) - 1

# Work below these sizes is not worth a GIL round trip.
cdef size_t NOGIL_TOKENS = 16384
cdef size_t NOGIL_BLOCKS = 1024
# A list's hashes go to the walk in pieces of 64, doubling to 1,024 (Index._query_items); a
# piece that long walks without the GIL, as an array of NOGIL_BLOCKS does.
cdef enum:
    QUERY_PIECE = 64
    QUERY_PIECE_MAX = 1024
cdef size_t NOGIL_PIECE = 1024


cdef object _status_error(kvp_status st, str where):
    msg = f"{where}: {kvp_status_str(st).decode()}"
    if st == KVP_E_NOMEM:
        return MemoryError(msg)
    if st == KVP_E_TOKEN:
        return InvalidTokens(msg)
    return InvalidArgument(msg)


cdef int _raise_status(kvp_status st, str where) except -1:
    raise _status_error(st, where)


# ---- token buffers -------------------------------------------------------------------------
cdef struct TokenView:
    Py_buffer buf
    bint has_buf
    uint32_t *owned  # tokens read out of a list or tuple (malloc'd; freed by _release_tokens)
    const void *ptr
    size_t n
    kvp_dtype dt


cdef inline void _release_tokens(TokenView *tv):
    if tv.has_buf:
        PyBuffer_Release(&tv.buf)
        tv.has_buf = False
    if tv.owned != NULL:
        free(tv.owned)
        tv.owned = NULL


cdef object _seq_to_int64(object tokens):
    """A Python sequence of token ids as array('q'); errors name the position."""
    try:
        return array("q", tokens)
    except (OverflowError, TypeError):
        pass
    for i, t in enumerate(tokens):
        try:
            v = operator.index(t)
        except TypeError:
            raise InvalidTokens(
                f"token at position {i} is a {type(t).__name__}, not an integer"
            ) from None
        if not 0 <= v < (1 << 32):
            raise InvalidTokens(f"token id {v} at position {i} is outside [0, 2**32)")
    raise InvalidTokens("token ids could not be read")  # pragma: no cover


cdef int _open_tokens(object tokens, TokenView *tv) except -1:
    """Point tv at a contiguous integer buffer for tokens (in place when possible)."""
    cdef int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT
    cdef str fmt
    cdef Py_ssize_t isz
    cdef int tnum
    cdef Py_ssize_t n
    tv.has_buf = False
    tv.owned = NULL
    tv.ptr = NULL
    tv.n = 0
    if type(tokens) is list or type(tokens) is tuple:
        # fast path: exact ints in [0, 2**32), read straight into a u32 buffer
        n = len(tokens)
        tv.owned = <uint32_t *>malloc(<size_t>(n if n > 0 else 1) * sizeof(uint32_t))
        if tv.owned == NULL:
            raise MemoryError("tokens: cannot allocate the u32 buffer")
        if kvpy_ints_to_u32(PySequence_Fast_ITEMS(tokens), n, tv.owned):
            tv.ptr = tv.owned
            tv.n = <size_t>n
            tv.dt = KVP_DT_U32
            return 0
        free(tv.owned)
        tv.owned = NULL
        tokens = _seq_to_int64(tokens)  # the generic path: errors name the position
    if type(tokens) is cnp.ndarray:
        # fast path: a 1-D aligned contiguous native 4/8-byte integer array, read in place (the
        # caller's reference keeps it alive for the call)
        tnum = cnp.PyArray_TYPE(<cnp.ndarray>tokens)
        if (cnp.PyArray_NDIM(<cnp.ndarray>tokens) == 1
                and cnp.PyArray_ISCARRAY_RO(<cnp.ndarray>tokens)
                and cnp.PyArray_ISNOTSWAPPED(<cnp.ndarray>tokens)):
            if tnum == cnp.NPY_UINT32:
                tv.dt = KVP_DT_U32
            elif tnum == cnp.NPY_INT32:
                tv.dt = KVP_DT_I32
            elif tnum == cnp.NPY_INT64:
                tv.dt = KVP_DT_I64
            elif tnum == cnp.NPY_UINT64:
                tv.dt = KVP_DT_U64
            else:
                tnum = -1
            if tnum != -1:
                tv.ptr = cnp.PyArray_DATA(<cnp.ndarray>tokens)
                tv.n = <size_t>cnp.PyArray_DIM(<cnp.ndarray>tokens, 0)
                return 0
    if isinstance(tokens, (bytes, bytearray)) or (
        isinstance(tokens, memoryview) and tokens.format in ("B", "b", "c")
    ):
        if isinstance(tokens, memoryview) and not tokens.c_contiguous:
            tokens = tokens.tobytes()
        PyObject_GetBuffer(tokens, &tv.buf, PyBUF_C_CONTIGUOUS)
        tv.has_buf = True
        if tv.buf.len % 4:
            n = tv.buf.len
            _release_tokens(tv)
            raise InvalidTokens(f"byte buffer of {n} bytes is not whole u32 tokens")
        tv.ptr = tv.buf.buf
        tv.n = <size_t>(tv.buf.len // 4)
        tv.dt = KVP_DT_LE32
        return 0
    if not PyObject_CheckBuffer(tokens):
        if isinstance(tokens, (str, dict, set)) or tokens is None:
            raise InvalidTokens(f"tokens must be a sequence of integers, got {type(tokens).__name__}")
        tokens = _seq_to_int64(tokens)
    elif isinstance(tokens, cnp.ndarray):
        if tokens.ndim != 1:
            raise InvalidTokens(f"tokens must be 1-D, got shape {tokens.shape}")
        kind = tokens.dtype.kind
        if kind not in "iu":
            raise InvalidTokens(f"tokens must be an integer array, got dtype {tokens.dtype}")
        if tokens.dtype.itemsize not in (4, 8) or not tokens.dtype.isnative:
            tokens = tokens.astype(np.int64)
        elif not tokens.flags.c_contiguous:
            tokens = np.ascontiguousarray(tokens)
    try:
        PyObject_GetBuffer(tokens, &tv.buf, flags)
    except BufferError:
        tokens = np.ascontiguousarray(np.asarray(tokens))
        PyObject_GetBuffer(tokens, &tv.buf, flags)
    tv.has_buf = True
    fmt = (<bytes>tv.buf.format).decode() if tv.buf.format != NULL else "B"
    isz = tv.buf.itemsize
    if tv.buf.ndim > 1:
        _release_tokens(tv)
        raise InvalidTokens("tokens must be 1-D")
    if fmt[:1] in ("@", "=", "<"):
        fmt = fmt[1:]
    cdef bint ok = True
    if fmt in ("I", "L", "N", "Q") or (fmt == "H" or fmt == "B"):
        tv.dt = KVP_DT_U32 if isz == 4 else (KVP_DT_U64 if isz == 8 else KVP_DT_U32)
        ok = isz in (4, 8)
    elif fmt in ("i", "l", "q", "n", "h", "b"):
        tv.dt = KVP_DT_I32 if isz == 4 else KVP_DT_I64
        ok = isz in (4, 8)
    else:
        _release_tokens(tv)
        raise InvalidTokens(f"tokens must be integers, got buffer format {fmt!r}")
    if not ok:  # 1- or 2-byte integers: widen once
        _release_tokens(tv)
        wide = np.asarray(memoryview(tokens)).astype(np.int64)
        PyObject_GetBuffer(wide, &tv.buf, flags)
        tv.has_buf = True
        tv.dt = KVP_DT_I64
    tv.ptr = tv.buf.buf
    tv.n = <size_t>(tv.buf.len // tv.buf.itemsize) if tv.buf.itemsize else 0
    return 0


cdef object _token_error(TokenView *tv, size_t pos, object block_size=None):
    cdef uint32_t u32
    cdef int32_t i32
    cdef int64_t i64
    cdef uint64_t u64
    cdef const char *p = <const char *>tv.ptr
    cdef object v
    if tv.dt == KVP_DT_I32:
        memcpy(&i32, p + 4 * pos, 4)
        v = i32
    elif tv.dt == KVP_DT_I64:
        memcpy(&i64, p + 8 * pos, 8)
        v = i64
    elif tv.dt == KVP_DT_U64:
        memcpy(&u64, p + 8 * pos, 8)
        v = u64
    else:
        memcpy(&u32, p + 4 * pos, 4)
        v = u32
    where = f"token id {v} at position {pos}"
    if block_size:
        where += f" (block {pos // block_size})"
    return InvalidTokens(f"{where} is outside [0, 2**32)")


# ---- u64 arrays ----------------------------------------------------------------------------
cdef object _u64_slow(object seq, str what):
    out = []
    for i, x in enumerate(seq):
        try:
            out.append(operator.index(x) & MASK64)
        except TypeError:
            raise InvalidArgument(
                f"{what}[{i}] must be an integer, got {type(x).__name__}"
            ) from None
    return np.array(out, dtype=np.uint64)


cdef tuple _u64_prefix(object seq, str what):
    """seq's items as u64, converted as _as_u64 converts a list (ints folded modulo 2**64),
    up to the first that is not an integer: (the values before it, that item's error or
    None). The caller walks the values and raises the error only if the walk reaches the
    item, so an item the walk never reaches is never an error."""
    try:
        return np.frombuffer(array("Q", seq), dtype=np.uint64), None
    except Exception:  # noqa: BLE001 - found again, item by item, below
        pass
    out = []
    for i, x in enumerate(seq):
        try:
            out.append(operator.index(x) & MASK64)
        except TypeError:
            err = InvalidArgument(f"{what}[{i}] must be an integer, got {type(x).__name__}")
            return np.array(out, dtype=np.uint64), err
        except Exception as exc:  # noqa: BLE001 - what __index__ raised, if the walk gets there
            return np.array(out, dtype=np.uint64), exc
    return np.array(out, dtype=np.uint64), None


cdef cnp.ndarray _as_u64(object x, str what):
    """x as an aligned, contiguous uint64 numpy array (a view for int64/uint64 arrays)."""
    cdef cnp.ndarray a
    cdef int tnum
    if type(x) is cnp.ndarray:  # (cnp: a C-level type check, no module attribute lookup)
        a = <cnp.ndarray>x
        tnum = cnp.PyArray_TYPE(a)
        if (tnum == cnp.NPY_UINT64 and cnp.PyArray_NDIM(a) == 1 and cnp.PyArray_ISCARRAY_RO(a)
                and cnp.PyArray_ISNOTSWAPPED(a)):
            return a  # fast path: used in place
    if isinstance(x, cnp.ndarray):
        a = <cnp.ndarray>x
        kind = a.dtype.kind
        if kind not in "iu":
            raise InvalidArgument(f"{what} must be integers, got dtype {a.dtype}")
        if a.ndim != 1:
            raise InvalidArgument(f"{what} must be 1-D, got shape {x.shape}")
        if a.dtype.itemsize == 8 and a.dtype.isnative:
            if kind == "i":
                a = a.view(np.uint64)
            if not (cnp.PyArray_ISCARRAY_RO(a)):
                a = np.require(a, np.uint64, ["C", "A"])
            return a
        return np.require(a.astype(np.int64), None, ["C", "A"]).view(np.uint64)
    if type(x) is list or type(x) is tuple:
        a = cnp.PyArray_EMPTY(1, [<cnp.npy_intp>len(x)], cnp.NPY_UINT64, 0)
        if kvpy_ints_to_u64(PySequence_Fast_ITEMS(x), len(x), <uint64_t *>cnp.PyArray_DATA(a)):
            return a
    if isinstance(x, (list, tuple)):
        try:
            return np.frombuffer(array("Q", x), dtype=np.uint64)
        except (OverflowError, TypeError):
            return _u64_slow(x, what)
    if x is None or isinstance(x, (str, bytes)):
        raise InvalidArgument(f"{what} must be a sequence of integers, got {type(x).__name__}")
    return _as_u64(list(x), what)


cdef inline const uint64_t *_u64_ptr(cnp.ndarray a):
    return <const uint64_t *>cnp.PyArray_DATA(a)


cdef struct U64View:
    const uint64_t *ptr
    size_t n


cdef object _u64_view(object x, str what, uint64_t *small, size_t small_cap, U64View *v):
    """Point v at x's values as u64. A short list or tuple of exact ints in [0, 2**64) (a decoded
    event's hashes) is read straight into the caller's ``small`` buffer (returns None): no numpy
    array per call. Anything else goes through _as_u64 (same values, same errors) and the array
    is returned: the caller keeps it alive while v is in use."""
    cdef Py_ssize_t n
    cdef cnp.ndarray a
    if type(x) is list or type(x) is tuple:
        n = len(x)
        if <size_t>n <= small_cap and kvpy_ints_to_u64(PySequence_Fast_ITEMS(x), n, small):
            v.ptr = small
            v.n = <size_t>n
            return None
    a = _as_u64(x, what)
    v.ptr = _u64_ptr(a)
    v.n = <size_t>a.shape[0]
    return a


# ---- validation ------------------------------------------------------------------------------
cdef kvp_endpoint_t _ep(object ep) except? 0xFFFFFFFE:
    cdef long v
    cdef int overflow = 0
    if PyLong_CheckExact(ep):  # fast path, same answer as below
        v = PyLong_AsLongAndOverflow(ep, &overflow)
        if not overflow and 0 <= v < (1 << 20):
            return <kvp_endpoint_t>v
    try:
        e = operator.index(ep)
    except TypeError:
        raise InvalidArgument(f"endpoint id must be an integer, got {type(ep).__name__}") from None
    if not (0 <= e < MAX_ENDPOINT or e == SHARED):
        raise InvalidArgument(f"endpoint id {e} out of range")
    return <kvp_endpoint_t>e


cdef int _tier(object tier) except -2:
    cdef long v
    cdef int overflow = 0
    if PyLong_CheckExact(tier) or type(tier) is _Tier:  # fast path, same answer as below
        v = PyLong_AsLongAndOverflow(tier, &overflow)
        if not overflow and 0 <= v <= 2:
            return <int>v
    if tier not in (DEVICE, HOST, DISK):
        raise InvalidArgument(f"tier {tier} is not 0 (device), 1 (host) or 2 (disk)")
    return <int>operator.index(tier)


cdef size_t _block_size(object block_size) except 0:
    cdef long v
    cdef int overflow = 0
    if PyLong_CheckExact(block_size):  # fast path, same answer as below
        v = PyLong_AsLongAndOverflow(block_size, &overflow)
        if not overflow and 0 < v < (1 << 62):
            return <size_t>v
    try:
        bs = operator.index(block_size)
    except TypeError:
        raise InvalidArgument(f"block_size must be an integer, got {type(block_size).__name__}") from None
    if bs <= 0:
        raise InvalidArgument(f"block_size must be positive, got {block_size}")
    if bs >= (1 << 62):
        raise InvalidArgument(f"block_size {block_size} is too large")
    return <size_t>bs


cdef uint64_t _seed(object seed) except? 0:
    if PyLong_CheckExact(seed):  # fast path: the value modulo 2**64, as below
        return <uint64_t>PyLong_AsUnsignedLongLongMask(seed)
    try:
        return <uint64_t>(operator.index(seed) & MASK64)
    except TypeError:
        raise InvalidArgument(f"seed must be an integer, got {type(seed).__name__}") from None


# ---- hashing -----------------------------------------------------------------------------------
def chain_hash(prev, local, extra=0):
    """Sequence hash of a block from its predecessor's sequence hash (or the root seed)."""
    return kvp_chain_hash(_seed(prev), _seed(local), _seed(extra))


def local_hash(block, seed=0):
    """Hash one block of u32 tokens."""
    cdef TokenView tv
    cdef kvp_hash_t h = 0
    cdef size_t pos = 0
    cdef uint64_t s = _seed(seed)
    cdef kvp_status st
    _open_tokens(block, &tv)
    try:
        st = kvp_local_hash(tv.ptr, tv.dt, tv.n, s, &h, &pos)
        if st == KVP_E_TOKEN:
            raise _token_error(&tv, pos)
        if st != KVP_OK:
            _raise_status(st, "local_hash")
    finally:
        _release_tokens(&tv)
    return h


def hash_blocks(tokens, block_size, seed=0, extra=None, bint with_local=True):
    """(local u64[], seq u64[]) of every full block of tokens (numpy arrays).

    with_local=False skips the local array and returns (None, seq).
    """
    cdef size_t bs = _block_size(block_size)
    cdef uint64_t s = _seed(seed)
    cdef TokenView tv
    cdef size_t pos = 0, nb, n_extra = 0
    cdef kvp_status st
    cdef cnp.ndarray ex = None
    cdef cnp.ndarray lo = None
    cdef cnp.ndarray seq
    cdef const uint64_t *ex_p = NULL
    cdef kvp_hash_t *lo_p = NULL
    cdef Py_ssize_t n_items
    if (type(tokens) is list or type(tokens) is tuple) and extra is None and bs <= KVPY_FUSED_MAX_BS:
        # fast path (a decoded event's or request's token list): read and hash in one pass
        n_items = len(tokens)
        nb = <size_t>n_items // bs
        seq = cnp.PyArray_EMPTY(1, [<cnp.npy_intp>nb], cnp.NPY_UINT64, 0)
        if with_local:
            lo = cnp.PyArray_EMPTY(1, [<cnp.npy_intp>nb], cnp.NPY_UINT64, 0)
            lo_p = <kvp_hash_t *>cnp.PyArray_DATA(lo)
        if kvpy_hash_items(PySequence_Fast_ITEMS(tokens), n_items, bs, s, lo_p,
                           <kvp_hash_t *>cnp.PyArray_DATA(seq)):
            return lo, seq
        lo = None  # not all exact ints in range: the generic path below, with its errors
        lo_p = NULL
    _open_tokens(tokens, &tv)
    try:
        nb = tv.n // bs
        if extra is not None:
            ex = _as_u64(extra, "extra")
            ex_p = _u64_ptr(ex)
            n_extra = <size_t>ex.shape[0]
        seq = cnp.PyArray_EMPTY(1, [<cnp.npy_intp>nb], cnp.NPY_UINT64, 0)
        if with_local:
            lo = cnp.PyArray_EMPTY(1, [<cnp.npy_intp>nb], cnp.NPY_UINT64, 0)
            lo_p = <kvp_hash_t *>cnp.PyArray_DATA(lo)
        if tv.n >= NOGIL_TOKENS:
            with nogil:
                st = kvp_hash_blocks(tv.ptr, tv.dt, tv.n, bs, s, ex_p, n_extra, lo_p,
                                     <kvp_hash_t *>cnp.PyArray_DATA(seq), nb, &pos)
        else:
            st = kvp_hash_blocks(tv.ptr, tv.dt, tv.n, bs, s, ex_p, n_extra, lo_p,
                                 <kvp_hash_t *>cnp.PyArray_DATA(seq), nb, &pos)
        if st == KVP_E_TOKEN:
            raise _token_error(&tv, pos, bs)
        if st == KVP_E_ARG and ex is not None:
            raise InvalidArgument(f"extra has {n_extra} entries for {nb} full blocks")
        if st != KVP_OK:
            _raise_status(st, "hash_blocks")
    finally:
        _release_tokens(&tv)
    return lo, seq


# seq_hashes' result arrays, by length (blocks), for reuse: creating and freeing a numpy array
# is ~50-60 ns of a ~450 ns call on a 400-token list. An array is handed out again only when
# nothing but this cache references it (the caller dropped it: no variable, view, memoryview or
# buffer export holds it), so a result anyone still holds is never written; and only while it is
# still a writeable 1-D uint64 array of that length (a caller may have changed its flags, dtype
# or shape in place before dropping it).
cdef enum:
    _SEQ_CACHE_LEN = 256
cdef list _seq_cache = [None] * _SEQ_CACHE_LEN


cdef cnp.ndarray _seq_out(size_t nb):
    cdef object cached
    cdef cnp.ndarray arr
    if nb < _SEQ_CACHE_LEN:
        cached = <object>PyList_GET_ITEM(_seq_cache, <Py_ssize_t>nb)
        # references: the cache's and `cached`'s own; a third is a holder outside
        if cached is not None and Py_REFCNT(cached) == 2:
            arr = <cnp.ndarray>cached
            if (cnp.PyArray_NDIM(arr) == 1 and cnp.PyArray_DIMS(arr)[0] == <cnp.npy_intp>nb
                    and cnp.PyArray_TYPE(arr) == cnp.NPY_UINT64
                    and (cnp.PyArray_FLAGS(arr) & (cnp.NPY_ARRAY_WRITEABLE | cnp.NPY_ARRAY_C_CONTIGUOUS | cnp.NPY_ARRAY_ALIGNED))
                        == (cnp.NPY_ARRAY_WRITEABLE | cnp.NPY_ARRAY_C_CONTIGUOUS | cnp.NPY_ARRAY_ALIGNED)):
                return arr
        arr = cnp.PyArray_EMPTY(1, [<cnp.npy_intp>nb], cnp.NPY_UINT64, 0)
        _seq_cache[nb] = arr
        return arr
    return cnp.PyArray_EMPTY(1, [<cnp.npy_intp>nb], cnp.NPY_UINT64, 0)


def seq_hashes(tokens, block_size, seed=0, extra=None):
    """Sequence hashes (numpy u64) of every full block of tokens: ``hash_blocks(...)[1]``.

    The routing path's call (a request's or an event's token list in, the hashes a query takes
    out): no local array, no tuple and no keyword to parse; from a list, a result of fewer than
    256 blocks may be an array an earlier call returned and its caller has since dropped (see
    _seq_out), never one still referenced anywhere.
    """
    cdef size_t bs
    cdef uint64_t s
    cdef cnp.ndarray seq
    cdef Py_ssize_t n_items
    if (type(tokens) is list or type(tokens) is tuple) and extra is None:
        bs = _block_size(block_size)
        s = _seed(seed)
        if bs <= KVPY_FUSED_MAX_BS:
            n_items = len(tokens)
            seq = _seq_out(<size_t>n_items // bs)
            if kvpy_hash_items(PySequence_Fast_ITEMS(tokens), n_items, bs, s, NULL,
                               <kvp_hash_t *>cnp.PyArray_DATA(seq)):
                return seq
    return hash_blocks(tokens, block_size, seed, extra, False)[1]


# ---- query results -----------------------------------------------------------------------------
# ints 0 .. _SMALL_INTS - 1, shared by QueryResult.scores (endpoint ids and block counts)
cdef enum:
    _SMALL_INTS = 4096
cdef list _SMALL_INT_LIST = list(range(_SMALL_INTS))


cdef class QueryResult:
    """Dense per-endpoint answer of Index.query (reusable: pass it back as ``out=``).

    local, device, host, disk, shared_beyond: int32 arrays indexed by endpoint id (length >=
    the index's endpoint limit). Endpoints holding nothing have local 0 and
    shared_beyond == shared_prefix.
    """

    cdef kvp_query_out q
    cdef readonly object local, device, host, disk, shared_beyond
    cdef object _touched

    def __cinit__(self, size_t capacity=0):
        self._alloc(capacity)

    cdef int _alloc(self, size_t cap) except -1:
        self.local = np.zeros(cap, np.int32)
        self.device = np.zeros(cap, np.int32)
        self.host = np.zeros(cap, np.int32)
        self.disk = np.zeros(cap, np.int32)
        self.shared_beyond = np.zeros(cap, np.int32)
        self._touched = np.zeros(max(cap, 1), np.uint32)
        self.q.local = <int32_t *>cnp.PyArray_DATA(self.local)
        self.q.device = <int32_t *>cnp.PyArray_DATA(self.device)
        self.q.host = <int32_t *>cnp.PyArray_DATA(self.host)
        self.q.disk = <int32_t *>cnp.PyArray_DATA(self.disk)
        self.q.shared_beyond = <int32_t *>cnp.PyArray_DATA(self.shared_beyond)
        self.q.touched = <uint32_t *>cnp.PyArray_DATA(self._touched)
        self.q.cap = cap
        self.q.n_touched = 0
        self.q.shared_fill = 0
        self.q.shared_prefix = 0
        self.q.walked = 0
        return 0

    cdef int _ensure(self, size_t need) except -1:
        cdef size_t cap
        if need <= self.q.cap:
            return 0
        cap = max(need, 2 * self.q.cap, 8)
        self._alloc(cap)
        return 0

    def reserve(self, capacity):
        """Grow the arrays to at least ``capacity`` endpoints (contents reset on growth)."""
        self._ensure(capacity)

    @property
    def shared_prefix(self):
        return self.q.shared_prefix

    @property
    def walked(self):
        return self.q.walked

    @property
    def capacity(self):
        return self.q.cap

    @property
    def endpoints(self):
        """Endpoint ids holding at least the first block (numpy uint32, query order)."""
        return self._touched[: self.q.n_touched].copy()

    def row(self, ep):
        """(local, device, host, disk, shared_beyond) of one endpoint id."""
        e = operator.index(ep)
        if 0 <= e < <Py_ssize_t>self.q.cap:
            return (int(self.local[e]), int(self.device[e]), int(self.host[e]),
                    int(self.disk[e]), int(self.shared_beyond[e]))
        return (0, 0, 0, 0, self.q.shared_prefix)

    def scores(self):
        """{endpoint id: local blocks} for every endpoint holding at least the first block
        (Dynamo's per-worker overlap scores), built in one pass over the touched endpoints.

        With hundreds of holders, building the dict is most of a query's cost: it is made at
        its final size, and ids and counts below _SMALL_INTS reuse the int objects of a table
        instead of allocating one each (CPython caches only those up to 256)."""
        cdef Py_ssize_t n = <Py_ssize_t>self.q.n_touched
        cdef dict d = _PyDict_NewPresized(n)
        cdef Py_ssize_t i
        cdef uint32_t e
        cdef int32_t v
        cdef object key, value
        for i in range(n):
            e = self.q.touched[i]
            v = self.q.local[e]
            key = <object>PyList_GET_ITEM(_SMALL_INT_LIST, e) if e < _SMALL_INTS else e
            value = <object>PyList_GET_ITEM(_SMALL_INT_LIST, v) if 0 <= v < _SMALL_INTS else v
            PyDict_SetItem(d, key, value)
        return d

    def matched(self):
        """ep -> row for every endpoint holding at least the first block."""
        return {int(e): self.row(int(e)) for e in self._touched[: self.q.n_touched]}

    def __repr__(self):
        return (f"QueryResult(walked={self.walked}, shared_prefix={self.shared_prefix}, "
                f"matched={self.matched()})")


# ---- the index -------------------------------------------------------------------------------
_COUNTERS = (
    "stored_blocks", "duplicate_stores", "conflicting_stores", "orphan_stores",
    "removed_blocks", "unknown_removes", "moved_blocks", "unknown_moves",
    "evicted_blocks", "evicted_entries", "cleared_endpoints", "reannounced_blocks",
)


cdef class Index:
    """The global prefix index (rules: kvplug._reference.Index)."""

    cdef kvp_index *idx
    cdef PyThread_type_lock lock
    cdef readonly uint64_t max_entries

    def __cinit__(self, max_entries=0):
        cdef kvp_status st
        try:
            m = operator.index(max_entries)
        except TypeError:
            raise InvalidArgument("max_entries must be an integer") from None
        if m < 0:
            raise InvalidArgument("max_entries must be >= 0")
        if m >= (1 << 63):
            raise InvalidArgument("max_entries is too large")
        self.max_entries = m
        self.lock = PyThread_allocate_lock()
        if self.lock == NULL:
            raise MemoryError("cannot allocate the index lock")
        st = kvp_index_new(self.max_entries, &self.idx)
        if st != KVP_OK:
            _raise_status(st, "Index")

    def __dealloc__(self):
        if self.idx != NULL:
            kvp_index_free(self.idx)
            self.idx = NULL
        if self.lock != NULL:
            PyThread_free_lock(self.lock)
            self.lock = NULL

    cdef inline void _acquire(self):
        if not PyThread_acquire_lock(self.lock, NOWAIT_LOCK):
            with nogil:
                PyThread_acquire_lock(self.lock, WAIT_LOCK)

    cdef inline void _release(self):
        PyThread_release_lock(self.lock)

    def reserve(self, blocks, mappings=None, endpoints=None):
        """Pre-size for ``blocks`` distinct blocks (block table, records, canonical engine map:
        one mapping per block, shared by every engine that agrees on its engine hash) and
        ``mappings`` engine mappings in the endpoints' own maps (default: as many as blocks;
        engines whose engine hashes disagree with the first engine's keep theirs there) so
        that building up to that size never rehashes. Own maps are per endpoint: the mappings
        are spread evenly over endpoint ids ``0 .. endpoints-1`` (default: the ids below
        ``endpoint_limit``, i.e. those that have stored)."""
        cdef kvp_status st = KVP_OK
        cdef size_t per, e
        b = operator.index(blocks)
        m = b if mappings is None else operator.index(mappings)
        n_ep = None if endpoints is None else operator.index(endpoints)
        if b < 0 or m < 0 or b >= (1 << 40) or m >= (1 << 40):
            raise InvalidArgument(f"reserve({blocks}, {mappings}): out of range")
        if n_ep is not None and not 0 <= n_ep <= MAX_ENDPOINT:
            raise InvalidArgument(f"reserve(endpoints={endpoints}): out of range")
        self._acquire()
        if n_ep:
            per = <size_t>((m + n_ep - 1) // n_ep)
            for e in range(<size_t>n_ep):
                st = kvp_index_reserve_endpoint(self.idx, <kvp_endpoint_t>e, per)
                if st != KVP_OK:
                    break
            if st == KVP_OK:
                st = kvp_index_reserve(self.idx, <size_t>b, 0)
        else:
            st = kvp_index_reserve(self.idx, <size_t>b, <size_t>m)
        self._release()
        if st != KVP_OK:
            _raise_status(st, "reserve")

    @property
    def endpoint_limit(self):
        """1 + the largest (non-shared) endpoint id ever stored."""
        return kvp_index_endpoint_limit(self.idx)

    def store(self, ep, tier, engine_hashes, block_hashes):
        """Store precomputed kvplug hashes (one per engine hash, chain order)."""
        cdef kvp_endpoint_t e = _ep(ep)
        cdef int t = _tier(tier)
        cdef uint64_t small_ehs[128]
        cdef uint64_t small_hs[128]
        cdef U64View ehv, hv
        if (type(engine_hashes) is list and type(block_hashes) is list
                and len(engine_hashes) <= 128 and len(block_hashes) <= 128):
            kvpy_prefetch_items(PySequence_Fast_ITEMS(engine_hashes), len(engine_hashes))
            kvpy_prefetch_items(PySequence_Fast_ITEMS(block_hashes), len(block_hashes))
        keep_ehs = _u64_view(engine_hashes, "engine_hashes", small_ehs, 128, &ehv)
        keep_hs = _u64_view(block_hashes, "block_hashes", small_hs, 128, &hv)
        cdef size_t n = ehv.n
        cdef kvp_status st
        if hv.n != n:
            raise InvalidArgument(f"{n} engine hashes but {hv.n} block hashes")
        self._acquire()
        try:
            if n >= NOGIL_BLOCKS:
                with nogil:
                    st = kvp_index_store(self.idx, e, t, ehv.ptr, hv.ptr, n)
            else:
                st = kvp_index_store(self.idx, e, t, ehv.ptr, hv.ptr, n)
        finally:
            self._release()
        if st != KVP_OK:
            _raise_status(st, f"store on endpoint {ep}")

    def store_tokens(self, ep, tier, parent_engine_hash, engine_hashes, tokens, block_size,
                     seed=0, extra=None):
        """Store blocks given by their tokens; False (orphan, counted) if the parent is unknown."""
        cdef kvp_endpoint_t e = _ep(ep)
        cdef int t = _tier(tier)
        cdef size_t bs = _block_size(block_size)
        cdef uint64_t s = _seed(seed)
        cdef cnp.ndarray ehs = _as_u64(engine_hashes, "engine_hashes")
        cdef size_t nb = <size_t>ehs.shape[0]
        cdef int has_parent = parent_engine_hash is not None
        cdef uint64_t parent = 0
        cdef cnp.ndarray ex = None
        cdef const uint64_t *ex_p = NULL
        cdef size_t n_extra = 0, pos = 0
        cdef int stored = 0
        cdef kvp_status st
        cdef TokenView tv
        cdef const uint64_t *ehp = _u64_ptr(ehs)
        if has_parent:
            try:
                parent = <uint64_t>(operator.index(parent_engine_hash) & MASK64)
            except TypeError:
                raise InvalidArgument("parent_engine_hash must be an integer") from None
        if extra is not None:
            ex = _as_u64(extra, "extra")
            ex_p = _u64_ptr(ex)
            n_extra = <size_t>ex.shape[0]
        _open_tokens(tokens, &tv)
        try:
            if tv.n != nb * bs:
                raise InvalidArgument(f"{tv.n} tokens for {nb} blocks of {bs} (endpoint {ep})")
            self._acquire()
            try:
                if tv.n >= NOGIL_TOKENS:
                    with nogil:
                        st = kvp_index_store_tokens(self.idx, e, t, has_parent, parent,
                                                    ehp, nb, tv.ptr, tv.dt, tv.n, bs,
                                                    s, ex_p, n_extra, &stored, &pos)
                else:
                    st = kvp_index_store_tokens(self.idx, e, t, has_parent, parent,
                                                ehp, nb, tv.ptr, tv.dt, tv.n, bs,
                                                s, ex_p, n_extra, &stored, &pos)
            finally:
                self._release()
            if st == KVP_E_TOKEN:
                raise _token_error(&tv, pos, bs)
            if st == KVP_E_ARG and ex is not None:
                raise InvalidArgument(f"extra has {n_extra} entries for {nb} full blocks")
            if st != KVP_OK:
                _raise_status(st, f"store_tokens on endpoint {ep}")
        finally:
            _release_tokens(&tv)
        return bool(stored)

    def store_tokens_many(self, rows, block_size):
        """Apply a batch of token stores in one call, in order. ``rows``: a sequence of
        ``(ep, tier, parent_engine_hash, engine_hashes, tokens, seed, extra)`` tuples; row i is
        exactly ``store_tokens(ep, tier, parent_engine_hash, engine_hashes, tokens, block_size,
        seed, extra)``.

        Returns ``(blocks, failures)``: the engine hashes in the rows that did not fail, and
        ``[(i, exception), ...]`` in row order, the exception being the one ``store_tokens``
        would have raised for that row. A failing row changes nothing (as its single call)
        and the others still run. Orphans are not failures (counted in ``orphan_stores``).
        Raises only for a malformed row (not a 7-tuple) or MemoryError (rows before the one
        that ran out of memory stay applied)."""
        cdef size_t bs = _block_size(block_size)
        cdef tuple rows_t = tuple(rows)
        cdef tuple row
        cdef Py_ssize_t n = len(rows_t), i, j
        cdef size_t n_run = 0, n_done = 0, n_failed = 0, total_tokens = 0, blocks = 0
        # small batches (the common case: one engine step) live on the stack
        cdef kvp_store_tokens_req small_reqs[16]
        cdef kvp_store_result small_res[16]
        cdef TokenView small_tvs[16]
        cdef Py_ssize_t small_slot[16]
        cdef kvp_store_tokens_req *reqs = small_reqs
        cdef kvp_store_result *res = small_res
        cdef TokenView *tvs = small_tvs
        cdef Py_ssize_t *slot = small_slot  # row index of each request handed to C
        cdef void *heap = NULL
        cdef kvp_store_tokens_req *r
        cdef cnp.ndarray ehs, ex
        cdef kvp_status st = KVP_OK
        cdef list keep = None  # arrays converted here that the requests point into
        cdef list early = None  # (row index, exception) of rows whose arguments are bad
        cdef list failures
        for i in range(n):
            if type(rows_t[i]) is not tuple or len(<tuple>rows_t[i]) != 7:
                raise InvalidArgument(f"store_tokens_many: row {i} is not a 7-tuple")
        if n == 0:
            return 0, []
        if n > 16:
            heap = malloc(n * (sizeof(kvp_store_tokens_req) + sizeof(kvp_store_result)
                               + sizeof(TokenView) + sizeof(Py_ssize_t)))
            if heap == NULL:
                raise MemoryError("store_tokens_many: cannot allocate the batch")
            reqs = <kvp_store_tokens_req *>heap
            res = <kvp_store_result *>(reqs + n)
            tvs = <TokenView *>(res + n)
            slot = <Py_ssize_t *>(tvs + n)
        try:
            # read every event's arguments first (no index access): the same conversions and
            # checks as store_tokens; an event failing them is reported and skipped
            for i in range(n):
                r = &reqs[n_run]
                tvs[n_run].has_buf = False
                tvs[n_run].owned = NULL
                row = <tuple>rows_t[i]
                try:
                    r.ep = _ep(row[0])
                    r.tier = _tier(row[1])
                    r.seed = _seed(row[5])
                    ehs = _as_u64(row[3], "engine_hashes")
                    if ehs is not row[3]:
                        if keep is None:
                            keep = []
                        keep.append(ehs)
                    r.engine_hashes = _u64_ptr(ehs)
                    r.n_blocks = <size_t>ehs.shape[0]
                    parent = row[2]
                    r.has_parent = parent is not None
                    r.parent = 0
                    if r.has_parent:
                        if PyLong_CheckExact(parent):
                            r.parent = <uint64_t>PyLong_AsUnsignedLongLongMask(parent)
                        else:
                            try:
                                r.parent = <uint64_t>(operator.index(parent) & MASK64)
                            except TypeError:
                                raise InvalidArgument(
                                    "parent_engine_hash must be an integer") from None
                    r.extra = NULL
                    r.n_extra = 0
                    if row[6] is not None:
                        ex = _as_u64(row[6], "extra")
                        r.extra = _u64_ptr(ex)
                        r.n_extra = <size_t>ex.shape[0]
                        if keep is None:
                            keep = []
                        keep.append(ex)
                    _open_tokens(row[4], &tvs[n_run])
                    if tvs[n_run].n != r.n_blocks * bs:
                        _release_tokens(&tvs[n_run])
                        raise InvalidArgument(
                            f"{tvs[n_run].n} tokens for {r.n_blocks} blocks of {bs} "
                            f"(endpoint {row[0]})")
                except (KvplugError, ValueError, TypeError, OverflowError) as err:
                    if early is None:
                        early = []
                    early.append((i, err))
                    continue
                r.tokens = tvs[n_run].ptr
                r.dt = tvs[n_run].dt
                r.n_tokens = tvs[n_run].n
                total_tokens += r.n_tokens
                blocks += r.n_blocks
                slot[n_run] = i
                n_run += 1
            if n_run:
                self._acquire()
                try:
                    if total_tokens >= NOGIL_TOKENS:
                        with nogil:
                            st = kvp_index_store_tokens_batch(self.idx, bs, reqs, n_run, res,
                                                              &n_done, &n_failed)
                    else:
                        st = kvp_index_store_tokens_batch(self.idx, bs, reqs, n_run, res,
                                                          &n_done, &n_failed)
                finally:
                    self._release()
            if n_failed == 0 and st == KVP_OK:
                return blocks, ([] if early is None else early)
            # failures in event order: argument errors merged with the core's statuses
            failures = []
            if early is None:
                early = []
            i = 0
            for j in range(<Py_ssize_t>n_done):
                while i < len(early) and early[i][0] < slot[j]:
                    failures.append(early[i])
                    i += 1
                if res[j].status != KVP_OK:
                    blocks -= reqs[j].n_blocks
                    failures.append((slot[j], self._store_error(&res[j], &reqs[j], &tvs[j], bs,
                                                                rows_t[slot[j]][0])))
            if st == KVP_E_NOMEM:
                # later events were not attempted: nothing after this one is reported
                raise MemoryError(f"store_tokens_many: out of memory at event {slot[n_done - 1]}")
            failures.extend(early[i:])
            return blocks, failures
        finally:
            for j in range(<Py_ssize_t>n_run):
                _release_tokens(&tvs[j])
            free(heap)

    cdef object _store_error(self, kvp_store_result *r, kvp_store_tokens_req *q, TokenView *tv,
                             size_t bs, object ep):
        """The exception store_tokens raises for this status."""
        if r.status == KVP_E_TOKEN:
            return _token_error(tv, r.err_pos, bs)
        if r.status == KVP_E_ARG and q.extra != NULL:
            return InvalidArgument(f"extra has {q.n_extra} entries for {q.n_blocks} full blocks")
        return _status_error(r.status, f"store_tokens on endpoint {ep}")

    def resolve(self, ep, engine_hash):
        """The kvplug hash an endpoint's engine hash maps to, or None."""
        cdef kvp_endpoint_t e = _ep(ep)
        cdef uint64_t eh = _seed(engine_hash)
        cdef kvp_hash_t h = 0
        cdef int found = 0
        self._acquire()
        st = kvp_index_resolve(self.idx, e, eh, &h, &found)
        self._release()
        if st != KVP_OK:
            _raise_status(st, "resolve")
        return h if found else None

    def remove(self, ep, engine_hashes, tier=None):
        cdef kvp_endpoint_t e = _ep(ep)
        cdef int t = -1 if tier is None else _tier(tier)
        cdef cnp.ndarray ehs = _as_u64(engine_hashes, "engine_hashes")
        cdef kvp_status st
        self._acquire()
        st = kvp_index_remove(self.idx, e, t, _u64_ptr(ehs), <size_t>ehs.shape[0])
        self._release()
        if st != KVP_OK:
            _raise_status(st, f"remove on endpoint {ep}")

    def move(self, ep, engine_hashes, from_tier, to_tier):
        cdef kvp_endpoint_t e = _ep(ep)
        cdef int f = _tier(from_tier)
        cdef int t = _tier(to_tier)
        cdef cnp.ndarray ehs = _as_u64(engine_hashes, "engine_hashes")
        cdef kvp_status st
        self._acquire()
        st = kvp_index_move(self.idx, e, f, t, _u64_ptr(ehs), <size_t>ehs.shape[0])
        self._release()
        if st != KVP_OK:
            _raise_status(st, f"move on endpoint {ep}")

    def clear(self, ep):
        """Forget everything one endpoint holds (engine restart, cache reset)."""
        cdef kvp_endpoint_t e = _ep(ep)
        cdef kvp_status st
        self._acquire()
        with nogil:
            st = kvp_index_clear(self.idx, e)
        self._release()
        if st != KVP_OK:
            _raise_status(st, f"clear endpoint {ep}")

    def query(self, block_hashes, QueryResult out=None):
        """Walk the request's sequence hashes in order. ``out`` is reused when given.

        A list or tuple is read as far as the walk goes, as the reference backend does: once
        no endpoint and no shared block continues the prefix, the hashes after it cannot change
        the answer and are not read (nor checked)."""
        if out is None:
            out = QueryResult(kvp_index_endpoint_limit(self.idx))
        if type(block_hashes) is list or type(block_hashes) is tuple:
            return self._query_items(block_hashes, out)
        cdef uint64_t small_hs[512]  # an 8,192-token prompt's hashes at 16 tokens per block
        cdef U64View hv
        keep_hs = _u64_view(block_hashes, "block_hashes", small_hs, 512, &hv)
        cdef size_t n = hv.n
        cdef kvp_status st
        cdef const uint64_t *hp = hv.ptr
        self._acquire()
        try:
            out._ensure(kvp_index_endpoint_limit(self.idx))
            if n >= NOGIL_BLOCKS:
                with nogil:
                    st = kvp_index_query(self.idx, hp, n, &out.q)
            else:
                st = kvp_index_query(self.idx, hp, n, &out.q)
        finally:
            self._release()
        if st != KVP_OK:
            _raise_status(st, "query")
        return out

    cdef QueryResult _query_items(self, object seq, QueryResult out):
        """query() of a list or tuple: its items converted a piece at a time, fed to the walk,
        and no further once the walk has ended. Reading a Python int costs a cache miss when
        the list is not hot, and a long prompt's walk usually ends well before its last block
        (an 8,192-token prompt in bench_core: a median of 136 of 512 blocks at 8 workers).
        Only exact ints in [0, 2**64) are read here, with the GIL held and no Python code
        running; a piece with anything else goes to _query_converted."""
        cdef uint64_t buf[QUERY_PIECE_MAX]
        cdef Py_ssize_t n = len(seq)
        cdef Py_ssize_t pos = 0, k
        cdef size_t piece = QUERY_PIECE
        cdef int more = 1
        cdef bint general = False
        cdef kvp_status st
        self._acquire()
        try:
            out._ensure(kvp_index_endpoint_limit(self.idx))
            st = kvp_index_query_begin(self.idx, <size_t>n, &out.q)
            if st != KVP_OK:
                _raise_status(st, "query")
            try:
                while more and pos < n:
                    # another thread may change a list while a long piece walks without the
                    # GIL: its items are read afresh, and a change of length is an error
                    if len(seq) != n:
                        raise InvalidArgument("block_hashes changed length during the query")
                    k = min(<Py_ssize_t>piece, n - pos)
                    if not kvpy_ints_to_u64(PySequence_Fast_ITEMS(seq) + pos, k, buf):
                        general = True
                        break
                    if <size_t>k >= NOGIL_PIECE:
                        with nogil:
                            st = kvp_index_query_feed(self.idx, buf, <size_t>k, &out.q, &more)
                    else:
                        st = kvp_index_query_feed(self.idx, buf, <size_t>k, &out.q, &more)
                    if st != KVP_OK:
                        _raise_status(st, "query")
                    pos += k
                    if piece < QUERY_PIECE_MAX:
                        piece *= 2
            finally:
                st = kvp_index_query_end(self.idx, &out.q)
            if st != KVP_OK:
                _raise_status(st, "query")
        finally:
            self._release()
        if general:
            return self._query_converted(seq, out)
        return out

    cdef QueryResult _query_converted(self, object seq, QueryResult out):
        """query() of a list or tuple with items the direct reader does not take (bools, int
        subclasses, numpy ints, ints outside u64, non-integers): converted as far as its first
        non-integer, outside the index's lock (the conversion may run Python code, which may
        call this index), then walked; that item's error is raised only if the walk reaches
        it, as the reference backend walks."""
        values, err = _u64_prefix(seq, "block_hashes")
        cdef cnp.ndarray a = values
        cdef size_t m = <size_t>a.shape[0]
        cdef const uint64_t *hp = _u64_ptr(a)
        cdef int more = 1
        cdef kvp_status st, end_st
        self._acquire()
        try:
            out._ensure(kvp_index_endpoint_limit(self.idx))
            # with a bad item, the walk is told of one more position: `more` then says
            # whether it would go on to that item
            st = kvp_index_query_begin(self.idx, m + (err is not None), &out.q)
            if st != KVP_OK:
                _raise_status(st, "query")
            try:
                if m >= NOGIL_BLOCKS:
                    with nogil:
                        st = kvp_index_query_feed(self.idx, hp, m, &out.q, &more)
                else:
                    st = kvp_index_query_feed(self.idx, hp, m, &out.q, &more)
            finally:
                end_st = kvp_index_query_end(self.idx, &out.q)
            if st != KVP_OK:
                _raise_status(st, "query")
            if end_st != KVP_OK:
                _raise_status(end_st, "query")
        finally:
            self._release()
        if err is not None and more:
            raise err
        return out

    def holdings(self, ep):
        """kvplug hash -> count per tier, for one endpoint (tests and debugging)."""
        cdef kvp_endpoint_t e = _ep(ep)
        cdef size_t n = 0
        cdef kvp_status st
        cdef cnp.ndarray hs, cs
        self._acquire()
        try:
            kvp_index_holdings(self.idx, e, NULL, NULL, 0, &n)
            hs = np.empty(n, np.uint64)
            cs = np.empty(3 * n, np.uint32)
            st = kvp_index_holdings(self.idx, e, <kvp_hash_t *>cnp.PyArray_DATA(hs),
                                    <uint32_t *>cnp.PyArray_DATA(cs), n, &n)
        finally:
            self._release()
        if st != KVP_OK:
            _raise_status(st, "holdings")
        c = cs.tolist()
        return {h: c[3 * i : 3 * i + 3] for i, h in enumerate(hs.tolist())}

    def held_count(self, ep):
        """Blocks one endpoint holds on any tier (one pass over the table, no copies)."""
        cdef kvp_endpoint_t e = _ep(ep)
        cdef size_t n = 0
        cdef kvp_status st
        self._acquire()
        try:
            st = kvp_index_holdings(self.idx, e, NULL, NULL, 0, &n)
        finally:
            self._release()
        if st != KVP_OK:
            if st != KVP_E_BUFFER:  # the count without a buffer: "too small" by design
                _raise_status(st, "held_count")
        return n

    def held_counts(self, n):
        """Blocks held per endpoint id ``0 .. n-1`` (uint64 array), in one pass."""
        cdef size_t size = <size_t>n
        cdef cnp.ndarray out = np.zeros(size, np.uint64)
        cdef kvp_status st
        self._acquire()
        try:
            st = kvp_index_held_counts(self.idx, <uint64_t *>cnp.PyArray_DATA(out), size)
        finally:
            self._release()
        if st != KVP_OK:
            _raise_status(st, "held_counts")
        return out

    def stats(self):
        cdef kvp_stats s
        kvp_index_stats(self.idx, &s)
        return {
            "stored_blocks": s.stored_blocks,
            "duplicate_stores": s.duplicate_stores,
            "conflicting_stores": s.conflicting_stores,
            "orphan_stores": s.orphan_stores,
            "removed_blocks": s.removed_blocks,
            "unknown_removes": s.unknown_removes,
            "moved_blocks": s.moved_blocks,
            "unknown_moves": s.unknown_moves,
            "evicted_blocks": s.evicted_blocks,
            "evicted_entries": s.evicted_entries,
            "cleared_endpoints": s.cleared_endpoints,
            "reannounced_blocks": s.reannounced_blocks,
            "blocks": s.blocks,
            "entries": s.entries,
            "engine_mappings": s.engine_mappings,
        }

    def _verify(self):
        """For tests: 0 when every table's invariants hold, else the number of the first broken
        one (``kvp_index_verify`` in csrc/index.c). Walks the whole index."""
        self._acquire()
        try:
            return kvp_index_verify(self.idx)
        finally:
            self._release()

    def memory_bytes(self):
        """Bytes the C index holds allocated (tables, records, holder arrays, scratch)."""
        cdef kvp_stats s
        kvp_index_stats(self.idx, &s)
        return s.memory_bytes


# ---- costs and selection -----------------------------------------------------------------------
cdef inline bint _is_vector(object x, int typenum):
    """``x`` is a 1-D contiguous numpy array of ``typenum``: usable in place, no conversion."""
    # cnp.ndarray: the type object in C (np.ndarray would be a module attribute lookup)
    return (type(x) is cnp.ndarray and cnp.PyArray_TYPE(<cnp.ndarray>x) == typenum
            and cnp.PyArray_NDIM(<cnp.ndarray>x) == 1
            and cnp.PyArray_IS_C_CONTIGUOUS(<cnp.ndarray>x))


cdef inline cnp.ndarray _empty_f64(Py_ssize_t n):
    """A new float64 vector through numpy's C API (np.empty is a Python call: ~3x slower at
    the few entries a decision has)."""
    cdef cnp.npy_intp dims = n
    return cnp.PyArray_EMPTY(1, &dims, cnp.NPY_DOUBLE, 0)


cdef cnp.ndarray _f64(object x, str what, Py_ssize_t n):
    # the routing stages pass float64 vectors: checked in C, not through ascontiguousarray;
    # ``a`` typed, so its ndim and length are read in C (a Python ``shape`` is a new tuple)
    cdef cnp.ndarray a
    if _is_vector(x, cnp.NPY_DOUBLE):
        a = <cnp.ndarray>x
    else:
        a = np.ascontiguousarray(x, dtype=np.float64)
    if cnp.PyArray_NDIM(a) != 1:
        raise InvalidArgument(f"{what} must be 1-D")
    if n >= 0 and cnp.PyArray_DIM(a, 0) != n:
        raise InvalidArgument(f"{what} has {cnp.PyArray_DIM(a, 0)} entries, expected {n}")
    return a


cdef kvp_cost_params _cost_params(object p) except *:
    """The C struct of a CostParams."""
    cdef kvp_cost_params cp
    cp.overlap_score_credit = p.overlap_score_credit
    cp.host_cache_hit_weight = p.host_cache_hit_weight
    cp.disk_cache_hit_weight = p.disk_cache_hit_weight
    cp.shared_cache_multiplier = p.shared_cache_multiplier
    cp.prefill_load_scale = p.prefill_load_scale
    return cp


def costs(prefill_blocks, device, host, disk, shared_beyond, decode_blocks, p, out=None):
    """The routing seed's cost, one float64 per candidate (numpy array)."""
    cdef cnp.ndarray pf = _f64(prefill_blocks, "prefill_blocks", -1)
    cdef Py_ssize_t n = pf.shape[0]
    cdef cnp.ndarray dv = _f64(device, "device", n)
    cdef cnp.ndarray ho = _f64(host, "host", n)
    cdef cnp.ndarray di = _f64(disk, "disk", n)
    cdef cnp.ndarray sb = _f64(shared_beyond, "shared_beyond", n)
    cdef cnp.ndarray dc = _f64(decode_blocks, "decode_blocks", n)
    cdef cnp.ndarray res
    cdef kvp_cost_params cp = _cost_params(p)
    if out is None:
        res = np.empty(n, np.float64)
    else:
        res = out
        if res.dtype != np.float64 or res.ndim != 1 or res.shape[0] < n or not res.flags.c_contiguous:
            raise InvalidArgument("out must be a contiguous float64 array with >= n entries")
    st = kvp_costs(<double *>cnp.PyArray_DATA(pf), <double *>cnp.PyArray_DATA(dv),
                   <double *>cnp.PyArray_DATA(ho), <double *>cnp.PyArray_DATA(di),
                   <double *>cnp.PyArray_DATA(sb), <double *>cnp.PyArray_DATA(dc),
                   <size_t>n, &cp, <double *>cnp.PyArray_DATA(res))
    if st != KVP_OK:
        _raise_status(st, "costs")
    return res if out is None else res[:n]


def seed_load_costs(prefill_tokens, decode_blocks, sel, device, host, disk, shared_beyond,
                    active_depth, double n_tokens, double full_blocks, double block_size, p):
    """The routing seed's default load terms and its cost, in one call: ``(prefill blocks,
    decode blocks, cost)`` per candidate ``sel[i]`` (endpoint ids into the load arrays), for
    tracked prefill and decode with KV reuse and the resident credit assumed. Each value is the
    same double operations, in the same order, as ``SeedCost.load_vectors`` followed by
    ``costs`` (tests/test_seed_cost_fused.py checks bit equality), without their ~10 numpy
    steps on arrays of a few dozen entries."""
    cdef cnp.ndarray sl = (sel if _is_vector(sel, cnp.NPY_INTP)
                           else np.ascontiguousarray(sel, dtype=np.intp))
    cdef Py_ssize_t n = sl.shape[0]
    cdef cnp.ndarray pt = _f64(prefill_tokens, "prefill_tokens", -1)
    cdef cnp.ndarray db = _f64(decode_blocks, "decode_blocks", -1)
    cdef cnp.ndarray dv = _f64(device, "device", n)
    cdef cnp.ndarray ho = _f64(host, "host", n)
    cdef cnp.ndarray di = _f64(disk, "disk", n)
    cdef cnp.ndarray sb = _f64(shared_beyond, "shared_beyond", n)
    cdef cnp.ndarray ad = None if active_depth is None else _f64(active_depth, "active_depth", n)
    cdef cnp.ndarray pf = _empty_f64(n)
    cdef cnp.ndarray dc = _empty_f64(n)
    cdef cnp.ndarray res = _empty_f64(n)
    cdef const Py_ssize_t *e = <const Py_ssize_t *>cnp.PyArray_DATA(sl)
    cdef const double *ptv = <const double *>cnp.PyArray_DATA(pt)
    cdef const double *dbv = <const double *>cnp.PyArray_DATA(db)
    cdef const double *dvv = <const double *>cnp.PyArray_DATA(dv)
    cdef const double *adv = NULL if ad is None else <const double *>cnp.PyArray_DATA(ad)
    cdef double *pfv = <double *>cnp.PyArray_DATA(pf)
    cdef double *dcv = <double *>cnp.PyArray_DATA(dc)
    cdef Py_ssize_t i, ep, n_pt = pt.shape[0], n_db = db.shape[0]
    cdef double inv = 1.0 / block_size
    cdef double per_request = n_tokens / block_size
    cdef double held
    for i in range(n):
        ep = e[i]
        if ep < 0 or ep >= n_pt or ep >= n_db:
            raise InvalidArgument(f"candidate endpoint {ep} is outside the load arrays")
        pfv[i] = ptv[ep] * inv
        pfv[i] = pfv[i] + per_request
        held = dvv[i]
        if adv != NULL and not (adv[i] <= held):  # np.maximum(active_depth, device)
            held = adv[i]
        dcv[i] = dbv[ep] - held
        dcv[i] = dcv[i] + full_blocks
    cdef kvp_cost_params cp = _cost_params(p)
    st = kvp_costs(pfv, dvv, <double *>cnp.PyArray_DATA(ho), <double *>cnp.PyArray_DATA(di),
                   <double *>cnp.PyArray_DATA(sb), dcv, <size_t>n, &cp,
                   <double *>cnp.PyArray_DATA(res))
    if st != KVP_OK:
        _raise_status(st, "seed_load_costs")
    return pf, dc, res


def select(cost, double temperature, double u):
    """Index of the chosen candidate (see kvplug._reference.select)."""
    cdef cnp.ndarray c = _f64(cost, "cost", -1)
    cdef size_t chosen = 0
    cdef kvp_status st
    if c.shape[0] == 0:
        raise InvalidArgument("no candidates")
    if not (0.0 <= u < 1.0):
        raise InvalidArgument(f"u must be in [0, 1), got {u}")
    if temperature < 0 or temperature != temperature:
        raise InvalidArgument(f"temperature must be >= 0, got {temperature}")
    st = kvp_select(<double *>cnp.PyArray_DATA(c), <size_t>c.shape[0], temperature, u, &chosen)
    if st != KVP_OK:
        if st == KVP_E_ARG:
            raise InvalidArgument("a cost is NaN")
        _raise_status(st, "select")
    return chosen





# ------------------------------------------------------------------ active blocks (dedup trie)
# The compiled twin of kvplug.active_blocks.ActiveBlocks (the pure-Python reference; read its
# module docstring for the trie): the same walks, the same node splits, the same counts
# (tests/test_active_blocks_differential.py). Every request walks it, adds to it and releases
# from it; here a walk compares hashes in C instead of through numpy scalars.

cdef class _TrieNode:
    """A run of consecutive chain hashes and the endpoints holding it (see ActiveBlocks)."""
    cdef object owner           # the uint64 array ``edge`` points into (kept alive)
    cdef const uint64_t *edge   # the run's hashes, chain order
    cdef Py_ssize_t length
    cdef _TrieNode parent
    cdef dict children          # keyed by the child's first hash
    cdef dict holders           # endpoint id -> active chains on it passing through

    @property
    def hashes(self):
        """The run's hashes (a copy; introspection and tests)."""
        return np.asarray([self.edge[i] for i in range(self.length)], dtype=np.uint64)


cdef _TrieNode _trie_node(object owner, const uint64_t *edge, Py_ssize_t length,
                          _TrieNode parent, dict holders):
    cdef _TrieNode node = _TrieNode.__new__(_TrieNode)
    node.owner = owner
    node.edge = edge
    node.length = length
    node.parent = parent
    node.children = {}
    node.holders = holders
    return node


cdef cnp.ndarray _u64_chain(object hashes):
    """``hashes`` as a 1-D contiguous uint64 array (itself when it already is one)."""
    if _is_vector(hashes, cnp.NPY_UINT64):
        return <cnp.ndarray>hashes
    arr = np.ascontiguousarray(hashes, dtype=np.uint64)
    if arr.ndim != 1:
        raise InvalidArgument("block hashes must be 1-D")
    return arr


cdef class ActiveBlocks:
    """Refcounted active chains of every endpoint (kvplug.active_blocks.ActiveBlocks, compiled).
    A walk is a list of (node, matched hashes) pairs, as the reference's."""
    cdef dict _roots
    cdef public Py_ssize_t chains   # active chains (requests) held

    def __init__(self):
        self._roots = {}
        self.chains = 0

    def walk(self, hashes):
        """The trie nodes along ``hashes``: an empty list when no endpoint holds its first
        block."""
        cdef cnp.ndarray arr = _u64_chain(hashes)
        cdef Py_ssize_t n = arr.shape[0]
        if n == 0:
            return []
        cdef const uint64_t *h = <const uint64_t *>cnp.PyArray_DATA(arr)
        found = self._roots.get(h[0])
        cdef list out = []
        if found is None:
            return out
        cdef _TrieNode node = <_TrieNode>found
        cdef Py_ssize_t pos = 0, m, k, lo, hi, mid
        cdef const uint64_t *edge
        while True:
            edge = node.edge
            m = node.length if node.length < n - pos else n - pos
            # chained hashes: equal at the probe end means equal all the way (k >= 1: the
            # first hash matched the dict key)
            if edge[m - 1] == h[pos + m - 1]:
                k = m
            else:
                lo, hi = 1, m - 1  # edge[lo-1] matches, edge[hi] does not
                while lo < hi:
                    mid = (lo + hi) // 2
                    if edge[mid] == h[pos + mid]:
                        lo = mid + 1
                    else:
                        hi = mid
                k = lo
            out.append((node, k))
            pos += k
            if k < node.length or pos == n:
                break
            found = node.children.get(h[pos])
            if found is None:
                break
            node = <_TrieNode>found
        return out

    @staticmethod
    def depths(list walk, out):
        """Per endpoint id, how many leading blocks of the walked chain are active there
        (``out``, a float64 array, is zeroed and filled)."""
        cdef Py_ssize_t pos = 0, k, ep, size = len(out)
        cdef _TrieNode node
        cdef double *o = NULL
        direct = _is_vector(out, cnp.NPY_DOUBLE)
        if direct:
            o = <double *>cnp.PyArray_DATA(<cnp.ndarray>out)
            memset(o, 0, size * sizeof(double))
        else:
            out[:] = 0
        for step in walk:
            node = <_TrieNode>step[0]
            k = step[1]
            pos += k
            for key in node.holders:
                ep = key
                if ep < 0:  # numpy's negative index, as the reference's fancy assignment
                    ep += size
                if ep < 0 or ep >= size:
                    raise IndexError(f"endpoint {key} is outside the depths array ({size})")
                if direct:
                    o[ep] = pos
                else:
                    out[ep] = pos
        return out

    def add(self, ep, hashes, list walk):
        """Hold ``hashes`` (its ``walk`` from this trie, unchanged since) on ``ep``. Returns
        (the chain's tail node, for ``release``; the number of blocks new to ``ep``)."""
        cdef cnp.ndarray arr = _u64_chain(hashes)
        cdef Py_ssize_t n = arr.shape[0]
        if n == 0:
            return None, 0
        cdef const uint64_t *h = <const uint64_t *>cnp.PyArray_DATA(arr)
        cdef Py_ssize_t pos = 0, depth = 0, k, held
        cdef _TrieNode node, parent = None, tail
        for step in walk:
            node = <_TrieNode>step[0]
            k = step[1]
            if k < node.length:
                node = self._split(node, k)
            held = node.holders.get(ep, 0)
            if held:
                depth = pos + k
            node.holders[ep] = held + 1
            pos += k
            parent = node
        tail = parent
        if pos < n:
            tail = _trie_node(arr, h + pos, n - pos, parent, {ep: 1})
            if parent is None:
                self._roots[h[pos]] = tail
            else:
                parent.children[h[pos]] = tail
        self.chains += 1
        return tail, n - depth

    def release(self, ep, _TrieNode tail):
        """Drop one chain (its tail node from ``add``) of ``ep``; returns how many blocks are
        no longer active on ``ep``."""
        if tail is None:
            return 0
        cdef Py_ssize_t freed = 0, held
        cdef _TrieNode node = tail, parent
        cdef dict siblings
        while node is not None:
            held = node.holders.get(ep, 0) - 1
            if held > 0:
                node.holders[ep] = held
            else:
                node.holders.pop(ep, None)
                freed += node.length
            parent = node.parent
            if not node.holders:  # no chain passes here any more: unlink it
                siblings = self._roots if parent is None else parent.children
                key = node.edge[0]
                if siblings.get(key) is node:
                    del siblings[key]
            node = parent
        self.chains -= 1
        return freed

    cdef _TrieNode _split(self, _TrieNode node, Py_ssize_t k):
        """Cut ``node`` after its first ``k`` hashes; returns the new upper part (same
        holders). The lower part keeps its identity, so tails held by requests stay valid."""
        cdef _TrieNode upper = _trie_node(node.owner, node.edge, k, node.parent,
                                          dict(node.holders))
        siblings = self._roots if node.parent is None else node.parent.children
        siblings[node.edge[0]] = upper
        node.edge = node.edge + k
        node.length -= k
        node.parent = upper
        upper.children[node.edge[0]] = node
        return upper

    def nodes(self):
        """Number of trie nodes (introspection, tests)."""
        cdef Py_ssize_t count = 0
        cdef list stack = list(self._roots.values())
        cdef _TrieNode node
        while stack:
            node = <_TrieNode>stack.pop()
            count += 1
            stack.extend(node.children.values())
        return count


def gather_f64(sel, *arrays):
    """``arrays[j][sel]`` as new float64 arrays, one per array: what a routing stage keeps of
    the index's per-endpoint int32 answers for its candidates (``sel``: ``slice(0, n)`` or
    endpoint ids), in one call instead of a gather and a cast per array. Other dtypes take
    numpy's path."""
    cdef Py_ssize_t n, i, j, ep, size, start, step
    cdef cnp.ndarray ids = None
    cdef const Py_ssize_t *e = NULL
    if type(sel) is slice:
        PySlice_Unpack(sel, &start, &n, &step)
        if start != 0 or step != 1 or n < 0:  # not a leading run: numpy's slicing rules
            return tuple(np.asarray(a)[sel].astype(np.float64) for a in arrays)
    else:
        ids = np.ascontiguousarray(sel, dtype=np.intp)
        if ids.ndim != 1:
            raise InvalidArgument("candidate ids must be 1-D")
        n = ids.shape[0]
        e = <const Py_ssize_t *>cnp.PyArray_DATA(ids)
    cdef list out = []
    cdef cnp.ndarray src, dst
    cdef const int32_t *s
    cdef double *d
    for a in arrays:
        if not _is_vector(a, cnp.NPY_INT32):
            out.append(np.asarray(a)[sel].astype(np.float64))
            continue
        src = <cnp.ndarray>a
        size = src.shape[0]
        s = <const int32_t *>cnp.PyArray_DATA(src)
        if e == NULL:
            m = n if n < size else size  # a slice past the end stops there, as numpy's
            dst = _empty_f64(m)
            d = <double *>cnp.PyArray_DATA(dst)
            for i in range(m):
                d[i] = s[i]
        else:
            dst = _empty_f64(n)
            d = <double *>cnp.PyArray_DATA(dst)
            for i in range(n):
                ep = e[i]
                if ep < 0:
                    ep += size
                if ep < 0 or ep >= size:
                    raise IndexError(f"index {e[i]} is out of bounds for size {size}")
                d[i] = s[ep]
        out.append(dst)
    return tuple(out)



cdef inline double _py_max(double a, double b):
    """Python's ``max(a, b)`` on floats: the first unless the second is greater."""
    return b if b > a else a


cdef inline double _py_min(double a, double b):
    """Python's ``min(a, b)`` on floats: the first unless the second is smaller."""
    return b if b < a else a


cdef double _py_divmod(double vx, double wx, double *rem):
    """Python's ``divmod(vx, wx)`` on floats (CPython's float_divmod), wx != 0: the quotient,
    and the remainder in ``rem``."""
    cdef double mod = fmod(vx, wx)
    cdef double div = (vx - mod) / wx
    cdef double floordiv
    if mod:
        if (wx < 0) != (mod < 0):
            mod += wx
            div -= 1.0
    else:
        mod = copysign(0.0, wx)
    rem[0] = mod
    if div:
        floordiv = floor(div)
        if div - floordiv > 0.5:
            floordiv += 1.0
        return floordiv
    return copysign(0.0, vx / wx)


cdef double _chunked_prefill_seconds(double new, double cached, double chunk,
                                     double a, double b, double c):
    """kvplug.affinity.chunked_prefill_seconds: the same operations in the same order."""
    cdef double n = _py_max(new, 0.0)
    cdef double p = _py_max(cached, 0.0)
    cdef double full, rem, quad, ctx
    if n <= 0:
        return 0.0
    if chunk <= 0 or chunk >= n:
        return (a * n + b * n * n + c * n * p) / 1000.0
    full = _py_divmod(n, chunk, &rem)
    quad = full * chunk * chunk + rem * rem
    ctx = n * p + chunk * chunk * full * (full - 1) / 2 + rem * full * chunk
    return (a * n + b * quad + c * ctx) / 1000.0


# the kernels' per-endpoint tables: the caller's own arrays, never a copy made per decision
# (``_f64`` would convert silently)
cdef const double *_f64_table(object x, str what, Py_ssize_t *size) except NULL:
    if not _is_vector(x, cnp.NPY_DOUBLE):
        raise InvalidArgument(f"{what} must be a 1-D contiguous float64 array")
    size[0] = cnp.PyArray_DIM(<cnp.ndarray>x, 0)
    return <const double *>cnp.PyArray_DATA(<cnp.ndarray>x)


cdef const int64_t *_i64_table(object x, str what, Py_ssize_t *size) except NULL:
    if not _is_vector(x, cnp.NPY_INT64):
        raise InvalidArgument(f"{what} must be a 1-D contiguous int64 array")
    size[0] = cnp.PyArray_DIM(<cnp.ndarray>x, 0)
    return <const int64_t *>cnp.PyArray_DATA(<cnp.ndarray>x)


def stale_prefill_summaries(endpoints, idx, max_batched, queues, versions):
    """The affinity policy's prefill summaries to refresh before :func:`predicted_ttfts`:
    ``(endpoint, chunk)`` for each candidate ``idx[i]`` (None: every one) of ``endpoints``
    whose summary in ``queues`` (a ``kvplug.affinity.PrefillSummaries``) was taken at another
    version of its prefills (``versions``, the load tracker's) or another chunk (its
    ``max_batched``, 0.0 past the array's end)."""
    cdef cnp.ndarray eps = (endpoints if _is_vector(endpoints, cnp.NPY_INTP)
                            else np.ascontiguousarray(endpoints, dtype=np.intp))
    cdef const Py_ssize_t *e = <const Py_ssize_t *>cnp.PyArray_DATA(eps)
    cdef Py_ssize_t n_eps = eps.shape[0]
    cdef Py_ssize_t n_mb, n_sv, n_sc, n_lv
    cdef const double *mb = _f64_table(max_batched, "max_batched", &n_mb)
    cdef const int64_t *sv = _i64_table(queues.version, "queues.version", &n_sv)
    cdef const double *sc = _f64_table(queues.chunk, "queues.chunk", &n_sc)
    cdef const int64_t *lv = _i64_table(versions, "versions", &n_lv)
    cdef Py_ssize_t n = n_eps if idx is None else len(idx)
    cdef Py_ssize_t i, j, ep
    cdef double chunk
    cdef list out = []
    for j in range(n):
        i = j if idx is None else idx[j]
        if i < 0 or i >= n_eps:
            raise InvalidArgument(f"candidate {i} is outside the {n_eps} endpoints")
        ep = e[i]
        if ep < 0 or ep >= n_sv or ep >= n_sc or ep >= n_lv:
            raise InvalidArgument(f"endpoint {ep} is outside the prefill summaries")
        chunk = mb[ep] if ep < n_mb else 0.0
        if sv[ep] != lv[ep] or sc[ep] != chunk:
            out.append((ep, chunk))
    return out


def predicted_ttfts(endpoints, idx, overlap, double prompt_tokens, double block_size,
                    max_batched, queues, inflight, context_tokens, double now, double read_ms,
                    coeffs, slowdowns=None, long_prefill=None):
    """The affinity policy's predicted time to first token of a prompt of ``prompt_tokens``
    on candidates ``idx`` (indices into ``endpoints``, the trace's endpoint ids; None: every
    one), a list of floats: the engine's queued prefill seconds at ``now`` (``queues``, a
    ``kvplug.affinity.PrefillSummaries`` current for these endpoints:
    :func:`stale_prefill_summaries`), plus the prompt's chunked prefill over its cached prefix
    (``overlap[i]`` blocks) at the engine's chunk (``max_batched``, 0.0 past its end) with the
    prefill fit ``coeffs`` (a, b, c), plus with ``read_ms`` the decode reads of the engine's
    active sequences (``inflight``, ``context_tokens``) in its steps. The same double
    operations, in the same order, as ``Affinity._predicted_ttft``'s one-engine path in
    Python (tests/test_affinity.py checks equality), without a Python call per engine: with
    hundreds of engines those were most of a routing decision. ``slowdowns`` (float64 per
    endpoint, 1.0 past its end; None: all 1.0): each engine's step times relative to the
    prefill fit's, which scale its predicted seconds (a factor of 1.0 changes no float).
    ``long_prefill`` (float64 per endpoint, 0.0 past its end; None: all 0.0): each engine's
    ``long_prefill_token_threshold``; on one with a threshold T and requests in flight the
    prompt runs in chunks of at most T and waits at most for ``ceil(new / T) * T`` tokens of
    each queued prefill (``queues.rate``: their seconds per token, summed), as
    ``Affinity._predicted_ttft``."""
    cdef cnp.ndarray eps = (endpoints if _is_vector(endpoints, cnp.NPY_INTP)
                            else np.ascontiguousarray(endpoints, dtype=np.intp))
    cdef const Py_ssize_t *e = <const Py_ssize_t *>cnp.PyArray_DATA(eps)
    cdef Py_ssize_t n_eps = eps.shape[0]
    cdef Py_ssize_t n_mb, n_s, n_st, n_oa, n_os, n_if, n_ctx
    cdef const double *mb = _f64_table(max_batched, "max_batched", &n_mb)
    cdef const double *sec = _f64_table(queues.seconds, "queues.seconds", &n_s)
    cdef const double *stp = _f64_table(queues.steps, "queues.steps", &n_st)
    cdef const double *oat = _f64_table(queues.oldest_at, "queues.oldest_at", &n_oa)
    cdef const double *osec = _f64_table(queues.oldest_seconds, "queues.oldest_seconds", &n_os)
    cdef const int64_t *active = _i64_table(inflight, "inflight", &n_if)
    cdef const int64_t *ctx = _i64_table(context_tokens, "context_tokens", &n_ctx)
    cdef Py_ssize_t n_sd = 0, n_lp = 0, n_rt = 0
    cdef const double *sd = (NULL if slowdowns is None
                             else _f64_table(slowdowns, "slowdowns", &n_sd))
    cdef const double *lp = (NULL if long_prefill is None
                             else _f64_table(long_prefill, "long_prefill", &n_lp))
    cdef const double *rt = _f64_table(queues.rate, "queues.rate", &n_rt)
    cdef double a, b, c
    a, b, c = coeffs
    cdef list ov = overlap if type(overlap) is list else list(overlap)
    cdef Py_ssize_t n_ov = len(ov)
    cdef Py_ssize_t n = n_eps if idx is None else len(idx)
    cdef list out = [None] * n
    cdef Py_ssize_t i, j, ep
    cdef double cached, chunk, new, own, queued, elapsed, read, steps, context, slow, cap
    for j in range(n):
        i = j if idx is None else idx[j]
        if i < 0 or i >= n_eps or i >= n_ov:
            raise InvalidArgument(f"candidate {i} is outside the {n_eps} endpoints")
        ep = e[i]
        if (ep < 0 or ep >= n_s or ep >= n_st or ep >= n_oa or ep >= n_os or ep >= n_if
                or ep >= n_ctx or ep >= n_rt):
            raise InvalidArgument(f"endpoint {ep} is outside the load or prefill summaries")
        cached = <double>ov[i] * block_size
        chunk = mb[ep] if ep < n_mb else 0.0
        new = prompt_tokens - cached
        slow = sd[ep] if ep < n_sd else 1.0
        # Affinity._endpoint_queue: a summary without prefills (0, 0, inf, 0, -inf, 0) gives 0.0
        queued = sec[ep]
        if read_ms:
            queued += stp[ep] * read_ms * <double>ctx[ep] / 1e6
        queued = queued * slow
        elapsed = _py_min(_py_max(now - oat[ep], 0.0), osec[ep] * slow)
        queued = _py_max(queued - elapsed, 0.0)
        cap = lp[ep] if ep < n_lp else 0.0
        if cap > 0 and active[ep] > 0:
            chunk = _py_min(chunk, cap) if chunk > 0 else cap
            if queued > 0:
                queued = _py_min(queued, ceil(new / cap) * cap * rt[ep] * slow)
        own = _chunked_prefill_seconds(new, cached, chunk, a, b, c) * slow
        # Affinity._read_seconds
        read = 0.0
        if read_ms and new > 0:
            context = <double>ctx[ep]
            steps = 1.0 if chunk <= 0 else ceil(new / _py_max(chunk - <double>active[ep], 1.0))
            read = steps * read_ms * context / 1e6 * slow
        out[j] = queued + own + read
    return out



cdef enum:
    _QUANTILE_BLOCK = 512  # values per sorted block of SlidingQuantile before it splits


cdef Py_ssize_t _bisect_left(const double *a, Py_ssize_t n, double v) noexcept:
    cdef Py_ssize_t lo = 0, hi = n, mid
    while lo < hi:
        mid = (lo + hi) >> 1
        if a[mid] < v:
            lo = mid + 1
        else:
            hi = mid
    return lo


cdef class SlidingQuantile:
    """Quantiles of the last ``window`` values added: ``kvplug.affinity.RecentQuantile`` (the
    same floats: numpy's linear method over the window's values in order) in C. The values
    are kept sorted in blocks of at most 512 (an insert or removal moves at most a block's
    entries; a quantile walks the blocks' sizes), and in arrival order in a ring, which says
    which value leaves. The default routing adds one value and asks for its quantile per
    decision: 0.8 us with two quantiles on a 50,000-value window, against ~10 with
    ``SortedList``."""

    cdef readonly Py_ssize_t window
    cdef Py_ssize_t count, oldest  # values held; the ring's oldest slot
    cdef double *ring
    cdef double **blocks
    cdef double *maxes  # each block's largest value (its last)
    cdef Py_ssize_t *sizes
    cdef Py_ssize_t n_blocks, block_slots

    def __cinit__(self, Py_ssize_t window):
        if window < 1:
            raise InvalidArgument("window must be >= 1")
        self.window = window
        self.ring = <double *>malloc(window * sizeof(double))
        self.block_slots = 8
        self.blocks = <double **>malloc(self.block_slots * sizeof(double *))
        self.maxes = <double *>malloc(self.block_slots * sizeof(double))
        self.sizes = <Py_ssize_t *>malloc(self.block_slots * sizeof(Py_ssize_t))
        if not (self.ring and self.blocks and self.maxes and self.sizes):
            raise MemoryError()

    def __dealloc__(self):
        cdef Py_ssize_t i
        if self.blocks != NULL:
            for i in range(self.n_blocks):
                free(self.blocks[i])
        free(self.blocks)
        free(self.maxes)
        free(self.sizes)
        free(self.ring)

    def __len__(self):
        return self.count

    cdef int _new_block(self, Py_ssize_t at) except -1:
        """An empty block at position ``at`` of the block list."""
        cdef Py_ssize_t slots
        cdef double **blocks
        cdef double *maxes
        cdef double *block
        cdef Py_ssize_t *sizes
        if self.n_blocks == self.block_slots:
            slots = 2 * self.block_slots
            blocks = <double **>realloc(self.blocks, slots * sizeof(double *))
            if blocks == NULL:
                raise MemoryError()
            self.blocks = blocks
            maxes = <double *>realloc(self.maxes, slots * sizeof(double))
            if maxes == NULL:
                raise MemoryError()
            self.maxes = maxes
            sizes = <Py_ssize_t *>realloc(self.sizes, slots * sizeof(Py_ssize_t))
            if sizes == NULL:
                raise MemoryError()
            self.sizes = sizes
            self.block_slots = slots
        block = <double *>malloc(_QUANTILE_BLOCK * sizeof(double))
        if block == NULL:
            raise MemoryError()
        cdef Py_ssize_t tail = self.n_blocks - at
        memmove(&self.blocks[at + 1], &self.blocks[at], tail * sizeof(double *))
        memmove(&self.maxes[at + 1], &self.maxes[at], tail * sizeof(double))
        memmove(&self.sizes[at + 1], &self.sizes[at], tail * sizeof(Py_ssize_t))
        self.blocks[at] = block
        self.sizes[at] = 0
        self.n_blocks += 1
        return 0

    cdef int _insert(self, double v) except -1:
        cdef Py_ssize_t i, pos, n, half
        cdef double *b
        if self.n_blocks == 0:
            self._new_block(0)
        i = _bisect_left(self.maxes, self.n_blocks, v)
        if i == self.n_blocks:
            i -= 1  # past every block's largest: the last block's end
        b = self.blocks[i]
        n = self.sizes[i]
        pos = _bisect_left(b, n, v)
        memmove(&b[pos + 1], &b[pos], (n - pos) * sizeof(double))
        b[pos] = v
        n += 1
        self.sizes[i] = n
        self.maxes[i] = b[n - 1]
        if n == _QUANTILE_BLOCK:  # split: the upper half into a new block after it
            self._new_block(i + 1)
            half = n >> 1
            memcpy(self.blocks[i + 1], &self.blocks[i][half], (n - half) * sizeof(double))
            self.sizes[i + 1] = n - half
            self.maxes[i + 1] = self.blocks[i][n - 1]
            self.sizes[i] = half
            self.maxes[i] = self.blocks[i][half - 1]
        return 0

    cdef int _remove(self, double v) except -1:
        cdef Py_ssize_t i = _bisect_left(self.maxes, self.n_blocks, v)
        cdef Py_ssize_t pos, n, tail
        cdef double *b
        if i < self.n_blocks:
            b = self.blocks[i]
            n = self.sizes[i]
            pos = _bisect_left(b, n, v)
        if i == self.n_blocks or pos == n or b[pos] != v:  # the ring's value is always held
            raise KvplugError("SlidingQuantile lost a value")
        memmove(&b[pos], &b[pos + 1], (n - pos - 1) * sizeof(double))
        n -= 1
        if n:
            self.sizes[i] = n
            self.maxes[i] = b[n - 1]
            return 0
        free(b)
        tail = self.n_blocks - i - 1
        memmove(&self.blocks[i], &self.blocks[i + 1], tail * sizeof(double *))
        memmove(&self.maxes[i], &self.maxes[i + 1], tail * sizeof(double))
        memmove(&self.sizes[i], &self.sizes[i + 1], tail * sizeof(Py_ssize_t))
        self.n_blocks -= 1
        return 0

    def add(self, double value):
        if value != value:
            raise InvalidArgument("a NaN has no place in a quantile")
        cdef Py_ssize_t slot
        if self.count == self.window:  # the oldest leaves; its slot takes the new value
            self._remove(self.ring[self.oldest])
            slot = self.oldest
            self.oldest = (self.oldest + 1) % self.window
        else:
            slot = (self.oldest + self.count) % self.window
            self.count += 1
        self.ring[slot] = value
        self._insert(value)

    def extend(self, values):
        for v in values:
            self.add(v)

    cdef double _at(self, Py_ssize_t k) noexcept:
        """The k-th smallest value held (0 <= k < count), walking the blocks' sizes from the
        nearer end (the tail's quantiles are near the top)."""
        cdef Py_ssize_t i = 0
        cdef Py_ssize_t above = self.count - 1 - k  # values above the k-th
        if above < k:
            i = self.n_blocks - 1
            while above >= self.sizes[i]:
                above -= self.sizes[i]
                i -= 1
            return self.blocks[i][self.sizes[i] - 1 - above]
        while k >= self.sizes[i]:
            k -= self.sizes[i]
            i += 1
        return self.blocks[i][k]

    def quantile(self, double q):
        """numpy's ``quantile(values, q)`` (linear) over the values held, as RecentQuantile's."""
        if not self.count:
            raise ValueError("no values")
        if not 0 <= q <= 1:
            raise InvalidArgument(f"quantile {q} is not in [0, 1]")
        cdef Py_ssize_t n = self.count
        cdef double virtual = (n - 1) * q
        if virtual >= n - 1:
            return self._at(n - 1)
        cdef Py_ssize_t lo = <Py_ssize_t>floor(virtual)
        cdef double a = self._at(lo), b = self._at(lo + 1)
        cdef double gamma = virtual - lo
        cdef double diff = b - a
        return b - diff * (1 - gamma) if gamma >= 0.5 else a + diff * gamma


__all__ = [
    "ActiveBlocks", "CostParams", "DEVICE", "DISK", "HOST", "Index", "MAX_ENDPOINT", "N_TIERS",
    "QueryResult", "SHARED", "chain_hash", "costs", "gather_f64", "hash_blocks", "local_hash",
    "SlidingQuantile", "predicted_ttfts", "select", "softmax_probs", "stale_prefill_summaries",
]
