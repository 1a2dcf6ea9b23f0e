// The AVX2 + FMA body of qmatmul.c, for CPUs without AVX-512 BF16; included by qmatmul.c only where
// the compiler targets AVX2 and FMA but not the AVX-512 path. It reads the same repacked layout.
//
// No bf16 dot product here: weights become fp32 vectors of 8 columns for one k, and each output is
// a chain of fp32 FMAs. A 4-bit q becomes the bf16 value 128 + q (bit pattern 0x4300 | q, as in the
// AVX-512 path) whose 16 bits, shifted to the top of a 32-bit lane, are that value as fp32: the
// unpacked byte pairs of the layout hold two k of one column per 32-bit lane, so one shift and one
// mask give both without a conversion. 8-bit q is converted (exact). Every product q * x is exact.
//
// The order of the sums of one output, the same on every path below (so whatever M is, wherever the
// row sits, however threads split the columns): per block of 32, pa = the k < 16 terms and pb = the
// k >= 16 terms, each an FMA chain in k order from 0; then acc += (pa + pb) * d (or pa * d0, pb * d1
// with two scales per block); then acc += offset * sum(x of the block) where there is an offset
// (4-bit: m - 128 d, which takes back the 128 * sum(x)); acc starts at 0, the bias is added last.

#include <immintrin.h>

#define RT 4  // rows sharing one read of an expanded weight vector (large-M path)

// x as fp32, and the sum of each 32-value block of each row (a fixed order of adds).
static void widen_rows(const uint16_t *x, int64_t M, int64_t K, float *xf, float *sx) {
    int64_t nb = K / BLOCK;
    for (int64_t i = 0; i < M * K; i++) xf[i] = bf16_to_f32(x[i]);
    for (int64_t r = 0; r < M; r++) {
        for (int64_t b = 0; b < nb; b++) {
            const float *v = xf + r * K + b * BLOCK;
            __m256 s = _mm256_add_ps(_mm256_add_ps(_mm256_loadu_ps(v), _mm256_loadu_ps(v + 8)),
                                     _mm256_add_ps(_mm256_loadu_ps(v + 16), _mm256_loadu_ps(v + 24)));
            __m128 h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
            h = _mm_add_ps(h, _mm_movehl_ps(h, h));
            h = _mm_add_ss(h, _mm_movehdup_ps(h));
            sx[r * nb + b] = _mm_cvtss_f32(h);
        }
    }
}

// w[j] = the weights k = 8c + j (j = 0..7) of columns 8h .. 8h + 7 of one (group, block) `blk`.
// 4-bit: bytes 64c + 32h .. + 31 hold them (lane 0: columns 8h..8h+3, lane 1: the next four); low
// nibbles unpacked give k 8c+0..3, high ones 8c+4..7; each 32-bit lane a pair (even k low, odd high).
// 8-bit: pair p = 4c + u, columns 8h.., at bytes 32p + 16h, one column's pair per two bytes.
static inline __attribute__((always_inline)) void expand_chunk(const uint8_t *blk, int bits, int c, int h,
                                                                __m256 w[8]) {
    if (bits == 4) {
        const __m256i low4 = _mm256_set1_epi8(0x0f), c43 = _mm256_set1_epi8(0x43);
        const __m256i top16 = _mm256_set1_epi32((int)0xffff0000u);
        __m256i v = _mm256_loadu_si256((const __m256i *)(blk + 64 * c + 32 * h));
        __m256i lo = _mm256_and_si256(v, low4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
        __m256i u[4] = {_mm256_unpacklo_epi8(lo, c43), _mm256_unpackhi_epi8(lo, c43),
                        _mm256_unpacklo_epi8(hi, c43), _mm256_unpackhi_epi8(hi, c43)};
        for (int i = 0; i < 4; i++) {
            w[2 * i] = _mm256_castsi256_ps(_mm256_slli_epi32(u[i], 16));
            w[2 * i + 1] = _mm256_castsi256_ps(_mm256_and_si256(u[i], top16));
        }
    } else {
        for (int i = 0; i < 4; i++) {
            __m128i v = _mm_loadu_si128((const __m128i *)(blk + 32 * (4 * c + i) + 16 * h));
            __m256i s = _mm256_cvtepi8_epi16(v);  // one column's pair per 32-bit lane
            w[2 * i] = _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(s, 16), 16));
            w[2 * i + 1] = _mm256_cvtepi32_ps(_mm256_srai_epi32(s, 16));
        }
    }
}

