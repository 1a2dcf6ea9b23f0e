// Rotary position embedding (rotate-half form) on bf16 q and k, fused with writing k and v into
// their cache pages, on the CPU.
//
// Bitwise the same as the torch reference (exlcli/ops/rope.py), which computes elementwise in fp32
// with one rounding per op and then rounds to bf16:
//   out[i]       = bf16((x[i] * cos[i]) - (x[i + D/2] * sin[i]))
//   out[i + D/2] = bf16((x[i + D/2] * cos[i]) + (x[i] * sin[i]))        for i < D/2
// with cos and sin read from the fp32 cache row of the token's position. Products are rounded
// before the add: separate mul and add instructions, never contracted into FMAs.
//
// Token t's k and v go to cache slot slots[t] (page * page_size + offset) of the caches
// [num_slots, kv_heads, D]. Positions and slots are checked against their bounds before anything
// is read or written, so a bad index returns an error instead of touching memory. Enough tokens
// are shared among the pool's threads (csrc/cpu/pool.h); a token's numbers never depend on which
// thread computes it.

#include <stdint.h>

#include "args.h"
#include "bf16.h"
#include "pool.h"

// No fused multiply-add contraction: the reference rounds every product (see above).
#if defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define EXL_ROPE 1
#include <immintrin.h>
#elif defined(__AVX2__)
#define EXL_ROPE 2  // 8 lanes, the same elementwise arithmetic
#include <immintrin.h>
#include <string.h>
#else
#define EXL_ROPE 0
#endif

int exl_rope_available(void) { return EXL_ROPE != 0; }

#if EXL_ROPE == 1

#define LANES 16

// One head of d values: x -> out, rotated by the cos | sin row cs.
static inline void rotate_head(const uint16_t *x, uint16_t *out, const float *cs, int64_t d) {
    const int64_t half = d / 2;
    for (int64_t i = 0; i < half; i += LANES) {
        __mmask16 m = lanes16(half - i);
        __m512 c = _mm512_maskz_loadu_ps(m, cs + i), s = _mm512_maskz_loadu_ps(m, cs + half + i);
        __m512 x1 = bf16_load16_masked(x + i, m), x2 = bf16_load16_masked(x + half + i, m);
        bf16_store16_masked(out + i, _mm512_sub_ps(_mm512_mul_ps(x1, c), _mm512_mul_ps(x2, s)), m);
        bf16_store16_masked(out + half + i, _mm512_add_ps(_mm512_mul_ps(x2, c), _mm512_mul_ps(x1, s)), m);
    }
}

static inline void copy_head(const uint16_t *x, uint16_t *out, int64_t d) {
    for (int64_t i = 0; i < d; i += 32) {
        __mmask32 m = d - i >= 32 ? 0xffffffffu : (__mmask32)((1u << (d - i)) - 1u);
        _mm512_mask_storeu_epi16(out + i, m, _mm512_maskz_loadu_epi16(m, x + i));
    }
}

#elif EXL_ROPE == 2

static inline void rotate_head(const uint16_t *x, uint16_t *out, const float *cs, int64_t d) {
    const int64_t half = d / 2;
    for (int64_t i = 0; i < half; i += 8) {
        int64_t n = half - i;
        __m256 c = f32_load8_n(cs + i, n), s = f32_load8_n(cs + half + i, n);
        __m256 x1 = bf16_load8_n(x + i, n), x2 = bf16_load8_n(x + half + i, n);
        bf16_store8_n(out + i, _mm256_sub_ps(_mm256_mul_ps(x1, c), _mm256_mul_ps(x2, s)), n);
        bf16_store8_n(out + half + i, _mm256_add_ps(_mm256_mul_ps(x2, c), _mm256_mul_ps(x1, s)), n);
    }
}

static inline void copy_head(const uint16_t *x, uint16_t *out, int64_t d) {
    memcpy(out, x, (size_t)d * sizeof(uint16_t));
}

#endif

#if EXL_ROPE

// Below this many rotated values a call stays on the caller's thread: waking the pool costs more.
#define PARALLEL_MIN_ELEMS 32768

typedef struct {
    const uint16_t *q, *k, *v;
    int64_t q_st, q_sh, k_st, k_sh, v_st, v_sh;
    const int64_t *positions, *slots;
    const float *cos_sin;
    uint16_t *k_cache, *v_cache, *q_out;
    int64_t heads, kv_heads, d;
} rope_args;

static void rope_tokens(void *ctx, int64_t begin, int64_t end) {
    const rope_args *a = (const rope_args *)ctx;
    const int64_t d = a->d, heads = a->heads, kv_heads = a->kv_heads;
    for (int64_t t = begin; t < end; t++) {
        const float *cs = a->cos_sin + a->positions[t] * d;
        for (int64_t h = 0; h < heads; h++)
            rotate_head(a->q + t * a->q_st + h * a->q_sh, a->q_out + (t * heads + h) * d, cs, d);
        uint16_t *kc = a->k_cache + a->slots[t] * kv_heads * d, *vc = a->v_cache + a->slots[t] * kv_heads * d;
        for (int64_t h = 0; h < kv_heads; h++) {
            rotate_head(a->k + t * a->k_st + h * a->k_sh, kc + h * d, cs, d);
            copy_head(a->v + t * a->v_st + h * a->v_sh, vc + h * d, d);
        }
    }
}

// q [T, heads, d], k and v [T, kv_heads, d]: strides (per token, per head) in elements, last dim
// contiguous. cos_sin [max_pos, d] fp32. q_out [T, heads, d] contiguous.
// Returns 0, or -1 for a position outside [0, max_pos), -2 for a slot outside [0, num_slots),
// -3 for an odd or empty head_dim; nothing is written unless it returns 0.
int exl_rope_and_write_kv(const exl_rope_and_write_kv_args *args) {
    const uint16_t *q = args->q, *k = args->k, *v = args->v;
    int64_t q_st = args->q_token_stride, q_sh = args->q_head_stride;
    int64_t k_st = args->k_token_stride, k_sh = args->k_head_stride;
    int64_t v_st = args->v_token_stride, v_sh = args->v_head_stride;
    const int64_t *positions = args->positions, *slots = args->slots;
    const float *cos_sin = args->cos_sin;
    int64_t max_pos = args->max_positions, num_slots = args->num_slots;
    uint16_t *k_cache = args->k_cache, *v_cache = args->v_cache, *q_out = args->q_out;
    int64_t heads = args->heads, kv_heads = args->kv_heads, d = args->dim, tokens = args->tokens;
    if (d <= 0 || d % 2 != 0 || tokens < 0) return -3;
    for (int64_t t = 0; t < tokens; t++) {
        if (positions[t] < 0 || positions[t] >= max_pos) return -1;
        if (slots[t] < 0 || slots[t] >= num_slots) return -2;
    }
    rope_args a = {q, k, v, q_st, q_sh, k_st, k_sh, v_st, v_sh, positions, slots, cos_sin,
                   k_cache, v_cache, q_out, heads, kv_heads, d};
    if (tokens * (heads + kv_heads) * d >= PARALLEL_MIN_ELEMS) exl_parallel_for(rope_tokens, &a, tokens);
    else rope_tokens(&a, 0, tokens);
    return 0;
}

#endif
