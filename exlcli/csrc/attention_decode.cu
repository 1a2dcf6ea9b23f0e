// Paged attention for decode: one query per sequence against its K/V pages, split over the KV
// length (flash-decoding). Each block takes one sequence, one KV head (all the query heads of its
// GQA group, so K and V are read once) and one partition of kPartitionTokens tokens. Partitions
// sit at fixed token offsets and are combined in order, so a sequence's result does not depend on
// the batch it runs in. When the block table allows only one partition the block writes the
// output itself; otherwise a second kernel merges the partitions' (max, sum, accumulator).
// Three versions compute the same partitions (EXLCLI_DECODE_KERNEL picks one): see each kernel.
#include <atomic>
#include <cstdint>
#include <cstdlib>

#include <ATen/ops/empty.h>

#include "common.cuh"
#include "ops.h"

namespace exlcli {
namespace {

constexpr int kPartitionTokens = 256;
constexpr int kWarps = 4;  // version 2; version 1 takes its warps as a template argument
constexpr int kThreads = kWarps * 32;
constexpr int kUnroll = 8;  // version 1: token passes whose loads are in flight together
constexpr int kUnrollV2 = 4;  // version 2: tokens per lane group whose K and V load together

struct DecodeParams {
  void* out;  // [rows, num_heads, D] contiguous
  float* part_acc;  // [B, num_heads, max_parts, D]: unnormalised partition outputs
  float* part_ml;  // [B, num_heads, max_parts, 2]: partition max and sum of exp
  const void* q;  // [rows, num_heads, D], heads and elements packed
  int64_t q_row_stride;
  const void* k_cache;  // [pages, page_size, num_kv_heads, D]
  const void* v_cache;
  const int* block_tables;  // [B, width]
  int64_t bt_stride;
  const int* seq_lens;  // [B]
  const int* query_start_loc;  // [B + 1] or nullptr
  int num_heads, num_kv_heads, group, head_chunks, page_size, max_parts;
  float scale;
};

// The query row of sequence b, or -1 when the sequence has no single query to answer here.
__device__ __forceinline__ int64_t query_row(const DecodeParams& p, int b) {
  if (p.query_start_loc == nullptr) return b;
  const int q0 = p.query_start_loc[b], q1 = p.query_start_loc[b + 1];
  return q1 - q0 == 1 ? q0 : -1;
}

// The cache slot of each token of the partition, looked up once so the loops' loads do not wait
// on the block table.
__device__ __forceinline__ void fill_slots(int64_t* s_slot, const int* table, int start, int n, int page_size) {
  for (int t = threadIdx.x; t < n; t += blockDim.x) {
    const int pos = start + t;
    s_slot[t] = static_cast<int64_t>(table[pos / page_size]) * page_size + pos % page_size;
  }
  __syncthreads();
}

// Where one block of a decode kernel works: grid (kv head x head chunk, sequence, partition).
template <typename T, int D>
struct DecodeBlock {
  int kvh, b, part, seq_len, num_parts, ng, head0;
  int64_t row;  // -1: nothing to do for this sequence
  T* out;       // the first of the block's ng query heads in the output row

  __device__ __forceinline__ DecodeBlock(const DecodeParams& p, int gmax) {
    const int chunk = blockIdx.x % p.head_chunks;
    kvh = blockIdx.x / p.head_chunks;
    b = blockIdx.y;
    part = blockIdx.z;
    row = query_row(p, b);
    seq_len = row < 0 ? 0 : p.seq_lens[b];
    num_parts = ceil_div(seq_len, kPartitionTokens);
    const int g0 = chunk * gmax;
    ng = min(gmax, p.group - g0);
    head0 = kvh * p.group + g0;
    out = static_cast<T*>(p.out) + (row < 0 ? 0 : row) * (static_cast<int64_t>(p.num_heads) * D) +
          static_cast<int64_t>(head0) * D;
  }

