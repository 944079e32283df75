/* kph1: kvplug's own 64-bit block hash (see kvplug/_reference.py for the contract). */
#include <string.h>

#include "kvplug.h"
#include "kvp_internal.h"

const char *kvp_status_str(kvp_status s) {
    switch (s) {
    case KVP_OK: return "ok";
    case KVP_E_NULL: return "null pointer";
    case KVP_E_ARG: return "invalid argument";
    case KVP_E_TOKEN: return "token out of range";
    case KVP_E_ENDPOINT: return "endpoint id out of range";
    case KVP_E_TIER: return "invalid tier";
    case KVP_E_NOMEM: return "out of memory";
    case KVP_E_BUFFER: return "buffer too small";
    case KVP_E_OVERFLOW: return "reference count overflow";
    }
    return "unknown status";
}

kvp_hash_t kvp_chain_hash(kvp_hash_t prev, kvp_hash_t local, uint64_t extra) {
    return kvp_chain_hash_inline(prev, local, extra);
}

/* Unaligned-safe loads (ld_u32, pair_u32: kvp_internal.h). Tokens have been validated, so
 * truncation to 32 bits is exact. */
static inline uint32_t ld_le32(const unsigned char *p, size_t i) {
    const unsigned char *q = p + 4 * i;
    return (uint32_t)q[0] | ((uint32_t)q[1] << 8) | ((uint32_t)q[2] << 16) | ((uint32_t)q[3] << 24);
}
static inline uint32_t ld_u64lo(const unsigned char *p, size_t i) {
    uint64_t v;
    memcpy(&v, p + 8 * i, 8);
    return (uint32_t)v;
}

static inline uint64_t pair_le32(const unsigned char *p, size_t i) {
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    uint64_t v;
    memcpy(&v, p + 4 * i, 8);
    return v;
#else
    return (uint64_t)ld_le32(p, i) | ((uint64_t)ld_le32(p, i + 1) << 32);
#endif
}
static inline uint64_t pair_u64(const unsigned char *p, size_t i) {
    return (uint64_t)ld_u64lo(p, i) | ((uint64_t)ld_u64lo(p, i + 1) << 32);
}

#define local_u32 kph_local_u32 /* kvp_internal.h */
DEFINE_LOCAL(local_le32, pair_le32, ld_le32)
DEFINE_LOCAL(local_u64, pair_u64, ld_u64lo)

static size_t elem_size(kvp_dtype dt) {
    switch (dt) {
    case KVP_DT_U32: case KVP_DT_I32: case KVP_DT_LE32: return 4;
    case KVP_DT_U64: case KVP_DT_I64: return 8;
    }
    return 0;
}

kvp_status kvp_check_tokens(const void *tokens, kvp_dtype dt, size_t n, size_t *err_pos) {
    if (elem_size(dt) == 0) return KVP_E_ARG;
    if (n == 0) return KVP_OK;
    if (tokens == NULL) return KVP_E_NULL;
    const unsigned char *p = (const unsigned char *)tokens;
    const size_t chunk = 256;
    switch (dt) {
    case KVP_DT_U32:
    case KVP_DT_LE32:
        return KVP_OK;
    case KVP_DT_I32:
        for (size_t s = 0; s < n; s += chunk) {
            size_t e = s + chunk < n ? s + chunk : n;
            uint32_t bad = 0;
            for (size_t i = s; i < e; i++) bad |= ld_u32(p, i);
            if (bad >> 31) {
                for (size_t i = s; i < e; i++)
                    if (ld_u32(p, i) >> 31) {
                        if (err_pos) *err_pos = i;
                        return KVP_E_TOKEN;
                    }
            }
        }
        return KVP_OK;
    case KVP_DT_U64:
    case KVP_DT_I64:
        for (size_t s = 0; s < n; s += chunk) {
            size_t e = s + chunk < n ? s + chunk : n;
            uint64_t bad = 0;
            for (size_t i = s; i < e; i++) {
                uint64_t v;
                memcpy(&v, p + 8 * i, 8);
                bad |= v;
            }
            if (bad >> 32) {
                for (size_t i = s; i < e; i++) {
                    uint64_t v;
                    memcpy(&v, p + 8 * i, 8);
                    if (v >> 32) {
                        if (err_pos) *err_pos = i;
                        return KVP_E_TOKEN;
                    }
                }
            }
        }
        return KVP_OK;
    }
    return KVP_E_ARG;
}

