# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""Fast path of the vLLM KV-event decoder: one pass over a msgpack ``KVEventBatch``.

Handles the shapes a healthy engine sends (array- or map-form events, uint64 / int64 / bin
hashes, GPU/CPU/STORAGE media, group 0, full-attention stores) and writes hashes and token ids
straight into numpy buffers: no Python int per token. Anything else — an unknown kind, a wrong
type, a truncated payload, another KV-cache group, an unknown medium, a token outside u32 —
returns None, and the caller decodes the batch with the msgspec path, which counts and logs
each problem. So this module only has to be right on what it accepts.
"""

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
    if _eq(s, n, b"type", 4): return F_TYPE
    if _eq(s, n, b"block_hashes", 12): return F_HASHES
    if _eq(s, n, b"parent_block_hash", 17): return F_PARENT
    if _eq(s, n, b"token_ids", 9): return F_TOKENS
    if _eq(s, n, b"block_size", 10): return F_BLOCK_SIZE
    if _eq(s, n, b"lora_id", 7): return F_LORA_ID
    if _eq(s, n, b"medium", 6): return F_MEDIUM
    if _eq(s, n, b"lora_name", 9): return F_LORA_NAME
    if _eq(s, n, b"extra_keys", 10): return F_EXTRA_KEYS
    if _eq(s, n, b"group_idx", 9): return F_GROUP
    if _eq(s, n, b"kv_cache_spec_kind", 18): return F_SPEC_KIND
    if _eq(s, n, b"kv_cache_spec_sliding_window", 28): return F_SPEC_WINDOW
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
    """An array of token ids as u32[]; None if it is not one (or too long)."""
    cdef size_t n, i
    cdef uint64_t v
    cdef bint neg
    if _array_len(r, &n) < 0 or n > max_tokens or not _need(r, n):
        return None
    cdef cnp.ndarray arr = np.empty(n, dtype=np.uint32)
    cdef uint32_t *d = <uint32_t *>cnp.PyArray_DATA(arr)
    for i in range(n):
        if _int(r, &v, &neg) < 0 or neg or v > 0xFFFFFFFF:
            return None
        d[i] = <uint32_t>v
    return arr


cdef int _read_field(Reader *r, Field f, dict rec, int *tier, int *group) except -2:
    """Read one event field into rec / tier / group; -1 = not the fast path's business."""
    cdef const uint8_t *s
    cdef size_t n
    cdef uint64_t v
    cdef bint neg
    cdef object obj = None
    cdef size_t start
    if f == F_HASHES:
        obj = _hash_array(r)
        if obj is None:
            return -1
        rec["h"] = obj
    elif f == F_PARENT:
        if not _nil(r):
            if _hash(r, &v) < 0:
                return -1
            rec["p"] = v
    elif f == F_TOKENS:
        obj = _token_array(r, <size_t>rec["_max"])
        if obj is None:
            return -1
        rec["t"] = obj
    elif f == F_BLOCK_SIZE:
        if _int(r, &v, &neg) < 0 or neg or v > 0x7FFFFFFF:
            return -1
        rec["bs"] = <long>v
    elif f == F_MEDIUM:
        if not _nil(r):
            if _str(r, &s, &n) < 0:
                return -1
            tier[0] = _tier(s, n)
            if tier[0] < 0:
                return -1  # unknown medium: the slow path counts it
    elif f == F_LORA_NAME:
        if not _nil(r):
            if _str(r, &s, &n) < 0:
                return -1
            try:
                rec["l"] = (<const char *>s)[:n].decode("utf-8", "strict")
            except UnicodeDecodeError:
                return -1
    elif f == F_EXTRA_KEYS:
        if not _nil(r):
            start = r.pos
            if _skip(r, 0) < 0:
                return -1
            rec["x"] = (start, r.pos)  # rare: decoded in Python
    elif f == F_GROUP:
        if not _nil(r):
            if _int(r, &v, &neg) < 0 or neg:
                return -1
            group[0] = <int>v if v < 0x7FFFFFFF else 0x7FFFFFFF
            if group[0] != 0:
                return -1  # hybrid models: group semantics live in the slow path
    elif f == F_SPEC_KIND:
        if not _nil(r):
            if _str(r, &s, &n) < 0:
                return -1
            if not _eq(s, n, b"full_attention", 14):
                return -1
    else:
        if _skip(r, 0) < 0:
            return -1
    return 0