  // True when this block has no partition to compute (and it wrote the zeros of an empty row).
  __device__ __forceinline__ bool idle(const DecodeParams& p, int threads) const {
    if (row < 0) return true;
    if (part < num_parts) return false;
    if (part == 0 && p.max_parts == 1) {  // an empty sequence (a padded row): zeros
      for (int i = threadIdx.x; i < ng * D; i += threads) out[i] = from_float<T>(0.f);
    }
    return true;
  }
};

template <typename T, int D, int GMAX, int WARPS>
__global__ void __launch_bounds__(WARPS * 32) paged_decode_kernel(const DecodeParams p) {
  grid_dependency_wait();  // launched with launch_pdl: the previous kernel may still run
  grid_dependents_launch();
  constexpr int VW = Vec<T>::N;  // elements per 16-byte load
  constexpr int TPT = D / VW;  // threads per token
  constexpr int TPW = 32 / TPT;  // tokens per warp per pass
  constexpr int PASS = WARPS * TPW;  // tokens per block per pass
  static_assert(TPT <= 32 && 32 % TPT == 0, "head_dim must split evenly over a warp");

  __shared__ float s_scores[GMAX][kPartitionTokens];  // scores, then exp(score - max)
  __shared__ float s_red[WARPS][GMAX][D];
  __shared__ float s_max[GMAX], s_sum[GMAX];
  __shared__ int64_t s_slot[kPartitionTokens];

  const DecodeBlock<T, D> blk(p, GMAX);
  if (blk.idle(p, WARPS * 32)) return;
  const int kvh = blk.kvh, b = blk.b, part = blk.part, seq_len = blk.seq_len, num_parts = blk.num_parts;
  const int ng = blk.ng, head0 = blk.head0;
  const int64_t row = blk.row;
  T* out = blk.out;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int start = part * kPartitionTokens;
  const int n = min(kPartitionTokens, seq_len - start);
  const int sub = lane % TPT;  // which 16-byte slice of the head this thread owns
  const int tok = lane / TPT;  // which token of the warp's pass

  float qv[GMAX][VW];
  {
    const T* qp = static_cast<const T*>(p.q) + row * p.q_row_stride + static_cast<int64_t>(head0) * D + sub * VW;
#pragma unroll
    for (int g = 0; g < GMAX; ++g) {
      if (g < ng) {
        const Vec<T> x = load_vec(qp + g * D);
#pragma unroll
        for (int e = 0; e < VW; ++e) qv[g][e] = to_float(x.v[e]);
      } else {
#pragma unroll
        for (int e = 0; e < VW; ++e) qv[g][e] = 0.f;
      }
    }
  }

  const int64_t slot_stride = static_cast<int64_t>(p.num_kv_heads) * D;
  const int64_t head_offset = static_cast<int64_t>(kvh) * D + sub * VW;
  fill_slots(s_slot, p.block_tables + b * p.bt_stride, start, n, p.page_size);  // ends with a barrier
  auto token_ptr = [&](const void* cache, int t) {
    return static_cast<const T*>(cache) + s_slot[t] * slot_stride + head_offset;
  };

  // Phase 1: scores of every token of the partition for every head of the group.
  for (int t0 = warp * TPW; t0 < n; t0 += PASS * kUnroll) {
    Vec<T> kv[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int t = t0 + u * PASS + tok;
      if (t < n) kv[u] = load_vec(token_ptr(p.k_cache, t));
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int t = t0 + u * PASS + tok;
      float kf[VW];
#pragma unroll
      for (int e = 0; e < VW; ++e) kf[e] = t < n ? to_float(kv[u].v[e]) : 0.f;
#pragma unroll
      for (int g = 0; g < GMAX; ++g) {
        float s = 0.f;
#pragma unroll
        for (int e = 0; e < VW; ++e) s = fmaf(qv[g][e], kf[e], s);
#pragma unroll
        for (int o = TPT / 2; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
        if (sub == 0 && t < n && g < ng) s_scores[g][t] = s * p.scale;
      }
    }
  }
  __syncthreads();

  // Phase 2: max and sum of exp per head, one warp per head.
  for (int g = warp; g < ng; g += WARPS) {
    float m = -INFINITY;
    for (int t = lane; t < n; t += 32) m = fmaxf(m, s_scores[g][t]);
    m = warp_max(m);
    float l = 0.f;
    for (int t = lane; t < n; t += 32) {
      const float e = expf(s_scores[g][t] - m);
      s_scores[g][t] = e;
      l += e;
    }
    l = warp_sum(l);
    if (lane == 0) {
      s_max[g] = m;
      s_sum[g] = l;
    }
  }
  __syncthreads();

  // Phase 3: sum of exp(score) * v, then over the tokens handled side by side.
  float acc[GMAX][VW];
#pragma unroll
  for (int g = 0; g < GMAX; ++g)
#pragma unroll
    for (int e = 0; e < VW; ++e) acc[g][e] = 0.f;
  for (int t0 = warp * TPW; t0 < n; t0 += PASS * kUnroll) {
    Vec<T> vv[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int t = t0 + u * PASS + tok;
      if (t < n) vv[u] = load_vec(token_ptr(p.v_cache, t));
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int t = t0 + u * PASS + tok;
      if (t < n) {
#pragma unroll
        for (int g = 0; g < GMAX; ++g) {
          const float w = g < ng ? s_scores[g][t] : 0.f;
#pragma unroll
          for (int e = 0; e < VW; ++e) acc[g][e] = fmaf(w, to_float(vv[u].v[e]), acc[g][e]);
        }
      }
    }
  }
#pragma unroll
  for (int g = 0; g < GMAX; ++g)
#pragma unroll
    for (int e = 0; e < VW; ++e)
#pragma unroll
      for (int o = TPT; o < 32; o <<= 1) acc[g][e] += __shfl_xor_sync(0xffffffffu, acc[g][e], o);
  if (lane < TPT) {
#pragma unroll
    for (int g = 0; g < GMAX; ++g)
      if (g < ng)
#pragma unroll
        for (int e = 0; e < VW; ++e) s_red[warp][g][sub * VW + e] = acc[g][e];
  }
  __syncthreads();

  for (int i = tid; i < ng * D; i += (WARPS * 32)) {
    const int g = i / D, d = i % D;
    float o = 0.f;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) o += s_red[w][g][d];
    if (p.max_parts == 1) {
      out[i] = from_float<T>(o * (1.f / s_sum[g]));  // the combine kernel computes the same for one part
    } else {
      const int64_t idx = (static_cast<int64_t>(b) * p.num_heads + head0 + g) * p.max_parts + part;
      p.part_acc[idx * D + d] = o;
      if (d == 0) {
        p.part_ml[idx * 2] = s_max[g];
        p.part_ml[idx * 2 + 1] = s_sum[g];
      }
    }
  }
}

// Version 2: no block-wide phases. Each group of TPT lanes walks its own tokens of
// the partition with an online softmax, loading K and V of kUnroll tokens together (2 * kUnroll
// 16-byte loads in flight per lane); the lane groups of a warp, then the warps, merge their
// (max, sum, accumulator) in a fixed order at the end. Same partitions and outputs as version 1.
template <typename T, int D, int GMAX>
__global__ void __launch_bounds__(kThreads) paged_decode_v2_kernel(const DecodeParams p) {
  grid_dependency_wait();  // launched with launch_pdl: the previous kernel may still run
  grid_dependents_launch();
  constexpr int VW = Vec<T>::N;
  constexpr int TPT = D / VW;
  constexpr int TPW = 32 / TPT;
  constexpr int PASS = kWarps * TPW;
  static_assert(TPT <= 32 && 32 % TPT == 0, "head_dim must split evenly over a warp");

  __shared__ float s_red[kWarps][GMAX][D];
  __shared__ float s_wm[kWarps][GMAX], s_wl[kWarps][GMAX];
  __shared__ int64_t s_slot[kPartitionTokens];

  const DecodeBlock<T, D> blk(p, GMAX);
  if (blk.idle(p, kThreads)) return;
  const int kvh = blk.kvh, b = blk.b, part = blk.part, seq_len = blk.seq_len, num_parts = blk.num_parts;
  const int ng = blk.ng, head0 = blk.head0;
  const int64_t row = blk.row;
  T* out = blk.out;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int start = part * kPartitionTokens;
  const int n = min(kPartitionTokens, seq_len - start);
  const int sub = lane % TPT;
  const int tok = lane / TPT;

  float qv[GMAX][VW];
  {
    const T* qp = static_cast<const T*>(p.q) + row * p.q_row_stride + static_cast<int64_t>(head0) * D + sub * VW;
#pragma unroll
    for (int g = 0; g < GMAX; ++g) {
      if (g < ng) {
        const Vec<T> x = load_vec(qp + g * D);
#pragma unroll
        for (int e = 0; e < VW; ++e) qv[g][e] = to_float(x.v[e]) * p.scale;
      } else {
#pragma unroll
        for (int e = 0; e < VW; ++e) qv[g][e] = 0.f;
      }
    }
  }
  const int64_t slot_stride = static_cast<int64_t>(p.num_kv_heads) * D;
  const int64_t head_offset = static_cast<int64_t>(kvh) * D + sub * VW;
  fill_slots(s_slot, p.block_tables + b * p.bt_stride, start, n, p.page_size);

  float m[GMAX], l[GMAX], acc[GMAX][VW];
#pragma unroll
  for (int g = 0; g < GMAX; ++g) {
    m[g] = -INFINITY;
    l[g] = 0.f;
#pragma unroll
    for (int e = 0; e < VW; ++e) acc[g][e] = 0.f;
  }

  for (int t0 = warp * TPW; t0 < n; t0 += PASS * kUnrollV2) {  // warp-uniform bound
    Vec<T> kk[kUnrollV2], vv[kUnrollV2];
#pragma unroll
    for (int u = 0; u < kUnrollV2; ++u) {
      const int t = t0 + u * PASS + tok;
      if (t < n) {
        const int64_t off = s_slot[t] * slot_stride + head_offset;
        kk[u] = load_vec(static_cast<const T*>(p.k_cache) + off);
        vv[u] = load_vec(static_cast<const T*>(p.v_cache) + off);
      }
    }
    float s[kUnrollV2][GMAX];
#pragma unroll
    for (int u = 0; u < kUnrollV2; ++u) {
      const bool valid = t0 + u * PASS + tok < n;
#pragma unroll
      for (int g = 0; g < GMAX; ++g) {
        float d = 0.f;
#pragma unroll
        for (int e = 0; e < VW; ++e) d = fmaf(qv[g][e], valid ? to_float(kk[u].v[e]) : 0.f, d);
#pragma unroll
        for (int o = TPT / 2; o > 0; o >>= 1) d += __shfl_xor_sync(0xffffffffu, d, o);
        s[u][g] = valid ? d : -INFINITY;
      }
    }
#pragma unroll
    for (int g = 0; g < GMAX; ++g) {
      float m_new = m[g];
#pragma unroll
      for (int u = 0; u < kUnrollV2; ++u) m_new = fmaxf(m_new, s[u][g]);
      if (m_new == -INFINITY) continue;  // this lane group has no token yet
      const float alpha = expf(m[g] - m_new);  // 0 on the first token
      l[g] *= alpha;
#pragma unroll
      for (int e = 0; e < VW; ++e) acc[g][e] *= alpha;
#pragma unroll
      for (int u = 0; u < kUnrollV2; ++u) {
        if (s[u][g] == -INFINITY) continue;
        const float w = expf(s[u][g] - m_new);
        l[g] += w;
#pragma unroll
        for (int e = 0; e < VW; ++e) acc[g][e] = fmaf(w, to_float(vv[u].v[e]), acc[g][e]);
      }
      m[g] = m_new;
    }
  }

  // Merge the lane groups of the warp (lanes with the same `sub`), in a fixed xor order.
#pragma unroll
  for (int g = 0; g < GMAX; ++g) {
    float mw = m[g];
#pragma unroll
    for (int o = TPT; o < 32; o <<= 1) mw = fmaxf(mw, __shfl_xor_sync(0xffffffffu, mw, o));
    const float scale = (mw == -INFINITY || m[g] == -INFINITY) ? 0.f : expf(m[g] - mw);
    float lw = l[g] * scale;
#pragma unroll
    for (int o = TPT; o < 32; o <<= 1) lw += __shfl_xor_sync(0xffffffffu, lw, o);
#pragma unroll
    for (int e = 0; e < VW; ++e) {
      float a = acc[g][e] * scale;
#pragma unroll
      for (int o = TPT; o < 32; o <<= 1) a += __shfl_xor_sync(0xffffffffu, a, o);
      acc[g][e] = a;
    }
    if (lane < TPT && g < ng) {
#pragma unroll
      for (int e = 0; e < VW; ++e) s_red[warp][g][sub * VW + e] = acc[g][e];
      if (lane == 0) {
        s_wm[warp][g] = mw;
        s_wl[warp][g] = lw;
      }
    }
  }
  __syncthreads();

  // Merge the warps, in order.
  for (int i = tid; i < ng * D; i += kThreads) {
    const int g = i / D, d = i % D;
    float mb = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) mb = fmaxf(mb, s_wm[w][g]);
    float o = 0.f, lb = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      if (s_wm[w][g] == -INFINITY) continue;
      const float scale = expf(s_wm[w][g] - mb);
      o = fmaf(s_red[w][g][d], scale, o);
      lb = fmaf(s_wl[w][g], scale, lb);
    }
    if (p.max_parts == 1) {
      out[i] = from_float<T>(o * (1.f / lb));  // the combine kernel computes the same for one part
    } else {
      const int64_t idx = (static_cast<int64_t>(b) * p.num_heads + head0 + g) * p.max_parts + part;
      p.part_acc[idx * D + d] = o;
      if (d == 0) {
        p.part_ml[idx * 2] = mb;
        p.part_ml[idx * 2 + 1] = lb;
      }
    }
  }
}

