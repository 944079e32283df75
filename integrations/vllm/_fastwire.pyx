# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""Fast path of the vLLM KV-event decoder: one pass over a msgpack ``KVEventBatch``.

Handles the shapes a healthy engine sends (array- or map-form events in an array- or
map-form batch, uint64 / int64 / bin hashes, GPU/CPU/STORAGE media, group 0, full-attention
stores), and checks every field vLLM declares as the msgspec path does (wire.py states the
contract both follow). A batch is first parsed and
checked in C alone: hashes and token ids go straight into the decoder's reused u64 / u32
buffers (no Python int per token or hash, nothing allocated per event); only then are the
kvplug events built, each with its own compact numpy arrays. Anything else — an unknown kind, a
wrong type, a truncated payload, another KV-cache group, an unknown medium, a token outside
u32 — returns None, and the caller decodes the batch with the msgspec path, which counts and
logs each problem. So this module only has to be right on what it accepts.
"""

from cpython.buffer cimport PyBUF_SIMPLE, PyBuffer_Release, PyObject_GetBuffer
from cpython.object cimport PyObject
from libc.stdint cimport int64_t, uint8_t, uint16_t, uint32_t, uint64_t
from libc.stdlib cimport calloc, free, malloc, realloc
from libc.string cimport memcmp, memcpy, memset

import numpy as np

cimport numpy as cnp

cnp.import_array()

DEF MAX_DEPTH = 32


cdef struct Reader:
    const uint8_t *p
    size_t n
    size_t pos


cdef extern from *:
    """
    #include <string.h>
    /* Token ids two at a time, for vocabularies over 64k (Llama 3's 128,256 ids, Qwen's,
     * Gemma's), whose ids mix msgpack's 1-, 3- and 5-byte forms at random. Where each id
     * starts depends on the width of the one before, so a per-id step waits for its type
     * byte and then its width (~13 cycles an id unbranched; with branches, ~half the widths
     * mispredict). Here one 8-byte load gives the first id's type byte and the type byte at
     * each place the second can start (1, 2, 3 or 5 bytes on); their widths are looked up
     * side by side, and the first id's width only picks among them: one lookup on the path
     * from one pair to the next instead of two. Little-endian hosts only (the load's byte
     * order); elsewhere the per-id loop does it all. */
    #if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    /* by type byte: the id's width in bytes (positive fixint 1, uint8 2, uint16 3, uint32 5;
     * 0: not one), and the shifts that take its value from the byte-swapped 8 bytes at it */
    static const uint8_t kvfw_width[256] = {[0 ... 0x7f] = 1, [0xcc] = 2, [0xcd] = 3, [0xce] = 5};
    static const uint8_t kvfw_shl[256] = {[0xcc] = 8, [0xcd] = 8, [0xce] = 8};
    static const uint8_t kvfw_shr[256] = {[0 ... 0x7f] = 56, [0xcc] = 56, [0xcd] = 48,
                                          [0xce] = 32};

    static inline uint32_t kvfw_id_at(const uint8_t *q) {
        uint64_t w;
        memcpy(&w, q, 8);
        uint64_t e = __builtin_bswap64(w);
        return (uint32_t)((e << kvfw_shl[q[0]]) >> kvfw_shr[q[0]]);
    }

    /* d[*i..] from p[*pos..] two ids a step while 2 ids are wanted and 16 bytes remain (the
     * widest pair takes 10 and the value loads read 8 from the second id's start); stops
     * early at a byte that starts no id: the caller's per-id loop then meets it and declines. */
    static inline void kvfw_id_pairs(const uint8_t *p, size_t *pos, size_t end, uint32_t *d,
                                     size_t *i, size_t n) {
        size_t at = *pos, k = *i;
        while (k + 2 <= n && at + 16 <= end) {
            uint64_t w;
            memcpy(&w, p + at, 8);
            uint32_t w0 = kvfw_width[w & 0xff];
            uint32_t next = (uint32_t)kvfw_width[(w >> 8) & 0xff]
                            | (uint32_t)kvfw_width[(w >> 16) & 0xff] << 4
                            | (uint32_t)kvfw_width[(w >> 24) & 0xff] << 8
                            | (uint32_t)kvfw_width[(w >> 40) & 0xff] << 16;
            uint32_t w1 = (next >> ((4 * w0 - 4) & 31)) & 0xf;
            if (!w0 || !w1)
                break;
            d[k] = kvfw_id_at(p + at);
            d[k + 1] = kvfw_id_at(p + at + w0);
            at += w0 + w1;
            k += 2;
        }
        *pos = at;
        *i = k;
    }
    #else
    static inline void kvfw_id_pairs(const uint8_t *p, size_t *pos, size_t end, uint32_t *d,
                                     size_t *i, size_t n) {
        (void)p; (void)pos; (void)end; (void)d; (void)i; (void)n;
    }
    #endif
    """
    void kvfw_id_pairs(const uint8_t *p, size_t *pos, size_t end, uint32_t *d, size_t *i,
                       size_t n) noexcept nogil


cdef inline bint _need(Reader *r, size_t k) noexcept nogil:
    return r.pos + k <= r.n


cdef inline uint64_t _be(const uint8_t *p, int k) noexcept nogil:
    cdef uint64_t v = 0
    cdef int i
    for i in range(k):
        v = (v << 8) | p[i]
    return v


cdef inline uint64_t _be64(const uint8_t *p) noexcept nogil:
    return ((<uint64_t>p[0] << 56) | (<uint64_t>p[1] << 48) | (<uint64_t>p[2] << 40) |
            (<uint64_t>p[3] << 32) | (<uint64_t>p[4] << 24) | (<uint64_t>p[5] << 16) |
            (<uint64_t>p[6] << 8) | <uint64_t>p[7])


cdef inline bint _nil(Reader *r) noexcept nogil:
    """Consume a nil if one is next."""
    if r.pos < r.n and r.p[r.pos] == 0xC0:
        r.pos += 1
        return True
    return False


DEF ARRAY = 0x90  # fixarray; 0xDC, 0xDD are array16 / array32
DEF MAP = 0x80  # fixmap; 0xDE, 0xDF are map16 / map32


cdef inline int _len(Reader *r, size_t *out, uint8_t kind) noexcept nogil:
    """Array (``kind`` ARRAY) or map (MAP) header -> its length; -1 if the next value is not
    one (or is truncated). The 16/32-bit forms follow fixarray / fixmap by the same rule."""
    if r.pos >= r.n:
        return -1
    cdef uint8_t b = r.p[r.pos]
    cdef uint8_t wide = 0xDC if kind == ARRAY else 0xDE
    if kind <= b <= kind + 0x0F:
        out[0] = b & 0x0F
        r.pos += 1
        return 0
    if b == wide and _need(r, 3):
        out[0] = <size_t>_be(r.p + r.pos + 1, 2)
        r.pos += 3
        return 0
    if b == wide + 1 and _need(r, 5):
        out[0] = <size_t>_be(r.p + r.pos + 1, 4)
        r.pos += 5
        return 0
    return -1


cdef inline bint _is(Reader *r, uint8_t kind) noexcept nogil:
    """Whether the next value is an array (``kind`` ARRAY) or a map (MAP); nothing consumed."""
    if r.pos >= r.n:
        return False
    cdef uint8_t b = r.p[r.pos]
    cdef uint8_t wide = 0xDC if kind == ARRAY else 0xDE
    return kind <= b <= kind + 0x0F or b == wide or b == wide + 1


cdef inline int _str(Reader *r, const uint8_t **s, size_t *n) noexcept nogil:
    if r.pos >= r.n:
        return -1
    cdef uint8_t b = r.p[r.pos]
    cdef size_t k
    if 0xA0 <= b <= 0xBF:
        k = b & 0x1F
        r.pos += 1
    elif b == 0xD9 and _need(r, 2):
        k = r.p[r.pos + 1]
        r.pos += 2
    elif b == 0xDA and _need(r, 3):
        k = <size_t>_be(r.p + r.pos + 1, 2)
        r.pos += 3
    elif b == 0xDB and _need(r, 5):
        k = <size_t>_be(r.p + r.pos + 1, 4)
        r.pos += 5
    else:
        return -1
    if not _need(r, k):
        return -1
    s[0] = r.p + r.pos
    n[0] = k
    r.pos += k
    return 0


cdef inline int _int(Reader *r, uint64_t *out, bint *neg) noexcept nogil:
    """Any msgpack integer -> its 64-bit two's complement; ``neg`` tells a negative value."""
    if r.pos >= r.n:
        return -1
    cdef uint8_t b = r.p[r.pos]
    cdef uint64_t v
    neg[0] = False
    if b <= 0x7F:
        out[0] = b
        r.pos += 1
        return 0
    if b >= 0xE0:
        out[0] = <uint64_t>(<int64_t>(<signed char>b))
        neg[0] = True
        r.pos += 1
        return 0
    cdef int k
    if b == 0xCC:
        k = 1
    elif b == 0xCD:
        k = 2
    elif b == 0xCE:
        k = 4
    elif b == 0xCF:
        k = 8
    elif 0xD0 <= b <= 0xD3:
        k = 1 << (b - 0xD0)
        if not _need(r, 1 + k):
            return -1
        v = _be(r.p + r.pos + 1, k)
        # sign-extend the k-byte value
        if k < 8 and (v >> (8 * k - 1)) & 1:
            v |= (~<uint64_t>0) << (8 * k)
        out[0] = v
        neg[0] = (v >> 63) & 1
        r.pos += 1 + k
        return 0
    else:
        return -1
    if not _need(r, 1 + k):
        return -1
    out[0] = _be(r.p + r.pos + 1, k)
    r.pos += 1 + k
    return 0


