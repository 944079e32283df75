/* The prefix index: kvplug block hash -> holders (endpoint, count per tier), and
 * (endpoint, engine hash) -> (block, refcount per tier). Rules: kvplug/_reference.py Index.
 *
 * Layout (sizes matter: see docs/core.md, memory per million blocks)
 *   block table  open addressing, linear probing, backward-shift deletion: 6-byte slots
 *                (16-bit hash tag, record id)
 *   records      a pool of 16-byte block records with stable ids (free list): hash and one
 *                compact inline holder (8-bit counts); more holders in a growable holder
 *                array of 8-byte holders (the same compact format), which widens to 12-byte
 *                holders once a count outgrows it; beside each record its canonical engine
 *                hash (8 bytes) and a bit; LRU links and per-holder engine hashes only when
 *                bounded
 *   canonical    one map for all endpoints: a block's first engine hash -> the block, 6-byte
 *   engine map   slots as the block table's; an endpoint mapping a block under that hash as
 *                its first mapping to it keeps the mapping as a flag on its holder
 *   engine maps  one per endpoint, for the other mappings (engines that disagree, further
 *                engine hashes of a block), open addressing on the engine hash, 12-byte slots
 *                -> record id; refcounts from the holder (first mapping of the endpoint to
 *                the block) or from a side table (further ones)
 * Invariant: a holder's count per tier is the sum of the refs of that endpoint's mappings to
 * the block, so holders and mappings are created and destroyed together.
 */
#if defined(__linux__) && !defined(_GNU_SOURCE)
#define _GNU_SOURCE /* mremap */
#endif
#include <stdlib.h>
#include <string.h>
#if defined(__linux__)
#include <sys/mman.h>
#define KVP_HAVE_MREMAP 1
#endif

#include "kvp_internal.h"
#include "kvplug.h"

#define NONE32 0xFFFFFFFFu
#define EP_EMPTY 0xFFFFFFFEu /* never a valid endpoint id */
#define EP_EXT 0xFFFFFFFDu   /* block_t.ep: the holders live in an ext_t */
#define EP_NONE 0xFFFFFFFCu  /* block_t.ep: no holder */
#define MIN_CAP 16
/* Hash tables stay at most LOAD_NUM/LOAD_DEN full (linear probing, multiply-high slot mapping)
 * and grow by (GROW_DEN + 1) / GROW_DEN; the record pool grows by POOL_GROW_DEN + 1 / ... */
#ifndef LOAD_NUM
#define LOAD_NUM 17
#define LOAD_DEN 20
#endif
#ifndef GROW_DEN
#define GROW_DEN 2
#endif
#ifndef POOL_GROW_DEN
#define POOL_GROW_DEN 8      /* while the pool is small (realloc may copy) */
#endif
#ifndef POOL_GROW_DEN_BIG /* once >= KVP_BIG_BYTES: a mapping that mremap grows without copying */
#if defined(__linux__)
#define POOL_GROW_DEN_BIG 32
#else
#define POOL_GROW_DEN_BIG POOL_GROW_DEN
#endif
#endif
#ifndef KVP_BIG_BYTES
#define KVP_BIG_BYTES ((size_t)1 << 20) /* arrays this large get their own mapping (Linux) */
#endif

/* A holder with full counts: 12 bytes, the working form (and a wide holder array's entry).
 * When the index is bounded, each holder also keeps one engine hash of ep mapped to
 * the block (eh_first, in a parallel array: rec_eh for an inline holder, after the holders in an
 * ext_t) so eviction finds the mapping without a table scan; unbounded indexes never evict and
 * keep no engine hashes per holder. */
typedef struct {
    kvp_endpoint_t ep;
    uint16_t count[KVP_N_TIERS]; /* sums of the mappings' refs; 65535 is KVP_E_OVERFLOW */
    uint16_t nmaps;              /* engine mappings of ep to this block | flags below */
} holder_t;
#define COUNT_MAX 0xFFFFu
#define EXT_MIN_CAP 2u           /* first holder array of a shared block (ext_grown_cap) */
#define NMAPS_MASK 0x3FFFu       /* 16383 engine hashes of one endpoint on one block at most */
#define HOLDER_CANON 0x4000u     /* one of the mappings is the block's canonical one (cm) */
#define HOLDER_EH_VALID 0x8000u  /* bounded index: the holder's eh_first is still mapped */

/* 8 bytes: a compact holder, the inline holder's format (ep, then `packed`: see block_t). A
 * holder array starts with these; a block's holders are shared by many endpoints far more
 * often than any one of them holds a block 256 times, so most arrays stay compact. */
typedef struct {
    kvp_endpoint_t ep;
    uint32_t packed;
} pholder_t;

/* Holders of a block with more than one: a header, then the array (then, bounded, one engine
 * hash per holder). The array is compact (pholder_t) until a holder's count would pass 255 or
 * its mappings 127; then it is rewritten wide (holder_t) and stays so. The header caches "this
 * block's holders equal those of record eq_prev while its holders had version eq_prev_ver",
 * which lets a query walk skip comparing long identical holder lists (popular prefixes). */
typedef struct {
    uint32_t hver;        /* clock stamp of the last change to these holders */
    uint32_t eq_prev;     /* record verified to have equal holders (NONE32: none) ... */
    uint32_t eq_prev_ver; /* ... while its hver was this */
    uint32_t cap;         /* holders allocated (even, so the eh array after them is aligned) */
    uint32_t n;           /* holders in use */
    uint32_t wide;        /* 1: holder_t entries; 0: pholder_t entries */
    uint32_t w[];         /* the entries, as 32-bit words (the endpoint first in both forms) */
} ext_t;

/* 16 bytes; LRU links and eh_first live in side arrays, allocated only when bounded. A block
 * with one holder usually keeps it inline, compactly: ep, and `packed` with an 8-bit count per
 * tier and 6 bits of nmaps (plus IN_CANON and IN_EH_VALID). ep == EP_NONE: no holder (none
 * yet, or the last one just left). ep == EP_EXT: the holders live in an ext_t (ext_t.n of
 * them), whose id in the index's ext table is `packed`; a block gets one when a second endpoint
 * holds it, or when its inline holder's counts outgrow 8 bits (or its mappings 6), so nothing
 * is ever lost. */
typedef struct {
    kvp_hash_t hash; /* on the free list: the next free record id */
    uint32_t ep;     /* the inline holder's endpoint, EP_NONE or EP_EXT */
    uint32_t packed; /* inline holder (see pack_holder), or the ext id */
} block_t;
#define IN_COUNT_MAX 0xFFu  /* an inline holder's count per tier */
#define IN_NMAPS_MAX 0x3Fu  /* an inline holder's engine mappings */
#define IN_CANON 0x40u
#define IN_EH_VALID 0x80u

_Static_assert(sizeof(holder_t) == 12, "holder_t is 12 bytes");
_Static_assert(sizeof(pholder_t) == 8, "pholder_t is 8 bytes");
_Static_assert(sizeof(block_t) == 16, "block_t is 16 bytes");
_Static_assert(sizeof(ext_t) % 8 == 0, "ext_t header keeps the eh array aligned");

/* A block-table slot is 5 bytes, one 40-bit little-endian word: the record id in its low 28 bits
 * (SLOT_NONE: an empty slot) and a 12-bit tag above it (low bits of the mixed block hash,
 * independent of the home slot, which its high 32 bits pick). A tag match is confirmed against
 * the record's full hash, which a hit reads anyway; a false tag match costs one record read with
 * probability 2^-12 per probed slot (an insert at the 0.85 load bound probes ~23 slots, so ~0.5 %
 * of those inserts read one record more). 5 bytes, not 6 with a 16-bit tag: the two tables are a
 * third to a half of the index's memory (issue 14's memory aim; docs/core.md). Rehash (from the
 * pool, sequentially) and backward-shift deletion recompute a slot's home from its record's
 * hash. */
typedef unsigned char bslot_t; /* a table is an array of SLOT_BYTES-byte slots */
#define SLOT_BYTES 5u
#define SLOT_REC_BITS 28
#define SLOT_NONE 0x0FFFFFFFu /* record id of an empty slot; records are below it */
#define SLOT_TAG_MASK 0xFFFu
static inline size_t slot_table_bytes(size_t cap) { return cap * SLOT_BYTES; }
static inline const bslot_t *slot_at(const bslot_t *t, size_t i) { return t + i * SLOT_BYTES; }
/* The slot's 5 bytes, read as 4 + 1: one 8-byte load would cross into the next cache line for 7
 * of 64 slot positions, a line the probe may not have prefetched; the 5 bytes themselves cross
 * for 4 of 64, as 6-byte slots did */
static inline uint64_t slot_word(const bslot_t *t, size_t i) {
    const bslot_t *p = slot_at(t, i);
    uint32_t lo;
    memcpy(&lo, p, sizeof(lo));
#if __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    lo = __builtin_bswap32(lo);
#endif
    return (uint64_t)lo | (uint64_t)p[4] << 32;
}
/* A slot word's two fields (a probe reads the word once and takes both) */
static inline uint32_t word_rec(uint64_t w) { return (uint32_t)w & SLOT_NONE; }
static inline uint32_t word_tag(uint64_t w) { return (uint32_t)(w >> SLOT_REC_BITS) & SLOT_TAG_MASK; }
static inline uint32_t slot_rec(const bslot_t *t, size_t i) { return word_rec(slot_word(t, i)); }
static inline uint32_t slot_tag(const bslot_t *t, size_t i) { return word_tag(slot_word(t, i)); }
/* Every slot of a table of `cap` empty: all-ones bytes, record SLOT_NONE (an empty slot's tag is
 * never read) */
static inline void slots_empty(bslot_t *t, size_t cap) { memset(t, 0xFF, slot_table_bytes(cap)); }
static inline void slot_set(bslot_t *t, size_t i, uint32_t rec, uint32_t tag) {
    const uint64_t x = (uint64_t)rec | (uint64_t)tag << SLOT_REC_BITS;
    uint32_t lo = (uint32_t)x; /* bytes 0-3, then byte 4: two stores, the next slot untouched */
#if __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    lo = __builtin_bswap32(lo);
#endif
    memcpy(t + i * SLOT_BYTES, &lo, sizeof(lo));
    t[i * SLOT_BYTES + 4] = (unsigned char)(x >> 32);
}

/* A table of such slots whose keys live in the records, not in the slots: the block table
 * (keyed on the records' block hashes) and the canonical engine map (keyed on the owners'
 * canonical engine hashes) are both one (st_* below). */
typedef struct {
    bslot_t *s;
    size_t cap, count;
    size_t bytes;         /* allocated size (arr_grow) */
    unsigned char mapped; /* its own mapping (arr_grow) */
} slot_table_t;

/* One engine mapping in 12 bytes, in its endpoint's own table (so no endpoint field): the
 * engine hash and the record id, whose top bit (M_SIDE) says where the mapping's refcounts
 * live. Without it (at most one such mapping per endpoint and block: the first one made), the
 * refcounts are the holder's counts minus those of the endpoint's other mappings to the block
 * (their sum is kept in the side table when there are any, so usually there are none and the
 * holder's counts are the mapping's). With it, the side table holds them, keyed by (endpoint,
 * engine hash). Mappings added to a block the endpoint already holds get M_SIDE. */
typedef struct __attribute__((packed, aligned(4))) {
    kvp_engine_hash_t eh;
    uint32_t rec; /* NONE32 = empty slot; else record id | M_SIDE */
} mslot_t;
_Static_assert(sizeof(mslot_t) == 12, "mslot_t is 12 bytes");
#define M_SIDE 0x80000000u
#define M_REC_MASK 0x7FFFFFFFu
#define POOL_MAX_RECORDS 0x0FFFFFF0u /* record ids fit a slot (SLOT_NONE) and leave M_SIDE free */

/* One endpoint's engine map: open addressing on the engine hash, linear probing. It holds the
 * endpoint's mappings other than canonical ones (see cm below), so it stays empty while the
 * endpoint's engine agrees with the others on what each engine hash is. */
typedef struct {
    mslot_t *t;
    uint32_t cap, count;
    uint32_t ncanon; /* canonical mappings of the endpoint (holders with HOLDER_CANON) */
} emap_t;

/* Side table: refcounts of M_SIDE mappings keyed by (endpoint code, engine hash), and per
 * (endpoint code | OT_SUM, record id) the sum of that endpoint's M_SIDE refcounts on the block. */
typedef struct {
    uint64_t key;
    uint32_t code; /* OVF_EMPTY = empty slot */
    uint32_t refs[KVP_N_TIERS];
} oslot_t;
#define OVF_EMPTY 0xFFFFFFFFu
#define OT_SUM 0x40000000u
#define M_SHARED_CODE 0x100000u

/* A query between kvp_index_query_begin and _end: the walk's locals between feeds. */
typedef struct {
    size_t n, walked, n_act, pending;
    uint32_t prev_r;
    int prev_shared, done, open;
} query_state_t;

struct kvp_index {
    uint64_t max_entries;
    slot_table_t bt; /* block hash -> record */
    block_t *pool;
    uint32_t pool_len, pool_cap, free_head;
    size_t pool_bytes, lru_prev_bytes, lru_next_bytes, rec_eh_bytes; /* allocated sizes */
    unsigned char pool_mapped, lru_prev_mapped, lru_next_mapped, rec_eh_mapped; /* own mmap */
    uint32_t *lru_prev, *lru_next; /* pool_cap entries each, only when max_entries > 0 */
    kvp_engine_hash_t *rec_eh;     /* eh_first of a record's inline holder, only when bounded */
    uint32_t lru_head, lru_tail;   /* oldest, newest */
    emap_t *em;        /* engine maps of endpoints 0 .. em_cap-1 */
    size_t em_cap;
    emap_t em_shared;  /* the shared tier's */
    /* Canonical map: engine hash -> record, at most one entry per record, shared by every
     * endpoint. A record created by a store whose engine hash no record owns yet owns it (its
     * canonical engine hash, rec_ceh, and its bit in cm_own); an endpoint whose first mapping
     * to a block is the block's canonical engine hash keeps that mapping as a flag on its
     * holder (HOLDER_CANON) instead of a slot in its own map. So engines that agree on engine
     * hashes (the usual case) cost one 6-byte slot per block, not 12 bytes per holder; where
     * they disagree, their own maps keep the rest, as before. */
    slot_table_t cm;
    unsigned char rec_ceh_mapped, cm_own_mapped;
    kvp_engine_hash_t *rec_ceh; /* pool_cap entries: a record's canonical engine hash */
    uint64_t *cm_own;           /* pool_cap bits: the record owns its cm entry */
    size_t rec_ceh_bytes, cm_own_bytes;
    size_t mt_count;   /* mappings, all endpoints (canonical ones included) */
    size_t mt_slots;   /* slots allocated, all endpoints */
    oslot_t *ot; /* side table (NULL until first needed) */
    size_t ot_cap, ot_count;
    uint64_t n_holdings;
    size_t ext_bytes;
    ext_t **ext_tab;    /* holder arrays by ext id (NULL: free id) */
    uint32_t *ext_free; /* free ext ids (a stack; ext_cap entries) */
    uint32_t ext_len, ext_cap, ext_nfree;
    uint32_t hclock; /* holder-change clock (ext_t.hver) */
    kvp_stats c; /* counters only; sizes are filled in by kvp_index_stats */
    /* query scratch */
    uint32_t *ep_gen, *ep_pos;
    uint32_t *act_ep;   /* endpoints still continuing the prefix, and their best tier */
    uint8_t *act_best;
    size_t ep_cap;
    uint32_t ep_limit;
    uint32_t gen;
    uint32_t *run;
    size_t run_cap;
    query_state_t qs;
    /* store_tokens scratch */
    kvp_hash_t *seq;
    size_t seq_cap;
};

