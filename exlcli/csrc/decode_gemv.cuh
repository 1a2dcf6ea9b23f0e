// The decode linear kernel: y[M, N] = x[M, K] @ W[N, K]^T (+ bias) for M <= 4 token rows, bf16 /
// fp16, streaming W once at close to the memory bandwidth, with optional fused stages:
//
//   prologue (what x is):  kPlain  x as given
//                          kNorm   rms_norm(r, norm_weight) of the given r, computed in the kernel
//                                  with the rounding and the summation order of norm.cu
//                          kSilu   silu(gate) * up of a fused [M, 2K] gate|up, as activation.cu
//   epilogue (what is written):
//                          kPlain     y, rounded to the dtype
//                          kResidual  round(round(y) + residual): the residual stream after this layer
//                          kFloat     round(y) as fp32 (the logits)
//                          kRopeKV    rows are q|k|v heads: q is rotated into q_out, k rotated and v
//                                     written into their KV pages, as rope.cu does
//
// Weights (W) are of the activations' dtype, or FP8 e4m3 (bf16 activations only) with an fp32 scale
// per row that multiplies the row's sum before the epilogue (FP8 checkpoints' per-tensor and
// per-channel scales; exlcli/ops/formats/cuda_fp8.py); their products run on fp16 pairs (dot16_e4m3).
//
// Work is split in row groups of kRows weight rows; each group is read by `warps_per_group` warps
// that split K between them (16-byte loads, unroll_of<W>() passes in flight per row), so even a
// 4096-row matrix gives every multiprocessor several groups. Over e4m3 rows a pass's registers are
// loaded again (the row group's next chunks, or the next row group's first) as soon as its products
// are done, so the loads stay in flight through the products, the warps' sums and the epilogue. The
// grid is persistent (blocks_per_sm<W, M>() a multiprocessor). The kernel is launched as a
// programmatic dependent launch: the first weights are loaded before it waits for the previous
// kernel (whose output is x).
#pragma once

#include <cuda_fp8.h>

#include "common.cuh"
#include "rope_kv.cuh"

