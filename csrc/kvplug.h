/* kvplug C core: block hashing (kph1), the prefix index, costs and selection.
 *
 * Every entry point validates its inputs and returns a kvp_status; nothing here aborts,
 * reads past a caller's buffer, or keeps memory after kvp_index_free. The pure-Python
 * reference (kvplug/_reference.py) is the contract; this is its fast twin.
 *
 * Threading: a kvp_index is not internally synchronised (queries also mutate LRU order and
 * scratch space). Callers serialise all calls on one index; the Cython binding holds a lock.
 */
#ifndef KVPLUG_H
#define KVPLUG_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Distinct names for distinct numbers. */
typedef uint64_t kvp_engine_hash_t; /* an engine's opaque block id, per endpoint */
typedef uint64_t kvp_hash_t;        /* kvplug's chained (sequence) or local block hash */
typedef uint32_t kvp_endpoint_t;    /* dense id of one (worker, dp_rank), or KVP_SHARED */
typedef uint32_t kvp_token_t;       /* a token id */

#define KVP_N_TIERS 3
#define KVP_TIER_DEVICE 0
#define KVP_TIER_HOST 1
#define KVP_TIER_DISK 2
#define KVP_TIER_ANY (-1)
#define KVP_SHARED ((kvp_endpoint_t)0xFFFFFFFFu)
#define KVP_MAX_ENDPOINT ((kvp_endpoint_t)1u << 20) /* ids must be < this, or KVP_SHARED */

typedef enum {
    KVP_OK = 0,
    KVP_E_NULL = 1,     /* a required pointer is NULL */
    KVP_E_ARG = 2,      /* bad argument: block size, lengths, u, temperature, NaN cost */
    KVP_E_TOKEN = 3,    /* token outside [0, 2^32); *err_pos is its position */
    KVP_E_ENDPOINT = 4, /* endpoint id out of range */
    KVP_E_TIER = 5,     /* tier not 0, 1, 2 (or KVP_TIER_ANY where allowed) */
    KVP_E_NOMEM = 6,    /* allocation failed; the index is unchanged or consistently partial */
    KVP_E_BUFFER = 7,   /* a caller-provided buffer is too small */
    KVP_E_OVERFLOW = 8  /* a holder's 16-bit per-tier count would overflow (65,535 references) */
} kvp_status;

/* Token buffer element types. All are read with unaligned-safe loads. */
typedef enum {
    KVP_DT_U32 = 0,  /* native uint32 */
    KVP_DT_I32 = 1,  /* native int32, must be >= 0 */
    KVP_DT_U64 = 2,  /* native uint64, must be < 2^32 */
    KVP_DT_I64 = 3,  /* native int64, must be in [0, 2^32) */
    KVP_DT_LE32 = 4  /* raw bytes, little-endian uint32 tokens */
} kvp_dtype;

const char *kvp_status_str(kvp_status s);

/* ---- hashing (kph1) ---------------------------------------------------------------------- */
kvp_hash_t kvp_chain_hash(kvp_hash_t prev, kvp_hash_t local, uint64_t extra);
kvp_status kvp_local_hash(const void *tokens, kvp_dtype dt, size_t n_tokens, uint64_t seed,
                          kvp_hash_t *out, size_t *err_pos);
/* Validate tokens: KVP_E_TOKEN with *err_pos = first bad position. */
kvp_status kvp_check_tokens(const void *tokens, kvp_dtype dt, size_t n_tokens, size_t *err_pos);
/* Local and sequence hashes of every full block. local_out may be NULL. extra may be NULL
 * (n_extra ignored); else n_extra must be >= number of full blocks. out_cap >= full blocks. */
kvp_status kvp_hash_blocks(const void *tokens, kvp_dtype dt, size_t n_tokens, size_t block_size,
                           uint64_t seed, const uint64_t *extra, size_t n_extra,
                           kvp_hash_t *local_out, kvp_hash_t *seq_out, size_t out_cap,
                           size_t *err_pos);