cdef inline int _hash(Reader *r, uint64_t *out) noexcept nogil:
    """A block hash: any integer (folded to u64) or bin (its last 8 bytes, big-endian)."""
    cdef bint neg
    if r.pos >= r.n:
        return -1
    cdef uint8_t b = r.p[r.pos]
    cdef size_t k
    if b == 0xCF:  # the common case: a uint64 >= 2**32
        if r.pos + 9 > r.n:
            return -1
        out[0] = _be64(r.p + r.pos + 1)
        r.pos += 9
        return 0
    if b == 0xC4 or b == 0xC5 or b == 0xC6:
        if b == 0xC4 and _need(r, 2):
            k = r.p[r.pos + 1]
            r.pos += 2
        elif b == 0xC5 and _need(r, 3):
            k = <size_t>_be(r.p + r.pos + 1, 2)
            r.pos += 3
        elif b == 0xC6 and _need(r, 5):
            k = <size_t>_be(r.p + r.pos + 1, 4)
            r.pos += 5
        else:
            return -1
        if k == 0 or not _need(r, k):
            return -1
        if k > 8:
            out[0] = _be(r.p + r.pos + k - 8, 8)
        else:
            out[0] = _be(r.p + r.pos, <int>k)
        r.pos += k
        return 0
    return _int(r, out, &neg)


cdef int _skip(Reader *r, int depth) noexcept nogil:
    """Skip one value of any type."""
    if depth > MAX_DEPTH or r.pos >= r.n:
        return -1
    cdef uint8_t b = r.p[r.pos]
    cdef size_t k = 0, i
    if b <= 0x7F or b >= 0xE0 or b == 0xC0 or b == 0xC2 or b == 0xC3:
        r.pos += 1
        return 0
    if 0x80 <= b <= 0x8F or b == 0xDE or b == 0xDF:
        if _len(r, &k, MAP) < 0:
            return -1
        for i in range(2 * k):
            if _skip(r, depth + 1) < 0:
                return -1
        return 0
    if 0x90 <= b <= 0x9F or b == 0xDC or b == 0xDD:
        if _len(r, &k, ARRAY) < 0:
            return -1
        for i in range(k):
            if _skip(r, depth + 1) < 0:
                return -1
        return 0
    if 0xA0 <= b <= 0xBF:
        k = 1 + (b & 0x1F)
    elif b == 0xCC or b == 0xD0:
        k = 2
    elif b == 0xCD or b == 0xD1:
        k = 3
    elif b == 0xCE or b == 0xD2 or b == 0xCA:
        k = 5
    elif b == 0xCF or b == 0xD3 or b == 0xCB:
        k = 9
    elif b == 0xD4:
        k = 3
    elif b == 0xD5:
        k = 4
    elif b == 0xD6:
        k = 6
    elif b == 0xD7:
        k = 10
    elif b == 0xD8:
        k = 18
    elif b == 0xC4 or b == 0xD9:
        if not _need(r, 2):
            return -1
        k = 2 + r.p[r.pos + 1]
    elif b == 0xC5 or b == 0xDA:
        if not _need(r, 3):
            return -1
        k = 3 + <size_t>_be(r.p + r.pos + 1, 2)
    elif b == 0xC6 or b == 0xDB:
        if not _need(r, 5):
            return -1
        k = 5 + <size_t>_be(r.p + r.pos + 1, 4)
    elif b == 0xC7:
        if not _need(r, 2):
            return -1
        k = 3 + r.p[r.pos + 1]
    elif b == 0xC8:
        if not _need(r, 3):
            return -1
        k = 4 + <size_t>_be(r.p + r.pos + 1, 2)
    elif b == 0xC9:
        if not _need(r, 5):
            return -1
        k = 6 + <size_t>_be(r.p + r.pos + 1, 4)
    else:
        return -1
    if not _need(r, k):
        return -1
    r.pos += k
    return 0


