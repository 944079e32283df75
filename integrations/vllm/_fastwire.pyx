# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""Fast path of the vLLM KV-event decoder: one pass over a msgpack ``KVEventBatch``.

Handles the shapes a healthy engine sends (array- or map-form events, uint64 / int64 / bin
hashes, GPU/CPU/STORAGE media, group 0, full-attention stores) and writes hashes and token ids
straight into numpy buffers: no Python int per token. Anything else — an unknown kind, a wrong
type, a truncated payload, another KV-cache group, an unknown medium, a token outside u32 —
returns None, and the caller decodes the batch with the msgspec path, which counts and logs
each problem. So this module only has to be right on what it accepts.
"""

from cpython.buffer cimport PyBUF_SIMPLE, PyBuffer_Release, PyObject_GetBuffer
from libc.stdint cimport int64_t, uint8_t, uint16_t, uint32_t, uint64_t
from libc.stdlib cimport free, realloc
from libc.string cimport memcmp

import numpy as np

cimport numpy as cnp

cnp.import_array()

DEF MAX_DEPTH = 32


cdef struct Reader:
    const uint8_t *p
    size_t n
    size_t pos


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


cdef int _array_len(Reader *r, size_t *out) noexcept nogil:
    """Array header -> length; -1 if the next value is not an array (or truncated)."""
    if r.pos >= r.n:
        return -1
    cdef uint8_t b = r.p[r.pos]
    if 0x90 <= b <= 0x9F:
        out[0] = b & 0x0F
        r.pos += 1
        return 0
    if b == 0xDC and _need(r, 3):
        out[0] = <size_t>_be(r.p + r.pos + 1, 2)
        r.pos += 3
        return 0
    if b == 0xDD and _need(r, 5):
        out[0] = <size_t>_be(r.p + r.pos + 1, 4)
        r.pos += 5
        return 0
    return -1


cdef int _map_len(Reader *r, size_t *out) noexcept nogil:
    if r.pos >= r.n:
        return -1
    cdef uint8_t b = r.p[r.pos]
    if 0x80 <= b <= 0x8F:
        out[0] = b & 0x0F
        r.pos += 1
        return 0
    if b == 0xDE and _need(r, 3):
        out[0] = <size_t>_be(r.p + r.pos + 1, 2)
        r.pos += 3
        return 0
    if b == 0xDF and _need(r, 5):
        out[0] = <size_t>_be(r.p + r.pos + 1, 4)
        r.pos += 5
        return 0
    return -1


cdef int _str(Reader *r, const uint8_t **s, size_t *n) noexcept nogil:
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


cdef int _int(Reader *r, uint64_t *out, bint *neg) noexcept nogil:
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


cdef int _hash(Reader *r, uint64_t *out) noexcept nogil:
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
        if _map_len(r, &k) < 0:
            return -1
        for i in range(2 * k):
            if _skip(r, depth + 1) < 0:
                return -1
        return 0
    if 0x90 <= b <= 0x9F or b == 0xDC or b == 0xDD:
        if _array_len(r, &k) < 0:
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


# ---- field names ---------------------------------------------------------------------------
cdef enum Field:
    F_UNKNOWN, F_TYPE, F_HASHES, F_PARENT, F_TOKENS, F_BLOCK_SIZE, F_LORA_ID, F_MEDIUM,
    F_LORA_NAME, F_EXTRA_KEYS, F_GROUP, F_SPEC_KIND, F_SPEC_WINDOW, F_SKIP

# array-form field order after the tag
cdef Field STORED_ORDER[12]
STORED_ORDER[:] = [F_HASHES, F_PARENT, F_TOKENS, F_BLOCK_SIZE, F_LORA_ID, F_MEDIUM, F_LORA_NAME,
                   F_EXTRA_KEYS, F_GROUP, F_SPEC_KIND, F_SPEC_WINDOW, F_SKIP]
cdef Field REMOVED_ORDER[3]
REMOVED_ORDER[:] = [F_HASHES, F_MEDIUM, F_GROUP]


cdef inline bint _eq(const uint8_t *s, size_t n, const char *lit, size_t m) noexcept nogil:
    return n == m and memcmp(s, lit, m) == 0


cdef Field _field(const uint8_t *s, size_t n) noexcept nogil:
    if n == 4:
        return F_TYPE if memcmp(s, b"type", 4) == 0 else F_UNKNOWN
    if n == 6:
        return F_MEDIUM if memcmp(s, b"medium", 6) == 0 else F_UNKNOWN
    if n == 7:
        return F_LORA_ID if memcmp(s, b"lora_id", 7) == 0 else F_UNKNOWN
    if n == 9:
        if memcmp(s, b"token_ids", 9) == 0: return F_TOKENS
        if memcmp(s, b"lora_name", 9) == 0: return F_LORA_NAME
        if memcmp(s, b"group_idx", 9) == 0: return F_GROUP
        return F_UNKNOWN
    if n == 10:
        if memcmp(s, b"block_size", 10) == 0: return F_BLOCK_SIZE
        if memcmp(s, b"extra_keys", 10) == 0: return F_EXTRA_KEYS
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
    return F_UNKNOWN  # locality, ownership, session_id, lookahead..., future fields


cdef int _tier(const uint8_t *s, size_t n) noexcept nogil:
    if _eq(s, n, b"GPU", 3): return 0
    if _eq(s, n, b"CPU", 3) or _eq(s, n, b"CPU_PINNED", 10): return 1
    if _eq(s, n, b"STORAGE", 7) or _eq(s, n, b"DISK", 4): return 2
    return -1


# ---- growable u64 buffer for coalesced removes ---------------------------------------------
cdef struct U64Buf:
    uint64_t *data
    size_t n
    size_t cap


cdef int _push(U64Buf *b, uint64_t v) noexcept nogil:
    cdef uint64_t *d
    if b.n == b.cap:
        d = <uint64_t *>realloc(b.data, (b.cap * 2 + 16) * sizeof(uint64_t))
        if d == NULL:
            return -1
        b.data = d
        b.cap = b.cap * 2 + 16
    b.data[b.n] = v
    b.n += 1
    return 0


cdef object _take(U64Buf *b):
    cdef cnp.ndarray arr = np.empty(b.n, dtype=np.uint64)
    cdef uint64_t *dst = <uint64_t *>cnp.PyArray_DATA(arr)
    cdef size_t i
    for i in range(b.n):
        dst[i] = b.data[i]
    b.n = 0
    return arr


# ---- events --------------------------------------------------------------------------------
cdef object _hash_array(Reader *r):
    """An array of block hashes as u64[]; None if it is not one."""
    cdef size_t n, i
    if _array_len(r, &n) < 0 or not _need(r, n):
        return None
    cdef cnp.ndarray arr = np.empty(n, dtype=np.uint64)
    cdef uint64_t *d = <uint64_t *>cnp.PyArray_DATA(arr)
    for i in range(n):
        if _hash(r, &d[i]) < 0:
            return None
    return arr


cdef int _hashes_into(Reader *r, U64Buf *buf) noexcept nogil:
    """Append an array of block hashes to buf (removes are coalesced there)."""
    cdef size_t n, i
    cdef uint64_t v
    if _array_len(r, &n) < 0 or not _need(r, n):
        return -1
    for i in range(n):
        if _hash(r, &v) < 0 or _push(buf, v) < 0:
            return -1
    return 0


cdef object _token_array(Reader *r, size_t max_tokens):
    """An array of token ids as u32[]; None if it is not one (or too long).

    Token ids are unsigned and msgpack writes the shortest form, so four encodings cover
    them all; the loop reads them without the general integer reader."""
    cdef size_t n, i, pos, end
    cdef const uint8_t *p
    cdef uint8_t b
    if _array_len(r, &n) < 0 or n > max_tokens or not _need(r, n):
        return None
    cdef cnp.ndarray arr = np.empty(n, dtype=np.uint32)
    cdef uint32_t *d = <uint32_t *>cnp.PyArray_DATA(arr)
    p = r.p
    pos = r.pos
    end = r.n
    for i in range(n):
        if pos >= end:
            return None
        b = p[pos]
        if b < 0x80:
            d[i] = b
            pos += 1
        elif b == 0xCD:
            if pos + 3 > end:
                return None
            d[i] = (<uint32_t>p[pos + 1] << 8) | p[pos + 2]
            pos += 3
        elif b == 0xCC:
            if pos + 2 > end:
                return None
            d[i] = p[pos + 1]
            pos += 2
        elif b == 0xCE:
            if pos + 5 > end:
                return None
            d[i] = ((<uint32_t>p[pos + 1] << 24) | (<uint32_t>p[pos + 2] << 16) |
                    (<uint32_t>p[pos + 3] << 8) | p[pos + 4])
            pos += 5
        else:
            return None  # negative, too wide, or not an int: the slow path says which
    r.pos = pos
    return arr


cdef bint _all_nil_array(const uint8_t *p, size_t n) noexcept nogil:
    """An array whose items are all nil (vLLM 0.32 sends one None per block)."""
    cdef Reader r
    cdef size_t k, i
    r.p = p
    r.n = n
    r.pos = 0
    if _array_len(&r, &k) < 0 or r.pos + k != n:
        return False
    for i in range(k):
        if p[r.pos + i] != 0xC0:
            return False
    return True


cdef struct Stored:
    # one event's fields as read; Python objects live in the caller's locals
    int tier
    int has_parent
    int has_lora_id
    uint64_t parent
    long block_size
    size_t extra_start
    size_t extra_end


cdef int _read_stored_field(Reader *r, Field f, Stored *ev, list objs, size_t max_tokens) \
        except -2:
    """One BlockStored field; objs = [hashes, tokens, lora_name]. -1: not the fast path's."""
    cdef const uint8_t *s
    cdef size_t n, start
    cdef uint64_t v
    cdef bint neg
    cdef object obj
    if f == F_HASHES:
        obj = _hash_array(r)
        if obj is None:
            return -1
        objs[0] = obj
    elif f == F_PARENT:
        if not _nil(r):
            if _hash(r, &ev.parent) < 0:
                return -1
            ev.has_parent = 1
    elif f == F_TOKENS:
        obj = _token_array(r, max_tokens)
        if obj is None:
            return -1
        objs[1] = obj
    elif f == F_BLOCK_SIZE:
        if _int(r, &v, &neg) < 0 or neg or v > 0x7FFFFFFF:
            return -1
        ev.block_size = <long>v
    elif f == F_LORA_ID:
        if not _nil(r):
            if _skip(r, 0) < 0:
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
        if not _nil(r):
            if _str(r, &s, &n) < 0:
                return -1
            try:
                objs[2] = (<const char *>s)[:n].decode("utf-8", "strict")
            except UnicodeDecodeError:
                return -1
    elif f == F_EXTRA_KEYS:
        if not _nil(r):
            start = r.pos
            if _skip(r, 0) < 0:
                return -1
            if not _all_nil_array(r.p + start, r.pos - start):
                ev.extra_start = start  # salt, LoRA, multimodal: decoded in Python
                ev.extra_end = r.pos
    elif f == F_GROUP:
        if not _nil(r):
            if _int(r, &v, &neg) < 0 or neg or v != 0:
                return -1  # hybrid models: group semantics live in the slow path
    elif f == F_SPEC_KIND:
        if not _nil(r):
            if _str(r, &s, &n) < 0 or not _eq(s, n, b"full_attention", 14):
                return -1
    else:
        if _skip(r, 0) < 0:
            return -1
    return 0


