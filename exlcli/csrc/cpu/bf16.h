// bf16 <-> fp32 conversions shared by the CPU kernels: bf16 values travel as uint16_t bit patterns.
//
// fp32 -> bf16 rounds to nearest even and turns every NaN into 0xffff (a NaN), as torch's
// vectorised conversion does, so kernels that must match torch bit for bit (norm, rope,
// activation) can use it, and the others get the same rule. bf16 -> fp32 is exact.
//
// The vector helpers need AVX-512 and are compiled only where the target has it (the masked ones
// also need BW and VL); the 8-lane ones at the end need AVX2; the scalar ones compile everywhere.
#pragma once
#include <stdint.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t v) {
    uint32_t u = (uint32_t)v << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    if (f != f) return 0xffff;
    uint32_t u;
    memcpy(&u, &f, 4);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

#if defined(__AVX512F__)
#include <immintrin.h>

// 16 bf16 -> 16 fp32.
static inline __m512 bf16_load16(const uint16_t *p) {
    __m256i h = _mm256_loadu_si256((const __m256i *)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// fp32 -> bf16 bit patterns (round to nearest even, NaN to 0xffff), one per 32-bit lane.
static inline __m512i bf16_bits(__m512 v) {
    __m512i u = _mm512_castps_si512(v);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    return _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0xffff));
}

// v rounded to bf16 precision, still fp32 (for arithmetic that the reference does on bf16 values).
static inline __m512 bf16_round(__m512 v) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits(v), 16));
}

// 16 fp32 -> 16 bf16, rounded, packed into 256 bits.
static inline __m256i bf16_pack16(__m512 v) { return _mm512_cvtepi32_epi16(bf16_bits(v)); }

static inline void bf16_store16(uint16_t *p, __m512 v) { _mm256_storeu_si256((__m256i *)p, bf16_pack16(v)); }

#if defined(__AVX512BW__) && defined(__AVX512VL__)

// The first n lanes (all 16 when n >= 16).
static inline __mmask16 lanes16(int64_t n) { return n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1u); }

// bf16 -> fp32 in the lanes of m; the others 0 (their memory is not read).
static inline __m512 bf16_load16_masked(const uint16_t *p, __mmask16 m) {
    __m256i h = _mm256_maskz_loadu_epi16(m, p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// v rounded to bf16, stored in the lanes of m only.
static inline void bf16_store16_masked(uint16_t *p, __m512 v, __mmask16 m) {
    _mm256_mask_storeu_epi16(p, m, bf16_pack16(v));
}

#endif  // BW, VL
#endif  // AVX512F

#if defined(__AVX2__)
#include <immintrin.h>

// The 8-lane helpers of the AVX2 paths: the same conversions, rounding and NaN rule as above, on
// the first n lanes (all 8 when n >= 8; the others read as 0, their memory never touched).

static inline __m256 bf16_load8_n(const uint16_t *p, int64_t n) {
    __m128i h;
    if (n >= 8) {
        h = _mm_loadu_si128((const __m128i *)p);
    } else {
        uint16_t t[8] = {0};
        memcpy(t, p, (size_t)n * sizeof(uint16_t));
        h = _mm_loadu_si128((const __m128i *)t);
    }
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

static inline __m256 f32_load8_n(const float *p, int64_t n) {
    if (n >= 8) return _mm256_loadu_ps(p);
    float t[8] = {0};
    memcpy(t, p, (size_t)n * sizeof(float));
    return _mm256_loadu_ps(t);
}

static inline __m256i bf16_bits8(__m256 v) {
    __m256i u = _mm256_castps_si256(v);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
    __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    return _mm256_blendv_epi8(r, _mm256_set1_epi32(0xffff), nan);
}

static inline __m256 bf16_round8(__m256 v) { return _mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits8(v), 16)); }

static inline void bf16_store8_n(uint16_t *p, __m256 v, int64_t n) {
    __m256i b = bf16_bits8(v);  // 0 .. 0xffff per lane: the unsigned pack keeps them as they are
    __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1));
    if (n >= 8) {
        _mm_storeu_si128((__m128i *)p, packed);
    } else {
        uint16_t t[8];
        _mm_storeu_si128((__m128i *)t, packed);
        memcpy(p, t, (size_t)n * sizeof(uint16_t));
    }
}

#endif  // AVX2