cdef int _double(Reader *r, double *out) noexcept nogil:
    cdef uint64_t v
    cdef uint32_t w
    cdef bint neg
    if r.pos >= r.n:
        return -1
    cdef uint8_t b = r.p[r.pos]
    if b == 0xCB and _need(r, 9):
        v = _be(r.p + r.pos + 1, 8)
        out[0] = (<double *>&v)[0]
        r.pos += 9
        return 0
    if b == 0xCA and _need(r, 5):
        w = <uint32_t>_be(r.p + r.pos + 1, 4)
        out[0] = (<float *>&w)[0]
        r.pos += 5
        return 0
    if _int(r, &v, &neg) == 0:
        out[0] = <double>(<int64_t>v) if neg else <double>v
        return 0
    return -1


cdef int _rank(Reader *r, long *rank) noexcept nogil:
    """The batch's ``data_parallel_rank``: nil, or a rank the subscriber can use."""
    cdef uint64_t v
    cdef bint neg
    if _nil(r):
        return 0
    if _int(r, &v, &neg) < 0 or neg or v > 0x7FFFFFFF:
        return -1
    rank[0] = <long>v
    return 0


# ---- field names ---------------------------------------------------------------------------
cdef enum Field:
    F_UNKNOWN, F_TYPE, F_HASHES, F_PARENT, F_TOKENS, F_BLOCK_SIZE, F_LORA_ID, F_MEDIUM,
    F_LORA_NAME, F_EXTRA_KEYS, F_GROUP, F_SPEC_KIND, F_SPEC_WINDOW, F_LOCALITY, F_OWNERSHIP,
    F_SESSION, F_SKIP

# Array-form field order after the tag: the fields of wire.py's msgspec structs, in order.
# Every field there is type-checked here as there (the contract both paths follow: a field
# vLLM declares must have vLLM's type, or the event is malformed); later elements are ignored.
DEF N_STORED = 13
cdef Field STORED_ORDER[N_STORED]
STORED_ORDER[:] = [F_HASHES, F_PARENT, F_TOKENS, F_BLOCK_SIZE, F_LORA_ID, F_MEDIUM, F_LORA_NAME,
                   F_EXTRA_KEYS, F_GROUP, F_SPEC_KIND, F_SPEC_WINDOW, F_LOCALITY, F_OWNERSHIP]
DEF N_REMOVED = 5
cdef Field REMOVED_ORDER[N_REMOVED]
REMOVED_ORDER[:] = [F_HASHES, F_MEDIUM, F_GROUP, F_LOCALITY, F_OWNERSHIP]


cdef inline bint _eq(const uint8_t *s, size_t n, const char *lit, size_t m) noexcept nogil:
    return n == m and memcmp(s, lit, m) == 0


cdef inline Field _field(const uint8_t *s, size_t n) noexcept nogil:
    if n == 4:
        return F_TYPE if memcmp(s, b"type", 4) == 0 else F_UNKNOWN
    if n == 6:
        return F_MEDIUM if memcmp(s, b"medium", 6) == 0 else F_UNKNOWN
    if n == 7:
        return F_LORA_ID if memcmp(s, b"lora_id", 7) == 0 else F_UNKNOWN
    if n == 8:
        return F_LOCALITY if memcmp(s, b"locality", 8) == 0 else F_UNKNOWN
    if n == 9:
        if memcmp(s, b"token_ids", 9) == 0: return F_TOKENS
        if memcmp(s, b"lora_name", 9) == 0: return F_LORA_NAME
        if memcmp(s, b"group_idx", 9) == 0: return F_GROUP
        if memcmp(s, b"ownership", 9) == 0: return F_OWNERSHIP
        return F_UNKNOWN
    if n == 10:
        if memcmp(s, b"block_size", 10) == 0: return F_BLOCK_SIZE
        if memcmp(s, b"extra_keys", 10) == 0: return F_EXTRA_KEYS
        if memcmp(s, b"session_id", 10) == 0: return F_SESSION
        return F_UNKNOWN
    if n == 12:
        return F_HASHES if memcmp(s, b"block_hashes", 12) == 0 else F_UNKNOWN
    if n == 17:
        return F_PARENT if memcmp(s, b"parent_block_hash", 17) == 0 else F_UNKNOWN
    if n == 18:
        return F_SPEC_KIND if memcmp(s, b"kv_cache_spec_kind", 18) == 0 else F_UNKNOWN
    if n == 28:
        return F_SPEC_WINDOW if memcmp(s, b"kv_cache_spec_sliding_window", 28) == 0 \
            else F_UNKNOWN
    return F_UNKNOWN  # lookahead_token_ids, future fields


cdef int _tier(const uint8_t *s, size_t n) noexcept nogil:
    if _eq(s, n, b"GPU", 3): return 0
    if _eq(s, n, b"CPU", 3) or _eq(s, n, b"CPU_PINNED", 10): return 1
    if _eq(s, n, b"STORAGE", 7) or _eq(s, n, b"DISK", 4): return 2
    return -1


cdef bint _utf8(const uint8_t *s, size_t n) noexcept nogil:
    """Strict UTF-8 (RFC 3629: no overlong forms, no surrogates), as msgspec and Python
    decode a str: a string that is not is the msgspec path's to reject."""
    cdef size_t i = 0, k, j
    cdef uint8_t c, lo, hi
    while i < n:
        c = s[i]
        if c < 0x80:
            i += 1
            continue
        lo, hi = 0x80, 0xBF
        if 0xC2 <= c <= 0xDF:
            k = 1
        elif 0xE0 <= c <= 0xEF:
            k = 2
            if c == 0xE0:
                lo = 0xA0
            elif c == 0xED:
                hi = 0x9F
        elif 0xF0 <= c <= 0xF4:
            k = 3
            if c == 0xF0:
                lo = 0x90
            elif c == 0xF4:
                hi = 0x8F
        else:
            return False
        if i + k >= n:  # truncated sequence
            return False
        if s[i + 1] < lo or s[i + 1] > hi:
            return False
        for j in range(2, k + 1):
            if s[i + j] < 0x80 or s[i + j] > 0xBF:
                return False
        i += k + 1
    return True


