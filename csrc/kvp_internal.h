/* Internal helpers shared by the core's translation units (not part of the API). */
#ifndef KVP_INTERNAL_H
#define KVP_INTERNAL_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

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


/* Unaligned-safe loads of native u32 tokens: one, and two as one word (t[i] | t[i+1] << 32). */
static inline uint32_t ld_u32(const unsigned char *p, size_t i) {
    uint32_t v;
    memcpy(&v, p + 4 * i, 4);
    return v;
}
static inline uint64_t pair_u32(const unsigned char *p, size_t i) {
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    uint64_t v;
    memcpy(&v, p + 4 * i, 8);
    return v;
#else
    return (uint64_t)ld_u32(p, i) | ((uint64_t)ld_u32(p, i + 1) << 32);
#endif
}

/* One block's local hash: eight tokens per round in two lanes, zero padding (n is mixed in). */
#define DEFINE_LOCAL(NAME, PAIR, LOAD)                                                        \
    static inline kvp_hash_t NAME(const unsigned char *p, size_t n, uint64_t seed) {          \
        uint64_t a = seed ^ KPH_K0 ^ ((uint64_t)n * KPH_K1);                                  \
        uint64_t b = seed ^ KPH_K2 ^ kph_rotl((uint64_t)n * KPH_K3, 29);                      \
        size_t i = 0;                                                                         \
        for (; i + 8 <= n; i += 8) {                                                          \
            uint64_t w0 = PAIR(p, i), w1 = PAIR(p, i + 2);                                    \
            uint64_t w2 = PAIR(p, i + 4), w3 = PAIR(p, i + 6);                                \
            a = kph_mum(w0 ^ KPH_K1 ^ a, w1 ^ KPH_K2) ^ kph_rotl(a, 23);                       \
            b = kph_mum(w2 ^ KPH_K3 ^ b, w3 ^ KPH_K0) ^ kph_rotl(b, 41);                       \
        }                                                                                     \
        if (i < n) {                                                                          \
            uint32_t pad[8] = {0, 0, 0, 0, 0, 0, 0, 0};                                       \
            for (size_t j = 0; i + j < n; j++) pad[j] = LOAD(p, i + j);                       \
            uint64_t w0 = (uint64_t)pad[0] | ((uint64_t)pad[1] << 32);                        \
            uint64_t w1 = (uint64_t)pad[2] | ((uint64_t)pad[3] << 32);                        \
            uint64_t w2 = (uint64_t)pad[4] | ((uint64_t)pad[5] << 32);                        \
            uint64_t w3 = (uint64_t)pad[6] | ((uint64_t)pad[7] << 32);                        \
            a = kph_mum(w0 ^ KPH_K1 ^ a, w1 ^ KPH_K2) ^ kph_rotl(a, 23);                       \
            b = kph_mum(w2 ^ KPH_K3 ^ b, w3 ^ KPH_K0) ^ kph_rotl(b, 41);                       \
        }                                                                                     \
        return kph_fmix64(kph_mum(a ^ KPH_K3, b ^ KPH_K0 ^ (uint64_t)n) ^ a ^ kph_rotl(b, 17)); \
    }

/* kph1's local hash of n native u32 tokens (inline here so that a caller reading tokens from
 * elsewhere, e.g. a Python list in the binding, can hash block by block as it reads). */
DEFINE_LOCAL(kph_local_u32, pair_u32, ld_u32)

/* The same hash of tokens held as 64-bit words, two tokens each (w[k] = t[2k] | t[2k+1] << 32):
 * a reader that builds words in registers and stores them whole lets the hash load each word
 * straight from the store buffer (u32 stores read back as one u64 load stall instead). */
static inline uint64_t pair_w64(const unsigned char *p, size_t i) {
    uint64_t v;
    memcpy(&v, p + 4 * i, 8); /* i is even: word i / 2 */
    return v;
}
static inline uint32_t ld_w64(const unsigned char *p, size_t i) {
    uint64_t v;
    memcpy(&v, p + 8 * (i / 2), 8);
    return (uint32_t)(v >> (32 * (i & 1)));
}
DEFINE_LOCAL(kph_local_w64, pair_w64, ld_w64)

void kvp_hash_blocks_unchecked(const void *tokens, kvp_dtype dt, size_t n_blocks,
                               size_t block_size, uint64_t seed, const uint64_t *extra,
                               kvp_hash_t *local_out, kvp_hash_t *seq_out);

#endif
