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
// The vectors run over the state's columns (Dv): every sum over rows adds them in order, so no sum
// is reordered; the L2 norms sum in order too.

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
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

// 8 floats (GCC/clang vector extension: AVX registers where there are some, pairs of SSE ones elsewhere).
typedef float v8 __attribute__((vector_size(32)));
static inline v8 load8(const float *p) { v8 x; memcpy(&x, p, sizeof x); return x; }
static inline void store8(float *p, v8 x) { memcpy(p, &x, sizeof x); }

#define TOKENS 64  // tokens whose normalized q and k a task prepares at once
#define COLS 16    // state columns a pass keeps in registers (Dv is a multiple of 16)

// One (sequence, value head): the sequence's tokens in runs of TOKENS; for each run, each block of COLS
// columns of the state goes through the run's tokens while it sits in L1 (columns are independent).
static void delta_task(void *ctx, int64_t begin, int64_t end) {
    const exl_gated_delta_args *a = ctx;
    const int64_t hv = a->v_heads, dk = a->k_dim, dv = a->v_dim;
    const int64_t group = hv / a->k_heads, key_dim = a->k_heads * dk;
    const int64_t head_elems = dk * dv;
    float *buf = malloc(sizeof(float) * (size_t)(2 * TOKENS * dk + TOKENS * dv));
    if (!buf) return;  // (out of memory: the caller's outputs stay unwritten)
    float *qn = buf, *kn = buf + TOKENS * dk, *vs = buf + 2 * TOKENS * dk;
    float decay[TOKENS], beta[TOKENS];
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
        for (int64_t t0 = a->begin[b]; t0 < a->end[b]; t0 += TOKENS) {
            const int64_t n = a->end[b] - t0 < TOKENS ? a->end[b] - t0 : TOKENS;
            for (int64_t t = 0; t < n; t++) {
                float *q = qn + t * dk, *k = kn + t * dk;
                load_row(a, t0 + t, kh * dk, dk, q);
                load_row(a, t0 + t, key_dim + kh * dk, dk, k);
                load_row(a, t0 + t, 2 * key_dim + h * dv, dv, vs + t * dv);
                l2_normalize(q, dk, a->eps, a->scale);
                l2_normalize(k, dk, a->eps, 1.0f);
                decay[t] = expf(a->g[(t0 + t) * hv + h]);
                beta[t] = a->beta[(t0 + t) * hv + h];
            }
            for (int64_t c = 0; c < dv; c += COLS) {
                for (int64_t t = 0; t < n; t++) {
                    const float *q = qn + t * dk, *k = kn + t * dk;
                    const v8 dec = {decay[t], decay[t], decay[t], decay[t], decay[t], decay[t], decay[t], decay[t]};
                    v8 r0 = {0}, r1 = {0};
                    for (int64_t i = 0; i < dk; i++) {  // S <- e^g S; read = S^T k
                        float *row = s + i * dv + c;
                        const v8 s0 = load8(row) * dec, s1 = load8(row + 8) * dec;
                        store8(row, s0);
                        store8(row + 8, s1);
                        r0 += s0 * k[i];
                        r1 += s1 * k[i];
                    }
                    const v8 u0 = (load8(vs + t * dv + c) - r0) * beta[t];
                    const v8 u1 = (load8(vs + t * dv + c + 8) - r1) * beta[t];
                    v8 o0 = {0}, o1 = {0};
                    for (int64_t i = 0; i < dk; i++) {  // S <- S + k u^T; o = S^T q
                        float *row = s + i * dv + c;
                        const v8 s0 = load8(row) + k[i] * u0, s1 = load8(row + 8) + k[i] * u1;
                        store8(row, s0);
                        store8(row + 8, s1);
                        o0 += s0 * q[i];
                        o1 += s1 * q[i];
                    }
                    float *o = a->out + ((t0 + t) * hv + h) * dv + c;
                    store8(o, o0);
                    store8(o + 8, o1);
                }
            }
        }
    }
    free(buf);
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

#define CONV_CHANNELS 64  // channels a task (a multiple of 8)

typedef int32_t v8i __attribute__((vector_size(32)));

// m ? a : b lane by lane (m: a comparison's all-ones or zero lanes; C has no vector ?:).
static inline v8 select8(v8i m, v8 a, v8 b) {
    v8i ai, bi;
    memcpy(&ai, &a, sizeof ai);
    memcpy(&bi, &b, sizeof bi);
    const v8i r = (m & ai) | (~m & bi);
    v8 out;
    memcpy(&out, &r, sizeof out);
    return out;
}

