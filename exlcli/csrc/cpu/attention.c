// Paged attention on the CPU, bf16 in and out: decode rows and prefill chunks of many sequences in
// one call (exlcli/ops/attention.py checks the inputs and calls it once per layer).
//
// Sequence b owns the queries q[qsl[b] .. qsl[b+1]) (its last n tokens, causal) and its L keys sit
// in the pages block_tables[b]. Work is cut into units (up to QBLK queries of one sequence, for
// all its kv heads or, when units are too few for the threads, one kv head) that the kernel pool
// shares out. A unit first rearranges the keys it needs into blocks of 16 keys, dimension-major
// (two bf16 dims per 32-bit lane, so the transpose moves half as much), and, when many row tiles
// will reuse them, the values into fp32 rows; every query head of the group and every query of
// the unit then reads those. Per query row:
//   s_j  = (sum_d q_d k_jd) * scale     d = 0, 1, ..., D-1 in turn: exact bf16 products, one fp32
//                                       rounding per step (FMA); one key per vector lane
//   p_j  = exp(s_j - max s)             lo <= j < limit = the row's position + 1
//   sum  = sum_j p_j                    lane j % 16 adds its keys in order, then a fixed tree
//   o_d  = (sum_j p_j v_jd) / sum       j = lo, lo + 1, ... in turn, fp32; one rounding to bf16 (RNE)
// The layer's kind (attention_kind.h): lo = limit - window with a window (else 0), and a unit reads
// its keys from the first its first query sees (blocks of keys before it are never made); scores
// are soft-capped before the softmax; a sink logit joins the max, and exp(sink - max) the sum (after
// the tree).
//
// Batch invariance: a row's arithmetic depends only on its q, its keys, its limit and its kind. Rows are
// processed in small tiles (the query heads of one token, which share the limit) that only share
// loads; how the work is cut into units, which thread runs them, and whether values come from
// the cache or from the fp32 copy (bf16 -> fp32 is exact) change no bit. So a token gets the same
// numbers alone, in any batch, or in any chunking of its prefill.

#include <math.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "args.h"
#include "attention_kind.h"
#include "bf16.h"
#include "pool.h"

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define EXL_ATTN 1
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__)
#define EXL_ATTN 2  // attention_avx2.h: the same contract and invariance with 8-lane vectors
#include <immintrin.h>
#else
#define EXL_ATTN 0
#endif

#define KB 16  // keys per block (one vector of fp32 scores)
#define RT 4   // query rows per tile (heads of one token sharing a kv head)
#define BT 4   // key blocks per score tile
#define DT 4   // vectors of 16 dims per output tile
#define QBLK 32  // most queries of one sequence in a unit of work
#define PREFETCH_BLOCKS 2  // key blocks ahead that convert_kv asks memory for

int exl_paged_attention_available(void) { return EXL_ATTN != 0; }

#if EXL_ATTN

typedef struct {
    const uint16_t *q, *k_cache, *v_cache;
    const int32_t *block_tables, *query_start_loc, *seq_lens;
    int64_t max_pages, page_size, heads, kv_heads, dim;
    float scale;
    uint16_t *out;
    const float *sinks;  // [heads] or NULL
    int64_t window;      // 0: none
    float softcap;       // 0: none
} AttentionArgs;

// A unit of work: queries tok0 .. tok1 - 1 of sequence seq (counted within its chunk) for kv
// heads h0 .. h1 - 1 and their query heads. Units only share inputs, so they can run anywhere.
typedef struct {
    int64_t seq, tok0, tok1, h0, h1;
} Unit;

// Keys the unit's last query sees.
static int64_t unit_keys(const AttentionArgs *a, const Unit *u) {
    int64_t n = a->query_start_loc[u->seq + 1] - a->query_start_loc[u->seq];
    return a->seq_lens[u->seq] - n + u->tok1;
}