cdef int _read_removed_field(Reader *r, Field f, U64Buf *run, int *tier, bint *has) \
        noexcept nogil:
    cdef const uint8_t *s
    cdef size_t n
    cdef uint64_t v
    cdef bint neg
    if f == F_HASHES:
        if _hashes_into(r, run) < 0:
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
    else:
        if _skip(r, 0) < 0:
            return -1
    return 0


def decode_batch(object payload, size_t max_tokens, long block_size):
    """(ts, dp_rank | None, records, n_wire_events) or None (not a fast-path batch).

    records: ``("S", hashes u64[], parent | None, tokens u32[] | None, block_size, tier,
    lora_name | None, extra_keys span | None)``, ``("R", hashes u64[], tier)`` (consecutive
    removes of one tier coalesced) and ``("C",)``.
    """
    cdef Py_buffer view
    PyObject_GetBuffer(payload, &view, PyBUF_SIMPLE)
    try:
        return _decode(<const uint8_t *>view.buf, <size_t>view.len, max_tokens, block_size)
    finally:
        PyBuffer_Release(&view)


cdef object _decode(const uint8_t *data, size_t size, size_t max_tokens, long block_size):
    cdef Reader rd
    cdef Reader *r = &rd
    rd.p = data
    rd.n = size
    rd.pos = 0
    if rd.n == 0:
        return None
    cdef size_t nb, nev, i, k, j, nfields, ev_start
    cdef double ts
    cdef const uint8_t *s
    cdef size_t sn
    cdef uint64_t v
    cdef bint neg, is_map, has_hashes
    cdef int tier, kind, run_tier = -2
    cdef Field f
    cdef U64Buf run
    cdef Stored ev
    cdef object rank = None
    cdef list records = []
    cdef list objs = [None, None, None]
    cdef object hashes, toks
    run.data = NULL
    run.n = 0
    run.cap = 0
    try:
        if _array_len(r, &nb) < 0 or nb < 2 or nb > 3:
            return None
        if _double(r, &ts) < 0:
            return None
        if _array_len(r, &nev) < 0:
            return None
        for i in range(nev):
            is_map = False
            if _map_len(r, &nfields) == 0:
                is_map = True
                # vLLM writes "type" first; a map without it is the slow path's
                if nfields == 0 or _str(r, &s, &sn) < 0 or not _eq(s, sn, b"type", 4):
                    return None
                nfields -= 1
            elif _array_len(r, &nfields) < 0 or nfields == 0:
                return None
            else:
                nfields -= 1
            if _str(r, &s, &sn) < 0:
                return None
            if _eq(s, sn, b"BlockStored", 11):
                kind = 0
            elif _eq(s, sn, b"BlockRemoved", 12):
                kind = 1
            elif _eq(s, sn, b"AllBlocksCleared", 16):
                kind = 2
            else:
                return None  # unknown kinds are counted by the slow path
            if kind == 1:
                ev_start = run.n
                has_hashes = False
                tier = 0
                for j in range(nfields):
                    if is_map:
                        if _str(r, &s, &sn) < 0:
                            return None
                        f = _field(s, sn)
                    else:
                        f = REMOVED_ORDER[j] if j < 3 else F_SKIP
                    if _read_removed_field(r, f, &run, &tier, &has_hashes) < 0:
                        return None
                if not has_hashes:
                    return None
                if run.n == ev_start:
                    continue  # an empty remove changes nothing
                if run_tier != tier and ev_start > 0:
                    # the run so far had another tier: emit it, keep this event's hashes
                    k = run.n
                    run.n = ev_start
                    records.append(("R", _take(&run), run_tier))
                    for j in range(k - ev_start):
                        run.data[j] = run.data[ev_start + j]
                    run.n = k - ev_start
                run_tier = tier
                continue
            if kind == 2:
                for j in range(nfields):
                    if is_map and _skip(r, 0) < 0:
                        return None
                    if _skip(r, 0) < 0:
                        return None
                if run.n:
                    records.append(("R", _take(&run), run_tier))
                run_tier = -2
                records.append(("C",))
                continue
            # BlockStored
            ev.tier = 0
            ev.has_parent = 0
            ev.has_lora_id = 0
            ev.parent = 0
            ev.block_size = 0
            ev.extra_start = 0
            ev.extra_end = 0
            objs[0] = None
            objs[1] = None
            objs[2] = None
            for j in range(nfields):
                if is_map:
                    if _str(r, &s, &sn) < 0:
                        return None
                    f = _field(s, sn)
                else:
                    f = STORED_ORDER[j] if j < 11 else F_SKIP
                if _read_stored_field(r, f, &ev, objs, max_tokens) < 0:
                    return None
            hashes = objs[0]
            if hashes is None:
                return None
            if ev.has_lora_id and objs[2] is None:
                return None  # a LoRA id without a name (vLLM <= 0.13): the slow path names it
            if len(hashes) == 0:
                continue  # nothing stored (and a run of removes may go on)
            toks = objs[1]
            if toks is not None and len(toks) == 0:
                toks = None  # offload copy by hash (the caller marks tier_copy)
            elif toks is not None and (ev.block_size <= 0 or (
                    block_size and ev.block_size != block_size)
                    or <size_t>len(toks) != <size_t>len(hashes) * <size_t>ev.block_size):
                return None  # the slow path counts the mismatch
            if run.n:
                records.append(("R", _take(&run), run_tier))
            run_tier = -2
            records.append(("S", hashes, ev.parent if ev.has_parent else None, toks,
                            ev.block_size, ev.tier, objs[2],
                            (ev.extra_start, ev.extra_end) if ev.extra_end else None))
        if run.n:
            records.append(("R", _take(&run), run_tier))
        if nb == 3:
            if not _nil(r):
                if _int(r, &v, &neg) < 0 or neg or v > 0x7FFFFFFF:
                    return None
                rank = <long>v
        if rd.pos != rd.n:
            return None  # trailing bytes: not a well-formed batch
        return ts, rank, records, nev
    finally:
        free(run.data)