/* ---- index --------------------------------------------------------------------------------- */
typedef struct kvp_index kvp_index;

typedef struct {
    uint64_t stored_blocks, duplicate_stores, conflicting_stores, orphan_stores;
    uint64_t removed_blocks, unknown_removes, moved_blocks, unknown_moves;
    uint64_t evicted_blocks, evicted_entries, cleared_endpoints;
    uint64_t reannounced_blocks; /* root stores of blocks the endpoint held: not counted twice */
    uint64_t blocks, entries, engine_mappings;
    uint64_t memory_bytes; /* bytes the index holds allocated (tables, records, scratch) */
} kvp_stats;

/* Dense per-endpoint query output. The caller allocates the five arrays (cap entries each,
 * zeroed) and `touched` (cap entries), sets n_touched = 0 and shared_fill = 0 once, and reuses
 * the struct: each query resets only what the previous query wrote. */
typedef struct {
    int32_t *local, *device, *host, *disk, *shared_beyond;
    uint32_t *touched;   /* endpoints with local > 0 after the last query */
    size_t cap;          /* entries in each array; must be >= kvp_index_endpoint_limit() */
    size_t n_touched;
    int32_t shared_fill; /* value of every untouched shared_beyond entry */
    int32_t shared_prefix;
    size_t walked;
} kvp_query_out;

kvp_status kvp_index_new(uint64_t max_entries, kvp_index **out);
void kvp_index_free(kvp_index *idx);
/* Pre-size for n_blocks distinct blocks (avoids growth rehashes): block table, records and the
 * canonical engine map (one mapping per block, shared by the endpoints that agree on its engine
 * hash). n_mappings is for the endpoints' own maps (mappings where engines disagree), spread
 * evenly over the endpoint ids below kvp_index_endpoint_limit() (none when no endpoint has
 * stored yet: use kvp_index_reserve_endpoint). */
kvp_status kvp_index_reserve(kvp_index *idx, size_t n_blocks, size_t n_mappings);
/* Pre-size ep's own engine map for n_mappings mappings (beyond the canonical map's). */
kvp_status kvp_index_reserve_endpoint(kvp_index *idx, kvp_endpoint_t ep, size_t n_mappings);
/* 1 + the largest non-shared endpoint id ever stored (query buffers must cover it). */
size_t kvp_index_endpoint_limit(const kvp_index *idx);

kvp_status kvp_index_store(kvp_index *idx, kvp_endpoint_t ep, int tier,
                           const kvp_engine_hash_t *engine_hashes, const kvp_hash_t *block_hashes,
                           size_t n);
/* *stored = 0 when the parent is unknown to ep (orphan: counted, index unchanged). */
kvp_status kvp_index_store_tokens(kvp_index *idx, kvp_endpoint_t ep, int tier, int has_parent,
                                  kvp_engine_hash_t parent, const kvp_engine_hash_t *engine_hashes,
                                  size_t n_blocks, const void *tokens, kvp_dtype dt,
                                  size_t n_tokens, size_t block_size, uint64_t seed,
                                  const uint64_t *extra, size_t n_extra, int *stored,
                                  size_t *err_pos);
/* One store of a batch: the arguments of kvp_index_store_tokens (block size is per batch). */
typedef struct {
    kvp_endpoint_t ep;
    int tier;
    int has_parent;
    kvp_engine_hash_t parent;
    const kvp_engine_hash_t *engine_hashes;
    size_t n_blocks;
    const void *tokens;
    kvp_dtype dt;
    size_t n_tokens;
    uint64_t seed;
    const uint64_t *extra; /* NULL: none */
    size_t n_extra;
} kvp_store_tokens_req;

/* What kvp_index_store_tokens returned for one request. */
typedef struct {
    kvp_status status;
    int stored;     /* 0: orphan (counted) or failed */
    size_t err_pos; /* status == KVP_E_TOKEN: the bad token's position in that request */
} kvp_store_result;

