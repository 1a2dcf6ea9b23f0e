// SiLU(gate) * up over a fused bf16 [T, 2I] gate|up row, on the CPU.
//
// Bitwise the same as the torch reference (exlcli/ops/activation.py: F.silu(gate) * up on bf16):
//   s = bf16(g / (1 + exp(-g)))    (fp32; exp as SLEEF's expf_u10, torch's vectorised exp)
//   out = bf16(s * up)             (the product of two bf16 values is exact in fp32)
// torch runs the last I % 32 elements of a row through its scalar function, whose exp is libm's
// expf; for every one of the 65536 bf16 inputs both give the same bf16 silu (the tests check all
// of them), so one vector path serves the whole row. Each element is computed alone: no
// dependence on the row count, the row's place or the thread (enough rows are shared among the
// pool's threads, csrc/cpu/pool.h).

#include <math.h>
#include <stdint.h>

#include "args.h"
#include "bf16.h"
#include "pool.h"

// No fused multiply-add contraction: the reference rounds every product.
#if defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define EXL_ACT 1
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__)
#define EXL_ACT 2  // 8 lanes: the same exp (SLEEF's AVX2 expf_u10 is this algorithm too), the same bits
#include <immintrin.h>
#else
#define EXL_ACT 0
#endif

int exl_activation_available(void) { return EXL_ACT != 0; }

#if EXL_ACT == 1

#define LANES 16

// exp(d) as SLEEF's expf_u10 (the one torch's Vectorized<float>::exp calls), step for step:
// d = q ln2 + s with q = rint(d / ln2) and ln2 split in two, a degree-7 polynomial in s (FMAs),
// then the scale by 2^q in two halves so that it never overflows early.
static inline __m512 sleef_expf(__m512 d) {
    __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(d, _mm512_set1_ps(1.44269504088896340736f)));  // 1 / ln2
    __m512 qf = _mm512_cvtepi32_ps(q);
    __m512 s = _mm512_fmadd_ps(qf, _mm512_set1_ps(-0.693145751953125f), d);
    s = _mm512_fmadd_ps(qf, _mm512_set1_ps(-1.428606765330187045e-06f), s);
    __m512 u = _mm512_set1_ps(0.000198527617612853646278381f);
    u = _mm512_fmadd_ps(u, s, _mm512_set1_ps(0.00139304355252534151077271f));
    u = _mm512_fmadd_ps(u, s, _mm512_set1_ps(0.00833336077630519866943359f));
    u = _mm512_fmadd_ps(u, s, _mm512_set1_ps(0.0416664853692054748535156f));
    u = _mm512_fmadd_ps(u, s, _mm512_set1_ps(0.166666671633720397949219f));
    u = _mm512_fmadd_ps(u, s, _mm512_set1_ps(0.5f));
    u = _mm512_add_ps(_mm512_set1_ps(1.0f), _mm512_fmadd_ps(_mm512_mul_ps(s, s), u, s));
    __m512i q1 = _mm512_srai_epi32(q, 1), q2 = _mm512_sub_epi32(q, q1);
    __m512i bias = _mm512_set1_epi32(127);
    u = _mm512_mul_ps(u, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(q1, bias), 23)));
    u = _mm512_mul_ps(u, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(q2, bias), 23)));
    u = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(d, _mm512_set1_ps(-104.0f), _CMP_NLT_US), u);
    return _mm512_mask_mov_ps(u, _mm512_cmp_ps_mask(_mm512_set1_ps(100.0f), d, _CMP_LT_OQ),
                              _mm512_set1_ps(INFINITY));
}

#elif EXL_ACT == 2