/* ---- small helpers ------------------------------------------------------------------------ */
static inline size_t fastrange(uint64_t x, size_t cap) {
    return (size_t)(((unsigned __int128)x * (uint64_t)cap) >> 64);
}
static inline uint64_t bmix_of(kvp_hash_t h) {
    uint64_t x = (h ^ (h >> 31)) * KPH_K0;
    return x ^ (x >> 29);
}
static inline uint32_t btag_of(uint64_t mixed) { return (uint32_t)mixed & SLOT_TAG_MASK; }
static inline size_t bhome_of(uint64_t mixed, size_t cap) { /* cap < 2^32 */
    return (size_t)(((mixed >> 32) * cap) >> 32);
}
static inline size_t bslot_of(kvp_hash_t h, size_t cap) { return bhome_of(bmix_of(h), cap); }
static inline uint32_t ep_code(kvp_endpoint_t ep) { return ep == KVP_SHARED ? M_SHARED_CODE : ep; }
static inline size_t mslot_of(kvp_engine_hash_t eh, size_t cap) {
    uint64_t x = eh * KPH_K0;
    x ^= x >> 29;
    x *= KPH_K1;
    return fastrange(x ^ (x >> 32), cap);
}
static inline size_t oslot_of(uint32_t code, uint64_t key, size_t cap) {
    return mslot_of(key ^ ((uint64_t)code * KPH_K3), cap);
}
static inline size_t grown_cap(size_t cap, size_t need) {
    while (need * LOAD_DEN > cap * LOAD_NUM) cap = cap + cap / GROW_DEN + MIN_CAP;
    return cap;
}
static inline int valid_ep(kvp_endpoint_t ep) { return ep < KVP_MAX_ENDPOINT || ep == KVP_SHARED; }
static inline int valid_tier(int t) { return t >= 0 && t < KVP_N_TIERS; }
static inline int is_ext(const block_t *b) { return b->ep == EP_EXT; }
static inline ext_t *ext_of(const kvp_index *idx, const block_t *b) {
    return idx->ext_tab[b->packed];
}
static inline uint32_t nh_of(const kvp_index *idx, const block_t *b) {
    return is_ext(b) ? ext_of(idx, b)->n : (b->ep != EP_NONE);
}
/* The compact format (an inline holder, a compact array's entry): ep, and `packed` with an
 * 8-bit count per tier and 6 bits of nmaps plus IN_CANON and IN_EH_VALID. */
static inline void unpack_fields(kvp_endpoint_t ep, uint32_t p, holder_t *h) {
    h->ep = ep;
    h->count[0] = (uint16_t)(p & 0xFF);
    h->count[1] = (uint16_t)((p >> 8) & 0xFF);
    h->count[2] = (uint16_t)((p >> 16) & 0xFF);
    h->nmaps = (uint16_t)(((p >> 24) & IN_NMAPS_MAX) | ((p >> 24) & IN_CANON ? HOLDER_CANON : 0) |
                          ((p >> 24) & IN_EH_VALID ? HOLDER_EH_VALID : 0));
}
/* The caller made sure it fits (fits_compact): see widen. */
static inline uint32_t pack_fields(const holder_t *h) {
    uint32_t nm = (h->nmaps & IN_NMAPS_MAX) | (h->nmaps & HOLDER_CANON ? IN_CANON : 0) |
                  (h->nmaps & HOLDER_EH_VALID ? IN_EH_VALID : 0);
    return (uint32_t)h->count[0] | (uint32_t)h->count[1] << 8 | (uint32_t)h->count[2] << 16 |
           nm << 24;
}
static inline void unpack_holder(const block_t *b, holder_t *h) { unpack_fields(b->ep, b->packed, h); }
static inline void pack_holder(block_t *b, const holder_t *h) {
    b->ep = h->ep;
    b->packed = pack_fields(h);
}
/* Would this holder, one more count in tier t (t < 0: none) or one more mapping (more_maps),
 * still fit the compact format? */
static inline int compact_after(const holder_t *h, int t, int more_maps) {
    return (t < 0 || h->count[t] < IN_COUNT_MAX) &&
           (!more_maps || (h->nmaps & NMAPS_MASK) < IN_NMAPS_MAX);
}
static inline size_t ext_stride(const ext_t *e) { /* in 32-bit words */
    return e->wide ? sizeof(holder_t) / 4 : sizeof(pholder_t) / 4;
}
static inline holder_t *ext_wide(ext_t *e) { return (holder_t *)(void *)e->w; }
static inline pholder_t *ext_compact(ext_t *e) { return (pholder_t *)(void *)e->w; }
static inline size_t ext_size(uint32_t cap, int bounded, int wide) {
    return sizeof(ext_t) + (size_t)cap * ((wide ? sizeof(holder_t) : sizeof(pholder_t)) +
                                          (bounded ? sizeof(kvp_engine_hash_t) : 0));
}
static inline kvp_engine_hash_t *ext_eh(ext_t *e) {
    return (kvp_engine_hash_t *)(void *)(e->w + (size_t)e->cap * ext_stride(e));
}
/* Holder k of an ext_t: a pointer into a wide array, or a compact entry unpacked into *tmp
 * (changes to which holder_sync writes back). */
static inline holder_t *ext_holder(ext_t *e, uint32_t k, holder_t *tmp) {
    if (e->wide) return &ext_wide(e)[k];
    unpack_fields(ext_compact(e)[k].ep, ext_compact(e)[k].packed, tmp);
    return tmp;
}
/* Write back holder k of record r after a change, when it was unpacked into *tmp (inline or
 * compact: the caller made sure it still fits); a wide holder was changed in place. */
static inline void holder_sync(kvp_index *idx, uint32_t r, uint32_t k, const holder_t *hd,
                               const holder_t *tmp) {
    if (hd != tmp) return;
    block_t *b = &idx->pool[r];
    if (is_ext(b)) {
        pholder_t *ph = &ext_compact(ext_of(idx, b))[k];
        ph->ep = hd->ep;
        ph->packed = pack_fields(hd);
    } else {
        pack_holder(b, hd);
    }
}
/* Read-only view of a block's holders, whatever their form: `stride` 32-bit words apart, the
 * endpoint first; compact entries (and the inline holder: block_t's ep and packed are adjacent,
 * in that order) have `packed` second, wide ones holder_t's counts. */
typedef struct {
    const uint32_t *w;
    size_t stride;
    uint32_t n;
} hview_t;
static inline hview_t hview_of(const kvp_index *idx, const block_t *b) {
    hview_t v;
    if (is_ext(b)) {
        const ext_t *e = ext_of(idx, b);
        v.w = e->w;
        v.stride = ext_stride(e);
        v.n = e->n;
    } else {
        v.w = &b->ep;
        v.stride = 2;
        v.n = b->ep != EP_NONE;
    }
    return v;
}
static inline uint32_t hv_ep(hview_t v, uint32_t k) { return v.w[k * v.stride]; }
static inline int best_tier(const holder_t *h) { return h->count[0] ? 0 : (h->count[1] ? 1 : 2); }
static inline int inline_best_tier(uint32_t packed) {
    return (packed & 0xFF) ? 0 : ((packed & 0xFF00) ? 1 : 2);
}
static inline int hv_best(hview_t v, uint32_t k) {
    const uint32_t *p = &v.w[k * v.stride];
    return v.stride == 2 ? inline_best_tier(p[1]) : best_tier((const holder_t *)(const void *)p);
}
/* Holder k unpacked (or copied) into *out. */
static inline void hv_get(hview_t v, uint32_t k, holder_t *out) {
    const uint32_t *p = &v.w[k * v.stride];
    if (v.stride == 2) unpack_fields(p[0], p[1], out);
    else memcpy(out, p, sizeof(*out));
}
/* Bounded only: where holder k of record r keeps its eh_first. */
static inline kvp_engine_hash_t *eh_first_of(kvp_index *idx, uint32_t r, uint32_t k) {
    block_t *b = &idx->pool[r];
    return is_ext(b) ? &ext_eh(ext_of(idx, b))[k] : &idx->rec_eh[r];
}

/* Holders are kept sorted by endpoint id: lookups search, and blocks held by the same
 * endpoints have identical holder lists whatever order the stores came in (see same_holders).
 * Endpoint ids are dense (below the index's endpoint limit), so in a long list ep sits about
 * ep / limit of the way along: start there and gallop to bracket it, then bisect the bracket.
 * A popular prefix's list spans kilobytes, where plain bisection is a chain of ~log2(n)
 * dependent cache misses; this touches one or two lines around the guess. The answer is the
 * lower bound whatever the guess (limit only steers it). */
enum { HOLDER_GUESS_MIN = 16 };
#define HS_EP(k) (hs[(size_t)(k) * stride])
static uint32_t holder_lower_bound(const uint32_t *hs, size_t stride, uint32_t n, kvp_endpoint_t ep,
                                   uint32_t limit) {
    uint32_t lo = 0, hi = n;
    if (n >= HOLDER_GUESS_MIN) {
        uint32_t g = ep < limit ? (uint32_t)((uint64_t)ep * n / limit) : n - 1;
        if (g > n - 1) g = n - 1;
        uint32_t step = 1;
        if (HS_EP(g) < ep) { /* the answer is after g: gallop up */
            lo = g + 1;
            for (;;) {
                const uint32_t p = lo + step - 1;
                if (p >= hi) break;
                if (HS_EP(p) < ep) {
                    lo = p + 1;
                    step *= 2;
                } else {
                    hi = p;
                    break;
                }
            }
        } else { /* the answer is at or before g: gallop down */
            hi = g;
            for (;;) {
                if (hi < lo + step) break;
                const uint32_t p = hi - step;
                if (HS_EP(p) >= ep) {
                    hi = p;
                    step *= 2;
                } else {
                    lo = p + 1;
                    break;
                }
            }
        }
    }
    while (lo < hi) {
        uint32_t mid = lo + (hi - lo) / 2;
        if (HS_EP(mid) < ep) lo = mid + 1;
        else hi = mid;
    }
    return lo;
}
#undef HS_EP

/* ep's holder on b (in b's ext_t, or unpacked into *tmp), or NULL; *k_out = its position. */
static holder_t *find_holder(const kvp_index *idx, const block_t *b, kvp_endpoint_t ep,
                             holder_t *tmp, uint32_t *k_out) {
    if (!is_ext(b)) {
        if (b->ep != ep) return NULL;
        unpack_holder(b, tmp);
        if (k_out) *k_out = 0;
        return tmp;
    }
    ext_t *e = ext_of(idx, b);
    const size_t stride = ext_stride(e);
    uint32_t k = holder_lower_bound(e->w, stride, e->n, ep, idx->ep_limit);
    if (k_out) *k_out = k;
    return (k < e->n && e->w[k * stride] == ep) ? ext_holder(e, k, tmp) : NULL;
}

/* ---- slot tables ------------------------------------------------------------------------- */
static kvp_status bt_alloc(size_t cap, bslot_t **out) {
    if (cap > SIZE_MAX / SLOT_BYTES) return KVP_E_NOMEM;
    bslot_t *t = (bslot_t *)malloc(slot_table_bytes(cap));
    if (!t) return KVP_E_NOMEM;
    slots_empty(t, cap);
    *out = t;
    return KVP_OK;
}

static int arr_grow(void **p, size_t *bytes, unsigned char *mapped, size_t new_bytes);

/* The block table (ST_BLOCKS: a slot per live record, keyed on its block hash) and the
 * canonical engine map (ST_CANON: a slot per owner, keyed on its canonical engine hash, rec_ceh;
 * see struct kvp_index). Probing, growth and deletion are one code (st_*); `which` is a constant
 * at every call and the st_* bodies are always inlined, so each table gets its own copy with
 * its key source folded in, as if written twice. */
enum { ST_BLOCKS = 0, ST_CANON = 1 };
#define ST_INLINE static inline __attribute__((always_inline))

/* Canonical engine hashes are mixed unlike block hashes, so a workload whose engine hashes equal
 * its block hashes does not give both tables the same clusters. */
static inline uint64_t cmix_of(kvp_engine_hash_t eh) {
    uint64_t x = (eh ^ (eh >> 29)) * KPH_K2;
    return x ^ (x >> 31);
}
static inline int cm_owns(const kvp_index *idx, uint32_t r) {
    return (int)((idx->cm_own[r >> 6] >> (r & 63)) & 1u);
}

ST_INLINE slot_table_t *st_table(const kvp_index *idx, int which) {
    return (slot_table_t *)(which == ST_CANON ? &idx->cm : &idx->bt);
}
/* Where the records' keys live, read once per call: with -fno-strict-aliasing every slot
 * written would otherwise make the compiler reload these pointers from the index. */