static inline kvp_hash_t local_any(const unsigned char *p, kvp_dtype dt, size_t n, uint64_t seed) {
    switch (dt) {
    case KVP_DT_U32: case KVP_DT_I32: return local_u32(p, n, seed);
    case KVP_DT_LE32: return local_le32(p, n, seed);
    default: return local_u64(p, n, seed);
    }
}

kvp_status kvp_local_hash(const void *tokens, kvp_dtype dt, size_t n, uint64_t seed,
                          kvp_hash_t *out, size_t *err_pos) {
    if (out == NULL) return KVP_E_NULL;
    kvp_status st = kvp_check_tokens(tokens, dt, n, err_pos);
    if (st != KVP_OK) return st;
    static const uint32_t empty = 0;
    *out = local_any(n ? (const unsigned char *)tokens : (const unsigned char *)&empty, dt, n, seed);
    return KVP_OK;
}

#define DEFINE_BLOCKS(NAME, LOCAL)                                                            \
    static void NAME(const unsigned char *p, size_t esz, size_t nb, size_t bs, uint64_t seed,  \
                     const uint64_t *extra, kvp_hash_t *lo, kvp_hash_t *seq) {                \
        uint64_t prev = seed;                                                                 \
        for (size_t b = 0; b < nb; b++) {                                                     \
            kvp_hash_t h = LOCAL(p + b * bs * esz, bs, 0);                                    \
            prev = kvp_chain_hash_inline(prev, h, extra ? extra[b] : 0);                      \
            if (lo) lo[b] = h;                                                                \
            seq[b] = prev;                                                                    \
        }                                                                                     \
    }

DEFINE_BLOCKS(blocks_u32, local_u32)
DEFINE_BLOCKS(blocks_le32, local_le32)
DEFINE_BLOCKS(blocks_u64, local_u64)

/* Shared by kvp_hash_blocks and store_tokens: tokens already validated. */
void kvp_hash_blocks_unchecked(const void *tokens, kvp_dtype dt, size_t n_blocks,
                               size_t block_size, uint64_t seed, const uint64_t *extra,
                               kvp_hash_t *local_out, kvp_hash_t *seq_out) {
    const unsigned char *p = (const unsigned char *)tokens;
    switch (dt) {
    case KVP_DT_U32: case KVP_DT_I32:
        blocks_u32(p, 4, n_blocks, block_size, seed, extra, local_out, seq_out);
        break;
    case KVP_DT_LE32:
        blocks_le32(p, 4, n_blocks, block_size, seed, extra, local_out, seq_out);
        break;
    default:
        blocks_u64(p, 8, n_blocks, block_size, seed, extra, local_out, seq_out);
        break;
    }
}

kvp_status kvp_hash_blocks(const void *tokens, kvp_dtype dt, size_t n_tokens, size_t block_size,
                           uint64_t seed, const uint64_t *extra, size_t n_extra,
                           kvp_hash_t *local_out, kvp_hash_t *seq_out, size_t out_cap,
                           size_t *err_pos) {
    if (block_size == 0 || elem_size(dt) == 0) return KVP_E_ARG;
    size_t nb = n_tokens / block_size;
    if (nb > 0 && seq_out == NULL) return KVP_E_NULL;
    if (out_cap < nb) return KVP_E_BUFFER;
    kvp_status st = kvp_check_tokens(tokens, dt, n_tokens, err_pos);
    if (st != KVP_OK) return st;
    if (extra != NULL && n_extra < nb) return KVP_E_ARG;
    if (nb == 0) return KVP_OK;
    kvp_hash_blocks_unchecked(tokens, dt, nb, block_size, seed, extra, local_out, seq_out);
    return KVP_OK;
}
