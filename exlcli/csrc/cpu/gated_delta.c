// Gated DeltaNet (Qwen3-Next, Qwen3.5) on the CPU: the gated delta rule token by token and the short
// causal convolution, both over B sequences with their states in slots (exlcli/ops/gated_delta.py holds
// the torch references and the math).
//
// The delta rule runs the recurrent form for prompts too: per value head and token it touches the
// [Dk, Dv] state twice (decay and read S^T k; write k u^T and read S^T q), 2 Dk Dv multiply-adds, while
// the chunkwise form of 64-token chunks does about 2.4 Dk Dv a token in matmuls (K S0, Q S0, K^T U and
// the chunk's n x n products) for Dk = Dv = 128: on a CPU, where both run at the same vector width, it
// has no flops to save, and the state (64 KiB a head) stays in the core's L2 across a prompt.
// Each (sequence, value head) is one task of the pool; its numbers depend on nothing else in the batch.
//
// The inner loops run over the state's columns (Dv): elementwise, so the compiler vectorizes them
// without reordering any sum; the L2 norms sum in order.

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "args.h"
#include "bf16.h"
#include "pool.h"

#define MAX_DIM 256
#define MAX_WIDTH 8

int exl_gated_delta_available(void) { return 1; }

static void load_row(const exl_gated_delta_args *a, int64_t row, int64_t offset, int64_t n, float *dst) {
    if (a->mixed_fp32) {
        memcpy(dst, (const float *)a->mixed + row * a->mixed_stride + offset, (size_t)n * sizeof(float));
    } else {
        const uint16_t *src = (const uint16_t *)a->mixed + row * a->mixed_stride + offset;
        for (int64_t i = 0; i < n; i++) dst[i] = bf16_to_f32(src[i]);
    }
}

// x * (1 / sqrt(sum x^2 + eps)) * factor, as the reference's l2norm (then the query scale).
static void l2_normalize(float *x, int64_t n, float eps, float factor) {
    float sum = 0.0f;
    for (int64_t i = 0; i < n; i++) sum += x[i] * x[i];
    const float r = 1.0f / sqrtf(sum + eps);
    for (int64_t i = 0; i < n; i++) x[i] = x[i] * r * factor;
}

static void delta_task(void *ctx, int64_t begin, int64_t end) {
    const exl_gated_delta_args *a = ctx;
    const int64_t hv = a->v_heads, dk = a->k_dim, dv = a->v_dim;
    const int64_t group = hv / a->k_heads, key_dim = a->k_heads * dk;
    const int64_t head_elems = dk * dv;
    float q[MAX_DIM], k[MAX_DIM], v[MAX_DIM], read[MAX_DIM], o[MAX_DIM];
    for (int64_t task = begin; task < end; task++) {
        const int64_t b = task / hv, h = task % hv, kh = h / group;
        float *restrict s = a->out_states + ((int64_t)a->out_slots[b] * hv + h) * head_elems;
        const int32_t in_slot = a->in_slots[b];
        if (in_slot < 0) {
            memset(s, 0, (size_t)head_elems * sizeof(float));
        } else {
            const float *src = a->in_states + ((int64_t)in_slot * hv + h) * head_elems;
            if (src != s) memcpy(s, src, (size_t)head_elems * sizeof(float));
        }
        for (int64_t t = a->begin[b]; t < a->end[b]; t++) {
            load_row(a, t, kh * dk, dk, q);
            load_row(a, t, key_dim + kh * dk, dk, k);
            load_row(a, t, 2 * key_dim + h * dv, dv, v);
            l2_normalize(q, dk, a->eps, a->scale);
            l2_normalize(k, dk, a->eps, 1.0f);
            const float decay = expf(a->g[t * hv + h]), beta = a->beta[t * hv + h];
            for (int64_t j = 0; j < dv; j++) read[j] = 0.0f;
            for (int64_t i = 0; i < dk; i++) {  // S <- e^g S; read = S^T k
                float *restrict row = s + i * dv;
                const float ki = k[i];
                for (int64_t j = 0; j < dv; j++) {
                    row[j] *= decay;
                    read[j] += row[j] * ki;
                }
            }
            for (int64_t j = 0; j < dv; j++) {
                read[j] = (v[j] - read[j]) * beta;  // u
                o[j] = 0.0f;
            }
            for (int64_t i = 0; i < dk; i++) {  // S <- S + k u^T; o = S^T q
                float *restrict row = s + i * dv;
                const float ki = k[i], qi = q[i];
                for (int64_t j = 0; j < dv; j++) {
                    row[j] += ki * read[j];
                    o[j] += row[j] * qi;
                }
            }
            memcpy(a->out + (t * hv + h) * dv, o, (size_t)dv * sizeof(float));
        }
    }
}