// How one block's two partial sums enter an output (the last two steps of the order above).
typedef struct {
    __m256 d0, d1, off;  // scales of k < 16 and k >= 16 (equal with one scale per block); offset
    int two_scales, has_off;
} block_coefs;

static inline __attribute__((always_inline)) block_coefs coefs_of(const float *d, const float *m, int64_t b, int h,
                                                                   int bits, int two_scales, int has_off) {
    block_coefs k;
    k.two_scales = two_scales;
    k.has_off = has_off;
    k.d0 = _mm256_loadu_ps(d + (two_scales ? 2 * b : b) * CG + 8 * h);
    k.d1 = two_scales ? _mm256_loadu_ps(d + (2 * b + 1) * CG + 8 * h) : k.d0;
    k.off = _mm256_setzero_ps();
    if (has_off) {
        __m256 mv = _mm256_loadu_ps(m + b * CG + 8 * h);
        k.off = bits == 4 ? _mm256_fmadd_ps(_mm256_set1_ps(-128.0f), k.d0, mv) : mv;
    }
    return k;
}

static inline __attribute__((always_inline)) __m256 add_block(__m256 acc, __m256 pa, __m256 pb,
                                                               const block_coefs *k, float sxb) {
    if (k->two_scales) {
        acc = _mm256_fmadd_ps(pa, k->d0, acc);
        acc = _mm256_fmadd_ps(pb, k->d1, acc);
    } else {
        acc = _mm256_fmadd_ps(_mm256_add_ps(pa, pb), k->d0, acc);
    }
    if (k->has_off) acc = _mm256_fmadd_ps(k->off, _mm256_set1_ps(sxb), acc);
    return acc;
}

typedef struct {
    const float *xf, *sx;
    int64_t M, K, nb, N;
    int bits, y_fp32, two_scales, has_off;
    const uint8_t *qs;
    const float *d, *m;
    const uint16_t *bias;
    void *y;
} qmm2_args;

static inline int64_t qbytes_of(int bits) { return bits == 4 ? 256 : 512; }
static inline int64_t scales_per_block(const qmm2_args *a) { return a->two_scales ? 2 : 1; }

// Few rows: each (block, chunk, half) is expanded in registers and used by all `rows` rows at once.
static inline __attribute__((always_inline)) void rows_direct(const qmm2_args *a, const uint8_t *gq, const float *gd,
                                                               const float *gm, int64_t r0, int rows,
                                                               __m256 acc[2][2]) {
    for (int r = 0; r < rows; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t b = 0; b < a->nb; b++) {
        const uint8_t *blk = gq + b * qbytes_of(a->bits);
        for (int h = 0; h < 2; h++) {
            __m256 pa[2], pb[2];
            for (int r = 0; r < rows; r++) pa[r] = pb[r] = _mm256_setzero_ps();
            for (int c = 0; c < 4; c++) {
                __m256 w[8];
                expand_chunk(blk, a->bits, c, h, w);
                for (int r = 0; r < rows; r++) {
                    const float *xb = a->xf + (r0 + r) * a->K + b * BLOCK + 8 * c;
                    __m256 p = c < 2 ? pa[r] : pb[r];
                    for (int j = 0; j < 8; j++) p = _mm256_fmadd_ps(w[j], _mm256_broadcast_ss(xb + j), p);
                    if (c < 2) pa[r] = p;
                    else pb[r] = p;
                }
            }
            block_coefs k = coefs_of(gd, gm, b, h, a->bits, a->two_scales, a->has_off);
            for (int r = 0; r < rows; r++)
                acc[r][h] = add_block(acc[r][h], pa[r], pb[r], &k, a->has_off ? a->sx[(r0 + r) * a->nb + b] : 0.0f);
        }
    }
}

// Many rows: the group's weights were expanded once into `wbuf` ([nb][4 chunks][2 halves][8] vectors);
// tiles of up to RT rows read each vector once, one half at a time.
static inline __attribute__((always_inline)) void rows_buffered(const qmm2_args *a, const __m256 *wbuf,
                                                                 const float *gd, const float *gm, int64_t r0,
                                                                 int rows, int h, __m256 acc[RT]) {
    for (int r = 0; r < rows; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < a->nb; b++) {
        __m256 pa[RT], pb[RT];
        for (int r = 0; r < rows; r++) pa[r] = pb[r] = _mm256_setzero_ps();
        for (int c = 0; c < 4; c++) {
            const __m256 *w = wbuf + ((b * 4 + c) * 2 + h) * 8;
            for (int j = 0; j < 8; j++) {
                for (int r = 0; r < rows; r++) {
                    __m256 xv = _mm256_broadcast_ss(a->xf + (r0 + r) * a->K + b * BLOCK + 8 * c + j);
                    if (c < 2) pa[r] = _mm256_fmadd_ps(w[j], xv, pa[r]);
                    else pb[r] = _mm256_fmadd_ps(w[j], xv, pb[r]);
                }
            }
        }
        block_coefs k = coefs_of(gd, gm, b, h, a->bits, a->two_scales, a->has_off);
        for (int r = 0; r < rows; r++)
            acc[r] = add_block(acc[r], pa[r], pb[r], &k, a->has_off ? a->sx[(r0 + r) * a->nb + b] : 0.0f);
    }
}