// ---- version 3: tensor cores, K/V staged in shared memory by cp.async -------------------------
// Each warp owns 16 tokens of every 64-token tile of the partition (tokens 16w..16w+15 of the
// tile) and walks its share on its own. Its shared memory is a ring of SLOTS slots of 16 rows
// (K rows of tile i, then V rows of tile i, then K rows of tile i + 1, ...), filled with cp.async
// ahead of use, so SLOTS - 1 of them are in flight while it computes, without holding registers.
// It computes with mma.sync m16n8k16:
//   scores S = Q K^T: 16 rows of query heads (GMAX <= 8 used, the rest zero) x 16 tokens;
//   an online softmax per head in base 2 (q.k * scale * log2(e)), the weights P rounded to T as
//   the reference rounds its probabilities;
//   O^T += V^T P^T: D rows x 8 heads, so P's fragments in the scores' registers are already the
//   B operand (no shuffle or shared-memory round trip), and the accumulator is D/16 x 4 floats.
// The warps merge their (max, sum, accumulator) in a fixed order at the end, as version 2 does.
// Nothing depends on the batch: the tiles sit at fixed offsets of the fixed partitions.
constexpr int kTileV3 = 64;  // tokens per tile: 16 per warp
// 16-row K or V slots per warp: 48 KB a block at D = 128, so 4 blocks an SM (the batch-64 grid of
// 512 blocks is resident at once). On the H200, 4 slots (64 KB, 3 blocks an SM) took 23.7 us instead
// of 17.7 at 64 x 208 tokens and were no faster elsewhere.
constexpr int kSlotsV3 = 3;
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