cdef int _opt_str(Reader *r) noexcept nogil:
    """A ``str | None`` field kvplug does not read: nil, or a valid UTF-8 string."""
    cdef const uint8_t *s
    cdef size_t n
    if _nil(r):
        return 0
    if _str(r, &s, &n) < 0 or not _utf8(s, n):
        return -1
    return 0


cdef int _opt_int(Reader *r) noexcept nogil:
    """An ``int | None`` field kvplug does not read (any msgpack integer)."""
    cdef uint64_t v
    cdef bint neg
    if _nil(r):
        return 0
    return _int(r, &v, &neg)


# ---- reusable decode buffers ---------------------------------------------------------------
# One batch is parsed in pure C first (every check done, nothing allocated per event), then the
# events are built: a declined batch costs no Python objects, and the buffers live on with the
# decoder so a healthy stream allocates only the events' own arrays.

cdef struct Rec:
    # one output event; hashes/tokens are spans of the decoder's buffers
    int kind            # 0 stored, 1 removed (a coalesced run), 2 cleared
    int tier
    int has_parent
    int has_lora_id
    uint64_t parent
    size_t h_off
    size_t h_n
    size_t t_off
    Py_ssize_t t_n      # -1: no token_ids (a tier copy)
    long block_size
    size_t lora_start   # the lora_name string's bytes in the payload (lora_n < 0: none)
    Py_ssize_t lora_n
    size_t extra_start  # extra_keys span in the payload (extra_end == 0: none)
    size_t extra_end


cdef int _grow(void **data, size_t *cap, size_t need, size_t item) noexcept nogil:
    """Make room for ``need`` items (amortised doubling)."""
    cdef size_t c
    cdef void *d
    if need <= cap[0]:
        return 0
    c = cap[0] * 2 + 64
    if c < need:
        c = need
    d = realloc(data[0], c * item)
    if d == NULL:
        return -1
    data[0] = d
    cap[0] = c
    return 0


cdef extern from "Python.h":
    object PyObject_Vectorcall(object callable, PyObject **args, size_t nargsf, object kwnames)

from kvplug.events import AllCleared, BlockRemoved, BlockStored, Tier

cdef tuple _TIERS = (Tier.DEVICE, Tier.HOST, Tier.DISK)
cdef object _STORED = BlockStored
cdef object _REMOVED = BlockRemoved
cdef object _CLEARED = AllCleared
cdef object _TRUE = True
# keyword names of the events as built here (the fields kvplug.events defines)
cdef tuple _KW_STORED = ("worker_id", "dp_rank", "tier", "parent_engine_hash", "engine_hashes",
                         "token_ids", "block_size")
cdef tuple _KW_STORED_NS = _KW_STORED + ("lora_name", "cache_salt", "block_extra")
cdef tuple _KW_COPY = ("worker_id", "dp_rank", "tier", "parent_engine_hash", "engine_hashes",
                       "tier_copy")
cdef tuple _KW_REMOVED = ("worker_id", "dp_rank", "tier", "engine_hashes")
cdef tuple _KW_CLEARED = ("worker_id", "dp_rank")

DEF KEEP_ITEMS = 1 << 20  # buffers grown past this by a huge batch are released after it


cdef inline cnp.ndarray _copy_array(const void *src, size_t n, int typenum, size_t item):
    cdef cnp.npy_intp dim = <cnp.npy_intp>n
    cdef cnp.ndarray arr = cnp.PyArray_EMPTY(1, &dim, typenum, 0)
    if n:
        memcpy(cnp.PyArray_DATA(arr), src, n * item)
    return arr