namespace exlcli {
namespace gemv {

enum class In { kPlain, kNorm, kSilu };
enum class Out { kPlain, kResidual, kFloat, kRopeKV };

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kRows = 8;  // weight rows per row group (4 rotation pairs in kRopeKV)
constexpr int kNormMaxThreads = 1024;  // norm.cu's block size limit, whose summation order we follow
constexpr int kNormChunksPerThread = 4;

struct Params {
  const void* w;  // [n, k]
  const void* bias;  // [n] or nullptr
  const float* w_scale;  // e4m3 weights: [n], the scale of each row
  int n, k;
  const void* x;  // kPlain, kNorm: [rows, k]; kSilu: [rows, 2k]; rows x_stride apart
  int64_t x_stride;
  int rows;  // 1 .. M
  const void* norm_w;  // kNorm: [k]
  float eps;
  void* y;  // [rows, n] contiguous (fp32 for kFloat)
  const void* residual;  // kResidual: [rows, n], rows res_stride apart
  int64_t res_stride;
  RopeKV rope;  // kRopeKV: where the q|k|v rows go (rope_kv.cuh)
  int warps_per_group;  // 1, 2, 4 or 8
  int num_units;  // row groups
};

__device__ __forceinline__ uint4 load_cached(const void* p) { return __ldg(static_cast<const uint4*>(p)); }

// Weights in one 16-byte chunk of a weight row: 8 of bf16 / fp16, 16 of e4m3.
template <typename W>
constexpr int chunk_weights() {
  return 16 / static_cast<int>(sizeof(W));
}

// The kernel's shape for weights of W and M token rows. An e4m3 chunk carries twice the weights of a
// bf16 one, and so more products per load, so e4m3 rows keep one chunk a row in flight per thread
// instead of two and, at one token, run 3 blocks a multiprocessor instead of 2 (the same registers
// in flight, more warps to hide the products): 8B shapes at one token, the four products of a layer
// take 68.5 us against 74.6 with two chunks and 2 blocks (H200, with the products in fp32), and two
// chunks in flight are slower with the fp16 products below too. More tokens keep 2 blocks, whose
// registers hold their sums without spilling. The passes in flight set how the warps split a row
// (warps_per_group), so they depend on W alone: a token's sums do not depend on M. bf16 / fp16 rows
// gain less so (112.2-113.6 us against 116.1, not at every shape) and keep 2 blocks and 2 chunks,
// loaded at the start of each pass over their row group (rolling loads measure the same for them,
// and make their 4-token kernels spill).
template <typename W>
constexpr int unroll_of() {  // 16-byte chunks of each row in flight per thread
  return sizeof(W) == 1 ? 1 : 2;
}
template <typename W, int M>
constexpr int blocks_per_sm() {
  return sizeof(W) == 1 && M == 1 ? 3 : 2;
}

// e4m3 rows multiply fp16 pairs: a chunk's 16 activations are converted once into 8 fp16 pairs, scaled
// by 2^-8 (so that 8 products of |w| <= 448 stay in fp16 range for |x| up to about 4,600, and about
// 37,000 for one such x among them; the row's sum is multiplied back by 2^8, exactly), and each row
// takes 8 HFMA2 into one fp16 pair, which is then added to the row's fp32 sum. Against fp32 products
// (an e4m3 pair to fp16, then to fp32, then FMA: 40 instructions a row's chunk against 20) this halves
// the work a weight; the fp16 sums of 8 products cost less precision than the bf16 rounding of the
// output.
constexpr float kE4m3ActivationScale = 1.f / 256.f;
constexpr float kE4m3SumScale = 256.f;

template <typename T>
__device__ __forceinline__ void scaled_halves(const uint4& b0, const uint4& b1, __half2 (&xh)[8]) {
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const T* y = reinterpret_cast<const T*>(half == 0 ? &b0 : &b1);
#pragma unroll
    for (int e = 0; e < 4; ++e)
      xh[4 * half + e] = __floats2half2_rn(to_float(y[2 * e]) * kE4m3ActivationScale,
                                           to_float(y[2 * e + 1]) * kE4m3ActivationScale);
  }
}

// 16 e4m3 weights times the chunk's 16 scaled activations (scaled_halves), added to acc.
__device__ __forceinline__ float dot16_e4m3(const uint4& a, const __half2 (&xh)[8], float acc) {
  const __nv_fp8x2_storage_t* w = reinterpret_cast<const __nv_fp8x2_storage_t*>(&a);
  __half2 s = __float2half2_rn(0.f);
#pragma unroll
  for (int e = 0; e < 8; ++e) {
    const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(w[e], __NV_E4M3);
    s = __hfma2(*reinterpret_cast<const __half2*>(&h), xh[e], s);
  }
  const float2 f = __half22float2(s);
  return acc + f.x + f.y;
}

template <typename T>
__device__ __forceinline__ float dot8(const uint4& a, const uint4& b, float acc) {
  const T* x = reinterpret_cast<const T*>(&a);
  const T* y = reinterpret_cast<const T*>(&b);
#pragma unroll
  for (int e = 0; e < 8; ++e) acc = fmaf(to_float(x[e]), to_float(y[e]), acc);
  return acc;
}

// Weight row `r` of row group `unit`, or -1 past the matrix.
template <Out OUT>
__device__ __forceinline__ int unit_row(const Params& p, int unit, int r) {
  if (unit >= p.num_units) return -1;
  if constexpr (OUT == Out::kRopeKV) {
    // a group is kRows/2 rotation pairs (j, j + half) of one head
    const int half = p.rope.head_dim / 2, per_head = half / (kRows / 2);
    const int head = unit / per_head, j0 = (unit % per_head) * (kRows / 2);
    return head * p.rope.head_dim + j0 + (r < kRows / 2 ? r : r - kRows / 2 + half);
  } else {
    const int row = unit * kRows + r;
    return row < p.n ? row : -1;
  }
}

// rms_norm's 1 / rms of each x row, summed in the order of norm.cu's kernel (a block of V threads,
// thread t summing chunks t, t + V, ...; warp sums; warps in order) so the normalised row matches it
// bit for bit. Every thread of the block must call this.
template <typename T, int M>
__device__ void norm_inverse(const Params& p, float (*s_scratch)[32], float* s_inv) {
  constexpr int kVirtual = kNormMaxThreads / kThreads;  // norm.cu threads this thread stands for
  const int chunks = p.k / 8;
  const int v = min(kNormMaxThreads, max(32, ceil_div(chunks, 32) * 32));
  const int lane = threadIdx.x & 31;
  float part[M][kVirtual];
#pragma unroll
  for (int m = 0; m < M; ++m) {  // every load first, so they are in flight together
    const T* x = static_cast<const T*>(p.x) + m * p.x_stride;
#pragma unroll
    for (int j = 0; j < kVirtual; ++j) {
      const int vt = threadIdx.x + j * kThreads;
      part[m][j] = 0.f;
      if (m < p.rows && vt < v) {
#pragma unroll
        for (int i = 0; i < kNormChunksPerThread; ++i) {
          const int c = vt + i * v;
          if (c < chunks) {
            const Vec<T> r = load_vec(x + c * 8);
#pragma unroll
            for (int e = 0; e < 8; ++e) part[m][j] = fmaf(to_float(r.v[e]), to_float(r.v[e]), part[m][j]);
          }
        }
      }
    }
  }
#pragma unroll
  for (int m = 0; m < M; ++m)
#pragma unroll
    for (int j = 0; j < kVirtual; ++j) {
      const float sum = warp_sum(part[m][j]);
      const int vt = threadIdx.x + j * kThreads;
      if (lane == 0 && vt < v && m < p.rows) s_scratch[m][vt >> 5] = sum;
    }
  __syncthreads();
  if (threadIdx.x < M && threadIdx.x < p.rows) {
    float total = 0.f;
    for (int w = 0; w < v / 32; ++w) total += s_scratch[threadIdx.x][w];
    s_inv[threadIdx.x] = rsqrtf(total * (1.f / p.k) + p.eps);
  }
  __syncthreads();
}

// Chunk c (8 elements) of x row m, as 8 packed T.
template <typename T, In IN>
__device__ __forceinline__ uint4 x_chunk(const Params& p, int m, int c, float inv) {
  const T* x = static_cast<const T*>(p.x) + m * p.x_stride;
  if constexpr (IN == In::kPlain) {
    return load_cached(x + c * 8);
  } else if constexpr (IN == In::kNorm) {
    const uint4 rv = load_cached(x + c * 8), wv = load_cached(static_cast<const T*>(p.norm_w) + c * 8);
    const T* r = reinterpret_cast<const T*>(&rv);
    const T* w = reinterpret_cast<const T*>(&wv);
    uint4 out;
    T* o = reinterpret_cast<T*>(&out);
#pragma unroll
    for (int e = 0; e < 8; ++e) o[e] = from_float<T>(to_float(w[e]) * round_to<T>(to_float(r[e]) * inv));
    return out;
  } else {
    const uint4 gv = load_cached(x + c * 8), uv = load_cached(x + p.k + c * 8);
    const T* g = reinterpret_cast<const T*>(&gv);
    const T* u = reinterpret_cast<const T*>(&uv);
    uint4 out;
    T* o = reinterpret_cast<T*>(&out);
#pragma unroll
    for (int e = 0; e < 8; ++e) o[e] = silu_mul(g[e], u[e]);
    return out;
  }
}

// What a thread's epilogue reads besides the sums (bias, residual, cos and sin), loaded when a row
// group starts so the loads are done by the time the sums are.
struct EpilogueInputs {
  float a = 0.f, b = 0.f;  // bias of the row (pair)
  float res = 0.f;  // kResidual: the residual element
  RopeAngle angle;  // kRopeKV: cos and sin of the pair's frequency at the token's position
  float scale_a = 1.f, scale_b = 1.f;  // e4m3 weights: the scales of the row (pair)
};

template <typename T, Out OUT>
__device__ __forceinline__ EpilogueInputs epilogue_inputs(const Params& p, int row, int m, int64_t position) {
  EpilogueInputs in;
  const T* bias = static_cast<const T*>(p.bias);
  if constexpr (OUT == Out::kRopeKV) {
    const int d = p.rope.head_dim, half = d / 2;
    if (p.w_scale != nullptr) {
      in.scale_a = p.w_scale[row];
      in.scale_b = p.w_scale[row + half];
    }
    if (bias != nullptr) {
      in.a = to_float(bias[row]);
      in.b = to_float(bias[row + half]);
    }
    in.angle = rope_angle(p.rope, row / d, row % d, position);
  } else {
    if (p.w_scale != nullptr) in.scale_a = p.w_scale[row];
    if (bias != nullptr) in.a = to_float(bias[row]);
    if constexpr (OUT == Out::kResidual) in.res = to_float(static_cast<const T*>(p.residual)[m * p.res_stride + row]);
  }
  return in;
}

template <typename T, Out OUT>
__device__ __forceinline__ void store_row(const Params& p, int row, int m, float s, const EpilogueInputs& in) {
  const float v = s + in.a;
  const int64_t at = static_cast<int64_t>(m) * p.n + row;
  if constexpr (OUT == Out::kPlain) {
    static_cast<T*>(p.y)[at] = from_float<T>(v);
  } else if constexpr (OUT == Out::kResidual) {
    static_cast<T*>(p.y)[at] = from_float<T>(round_to<T>(v) + in.res);
  } else {
    static_cast<float*>(p.y)[at] = round_to<T>(v);
  }
}

// Rows ra = head * D + j and ra + D/2 of token m: rotate (q, k) and store, or store (v).
template <typename T>
__device__ __forceinline__ void store_rope_pair(const Params& p, int ra, int m, float sa, float sb, int64_t slot,
                                                const EpilogueInputs& in) {
  const int d = p.rope.head_dim;
  exlcli::store_rope_pair<T>(p.rope, ra / d, ra % d, m, round_to<T>(sa + in.a), round_to<T>(sb + in.b), in.angle,
                             slot);
}

template <typename T, typename W, int M, In IN, Out OUT>
__global__ void __launch_bounds__(kThreads, blocks_per_sm<W, M>()) decode_gemv_kernel(const Params p) {
  constexpr int kPer = chunk_weights<W>();
  constexpr int kUnroll = unroll_of<W>();
  constexpr bool kRolling = sizeof(W) == 1;  // loads issued right after the products they replace
  constexpr bool kScaled = sizeof(W) == 1;
  __shared__ float s_red[kWarps][kRows][M];
  __shared__ float s_scratch[M][32];
  __shared__ float s_inv[M];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int wg = p.warps_per_group, groups = kWarps / wg;
  const int group = warp / wg;
  const int gt = threadIdx.x - group * wg * 32;  // thread within the row group
  const int step = wg * 32;
  const int chunks = p.k / kPer;
  const W* w = static_cast<const W*>(p.w);

  uint4 wv[kUnroll][kRows];
  // chunk c of weight row `row`, zeros past the matrix (row -1)
  auto weight_chunk = [&](int row, int c) {
    return row >= 0 && c < chunks
               ? __ldcs(reinterpret_cast<const uint4*>(w + static_cast<int64_t>(row) * p.k + c * kPer))
               : make_uint4(0, 0, 0, 0);
  };
  // every pass of (unit, c0), row by row
  auto load_weights = [&](int unit, int c0) {
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const int row = unit_row<OUT>(p, unit, r);
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) wv[u][r] = weight_chunk(row, c0 + u * step);
    }
  };
  // (rolling) pass u of (unit, c0)
  auto load_pass = [&](int u, int unit, int c0) {
#pragma unroll
    for (int r = 0; r < kRows; ++r) wv[u][r] = weight_chunk(unit_row<OUT>(p, unit, r), c0 + u * step);
  };

  // Weights depend on no earlier kernel: start loading them before waiting for it.
  const int first = blockIdx.x * groups;
  load_weights(first + group, gt);
  grid_dependency_wait();
  grid_dependents_launch();
  if constexpr (IN == In::kNorm) norm_inverse<T, M>(p, s_scratch, s_inv);
  float inv[M];
