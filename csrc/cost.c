/* The routing seed's cost, vectorised over candidates, and selection (argmin / softmax).
 * Operation order matches kvplug/_reference.py exactly so results are bit-identical; the build
 * uses -ffp-contract=off so no multiply-add is fused. */
#include <math.h>

#include "kvplug.h"

kvp_status kvp_costs(const double *prefill, const double *device, const double *host,
                     const double *disk, const double *shared_beyond, const double *decode,
                     size_t n, const kvp_cost_params *p, double *out) {
    if (p == NULL) return KVP_E_NULL;
    if (n == 0) return KVP_OK;
    if (!prefill || !device || !host || !disk || !shared_beyond || !decode || !out)
        return KVP_E_NULL;
    for (size_t i = 0; i < n; i++) {
        double adj = prefill[i] - p->overlap_score_credit * device[i];
        adj = adj - p->host_cache_hit_weight * host[i];
        adj = adj - p->disk_cache_hit_weight * disk[i];
        adj = adj - p->shared_cache_multiplier * shared_beyond[i];
        if (0.0 > adj) adj = 0.0; /* Python's max(adj, 0.0): keeps adj unless 0.0 is greater */
        out[i] = p->prefill_load_scale * adj + decode[i];
    }
    return KVP_OK;
}

kvp_status kvp_select(const double *cost, size_t n, double temperature, double u,
                      size_t *chosen) {
    if (chosen == NULL) return KVP_E_NULL;
    if (n == 0) return KVP_E_ARG;
    if (cost == NULL) return KVP_E_NULL;
    if (!(u >= 0.0 && u < 1.0)) return KVP_E_ARG;
    if (isnan(temperature) || temperature < 0) return KVP_E_ARG;
    double lo = cost[0], hi = cost[0];
    for (size_t i = 0; i < n; i++) {
        if (isnan(cost[i])) return KVP_E_ARG;
        if (cost[i] < lo) lo = cost[i];
        if (cost[i] > hi) hi = cost[i];
    }
    if (temperature == 0) {
        size_t tied = 0;
        for (size_t i = 0; i < n; i++) tied += cost[i] == lo;
        size_t pick = (size_t)(u * (double)tied);
        if (pick >= tied) pick = tied - 1;
        for (size_t i = 0; i < n; i++) {
            if (cost[i] != lo) continue;
            if (pick == 0) {
                *chosen = i;
                return KVP_OK;
            }
            pick--;
        }
        *chosen = n - 1; /* unreachable: lo is one of the costs */
        return KVP_OK;
    }
    if (hi == lo) { /* uniform */
        double pr = 1.0 / (double)n, acc = 0.0;
        for (size_t i = 0; i < n; i++) {
            acc += pr;
            if (u < acc) {
                *chosen = i;
                return KVP_OK;
            }
        }
        *chosen = n - 1;
        return KVP_OK;
    }
    double span = hi - lo, s = 0.0;
    for (size_t i = 0; i < n; i++) s += exp(-((cost[i] - lo) / span) / temperature);
    double acc = 0.0;
    for (size_t i = 0; i < n; i++) {
        acc += exp(-((cost[i] - lo) / span) / temperature) / s;
        if (u < acc) {
            *chosen = i;
            return KVP_OK;
        }
    }
    *chosen = n - 1;
    return KVP_OK;
}