typedef struct {
    const block_t *pool;
    const kvp_engine_hash_t *ceh;
    const uint64_t *own;
} st_keys_t;
ST_INLINE st_keys_t st_keys(const kvp_index *idx) {
    return (st_keys_t){idx->pool, idx->rec_ceh, idx->cm_own};
}
/* Record r's key in the table, and how keys are mixed (tag and home slot). */
ST_INLINE uint64_t st_key(st_keys_t k, int which, uint32_t r) {
    return which == ST_CANON ? k.ceh[r] : k.pool[r].hash;
}
ST_INLINE uint64_t st_mix(int which, uint64_t key) {
    return which == ST_CANON ? cmix_of(key) : bmix_of(key);
}
/* Whether record r has a slot in the table (a live record; an owner of its engine hash). */
ST_INLINE int st_member(st_keys_t k, int which, uint32_t r) {
    return which == ST_CANON ? (int)((k.own[r >> 6] >> (r & 63)) & 1u) : k.pool[r].ep != EP_NONE;
}

/* The record whose key is `key`, or NONE32 with *empty = where it would be inserted. Spelled
 * out field by field rather than through st_table/st_key: so GCC lays the loop out as it did
 * for the two hand-written probes (through the helpers callgrind counted 4-6 % more
 * instructions in map_lookup, where the canonical probe is inlined). */
ST_INLINE uint32_t st_probe(const kvp_index *idx, int which, uint64_t key, size_t *empty) {
    const size_t cap = which == ST_CANON ? idx->cm.cap : idx->bt.cap;
    const uint64_t mixed = st_mix(which, key);
    const uint32_t tag = btag_of(mixed);
    size_t i = bhome_of(mixed, cap);
    for (;;) {
        const uint64_t w = slot_word(which == ST_CANON ? idx->cm.s : idx->bt.s, i);
        const uint32_t rec = word_rec(w);
        if (rec == SLOT_NONE) {
            *empty = i;
            return NONE32;
        }
        if (word_tag(w) == tag &&
            (which == ST_CANON ? idx->rec_ceh[rec] : idx->pool[rec].hash) == key)
            return rec;
        if (++i == cap) i = 0;
    }
}

/* Empty the table's first `cap` slots (allocated) and fill them from its members, read in
 * record order with each one's home slot prefetched ahead: slots keep only a 12-bit tag, so
 * homes come from the records' keys. */
ST_INLINE void st_refill(kvp_index *idx, int which, size_t cap) {
    slot_table_t *tab = st_table(idx, which);
    const st_keys_t k = st_keys(idx);
    bslot_t *t = tab->s;
    slots_empty(t, cap);
    /* each record's home and tag are computed once, REHASH_AHEAD records ahead, when its home
     * line is prefetched, and kept in a ring until its turn (a refill is ~half of an apply into
     * a growing index, by callgrind) */
    enum { REHASH_AHEAD = 16 };
    size_t home[REHASH_AHEAD];
    uint32_t tag[REHASH_AHEAD];
#define REFILL_AHEAD(r)                                                         \
    do {                                                                        \
        const uint64_t mixed_ = st_mix(which, st_key(k, which, (r)));           \
        home[(r) % REHASH_AHEAD] = bhome_of(mixed_, cap);                       \
        tag[(r) % REHASH_AHEAD] = btag_of(mixed_);                              \
        __builtin_prefetch(slot_at(t, home[(r) % REHASH_AHEAD]), 1);            \
    } while (0)
    const uint32_t n = idx->pool_len;
    for (uint32_t r = 0; r < n && r < REHASH_AHEAD; r++) REFILL_AHEAD(r);
    for (uint32_t r = 0; r < n; r++) {
        size_t j = home[r % REHASH_AHEAD];
        const uint32_t tg = tag[r % REHASH_AHEAD];
        if (r + REHASH_AHEAD < n) REFILL_AHEAD(r + REHASH_AHEAD);
        if (!st_member(k, which, r)) continue;
        while (slot_rec(t, j) != SLOT_NONE)
            if (++j == cap) j = 0;
        slot_set(t, j, r, tg);
    }
#undef REFILL_AHEAD
    tab->cap = cap;
}

/* Room for `extra` more slots within the load bound. The new table reuses the old one's memory
 * (grown in place: mremap once it is big, so its pages are not faulted in and zeroed again),
 * since it is refilled from the records anyway. */
ST_INLINE kvp_status st_reserve(kvp_index *idx, int which, size_t extra) {
    slot_table_t *tab = st_table(idx, which);
    size_t need = tab->count + extra;
    if (need < tab->count || need > ((size_t)1 << 31)) return KVP_E_NOMEM;
    size_t cap = grown_cap(tab->cap, need);
    if (cap == tab->cap) return KVP_OK;
    if (cap > SIZE_MAX / SLOT_BYTES ||
        !arr_grow((void **)&tab->s, &tab->bytes, &tab->mapped, slot_table_bytes(cap)))
        return KVP_E_NOMEM;
    st_refill(idx, which, cap);
    return KVP_OK;
}

/* Delete member r's slot (found by record id, so no key comparison is needed) by backward
 * shift: later cluster members whose home is not in (i, j] move up. */
ST_INLINE void st_delete(kvp_index *idx, int which, uint32_t r) {
    slot_table_t *tab = st_table(idx, which);
    const st_keys_t k = st_keys(idx);
    bslot_t *t = tab->s;
    const size_t cap = tab->cap;
    size_t i = bhome_of(st_mix(which, st_key(k, which, r)), cap);
    for (;;) {
        const uint32_t ri = slot_rec(t, i);
        if (ri == SLOT_NONE) return;
        if (ri == r) break;
        if (++i == cap) i = 0;
    }
    size_t j = i;
    for (;;) {
        if (++j == cap) j = 0;
        const uint32_t rj = slot_rec(t, j);
        if (rj == SLOT_NONE) break;
        size_t home = bhome_of(st_mix(which, st_key(k, which, rj)), cap);
        int stays = (i <= j) ? (i < home && home <= j) : (i < home || home <= j);
        if (stays) continue;
        slot_set(t, i, rj, slot_tag(t, j));
        i = j;
    }
    slot_set(t, i, SLOT_NONE, SLOT_TAG_MASK);
    tab->count--;
}

/* The block table */
static uint32_t bt_probe(const kvp_index *idx, kvp_hash_t h, size_t *empty) {
    return st_probe(idx, ST_BLOCKS, h, empty);
}
static inline uint32_t bt_find(const kvp_index *idx, kvp_hash_t h) {
    size_t empty;
    return bt_probe(idx, h, &empty);
}
static kvp_status bt_reserve(kvp_index *idx, size_t extra) {
    return st_reserve(idx, ST_BLOCKS, extra);
}
static void bt_refill(kvp_index *idx, size_t cap) { st_refill(idx, ST_BLOCKS, cap); }
static void bt_delete(kvp_index *idx, uint32_t r) { st_delete(idx, ST_BLOCKS, r); }

/* The canonical engine map */
static uint32_t cm_probe(const kvp_index *idx, kvp_engine_hash_t eh, size_t *empty) {
    return st_probe(idx, ST_CANON, eh, empty);
}
/* Record r (new, holding nothing in cm yet) owns eh, whose probe found slot `empty` free. */
static void cm_insert(kvp_index *idx, uint32_t r, kvp_engine_hash_t eh, size_t empty) {
    slot_set(idx->cm.s, empty, r, btag_of(cmix_of(eh)));
    idx->cm.count++;
    idx->rec_ceh[r] = eh;
    idx->cm_own[r >> 6] |= (uint64_t)1 << (r & 63);
}
static kvp_status cm_reserve(kvp_index *idx, size_t extra) {
    return st_reserve(idx, ST_CANON, extra);
}
static void cm_refill(kvp_index *idx, size_t cap) { st_refill(idx, ST_CANON, cap); }
static void cm_delete(kvp_index *idx, uint32_t r) {
    idx->cm_own[r >> 6] &= ~((uint64_t)1 << (r & 63));
    st_delete(idx, ST_CANON, r);
}

/* ---- engine mapping tables (one per endpoint) --------------------------------------------- */
static inline uint32_t m_rec(const mslot_t *m) { return m->rec & M_REC_MASK; }
static inline int m_side(const mslot_t *m) { return (m->rec & M_SIDE) != 0; }

static inline emap_t *emap_of(const kvp_index *idx, kvp_endpoint_t ep) {
    if (ep == KVP_SHARED) return (emap_t *)&idx->em_shared;
    return (size_t)ep < idx->em_cap ? &idx->em[ep] : NULL;
}

/* Probe once: the slot holding eh, or NULL with *empty = where it would be inserted (only
 * meaningful when the table has capacity). */
static mslot_t *mt_probe(const emap_t *em, kvp_engine_hash_t eh, size_t *empty) {
    const size_t cap = em ? em->cap : 0;
    if (cap == 0) {
        *empty = 0;
        return NULL;
    }
    size_t i = mslot_of(eh, cap);
    for (;;) {
        mslot_t *s = &em->t[i];
        if (s->rec == NONE32) {
            *empty = i;
            return NULL;
        }
        if (s->eh == eh) return s;
        if (++i == cap) i = 0;
    }
}

/* An engine mapping of an endpoint as found: its value (engine hash; record id, with M_SIDE when
 * its refcounts live in the side table), and its slot in the endpoint's own map, or slot NULL
 * for a canonical mapping (the block's canonical engine hash, kept as its holder's flag). */
typedef struct {
    mslot_t v;
    mslot_t *slot;
} mapping_t;

/* ep's mapping of eh, if any: in ep's own map, else the canonical one when ep's holder on the
 * record owning eh has HOLDER_CANON (an endpoint never has both for one engine hash: a
 * canonical mapping is only made when the own map has none, and the own map only gets eh when
 * no canonical mapping of ep answers it). *m_empty: where ep's own map would take eh;
 * *cm_rec: the record owning eh (NONE32: none, or not looked up), *cm_empty: where it would go. */
static int map_lookup(const kvp_index *idx, kvp_endpoint_t ep, kvp_engine_hash_t eh,
                      mapping_t *out, size_t *m_empty, uint32_t *cm_rec, size_t *cm_empty) {
    mslot_t *m = mt_probe(emap_of(idx, ep), eh, m_empty);
    *cm_rec = NONE32;
    if (m != NULL) {
        out->v = *m;
        out->slot = m;
        return 1;
    }
    const uint32_t r = cm_probe(idx, eh, cm_empty);
    *cm_rec = r;
    if (r == NONE32) return 0;
    holder_t tmp;
    const holder_t *hd = find_holder(idx, &idx->pool[r], ep, &tmp, NULL);
    if (hd == NULL || !(hd->nmaps & HOLDER_CANON)) return 0;
    out->v.eh = eh;
    out->v.rec = r;
    out->slot = NULL;
    return 1;
}

static int map_find(const kvp_index *idx, kvp_endpoint_t ep, kvp_engine_hash_t eh,
                    mapping_t *out) {
    size_t m_empty, cm_empty;
    uint32_t cm_rec;
    return map_lookup(idx, ep, eh, out, &m_empty, &cm_rec, &cm_empty);
}

static kvp_status mt_alloc(size_t cap, mslot_t **out) {
    if (cap > SIZE_MAX / sizeof(mslot_t)) return KVP_E_NOMEM;
    mslot_t *t = (mslot_t *)malloc(cap * sizeof(mslot_t));
    if (!t) return KVP_E_NOMEM;
    for (size_t i = 0; i < cap; i++) {
        t[i].eh = 0;
        t[i].rec = NONE32;
    }
    *out = t;
    return KVP_OK;
}

/* Room for `extra` more mappings of ep (whose emap_t must exist). */
static kvp_status mt_reserve(kvp_index *idx, kvp_endpoint_t ep, size_t extra) {
    emap_t *em = emap_of(idx, ep);
    size_t need = (size_t)em->count + extra;
    if (need < em->count || need > ((size_t)1 << 31)) return KVP_E_NOMEM;
    size_t cap = grown_cap(em->cap, need);
    if (cap == em->cap) return KVP_OK;
    if (cap > NONE32) return KVP_E_NOMEM;
    mslot_t *t;
    if (mt_alloc(cap, &t) != KVP_OK) return KVP_E_NOMEM;
    for (size_t i = 0; i < em->cap; i++) {
        if (em->t[i].rec == NONE32) continue;
        size_t j = mslot_of(em->t[i].eh, cap);
        while (t[j].rec != NONE32)
            if (++j == cap) j = 0;
        t[j] = em->t[i];
    }
    free(em->t);
    idx->mt_slots += cap - em->cap;
    em->t = t;
    em->cap = (uint32_t)cap;
    return KVP_OK;
}

/* ---- side table (small open addressing, at most half full) --------------------------------- */
static oslot_t *ot_find(const kvp_index *idx, uint32_t code, uint64_t key) {
    if (idx->ot_cap == 0) return NULL;
    size_t i = oslot_of(code, key, idx->ot_cap);
    for (;;) {
        oslot_t *o = &idx->ot[i];
        if (o->code == OVF_EMPTY) return NULL;
        if (o->code == code && o->key == key) return o;
        if (++i == idx->ot_cap) i = 0;
    }
}

/* Insert a zeroed entry; the caller made room with ot_reserve() and checked it is absent. */
static oslot_t *ot_put(oslot_t *ot, size_t cap, uint32_t code, uint64_t key) {
    size_t i = oslot_of(code, key, cap);
    while (ot[i].code != OVF_EMPTY)
        if (++i == cap) i = 0;
    memset(&ot[i], 0, sizeof ot[i]);
    ot[i].code = code;
    ot[i].key = key;
    return &ot[i];
}

/* Room for `extra` more entries; called before any change that may need them. */
static kvp_status ot_reserve(kvp_index *idx, size_t extra) {
    if ((idx->ot_count + extra) * 2 <= idx->ot_cap) return KVP_OK;
    size_t cap = idx->ot_cap ? idx->ot_cap : 16;
    while ((idx->ot_count + extra) * 2 > cap) cap *= 2;
    if (cap > SIZE_MAX / sizeof(oslot_t)) return KVP_E_NOMEM;
    oslot_t *t = (oslot_t *)malloc(cap * sizeof(oslot_t));
    if (!t) return KVP_E_NOMEM;
    for (size_t i = 0; i < cap; i++) {
        memset(&t[i], 0, sizeof t[i]);
        t[i].code = OVF_EMPTY;
    }
    for (size_t i = 0; i < idx->ot_cap; i++)
        if (idx->ot[i].code != OVF_EMPTY) *ot_put(t, cap, idx->ot[i].code, idx->ot[i].key) = idx->ot[i];
    free(idx->ot);
    idx->ot = t;
    idx->ot_cap = cap;
    return KVP_OK;
}