#pragma unroll
  for (int m = 0; m < M; ++m) inv[m] = IN == In::kNorm && m < p.rows ? s_inv[m] : 1.f;

  // The output this thread finishes in each row group: row (pair) er of token em.
  constexpr int kOutputs = (OUT == Out::kRopeKV ? kRows / 2 : kRows) * M;
  const bool finisher = gt < kOutputs;
  const int er = gt / M, em = gt % M;
  const int64_t position = OUT == Out::kRopeKV && finisher && em < p.rows ? p.rope.positions[em] : 0;
  const int64_t slot = OUT == Out::kRopeKV && finisher && em < p.rows ? p.rope.slots[em] : -1;

  bool loaded = true;  // (not rolling) wv holds this pass's chunks
  for (int base = first; base < p.num_units; base += gridDim.x * groups) {
    const int unit = base + group;
    const int out_row = finisher ? unit_row<OUT>(p, unit, er) : -1;
    const bool finishes = out_row >= 0 && em < p.rows;
    EpilogueInputs ein;
    if (finishes) ein = epilogue_inputs<T, OUT>(p, out_row, em, position);
    float acc[kRows][M];
#pragma unroll
    for (int r = 0; r < kRows; ++r)
#pragma unroll
      for (int m = 0; m < M; ++m) acc[r][m] = 0.f;
    for (int c0 = gt; c0 < chunks; c0 += step * kUnroll) {
      if (!kRolling && !loaded) load_weights(unit, c0);
      loaded = false;
      // (rolling) where this thread's loads go next: the group's next chunks, or the next group's first
      int next_unit = unit, next_c0 = c0 + step * kUnroll;
      if (next_c0 >= chunks) {
        next_unit = unit + gridDim.x * groups;
        next_c0 = gt;
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int c = c0 + u * step;
        if (c < chunks) {
#pragma unroll
          for (int m = 0; m < M; ++m) {
            if (m < p.rows) {
              if constexpr (kPer == 8) {
                const uint4 xv = x_chunk<T, IN>(p, m, c, inv[m]);
#pragma unroll
                for (int r = 0; r < kRows; ++r) acc[r][m] = dot8<T>(wv[u][r], xv, acc[r][m]);
              } else {
                const uint4 x0 = x_chunk<T, IN>(p, m, 2 * c, inv[m]), x1 = x_chunk<T, IN>(p, m, 2 * c + 1, inv[m]);
                __half2 xh[8];
                scaled_halves<T>(x0, x1, xh);
#pragma unroll
                for (int r = 0; r < kRows; ++r) acc[r][m] = dot16_e4m3(wv[u][r], xh, acc[r][m]);
              }
            }
          }
        }
        if constexpr (kRolling) load_pass(u, next_unit, next_c0);
      }
    }
    loaded = false;
#pragma unroll
    for (int r = 0; r < kRows; ++r)
#pragma unroll
      for (int m = 0; m < M; ++m) {
        const float v = warp_sum(acc[r][m]);
        if (lane == 0) s_red[warp][r][m] = v;
      }
    __syncthreads();
    if (finishes) {
      float sa = 0.f;
      for (int i = 0; i < wg; ++i) sa += s_red[group * wg + i][er][em];
      // __fmul_rn: never contracted into an FMA with the bias, so every epilogue rounds alike
      if constexpr (kScaled) sa = __fmul_rn(sa * kE4m3SumScale, ein.scale_a);
      if constexpr (OUT == Out::kRopeKV) {
        float sb = 0.f;
        for (int i = 0; i < wg; ++i) sb += s_red[group * wg + i][er + kRows / 2][em];
        if constexpr (kScaled) sb = __fmul_rn(sb * kE4m3SumScale, ein.scale_b);
        store_rope_pair<T>(p, out_row, em, sa, sb, slot, ein);
      } else {
        store_row<T, OUT>(p, out_row, em, sa, ein);
      }
    }
    __syncthreads();  // s_red is reused by the next unit
  }
}

