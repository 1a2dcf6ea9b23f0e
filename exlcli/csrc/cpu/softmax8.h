// 8-lane fp32 helpers of the AVX2 attention paths (attention_avx2.h, attention_quant.c): a
// horizontal sum in a fixed order, exp for max-subtracted scores, and a row's softmax over a range
// of keys with an optional sink logit. Needs AVX2 and FMA.
#pragma once
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

// Horizontal sum in one fixed order: halves, then pairs.
static inline float hsum8(__m256 v) {
    __m128 b = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    __m128 c = _mm_add_ps(b, _mm_movehl_ps(b, b));
    return _mm_cvtss_f32(_mm_add_ss(c, _mm_movehdup_ps(c)));
}

// exp(x) for x <= 0: 2^n e^r, |r| <= ln2/2, degree-7 Taylor polynomial; exp(0) is exactly 1. Below
// -87 (where 2^n would leave the normal range) it gives e^-87, 1.6e-38: nothing beside the row's
// largest term, which is 1.
static inline __m256 exp8(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.42860682030941723e-6f), r);
    __m256 p = _mm256_set1_ps(1.0f / 5040.0f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 720.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

// Softmax numerators in place over s[lo, limit), from lo's block of 8 on (keys before lo in that
// block and past limit up to a whole block get 0); returns their sum (lane j % 8 adds its keys in
// order, then hsum8), plus exp(*sink - max) for a sink logit (sink NULL: none), the max taken over
// the scores and the sink.
static inline float softmax_range8(float *s, int64_t lo, int64_t limit, const float *sink) {
    int64_t start = lo / 8 * 8, padded = (limit + 7) / 8 * 8;
    float mx = sink ? *sink : -INFINITY;
    for (int64_t j = lo; j < limit; j++) mx = s[j] > mx ? s[j] : mx;
    for (int64_t j = start; j < lo; j++) s[j] = -INFINITY;
    for (int64_t j = limit; j < padded; j++) s[j] = -INFINITY;
    __m256 vmax = _mm256_set1_ps(mx), sum = _mm256_setzero_ps();
    for (int64_t j = start; j < padded; j += 8) {
        __m256 x = _mm256_loadu_ps(s + j);
        __m256 e = _mm256_and_ps(exp8(_mm256_sub_ps(x, vmax)),  // keys outside the range: 0
                                 _mm256_cmp_ps(x, _mm256_set1_ps(-INFINITY), _CMP_NEQ_OQ));
        _mm256_storeu_ps(s + j, e);
        sum = _mm256_add_ps(sum, e);
    }
    float total = hsum8(sum);
    if (sink) total += _mm256_cvtss_f32(exp8(_mm256_set1_ps(*sink - mx)));
    return total;
}