// The first key the unit's first query sees (0 without a window): no key before it is read.
static int64_t unit_first(const AttentionArgs *a, const Unit *u) {
    int64_t n = a->query_start_loc[u->seq + 1] - a->query_start_loc[u->seq];
    return kind_first_key(a->window, a->seq_lens[u->seq] - n + u->tok0 + 1);
}

// Where the unit's keys (and a row's scores) start: unit_first rounded down to a whole block of KB
// keys, so key j sits in vector lane j % KB in whatever unit it is computed.
static int64_t unit_base(const AttentionArgs *a, const Unit *u) {
    return unit_first(a, u) / KB * KB;
}

#endif

#if EXL_ATTN == 1

// Horizontal sum in one fixed order: halves, quarters, then pairs.
static inline float sum16(__m512 v) {
    __m256 a = _mm256_add_ps(_mm512_castps512_ps256(v),
                             _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
    __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    __m128 c = _mm_add_ps(b, _mm_movehl_ps(b, b));
    __m128 d = _mm_add_ss(c, _mm_movehdup_ps(c));
    return _mm_cvtss_f32(d);
}

// exp(x) for x <= 0 (max-subtracted scores): 2^n e^r, |r| <= ln2/2, degree-7 Taylor polynomial.
// exp(0) is exactly 1; below about -103 the result is 0.
static inline __m512 exp_ps(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-104.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860682030941723e-6f), r);
    __m512 p = _mm512_set1_ps(1.0f / 5040.0f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

// In-register 16x16 transpose: four rounds, each exchanging one bit b of the row and column
// indices (rows i and i|b swap the elements whose column bit differs from their row bit).
// XCHG_LO[s][j] / XCHG_HI[s][j]: permutex2var indices for the row without / with bit 1 << s.
static const int32_t XCHG_LO[4][16] __attribute__((aligned(64))) = {
    {0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30},
    {0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29},
    {0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27},
    {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23}};
static const int32_t XCHG_HI[4][16] __attribute__((aligned(64))) = {
    {1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31},
    {2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31},
    {4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31},
    {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31}};

static inline __attribute__((always_inline)) void transpose16(__m512 m[16]) {
#pragma GCC unroll 4
    for (int s = 0; s < 4; s++) {
        int b = 1 << s;
        __m512i lo = _mm512_load_si512(XCHG_LO[s]), hi = _mm512_load_si512(XCHG_HI[s]);
#pragma GCC unroll 16
        for (int i = 0; i < 16; i++) {
            if (i & b) continue;
            __m512 a = m[i], c = m[i | b];
            m[i] = _mm512_permutex2var_ps(a, lo, c);
            m[i | b] = _mm512_permutex2var_ps(a, hi, c);
        }
    }
}

// One sequence's keys kbase .. len - 1 (kbase a multiple of KB) for kv heads h0 .. h1 - 1, in one
// pass over its pages (the rows of a slot are contiguous): keys -> kp[h - h0][block][pair e][16 keys]
// (blocks counted from kbase), each 32-bit element holding the bf16 dims 2e (low half) and 2e + 1
// (high half) of one key, zero before `from` and past len (those are not read); values ->
// vf[h - h0][j - kbase][d] in fp32 for j >= from (unless vf is NULL). kstride, vstride: elements per head.
static void convert_kv(const uint16_t *k_cache, const uint16_t *v_cache, const int32_t *pages,
                       int64_t page_size, int64_t kv_heads, int64_t h0, int64_t h1, int64_t dim,
                       int64_t kbase, int64_t from, int64_t len, uint32_t *kp, int64_t kstride, float *vf,
                       int64_t vstride) {
    int64_t blocks = (len - kbase + KB - 1) / KB, pairs = dim / 2, row_len = kv_heads * dim;
    for (int64_t blk = 0; blk < blocks; blk++) {
        // ask early for the rows PREFETCH_BLOCKS ahead: the memory latency then overlaps this work
        for (int64_t j = kbase + (blk + PREFETCH_BLOCKS) * KB; j < kbase + (blk + PREFETCH_BLOCKS + 1) * KB && j < len;
             j++) {
            int64_t off = ((int64_t)pages[j / page_size] * page_size + j % page_size) * row_len;
            for (int64_t e = h0 * dim; e < h1 * dim; e += 32) {
                _mm_prefetch((const char *)(k_cache + off + e), _MM_HINT_T0);
                if (vf) _mm_prefetch((const char *)(v_cache + off + e), _MM_HINT_T0);
            }
        }
        int64_t base[KB];
        for (int i = 0; i < KB; i++) {
            int64_t j = kbase + blk * KB + i;
            base[i] = -1;
            if (j >= from && j < len) {
                base[i] = ((int64_t)pages[j / page_size] * page_size + j % page_size) * row_len;
                const uint16_t *vrow = v_cache + base[i];
                for (int64_t h = h0; vf && h < h1; h++)
                    for (int64_t d = 0; d < dim; d += 16)
                        _mm512_storeu_ps(vf + (h - h0) * vstride + (j - kbase) * dim + d,
                                         bf16_load16(vrow + h * dim + d));
            }
        }
        for (int64_t h = h0; h < h1; h++) {
            for (int64_t d0 = 0; d0 < dim; d0 += 32) {
                int full = dim - d0 >= 32;  // else 16 dims (8 pairs) are left
                __m512 m[16];
#pragma GCC unroll 16
                for (int i = 0; i < KB; i++) {
                    const uint16_t *src = k_cache + base[i] + h * dim + d0;
                    if (base[i] < 0) m[i] = _mm512_setzero_ps();
                    else if (full) m[i] = _mm512_loadu_ps((const void *)src);
                    else m[i] = _mm512_zextps256_ps512(_mm256_loadu_ps((const float *)src));
                }
                transpose16(m);
                uint32_t *dst = kp + (h - h0) * kstride + (blk * pairs + d0 / 2) * KB;
#pragma GCC unroll 16
                for (int i = 0; i < 16; i++)
                    if (full || i < 8) _mm512_storeu_ps((void *)(dst + i * KB), m[i]);
            }
        }
    }
}

// Scores of `rows` query rows (qf: [rows][dim]) over key blocks [blk0, blk0 + nblk), into
// s[row][padded]. Each lane is one key's dot product, summed over d in order.
static inline __attribute__((always_inline)) void score_tile(
        const float *qf, const uint32_t *kp, int64_t dim, int rows, int64_t blk0, int nblk,
        float scale, float *s, int64_t padded) {
    __m512 acc[RT][BT];
    for (int r = 0; r < RT; r++)
        for (int x = 0; x < BT; x++) acc[r][x] = _mm512_setzero_ps();
    int64_t pairs = dim / 2;
    const uint32_t *k0 = kp + blk0 * pairs * KB;
    const __m512i high = _mm512_set1_epi32((int)0xffff0000u);
    for (int64_t e = 0; e < pairs; e++) {
        __m512 even[BT], odd[BT];
        for (int x = 0; x < BT; x++)
            if (x < nblk) {
                __m512i v = _mm512_loadu_si512(k0 + (x * pairs + e) * KB);
                even[x] = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
                odd[x] = _mm512_castsi512_ps(_mm512_and_si512(v, high));
            }
        for (int r = 0; r < RT; r++) {
            if (r >= rows) continue;
            __m512 q0 = _mm512_set1_ps(qf[r * dim + 2 * e]), q1 = _mm512_set1_ps(qf[r * dim + 2 * e + 1]);
            for (int x = 0; x < BT; x++)
                if (x < nblk) acc[r][x] = _mm512_fmadd_ps(q1, odd[x], _mm512_fmadd_ps(q0, even[x], acc[r][x]));
        }
    }
    __m512 sc = _mm512_set1_ps(scale);
    for (int r = 0; r < RT; r++)
        for (int x = 0; x < BT; x++)
            if (r < rows && x < nblk)
                _mm512_storeu_ps(s + r * padded + (blk0 + x) * KB, _mm512_mul_ps(acc[r][x], sc));
}

#define SCORE_CASE(R)                                                                            \
    case R:                                                                                      \
        for (; blk + BT <= blocks; blk += BT) score_tile(qf, kt, dim, R, blk, BT, scale, s, padded); \
        for (; blk < blocks; blk++) score_tile(qf, kt, dim, R, blk, 1, scale, s, padded);         \
        break;

// Blocks blk0 .. blocks - 1 of the unit's keys.
static void scores(const float *qf, const uint32_t *kt, int64_t dim, int rows, int64_t blk0, int64_t blocks,
                   float scale, float *s, int64_t padded) {
    int64_t blk = blk0;
    switch (rows) {
        SCORE_CASE(1)
        SCORE_CASE(2)
        SCORE_CASE(3)
        SCORE_CASE(4)
    }
}

// Softmax numerators in place over s[lo, limit), from lo's block on (keys outside the range get 0);
// returns their sum, plus exp(*sink - max) for a sink logit (sink NULL: none), the max taken over
// the scores and the sink.
static float softmax_row(float *s, int64_t lo, int64_t limit, const float *sink) {
    int64_t first = lo / KB, blocks = (limit + KB - 1) / KB;
    __mmask16 head = (__mmask16)(0xffffu << (lo % KB));
    __mmask16 tail = (__mmask16)((limit % KB) ? ((1u << (limit % KB)) - 1) : 0xffff);
    __m512 mx = _mm512_set1_ps(sink ? *sink : -INFINITY);
    for (int64_t blk = first; blk < blocks; blk++) {
        __mmask16 m = (blk == blocks - 1 ? tail : 0xffff) & (blk == first ? head : 0xffff);
        mx = _mm512_mask_max_ps(mx, m, mx, _mm512_loadu_ps(s + blk * KB));
    }
    __m512 vmax = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
    __m512 sum = _mm512_setzero_ps();
    for (int64_t blk = first; blk < blocks; blk++) {
        __mmask16 m = (blk == blocks - 1 ? tail : 0xffff) & (blk == first ? head : 0xffff);
        __m512 e = _mm512_maskz_mov_ps(m, exp_ps(_mm512_sub_ps(_mm512_loadu_ps(s + blk * KB), vmax)));
        _mm512_storeu_ps(s + blk * KB, e);
        sum = _mm512_add_ps(sum, e);
    }
    float total = sum16(sum);
    if (sink) total += _mm512_cvtss_f32(exp_ps(_mm512_sub_ps(_mm512_set1_ps(*sink), vmax)));
    return total;
}

// Walks the next sequence's pages (K and V, whole slots) a few cache lines at a time, so that its
// memory reads overlap this sequence's arithmetic. Only timing depends on it, never a result.
typedef struct {
    const char *k, *v;
    const int32_t *pages;
    int64_t num_pages, page_bytes, page, offset;
    int lines;  // per call of prefetch_some
} Prefetcher;

static inline void prefetch_some(Prefetcher *pf) {
    for (int i = 0; i < pf->lines && pf->page < pf->num_pages; i++) {
        int64_t at = (int64_t)pf->pages[pf->page] * pf->page_bytes + pf->offset;
        _mm_prefetch(pf->k + at, _MM_HINT_T1);
        _mm_prefetch(pf->v + at, _MM_HINT_T1);
        pf->offset += 64;
        if (pf->offset >= pf->page_bytes) {
            pf->offset = 0;
            pf->page++;
        }
    }
}

// Where a head's values are read from: the fp32 rows convert_kv made (when many row tiles reuse
// them), or straight from the bf16 cache (a decode row: one use each). Same numbers either way.
typedef struct {
    const float *vf;          // [j - kbase][dim], or NULL
    const uint16_t *v_cache;  // this head's column of the cache
    const int32_t *pages;
    int64_t page_size, slot_stride;  // elements from one slot to the next: kv_heads * dim
    int64_t kbase;            // the position of the unit's key 0
} Values;

// out[r][d0 .. d0 + 16 * nvec) = (sum_j p[r][j] v[j]) / total[r] over lo <= j < limit (the unit's
// keys), rounded to bf16.
static inline __attribute__((always_inline)) void pv_tile(
        const float *p, int64_t padded, const Values *vals, int from_cache, int64_t dim, int64_t lo, int64_t limit,
        int rows, int64_t d0, int nvec, const float *total, uint16_t *const out[RT], Prefetcher *pf) {
    __m512 acc[RT][DT];
    for (int r = 0; r < RT; r++)
        for (int x = 0; x < DT; x++) acc[r][x] = _mm512_setzero_ps();
    int64_t page = (vals->kbase + lo) / vals->page_size, in_page = (vals->kbase + lo) % vals->page_size;
    for (int64_t j = lo; j < limit; j++) {
        prefetch_some(pf);
        __m512 v[DT];
        if (from_cache) {
            const uint16_t *row = vals->v_cache + ((int64_t)vals->pages[page] * vals->page_size + in_page)
                                  * vals->slot_stride + d0;
            if (++in_page == vals->page_size) {
                in_page = 0;
                page++;
            }
            for (int x = 0; x < DT; x++)
                if (x < nvec) v[x] = bf16_load16(row + 16 * x);
        } else {
            for (int x = 0; x < DT; x++)
                if (x < nvec) v[x] = _mm512_loadu_ps(vals->vf + j * dim + d0 + 16 * x);
        }
        for (int r = 0; r < RT; r++) {
            if (r >= rows) continue;
            __m512 pb = _mm512_set1_ps(p[r * padded + j]);
            for (int x = 0; x < DT; x++)
                if (x < nvec) acc[r][x] = _mm512_fmadd_ps(pb, v[x], acc[r][x]);
        }
    }
    for (int r = 0; r < RT; r++) {
        if (r >= rows) continue;
        __m512 t = _mm512_set1_ps(total[r]);
        for (int x = 0; x < DT; x++)
            if (x < nvec)
                bf16_store16(out[r] + d0 + 16 * x, _mm512_div_ps(acc[r][x], t));
    }
}

#define PV_CASE(R, N)                                                                            \
    if (vals->vf) pv_tile(p, padded, vals, 0, dim, lo, limit, R, d0, N, total, out, pf);          \
    else pv_tile(p, padded, vals, 1, dim, lo, limit, R, d0, N, total, out, pf);

#define PV_ROWS(R)                                                                               \
    case R:                                                                                      \
        switch (nvec) {                                                                          \
            case 1: PV_CASE(R, 1) break;                                                         \
            case 2: PV_CASE(R, 2) break;                                                         \
            case 3: PV_CASE(R, 3) break;                                                         \
            default: PV_CASE(R, 4) break;                                                        \
        }                                                                                        \
        break;

static void weighted_values(const float *p, int64_t padded, const Values *vals, int64_t dim, int64_t lo,
                            int64_t limit, int rows, const float *total, uint16_t *const out[RT], Prefetcher *pf) {
    for (int64_t d0 = 0; d0 < dim; d0 += 16 * DT) {
        int64_t left = (dim - d0) / 16;
        int nvec = left < DT ? (int)left : DT;
        switch (rows) {
            PV_ROWS(1)
            PV_ROWS(2)
            PV_ROWS(3)
            PV_ROWS(4)
        }
    }
}

// Floats of scratch for a unit of `keys` keys (from its base on): its heads' converted keys and
// values, the scores of one tile of rows and its fp32 queries.
static int64_t workspace_floats(int64_t keys, int64_t heads, int64_t dim) {
    int64_t padded = (keys + KB - 1) / KB * KB;
    return heads * (padded * dim / 2 + padded * dim) + RT * padded + RT * dim;
}

// `next`: the unit this thread does after u (its memory is prefetched during u), or NULL.
static void attend_unit(const AttentionArgs *a, const Unit *u, const Unit *next, float *work) {
    int64_t heads = a->heads, kv_heads = a->kv_heads, dim = a->dim, page_size = a->page_size;
    int64_t group = heads / kv_heads, tiles = (group + RT - 1) / RT, nh = u->h1 - u->h0;
    int64_t b = u->seq, q0 = a->query_start_loc[b], n = a->query_start_loc[b + 1] - q0, len = a->seq_lens[b];
    int64_t kbase = unit_base(a, u), keys = unit_keys(a, u) - kbase;  // the unit's keys, from its base
    const int32_t *pages = a->block_tables + b * a->max_pages;
    int64_t padded = (keys + KB - 1) / KB * KB;
    int64_t kstride = padded * dim / 2, vstride = padded * dim;
    uint32_t *kp = (uint32_t *)work;
    float *vf = work + nh * kstride, *s = vf + nh * vstride, *qf = s + RT * padded;
    // values used by one or two row tiles are read from the cache as they are needed
    int convert_values = (u->tok1 - u->tok0) * tiles > 2;
    convert_kv(a->k_cache, a->v_cache, pages, page_size, kv_heads, u->h0, u->h1, dim, kbase, unit_first(a, u),
               kbase + keys, kp, kstride, convert_values ? vf : NULL, vstride);
    int64_t slot_bytes = kv_heads * dim * 2;
    Prefetcher pf = {(const char *)a->k_cache, (const char *)a->v_cache, pages, 0, page_size * slot_bytes, 0, 0, 0};
    if (next && next->seq != b) {
        // spread the next sequence's lines over this unit's weighted-sum steps
        int64_t steps = 0;
        for (int64_t t = u->tok0; t < u->tok1; t++) {
            int64_t limit = len - n + t + 1;
            steps += limit - kind_first_key(a->window, limit);
        }
        steps *= nh * tiles * ((dim / 16 + DT - 1) / DT);
        pf.pages = a->block_tables + next->seq * a->max_pages;
        pf.page = unit_first(a, next) / page_size;
        pf.num_pages = (unit_keys(a, next) + page_size - 1) / page_size;
        int64_t lines = (pf.num_pages - pf.page) * pf.page_bytes / 64;
        pf.lines = (int)((lines + steps - 1) / steps);
    }
    for (int64_t h = u->h0; h < u->h1; h++) {
        const uint32_t *kt = kp + (h - u->h0) * kstride;
        Values vals = {convert_values ? vf + (h - u->h0) * vstride : NULL, a->v_cache + h * dim, pages,
                       page_size, kv_heads * dim, kbase};
        for (int64_t t = u->tok0; t < u->tok1; t++) {
            // the row's keys lo .. limit - 1, counted from the unit's base
            int64_t limit = len - n + t + 1, lo = kind_first_key(a->window, limit) - kbase;
            limit -= kbase;
            for (int64_t g0 = 0; g0 < group; g0 += RT) {
                int rows = (int)(group - g0 < RT ? group - g0 : RT);
                uint16_t *orow[RT];
                float total[RT];
                for (int r = 0; r < rows; r++) {
                    int64_t off = ((q0 + t) * heads + h * group + g0 + r) * dim;
                    for (int64_t d = 0; d < dim; d += 16)
                        _mm512_storeu_ps(qf + r * dim + d, bf16_load16(a->q + off + d));
                    orow[r] = a->out + off;
                }
                scores(qf, kt, dim, rows, lo / KB, (limit + KB - 1) / KB, a->scale, s, padded);
                for (int r = 0; r < rows; r++) {
                    kind_soft_cap(s + r * padded, lo, limit, a->softcap);
                    total[r] = softmax_row(s + r * padded, lo, limit, a->sinks ? a->sinks + h * group + g0 + r : NULL);
                }
                weighted_values(s, padded, &vals, dim, lo, limit, rows, total, orow, &pf);
            }
        }
    }
}

#elif EXL_ATTN == 2
#include "attention_avx2.h"
#endif

#if EXL_ATTN

typedef struct {
    AttentionArgs args;
    const Unit *units;
    atomic_int failed;
} AttentionJob;

static void attend_units(void *ctx, int64_t begin, int64_t end) {
    AttentionJob *job = (AttentionJob *)ctx;
    int64_t most = 0;
    for (int64_t i = begin; i < end; i++) {
        const Unit *u = &job->units[i];
        int64_t need = workspace_floats(unit_keys(&job->args, u) - unit_base(&job->args, u), u->h1 - u->h0,
                                        job->args.dim);
        if (need > most) most = need;
    }
    float *work = (float *)aligned_alloc(64, (size_t)(most + 16) / 16 * 64);
    if (!work) {
        atomic_store(&job->failed, 1);
        return;
    }
    for (int64_t i = begin; i < end; i++)
        attend_unit(&job->args, &job->units[i], i + 1 < end ? &job->units[i + 1] : NULL, work);
    free(work);
}

// q, out: [T, heads, dim]; caches: [num_pages, page_size, kv_heads, dim]; block_tables:
// [B, max_pages]; sequences seq_begin .. seq_end - 1 are computed, shared among the pool's
// threads (`threads`: how many it has) in units of up to QBLK queries of one sequence, and also
// split by kv head when that gives too few units to go round. The caller has checked shapes,
// dtypes and lengths. The layer's kind: args->sinks, window, softcap (attention_kind.h); with a
// window, table entries of pages before the window are never read. Returns 0; 1 when a used
// block-table entry is outside [0, num_pages); -1 when out of memory.
int exl_paged_attention(const exl_paged_attention_args *args) {
    const uint16_t *q = args->q, *k_cache = args->k_cache, *v_cache = args->v_cache;
    const int32_t *block_tables = args->block_tables, *query_start_loc = args->query_start_loc;
    const int32_t *seq_lens = args->seq_lens;
    int64_t max_pages = args->max_pages, seq_begin = args->seq_begin, seq_end = args->seq_end;
    int64_t num_pages = args->num_pages, page_size = args->page_size, heads = args->heads;
    int64_t kv_heads = args->kv_heads, dim = args->dim, threads = args->threads;
    float scale = args->scale;
    uint16_t *out = args->out;
    int64_t count = 0;
    for (int64_t b = seq_begin; b < seq_end; b++) {
        const int32_t *pages = block_tables + b * max_pages;
        int64_t n = query_start_loc[b + 1] - query_start_loc[b];
        if (n == 0) continue;
        for (int64_t i = kind_first_key(args->window, seq_lens[b] - n + 1) / page_size;
             i < (seq_lens[b] + page_size - 1) / page_size; i++)
            if (pages[i] < 0 || pages[i] >= num_pages) return 1;
        count += (n + QBLK - 1) / QBLK;
    }
    int64_t split = count < 2 * threads ? kv_heads : 1;  // kv heads per sequence's block, apart
    Unit *units = (Unit *)malloc(sizeof(Unit) * (size_t)(count * split + 1));
    if (!units) return -1;
    int64_t nu = 0;
    for (int64_t b = seq_begin; b < seq_end; b++) {
        int64_t n = query_start_loc[b + 1] - query_start_loc[b];
        for (int64_t t = 0; t < n; t += QBLK)
            for (int64_t p = 0; p < split; p++)
                units[nu++] = (Unit){b, t, t + QBLK < n ? t + QBLK : n, kv_heads * p / split, kv_heads * (p + 1) / split};
    }
    AttentionJob job = {{q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, max_pages, page_size,
                         heads, kv_heads, dim, scale, out, args->sinks, args->window, args->softcap}, units, 0};
    exl_parallel_for(attend_units, &job, nu);
    free(units);
    return atomic_load(&job.failed) ? -1 : 0;
}

#else

int exl_paged_attention(const exl_paged_attention_args *args) {
    (void)args;
    return -1;
}

#endif