def decode_batch(const uint8_t[::1] buf, size_t max_tokens, long block_size):
    """(ts, dp_rank | None, records, n_wire_events) or None (not a fast-path batch).

    records: ``("S", hashes u64[], parent | None, tokens u32[] | None, block_size, tier,
    lora_name | None, extra_keys span | None)``, ``("R", hashes u64[], tier)`` (consecutive
    removes of one tier coalesced) and ``("C",)``.
    """
    cdef Reader rd
    cdef Reader *r = &rd
    rd.p = &buf[0] if buf.shape[0] > 0 else NULL
    rd.n = buf.shape[0]
    rd.pos = 0
    if rd.n == 0:
        return None
    cdef size_t nb, nev, i, k, j, nfields
    cdef double ts
    cdef const uint8_t *s
    cdef size_t sn
    cdef uint64_t v
    cdef bint neg, is_map
    cdef int tier, group, kind, run_tier = -2
    cdef size_t ev_start
    cdef bint has_hashes
    cdef Field f
    cdef U64Buf run
    cdef object rank = None
    cdef list records = []
    cdef dict rec
    cdef size_t max_tok = max_tokens
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
            elif _array_len(r, &nfields) < 0 or nfields == 0:
                return None
            rec = {"_max": max_tok}
            tier = 0
            group = 0
            kind = -1
            if is_map:
                # vLLM writes "type" first; insist on it (a map without it is the slow path's)
                if nfields == 0 or _str(r, &s, &sn) < 0 or not _eq(s, sn, b"type", 4):
                    return None
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
            if not is_map:
                nfields -= 1
            ev_start = run.n
            has_hashes = False
            for j in range(nfields):
                if is_map:
                    if _str(r, &s, &sn) < 0:
                        return None
                    f = _field(s, sn)
                else:
                    if kind == 0:
                        f = STORED_ORDER[j] if j < 11 else F_SKIP
                    elif kind == 1:
                        f = REMOVED_ORDER[j] if j < 3 else F_SKIP
                    else:
                        f = F_SKIP
                if kind == 2 or f == F_LORA_ID or f == F_SPEC_WINDOW or f == F_SKIP \
                        or f == F_UNKNOWN or f == F_TYPE:
                    if _skip(r, 0) < 0:
                        return None
                    continue
                if kind == 1 and f == F_HASHES:
                    if _hashes_into(r, &run) < 0:
                        return None
                    has_hashes = True
                    continue
                if kind == 1 and f != F_MEDIUM and f != F_GROUP:
                    if _skip(r, 0) < 0:
                        return None
                    continue
                if _read_field(r, f, rec, &tier, &group) < 0:
                    return None
            if kind == 1:
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
            if kind == 0 and "h" not in rec:
                return None
            if kind == 0 and len(rec["h"]) == 0:
                continue  # nothing stored (and a run of removes may go on)
            if run.n:
                records.append(("R", _take(&run), run_tier))
            run_tier = -2
            if kind == 2:
                records.append(("C",))
                continue
            hashes = rec["h"]
            toks = rec.get("t")
            bs = rec.get("bs", 0)
            if len(hashes) == 0:
                continue
            if toks is None or len(toks) == 0:
                toks = None  # offload copy by hash (the caller marks tier_copy)
            elif bs <= 0 or (block_size and bs != block_size) or \
                    len(toks) != len(hashes) * bs:
                return None  # the slow path counts the mismatch
            records.append(("S", hashes, rec.get("p"), toks, bs, tier, rec.get("l"),
                            rec.get("x")))
        if run.n:
            records.append(("R", _take(&run), run_tier))
        if nb == 3:
            if _nil(r):
                rank = None
            else:
                if _int(r, &v, &neg) < 0 or neg or v > 0x7FFFFFFF:
                    return None
                rank = <long>v
        if rd.pos != rd.n:
            return None  # trailing bytes: not a well-formed batch
        return ts, rank, records, nev
    finally:
        free(run.data)