static inline __m256 sleef_expf8(__m256 d) {
    __m256i q = _mm256_cvtps_epi32(_mm256_mul_ps(d, _mm256_set1_ps(1.44269504088896340736f)));  // 1 / ln2
    __m256 qf = _mm256_cvtepi32_ps(q);
    __m256 s = _mm256_fmadd_ps(qf, _mm256_set1_ps(-0.693145751953125f), d);
    s = _mm256_fmadd_ps(qf, _mm256_set1_ps(-1.428606765330187045e-06f), s);
    __m256 u = _mm256_set1_ps(0.000198527617612853646278381f);
    u = _mm256_fmadd_ps(u, s, _mm256_set1_ps(0.00139304355252534151077271f));
    u = _mm256_fmadd_ps(u, s, _mm256_set1_ps(0.00833336077630519866943359f));
    u = _mm256_fmadd_ps(u, s, _mm256_set1_ps(0.0416664853692054748535156f));
    u = _mm256_fmadd_ps(u, s, _mm256_set1_ps(0.166666671633720397949219f));
    u = _mm256_fmadd_ps(u, s, _mm256_set1_ps(0.5f));
    u = _mm256_add_ps(_mm256_set1_ps(1.0f), _mm256_fmadd_ps(_mm256_mul_ps(s, s), u, s));
    __m256i q1 = _mm256_srai_epi32(q, 1), q2 = _mm256_sub_epi32(q, q1);
    __m256i bias = _mm256_set1_epi32(127);
    u = _mm256_mul_ps(u, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(q1, bias), 23)));
    u = _mm256_mul_ps(u, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(q2, bias), 23)));
    u = _mm256_and_ps(u, _mm256_cmp_ps(d, _mm256_set1_ps(-104.0f), _CMP_NLT_US));
    return _mm256_blendv_ps(u, _mm256_set1_ps(INFINITY), _mm256_cmp_ps(_mm256_set1_ps(100.0f), d, _CMP_LT_OQ));
}

#endif

#if EXL_ACT

// Below this many outputs a call stays on the caller's thread: waking the pool costs more.
#define PARALLEL_MIN_ELEMS 8192

typedef struct {
    const uint16_t *x;
    uint16_t *out;
    int64_t x_stride, out_stride, inter;
} silu_args;

#if EXL_ACT == 1
static void silu_rows(void *ctx, int64_t begin, int64_t end) {
    const silu_args *a = (const silu_args *)ctx;
    const int64_t inter = a->inter;
    const __m512 one = _mm512_set1_ps(1.0f), sign = _mm512_set1_ps(-0.0f);
    for (int64_t r = begin; r < end; r++) {
        const uint16_t *gate = a->x + r * a->x_stride, *up = gate + inter;
        uint16_t *o = a->out + r * a->out_stride;
        for (int64_t i = 0; i < inter; i += LANES) {
            __mmask16 m = lanes16(inter - i);
            __m512 g = bf16_load16_masked(gate + i, m);
            __m512 s = bf16_round(_mm512_div_ps(g, _mm512_add_ps(one, sleef_expf(_mm512_xor_ps(g, sign)))));
            bf16_store16_masked(o + i, _mm512_mul_ps(s, bf16_load16_masked(up + i, m)), m);
        }
    }
}
#else
static void silu_rows(void *ctx, int64_t begin, int64_t end) {
    const silu_args *a = (const silu_args *)ctx;
    const int64_t inter = a->inter;
    const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
    for (int64_t r = begin; r < end; r++) {
        const uint16_t *gate = a->x + r * a->x_stride, *up = gate + inter;
        uint16_t *o = a->out + r * a->out_stride;
        for (int64_t i = 0; i < inter; i += 8) {
            __m256 g = bf16_load8_n(gate + i, inter - i);
            __m256 s = bf16_round8(_mm256_div_ps(g, _mm256_add_ps(one, sleef_expf8(_mm256_xor_ps(g, sign)))));
            bf16_store8_n(o + i, _mm256_mul_ps(s, bf16_load8_n(up + i, inter - i)), inter - i);
        }
    }
}
#endif

// x: rows of 2I (gate then up), row stride x_stride; out: rows of I, row stride out_stride.
int exl_silu_and_mul(const exl_silu_and_mul_args *args) {
    const uint16_t *x = args->x;
    uint16_t *out = args->out;
    int64_t x_stride = args->x_stride, out_stride = args->out_stride, inter = args->inter, rows = args->rows;
    if (inter <= 0 || rows < 0) return -1;
    silu_args a = {x, out, x_stride, out_stride, inter};
    if (rows * inter >= PARALLEL_MIN_ELEMS) exl_parallel_for(silu_rows, &a, rows);
    else silu_rows(&a, 0, rows);
    return 0;
}

#endif