cdef class FastDecoder:
    """The compiled one-pass decoder of one stream (not thread-safe; one per BatchDecoder)."""

    cdef uint64_t *hashes     # stores' hashes
    cdef size_t h_n, h_cap
    cdef uint64_t *rhashes    # removes' hashes (each output remove is one contiguous span)
    cdef size_t rh_n, rh_cap
    cdef uint64_t *set_keys   # engine hashes stores touched since the last remove event began
    cdef uint32_t *set_gen    # (open addressing; a slot is live when its gen == cur_gen)
    cdef size_t set_n, set_cap
    cdef uint32_t cur_gen
    cdef uint32_t *tokens
    cdef size_t t_n, t_cap
    cdef Rec *recs
    cdef size_t r_n, r_cap
    cdef bint busy
    # True once a 5-byte token id has been read: this stream's ids then go two a step
    cdef readonly bint wide_ids

    def __dealloc__(self):
        free(self.hashes)
        free(self.rhashes)
        free(self.set_keys)
        free(self.set_gen)
        free(self.tokens)
        free(self.recs)

    cdef void _trim(self) noexcept:
        if self.h_cap > KEEP_ITEMS:
            free(self.hashes)
            self.hashes = NULL
            self.h_cap = 0
        if self.rh_cap > KEEP_ITEMS:
            free(self.rhashes)
            self.rhashes = NULL
            self.rh_cap = 0
        if self.set_cap > KEEP_ITEMS:
            free(self.set_keys)
            free(self.set_gen)
            self.set_keys = NULL
            self.set_gen = NULL
            self.set_cap = 0
            self.set_n = 0
        if self.t_cap > KEEP_ITEMS:
            free(self.tokens)
            self.tokens = NULL
            self.t_cap = 0
        if self.r_cap > KEEP_ITEMS:
            free(self.recs)
            self.recs = NULL
            self.r_cap = 0

    def decode(self, object payload, size_t max_tokens, long block_size, str worker_id,
               object dp_rank, object extra_fn):
        """``(ts, wire_rank | None, events, n_wire_events, stored_blocks, removed_blocks,
        cleared, tier_copies)`` or None (not a fast-path batch: decode it the general way).

        Events are kvplug events for ``worker_id`` and the batch's rank (``dp_rank`` when the
        batch carries none); consecutive removes of one tier are coalesced into one event.
        ``extra_fn(extra_keys_bytes, n_blocks, lora_name, is_root)`` turns a store's
        non-trivial ``extra_keys`` into ``(cache_salt, block_extra)``, or None to decline.
        """
        cdef Py_buffer view
        cdef double ts = 0
        cdef long rank = -1
        cdef size_t nev = 0
        cdef int ok
        if self.busy:  # re-entered (from extra_fn): decline rather than clobber the buffers
            return None
        self.busy = True
        PyObject_GetBuffer(payload, &view, PyBUF_SIMPLE)
        try:
            self.h_n = 0
            self.rh_n = 0
            self.t_n = 0
            self.r_n = 0
            # the GIL is kept: a batch takes microseconds, and giving the GIL away can cost the
            # subscriber thread a whole switch interval to get it back
            ok = self._parse(<const uint8_t *>view.buf, <size_t>view.len, max_tokens, block_size,
                             &ts, &rank, &nev)
            if ok < 0:
                return None
            return self._build(<const uint8_t *>view.buf, ts, rank, nev, worker_id, dp_rank,
                               extra_fn)
        finally:
            PyBuffer_Release(&view)
            self._trim()
            self.busy = False

    def parse_only(self, object payload, size_t max_tokens, long block_size):
        """Phase 1 alone (for stage timings): (events, hashes, tokens) parsed, or None."""
        cdef Py_buffer view
        cdef double ts = 0
        cdef long rank = -1
        cdef size_t nev = 0
        if self.busy:
            return None
        PyObject_GetBuffer(payload, &view, PyBUF_SIMPLE)
        try:
            self.h_n = 0
            self.rh_n = 0
            self.t_n = 0
            self.r_n = 0
            if self._parse(<const uint8_t *>view.buf, <size_t>view.len, max_tokens, block_size,
                           &ts, &rank, &nev) < 0:
                return None
            return self.r_n, self.h_n + self.rh_n, self.t_n
        finally:
            PyBuffer_Release(&view)
            self._trim()

    def token_array(self, object raw, size_t max_tokens):
        """One msgpack array of token ids (unsigned ints below 2**32; an SGLang store's
        ``token_ids``, which msgspec keeps raw) as a new uint32 array, by the same loop as a
        vLLM store's; None for anything else (EAGLE3's id pairs, a negative or wider int, more
        than ``max_tokens`` ids, bytes after the array): the caller's msgspec decoder then
        reads it and says what is wrong."""
        cdef Py_buffer view
        cdef Reader r
        cdef Rec rec
        if self.busy:
            return None
        PyObject_GetBuffer(raw, &view, PyBUF_SIMPLE)
        try:
            r.p = <const uint8_t *>view.buf
            r.n = <size_t>view.len
            r.pos = 0
            self.t_n = 0
            if self._tokens_into(&r, max_tokens, &rec) < 0 or r.pos != r.n:
                return None
            return _copy_array(self.tokens, self.t_n, cnp.NPY_UINT32, sizeof(uint32_t))
        finally:
            PyBuffer_Release(&view)
            self._trim()

    # -- phase 1: parse and check, pure C ----------------------------------------------------
    cdef Rec *_new_rec(self) noexcept nogil:
        if _grow(<void **>&self.recs, &self.r_cap, self.r_n + 1, sizeof(Rec)) < 0:
            return NULL
        self.r_n += 1
        return &self.recs[self.r_n - 1]

    cdef int _hashes_into(self, Reader *r, size_t *off, size_t *n_out) noexcept nogil:
        """A store's array of block hashes appended to the hash buffer."""
        cdef size_t n, i
        if _len(r, &n, ARRAY) < 0 or not _need(r, n):  # every hash takes >= 1 byte
            return -1
        if _grow(<void **>&self.hashes, &self.h_cap, self.h_n + n, sizeof(uint64_t)) < 0:
            return -1
        off[0] = self.h_n
        for i in range(n):
            if _hash(r, &self.hashes[self.h_n + i]) < 0:
                return -1
        self.h_n += n
        n_out[0] = n
        return 0

    cdef int _rhashes_into(self, Reader *r, size_t *off, size_t *n_out) noexcept nogil:
        """A remove's array of block hashes appended to the remove-hash buffer."""
        cdef size_t n, i
        if _len(r, &n, ARRAY) < 0 or not _need(r, n):
            return -1
        if _grow(<void **>&self.rhashes, &self.rh_cap, self.rh_n + n, sizeof(uint64_t)) < 0:
            return -1
        off[0] = self.rh_n
        for i in range(n):
            if _hash(r, &self.rhashes[self.rh_n + i]) < 0:
                return -1
        self.rh_n += n
        n_out[0] = n
        return 0

    # -- the set of hashes stores touched since the open remove event ----------------------
    cdef inline void _set_reset(self) noexcept nogil:
        self.set_n = 0
        self.cur_gen += 1
        if self.cur_gen == 0:  # wrapped: every slot must read as empty again
            if self.set_cap:
                memset(self.set_gen, 0, self.set_cap * sizeof(uint32_t))
            self.cur_gen = 1

    cdef inline size_t _slot(self, uint64_t h) noexcept nogil:
        return <size_t>((h * <uint64_t>0x9E3779B97F4A7C15) >> 40) & (self.set_cap - 1)

    cdef bint _set_has(self, uint64_t h) noexcept nogil:
        cdef size_t i
        if self.set_n == 0:
            return False
        i = self._slot(h)
        while self.set_gen[i] == self.cur_gen:
            if self.set_keys[i] == h:
                return True
            i = (i + 1) & (self.set_cap - 1)
        return False

    cdef int _set_add(self, uint64_t h) noexcept nogil:
        cdef size_t i, j, old_cap
        cdef uint64_t *old_keys
        cdef uint32_t *old_gen
        if (self.set_n + 1) * 2 > self.set_cap:  # keep the load <= 1/2
            old_cap, old_keys, old_gen = self.set_cap, self.set_keys, self.set_gen
            self.set_cap = 64 if old_cap == 0 else old_cap * 2
            self.set_keys = <uint64_t *>malloc(self.set_cap * sizeof(uint64_t))
            self.set_gen = <uint32_t *>calloc(self.set_cap, sizeof(uint32_t))
            if self.set_keys == NULL or self.set_gen == NULL:
                free(self.set_keys)
                free(self.set_gen)
                self.set_keys, self.set_gen, self.set_cap = old_keys, old_gen, old_cap
                return -1
            if self.cur_gen == 0:
                self.cur_gen = 1
            for j in range(old_cap):
                if old_gen[j] == self.cur_gen:
                    i = self._slot(old_keys[j])
                    while self.set_gen[i] == self.cur_gen:
                        i = (i + 1) & (self.set_cap - 1)
                    self.set_gen[i] = self.cur_gen
                    self.set_keys[i] = old_keys[j]
            free(old_keys)
            free(old_gen)
        i = self._slot(h)
        while self.set_gen[i] == self.cur_gen:
            if self.set_keys[i] == h:
                return 0
            i = (i + 1) & (self.set_cap - 1)
        self.set_gen[i] = self.cur_gen
        self.set_keys[i] = h
        self.set_n += 1
        return 0

    cdef int _tokens_into(self, Reader *r, size_t max_tokens, Rec *ev) noexcept nogil:
        """An array of token ids appended to the token buffer as u32.

        Token ids are unsigned and msgpack writes the shortest form, so four encodings cover
        them all; the loop reads them without the general integer reader. Anything else
        (negative, wider than u32, not an int) declines: the slow path says which."""
        cdef size_t n, i, pos, end
        cdef const uint8_t *p
        cdef uint8_t b
        cdef uint32_t *d
        if _len(r, &n, ARRAY) < 0 or n > max_tokens or not _need(r, n):
            return -1
        if _grow(<void **>&self.tokens, &self.t_cap, self.t_n + n, sizeof(uint32_t)) < 0:
            return -1
        d = self.tokens + self.t_n
        p = r.p
        pos = r.pos
        end = r.n
        i = 0
        if self.wide_ids:
            kvfw_id_pairs(p, &pos, end, d, &i, n)
        # While 5 bytes (the widest token) remain: no bounds check
        while i < n and pos + 5 <= end:
            b = p[pos]
            if b == 0xCD and i + 4 <= n and pos + 12 <= end and p[pos + 3] == 0xCD \
                    and p[pos + 6] == 0xCD and p[pos + 9] == 0xCD:
                # four uint16 ids in a row (most ids of a vocabulary up to 64k): one branch
                d[i] = (<uint32_t>p[pos + 1] << 8) | p[pos + 2]
                d[i + 1] = (<uint32_t>p[pos + 4] << 8) | p[pos + 5]
                d[i + 2] = (<uint32_t>p[pos + 7] << 8) | p[pos + 8]
                d[i + 3] = (<uint32_t>p[pos + 10] << 8) | p[pos + 11]
                pos += 12
                i += 4
                continue
            if b < 0x80:
                d[i] = b
                pos += 1
            elif b == 0xCD:
                d[i] = (<uint32_t>p[pos + 1] << 8) | p[pos + 2]
                pos += 3
            elif b == 0xCC:
                d[i] = p[pos + 1]
                pos += 2
            elif b == 0xCE:
                d[i] = ((<uint32_t>p[pos + 1] << 24) | (<uint32_t>p[pos + 2] << 16) |
                        (<uint32_t>p[pos + 3] << 8) | p[pos + 4])
                pos += 5
                # the vocabulary is over 64k: its 1-, 3- and 5-byte ids keep the branches
                # above mispredicting, so this stream's next arrays go two ids a step
                self.wide_ids = True
            else:
                return -1
            i += 1
        while i < n:  # the last few tokens of the payload, checked
            if pos >= end:
                return -1
            b = p[pos]
            if b < 0x80:
                d[i] = b
                pos += 1
            elif b == 0xCD:
                if pos + 3 > end:
                    return -1
                d[i] = (<uint32_t>p[pos + 1] << 8) | p[pos + 2]
                pos += 3
            elif b == 0xCC:
                if pos + 2 > end:
                    return -1
                d[i] = p[pos + 1]
                pos += 2
            elif b == 0xCE:
                if pos + 5 > end:
                    return -1
                d[i] = ((<uint32_t>p[pos + 1] << 24) | (<uint32_t>p[pos + 2] << 16) |
                        (<uint32_t>p[pos + 3] << 8) | p[pos + 4])
                pos += 5
            else:
                return -1
            i += 1
        r.pos = pos
        ev.t_off = self.t_n
        ev.t_n = <Py_ssize_t>n
        self.t_n += n
        return 0

    cdef int _stored_field(self, Reader *r, Field f, Rec *ev, size_t max_tokens) noexcept nogil:
        """One BlockStored field into ev. -1: not the fast path's."""
        cdef const uint8_t *s
        cdef size_t n, start, i
        cdef uint64_t v
        cdef bint neg, all_nil
        if f == F_HASHES:
            if self._hashes_into(r, &ev.h_off, &ev.h_n) < 0:
                return -1
        elif f == F_PARENT:
            if not _nil(r):
                if _hash(r, &ev.parent) < 0:
                    return -1
                ev.has_parent = 1
        elif f == F_TOKENS:
            if self._tokens_into(r, max_tokens, ev) < 0:
                return -1
        elif f == F_BLOCK_SIZE:
            if _int(r, &v, &neg) < 0 or neg or v > 0x7FFFFFFF:
                return -1
            ev.block_size = <long>v
        elif f == F_LORA_ID:
            if not _nil(r):
                if _int(r, &v, &neg) < 0:
                    return -1
                ev.has_lora_id = 1
        elif f == F_MEDIUM:
            if not _nil(r):
                if _str(r, &s, &n) < 0:
                    return -1
                ev.tier = _tier(s, n)
                if ev.tier < 0:
                    return -1  # unknown medium: the slow path counts it
        elif f == F_LORA_NAME:
            if _nil(r):
                ev.lora_n = -1
            else:
                if _str(r, &s, &n) < 0 or not _utf8(s, n):
                    return -1
                ev.lora_start = <size_t>(s - r.p)
                ev.lora_n = <Py_ssize_t>n
        elif f == F_EXTRA_KEYS:
            # vLLM: list[tuple | None] | None, one entry per block
            ev.extra_end = 0
            if not _nil(r):
                start = r.pos
                if _len(r, &n, ARRAY) < 0:
                    return -1
                all_nil = True
                for i in range(n):
                    if _nil(r):
                        continue
                    if not _is(r, ARRAY) or _skip(r, 0) < 0:
                        return -1
                    all_nil = False
                if not all_nil:  # salt, LoRA, multimodal: decoded in Python
                    ev.extra_start = start
                    ev.extra_end = r.pos
        elif f == F_GROUP:
            if not _nil(r):
                if _int(r, &v, &neg) < 0 or neg or v != 0:
                    return -1  # hybrid models: group semantics live in the slow path
        elif f == F_SPEC_KIND:
            if not _nil(r):
                if _str(r, &s, &n) < 0 or not _eq(s, n, b"full_attention", 14):
                    return -1
        elif f == F_SPEC_WINDOW:
            return _opt_int(r)
        elif f == F_LOCALITY or f == F_OWNERSHIP or f == F_SESSION:
            return _opt_str(r)
        elif f == F_TYPE:
            return -1  # a second tag: the slow path says what it means
        else:
            if _skip(r, 0) < 0:
                return -1
        return 0

    cdef int _removed_field(self, Reader *r, Field f, size_t *off, size_t *n_out, int *tier,
                            bint *has) noexcept nogil:
        cdef const uint8_t *s
        cdef size_t n
        cdef uint64_t v
        cdef bint neg
        if f == F_HASHES:
            if has[0]:
                # a repeated key: the last one counts (msgspec's rule); drop the first's hashes
                self.rh_n = off[0]
            if self._rhashes_into(r, off, n_out) < 0:
                return -1
            has[0] = True
        elif f == F_MEDIUM:
            if not _nil(r):
                if _str(r, &s, &n) < 0:
                    return -1
                tier[0] = _tier(s, n)
                if tier[0] < 0:
                    return -1
        elif f == F_GROUP:
            if not _nil(r):
                if _int(r, &v, &neg) < 0 or neg or v != 0:
                    return -1
        elif f == F_LOCALITY or f == F_OWNERSHIP:
            return _opt_str(r)
        elif f == F_TYPE:
            return -1
        else:
            if _skip(r, 0) < 0:
                return -1
        return 0

    cdef int _parse(self, const uint8_t *data, size_t size, size_t max_tokens, long block_size,
                    double *ts, long *rank, size_t *n_events) noexcept nogil:
        """A ``KVEventBatch``: ``[ts, events, data_parallel_rank?]`` as every vLLM release
        sends it, or the same fields as a map (a build whose batch struct is not array_like);
        in a map, unknown keys are skipped and a repeated one declines."""
        cdef Reader rd
        cdef Reader *r = &rd
        cdef size_t nb, i
        cdef const uint8_t *s
        cdef size_t sn
        cdef bint has_ts = False, has_events = False, has_rank = False
        rd.p = data
        rd.n = size
        rd.pos = 0
        if size == 0:
            return -1
        if _len(r, &nb, MAP) == 0:
            for i in range(nb):
                if _str(r, &s, &sn) < 0:
                    return -1
                if _eq(s, sn, b"ts", 2):
                    if has_ts or _double(r, ts) < 0:
                        return -1
                    has_ts = True
                elif _eq(s, sn, b"events", 6):
                    if has_events or self._events(r, max_tokens, block_size, n_events) < 0:
                        return -1
                    has_events = True
                elif _eq(s, sn, b"data_parallel_rank", 18):
                    if has_rank or _rank(r, rank) < 0:
                        return -1
                    has_rank = True
                elif _skip(r, 0) < 0:
                    return -1
            if not (has_ts and has_events):
                return -1
        else:
            if _len(r, &nb, ARRAY) < 0 or nb < 2 or nb > 3:
                return -1
            if _double(r, ts) < 0:
                return -1
            if self._events(r, max_tokens, block_size, n_events) < 0:
                return -1
            if nb == 3 and _rank(r, rank) < 0:
                return -1
        if rd.pos != rd.n:
            return -1  # trailing bytes: not a well-formed batch
        return 0

    cdef int _events(self, Reader *r, size_t max_tokens, long block_size,
                     size_t *n_events) noexcept nogil:
        """The batch's event array into the record and span buffers."""
        cdef size_t nev, i, j, k, nfields, h_mark, t_mark, h_off, h_n
        cdef const uint8_t *s
        cdef size_t sn
        cdef bint is_map, has_hashes
        cdef int tier, kind
        cdef Field f
        cdef Rec *ev
        cdef Rec *rm
        # The last remove output (-1: none since the start or a clear). A later remove of its
        # tier joins it — moving earlier past the stores in between — up to the first of its
        # hashes one of those stores holds or chains to (the set): the index ends up the
        # same, with one event (one index call) instead of one per eviction burst.
        cdef Py_ssize_t rm_i = -1
        cdef bint clash
        if _len(r, &nev, ARRAY) < 0:
            return -1
        n_events[0] = nev
        for i in range(nev):
            is_map = False
            if _len(r, &nfields, MAP) == 0:
                is_map = True
                # vLLM writes "type" first; a map without it is the slow path's
                if nfields == 0 or _str(r, &s, &sn) < 0 or not _eq(s, sn, b"type", 4):
                    return -1
                nfields -= 1
            elif _len(r, &nfields, ARRAY) < 0 or nfields == 0:
                return -1
            else:
                nfields -= 1
            if _str(r, &s, &sn) < 0:
                return -1
            if _eq(s, sn, b"BlockStored", 11):
                kind = 0
            elif _eq(s, sn, b"BlockRemoved", 12):
                kind = 1
            elif _eq(s, sn, b"AllBlocksCleared", 16):
                kind = 2
            else:
                return -1  # unknown kinds are counted by the slow path
            if kind == 1:
                has_hashes = False
                tier = 0
                h_off = self.rh_n
                h_n = 0
                for j in range(nfields):
                    if is_map:
                        if _str(r, &s, &sn) < 0:
                            return -1
                        f = _field(s, sn)
                    else:
                        f = REMOVED_ORDER[j] if j < N_REMOVED else F_SKIP
                    if self._removed_field(r, f, &h_off, &h_n, &tier, &has_hashes) < 0:
                        return -1
                if not has_hashes:
                    return -1
                if h_n == 0:
                    continue  # an empty remove changes nothing
                if rm_i >= 0 and self.recs[rm_i].tier == tier:
                    clash = False
                    for k in range(h_n):
                        if self._set_has(self.rhashes[h_off + k]):
                            clash = True
                            break
                    # contiguous: rm_i is the last remove, its hashes end the buffer
                    if not clash:
                        self.recs[rm_i].h_n += h_n
                        continue
                    # hash by hash, as coalesce_removes: the ones before the first a store
                    # touched still join; from it on they start the next remove
                    self.recs[rm_i].h_n += k
                    h_off += k
                    h_n -= k
                rm = self._new_rec()
                if rm == NULL:
                    return -1
                rm.kind = 1
                rm.tier = tier
                rm.h_off = h_off
                rm.h_n = h_n
                rm_i = <Py_ssize_t>(self.r_n - 1)
                self._set_reset()
                continue
            if kind == 2:
                # vLLM's AllBlocksCleared has no fields: whatever a sender adds is ignored
                for j in range(nfields):
                    if is_map:
                        if _str(r, &s, &sn) < 0 or _eq(s, sn, b"type", 4):
                            return -1
                    if _skip(r, 0) < 0:
                        return -1
                ev = self._new_rec()
                if ev == NULL:
                    return -1
                ev.kind = 2
                ev.tier = 0
                rm_i = -1
                continue
            # BlockStored
            h_mark = self.h_n
            t_mark = self.t_n
            ev = self._new_rec()
            if ev == NULL:
                return -1
            ev.kind = 0
            ev.tier = 0
            ev.has_parent = 0
            ev.has_lora_id = 0
            ev.parent = 0
            ev.h_off = 0
            ev.h_n = 0
            ev.t_off = 0
            ev.t_n = -1
            ev.block_size = 0
            ev.lora_start = 0
            ev.lora_n = -1
            ev.extra_start = 0
            ev.extra_end = 0
            has_hashes = False
            for j in range(nfields):
                if is_map:
                    if _str(r, &s, &sn) < 0:
                        return -1
                    f = _field(s, sn)
                else:
                    f = STORED_ORDER[j] if j < N_STORED else F_SKIP
                if f == F_HASHES:
                    has_hashes = True
                if self._stored_field(r, f, ev, max_tokens) < 0:
                    return -1
            if not has_hashes:
                return -1
            if ev.has_lora_id and ev.lora_n < 0:
                return -1  # a LoRA id without a name (vLLM <= 0.13): the slow path names it
            if ev.extra_end and (ev.h_n == 0 or ev.t_n <= 0):
                # extra_keys on a store that is never built (no blocks, or a tier copy): only
                # msgspec's decoding says whether they are valid (UTF-8, ext types...)
                return -1
            if ev.h_n == 0:
                # nothing stored (and a run of removes may go on): forget what it appended
                self.r_n -= 1
                self.h_n = h_mark
                self.t_n = t_mark
                continue
            if ev.t_n == 0:
                ev.t_n = -1  # offload copy by hash (the caller marks tier_copy)
            elif ev.t_n > 0 and (ev.block_size <= 0 or (
                    block_size and ev.block_size != block_size)
                    or <size_t>ev.t_n != ev.h_n * <size_t>ev.block_size):
                return -1  # the slow path counts the mismatch
            if rm_i >= 0:  # what a later remove must not move past
                for k in range(ev.h_n):
                    if self._set_add(self.hashes[ev.h_off + k]) < 0:
                        return -1
                if ev.has_parent and self._set_add(ev.parent) < 0:
                    return -1
        return 0

    # -- phase 2: the events ---------------------------------------------------------------
    cdef object _build(self, const uint8_t *data, double ts, long wire_rank, size_t nev,
                       str worker_id, object dp_rank, object extra_fn):
        cdef list events = []
        cdef size_t i
        cdef Rec *ev
        cdef object rank = dp_rank if wire_rank < 0 else wire_rank
        cdef object hashes, toks, parent, lora, salt, extras, got, e, tier
        cdef object bs_obj
        cdef PyObject *argv[10]
        cdef size_t stored_blocks = 0, removed_blocks = 0, cleared = 0, copies = 0
        argv[0] = <PyObject *>worker_id
        argv[1] = <PyObject *>rank
        for i in range(self.r_n):
            ev = &self.recs[i]
            tier = _TIERS[ev.tier]
            argv[2] = <PyObject *>tier
            if ev.kind == 1:
                hashes = _copy_array(self.rhashes + ev.h_off, ev.h_n, cnp.NPY_UINT64, 8)
                argv[3] = <PyObject *>hashes
                e = PyObject_Vectorcall(_REMOVED, argv, 0, _KW_REMOVED)
                removed_blocks += ev.h_n
            elif ev.kind == 2:
                e = PyObject_Vectorcall(_CLEARED, argv, 0, _KW_CLEARED)
                cleared += 1
            else:
                hashes = _copy_array(self.hashes + ev.h_off, ev.h_n, cnp.NPY_UINT64, 8)
                parent = ev.parent if ev.has_parent else None
                argv[3] = <PyObject *>parent
                argv[4] = <PyObject *>hashes
                stored_blocks += ev.h_n
                if ev.t_n < 0:
                    argv[5] = <PyObject *>_TRUE
                    e = PyObject_Vectorcall(_STORED, argv, 0, _KW_COPY)
                    copies += 1
                else:
                    toks = _copy_array(self.tokens + ev.t_off, <size_t>ev.t_n,
                                       cnp.NPY_UINT32, 4)
                    bs_obj = ev.block_size
                    argv[5] = <PyObject *>toks
                    argv[6] = <PyObject *>bs_obj
                    if ev.lora_n < 0 and ev.extra_end == 0:
                        e = PyObject_Vectorcall(_STORED, argv, 0, _KW_STORED)
                    else:
                        lora = None
                        if ev.lora_n >= 0:
                            try:
                                lora = (<const char *>data + ev.lora_start)[:ev.lora_n].decode(
                                    "utf-8", "strict")
                            except UnicodeDecodeError:
                                return None
                        salt = extras = None
                        if ev.extra_end:
                            got = extra_fn(
                                (<const char *>data + ev.extra_start)[
                                    :ev.extra_end - ev.extra_start],
                                ev.h_n, lora, not ev.has_parent)
                            if got is None:
                                return None
                            salt, extras = got
                        argv[7] = <PyObject *>lora
                        argv[8] = <PyObject *>salt
                        argv[9] = <PyObject *>extras
                        e = PyObject_Vectorcall(_STORED, argv, 0, _KW_STORED_NS)
            events.append(e)
        return (ts, None if wire_rank < 0 else wire_rank, events, nev, stored_blocks,
                removed_blocks, cleared, copies)