template <int D, int SLOTS>
constexpr int v3_smem_bytes() {  // per block: kWarps x SLOTS x 16 rows x D x 2 bytes
  return kWarps * SLOTS * 16 * D * 2;
}

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16 bytes global -> shared, bypassing L1; src_bytes 0 writes zeros (a token past the sequence).
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, int src_bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
#endif
}

__device__ __forceinline__ void cp_async_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;" ::: "memory");
#endif
}

template <int N>
__device__ __forceinline__ void cp_async_wait() {  // all but the N most recent groups are done
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
#endif
}

template <bool kTrans>
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if constexpr (kTrans) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
  } else {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
  }
#endif
}

// d += a (16x16, row) * b (16x8, col), fp32 accumulate. a1 and a3 (rows 8..15) are zero here.
template <typename T>
__device__ __forceinline__ void mma_16816(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                          uint32_t b0, uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
                 "{%8, %9}, {%0, %1, %2, %3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  } else {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
                 "{%8, %9}, {%0, %1, %2, %3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
#endif
}

template <typename T>
__device__ __forceinline__ uint32_t bits16(T x) {
  return static_cast<uint32_t>(*reinterpret_cast<const uint16_t*>(&x));
}

// Rounds lo and hi to T and packs them (lo in the low half, as mma operands want); adds the
// rounded values to `sum`.
template <typename T>
__device__ __forceinline__ uint32_t pack_round(float lo, float hi, float& sum) {
  const T a = from_float<T>(lo), b = from_float<T>(hi);
  sum += to_float(a) + to_float(b);
  return bits16(a) | (bits16(b) << 16);
}