/* Apply reqs[0 .. n) in order, each exactly as kvp_index_store_tokens would (same checks, same
 * counters). A failing request is reported in its results[i] and changes nothing (except for
 * KVP_E_OVERFLOW, which, as in the single call, keeps the blocks before the overflowing one);
 * the requests after it still run. Only KVP_E_NOMEM stops the batch: the call returns it with
 * *n_done = index of that request + 1 (its result says NOMEM; later ones were not attempted).
 * Otherwise returns KVP_OK with *n_done = n; *n_failed = requests whose status is not KVP_OK. */
kvp_status kvp_index_store_tokens_batch(kvp_index *idx, size_t block_size,
                                        const kvp_store_tokens_req *reqs, size_t n,
                                        kvp_store_result *results, size_t *n_done,
                                        size_t *n_failed);
kvp_status kvp_index_remove(kvp_index *idx, kvp_endpoint_t ep, int tier /* or KVP_TIER_ANY */,
                            const kvp_engine_hash_t *engine_hashes, size_t n);
kvp_status kvp_index_move(kvp_index *idx, kvp_endpoint_t ep, int from_tier, int to_tier,
                          const kvp_engine_hash_t *engine_hashes, size_t n);
kvp_status kvp_index_clear(kvp_index *idx, kvp_endpoint_t ep);
kvp_status kvp_index_resolve(const kvp_index *idx, kvp_endpoint_t ep, kvp_engine_hash_t eh,
                             kvp_hash_t *out, int *found);
kvp_status kvp_index_query(kvp_index *idx, const kvp_hash_t *block_hashes, size_t n,
                           kvp_query_out *out);
/* The same query fed in pieces, for a caller that converts the hashes as it goes: begin with
 * the query's length n, feed the hashes in order (each feed continues where the last ended;
 * at most n in all), end. *more = 0 once the walk has ended (no endpoint and no shared block
 * continues the prefix, or all n fed): the hashes after that cannot change the answer, and
 * need not be read. kvp_index_query is begin, one feed of all n, end. Nothing may change the
 * index between begin and end. */
kvp_status kvp_index_query_begin(kvp_index *idx, size_t n, kvp_query_out *out);
kvp_status kvp_index_query_feed(kvp_index *idx, const kvp_hash_t *block_hashes, size_t n,
                                kvp_query_out *out, int *more);
kvp_status kvp_index_query_end(kvp_index *idx, kvp_query_out *out);
kvp_status kvp_index_stats(const kvp_index *idx, kvp_stats *out);
/* Blocks ep holds: hashes[i] and counts[3*i .. 3*i+2]. *n_out = number held; KVP_E_BUFFER (with
 * *n_out set) when cap is too small. */
kvp_status kvp_index_holdings(const kvp_index *idx, kvp_endpoint_t ep, kvp_hash_t *hashes,
                              uint32_t *counts, size_t cap, size_t *n_out);
/* counts[ep] = blocks endpoint ep holds, for every ep < n (one pass over the table). */
kvp_status kvp_index_held_counts(const kvp_index *idx, uint64_t *counts, size_t n);
/* For tests: walk every table and check the index's invariants (each slot findable from its
 * home, counts, canonical-map ownership, every mapping's record held by its endpoint). 0 when
 * they hold, else the number of the first broken one (see csrc/index.c). O(size). */
int kvp_index_verify(const kvp_index *idx);

/* ---- costs and selection ------------------------------------------------------------------ */
typedef struct {
    double overlap_score_credit, host_cache_hit_weight, disk_cache_hit_weight;
    double shared_cache_multiplier, prefill_load_scale;
} kvp_cost_params;

kvp_status kvp_costs(const double *prefill_blocks, const double *device, const double *host,
                     const double *disk, const double *shared_beyond, const double *decode_blocks,
                     size_t n, const kvp_cost_params *p, double *out);
kvp_status kvp_select(const double *cost, size_t n, double temperature, double u,
                      size_t *chosen);

#ifdef __cplusplus
}
#endif
#endif /* KVPLUG_H */