// Warps per row group for rows of `chunks` 16-byte chunks: enough for `unroll` passes per thread.
inline int warps_per_group(int chunks, int unroll) {
  for (int wg = kWarps; wg > 1; wg /= 2)
    if (chunks >= wg * 32 * unroll) return wg;
  return 1;
}

template <typename T, typename W, int M, In IN, Out OUT>
void launch(Params p, cudaStream_t stream, bool pdl) {
  p.warps_per_group = warps_per_group(p.k / chunk_weights<W>(), unroll_of<W>());
  if (OUT == Out::kRopeKV) {
    p.num_units = (p.rope.num_heads + 2 * p.rope.num_kv_heads) * ((p.rope.head_dim / 2) / (kRows / 2));
  } else {
    p.num_units = ceil_div(p.n, kRows);
  }
  // As many rounds of the persistent loop as the resident blocks need, with no more blocks a
  // multiprocessor than those rounds take: 512 units on 3 x 132 blocks leave a second round of 116
  // blocks, too few loads in flight to keep memory busy, where 2 x 132 blocks keep it busy to the end
  // (e4m3 down of the 8B shape at one token: 22.8 us against 23.8-24.0 on an H100). Every multiprocessor
  // gets the same number of blocks: with 2 on some and 3 on others, the slower ones set the time.
  const int tasks = ceil_div(p.num_units, kWarps / p.warps_per_group);
  const int sms = num_sms(), rounds = ceil_div(tasks, blocks_per_sm<W, M>() * sms);
  const int grid = std::max(1, std::min(tasks, ceil_div(tasks, rounds * sms) * sms));
  launch_pdl(decode_gemv_kernel<T, W, M, IN, OUT>, dim3(grid), dim3(kThreads), 0, stream, pdl, p);
}