// Output row r, columns n0 + 8h ..: acc + bias, the lanes that exist only.
static inline void store_half(const qmm2_args *a, int64_t r, int64_t n0, int h, __m256 acc) {
    float out[8];
    _mm256_storeu_ps(out, acc);
    int64_t col = n0 + 8 * h, count = a->N - col < 8 ? a->N - col : 8;
    for (int64_t i = 0; i < count; i++) {
        float v = a->bias ? out[i] + bf16_to_f32(a->bias[col + i]) : out[i];
        if (a->y_fp32) ((float *)a->y)[r * a->N + col + i] = v;
        else ((uint16_t *)a->y)[r * a->N + col + i] = f32_to_bf16(v);
    }
}

static void qmm2_groups(void *ctx, int64_t begin, int64_t end) {
    const qmm2_args *a = (const qmm2_args *)ctx;
    int64_t nb = a->nb, qbytes = qbytes_of(a->bits), spb = scales_per_block(a);
    __m256 *wbuf = NULL;
    if (a->M > 2) wbuf = (__m256 *)aligned_alloc(32, (size_t)nb * 64 * sizeof(__m256));
    for (int64_t g = begin; g < end; g++) {
        const uint8_t *gq = a->qs + g * nb * qbytes;
        const float *gd = a->d + g * nb * spb * CG;
        const float *gm = a->has_off ? a->m + g * nb * CG : NULL;
        int64_t n0 = g * CG;
        if (!wbuf) {  // also where the buffer could not be had: the same sums, only slower
            for (int64_t r0 = 0; r0 < a->M; r0 += 2) {
                __m256 acc[2][2];
                int rows = a->M - r0 >= 2 ? 2 : 1;
                if (rows == 2) rows_direct(a, gq, gd, gm, r0, 2, acc);
                else rows_direct(a, gq, gd, gm, r0, 1, acc);
                for (int r = 0; r < rows; r++)
                    for (int h = 0; h < 2; h++) store_half(a, r0 + r, n0, h, acc[r][h]);
            }
            continue;
        }
        for (int64_t b = 0; b < nb; b++)
            for (int c = 0; c < 4; c++)
                for (int h = 0; h < 2; h++) expand_chunk(gq + b * qbytes, a->bits, c, h, wbuf + ((b * 4 + c) * 2 + h) * 8);
        for (int h = 0; h < 2; h++) {
            if (n0 + 8 * h >= a->N) break;
            for (int64_t r0 = 0; r0 < a->M; r0 += RT) {
                int rows = (int)(a->M - r0 < RT ? a->M - r0 : RT);
                __m256 acc[RT];
                switch (rows) {  // constant row counts let the compiler keep the sums in registers
                    case 4: rows_buffered(a, wbuf, gd, gm, r0, 4, h, acc); break;
                    case 3: rows_buffered(a, wbuf, gd, gm, r0, 3, h, acc); break;
                    case 2: rows_buffered(a, wbuf, gd, gm, r0, 2, h, acc); break;
                    default: rows_buffered(a, wbuf, gd, gm, r0, 1, h, acc); break;
                }
                for (int i = 0; i < rows; i++) store_half(a, r0 + i, n0, h, acc[i]);
            }
        }
    }
    free(wbuf);
}

static int qmatmul_avx2(const exl_qmatmul_args *args, int two_scales, int has_off) {
    int64_t M = args->rows, K = args->in_features, N = args->out_features, nb = K / BLOCK;
    float *xf = (float *)malloc(sizeof(float) * (size_t)(M * K + M * nb + 1));
    if (!xf) return -1;
    float *sx = xf + M * K;
    widen_rows(args->x, M, K, xf, sx);
    qmm2_args a = {xf, sx, M, K, nb, N, args->bits, args->y_fp32, two_scales, has_off,
                   args->qs, args->d, args->m, args->bias, args->y};
    exl_parallel_for(qmm2_groups, &a, (N + CG - 1) / CG);
    free(xf);
    return 0;
}
