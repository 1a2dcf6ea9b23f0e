// The router of a mixture-of-experts layer on the CPU (exlcli/ops/cpu/moe_router.py; the one-call layer of
// decoder.c): each token's expert logits, then its k experts and their weights (exlcli/ops/moe.py's route()):
//   softmax_topk (kind 0): softmax over every expert, then the k best (ties to the lower id); with normalize
//   the k weights divided by their sum (Mixtral, Qwen3-MoE's norm_topk_prob);
//   topk_softmax (kind 1): the k best logits, then a softmax over those k (gpt-oss).
// The logits are fp32: a dense bf16 router's dot products summed in fp32 in a fixed order (16 lanes, then
// their tree), a quantized one's straight from exl_qmatmul's fp32 output. Each token's row depends on that
// row alone, so a row's experts do not depend on the batch around it.

#include <math.h>
#include <stdlib.h>

#include "args.h"
#include "bf16.h"
#include "pool.h"

int exl_moe_router_available(void) { return 1; }

// logits[t, e] = sum_h x[t, h] * w[e, h], in fp32: 16 running sums per row, added pairwise at the end.
static void dense_logits(void *ctx, int64_t begin, int64_t end) {
    const exl_moe_router_args *a = (const exl_moe_router_args *)ctx;
    const int64_t H = a->hidden, E = a->num_experts;
    for (int64_t t = begin; t < end; t++) {
        const uint16_t *x = a->x + t * H;
        for (int64_t e = 0; e < E; e++) {
            const uint16_t *w = a->weight + e * H;
            float acc[16] = {0};
            int64_t h = 0;
            for (; h + 16 <= H; h += 16)
                for (int l = 0; l < 16; l++) acc[l] += bf16_to_f32(x[h + l]) * bf16_to_f32(w[h + l]);
            for (int l = 0; h < H; h++, l++) acc[l] += bf16_to_f32(x[h]) * bf16_to_f32(w[h]);
            for (int n = 8; n >= 1; n /= 2)
                for (int l = 0; l < n; l++) acc[l] += acc[l + n];
            a->logits[t * E + e] = acc[0];
        }
    }
}

// the k largest of v[0 .. E - 1] in descending order, ties to the lower index (torch.topk's order)
static void top_k(const float *v, int64_t E, int64_t k, float *vals, int64_t *ids) {
    for (int64_t j = 0; j < k; j++) {
        int64_t best = -1;
        for (int64_t e = 0; e < E; e++) {
            int taken = 0;
            for (int64_t i = 0; i < j; i++) taken |= ids[i] == e;
            if (!taken && (best < 0 || v[e] > v[best])) best = e;
        }
        ids[j] = best;
        vals[j] = v[best];
    }
}

static void route_rows(void *ctx, int64_t begin, int64_t end) {
    const exl_moe_router_args *a = (const exl_moe_router_args *)ctx;
    const int64_t E = a->num_experts, k = a->top_k;
    for (int64_t t = begin; t < end; t++) {
        float *l = a->logits + t * E, *w = a->weights + t * k;
        int64_t *ids = a->ids + t * k;
        if (a->kind == 0) {  // softmax over every expert (in place), then the top k
            float m = l[0], s = 0.0f;
            for (int64_t e = 1; e < E; e++) m = l[e] > m ? l[e] : m;
            for (int64_t e = 0; e < E; e++) s += (l[e] = expf(l[e] - m));
            for (int64_t e = 0; e < E; e++) l[e] /= s;
            top_k(l, E, k, w, ids);
            if (a->normalize) {
                float sum = 0.0f;
                for (int64_t j = 0; j < k; j++) sum += w[j];
                for (int64_t j = 0; j < k; j++) w[j] /= sum;
            }
        } else {  // the top k logits, then their softmax (the first is the largest)
            top_k(l, E, k, w, ids);
            float s = 0.0f, m = w[0];
            for (int64_t j = 0; j < k; j++) s += (w[j] = expf(w[j] - m));
            for (int64_t j = 0; j < k; j++) w[j] /= s;
        }
    }
}

// Returns 0; -1 no kernel for the quantized router; 6 sizes that do not fit together.
int exl_moe_router(const exl_moe_router_args *a) {
    const int64_t T = a->tokens, H = a->hidden, E = a->num_experts, k = a->top_k;
    if (T < 0 || H <= 0 || E < 1 || k < 1 || k > E || a->kind < 0 || a->kind > 1) return 6;
    if ((a->weight == 0) == (a->parts == 0)) return 6;
    if (T == 0) return 0;
    if (a->weight) {
        if (T * E * H >= 1 << 20) exl_parallel_for(dense_logits, (void *)a, T);
        else dense_logits((void *)a, 0, T);
    } else {  // one quantized part, its fp32 output
        exl_qmatmul_args q = *a->parts;
        if (q.in_features != H || q.out_features != E) return 6;
        q.x = a->x, q.rows = T, q.y = a->logits, q.y_fp32 = 1;
        if (exl_qmatmul(&q)) return -1;
    }
    if (T * E >= 1 << 14) exl_parallel_for(route_rows, (void *)a, T);
    else route_rows((void *)a, 0, T);
    return 0;
}