// Runs launch<T, W, M, IN, OUT> with M the smallest of 1, 2, 4 that holds p.rows.
template <typename T, typename W, In IN, Out OUT>
void launch_rows(const Params& p, cudaStream_t stream, bool pdl) {
  if (p.rows <= 1) {
    launch<T, W, 1, IN, OUT>(p, stream, pdl);
  } else if (p.rows <= 2) {
    launch<T, W, 2, IN, OUT>(p, stream, pdl);
  } else {
    launch<T, W, 4, IN, OUT>(p, stream, pdl);
  }
}

// Calls go(T{}, W{}) for the activation dtype and the weights' kind (e4m3: bf16 activations only);
// false for a pair no kernel is built for.
template <typename Go>
bool with_types(at::ScalarType dtype, bool fp8_weights, Go&& go) {
  if (fp8_weights) return dtype == at::kBFloat16 && go(__nv_bfloat16{}, __nv_fp8_e4m3{});
  return dtype == at::kBFloat16 ? go(__nv_bfloat16{}, __nv_bfloat16{}) : go(__half{}, __half{});
}

}  // namespace gemv
}  // namespace exlcli

namespace exlcli {
namespace gemv {

// Launches the (in, out) combination for p.rows rows of dtype `dtype` (bf16 / fp16), over weights of
// that dtype or e4m3 ones (p.w_scale set). Each returns false for a combination its file does not
// hold: linear.cu holds the plain and silu prologues, linear_fused.cu the norm prologue and the rope
// epilogue.
bool launch_plain_combos(const Params& p, at::ScalarType dtype, In in, Out out, cudaStream_t stream, bool pdl);
bool launch_fused_combos(const Params& p, at::ScalarType dtype, In in, Out out, cudaStream_t stream, bool pdl);

}  // namespace gemv
}  // namespace exlcli