template <typename T, int D, int GMAX, int SLOTS>
__global__ void __launch_bounds__(kThreads, 4) paged_decode_v3_kernel(const DecodeParams p) {
  grid_dependency_wait();  // launched with launch_pdl: the previous kernel may still run
  // No grid_dependents_launch() here: it comes at the end (see launch_v3).
  static_assert(sizeof(T) == 2 && GMAX <= 8 && D % 16 == 0, "version 3: 16-bit types, at most 8 heads");
  static_assert(SLOTS >= 3 && SLOTS * 16 * D * 2 >= GMAX * D * 4, "version 3: the ring also holds the warp's result");
  constexpr int CPR = D * 2 / 16;  // 16-byte chunks per K or V row
  constexpr int KSTEPS = D / 16;  // mma steps over the head dim (scores), and row blocks of O^T
  constexpr int ROWS = 16;  // tokens per warp per tile
  constexpr int SLOT = ROWS * D;  // elements of one slot

  extern __shared__ __align__(128) unsigned char v3_smem[];
  __shared__ int64_t s_slot[kPartitionTokens];
  __shared__ float s_wm[kWarps][GMAX], s_wl[kWarps][GMAX];

  const DecodeBlock<T, D> blk(p, GMAX);
  if (blk.idle(p, kThreads)) return;
  const int b = blk.b, part = blk.part, ng = blk.ng, head0 = blk.head0;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, c = lane & 3;  // the mma fragments' row group and column pair
  const int start = part * kPartitionTokens;
  const int n = min(kPartitionTokens, blk.seq_len - start);

  // A operand of the scores: the query heads as rows (row g = head g; rows 8..15 stay zero).
  uint32_t qa[KSTEPS][2];
  {
    const T* qp = static_cast<const T*>(p.q) + blk.row * p.q_row_stride + static_cast<int64_t>(head0 + g) * D + 2 * c;
#pragma unroll
    for (int k = 0; k < KSTEPS; ++k) {
      qa[k][0] = g < ng ? *reinterpret_cast<const uint32_t*>(qp + k * 16) : 0u;
      qa[k][1] = g < ng ? *reinterpret_cast<const uint32_t*>(qp + k * 16 + 8) : 0u;
    }
  }
  fill_slots(s_slot, p.block_tables + b * p.bt_stride, start, n, p.page_size);  // ends with a barrier

  T* const ring = reinterpret_cast<T*>(v3_smem) + warp * (SLOTS * SLOT);
  const int64_t slot_stride = static_cast<int64_t>(p.num_kv_heads) * D;
  const T* const k_head = static_cast<const T*>(p.k_cache) + static_cast<int64_t>(blk.kvh) * D;
  const T* const v_head = static_cast<const T*>(p.v_cache) + static_cast<int64_t>(blk.kvh) * D;
  const int first = warp * ROWS;  // this warp's first token in every tile
  const int tiles = n > first ? ceil_div(n - first, kTileV3) : 0;

  // Load number j of the warp: the 16 K rows (j even) or V rows (j odd) of tile j / 2, into slot
  // j % SLOTS. Chunk x of row r lands at chunk x ^ (r & 7), so ldmatrix's 8 rows of one chunk
  // column hit 8 distinct banks. Tokens past the sequence are zeros.
  auto issue = [&](int j) {
    const int i = j >> 1;
    if (i < tiles) {
      T* const dst_slot = ring + (j % SLOTS) * SLOT;
      const T* const src = (j & 1) ? v_head : k_head;
      const int base = i * kTileV3 + first;
#pragma unroll
      for (int u = 0; u < ROWS * CPR / 32; ++u) {
        const int chunk = lane + 32 * u, r = chunk / CPR, col = chunk % CPR;
        const bool valid = base + r < n;
        const int64_t off = valid ? s_slot[base + r] * slot_stride + col * 8 : 0;
        cp_async16(smem_addr(dst_slot + r * D + ((col ^ (r & 7)) * 8)), src + off, valid ? 16 : 0);
      }
    }
    cp_async_commit();  // an empty group past the end keeps the wait counts uniform
  };
  auto slot_of = [&](int j) { return ring + (j % SLOTS) * SLOT; };

  const float sc2 = p.scale * kLog2e;
  float m = -INFINITY, l = 0.f;  // head g's running max (base 2) and this lane's sum of weights
  float acc[KSTEPS][4];  // O^T rows 16k + g (+8), heads 2c and 2c + 1
#pragma unroll
  for (int k = 0; k < KSTEPS; ++k)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[k][e] = 0.f;
  const int lrow = (lane >> 4) * 8 + (lane & 7);  // ldmatrix: the row this lane points at
  const int lhalf = (lane >> 3) & 1;  // and which 8-column half

#pragma unroll
  for (int j = 0; j < SLOTS; ++j) issue(j);
  for (int i = 0; i < tiles; ++i) {  // warp-uniform
    const int valid = min(ROWS, n - (i * kTileV3 + first));
    cp_async_wait<SLOTS - 1>();  // load 2i (K of tile i) is done
    __syncwarp();  // and visible to every lane

    // S = Q K^T for 16 tokens: s[0] tokens 2c, 2c+1; s[1] tokens 8+2c, 9+2c (head g, and the
    // zero rows g + 8 in s[.][2..3]).
    float s[2][4] = {};
    const T* const ks = slot_of(2 * i);
#pragma unroll
    for (int k = 0; k < KSTEPS; ++k) {
      uint32_t kb[4];  // tokens 0-7: d 0-7, d 8-15; tokens 8-15: d 0-7, d 8-15
      ldmatrix_x4<false>(kb, smem_addr(ks + lrow * D + (((2 * k + lhalf) ^ (lrow & 7)) * 8)));
      mma_16816<T>(s[0], qa[k][0], 0u, qa[k][1], 0u, kb[0], kb[1]);
      mma_16816<T>(s[1], qa[k][0], 0u, qa[k][1], 0u, kb[2], kb[3]);
    }
    __syncwarp();  // every lane is done with K of tile i: its slot takes the next load
    issue(2 * i + SLOTS);

    // Online softmax of head g over the tile's tokens (the four lanes of g hold 4 tokens each).
    float x[4];
    x[0] = 2 * c < valid ? s[0][0] * sc2 : -INFINITY;
    x[1] = 2 * c + 1 < valid ? s[0][1] * sc2 : -INFINITY;
    x[2] = 8 + 2 * c < valid ? s[1][0] * sc2 : -INFINITY;
    x[3] = 9 + 2 * c < valid ? s[1][1] * sc2 : -INFINITY;
    float mx = fmaxf(fmaxf(x[0], x[1]), fmaxf(x[2], x[3]));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    const float m_new = fmaxf(m, mx);  // finite: token 0 of the tile is valid
    const float alpha = exp2f(m - m_new);  // 0 on the first tile
    m = m_new;
    float tile_sum = 0.f;
    const uint32_t pb0 = pack_round<T>(exp2f(x[0] - m_new), exp2f(x[1] - m_new), tile_sum);
    const uint32_t pb1 = pack_round<T>(exp2f(x[2] - m_new), exp2f(x[3] - m_new), tile_sum);
    l = fmaf(l, alpha, tile_sum);

    // O^T = O^T * alpha + V^T P^T. The accumulator's columns are heads 2c and 2c + 1.
    const float alpha_lo = __shfl_sync(0xffffffffu, alpha, 8 * c);
    const float alpha_hi = __shfl_sync(0xffffffffu, alpha, 8 * c + 4);
    cp_async_wait<SLOTS - 1>();  // load 2i + 1 (V of tile i) is done
    __syncwarp();
    const T* const vs = slot_of(2 * i + 1);
#pragma unroll
    for (int k = 0; k < KSTEPS; ++k) {
      uint32_t va[4];  // d 0-7 x tokens 0-7, d 8-15 x tokens 0-7, d 0-7 x tokens 8-15, d 8-15 x tokens 8-15
      ldmatrix_x4<true>(va, smem_addr(vs + lrow * D + (((2 * k + lhalf) ^ (lrow & 7)) * 8)));
      acc[k][0] *= alpha_lo;
      acc[k][1] *= alpha_hi;
      acc[k][2] *= alpha_lo;
      acc[k][3] *= alpha_hi;
      mma_16816<T>(acc[k], va[0], va[1], va[2], va[3], pb0, pb1);
    }
    __syncwarp();  // every lane is done with V of tile i
    issue(2 * i + 1 + SLOTS);
  }
  cp_async_wait<0>();
  __syncwarp();

  // Warp totals: the sum over the lanes of head g (m is already the warp's), then the
  // accumulator into this warp's own (now free) ring as [GMAX][D] floats.
  l += __shfl_xor_sync(0xffffffffu, l, 1);
  l += __shfl_xor_sync(0xffffffffu, l, 2);
  float* const red = reinterpret_cast<float*>(ring);
  if (c == 0 && g < GMAX) {
    s_wm[warp][g] = m;
    s_wl[warp][g] = l;
  }
#pragma unroll
  for (int k = 0; k < KSTEPS; ++k) {
    const int h = 2 * c;
    if (h < GMAX) {
      red[h * D + 16 * k + g] = acc[k][0];
      red[h * D + 16 * k + g + 8] = acc[k][2];
    }
    if (h + 1 < GMAX) {
      red[(h + 1) * D + 16 * k + g] = acc[k][1];
      red[(h + 1) * D + 16 * k + g + 8] = acc[k][3];
    }
  }
  __syncthreads();

  // Merge the warps, in order (a warp with no token has max -inf and is skipped).
  for (int idx = tid; idx < ng * D; idx += kThreads) {
    const int h = idx / D, d = idx % D;
    float mb = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) mb = fmaxf(mb, s_wm[w][h]);
    float o = 0.f, lb = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      if (s_wm[w][h] == -INFINITY) continue;
      const float scale = exp2f(s_wm[w][h] - mb);
      const float* const wred = reinterpret_cast<const float*>(v3_smem) + w * (SLOTS * SLOT / 2);
      o = fmaf(wred[h * D + d], scale, o);
      lb = fmaf(s_wl[w][h], scale, lb);
    }
    if (p.max_parts == 1) {
      blk.out[idx] = from_float<T>(o * (1.f / lb));  // the combine kernel computes the same for one part
    } else {
      const int64_t pi = (static_cast<int64_t>(b) * p.num_heads + head0 + h) * p.max_parts + part;
      p.part_acc[pi * D + d] = o;
      if (d == 0) {
        p.part_ml[pi * 2] = mb * kLn2;  // the combine kernel works in natural logs
        p.part_ml[pi * 2 + 1] = lb;
      }
    }
  }
  grid_dependents_launch();  // only now: see launch_v3
}