static void ot_delete(kvp_index *idx, uint32_t code, uint64_t key) {
    oslot_t *o = ot_find(idx, code, key);
    if (o == NULL) return;
    const size_t cap = idx->ot_cap;
    size_t i = (size_t)(o - idx->ot), j = i;
    for (;;) { /* backward shift */
        if (++j == cap) j = 0;
        if (idx->ot[j].code == OVF_EMPTY) break;
        size_t home = oslot_of(idx->ot[j].code, idx->ot[j].key, cap);
        int stays = (i <= j) ? (i < home && home <= j) : (i < home || home <= j);
        if (stays) continue;
        idx->ot[i] = idx->ot[j];
        i = j;
    }
    memset(&idx->ot[i], 0, sizeof idx->ot[i]);
    idx->ot[i].code = OVF_EMPTY;
    idx->ot_count--;
}

/* ---- mapping refcounts -------------------------------------------------------------------- */
/* Refs of mapping m (of endpoint code `code`, whose holder on the block is hd) in tier t. */
static inline uint32_t mref(const kvp_index *idx, uint32_t code, const mslot_t *m,
                            const holder_t *hd, int t) {
    if (m_side(m)) return ot_find(idx, code, m->eh)->refs[t];
    uint32_t c = hd->count[t];
    if ((hd->nmaps & NMAPS_MASK) > 1) c -= ot_find(idx, code | OT_SUM, m_rec(m))->refs[t];
    return c;
}
static inline int mref_any(const kvp_index *idx, uint32_t code, const mslot_t *m,
                           const holder_t *hd) {
    for (int t = 0; t < KVP_N_TIERS; t++)
        if (mref(idx, code, m, hd, t)) return 1;
    return 0;
}
/* The holder's count changes with the mapping's; an M_SIDE mapping's entry and its block sum
 * follow it. Incrementing cannot fail (entries exist); the caller updates hd->count. */
static inline void mref_inc(kvp_index *idx, uint32_t code, const mslot_t *m, int t) {
    if (!m_side(m)) return;
    ot_find(idx, code, m->eh)->refs[t]++;
    ot_find(idx, code | OT_SUM, m_rec(m))->refs[t]++;
}
static inline void mref_dec(kvp_index *idx, uint32_t code, const mslot_t *m, int t) {
    if (!m_side(m)) return;
    ot_find(idx, code, m->eh)->refs[t]--;
    oslot_t *s = ot_find(idx, code | OT_SUM, m_rec(m));
    s->refs[t]--;
    if ((s->refs[0] | s->refs[1] | s->refs[2]) == 0) ot_delete(idx, code | OT_SUM, m_rec(m));
}

static inline uint32_t mref_of(const kvp_index *idx, kvp_endpoint_t ep, const mslot_t *m, int t) {
    holder_t tmp;
    return mref(idx, ep_code(ep), m, find_holder(idx, &idx->pool[m_rec(m)], ep, &tmp, NULL), t);
}

/* Delete the mapping in slot i of em (its side entry too). */
static void mt_delete_at(kvp_index *idx, emap_t *em, uint32_t code, size_t i) {
    const size_t cap = em->cap;
    if (m_side(&em->t[i])) ot_delete(idx, code, em->t[i].eh);
    size_t j = i;
    for (;;) {
        if (++j == cap) j = 0;
        if (em->t[j].rec == NONE32) break;
        size_t home = mslot_of(em->t[j].eh, cap);
        int stays = (i <= j) ? (i < home && home <= j) : (i < home || home <= j);
        if (stays) continue;
        em->t[i] = em->t[j];
        i = j;
    }
    em->t[i].eh = 0;
    em->t[i].rec = NONE32;
    em->count--;
    idx->mt_count--;
}
/* ---- records and LRU ---------------------------------------------------------------------- */
/* The record pool and its side arrays grow often and only grow. On Linux, an array that must
 * grow past KVP_BIG_BYTES moves to its own anonymous mapping, which mremap then enlarges without
 * copying, so the pool can grow in 1/32 steps (little reserved-but-unused capacity) at no cost.
 * First allocations (e.g. reserve()) and small arrays use malloc/realloc. *bytes is the array's
 * allocated size and *mapped whether it is such a mapping; both change only on success. */