def hash_array(object raw, size_t max_n):
    """One msgpack array of integer block hashes (an SGLang event's ``block_hashes``, which
    msgspec keeps raw) as a new uint64 array, each folded to u64 as ``h & MASK64`` folds it:
    no Python int per hash, where msgspec's ``list[int]`` and the fold made two. None for
    anything else (a bin, a float, a bool, more than ``max_n`` hashes, bytes after the array):
    the caller's msgspec decoder then reads it and says what is wrong."""
    cdef Py_buffer view
    cdef Reader r
    cdef size_t n, i
    cdef bint neg
    cdef uint8_t b
    cdef cnp.npy_intp dim
    cdef cnp.ndarray arr
    cdef uint64_t *d
    PyObject_GetBuffer(raw, &view, PyBUF_SIMPLE)
    try:
        r.p = <const uint8_t *>view.buf
        r.n = <size_t>view.len
        r.pos = 0
        if _len(&r, &n, ARRAY) < 0 or n > max_n or not _need(&r, n):
            return None
        dim = <cnp.npy_intp>n
        arr = cnp.PyArray_EMPTY(1, &dim, cnp.NPY_UINT64, 0)
        d = <uint64_t *>cnp.PyArray_DATA(arr)
        for i in range(n):
            b = r.p[r.pos] if r.pos < r.n else 0xC1
            # a uint64 (0xCF) or int64 (0xD3) hash: its 8 big-endian bytes are the u64 either
            # way (two's complement); SGLang's hash_str_to_int64 hashes take one of the two
            if (b == 0xCF or b == 0xD3) and r.pos + 9 <= r.n:
                d[i] = _be64(r.p + r.pos + 1)
                r.pos += 9
            elif _int(&r, &d[i], &neg) < 0:
                return None
        if r.pos != r.n:
            return None
        return arr
    finally:
        PyBuffer_Release(&view)