// One block per (head, sequence), one thread per element of the head.
template <typename T, int D>
__global__ void __launch_bounds__(D) paged_decode_combine_kernel(const DecodeParams p) {
  grid_dependency_wait();  // launched with launch_pdl: the previous kernel may still run
  grid_dependents_launch();
  const int h = blockIdx.x, b = blockIdx.y, d = threadIdx.x;
  const int64_t row = query_row(p, b);
  if (row < 0) return;
  T* out = static_cast<T*>(p.out) + row * (static_cast<int64_t>(p.num_heads) * D) + static_cast<int64_t>(h) * D;
  const int num_parts = ceil_div(p.seq_lens[b], kPartitionTokens);
  if (num_parts == 0) {
    out[d] = from_float<T>(0.f);
    return;
  }
  const int64_t base = (static_cast<int64_t>(b) * p.num_heads + h) * p.max_parts;
  float m = -INFINITY;
  for (int i = 0; i < num_parts; ++i) m = fmaxf(m, p.part_ml[(base + i) * 2]);
  float l = 0.f, o = 0.f;
  for (int i = 0; i < num_parts; ++i) {
    const float w = expf(p.part_ml[(base + i) * 2] - m);
    l = fmaf(p.part_ml[(base + i) * 2 + 1], w, l);
    o = fmaf(p.part_acc[(base + i) * D + d], w, o);
  }
  out[d] = from_float<T>(o * (1.f / l));
}