static int arr_grow(void **p, size_t *bytes, unsigned char *mapped, size_t new_bytes) {
    if (new_bytes <= *bytes) return 1; /* grown before a sibling array's failure */
#ifdef KVP_HAVE_MREMAP
    if (*mapped || (*p != NULL && new_bytes >= KVP_BIG_BYTES)) {
        void *q;
        if (*mapped) {
            q = mremap(*p, *bytes, new_bytes, MREMAP_MAYMOVE);
#ifdef MADV_HUGEPAGE /* the range may have moved or grown (random probes: fewer TLB misses) */
            if (q != MAP_FAILED) (void)madvise(q, new_bytes, MADV_HUGEPAGE);
#endif
        } else {
            q = mmap(NULL, new_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
            if (q != MAP_FAILED) {
#ifdef MADV_HUGEPAGE /* before the copy faults the pages in */
                (void)madvise(q, new_bytes, MADV_HUGEPAGE);
#endif
                memcpy(q, *p, *bytes);
                free(*p);
            }
        }
        if (q == MAP_FAILED) return 0;
        *p = q;
        *bytes = new_bytes;
        *mapped = 1;
        return 1;
    }
#endif
    void *q = realloc(*p, new_bytes);
    if (q == NULL) return 0;
    *p = q;
    *bytes = new_bytes;
    return 1;
}

static void arr_free(void *p, size_t bytes, unsigned char mapped) {
#ifdef KVP_HAVE_MREMAP
    if (mapped) {
        munmap(p, bytes);
        return;
    }
#endif
    (void)bytes;
    (void)mapped;
    free(p);
}

static kvp_status pool_reserve(kvp_index *idx, size_t extra) {
    size_t need = (size_t)idx->pool_len + extra;
    if (need <= idx->pool_cap) return KVP_OK;
    if (need >= POOL_MAX_RECORDS) return KVP_E_NOMEM;
    size_t cap = idx->pool_cap ? idx->pool_cap : 64;
    while (cap < need)
        cap += cap / (cap * sizeof(block_t) >= KVP_BIG_BYTES ? POOL_GROW_DEN_BIG : POOL_GROW_DEN);
    if (cap >= POOL_MAX_RECORDS) cap = POOL_MAX_RECORDS - 1;
    /* pool_cap changes only once every array has grown; a failure leaves larger arrays unused */
    if (!arr_grow((void **)&idx->pool, &idx->pool_bytes, &idx->pool_mapped,
                  cap * sizeof(block_t)) ||
        !arr_grow((void **)&idx->rec_ceh, &idx->rec_ceh_bytes, &idx->rec_ceh_mapped,
                  cap * sizeof(kvp_engine_hash_t)))
        return KVP_E_NOMEM;
    const size_t own_had = idx->cm_own_bytes; /* new bits must read "owns nothing" */
    if (!arr_grow((void **)&idx->cm_own, &idx->cm_own_bytes, &idx->cm_own_mapped,
                  (cap + 63) / 64 * sizeof(uint64_t)))
        return KVP_E_NOMEM;
    if (idx->cm_own_bytes > own_had)
        memset((unsigned char *)idx->cm_own + own_had, 0, idx->cm_own_bytes - own_had);
    if (idx->max_entries) {
        if (!arr_grow((void **)&idx->lru_prev, &idx->lru_prev_bytes, &idx->lru_prev_mapped,
                      cap * sizeof(uint32_t)) ||
            !arr_grow((void **)&idx->lru_next, &idx->lru_next_bytes, &idx->lru_next_mapped,
                      cap * sizeof(uint32_t)) ||
            !arr_grow((void **)&idx->rec_eh, &idx->rec_eh_bytes, &idx->rec_eh_mapped,
                      cap * sizeof(kvp_engine_hash_t)))
            return KVP_E_NOMEM;
    }
    idx->pool_cap = (uint32_t)cap;
    return KVP_OK;
}

static uint32_t pool_take(kvp_index *idx) {
    uint32_t r;
    if (idx->free_head != NONE32) {
        r = idx->free_head;
        idx->free_head = (uint32_t)idx->pool[r].hash;
    } else {
        r = idx->pool_len++;
    }
    block_t *b = &idx->pool[r];
    memset(b, 0, sizeof(*b));
    b->ep = EP_NONE;
    idx->rec_ceh[r] = 0; /* owns nothing (cm_own), but cm_reserve reads every record's */
    if (idx->max_entries) idx->lru_prev[r] = idx->lru_next[r] = NONE32;
    return r;
}

/* A new record for block h, entered in the block table at b_empty (the empty slot h's probe
 * found: nothing may have moved since). */
static inline uint32_t record_new(kvp_index *idx, kvp_hash_t h, size_t b_empty) {
    const uint32_t r = pool_take(idx);
    idx->pool[r].hash = h;
    slot_set(idx->bt.s, b_empty, r, btag_of(bmix_of(h)));
    idx->bt.count++;
    return r;
}

static void pool_give(kvp_index *idx, uint32_t r) {
    block_t *b = &idx->pool[r];
    if (is_ext(b)) {
        ext_t *e = ext_of(idx, b);
        idx->ext_bytes -= ext_size(e->cap, idx->max_entries != 0, (int)e->wide);
        free(e);
        idx->ext_tab[b->packed] = NULL;
        idx->ext_free[idx->ext_nfree++] = b->packed;
    }
    memset(b, 0, sizeof(*b));
    b->ep = EP_NONE; /* no holders: clear() may still meet mappings to a freed record */
    b->hash = idx->free_head;
    idx->free_head = r;
}

static void lru_unlink(kvp_index *idx, uint32_t r) {
    uint32_t *prev = idx->lru_prev, *next = idx->lru_next;
    if (prev[r] != NONE32) next[prev[r]] = next[r];
    else if (idx->lru_head == r) idx->lru_head = next[r];
    if (next[r] != NONE32) prev[next[r]] = prev[r];
    else if (idx->lru_tail == r) idx->lru_tail = prev[r];
    prev[r] = next[r] = NONE32;
}

static void lru_append(kvp_index *idx, uint32_t r) {
    idx->lru_prev[r] = idx->lru_tail;
    idx->lru_next[r] = NONE32;
    if (idx->lru_tail != NONE32) idx->lru_next[idx->lru_tail] = r;
    else idx->lru_head = r;
    idx->lru_tail = r;
}

/* Recency only matters when the index is bounded; unbounded indexes skip the bookkeeping. */
static inline void touch(kvp_index *idx, uint32_t r) {
    if (idx->max_entries == 0 || idx->lru_tail == r) return;
    lru_unlink(idx, r);
    lru_append(idx, r);
}

static void delete_block(kvp_index *idx, uint32_t r) {
    if (cm_owns(idx, r)) cm_delete(idx, r);
    bt_delete(idx, r);
    if (idx->max_entries) lru_unlink(idx, r);
    pool_give(idx, r);
}

/* delete_block leaving the record's slots in the block table and the canonical map, for a
 * caller that refills both from the pool afterwards (refill_tables): a bulk deletion's
 * backward shifts each read the records of a cluster, a refill reads the pool once in order. */
static void delete_block_unslotted(kvp_index *idx, uint32_t r) {
    if (cm_owns(idx, r)) {
        idx->cm_own[r >> 6] &= ~((uint64_t)1 << (r & 63));
        idx->cm.count--;
    }
    idx->bt.count--;
    if (idx->max_entries) lru_unlink(idx, r);
    pool_give(idx, r);
}

static void refill_tables(kvp_index *idx) {
    bt_refill(idx, idx->bt.cap);
    cm_refill(idx, idx->cm.cap);
}

static uint32_t clock_next(kvp_index *idx) {
    if (++idx->hclock == 0) { /* wrapped: no cached equality may survive */
        for (uint32_t id = 0; id < idx->ext_len; id++)
            if (idx->ext_tab[id]) idx->ext_tab[id]->eq_prev = NONE32;
        idx->hclock = 1;
    }
    return idx->hclock;
}

/* Any change to a block's holders or their counts invalidates equality cached with it. */
static inline void holders_changed(kvp_index *idx, block_t *b) {
    if (is_ext(b)) {
        ext_t *e = ext_of(idx, b);
        e->hver = clock_next(idx);
        e->eq_prev = NONE32;
    }
}

/* Room for one more ext id (before any state changes). */
static kvp_status ext_id_reserve(kvp_index *idx) {
    if (idx->ext_nfree > 0 || idx->ext_len < idx->ext_cap) return KVP_OK;
    if (idx->ext_cap >= (NONE32 >> 2)) return KVP_E_NOMEM;
    uint32_t cap = idx->ext_cap ? idx->ext_cap * 2 : 16;
    ext_t **t = (ext_t **)realloc(idx->ext_tab, cap * sizeof(ext_t *));
    if (!t) return KVP_E_NOMEM;
    idx->ext_tab = t;
    uint32_t *f = (uint32_t *)realloc(idx->ext_free, cap * sizeof(uint32_t));
    if (!f) return KVP_E_NOMEM; /* ext_tab grew, ext_cap did not: consistent */
    idx->ext_free = f;
    idx->ext_cap = cap;
    return KVP_OK;
}

/* Move record r's inline holder (it has one) into a new ext_t: compact before a second holder
 * joins, wide before a count or the mapping count outgrows the inline fields. Nothing changes
 * on failure. */
static kvp_status to_ext(kvp_index *idx, uint32_t r, int wide) {
    block_t *b = &idx->pool[r];
    const int bounded = idx->max_entries != 0;
    if (ext_id_reserve(idx) != KVP_OK) return KVP_E_NOMEM;
    ext_t *ext = (ext_t *)malloc(ext_size(EXT_MIN_CAP, bounded, wide));
    if (!ext) return KVP_E_NOMEM;
    ext->cap = EXT_MIN_CAP;
    ext->n = 1;
    ext->wide = (uint32_t)wide;
    if (wide) {
        unpack_holder(b, &ext_wide(ext)[0]);
    } else {
        ext_compact(ext)[0].ep = b->ep;
        ext_compact(ext)[0].packed = b->packed;
    }
    if (bounded) ext_eh(ext)[0] = idx->rec_eh[r];
    ext->eq_prev = NONE32;
    ext->eq_prev_ver = 0;
    ext->hver = clock_next(idx);
    const uint32_t id = idx->ext_nfree > 0 ? idx->ext_free[--idx->ext_nfree] : idx->ext_len++;
    idx->ext_tab[id] = ext;
    b->ep = EP_EXT;
    b->packed = id;
    idx->ext_bytes += ext_size(EXT_MIN_CAP, bounded, wide);
    return KVP_OK;
}

/* Give record r's holders full counts (before one outgrows the compact format): an inline
 * holder moves to a wide ext_t, a compact array is rewritten wide. Nothing changes on
 * failure. */
static kvp_status widen(kvp_index *idx, uint32_t r) {
    block_t *b = &idx->pool[r];
    if (!is_ext(b)) return to_ext(idx, r, 1);
    ext_t *old = ext_of(idx, b);
    if (old->wide) return KVP_OK;
    const int bounded = idx->max_entries != 0;
    ext_t *e = (ext_t *)malloc(ext_size(old->cap, bounded, 1));
    if (!e) return KVP_E_NOMEM;
    memcpy(e, old, sizeof(ext_t));
    e->wide = 1;
    for (uint32_t k = 0; k < old->n; k++)
        unpack_fields(ext_compact(old)[k].ep, ext_compact(old)[k].packed, &ext_wide(e)[k]);
    if (bounded) memcpy(ext_eh(e), ext_eh(old), (size_t)old->n * sizeof(kvp_engine_hash_t));
    idx->ext_bytes += ext_size(old->cap, bounded, 1) - ext_size(old->cap, bounded, 0);
    idx->ext_tab[b->packed] = e;
    free(old);
    return KVP_OK;
}

/* A holder array's next capacity, kept even (the eh array after it stays aligned): doubling
 * while small (most shared blocks have a few holders), then a quarter more, so a popular
 * block's array (hundreds of holders at 512 endpoints) is at most ~20 % unused instead of up
 * to half; the extra reallocs did not measurably slow apply (docs/core.md). */
static inline uint32_t ext_grown_cap(uint32_t cap) {
    if (cap < 16) return cap * 2;
    return (cap + cap / 4 + 1) & ~1u;
}

/* Open position k of e's holders (room made by holder_room): holders k.. and, bounded, their
 * engine hashes move up one; n grows by one. */
static inline void ext_open_at(ext_t *e, uint32_t k, int bounded) {
    const uint32_t n = e->n;
    const size_t stride = ext_stride(e);
    if (k < n) {
        memmove(e->w + (k + 1) * stride, e->w + k * stride, (n - k) * stride * 4);
        if (bounded) {
            kvp_engine_hash_t *ehs = ext_eh(e);
            memmove(&ehs[k + 1], &ehs[k], (size_t)(n - k) * sizeof(*ehs));
        }
    }
    e->n++;
}

/* Make room for one more holder on record r (before any state changes). */
static kvp_status holder_room(kvp_index *idx, uint32_t r) {
    block_t *b = &idx->pool[r];
    const int bounded = idx->max_entries != 0;
    if (nh_of(idx, b) == 0) return KVP_OK;
    if (!is_ext(b)) {
        kvp_status st = to_ext(idx, r, 0);
        if (st != KVP_OK) return st;
    }
    ext_t *ext = ext_of(idx, b);
    const uint32_t old = ext->cap;
    if (ext->n < old) return KVP_OK;
    if (old >= (NONE32 >> 5)) return KVP_E_NOMEM;
    const uint32_t cap = ext_grown_cap(old);
    const int wide = (int)ext->wide;
    ext = (ext_t *)realloc(ext, ext_size(cap, bounded, wide));
    if (!ext) return KVP_E_NOMEM;
    if (bounded) { /* the engine hashes follow the holders: move them past the new holder slots */
        const size_t stride = ext_stride(ext);
        memmove(ext->w + (size_t)cap * stride, ext->w + (size_t)old * stride,
                old * sizeof(kvp_engine_hash_t));
    }
    ext->cap = cap;
    idx->ext_bytes += ext_size(cap, bounded, wide) - ext_size(old, bounded, wide);
    idx->ext_tab[b->packed] = ext;
    return KVP_OK;
}

/* Remove holder k of record r. */
static void remove_holder_at(kvp_index *idx, uint32_t r, uint32_t k) {
    block_t *b = &idx->pool[r];
    if (!is_ext(b)) {
        b->ep = EP_NONE;
        b->packed = 0;
        return;
    }
    ext_t *e = ext_of(idx, b);
    size_t tail = (size_t)e->n - 1 - k;
    if (tail) {
        const size_t stride = ext_stride(e);
        memmove(e->w + k * stride, e->w + (k + 1) * stride, tail * stride * 4);
        if (idx->max_entries) {
            kvp_engine_hash_t *eh = ext_eh(e);
            memmove(&eh[k], &eh[k + 1], tail * sizeof(kvp_engine_hash_t));
        }
    }
    e->n--;
    holders_changed(idx, b);
}

static kvp_status grow_ep_scratch(kvp_index *idx, kvp_endpoint_t ep) {
    if (ep == KVP_SHARED) return KVP_OK;
    if ((size_t)ep < idx->ep_cap) return KVP_OK;
    size_t cap = idx->ep_cap ? idx->ep_cap : 64;
    while (cap <= (size_t)ep) cap *= 2;
    uint32_t *g = (uint32_t *)realloc(idx->ep_gen, cap * sizeof(uint32_t));
    if (!g) return KVP_E_NOMEM;
    idx->ep_gen = g;
    uint32_t *p = (uint32_t *)realloc(idx->ep_pos, cap * sizeof(uint32_t));
    if (!p) return KVP_E_NOMEM;
    idx->ep_pos = p;
    uint32_t *a = (uint32_t *)realloc(idx->act_ep, cap * sizeof(uint32_t));
    if (!a) return KVP_E_NOMEM;
    idx->act_ep = a;
    uint8_t *ab = (uint8_t *)realloc(idx->act_best, cap);
    if (!ab) return KVP_E_NOMEM;
    idx->act_best = ab;
    emap_t *em = (emap_t *)realloc(idx->em, cap * sizeof(emap_t));
    if (!em) return KVP_E_NOMEM;
    idx->em = em;
    memset(em + idx->em_cap, 0, (cap - idx->em_cap) * sizeof(emap_t));
    idx->em_cap = cap;
    memset(g + idx->ep_cap, 0, (cap - idx->ep_cap) * sizeof(uint32_t));
    memset(p + idx->ep_cap, 0, (cap - idx->ep_cap) * sizeof(uint32_t));
    idx->ep_cap = cap;
    return KVP_OK;
}

/* ---- core ops (mirror _reference.Index._add_ref / _drop_ref) ------------------------------- */
/* Capacity for one new block, record and canonical-map entry must have been reserved by the
 * caller; ep's own map grows here when a mapping goes there (rarely: see cm). */
static kvp_status add_ref(kvp_index *idx, kvp_endpoint_t ep, kvp_engine_hash_t eh, kvp_hash_t h,
                          int tier) {
    size_t m_empty = 0, b_empty = 0, c_empty = 0;
    emap_t *em = emap_of(idx, ep);
    const uint32_t code = ep_code(ep);
    mapping_t mp;
    uint32_t rc; /* the record owning eh in the canonical map */
    uint32_t r;
    holder_t tmp, *hd;
    uint32_t hk = 0; /* hd's position among the block's holders */
    int dup = 0;
    if (map_lookup(idx, ep, eh, &mp, &m_empty, &rc, &c_empty)) {
        r = m_rec(&mp.v);
        if (idx->pool[r].hash != h) {
            idx->c.conflicting_stores++;
            return KVP_OK;
        }
        hd = find_holder(idx, &idx->pool[r], ep, &tmp, &hk);
        if (hd->count[tier] == COUNT_MAX) return KVP_E_OVERFLOW;
        if (hd == &tmp && !compact_after(hd, tier, 0)) { /* before any change */
            kvp_status st = widen(idx, r);
            if (st != KVP_OK) return st;
            hd = find_holder(idx, &idx->pool[r], ep, &tmp, &hk);
        }
        dup = mref(idx, code, &mp.v, hd, tier) > 0;
    } else {
        /* the block: the canonical map's record when it is this block (one probe for a block
         * other engines hold under the same engine hash), else the block table's */
        r = (rc != NONE32 && idx->pool[rc].hash == h) ? rc : bt_probe(idx, h, &b_empty);
        holder_t *old = r != NONE32 ? find_holder(idx, &idx->pool[r], ep, &tmp, &hk) : NULL;
        /* canonical: ep's first mapping to the block, under the engine hash the block owns or,
         * for a new block, will own (no block owns it yet) */
        const int canon = old == NULL && (r == NONE32 ? rc == NONE32 : r == rc);
        kvp_status st;
        if (old) { /* refuse an overflowing store, make room, before any change */
            if (old->count[tier] == COUNT_MAX || (old->nmaps & NMAPS_MASK) == NMAPS_MASK)
                return KVP_E_OVERFLOW;
            if ((st = ot_reserve(idx, 2)) != KVP_OK) return st;
            if (old == &tmp && !compact_after(old, tier, 1)) {
                if ((st = widen(idx, r)) != KVP_OK) return st;
                old = find_holder(idx, &idx->pool[r], ep, &tmp, &hk);
            }
        }
        if (!canon) {
            const uint32_t had = em->cap;
            if ((st = mt_reserve(idx, ep, 1)) != KVP_OK) return st;
            if (em->cap != had) mt_probe(em, eh, &m_empty);
        }
        if (r == NONE32) {
            r = record_new(idx, h, b_empty);           /* the probe's empty slot: nothing moved */
            if (canon) cm_insert(idx, r, eh, c_empty); /* likewise */
            if (idx->max_entries) lru_append(idx, r);
        }
        block_t *b = &idx->pool[r];
        hd = old;
        uint32_t side = 0;
        if (hd == NULL) {
            uint32_t k = 0;
            if (nh_of(idx, b) == 0) { /* the only holder: inline */
                hd = &tmp;
            } else {
                st = holder_room(idx, r);
                if (st != KVP_OK) return st;
                ext_t *e = ext_of(idx, b);
                k = holder_lower_bound(e->w, ext_stride(e), e->n, ep, idx->ep_limit);
                ext_open_at(e, k, idx->max_entries != 0);
                hd = e->wide ? &ext_wide(e)[k] : &tmp; /* a new holder fits the compact form */
            }
            hk = k;
            memset(hd, 0, sizeof(*hd));
            hd->ep = ep;
            if (idx->max_entries) {
                *eh_first_of(idx, r, k) = eh;
                hd->nmaps = HOLDER_EH_VALID;
            }
            idx->n_holdings++;
            if (ep != KVP_SHARED && ep + 1 > idx->ep_limit) idx->ep_limit = ep + 1;
        } else { /* ep already maps another engine hash here: this one's refs go to the side */
            side = M_SIDE;
            ot_put(idx->ot, idx->ot_cap, code, eh);
            idx->ot_count++;
            if (ot_find(idx, code | OT_SUM, r) == NULL) {
                ot_put(idx->ot, idx->ot_cap, code | OT_SUM, r);
                idx->ot_count++;
            }
        }
        hd->nmaps++;
        if (canon) {
            hd->nmaps |= HOLDER_CANON;
            em->ncanon++;
            mp.slot = NULL;
        } else {
            mp.slot = &em->t[m_empty]; /* the probe's empty slot: the map is untouched since */
            mp.slot->eh = eh;
            mp.slot->rec = r | side;
            em->count++;
        }
        mp.v.eh = eh;
        mp.v.rec = r | side;
        idx->mt_count++;
    }
    if (dup) idx->c.duplicate_stores++;
    mref_inc(idx, code, &mp.v, tier);
    hd->count[tier]++;
    holder_sync(idx, r, hk, hd, &tmp);
    holders_changed(idx, &idx->pool[r]);
    idx->c.stored_blocks++;
    touch(idx, r);
    return KVP_OK;
}

/* Drop one ref of ep's mapping mp in tier t, which it must hold. */
static void drop_ref(kvp_index *idx, kvp_endpoint_t ep, const mapping_t *mp, int tier) {
    emap_t *em = emap_of(idx, ep);
    const uint32_t code = ep_code(ep);
    const mslot_t *m = &mp->v;
    uint32_t r = m_rec(m);
    block_t *b = &idx->pool[r];
    holder_t tmp;
    uint32_t k;
    holder_t *hd = find_holder(idx, b, ep, &tmp, &k);
    mref_dec(idx, code, m, tier);
    hd->count[tier]--;
    int mapping_gone = !mref_any(idx, code, m, hd);
    int holder_gone = (hd->count[0] | hd->count[1] | hd->count[2]) == 0;
    if (mapping_gone) {
        if (!holder_gone) {
            hd->nmaps--;
            if (idx->max_entries && *eh_first_of(idx, r, k) == m->eh)
                hd->nmaps &= (uint16_t)~HOLDER_EH_VALID;
            if (mp->slot == NULL) hd->nmaps &= (uint16_t)~HOLDER_CANON;
        }
        if (mp->slot != NULL) {
            mt_delete_at(idx, em, code, (size_t)(mp->slot - em->t));
        } else {
            em->ncanon--;
            idx->mt_count--;
        }
    }
    if (holder_gone) {
        remove_holder_at(idx, r, k);
        idx->n_holdings--;
        if (nh_of(idx, b) == 0) delete_block(idx, r);
    } else {
        holder_sync(idx, r, k, hd, &tmp);
        holders_changed(idx, b);
    }
}

/* Delete every mapping of ep to record r, scanning ep's table; deletion shifts entries back
 * into the current slot, so re-check it. */
static void scan_delete_mappings(kvp_index *idx, uint32_t r, kvp_endpoint_t ep) {
    emap_t *em = emap_of(idx, ep);
    if (em == NULL) return;
    const uint32_t code = ep_code(ep);
    size_t i = 0;
    while (i < em->cap) {
        mslot_t *s = &em->t[i];
        if (s->rec != NONE32 && m_rec(s) == r) mt_delete_at(idx, em, code, i);
        else i++;
    }
}

static void evict_block(kvp_index *idx, uint32_t r) {
    block_t *b = &idx->pool[r];
    const hview_t hv = hview_of(idx, b); /* the loop changes mappings only, not holders */
    const uint32_t n = hv.n;
    for (uint32_t k = 0; k < n; k++) {
        holder_t hk;
        hv_get(hv, k, &hk);
        const kvp_endpoint_t ep = hk.ep;
        const int canon = (hk.nmaps & HOLDER_CANON) != 0;
        if (canon) { /* the canonical mapping goes with the holder */
            emap_of(idx, ep)->ncanon--;
            idx->mt_count--;
        }
        if (canon && (hk.nmaps & NMAPS_MASK) == 1) {
            /* its only mapping: nothing in ep's own map */
        } else if (!canon && (hk.nmaps & NMAPS_MASK) == 1 && (hk.nmaps & HOLDER_EH_VALID)) {
            emap_t *em = emap_of(idx, ep);
            size_t empty;
            mslot_t *m = mt_probe(em, *eh_first_of(idx, r, k), &empty);
            if (m) mt_delete_at(idx, em, ep_code(ep), (size_t)(m - em->t));
        } else {
            scan_delete_mappings(idx, r, ep);
        }
        ot_delete(idx, ep_code(ep) | OT_SUM, r);
    }
    idx->n_holdings -= n;
    idx->c.evicted_blocks++;
    idx->c.evicted_entries += n;
    delete_block(idx, r);
}

static void evict_over_bound(kvp_index *idx) {
    if (idx->max_entries == 0) return;
    while (idx->n_holdings > idx->max_entries && idx->lru_head != NONE32) evict_block(idx, idx->lru_head);
}

/* ---- public API --------------------------------------------------------------------------- */
kvp_status kvp_index_new(uint64_t max_entries, kvp_index **out) {
    if (out == NULL) return KVP_E_NULL;
    *out = NULL;
    kvp_index *idx = (kvp_index *)calloc(1, sizeof(kvp_index));
    if (!idx) return KVP_E_NOMEM;
    idx->max_entries = max_entries;
    idx->bt.cap = MIN_CAP;
    idx->free_head = NONE32;
    idx->lru_head = idx->lru_tail = NONE32;
    idx->gen = 0;
    if (bt_alloc(MIN_CAP, &idx->bt.s) != KVP_OK) {
        kvp_index_free(idx);
        return KVP_E_NOMEM;
    }
    idx->bt.bytes = slot_table_bytes(MIN_CAP);
    idx->cm.cap = MIN_CAP;
    if (bt_alloc(MIN_CAP, &idx->cm.s) != KVP_OK) {
        kvp_index_free(idx);
        return KVP_E_NOMEM;
    }
    idx->cm.bytes = slot_table_bytes(MIN_CAP);
    *out = idx;
    return KVP_OK;
}

void kvp_index_free(kvp_index *idx) {
    if (idx == NULL) return;
    for (uint32_t id = 0; id < idx->ext_len; id++) free(idx->ext_tab[id]); /* NULL when free */
    free(idx->ext_tab);
    free(idx->ext_free);
    arr_free(idx->pool, idx->pool_bytes, idx->pool_mapped);
    arr_free(idx->lru_prev, idx->lru_prev_bytes, idx->lru_prev_mapped);
    arr_free(idx->lru_next, idx->lru_next_bytes, idx->lru_next_mapped);
    arr_free(idx->rec_eh, idx->rec_eh_bytes, idx->rec_eh_mapped);
    arr_free(idx->bt.s, idx->bt.bytes, idx->bt.mapped);
    arr_free(idx->cm.s, idx->cm.bytes, idx->cm.mapped);
    arr_free(idx->rec_ceh, idx->rec_ceh_bytes, idx->rec_ceh_mapped);
    arr_free(idx->cm_own, idx->cm_own_bytes, idx->cm_own_mapped);
    for (size_t e = 0; e < idx->em_cap; e++) free(idx->em[e].t);
    free(idx->em);
    free(idx->em_shared.t);
    free(idx->ot);
    free(idx->ep_gen);
    free(idx->ep_pos);
    free(idx->act_ep);
    free(idx->act_best);
    free(idx->run);
    free(idx->seq);
    free(idx);
}

size_t kvp_index_endpoint_limit(const kvp_index *idx) { return idx ? idx->ep_limit : 0; }

static kvp_status reserve_for_store(kvp_index *idx, kvp_endpoint_t ep, size_t n) {
    kvp_status st;
    if ((st = grow_ep_scratch(idx, ep)) != KVP_OK) return st;
    if ((st = bt_reserve(idx, n)) != KVP_OK) return st;
    if ((st = cm_reserve(idx, n)) != KVP_OK) return st;
    return pool_reserve(idx, n); /* ep's own map grows in add_ref, if a mapping goes there */
}

enum { STORE_AHEAD = 12 }; /* blocks to prefetch ahead: covers DRAM latency at ~20 ns/block */

/* The lines a store of (eh, h) will probe: the canonical map's and the block table's home slots
 * (two lines each: an insert usually probes past its home line at these loads), and ep's own
 * map's when it has mappings (rarely: engines that disagree). A macro, not a function: GCC
 * deems a function of prefetches alone free of side effects and deletes its calls. */
#define PREFETCH_STORE(idx, em, eh, h)                                                  \
    do {                                                                                \
        const char *b_ = (const char *)slot_at((idx)->bt.s, bslot_of((h), (idx)->bt.cap)); \
        const char *c_ =                                                                \
            (const char *)slot_at((idx)->cm.s, bhome_of(cmix_of(eh), (idx)->cm.cap));   \
        __builtin_prefetch(b_);                                                         \
        __builtin_prefetch(b_ + 64);                                                    \
        __builtin_prefetch(c_);                                                         \
        __builtin_prefetch(c_ + 64);                                                    \
        if ((em)->count) {                                                              \
            const char *m_ = (const char *)&(em)->t[mslot_of((eh), (em)->cap)];          \
            __builtin_prefetch(m_);                                                     \
            __builtin_prefetch(m_ + 64);                                                \
        }                                                                               \
    } while (0)

/* The holder both fast paths create: one canonical mapping, one ref in `tier` (and, bounded,
 * its engine hash kept), and the counts a new canonical holding moves. */
static inline holder_t new_canon_holder(kvp_endpoint_t ep, int tier, int bounded) {
    holder_t hd;
    memset(&hd, 0, sizeof(hd));
    hd.ep = ep;
    hd.count[tier] = 1;
    hd.nmaps = 1u | HOLDER_CANON | (bounded ? HOLDER_EH_VALID : 0u);
    return hd;
}
/* pack_fields(new_canon_holder(ep, tier, bounded)), spelled out: tier is only known at run
 * time, and the general packing costs a new block ~10 instructions more (callgrind) */
static inline uint32_t packed_new_canon(int tier, int bounded) {
    return (1u << (8 * tier)) | (1u | IN_CANON | (bounded ? IN_EH_VALID : 0u)) << 24;
}
static inline void count_new_canon_holding(kvp_index *idx, emap_t *em, kvp_endpoint_t ep) {
    idx->n_holdings++;
    if (ep != KVP_SHARED && ep + 1 > idx->ep_limit) idx->ep_limit = ep + 1;
    em->ncanon++;
    idx->mt_count++;
    idx->c.stored_blocks++;
}

/* add_ref's two commonest cases on their own, for an endpoint whose own map is empty (its
 * engine agrees with the others on engine hashes), with exactly the state add_ref leaves:
 * - a block no record has, under an engine hash no record owns: a new record, which owns eh,
 *   with ep as its inline holder (one canonical mapping, one ref in `tier`);
 * - the block of the record owning eh, whose holders are in an ext_t (other endpoints hold or
 *   held it) and do not include ep: ep joins its sorted holders with one canonical mapping and
 *   one ref, its place found by one bisection (add_ref's general path runs three: two lookups,
 *   then the insert's).
 * Between them most of a store's instructions by callgrind. Returns 0, having changed nothing,
 * for any other case, which the caller sends to add_ref. The pool, block table and canonical
 * map have room (reserve_for_store). */
static inline int store_new_holder(kvp_index *idx, emap_t *em, kvp_endpoint_t ep, int tier,
                                   kvp_engine_hash_t eh, kvp_hash_t h, uint32_t r) {
    block_t *b = &idx->pool[r];
    if (b->hash != h || !is_ext(b)) return 0;
    ext_t *e = ext_of(idx, b);
    const size_t stride = ext_stride(e);
    const uint32_t n = e->n;
    const uint32_t k = holder_lower_bound(e->w, stride, n, ep, idx->ep_limit);
    if (k < n && e->w[k * stride] == ep) return 0; /* ep holds it already */
    if (holder_room(idx, r) != KVP_OK) return 0;  /* nothing changed: add_ref reports it */
    e = ext_of(idx, b);                            /* holder_room may have moved it */
    const int bounded = idx->max_entries != 0;
    ext_open_at(e, k, bounded);
    if (e->wide) {
        ext_wide(e)[k] = new_canon_holder(ep, tier, bounded);
    } else {
        ext_compact(e)[k].ep = ep;
        ext_compact(e)[k].packed = packed_new_canon(tier, bounded);
    }
    if (bounded) ext_eh(e)[k] = eh;
    count_new_canon_holding(idx, em, ep);
    holders_changed(idx, b);
    touch(idx, r);
    return 1;
}

static inline int store_fast(kvp_index *idx, emap_t *em, kvp_endpoint_t ep, int tier,
                             kvp_engine_hash_t eh, kvp_hash_t h) {
    size_t c_empty, b_empty;
    if (em->count != 0) return 0;
    const uint32_t rc = cm_probe(idx, eh, &c_empty);
    if (rc != NONE32) return store_new_holder(idx, em, ep, tier, eh, h, rc);
    if (bt_probe(idx, h, &b_empty) != NONE32) return 0;
    const uint32_t r = record_new(idx, h, b_empty);
    block_t *b = &idx->pool[r];
    cm_insert(idx, r, eh, c_empty);
    const int bounded = idx->max_entries != 0;
    if (bounded) {
        lru_append(idx, r); /* newest: add_ref's touch() would leave it there */
        idx->rec_eh[r] = eh;
    }
    b->ep = ep; /* the only holder: inline */
    b->packed = packed_new_canon(tier, bounded);
    count_new_canon_holding(idx, em, ep);
    return 1;
}

static kvp_status store_unchecked(kvp_index *idx, kvp_endpoint_t ep, int tier,
                                  const kvp_engine_hash_t *ehs, const kvp_hash_t *hs, size_t n) {
    kvp_status st = KVP_OK;
    emap_t *em = emap_of(idx, ep); /* reserved: exists, and does not move during the loop */
    /* the first blocks too: a typical store event is only ~30 blocks long */
    for (size_t i = 0; i < n && i < STORE_AHEAD; i++) PREFETCH_STORE(idx, em, ehs[i], hs[i]);
    for (size_t i = 0; i < n; i++) {
        if (i + STORE_AHEAD < n) PREFETCH_STORE(idx, em, ehs[i + STORE_AHEAD], hs[i + STORE_AHEAD]);
        if (store_fast(idx, em, ep, tier, ehs[i], hs[i])) continue;
        st = add_ref(idx, ep, ehs[i], hs[i], tier);
        if (st != KVP_OK) break;
    }
    evict_over_bound(idx);
    return st;
}

kvp_status kvp_index_reserve_endpoint(kvp_index *idx, kvp_endpoint_t ep, size_t n_mappings) {
    if (idx == NULL) return KVP_E_NULL;
    if (!valid_ep(ep)) return KVP_E_ENDPOINT;
    kvp_status st = grow_ep_scratch(idx, ep);
    if (st != KVP_OK) return st;
    const emap_t *em = emap_of(idx, ep);
    return mt_reserve(idx, ep, n_mappings > em->count ? n_mappings - em->count : 0);
}

kvp_status kvp_index_reserve(kvp_index *idx, size_t n_blocks, size_t n_mappings) {
    if (idx == NULL) return KVP_E_NULL;
    kvp_status st;
    size_t nb = n_blocks > idx->bt.count ? n_blocks - idx->bt.count : 0;
    if ((st = bt_reserve(idx, nb)) != KVP_OK) return st;
    /* every block may own its canonical engine hash */
    if ((st = cm_reserve(idx, n_blocks > idx->cm.count ? n_blocks - idx->cm.count : 0)) != KVP_OK)
        return st;
    /* endpoints' own maps (mappings the canonical map does not cover) are per endpoint:
     * spread the mappings over the endpoints that have stored */
    if (idx->ep_limit > 0 && n_mappings > 0) {
        const size_t per = (n_mappings + idx->ep_limit - 1) / idx->ep_limit;
        for (kvp_endpoint_t e = 0; e < idx->ep_limit; e++)
            if ((st = kvp_index_reserve_endpoint(idx, e, per)) != KVP_OK) return st;
    }
    return pool_reserve(idx, n_blocks > idx->pool_len ? n_blocks - idx->pool_len : 0);
}

kvp_status kvp_index_store(kvp_index *idx, kvp_endpoint_t ep, int tier,
                           const kvp_engine_hash_t *engine_hashes, const kvp_hash_t *block_hashes,
                           size_t n) {
    if (idx == NULL) return KVP_E_NULL;
    if (!valid_ep(ep)) return KVP_E_ENDPOINT;
    if (!valid_tier(tier)) return KVP_E_TIER;
    if (n == 0) {
        evict_over_bound(idx);
        return KVP_OK;
    }
    if (engine_hashes == NULL || block_hashes == NULL) return KVP_E_NULL;
    kvp_status st = reserve_for_store(idx, ep, n);
    if (st != KVP_OK) return st;
    return store_unchecked(idx, ep, tier, engine_hashes, block_hashes, n);
}

kvp_status kvp_index_resolve(const kvp_index *idx, kvp_endpoint_t ep, kvp_engine_hash_t eh,
                             kvp_hash_t *out, int *found) {
    if (idx == NULL || out == NULL || found == NULL) return KVP_E_NULL;
    if (!valid_ep(ep)) return KVP_E_ENDPOINT;
    mapping_t mp;
    *found = map_find(idx, ep, eh, &mp);
    *out = *found ? idx->pool[m_rec(&mp.v)].hash : 0;
    return KVP_OK;
}

/* A store from the root (no parent) whose first blocks ep already holds in `tier` (the same
 * engine hash for the same block, idx->seq) re-announces them: vLLM with kv_cache_report_mode
 * "full" sends a request's cache hits as BlockStored again, yet one BlockRemoved per block when
 * it goes, so counting them again would leave blocks indexed after the engine dropped them.
 * Those leading blocks are touched (the engine just used them), not stored again. A copy that
 * an engine really holds twice then goes from the index at its first removal: a missed hit at
 * worst, never a phantom one. Returns how many leading blocks are held. */
static size_t held_prefix(kvp_index *idx, kvp_endpoint_t ep, int tier,
                          const kvp_engine_hash_t *ehs, size_t n) {
    size_t k = 0;
    for (; k < n; k++) {
        mapping_t mp;
        if (!map_find(idx, ep, ehs[k], &mp)) break;
        const uint32_t r = m_rec(&mp.v);
        if (idx->pool[r].hash != idx->seq[k] || mref_of(idx, ep, &mp.v, tier) == 0) break;
        touch(idx, r);
    }
    return k;
}

kvp_status kvp_index_store_tokens(kvp_index *idx, kvp_endpoint_t ep, int tier, int has_parent,
                                  kvp_engine_hash_t parent, const kvp_engine_hash_t *engine_hashes,
                                  size_t n_blocks, const void *tokens, kvp_dtype dt,
                                  size_t n_tokens, size_t block_size, uint64_t seed,
                                  const uint64_t *extra, size_t n_extra, int *stored,
                                  size_t *err_pos) {
    if (idx == NULL || stored == NULL) return KVP_E_NULL;
    *stored = 0;
    if (!valid_ep(ep)) return KVP_E_ENDPOINT;
    if (!valid_tier(tier)) return KVP_E_TIER;
    if (block_size == 0) return KVP_E_ARG;
    if (n_blocks != 0 && n_tokens / n_blocks != block_size) return KVP_E_ARG;
    if (n_tokens != n_blocks * block_size) return KVP_E_ARG;
    if (n_blocks > 0 && engine_hashes == NULL) return KVP_E_NULL;
    uint64_t root = seed;
    if (has_parent) {
        mapping_t mp;
        if (!map_find(idx, ep, parent, &mp)) {
            idx->c.orphan_stores++;
            return KVP_OK;
        }
        root = idx->pool[m_rec(&mp.v)].hash;
    }
    kvp_status st = kvp_check_tokens(tokens, dt, n_tokens, err_pos);
    if (st != KVP_OK) return st;
    if (extra != NULL && n_extra < n_blocks) return KVP_E_ARG;
    if (n_blocks > idx->seq_cap) {
        size_t cap = idx->seq_cap ? idx->seq_cap : 64;
        while (cap < n_blocks) cap *= 2;
        kvp_hash_t *s = (kvp_hash_t *)realloc(idx->seq, cap * sizeof(kvp_hash_t));
        if (!s) return KVP_E_NOMEM;
        idx->seq = s;
        idx->seq_cap = cap;
    }
    if ((st = reserve_for_store(idx, ep, n_blocks)) != KVP_OK) return st;
    if (n_blocks)
        kvp_hash_blocks_unchecked(tokens, dt, n_blocks, block_size, root, extra, NULL, idx->seq);
    const size_t held = has_parent ? 0 : held_prefix(idx, ep, tier, engine_hashes, n_blocks);
    idx->c.reannounced_blocks += held;
    st = store_unchecked(idx, ep, tier, engine_hashes + held, idx->seq + held, n_blocks - held);
    if (st == KVP_OK) *stored = 1;
    return st;
}

kvp_status kvp_index_store_tokens_batch(kvp_index *idx, size_t block_size,
                                        const kvp_store_tokens_req *reqs, size_t n,
                                        kvp_store_result *results, size_t *n_done,
                                        size_t *n_failed) {
    if (idx == NULL || n_done == NULL || n_failed == NULL) return KVP_E_NULL;
    *n_done = 0;
    *n_failed = 0;
    if (n > 0 && (reqs == NULL || results == NULL)) return KVP_E_NULL;
    for (size_t i = 0; i < n; i++) {
        const kvp_store_tokens_req *r = &reqs[i];
        kvp_store_result *out = &results[i];
        out->err_pos = 0;
        out->status = kvp_index_store_tokens(idx, r->ep, r->tier, r->has_parent, r->parent,
                                             r->engine_hashes, r->n_blocks, r->tokens, r->dt,
                                             r->n_tokens, block_size, r->seed, r->extra,
                                             r->n_extra, &out->stored, &out->err_pos);
        *n_done = i + 1;
        if (out->status != KVP_OK) {
            (*n_failed)++;
            if (out->status == KVP_E_NOMEM) return KVP_E_NOMEM;
        }
    }
    return KVP_OK;
}

kvp_status kvp_index_remove(kvp_index *idx, kvp_endpoint_t ep, int tier,
                            const kvp_engine_hash_t *engine_hashes, size_t n) {
    if (idx == NULL) return KVP_E_NULL;
    if (!valid_ep(ep)) return KVP_E_ENDPOINT;
    if (tier != KVP_TIER_ANY && !valid_tier(tier)) return KVP_E_TIER;
    if (n > 0 && engine_hashes == NULL) return KVP_E_NULL;
    for (size_t i = 0; i < n; i++) {
        kvp_engine_hash_t eh = engine_hashes[i];
        mapping_t mp;
        int found = map_find(idx, ep, eh, &mp);
        int any = 0;
        for (int t = 0; t < KVP_N_TIERS && found; t++)
            if (mref_of(idx, ep, &mp.v, t) > 0 && (tier == KVP_TIER_ANY || t == tier)) any = 1;
        if (!any) {
            idx->c.unknown_removes++;
            continue;
        }
        for (int t = 0; t < KVP_N_TIERS; t++) {
            if (!map_find(idx, ep, eh, &mp)) break; /* a drop may shift slots */
            if (mref_of(idx, ep, &mp.v, t) > 0 && (tier == KVP_TIER_ANY || t == tier))
                drop_ref(idx, ep, &mp, t);
        }
        idx->c.removed_blocks++;
    }
    return KVP_OK;
}

kvp_status kvp_index_move(kvp_index *idx, kvp_endpoint_t ep, int from_tier, int to_tier,
                          const kvp_engine_hash_t *engine_hashes, size_t n) {
    if (idx == NULL) return KVP_E_NULL;
    if (!valid_ep(ep)) return KVP_E_ENDPOINT;
    if (!valid_tier(from_tier) || !valid_tier(to_tier)) return KVP_E_TIER;
    if (n > 0 && engine_hashes == NULL) return KVP_E_NULL;
    kvp_status st = reserve_for_store(idx, ep, 1);
    if (st != KVP_OK) return st;
    for (size_t i = 0; i < n; i++) {
        mapping_t mp;
        if (!map_find(idx, ep, engine_hashes[i], &mp) || mref_of(idx, ep, &mp.v, from_tier) == 0) {
            idx->c.unknown_moves++;
            continue;
        }
        if (from_tier == to_tier) continue;
        const uint32_t r = m_rec(&mp.v);
        /* overflow would only strike add_ref after the drop; check first so a move is atomic */
        holder_t tmp;
        holder_t *hd = find_holder(idx, &idx->pool[r], ep, &tmp, NULL);
        if (hd->count[to_tier] == COUNT_MAX) return KVP_E_OVERFLOW;
        if (hd == &tmp && !compact_after(hd, to_tier, 0) && (st = widen(idx, r)) != KVP_OK)
            return st;
        /* the re-added mapping may need side entries (when it is dropped but the holder stays)
         * and, if it was canonical, a slot in ep's own map (as a side mapping) */
        if ((st = ot_reserve(idx, 2)) != KVP_OK) return st;
        if ((st = mt_reserve(idx, ep, 1)) != KVP_OK) return st;
        if (!map_find(idx, ep, engine_hashes[i], &mp)) return KVP_E_ARG; /* cannot happen */
        kvp_hash_t h = idx->pool[r].hash;
        drop_ref(idx, ep, &mp, from_tier);
        /* the drop freed at most one record/mapping/holder slot and the side entries and an own
         * map slot are reserved, so add_ref cannot need memory */
        st = add_ref(idx, ep, engine_hashes[i], h, to_tier);
        if (st != KVP_OK) return st;
        idx->c.stored_blocks--; /* a move is not a new store */
        idx->c.moved_blocks++;
    }
    return KVP_OK;
}

kvp_status kvp_index_clear(kvp_index *idx, kvp_endpoint_t ep) {
    if (idx == NULL) return KVP_E_NULL;
    if (!valid_ep(ep)) return KVP_E_ENDPOINT;
    emap_t *em = emap_of(idx, ep);
    const uint32_t code = ep_code(ep);
    /* Many blocks to drop (ep's holders, at most its mappings, a sixteenth of the blocks or
     * more): drop them unslotted and refill both tables once, O(records), instead of ~0.5 us
     * of backward shifts per block (random reads of the clusters' records). */
    const size_t held = em != NULL ? (size_t)em->ncanon + em->count : 0;
    const int bulk = held > 0 && held * 16 >= idx->bt.count;
    void (*drop_block)(kvp_index *, uint32_t) = bulk ? delete_block_unslotted : delete_block;
    if (em != NULL && em->ncanon > 0) {
        /* ep's canonical mappings are flags on its holders: walk the records (in order) until
         * every holder with one has gone; their other mappings, if any, go with the own map's */
        uint32_t left = em->ncanon;
        const uint32_t n = idx->pool_len;
        for (uint32_t r = 0; r < n && left > 0; r++) {
            block_t *b = &idx->pool[r];
            if (b->ep == EP_NONE) continue; /* free */
            holder_t tmp;
            uint32_t k;
            const holder_t *hd = find_holder(idx, b, ep, &tmp, &k);
            if (hd == NULL || !(hd->nmaps & HOLDER_CANON)) continue;
            left--;
            ot_delete(idx, code | OT_SUM, r);
            remove_holder_at(idx, r, k);
            idx->n_holdings--;
            if (nh_of(idx, b) == 0) drop_block(idx, r);
        }
        idx->mt_count -= em->ncanon;
        em->ncanon = 0;
    }
    if (em != NULL && em->t != NULL) {
        for (size_t i = 0; i < em->cap; i++) {
            const mslot_t *s = &em->t[i];
            if (s->rec == NONE32) continue;
            const uint32_t r = m_rec(s);
            if (m_side(s)) ot_delete(idx, code, s->eh);
            /* the first mapping met removes the holder; later ones to the block find none */
            block_t *b = &idx->pool[r];
            holder_t tmp;
            uint32_t k;
            if (find_holder(idx, b, ep, &tmp, &k) != NULL) {
                ot_delete(idx, code | OT_SUM, r);
                remove_holder_at(idx, r, k);
                idx->n_holdings--;
                if (nh_of(idx, b) == 0) drop_block(idx, r);
            }
        }
        idx->mt_count -= em->count;
        idx->mt_slots -= em->cap;
        free(em->t);
        em->t = NULL;
        em->cap = em->count = 0;
    }
    if (bulk) refill_tables(idx);
    idx->c.cleared_endpoints++;
    return KVP_OK;
}

/* Same endpoints (holder lists are sorted) with the same best tiers. Exact; a mismatch just
 * means a full check.
 * A positive answer between two multi-holder blocks is cached in b's header until either
 * block's holders change. */
static inline int same_holders(const kvp_index *idx, uint32_t ra, const block_t *a,
                               const block_t *b) {
    const uint32_t n = nh_of(idx, a);
    if (n != nh_of(idx, b)) return 0;
    const int both_ext = is_ext(a) && is_ext(b);
    if (!both_ext && !is_ext(a) && !is_ext(b)) /* one inline holder each (n == 1: n == 0 never walks here) */
        return a->ep == b->ep && inline_best_tier(a->packed) == inline_best_tier(b->packed);
    ext_t *ea = both_ext ? ext_of(idx, a) : NULL, *eb = both_ext ? ext_of(idx, b) : NULL;
    if (both_ext && eb->eq_prev == ra && eb->eq_prev_ver == ea->hver) return 1;
    const hview_t va = hview_of(idx, a), vb = hview_of(idx, b);
    for (uint32_t k = 0; k < n; k++)
        if (hv_ep(va, k) != hv_ep(vb, k) || hv_best(va, k) != hv_best(vb, k)) return 0;
    if (both_ext) {
        eb->eq_prev = ra;
        eb->eq_prev_ver = ea->hver;
    }
    return 1;
}

/* Credit `pending` repeated positions to every active endpoint. */
static inline void settle(const uint32_t *act, const uint8_t *act_best, size_t n_act,
                          size_t pending, uint32_t *ep_pos, int32_t **tier_out) {
    if (pending == 0) return;
    for (size_t k = 0; k < n_act; k++) {
        tier_out[act_best[k]][act[k]] += (int32_t)pending;
        ep_pos[act[k]] += (uint32_t)pending;
    }
}

/* A query's walk state between kvp_index_query_feed calls (the walk's locals, kept in the index
 * so a caller can read the hashes in pieces and stop reading once the walk ends). */
kvp_status kvp_index_query_begin(kvp_index *idx, size_t n, kvp_query_out *out) {
    if (idx == NULL || out == NULL) return KVP_E_NULL;
    if (n > (size_t)INT32_MAX - 1) return KVP_E_ARG;
    if (out->cap < idx->ep_limit) return KVP_E_BUFFER;
    if (out->cap > 0 && (!out->local || !out->device || !out->host || !out->disk ||
                         !out->shared_beyond || !out->touched))
        return KVP_E_NULL;
    if (out->n_touched > out->cap) return KVP_E_ARG;
    if (n + 1 > idx->run_cap) {
        size_t cap = idx->run_cap ? idx->run_cap : 256;
        while (cap < n + 1) cap *= 2;
        uint32_t *run = (uint32_t *)realloc(idx->run, cap * sizeof(uint32_t));
        if (!run) return KVP_E_NOMEM;
        idx->run = run;
        idx->run_cap = cap;
    }
    /* reset only what the previous query wrote */
    for (size_t k = 0; k < out->n_touched; k++) {
        uint32_t ep = out->touched[k];
        if (ep >= out->cap) continue;
        out->local[ep] = out->device[ep] = out->host[ep] = out->disk[ep] = 0;
        out->shared_beyond[ep] = out->shared_fill;
    }
    out->n_touched = 0;
    if (++idx->gen == 0) { /* generation wrapped: forget every stamp */
        if (idx->ep_cap) memset(idx->ep_gen, 0, idx->ep_cap * sizeof(uint32_t));
        idx->gen = 1;
    }
    idx->qs = (query_state_t){.n = n, .prev_r = NONE32, .open = 1};
    return KVP_OK;
}

kvp_status kvp_index_query_feed(kvp_index *idx, const kvp_hash_t *hs, size_t n_in,
                                kvp_query_out *out, int *more) {
    if (idx == NULL || out == NULL || more == NULL) return KVP_E_NULL;
    if (n_in > 0 && hs == NULL) return KVP_E_NULL;
    query_state_t *qs = &idx->qs;
    if (!qs->open) return KVP_E_ARG;
    if (n_in > qs->n - qs->walked) return KVP_E_ARG;
    if (qs->done) {
        *more = 0;
        return KVP_OK;
    }
    const uint32_t gen = idx->gen;
    uint32_t *ep_gen = idx->ep_gen, *ep_pos = idx->ep_pos;
    uint32_t *act = idx->act_ep;
    uint8_t *act_best = idx->act_best;
    int32_t *tier_out[KVP_N_TIERS] = {out->device, out->host, out->disk};
    uint32_t *run = idx->run;
    const size_t base = qs->walked; /* position of hs[0] in the query */
    size_t walked = base;
    size_t n_act = qs->n_act;     /* endpoints continuing after the last position */
    size_t pending = qs->pending; /* positions since the last full check whose holders repeat it */
    uint32_t prev_r = qs->prev_r;
    int prev_shared = qs->prev_shared;
    int done = 0;
    const size_t bcap = idx->bt.cap;
    enum { AHEAD = 8 };
    for (size_t j = 0; j < n_in && j < AHEAD; j++)
        __builtin_prefetch(slot_at(idx->bt.s, bslot_of(hs[j], bcap)));
    for (size_t j = 0; j < n_in; j++) {
        if (j + AHEAD < n_in) __builtin_prefetch(slot_at(idx->bt.s, bslot_of(hs[j + AHEAD], bcap)));
        const size_t i = base + j;
        uint32_t r = bt_find(idx, hs[j]);
        walked = i + 1;
        int shared = 0;
        size_t n_cont = 0;
        if (r != NONE32) {
            touch(idx, r);
            block_t *b = &idx->pool[r];
            if (n_act > 0 && prev_r != NONE32 && same_holders(idx, prev_r, &idx->pool[prev_r], b)) {
                /* the same endpoints with the same best tiers as the previous block: every
                 * active endpoint continues; settle the counts later in one pass */
                pending++;
                shared = prev_shared;
                n_cont = n_act;
            } else {
                const hview_t hv = hview_of(idx, b);
                const uint32_t nh = hv.n;
                settle(act, act_best, n_act, pending, ep_pos, tier_out);
                pending = 0;
                if (i == 0) {
                    for (uint32_t k = 0; k < nh; k++) {
                        uint32_t ep = hv_ep(hv, k);
                        if (ep == KVP_SHARED) {
                            shared = 1;
                            continue;
                        }
                        int best = hv_best(hv, k);
                        ep_gen[ep] = gen;
                        ep_pos[ep] = 0;
                        out->touched[out->n_touched++] = ep;
                        tier_out[best][ep]++;
                        act[n_cont] = ep;
                        act_best[n_cont++] = (uint8_t)best;
                    }
                } else if (n_act > 0) {
                    const uint32_t prev = (uint32_t)(i - 1);
                    for (uint32_t k = 0; k < nh; k++) {
                        uint32_t ep = hv_ep(hv, k);
                        if (ep == KVP_SHARED) {
                            shared = 1;
                            continue;
                        }
                        if (ep_gen[ep] != gen || ep_pos[ep] != prev) continue;
                        int best = hv_best(hv, k);
                        ep_pos[ep] = (uint32_t)i;
                        tier_out[best][ep]++;
                        act[n_cont] = ep;
                        act_best[n_cont++] = (uint8_t)best;
                    }
                } else {
                    for (uint32_t k = 0; k < nh; k++)
                        if (hv_ep(hv, k) == KVP_SHARED) {
                            shared = 1;
                            break;
                        }
                }
            }
        } else {
            settle(act, act_best, n_act, pending, ep_pos, tier_out);
            pending = 0;
        }
        run[i] = (uint32_t)shared;
        n_act = n_cont;
        prev_r = r;
        prev_shared = shared;
        if (n_cont == 0 && !shared) {
            done = 1;
            break;
        }
    }
    if (!done && walked == qs->n) done = 1;
    qs->walked = walked;
    qs->n_act = n_act;
    qs->pending = pending;
    qs->prev_r = prev_r;
    qs->prev_shared = prev_shared;
    qs->done = done;
    *more = !done;
    return KVP_OK;
}

kvp_status kvp_index_query_end(kvp_index *idx, kvp_query_out *out) {
    if (idx == NULL || out == NULL) return KVP_E_NULL;
    query_state_t *qs = &idx->qs;
    if (!qs->open) return KVP_E_ARG;
    qs->open = 0;
    uint32_t *ep_pos = idx->ep_pos;
    uint32_t *run = idx->run;
    int32_t *tier_out[KVP_N_TIERS] = {out->device, out->host, out->disk};
    const size_t walked = qs->walked;
    settle(idx->act_ep, idx->act_best, qs->n_act, qs->pending, ep_pos, tier_out);
    /* run[i] = shared blocks in a row starting at position i (0 at and past the walk's end) */
    run[walked] = 0;
    for (size_t i = walked; i-- > 0;) run[i] = run[i] ? run[i + 1] + 1 : 0;
    int32_t shared_prefix = (int32_t)run[0];
    if (shared_prefix != out->shared_fill) {
        for (size_t e = 0; e < out->cap; e++) out->shared_beyond[e] = shared_prefix;
        out->shared_fill = shared_prefix;
    }
    for (size_t k = 0; k < out->n_touched; k++) {
        uint32_t ep = out->touched[k];
        uint32_t local = ep_pos[ep] + 1;
        out->local[ep] = (int32_t)local;
        out->shared_beyond[ep] = (int32_t)run[local];
    }
    out->shared_prefix = shared_prefix;
    out->walked = walked;
    return KVP_OK;
}

kvp_status kvp_index_query(kvp_index *idx, const kvp_hash_t *hs, size_t n, kvp_query_out *out) {
    if (n > 0 && hs == NULL) return KVP_E_NULL;
    kvp_status st = kvp_index_query_begin(idx, n, out);
    if (st != KVP_OK) return st;
    int more;
    kvp_index_query_feed(idx, hs, n, out, &more);
    return kvp_index_query_end(idx, out);
}

kvp_status kvp_index_stats(const kvp_index *idx, kvp_stats *out) {
    if (idx == NULL || out == NULL) return KVP_E_NULL;
    *out = idx->c;
    out->blocks = idx->bt.count;
    out->entries = idx->n_holdings;
    out->engine_mappings = idx->mt_count;
    out->memory_bytes = sizeof(kvp_index) + idx->bt.bytes +
                        sizeof(mslot_t) * idx->mt_slots + sizeof(emap_t) * idx->em_cap +
                        sizeof(oslot_t) * idx->ot_cap +
                        idx->pool_bytes + idx->ext_bytes + idx->lru_prev_bytes +
                        idx->lru_next_bytes + idx->rec_eh_bytes + idx->cm.bytes +
                        idx->rec_ceh_bytes + idx->cm_own_bytes +
                        (size_t)idx->ext_cap * (sizeof(ext_t *) + sizeof(uint32_t)) +
                        idx->ep_cap * (3 * sizeof(uint32_t) + 1) + idx->run_cap * sizeof(uint32_t) +
                        idx->seq_cap * sizeof(kvp_hash_t);
    return KVP_OK;
}

kvp_status kvp_index_held_counts(const kvp_index *idx, uint64_t *counts, size_t n) {
    if (idx == NULL || (n > 0 && counts == NULL)) return KVP_E_NULL;
    for (size_t i = 0; i < n; i++) counts[i] = 0;
    const size_t slots = idx->bt.cap;
    for (size_t i = 0; i < slots; i++) {
        const uint32_t r = slot_rec(idx->bt.s, i);
        if (r == SLOT_NONE) continue;
        const block_t *b = &idx->pool[r];
        if (!is_ext(b)) {
            if (b->ep < n) counts[b->ep]++; /* EP_NONE is far above any n */
            continue;
        }
        const ext_t *e = ext_of(idx, b);
        const size_t stride = ext_stride(e);
        for (uint32_t k = 0; k < e->n; k++)
            if (e->w[k * stride] < n) counts[e->w[k * stride]]++;
    }
    return KVP_OK;
}

kvp_status kvp_index_holdings(const kvp_index *idx, kvp_endpoint_t ep, kvp_hash_t *hashes,
                              uint32_t *counts, size_t cap, size_t *n_out) {
    if (idx == NULL || n_out == NULL) return KVP_E_NULL;
    if (cap > 0 && (hashes == NULL || counts == NULL)) return KVP_E_NULL;
    if (!valid_ep(ep)) return KVP_E_ENDPOINT;
    size_t n = 0;
    size_t slots = idx->bt.cap;
    for (size_t i = 0; i < slots; i++) {
        const uint32_t r = slot_rec(idx->bt.s, i);
        if (r == SLOT_NONE) continue;
        block_t *b = &idx->pool[r];
        holder_t tmp;
        holder_t *hd = find_holder(idx, b, ep, &tmp, NULL);
        if (hd == NULL) continue;
        if (n < cap) {
            hashes[n] = b->hash;
            counts[3 * n] = hd->count[0];
            counts[3 * n + 1] = hd->count[1];
            counts[3 * n + 2] = hd->count[2];
        }
        n++;
    }
    *n_out = n;
    return n > cap ? KVP_E_BUFFER : KVP_OK;
}

/* Is slot `at` of a linear-probing table reachable from `home` (no empty slot in between)? */
static int bslot_reachable(const bslot_t *t, size_t cap, size_t home, size_t at) {
    for (size_t i = home;; i = (i + 1 == cap) ? 0 : i + 1) {
        if (i == at) return 1;
        if (slot_rec(t, i) == SLOT_NONE) return 0;
    }
}

int kvp_index_verify(const kvp_index *idx) {
    if (idx == NULL) return 1;
    /* block table: live records, tags, reachability, count */
    size_t n = 0;
    for (size_t i = 0; i < idx->bt.cap; i++) {
        const uint32_t r = slot_rec(idx->bt.s, i);
        if (r == SLOT_NONE) continue;
        n++;
        if (r >= idx->pool_len || idx->pool[r].ep == EP_NONE) return 2;
        const uint64_t mixed = bmix_of(idx->pool[r].hash);
        if (slot_tag(idx->bt.s, i) != btag_of(mixed)) return 3;
        if (!bslot_reachable(idx->bt.s, idx->bt.cap, bhome_of(mixed, idx->bt.cap), i)) return 4;
    }
    if (n != idx->bt.count) return 5;
    /* canonical map: owners only, tags, reachability, count; every owner is in it, alive */
    n = 0;
    for (size_t i = 0; i < idx->cm.cap; i++) {
        const uint32_t r = slot_rec(idx->cm.s, i);
        if (r == SLOT_NONE) continue;
        n++;
        if (r >= idx->pool_len || idx->pool[r].ep == EP_NONE || !cm_owns(idx, r)) return 6;
        const uint64_t mixed = cmix_of(idx->rec_ceh[r]);
        if (slot_tag(idx->cm.s, i) != btag_of(mixed)) return 7;
        if (!bslot_reachable(idx->cm.s, idx->cm.cap, bhome_of(mixed, idx->cm.cap), i)) return 8;
        size_t empty;
        if (cm_probe(idx, idx->rec_ceh[r], &empty) != r) return 9; /* two owners of one hash */
    }
    if (n != idx->cm.count) return 10;
    size_t owners = 0;
    for (uint32_t r = 0; r < idx->pool_len; r++)
        if (cm_owns(idx, r)) {
            owners++;
            if (idx->pool[r].ep == EP_NONE) return 11;
        }
    if (owners != idx->cm.count) return 12;
    /* holders: canonical flags per endpoint; holdings */
    uint64_t holdings = 0;
    const size_t n_em = idx->em_cap + 1; /* the endpoints' maps, then the shared tier's */
    uint64_t *canon = (uint64_t *)calloc(n_em, sizeof(uint64_t));
    if (canon == NULL) return 13;
    int bad = 0;
    for (uint32_t r = 0; r < idx->pool_len && !bad; r++) {
        const block_t *b = &idx->pool[r];
        if (b->ep == EP_NONE) continue;
        const hview_t hv = hview_of(idx, b);
        holdings += hv.n;
        for (uint32_t k = 0; k < hv.n; k++) {
            holder_t h;
            hv_get(hv, k, &h);
            if ((h.count[0] | h.count[1] | h.count[2]) == 0) bad = 14;
            if (k > 0 && hv_ep(hv, k - 1) >= h.ep) bad = 15; /* sorted, distinct */
            if (!(h.nmaps & HOLDER_CANON)) continue;
            if (!cm_owns(idx, r)) bad = 16; /* a canonical mapping of a block owning nothing */
            const size_t e = h.ep == KVP_SHARED ? idx->em_cap : h.ep;
            if (e >= n_em) bad = 17;
            else canon[e]++;
        }
    }
    if (!bad && holdings != idx->n_holdings) bad = 18;
    /* own maps: slots reachable, records held by the endpoint, counts; canonical counts */
    size_t mappings = 0, slots = 0;
    for (size_t e = 0; e < n_em && !bad; e++) {
        const kvp_endpoint_t ep = e == idx->em_cap ? KVP_SHARED : (kvp_endpoint_t)e;
        const emap_t *em = emap_of(idx, ep);
        if (em->ncanon != canon[e]) bad = 19;
        size_t cnt = 0;
        for (size_t i = 0; i < em->cap && !bad; i++) {
            const mslot_t *m = &em->t[i];
            if (m->rec == NONE32) continue;
            cnt++;
            const uint32_t r = m_rec(m);
            holder_t tmp;
            if (r >= idx->pool_len || find_holder(idx, &idx->pool[r], ep, &tmp, NULL) == NULL)
                bad = 20;
            size_t empty;
            if (mt_probe(em, m->eh, &empty) != m) bad = 21;
            /* never both an own and a canonical mapping of one engine hash */
            const uint32_t cr = cm_probe(idx, m->eh, &empty);
            if (cr != NONE32) {
                const holder_t *hc = find_holder(idx, &idx->pool[cr], ep, &tmp, NULL);
                if (hc != NULL && (hc->nmaps & HOLDER_CANON)) bad = 22;
            }
        }
        if (!bad && cnt != em->count) bad = 23;
        mappings += cnt + em->ncanon;
        slots += em->cap;
    }
    free(canon);
    if (bad) return bad;
    if (mappings != idx->mt_count) return 24;
    if (slots != idx->mt_slots) return 25;
    return 0;
}
