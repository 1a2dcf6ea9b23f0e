// The routed experts of a mixture-of-experts layer in one call, for MoeFeedForward on the CPU
// (exlcli/ops/moe.py, through exlcli/ops/cpu/moe_experts.py) and for the one-call layer (decoder.c). The router
// and its top k come before it (moe_router.c, or torch); given each token's experts and weights this runs, from
// C, what the per-expert Python path runs, in its order and with its arguments, so the sums come out bit for bit
// as there (and as batch-invariant):
//   the token slots (token, j) sorted by expert, stably (tokens in order within an expert), and x's rows
//   gathered so; per active expert e, over its rows: gu = x_e @ Wgate_up(e) (bf16), a = silu_and_mul(gu),
//   y_e = a @ Wdown(e) (bf16); out[t] = sum over t's slots in ascending expert order of float(y) * w,
//   each product rounded, from 0 (the fp32 index_add_ of the Python path).
// The matmuls of all the active experts are one job of the pool (qmatmul_grouped): the threads share
// (expert, 16-column group) units, and each expert's weights are read once for all of its tokens.

#include <stdlib.h>
#include <string.h>

#include "args.h"
#include "bf16.h"
#include "pool.h"
#include "qmatmul.h"

// The weighted sum rounds each product before its add, as torch's mul then index_add_ do.
#if defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

int exl_qmatmul_available(void);
int exl_activation_available(void);

int exl_moe_experts_available(void) { return exl_qmatmul_available() && exl_activation_available(); }

typedef struct {
    const exl_moe_experts_args *a;
    const uint16_t *y;      // bf16 [T * top_k, hidden]: the slots' down outputs, grouped by expert
    const int64_t *pos;     // [T, top_k]: where slot (t, j) sits in y
} weighted_sum_task;

static void weighted_sums(void *ctx, int64_t begin, int64_t end) {
    const weighted_sum_task *w = (const weighted_sum_task *)ctx;
    const exl_moe_experts_args *a = w->a;
    const int64_t H = a->hidden, k = a->top_k;
    int64_t order[64];
    for (int64_t t = begin; t < end; t++) {
        // t's slots in ascending expert order, ties in slot order: the order index_add_ adds them
        for (int64_t j = 0; j < k; j++) {
            int64_t i = j;
            while (i > 0 && a->ids[t * k + order[i - 1]] > a->ids[t * k + j]) {
                order[i] = order[i - 1];
                i--;
            }
            order[i] = j;
        }
        float *o = a->out + t * H;
        for (int64_t h = 0; h < H; h++) o[h] = 0.0f;
        for (int64_t s = 0; s < k; s++) {
            int64_t j = order[s];
            const uint16_t *y = w->y + w->pos[t * k + j] * H;
            const float wt = a->weights[t * k + j];
            for (int64_t h = 0; h < H; h++) {
                float p = bf16_to_f32(y[h]) * wt;
                o[h] = o[h] + p;
            }
        }
    }
}

// Returns 0; -1 out of memory or no kernel built; 6 sizes that do not fit together; 7 an expert id outside
// 0 .. num_experts - 1.
int exl_moe_experts(const exl_moe_experts_args *a) {
    const int64_t T = a->tokens, H = a->hidden, I = a->inter, k = a->top_k, E = a->num_experts;
    if (!exl_moe_experts_available()) return -1;
    if (T < 0 || H <= 0 || I <= 0 || k < 1 || k > 64 || E < 1 || a->gate_up_parts < 1 || a->down_parts < 1) return 6;
    if (T == 0) return 0;
    for (int64_t i = 0; i < T * k; i++)
        if (a->ids[i] < 0 || a->ids[i] >= E) return 7;
    const int64_t S = T * k;
    int64_t *first = (int64_t *)calloc((size_t)(E + 1), sizeof(int64_t));
    int64_t *fill = (int64_t *)calloc((size_t)E, sizeof(int64_t));
    int64_t *pos = (int64_t *)malloc(sizeof(int64_t) * (size_t)S);
    qmm_group *groups = (qmm_group *)malloc(sizeof(qmm_group) * (size_t)E);
    uint16_t *xg = (uint16_t *)malloc(sizeof(uint16_t) * (size_t)(S * H));  // gathered x, then the down outputs
    uint16_t *gu = (uint16_t *)malloc(sizeof(uint16_t) * (size_t)(S * 2 * I));
    uint16_t *act = (uint16_t *)malloc(sizeof(uint16_t) * (size_t)(S * I));
    int rc = -1;
    if (!first || !fill || !pos || !groups || !xg || !gu || !act) goto done;
    // a stable counting sort of the slots by expert
    for (int64_t i = 0; i < S; i++) first[a->ids[i] + 1]++;
    for (int64_t e = 0; e < E; e++) first[e + 1] += first[e];
    for (int64_t i = 0; i < S; i++) {
        int64_t e = a->ids[i], p = first[e] + fill[e]++;
        pos[i] = p;
        memcpy(xg + p * H, a->x + (i / k) * H, sizeof(uint16_t) * (size_t)H);
    }
    int64_t n = 0;
    for (int64_t e = 0; e < E; e++) {
        if (first[e + 1] == first[e]) continue;
        qmm_group g = {a->gate_up + e * a->gate_up_parts, a->gate_up_parts, first[e], first[e + 1] - first[e],
                       gu + first[e] * 2 * I, 2 * I};
        groups[n++] = g;
    }
    for (int64_t i = 0; i < n; i++) {  // every part's width must add up to the layer's
        int64_t col = 0;
        for (int64_t p = 0; p < groups[i].n_parts; p++) col += groups[i].parts[p].out_features;
        if (col != 2 * I) {
            rc = 6;
            goto done;
        }
    }
    if ((rc = qmatmul_grouped(groups, n, xg, S, H))) goto done;
    exl_silu_and_mul_args s = {gu, 2 * I, act, I, I, S};
    if ((rc = exl_silu_and_mul(&s) ? 6 : 0)) goto done;
    for (int64_t i = 0; i < n; i++) {
        int64_t e = (groups[i].parts - a->gate_up) / a->gate_up_parts, col = 0;
        const exl_qmatmul_args *parts = a->down + e * a->down_parts;
        for (int64_t p = 0; p < a->down_parts; p++) col += parts[p].out_features;
        if (col != H) {
            rc = 6;
            goto done;
        }
        groups[i].parts = parts;
        groups[i].n_parts = a->down_parts;
        groups[i].y = xg + groups[i].row0 * H;
        groups[i].ldy = H;
    }
    if ((rc = qmatmul_grouped(groups, n, act, S, I))) goto done;
    weighted_sum_task w = {a, xg, pos};
    if (T * H >= 32768) exl_parallel_for(weighted_sums, &w, T);
    else weighted_sums(&w, 0, T);
done:
    free(first), free(fill), free(pos), free(groups), free(xg), free(gu), free(act);
    return rc == 1 ? -1 : rc;
}