// Version 3 is the default (on the H200: 17 us at 64 x 208 tokens against 46 us for version 1, and
// faster at every measured shape); EXLCLI_DECODE_KERNEL=1 or 2 selects version 1 or 2 (read at
// each launch), and exlcli/ops/_ext.py switches versions when the one in use fails its check.
int decode_kernel_version() {
  const char* v = std::getenv("EXLCLI_DECODE_KERNEL");
  if (v != nullptr && v[0] == '1') return 1;
  if (v != nullptr && v[0] == '2') return 2;
  return 3;
}

// Version 3 needs sm_80 (cp.async, bf16 mma); older devices run version 1 instead.
bool device_has_sm80() {
  static std::atomic<int> cached[64] = {};  // 0 unknown, 1 no, 2 yes
  int device = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  std::atomic<int>& slot = cached[device & 63];
  int v = slot.load(std::memory_order_relaxed);
  if (v == 0) {
    int major = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
    v = major >= 8 ? 2 : 1;
    slot.store(v, std::memory_order_relaxed);
  }
  return v == 2;
}

template <typename T, int D, int GMAX, int SLOTS = kSlotsV3>
void launch_v3(const DecodeParams& p, const dim3& grid, cudaStream_t stream) {
  constexpr int smem = v3_smem_bytes<D, SLOTS>();
  auto kernel = paged_decode_v3_kernel<T, D, GMAX, SLOTS>;
  static std::atomic<uint64_t> configured{0};  // one bit per device: the attributes are set
  int device = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  const uint64_t bit = uint64_t{1} << (device & 63);
  if (!(configured.load(std::memory_order_relaxed) & bit)) {
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                        cudaSharedmemCarveoutMaxShared));
    configured.fetch_or(bit, std::memory_order_relaxed);
  }
  // Unlike the other kernels, this one lets the next kernel start only at its end: the o_proj
  // projection's blocks, started early beside it, made the batch-1 decode graph of Llama-8B on the
  // H200 take 5.34 ms instead of 4.40 (measured with the trigger at the start, at the end, and
  // nowhere: 5.34 / 4.40 / 4.41; the carveout and a plain launch made no difference).
  launch_pdl(kernel, grid, dim3(kThreads), smem, stream, p);
}