// Returns 0, or -1 for a shape it does not take (exlcli/ops/gated_delta.py: unsupported_shape).
int exl_gated_delta(const exl_gated_delta_args *a) {
    if (a->k_dim <= 0 || a->k_dim > MAX_DIM || a->v_dim <= 0 || a->v_dim > MAX_DIM || a->k_heads <= 0
        || a->v_heads % a->k_heads || a->num_seqs < 0)
        return -1;
    const int64_t tasks = a->num_seqs * a->v_heads;
    exl_parallel_for_chunks(delta_task, (void *)a, tasks, tasks);
    return 0;
}

// --- the causal convolution --------------------------------------------------------------------------

#define CONV_CHANNELS 256  // channels a task

static inline float silu(float x) { return x / (1.0f + expf(-x)); }

static void conv_task(void *ctx, int64_t begin, int64_t end) {
    const exl_causal_conv1d_args *a = ctx;
    const int64_t C = a->channels, W = a->width, chunks = (C + CONV_CHANNELS - 1) / CONV_CHANNELS;
    float w[CONV_CHANNELS * MAX_WIDTH];
    uint16_t fresh[(MAX_WIDTH - 1) * CONV_CHANNELS];
    for (int64_t task = begin; task < end; task++) {
        const int64_t b = task / chunks, c0 = (task % chunks) * CONV_CHANNELS;
        const int64_t nc = C - c0 < CONV_CHANNELS ? C - c0 : CONV_CHANNELS;
        const int64_t first = a->begin[b], n = a->end[b] - first;
        const int32_t in_slot = a->in_slots[b];
        const uint16_t *state = in_slot < 0 ? NULL : a->in_states + (int64_t)in_slot * (W - 1) * C + c0;
        for (int64_t c = 0; c < nc; c++)
            for (int64_t j = 0; j < W; j++) w[j * CONV_CHANNELS + c] = bf16_to_f32(a->weight[(c0 + c) * W + j]);
        // the window's input p (0 .. n + W - 2): the state's W - 1, then the tokens'
#define INPUT(p, c) ((p) < W - 1 ? (state ? state[(p) * C + (c)] : (uint16_t)0) \
                                 : a->x[(first + (p) - (W - 1)) * a->x_stride + c0 + (c)])
        for (int64_t i = 0; i < n; i++) {
            uint16_t *o = a->out + (first + i) * C + c0;
            for (int64_t c = 0; c < nc; c++) {
                float acc = bf16_to_f32(INPUT(i, c)) * w[c];
                for (int64_t j = 1; j < W; j++) acc = acc + bf16_to_f32(INPUT(i + j, c)) * w[j * CONV_CHANNELS + c];
                o[c] = f32_to_bf16(silu(acc));
            }
        }
        // the new state: the last W - 1 inputs, gathered before any is written (out may be the state read)
        for (int64_t p = 0; p < W - 1; p++)
            for (int64_t c = 0; c < nc; c++) fresh[p * CONV_CHANNELS + c] = INPUT(n + p, c);
#undef INPUT
        uint16_t *dst = a->out_states + (int64_t)a->out_slots[b] * (W - 1) * C + c0;
        for (int64_t p = 0; p < W - 1; p++) memcpy(dst + p * C, fresh + p * CONV_CHANNELS, (size_t)nc * 2);
    }
}

// Returns 0, or -1 for a width it does not take.
int exl_causal_conv1d(const exl_causal_conv1d_args *a) {
    if (a->width < 2 || a->width > MAX_WIDTH || a->channels <= 0 || a->num_seqs < 0) return -1;
    const int64_t tasks = a->num_seqs * ((a->channels + CONV_CHANNELS - 1) / CONV_CHANNELS);
    exl_parallel_for(conv_task, (void *)a, tasks);
    return 0;
}
