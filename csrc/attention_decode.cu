// Paged attention for decode: one query per sequence against its K/V pages, split over the KV
// length (flash-decoding). Each block takes one sequence, one KV head (all the query heads of its
// GQA group, so K and V are read once) and one partition of kPartitionTokens tokens. Partitions
// sit at fixed token offsets and are combined in order, so a sequence's result does not depend on
// the batch it runs in. When the block table allows only one partition the block writes the
// output itself; otherwise a second kernel merges the partitions' (max, sum, accumulator).
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

// Version 1 is the default (measured faster on the H200); EXLCLI_DECODE_KERNEL=2 selects
// version 2, and exlcli/ops/_ext.py switches to the other one when the default fails its check.
bool use_decode_v1() {
  const char* v = std::getenv("EXLCLI_DECODE_KERNEL");
  return v == nullptr || v[0] != '2';
}

template <typename T, int D, int GMAX>
void launch(const DecodeParams& p, int num_seqs, cudaStream_t stream) {
  const dim3 grid(p.num_kv_heads * p.head_chunks, num_seqs, p.max_parts);
  if (use_decode_v1()) {
    if (decode_attention_warps() == 4) {
      launch_pdl(paged_decode_kernel<T, D, GMAX, 4>, grid, dim3(4 * 32), 0, stream, p);
    } else {
      launch_pdl(paged_decode_kernel<T, D, GMAX, 8>, grid, dim3(8 * 32), 0, stream, p);
    }
  } else {
    launch_pdl(paged_decode_v2_kernel<T, D, GMAX>, grid, dim3(kThreads), 0, stream, p);
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