template <typename T, int D, int GMAX>
void launch(const DecodeParams& p, int num_seqs, cudaStream_t stream) {
  const dim3 grid(p.num_kv_heads * p.head_chunks, num_seqs, p.max_parts);
  int version = decode_kernel_version();
  if (version == 3 && (std::is_same_v<T, float> || !device_has_sm80())) version = 1;  // fp32: version 1
  if (version == 3) {
    if constexpr (!std::is_same_v<T, float>) launch_v3<T, D, GMAX>(p, grid, stream);
  } else if (version == 2) {
    launch_pdl(paged_decode_v2_kernel<T, D, GMAX>, grid, dim3(kThreads), 0, stream, p);
  } else if (decode_attention_warps() == 4) {
    launch_pdl(paged_decode_kernel<T, D, GMAX, 4>, grid, dim3(4 * 32), 0, stream, p);
  } else {
    launch_pdl(paged_decode_kernel<T, D, GMAX, 8>, grid, dim3(8 * 32), 0, stream, p);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (p.max_parts > 1) {
    launch_pdl(paged_decode_combine_kernel<T, D>, dim3(p.num_heads, num_seqs), dim3(D), 0, stream, p);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

template <typename T, int D>
void launch_group(const DecodeParams& p, int gmax, int num_seqs, cudaStream_t stream) {
  switch (gmax) {
    case 1: launch<T, D, 1>(p, num_seqs, stream); break;
    case 2: launch<T, D, 2>(p, num_seqs, stream); break;
    case 4: launch<T, D, 4>(p, num_seqs, stream); break;
    default: launch<T, D, 8>(p, num_seqs, stream); break;
  }
}

}  // namespace

void check_paged_attention_inputs(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_tables, const at::Tensor& seq_lens) {
  for (const at::Tensor* t : {&q, &k_cache, &v_cache, &block_tables, &seq_lens}) {
    EXL_CHECK_CUDA_TENSOR(*t, "paged attention: every input");
    TORCH_CHECK(t->device() == q.device(), "paged attention: inputs are on different devices");
  }
  TORCH_CHECK(q.dim() == 3, "paged attention: q must be [tokens, heads, head_dim], got ", q.sizes());
  const int64_t head_dim = q.size(2);
  TORCH_CHECK(head_dim == 64 || head_dim == 128, "paged attention: head_dim must be 64 or 128, got ", head_dim);
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == head_dim, "paged attention: q must have packed heads");
  TORCH_CHECK(q.stride(0) % (16 / q.element_size()) == 0 && aligned16(q.data_ptr()),
              "paged attention: q rows must be 16-byte aligned");
  for (const at::Tensor* c : {&k_cache, &v_cache}) {
    TORCH_CHECK(c->dim() == 4 && c->size(3) == head_dim, "paged attention: caches must be [pages, page_size, "
                "kv_heads, ", head_dim, "], got ", c->sizes());
    TORCH_CHECK(c->is_contiguous(), "paged attention: caches must be contiguous");
    TORCH_CHECK(c->scalar_type() == q.scalar_type(), "paged attention: cache dtype ", c->scalar_type(),
                " differs from q dtype ", q.scalar_type());
  }
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes(), "paged attention: k_cache and v_cache differ in shape");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0, "paged attention: ", q.size(1), " query heads are not a multiple of ",
              k_cache.size(2), " kv heads");
  EXL_CHECK_DTYPE(block_tables, at::kInt, "paged attention: block_tables");
  EXL_CHECK_DTYPE(seq_lens, at::kInt, "paged attention: seq_lens");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.stride(1) == 1,
              "paged attention: block_tables must be [sequences, pages] with contiguous rows");
  TORCH_CHECK(seq_lens.dim() == 1 && seq_lens.is_contiguous() && seq_lens.size(0) == block_tables.size(0),
              "paged attention: seq_lens must be a contiguous [", block_tables.size(0), "]");
}

void launch_paged_decode(const at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                         const at::Tensor& v_cache, const at::Tensor& block_tables,
                         const at::Tensor& seq_lens, const int* query_start_loc, double scale) {
  const int num_seqs = static_cast<int>(seq_lens.size(0));
  if (num_seqs == 0) return;
  TORCH_CHECK(num_seqs <= 65535, "paged attention: at most 65535 sequences per call, got ", num_seqs);
  DecodeParams p{};
  p.num_heads = static_cast<int>(q.size(1));
  p.num_kv_heads = static_cast<int>(k_cache.size(2));
  p.group = p.num_heads / p.num_kv_heads;
  const int gmax = p.group <= 1 ? 1 : p.group <= 2 ? 2 : p.group <= 4 ? 4 : 8;
  p.head_chunks = ceil_div(p.group, gmax);
  p.page_size = static_cast<int>(k_cache.size(1));
  const int64_t max_tokens = block_tables.size(1) * static_cast<int64_t>(p.page_size);
  p.max_parts = static_cast<int>(std::max<int64_t>(1, (max_tokens + kPartitionTokens - 1) / kPartitionTokens));
  TORCH_CHECK(p.max_parts <= 65535, "paged attention: block tables are too wide");
  const int64_t head_dim = q.size(2);
  at::Tensor part_acc, part_ml;
  if (p.max_parts > 1) {
    const auto f32 = q.options().dtype(at::kFloat);
    part_acc = at::empty({num_seqs, p.num_heads, p.max_parts, head_dim}, f32);
    part_ml = at::empty({num_seqs, p.num_heads, p.max_parts, 2}, f32);
    p.part_acc = part_acc.data_ptr<float>();
    p.part_ml = part_ml.data_ptr<float>();
  }
  p.out = out.data_ptr();
  p.q = q.data_ptr();
  p.q_row_stride = q.stride(0);
  p.k_cache = k_cache.data_ptr();
  p.v_cache = v_cache.data_ptr();
  p.block_tables = block_tables.data_ptr<int>();
  p.bt_stride = block_tables.stride(0);
  p.seq_lens = seq_lens.data_ptr<int>();
  p.query_start_loc = query_start_loc;
  p.scale = static_cast<float>(scale);
  const cudaStream_t stream = current_stream();
  EXL_DISPATCH_FLOAT(q.scalar_type(), "paged attention", [&] {
    if (head_dim == 64) {
      launch_group<scalar_t, 64>(p, gmax, num_seqs, stream);
    } else {
      launch_group<scalar_t, 128>(p, gmax, num_seqs, stream);
    }
  });
}

at::Tensor paged_attention_decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale) {
  check_paged_attention_inputs(q, k_cache, v_cache, block_tables, seq_lens);
  TORCH_CHECK(seq_lens.size(0) == q.size(0), "paged_attention_decode: one query per sequence: q has ", q.size(0),
              " rows for ", seq_lens.size(0), " sequences");
  const c10::cuda::CUDAGuard guard(q.device());
  at::Tensor out = at::empty(q.sizes(), q.options().memory_format(at::MemoryFormat::Contiguous));
  launch_paged_decode(out, q, k_cache, v_cache, block_tables, seq_lens, nullptr, scale);
  return out;
}

}  // namespace exlcli
