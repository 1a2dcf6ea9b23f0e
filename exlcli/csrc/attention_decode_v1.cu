// Decode attention, version 1: block-wide phases (scores of the partition into shared memory,
// then max and sum per head, then the weighted sum of V). Runs every float type on every device;
// the dispatch picks it for fp32, before sm_80, or when the caller asks for it.
#include "attention_decode.cuh"

namespace exlcli {
namespace decode_attention {
namespace {

constexpr int kWarpsV1 = 8;  // warps per block: 4 make the batch-1 Llama-8B decode graph slower on the H200
constexpr int kUnroll = 8;  // token passes whose loads are in flight together

template <typename T, int D, int GMAX, int WARPS>
__global__ void __launch_bounds__(WARPS * 32) paged_decode_kernel(const DecodeParams p) {
  grid_dependency_wait();  // launched with launch_pdl: the previous kernel may still run
  grid_dependents_launch();
  constexpr int VW = Vec<T>::N;  // elements per 16-byte load
  constexpr int TPT = D / VW < 32 ? D / VW : 32;  // threads per token
  constexpr int NV = D / (TPT * VW);  // 16-byte loads per thread per token (2: fp32 heads of 256)
  constexpr int EPT = NV * VW;  // elements of the head per thread, side by side
  constexpr int TPW = 32 / TPT;  // tokens per warp per pass
  constexpr int PASS = WARPS * TPW;  // tokens per block per pass
  constexpr int UNROLL = kUnroll / NV;  // the same bytes in flight whatever NV
  static_assert(TPT * EPT == D && 32 % TPT == 0, "head_dim must split evenly over a warp");
  // Heads of 256: the warps' partial outputs are summed into one [GMAX][D] buffer, a warp at a time in
  // warp order (the sum a [WARPS][GMAX][D] buffer gives, whose 64 KB would pass the 48 KB of static
  // shared memory).
  constexpr bool kSerialReduce = D > 128;

  __shared__ float s_scores[GMAX][kPartitionTokens];  // scores, then exp(score - max)
  __shared__ float s_red[kSerialReduce ? 1 : WARPS][GMAX][D];
  __shared__ float s_max[GMAX], s_sum[GMAX];
  __shared__ int64_t s_slot[kPartitionTokens];

  const DecodeBlock<T, D> blk(p, GMAX);
  if (blk.idle(p, WARPS * 32)) return;
  const int kvh = blk.kvh, b = blk.b;
  const int ng = blk.ng, head0 = blk.head0;
  const int64_t row = blk.row;
  T* out = blk.out;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int start = blk.start, n = blk.n;
  const int sub = lane % TPT;  // which EPT elements of the head this thread owns
  const int tok = lane / TPT;  // which token of the warp's pass

  float qv[GMAX][EPT];
  {
    const T* qp = static_cast<const T*>(p.q) + row * p.q_row_stride + static_cast<int64_t>(head0) * D + sub * EPT;
#pragma unroll
    for (int g = 0; g < GMAX; ++g) {
#pragma unroll
      for (int j = 0; j < NV; ++j) {
        if (g < ng) {
          const Vec<T> x = load_vec(qp + g * D + j * VW);
#pragma unroll
          for (int e = 0; e < VW; ++e) qv[g][j * VW + e] = to_float(x.v[e]);
        } else {
#pragma unroll
          for (int e = 0; e < VW; ++e) qv[g][j * VW + e] = 0.f;
        }
      }
    }
  }

  const int64_t slot_stride = static_cast<int64_t>(p.num_kv_heads) * D;
  const int64_t head_offset = static_cast<int64_t>(kvh) * D + sub * EPT;
  fill_slots(s_slot, p.block_tables + b * p.bt_stride, start, n, p.page_size);  // ends with a barrier
  auto token_ptr = [&](const void* cache, int t) {
    return static_cast<const T*>(cache) + s_slot[t] * slot_stride + head_offset;
  };

  // Phase 1: scores of every token of the partition for every head of the group.
  for (int t0 = warp * TPW; t0 < n; t0 += PASS * UNROLL) {
    Vec<T> kv[UNROLL][NV];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int t = t0 + u * PASS + tok;
      if (t < n) {
#pragma unroll
        for (int j = 0; j < NV; ++j) kv[u][j] = load_vec(token_ptr(p.k_cache, t) + j * VW);
      }
    }
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int t = t0 + u * PASS + tok;
      float kf[EPT];
#pragma unroll
      for (int j = 0; j < NV; ++j)
#pragma unroll
        for (int e = 0; e < VW; ++e) kf[j * VW + e] = t < n ? to_float(kv[u][j].v[e]) : 0.f;
#pragma unroll
      for (int g = 0; g < GMAX; ++g) {
        float s = 0.f;
#pragma unroll
        for (int e = 0; e < EPT; ++e) s = fmaf(qv[g][e], kf[e], s);
#pragma unroll
        for (int o = TPT / 2; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
        if (sub == 0 && t < n && g < ng) s_scores[g][t] = soft_capped(p, s * p.scale);
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
  float acc[GMAX][EPT];
#pragma unroll
  for (int g = 0; g < GMAX; ++g)
#pragma unroll
    for (int e = 0; e < EPT; ++e) acc[g][e] = 0.f;
  for (int t0 = warp * TPW; t0 < n; t0 += PASS * UNROLL) {
    Vec<T> vv[UNROLL][NV];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int t = t0 + u * PASS + tok;
      if (t < n) {
#pragma unroll
        for (int j = 0; j < NV; ++j) vv[u][j] = load_vec(token_ptr(p.v_cache, t) + j * VW);
      }
    }
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int t = t0 + u * PASS + tok;
      if (t < n) {
#pragma unroll
        for (int g = 0; g < GMAX; ++g) {
          const float w = g < ng ? s_scores[g][t] : 0.f;
#pragma unroll
          for (int j = 0; j < NV; ++j)
#pragma unroll
            for (int e = 0; e < VW; ++e) acc[g][j * VW + e] = fmaf(w, to_float(vv[u][j].v[e]), acc[g][j * VW + e]);
        }
      }
    }
  }
#pragma unroll
  for (int g = 0; g < GMAX; ++g)
#pragma unroll
    for (int e = 0; e < EPT; ++e)
#pragma unroll
      for (int o = TPT; o < 32; o <<= 1) acc[g][e] += __shfl_xor_sync(0xffffffffu, acc[g][e], o);
  if constexpr (kSerialReduce) {
    for (int w = 0; w < WARPS; ++w) {  // block-uniform: every thread reaches each barrier
      if (warp == w && lane < TPT) {
#pragma unroll
        for (int g = 0; g < GMAX; ++g)
          if (g < ng)
#pragma unroll
            for (int e = 0; e < EPT; ++e) {
              float& r = s_red[0][g][sub * EPT + e];
              r = (w == 0 ? 0.f : r) + acc[g][e];
            }
      }
      __syncthreads();
    }
  } else {
    if (lane < TPT) {
#pragma unroll
      for (int g = 0; g < GMAX; ++g)
        if (g < ng)
#pragma unroll
          for (int e = 0; e < EPT; ++e) s_red[warp][g][sub * EPT + e] = acc[g][e];
    }
    __syncthreads();
  }

  for (int i = tid; i < ng * D; i += (WARPS * 32)) {
    const int g = i / D, d = i % D;
    float o = 0.f;
    if constexpr (kSerialReduce) {
      o = s_red[0][g][d];
    } else {
#pragma unroll
      for (int w = 0; w < WARPS; ++w) o += s_red[w][g][d];
    }
    if (p.max_parts == 1) {
      // the combine kernel computes the same for one part
      out[i] = from_float<T>(o * output_factor(p, head0 + g, s_max[g], s_sum[g]));
    } else {
      const int64_t idx = (static_cast<int64_t>(b) * p.num_heads + head0 + g) * p.max_parts + blk.slot;
      p.part_acc[idx * D + d] = o;
      if (d == 0) {
        p.part_ml[idx * 2] = s_max[g];
        p.part_ml[idx * 2 + 1] = s_sum[g];
      }
    }
  }
}

template <typename T, int D>
void launch_group(const DecodeParams& p, int gmax, const dim3& grid, cudaStream_t stream, bool pdl) {
  switch (gmax) {
    case 1: launch_pdl(paged_decode_kernel<T, D, 1, kWarpsV1>, grid, dim3(kWarpsV1 * 32), 0, stream, pdl, p); break;
    case 2: launch_pdl(paged_decode_kernel<T, D, 2, kWarpsV1>, grid, dim3(kWarpsV1 * 32), 0, stream, pdl, p); break;
    case 4: launch_pdl(paged_decode_kernel<T, D, 4, kWarpsV1>, grid, dim3(kWarpsV1 * 32), 0, stream, pdl, p); break;
    default: launch_pdl(paged_decode_kernel<T, D, 8, kWarpsV1>, grid, dim3(kWarpsV1 * 32), 0, stream, pdl, p); break;
  }
}

}  // namespace

void launch_v1(const DecodeParams& p, at::ScalarType dtype, int head_dim, int gmax, const dim3& grid,
               cudaStream_t stream, bool pdl) {
  EXL_DISPATCH_FLOAT(dtype, "paged attention", [&] {
    if (head_dim == 64) {
      launch_group<scalar_t, 64>(p, gmax, grid, stream, pdl);
    } else if (head_dim == 128) {
      launch_group<scalar_t, 128>(p, gmax, grid, stream, pdl);
    } else {
      launch_group<scalar_t, 256>(p, gmax, grid, stream, pdl);
    }
  });
}

}  // namespace decode_attention
}  // namespace exlcli
