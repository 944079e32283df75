/* C-level stress of the core's API, meant to run under ASan/UBSan/LSan (tests/test_core_sanitizer.py
 * compiles it with -fsanitize=address,undefined and runs it with leak detection on).
 *
 * Random stores (by hashes and by tokens), removes, moves, clears and queries over a small key
 * space on bounded and unbounded indexes, plus invalid arguments that must come back as a
 * status, then frees everything. Checks cheap invariants; the differential tests in Python
 * check exact answers against the reference.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../kvplug.h"

static uint64_t rng_state = 0x9E3779B97F4A7C15ull;
static uint64_t next_u64(void) { /* splitmix64 */
    uint64_t z = (rng_state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}
static uint32_t below(uint32_t n) { return (uint32_t)(next_u64() % n); }

#define CHECK(cond)                                                              \
    do {                                                                         \
        if (!(cond)) {                                                           \
            fprintf(stderr, "check failed at %s:%d: %s\n", __FILE__, __LINE__, #cond); \
            return 1;                                                            \
        }                                                                        \
    } while (0)

static kvp_endpoint_t pick_ep(void) {
    uint32_t r = below(10);
    return r == 9 ? KVP_SHARED : r % 6;
}

static int run(uint64_t max_entries, int steps) {
    kvp_index *idx = NULL;
    CHECK(kvp_index_new(max_entries, &idx) == KVP_OK && idx != NULL);
    enum { CAP = 64, NB = 8, BS = 4 };
    int32_t local[CAP], device[CAP], host[CAP], disk[CAP], beyond[CAP];
    uint32_t touched[CAP];
    memset(local, 0, sizeof local);
    memset(device, 0, sizeof device);
    memset(host, 0, sizeof host);
    memset(disk, 0, sizeof disk);
    memset(beyond, 0, sizeof beyond);
    kvp_query_out q = {local, device, host, disk, beyond, touched, CAP, 0, 0, 0, 0};
    kvp_engine_hash_t ehs[NB];
    kvp_hash_t hs[NB];
    uint32_t toks[NB * BS];
    for (int s = 0; s < steps; s++) {
        kvp_endpoint_t ep = pick_ep();
        size_t n = below(NB + 1);
        for (size_t i = 0; i < n; i++) {
            ehs[i] = below(24);
            hs[i] = below(16);
        }
        for (size_t i = 0; i < n * BS; i++) toks[i] = below(2);
        int tier = (int)below(3);
        switch (below(8)) {
        case 0:
            CHECK(kvp_index_store(idx, ep, tier, ehs, hs, n) == KVP_OK);
            break;
        case 1: {
            int stored = -1;
            size_t pos = 0;
            kvp_status st = kvp_index_store_tokens(idx, ep, tier, (int)below(2), below(24), ehs, n,
                                                   toks, KVP_DT_U32, n * BS, BS, below(2), NULL,
                                                   0, &stored, &pos);
            CHECK(st == KVP_OK && (stored == 0 || stored == 1));
            break;
        }
        case 2:
            CHECK(kvp_index_remove(idx, ep, below(4) == 0 ? KVP_TIER_ANY : tier, ehs, n) == KVP_OK);
            break;
        case 3:
            CHECK(kvp_index_move(idx, ep, tier, (int)below(3), ehs, n) == KVP_OK);
            break;
        case 4:
            if (below(8) == 0) CHECK(kvp_index_clear(idx, ep) == KVP_OK);
            break;
        default: {
            kvp_hash_t qh[NB];
            size_t qn = below(NB + 1);
            uint32_t qt[NB * BS];
            for (size_t i = 0; i < qn * BS; i++) qt[i] = below(2);
            size_t pos;
            CHECK(kvp_hash_blocks(qt, KVP_DT_U32, qn * BS, BS, 0, NULL, 0, NULL, qh, NB, &pos) ==
                  KVP_OK);
            if (below(3) == 0)
                for (size_t i = 0; i < qn; i++) qh[i] = below(16);
            CHECK(kvp_index_query(idx, qh, qn, &q) == KVP_OK);
            CHECK(q.walked <= qn);
            for (size_t k = 0; k < q.n_touched; k++) {
                uint32_t e = touched[k];
                CHECK(e < CAP && local[e] > 0 && (size_t)local[e] <= q.walked);
                CHECK(device[e] + host[e] + disk[e] == local[e]);
            }
            break;
        }
        }
        kvp_stats st;
        CHECK(kvp_index_stats(idx, &st) == KVP_OK);
        CHECK(st.entries >= st.blocks);
        if (max_entries) CHECK(st.entries <= max_entries || st.blocks == 0);
    }
    /* invalid arguments come back as statuses */
    CHECK(kvp_index_store(NULL, 0, 0, ehs, hs, 1) == KVP_E_NULL);
    CHECK(kvp_index_store(idx, KVP_MAX_ENDPOINT, 0, ehs, hs, 1) == KVP_E_ENDPOINT);
    CHECK(kvp_index_store(idx, 0, 3, ehs, hs, 1) == KVP_E_TIER);
    CHECK(kvp_index_store(idx, 0, 0, NULL, hs, 1) == KVP_E_NULL);
    CHECK(kvp_index_remove(idx, 0, 7, ehs, 1) == KVP_E_TIER);
    CHECK(kvp_index_move(idx, 0, 0, -1, ehs, 1) == KVP_E_TIER);
    CHECK(kvp_index_clear(idx, 0xFFFFFFFEu) == KVP_E_ENDPOINT);
    CHECK(kvp_index_query(idx, NULL, 3, &q) == KVP_E_NULL);
    kvp_query_out small = q;
    small.cap = 0;
    kvp_stats s0;
    kvp_index_stats(idx, &s0);
    if (kvp_index_endpoint_limit(idx) > 0) CHECK(kvp_index_query(idx, hs, 1, &small) == KVP_E_BUFFER);
    int stored;
    size_t pos = 0;
    int32_t bad[4] = {1, 2, -3, 4};
    CHECK(kvp_index_store_tokens(idx, 0, 0, 0, 0, ehs, 1, bad, KVP_DT_I32, 4, 4, 0, NULL, 0, &stored,
                                 &pos) == KVP_E_TOKEN &&
          pos == 2);
    CHECK(kvp_index_store_tokens(idx, 0, 0, 0, 0, ehs, 2, toks, KVP_DT_U32, 4, 4, 0, NULL, 0, &stored,
                                 &pos) == KVP_E_ARG);
    kvp_stats s1;
    kvp_index_stats(idx, &s1);
    CHECK(memcmp(&s0, &s1, sizeof s0) == 0);
    size_t chosen;
    double costs[3] = {1.0, 0.5, 0.5};
    CHECK(kvp_select(costs, 3, 0.0, 0.99, &chosen) == KVP_OK && chosen == 2);
    CHECK(kvp_select(costs, 0, 0.0, 0.5, &chosen) == KVP_E_ARG);
    CHECK(kvp_select(costs, 3, -1.0, 0.5, &chosen) == KVP_E_ARG);
    CHECK(kvp_hash_blocks(toks, KVP_DT_U32, 8, 0, 0, NULL, 0, NULL, hs, NB, &pos) == KVP_E_ARG);
    kvp_index_free(idx);
    kvp_index_free(NULL);
    return 0;
}

/* Many distinct blocks: table rehashes, long probe clusters, removes that shift them back, and
 * a record pool large enough to live in its own mapping (built with a small KVP_BIG_BYTES). */
static int grow_and_shrink(uint64_t max_entries) {
    kvp_index *idx = NULL;
    CHECK(kvp_index_new(max_entries, &idx) == KVP_OK);
    enum { N = 30000, BATCH = 64, EPS = 4 };
    static kvp_engine_hash_t ehs[N];
    static kvp_hash_t hs[N];
    for (size_t i = 0; i < N; i++) {
        ehs[i] = next_u64();
        hs[i] = next_u64() | 1; /* distinct with overwhelming probability */
    }
    for (size_t i = 0; i < N; i += BATCH) {
        kvp_endpoint_t ep = (kvp_endpoint_t)((i / BATCH) % EPS);
        size_t n = N - i < BATCH ? N - i : BATCH;
        CHECK(kvp_index_store(idx, ep, (int)(i % 3), &ehs[i], &hs[i], n) == KVP_OK);
    }
    kvp_stats st;
    CHECK(kvp_index_stats(idx, &st) == KVP_OK);
    if (max_entries == 0) CHECK(st.blocks == N && st.entries == N && st.engine_mappings == N);
    else CHECK(st.entries <= max_entries);
    size_t found_n = 0;
    for (size_t i = 0; i < N; i++) {
        kvp_hash_t h;
        int found;
        CHECK(kvp_index_resolve(idx, (kvp_endpoint_t)((i / BATCH) % EPS), ehs[i], &h, &found) ==
              KVP_OK);
        CHECK(!found || h == hs[i]);
        found_n += (size_t)found;
    }
    CHECK(found_n == st.engine_mappings);
    for (size_t i = 0; i < N; i += 2 * BATCH) { /* remove every other batch */
        size_t n = N - i < BATCH ? N - i : BATCH;
        CHECK(kvp_index_remove(idx, (kvp_endpoint_t)((i / BATCH) % EPS), KVP_TIER_ANY, &ehs[i], n) ==
              KVP_OK);
    }
    for (size_t i = 0; i < N; i++) {
        kvp_hash_t h;
        int found;
        CHECK(kvp_index_resolve(idx, (kvp_endpoint_t)((i / BATCH) % EPS), ehs[i], &h, &found) ==
              KVP_OK);
        if ((i / BATCH) % 2 == 0) CHECK(!found);
        else if (max_entries == 0) CHECK(found && h == hs[i]);
        if (found) { /* the block table still finds the block after the shifts */
            enum { CAP = EPS };
            int32_t a[5][CAP] = {{0}};
            uint32_t touched[CAP];
            kvp_query_out q = {a[0], a[1], a[2], a[3], a[4], touched, CAP, 0, 0, 0, 0};
            CHECK(kvp_index_query(idx, &hs[i], 1, &q) == KVP_OK);
            CHECK(q.n_touched == 1 && a[0][(i / BATCH) % EPS] == 1);
        }
    }
    for (kvp_endpoint_t ep = 0; ep < EPS; ep++) CHECK(kvp_index_clear(idx, ep) == KVP_OK);
    CHECK(kvp_index_stats(idx, &st) == KVP_OK);
    CHECK(st.blocks == 0 && st.entries == 0 && st.engine_mappings == 0);
    kvp_index_free(idx);
    return 0;
}

/* Few blocks, many references: counts past a record's inline 8 bits, more than 63 engine hashes
 * of one block on one endpoint (side-table refcounts), moves and partial removes; then every
 * reference is removed again and the index must be empty. */
static int heavy_counts(uint64_t max_entries) {
    kvp_index *idx = NULL;
    CHECK(kvp_index_new(max_entries, &idx) == KVP_OK);
    CHECK(kvp_index_reserve_endpoint(idx, 2, 500) == KVP_OK);
    CHECK(kvp_index_reserve_endpoint(idx, KVP_MAX_ENDPOINT, 1) == KVP_E_ENDPOINT);
    CHECK(kvp_index_reserve(idx, 16, 64) == KVP_OK);
    enum { EHS = 200, REPS = 64 };
    kvp_engine_hash_t ehs[REPS];
    kvp_hash_t hs[REPS];
    for (int s = 0; s < 3000; s++) {
        kvp_endpoint_t ep = below(4) == 3 ? KVP_SHARED : below(3);
        size_t n = 1 + below(REPS);
        kvp_engine_hash_t one = below(8) == 0 ? below(EHS) : below(3);
        for (size_t i = 0; i < n; i++) {
            ehs[i] = below(3) == 0 ? below(EHS) : one;
            hs[i] = ehs[i] % 3; /* an engine hash always names the same block */
        }
        int tier = (int)below(3);
        switch (below(10)) {
        case 0:
        case 1:
            CHECK(kvp_index_remove(idx, ep, below(2) ? KVP_TIER_ANY : tier, ehs, n) == KVP_OK);
            break;
        case 2:
            CHECK(kvp_index_move(idx, ep, tier, (int)below(3), ehs, n) == KVP_OK);
            break;
        case 3:
            if (below(20) == 0) CHECK(kvp_index_clear(idx, ep) == KVP_OK);
            break;
        default:
            CHECK(kvp_index_store(idx, ep, tier, ehs, hs, n) == KVP_OK);
        }
    }
    if (max_entries == 0) { /* the phase did pass the inline limits */
        kvp_hash_t held[8];
        uint32_t counts[24], most = 0;
        size_t nh = 0;
        CHECK(kvp_index_holdings(idx, 0, held, counts, 8, &nh) == KVP_OK && nh > 0);
        for (size_t i = 0; i < 3 * nh; i++) most = counts[i] > most ? counts[i] : most;
        CHECK(most > 255);
    }
    for (kvp_endpoint_t ep = 0; ep < 4; ep++) { /* remove every reference, one call per tier */
        kvp_endpoint_t e = ep == 3 ? KVP_SHARED : ep;
        for (int round = 0; round < 70000; round++) {
            kvp_stats st;
            CHECK(kvp_index_stats(idx, &st) == KVP_OK);
            size_t before = st.removed_blocks;
            kvp_engine_hash_t all[EHS];
            for (size_t i = 0; i < EHS; i++) all[i] = i;
            CHECK(kvp_index_remove(idx, e, KVP_TIER_ANY, all, EHS) == KVP_OK);
            CHECK(kvp_index_stats(idx, &st) == KVP_OK);
            if (st.removed_blocks == before) break;
        }
    }
    kvp_stats st;
    CHECK(kvp_index_stats(idx, &st) == KVP_OK);
    CHECK(st.blocks == 0 && st.entries == 0 && st.engine_mappings == 0);
    kvp_index_free(idx);
    return 0;
}

/* Batches of token stores (some invalid: bad tier, endpoint, token, lengths, short extras,
 * unknown parents) into one index and the same requests one call at a time into another: the
 * per-request statuses, the counters and every endpoint's holdings must be identical. */
static int same_holdings(const kvp_index *a, const kvp_index *b, kvp_endpoint_t ep) {
    enum { HCAP = 4096 };
    static kvp_hash_t ha[HCAP], hb[HCAP];
    static uint32_t ca[3 * HCAP], cb[3 * HCAP];
    size_t na = 0, nb = 0;
    if (kvp_index_holdings(a, ep, ha, ca, HCAP, &na) != KVP_OK) return 0;
    if (kvp_index_holdings(b, ep, hb, cb, HCAP, &nb) != KVP_OK) return 0;
    if (na != nb) return 0;
    /* holdings come in table order, which may differ: compare as sets */
    for (size_t i = 0; i < na; i++) {
        size_t j = 0;
        while (j < nb && hb[j] != ha[i]) j++;
        if (j == nb || memcmp(&ca[3 * i], &cb[3 * j], 3 * sizeof(uint32_t)) != 0) return 0;
    }
    return 1;
}

static int batch_phase(uint64_t max_entries, int rounds) {
    enum { NR = 24, NB = 6, BS = 4 };
    kvp_index *a = NULL, *b = NULL;
    CHECK(kvp_index_new(max_entries, &a) == KVP_OK && kvp_index_new(max_entries, &b) == KVP_OK);
    static kvp_engine_hash_t ehs[NR][NB];
    static uint32_t toks[NR][NB * BS + 1];
    static uint64_t extra[NR][NB];
    kvp_store_tokens_req reqs[NR];
    kvp_store_result res[NR];
    size_t total_failed = 0, token_errors = 0;
    for (int round = 0; round < rounds; round++) {
        size_t n = below(NR + 1);
        for (size_t i = 0; i < n; i++) {
            kvp_store_tokens_req *r = &reqs[i];
            size_t nb = below(NB + 1);
            for (size_t k = 0; k < nb; k++) {
                ehs[i][k] = below(32);
                extra[i][k] = below(2);
            }
            for (size_t k = 0; k < nb * BS + 1; k++) toks[i][k] = below(3);
            memset(r, 0, sizeof *r);
            r->ep = below(16) == 0 ? KVP_MAX_ENDPOINT : pick_ep();
            r->tier = below(16) == 0 ? 3 : (int)below(3);
            r->has_parent = (int)below(2);
            r->parent = below(32);
            r->engine_hashes = ehs[i];
            r->n_blocks = nb;
            r->tokens = toks[i];
            r->dt = KVP_DT_U32;
            r->n_tokens = nb * BS + (below(16) == 0); /* sometimes one token too many */
            r->seed = below(2);
            if (below(4) == 0) {
                r->extra = extra[i];
                r->n_extra = nb - (nb > 0 && below(4) == 0); /* sometimes one short */
            }
            if (nb > 0 && below(16) == 0) { /* a token outside [0, 2^32) */
                r->dt = KVP_DT_U64;
                r->tokens = ehs[i]; /* read as u64 "tokens": n_tokens must match */
                r->n_tokens = nb;
                ehs[i][0] = 0x100000000ull;
                r->n_blocks = nb / BS; /* whole blocks of u64 tokens only */
            }
        }
        size_t done = 99, failed = 99;
        CHECK(kvp_index_store_tokens_batch(a, BS, reqs, n, res, &done, &failed) == KVP_OK);
        CHECK(done == n);
        size_t failed_single = 0;
        for (size_t i = 0; i < n; i++) {
            const kvp_store_tokens_req *r = &reqs[i];
            int stored = -1;
            size_t pos = 0;
            kvp_status st = kvp_index_store_tokens(b, r->ep, r->tier, r->has_parent, r->parent,
                                                   r->engine_hashes, r->n_blocks, r->tokens, r->dt,
                                                   r->n_tokens, BS, r->seed, r->extra, r->n_extra,
                                                   &stored, &pos);
            CHECK(st == res[i].status && stored == res[i].stored);
            if (st == KVP_E_TOKEN) CHECK(pos == res[i].err_pos);
            token_errors += st == KVP_E_TOKEN;
            failed_single += st != KVP_OK;
        }
        CHECK(failed == failed_single);
        total_failed += failed;
        kvp_stats sa, sb;
        CHECK(kvp_index_stats(a, &sa) == KVP_OK && kvp_index_stats(b, &sb) == KVP_OK);
        sa.memory_bytes = sb.memory_bytes = 0;
        CHECK(memcmp(&sa, &sb, sizeof sa) == 0);
        if (round % 16 == 0) {
            for (kvp_endpoint_t ep = 0; ep < 6; ep++) CHECK(same_holdings(a, b, ep));
            CHECK(same_holdings(a, b, KVP_SHARED));
        }
        if (below(8) == 0) { /* removes between batches, the same on both */
            kvp_endpoint_t ep = pick_ep();
            CHECK(kvp_index_remove(a, ep, KVP_TIER_ANY, ehs[0], NB) == KVP_OK);
            CHECK(kvp_index_remove(b, ep, KVP_TIER_ANY, ehs[0], NB) == KVP_OK);
        }
    }
    kvp_stats fin;
    CHECK(kvp_index_stats(a, &fin) == KVP_OK);
    CHECK(total_failed > 0 && token_errors > 0 && fin.stored_blocks > 0 && fin.orphan_stores > 0);
    size_t done = 0, failed = 0;
    CHECK(kvp_index_store_tokens_batch(NULL, BS, reqs, 1, res, &done, &failed) == KVP_E_NULL);
    CHECK(kvp_index_store_tokens_batch(a, BS, NULL, 1, res, &done, &failed) == KVP_E_NULL);
    CHECK(kvp_index_store_tokens_batch(a, BS, reqs, 1, NULL, &done, &failed) == KVP_E_NULL);
    CHECK(kvp_index_store_tokens_batch(a, BS, reqs, 1, res, NULL, &failed) == KVP_E_NULL);
    CHECK(kvp_index_store_tokens_batch(a, BS, NULL, 0, NULL, &done, &failed) == KVP_OK &&
          done == 0 && failed == 0);
    kvp_index_free(a);
    kvp_index_free(b);
    return 0;
}

int main(int argc, char **argv) {
    int steps = argc > 1 ? atoi(argv[1]) : 20000;
    uint64_t bounds[] = {0, 1, 3, 7, 40};
    for (size_t b = 0; b < sizeof bounds / sizeof bounds[0]; b++) {
        for (int round = 0; round < 4; round++) {
            if (run(bounds[b], steps) != 0) {
                fprintf(stderr, "failed: bound %llu round %d\n", (unsigned long long)bounds[b], round);
                return 1;
            }
        }
    }
    if (heavy_counts(0) != 0 || heavy_counts(2) != 0 || heavy_counts(500) != 0) {
        fprintf(stderr, "failed: heavy_counts\n");
        return 1;
    }
    if (batch_phase(0, 2000) != 0 || batch_phase(5, 2000) != 0 || batch_phase(60, 2000) != 0) {
        fprintf(stderr, "failed: batch_phase\n");
        return 1;
    }
    if (grow_and_shrink(0) != 0 || grow_and_shrink(5000) != 0) {
        fprintf(stderr, "failed: grow_and_shrink\n");
        return 1;
    }
    printf("ok\n");
    return 0;
}
