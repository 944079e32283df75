/* Internal helpers shared by the core's translation units (not part of the API). */
#ifndef KVP_INTERNAL_H
#define KVP_INTERNAL_H

#include <stdint.h>

#include "kvplug.h"

#define KPH_K0 0x9E3779B97F4A7C15ull
#define KPH_K1 0xBF58476D1CE4E5B9ull
#define KPH_K2 0x94D049BB133111EBull
#define KPH_K3 0xD6E8FEB86659FD93ull

/* 64x64 -> 128-bit multiply folded by xor of the halves. */
static inline uint64_t kph_mum(uint64_t a, uint64_t b) {
    unsigned __int128 p = (unsigned __int128)a * b;
    return (uint64_t)p ^ (uint64_t)(p >> 64);
}

static inline uint64_t kph_rotl(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }

static inline uint64_t kph_fmix64(uint64_t x) {
    x ^= x >> 33;
    x *= 0xFF51AFD7ED558CCDull;
    x ^= x >> 33;
    x *= 0xC4CEB9FE1A85EC53ull;
    x ^= x >> 33;
    return x;
}

static inline kvp_hash_t kvp_chain_hash_inline(kvp_hash_t prev, kvp_hash_t local, uint64_t extra) {
    return kph_fmix64(kph_mum(prev ^ KPH_K2, local ^ KPH_K3) ^
                      kph_mum(extra ^ KPH_K1, prev ^ local ^ KPH_K0) ^ kph_rotl(prev, 31));
}

void kvp_hash_blocks_unchecked(const void *tokens, kvp_dtype dt, size_t n_blocks,
                               size_t block_size, uint64_t seed, const uint64_t *extra,
                               kvp_hash_t *local_out, kvp_hash_t *seq_out);

#endif