// e^x in 8 lanes, within 2 ulp of expf for x in [-87, 88] (clamped to it): x = n ln2 + r with
// n = round(x / ln2) (the 1.5 * 2^23 trick) and ln2 in two parts, SLEEF's degree-7 polynomial in r, then
// times 2^n built in the exponent bits. The convolution's SiLU takes it; torch's vectorized exp is
// SLEEF's, so the two differ by an fp32 rounding at most, which bf16 outputs rarely show.
static inline v8 exp8(v8 x) {
    const v8 lo = {-87.0f, -87.0f, -87.0f, -87.0f, -87.0f, -87.0f, -87.0f, -87.0f};
    const v8 hi = {88.0f, 88.0f, 88.0f, 88.0f, 88.0f, 88.0f, 88.0f, 88.0f};
    x = select8(x < lo, lo, x);
    x = select8(x > hi, hi, x);
    const float magic = 12582912.0f;  // 1.5 * 2^23
    const v8 t = x * 1.44269504088896340736f + magic;
    const v8 n = t - magic;
    v8i bits;
    memcpy(&bits, &t, sizeof bits);
    const v8i e = (bits - 0x4B400000 + 127) << 23;  // n's bits sit in t's low mantissa
    v8 r = x - n * 0.693145751953125f;
    r = r - n * 1.428606765330187045e-06f;
    v8 u = 0.000198527617612853646278381f + r * 0.0f;
    u = u * r + 0.00139304355252534151077271f;
    u = u * r + 0.00833336077630519866943359f;
    u = u * r + 0.0416664853692054748535156f;
    u = u * r + 0.166666671633720397949219f;
    u = u * r + 0.5f;
    u = 1.0f + ((r * r) * u + r);
    v8 scale;
    memcpy(&scale, &e, sizeof scale);
    return u * scale;
}

// One (sequence, block of CONV_CHANNELS channels): the last W inputs of each channel in a ring.
static void conv_task(void *ctx, int64_t begin, int64_t end) {
    const exl_causal_conv1d_args *a = ctx;
    const int64_t C = a->channels, W = a->width, chunks = (C + CONV_CHANNELS - 1) / CONV_CHANNELS;
    float w[MAX_WIDTH][CONV_CHANNELS], ring[MAX_WIDTH][CONV_CHANNELS];
    for (int64_t task = begin; task < end; task++) {
        const int64_t b = task / chunks, c0 = (task % chunks) * CONV_CHANNELS;
        const int64_t nc = C - c0 < CONV_CHANNELS ? C - c0 : CONV_CHANNELS;
        const int64_t first = a->begin[b], n = a->end[b] - first;
        const int32_t in_slot = a->in_slots[b];
        const uint16_t *state = in_slot < 0 ? NULL : a->in_states + (int64_t)in_slot * (W - 1) * C + c0;
        memset(w, 0, sizeof w);
        memset(ring, 0, sizeof ring);
        for (int64_t c = 0; c < nc; c++)
            for (int64_t j = 0; j < W; j++) w[j][c] = bf16_to_f32(a->weight[(c0 + c) * W + j]);
        // input p (the state's W - 1, then the tokens) sits in ring[p % W]
        for (int64_t p = 0; p < W - 1 && state; p++)
            for (int64_t c = 0; c < nc; c++) ring[p][c] = bf16_to_f32(state[p * C + c]);
        for (int64_t i = 0; i < n; i++) {
            const uint16_t *x = a->x + (first + i) * a->x_stride + c0;
            float *slot = ring[(W - 1 + i) % W];
            for (int64_t c = 0; c < nc; c++) slot[c] = bf16_to_f32(x[c]);
            uint16_t *o = a->out + (first + i) * C + c0;
            for (int64_t c = 0; c < nc; c += 8) {
                v8 acc = load8(ring[i % W] + c) * load8(w[0] + c);
                for (int64_t j = 1; j < W; j++) acc = acc + load8(ring[(i + j) % W] + c) * load8(w[j] + c);
                const v8 y = acc / (1.0f + exp8(-acc));
                for (int64_t l = 0; l < 8 && c + l < nc; l++) o[c + l] = f32_to_bf16(y[l]);
            }
        }
        // the new state: inputs n .. n + W - 2 (out may be the state read: every read is done)
        uint16_t *dst = a->out_states + (int64_t)a->out_slots[b] * (W - 1) * C + c0;
        for (int64_t p = 0; p < W - 1; p++) {
            const float *src = ring[(n + p) % W];
            for (int64_t c = 0; c < nc; c++) dst[p * C + c] = f32_to_bf16(src[c]);
        }
    }
}

// Returns 0, or -1 for a width it does not take.
int exl_causal_conv1d(const exl_causal_conv1d_args *a) {
    if (a->width < 2 || a->width > MAX_WIDTH || a->channels <= 0 || a->num_seqs < 0) return -1;
    const int64_t tasks = a->num_seqs * ((a->channels + CONV_CHANNELS - 1) / CONV_CHANNELS);
    exl_parallel_for(conv_task, (void *)a, tasks);
    return 0;
}
