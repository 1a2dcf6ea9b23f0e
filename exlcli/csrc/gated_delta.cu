// Gated DeltaNet (Qwen3-Next, Qwen3.5): the gated delta rule and the short causal convolution over B
// sequences, sequence b's tokens the rows begin[b] .. end[b] - 1 and its state a slot of a pool
// (exlcli/ops/gated_delta.py holds the torch references and the math; csrc/cpu/gated_delta.c the CPU's).
//
// The delta rule, per token: S <- e^g S; u = beta (v - S^T k); S <- S + k u^T; o = S^T q, with q and k
// L2-normalized (q then scaled). Column j of S evolves on its own (u_j needs column j only), so a block
// takes one (sequence, value head, tile of 32 columns): 8 warps, lane = the column, warp w the rows
// w, w + 8, ...: the tile's state stays in registers (Dk / 8 values a thread) across the sequence's
// tokens, read from its slot once and written once. The two sums over rows (S^T k, S^T q) add each
// thread's rows, then the 8 warps' partials in order: a row's numbers depend on nothing else in the
// batch. Every index (slots, token rows) is read on the device, so a decode step captures in a CUDA
// graph and replays with other slots. A call with a prompt among its sequences (the host knows their
// lengths: gated_delta_kernels.CUDA_CHUNKED_MIN_TOKENS) takes the chunkwise kernel below instead, whose
// 64-token chunks need a few barriers a chunk rather than a few a token.
#include "common.cuh"
#include "ops.h"

namespace exlcli {
namespace {

constexpr int kTile = 32;     // state columns a block
constexpr int kWarps = 8;     // row groups a block
constexpr int kMaxDim = 256;  // Dk and Dv at most (gated_delta.py: MAX_HEAD_DIM)
constexpr int kMaxWidth = 8;  // convolution taps at most

template <typename T, int MAXR>
__global__ void __launch_bounds__(kTile * kWarps)
    gated_delta_kernel(const T* __restrict__ mixed, int64_t mixed_stride, const float* __restrict__ g,
                       const float* __restrict__ beta, const float* in_states, const int32_t* __restrict__ in_slots,
                       float* out_states, const int32_t* __restrict__ out_slots, const int32_t* __restrict__ begin,
                       const int32_t* __restrict__ end, int k_heads, int v_heads, int dk, int dv, float scale,
                       float eps, float* __restrict__ out) {
  __shared__ float sk[kMaxDim], sq[kMaxDim], red[kWarps][kTile], scratch[32];
  grid_dependency_wait();
  grid_dependents_launch();
  const int b = blockIdx.x, h = blockIdx.y, lane = threadIdx.x & 31, w = threadIdx.x >> 5;
  const int j = blockIdx.z * kTile + lane;
  const bool col = j < dv;
  const int rpt = dk / kWarps;  // rows a thread (dk a multiple of 16)
  const int kh = h / (v_heads / k_heads), key_dim = k_heads * dk;
  const int64_t head = static_cast<int64_t>(dk) * dv;
  float s[MAXR];
  const int in_slot = in_slots[b];
  const float* src = in_slot < 0 ? nullptr : in_states + (static_cast<int64_t>(in_slot) * v_heads + h) * head;
#pragma unroll
  for (int r = 0; r < MAXR; ++r) s[r] = (r < rpt && col && src) ? src[static_cast<int64_t>(w + kWarps * r) * dv + j] : 0.f;
  const int first = begin[b], last = end[b];
  // a token's inputs: this thread's q and k element (threads < dk), its column's v, the head's g and beta;
  // the next token's are loaded before the current one is computed, so their latency overlaps it
  auto load = [&](int t, float& qx, float& kx, float& vx, float& gx, float& bx) {
    const T* row = mixed + static_cast<int64_t>(t) * mixed_stride;
    qx = threadIdx.x < dk ? to_float(row[kh * dk + threadIdx.x]) : 0.f;
    kx = threadIdx.x < dk ? to_float(row[key_dim + kh * dk + threadIdx.x]) : 0.f;
    vx = col ? to_float(row[2 * key_dim + h * dv + j]) : 0.f;
    gx = g[static_cast<int64_t>(t) * v_heads + h];
    bx = beta[static_cast<int64_t>(t) * v_heads + h];
  };
  float qx = 0.f, kx = 0.f, v = 0.f, gt = 0.f, bt = 0.f;
  if (first < last) load(first, qx, kx, v, gt, bt);
  for (int t = first; t < last; ++t) {
    float nq = 0.f, nk = 0.f, nv = 0.f, ng = 0.f, nb = 0.f;
    if (t + 1 < last) load(t + 1, nq, nk, nv, ng, nb);
    if (threadIdx.x < dk) {
      sq[threadIdx.x] = qx;
      sk[threadIdx.x] = kx;
    }
    const float rk = rsqrtf(block_sum(kx * kx, scratch) + eps);
    const float rq = rsqrtf(block_sum(qx * qx, scratch) + eps);  // (its syncs also publish sk, sq)
    const float decay = __expf(gt);
    float part = 0.f;
#pragma unroll
    for (int r = 0; r < MAXR; ++r) {
      if (r < rpt) {
        s[r] *= decay;
        part += s[r] * (sk[w + kWarps * r] * rk);
      }
    }
    red[w][lane] = part;
    __syncthreads();
    float read = 0.f;
#pragma unroll
    for (int x = 0; x < kWarps; ++x) read += red[x][lane];
    const float u = (v - read) * bt;
    __syncthreads();  // red is written again below
    part = 0.f;
#pragma unroll
    for (int r = 0; r < MAXR; ++r) {
      if (r < rpt) {
        s[r] += (sk[w + kWarps * r] * rk) * u;
        part += s[r] * (sq[w + kWarps * r] * rq * scale);
      }
    }
    red[w][lane] = part;
    __syncthreads();
    if (w == 0 && col) {
      float o = 0.f;
#pragma unroll
      for (int x = 0; x < kWarps; ++x) o += red[x][lane];
      out[(static_cast<int64_t>(t) * v_heads + h) * dv + j] = o;
    }
    qx = nq, kx = nk, v = nv, gt = ng, bt = nb;
  }
  float* dst = out_states + (static_cast<int64_t>(out_slots[b]) * v_heads + h) * head;
#pragma unroll
  for (int r = 0; r < MAXR; ++r)
    if (r < rpt && col) dst[static_cast<int64_t>(w + kWarps * r) * dv + j] = s[r];
}

// The chunkwise form for prompts (exlcli/ops/gated_delta.py: chunk_gated_delta_rule), a block per
// (sequence, value head, 32 state columns) again, its state tile in shared memory; chunk by chunk of 64
// tokens: the chunk's normalized k and q rows, A = beta_i (k_i . k_m) e^{G_i - G_m} (m < i) and
// (q_i . k_m) e^{G_i - G_m} (m <= i), then U = beta (V - e^G K S) solved through (I + A) row by row (each
// warp 4 columns, no block barrier), o = e^G Q S + (QK o decay) U and S <- e^{G_C} S + (K e^{G_C - G})^T U.
// The sums run in fixed orders: a row's numbers do not depend on the batch either.
constexpr int kChunk = 64;
constexpr int kLdu = kTile + 1;  // U's padded rows: a warp reading one column of 32 rows hits 32 banks

__host__ __device__ constexpr int chunk_smem_floats(int dk) {
  return 2 * kChunk * (dk + 1) + dk * kTile + 2 * kChunk * kChunk + kChunk * kLdu + 3 * kChunk;
}

template <typename T>
__global__ void __launch_bounds__(kTile * kWarps)
    gated_delta_chunk_kernel(const T* __restrict__ mixed, int64_t mixed_stride, const float* __restrict__ g,
                             const float* __restrict__ beta, const float* in_states,
                             const int32_t* __restrict__ in_slots, float* out_states,
                             const int32_t* __restrict__ out_slots, const int32_t* __restrict__ begin,
                             const int32_t* __restrict__ end, int k_heads, int v_heads, int dk, int dv, float scale,
                             float eps, float* __restrict__ out) {
  extern __shared__ float smem[];
  const int ld = dk + 1;  // padded rows: lanes reading one column of 32 rows hit 32 banks
  float* sK = smem;                          // [kChunk][ld]
  float* sQ = sK + kChunk * ld;              // [kChunk][ld]
  float* sS = sQ + kChunk * ld;              // [dk][kTile]
  float* sA = sS + dk * kTile;               // [kChunk][kChunk]
  float* sQK = sA + kChunk * kChunk;         // [kChunk][kChunk]
  float* sU = sQK + kChunk * kChunk;         // [kChunk][kLdu]
  float* sG = sU + kChunk * kLdu;            // [kChunk] cumulative log decay
  float* sB = sG + kChunk;                   // [kChunk] beta
  float* sW = sB + kChunk;                   // [kChunk] e^{G_C - G_m}
  grid_dependency_wait();
  grid_dependents_launch();
  const int b = blockIdx.x, h = blockIdx.y, lane = threadIdx.x & 31, w = threadIdx.x >> 5;
  const int j = blockIdx.z * kTile + lane;
  const bool col = j < dv;
  const int kh = h / (v_heads / k_heads), key_dim = k_heads * dk;
  const int64_t head = static_cast<int64_t>(dk) * dv;
  const int in_slot = in_slots[b];
  const float* src = in_slot < 0 ? nullptr : in_states + (static_cast<int64_t>(in_slot) * v_heads + h) * head;
  for (int d = w; d < dk; d += kWarps) sS[d * kTile + lane] = (col && src) ? src[static_cast<int64_t>(d) * dv + j] : 0.f;
  const int first = begin[b], last = end[b];
  for (int t0 = first; t0 < last; t0 += kChunk) {
    const int n = min(kChunk, last - t0);
    // the chunk's rows: q and k normalized (a warp a token), V's tile into sU, g and beta
    for (int i = w; i < n; i += kWarps) {
      const T* row = mixed + static_cast<int64_t>(t0 + i) * mixed_stride;
      float qq = 0.f, kk = 0.f;
      for (int d = lane; d < dk; d += 32) {
        const float qv = to_float(row[kh * dk + d]), kv = to_float(row[key_dim + kh * dk + d]);
        sQ[i * ld + d] = qv;
        sK[i * ld + d] = kv;
        qq += qv * qv;
        kk += kv * kv;
      }
      const float rq = rsqrtf(warp_sum(qq) + eps) * scale, rk = rsqrtf(warp_sum(kk) + eps);
      for (int d = lane; d < dk; d += 32) {
        sQ[i * ld + d] *= rq;
        sK[i * ld + d] *= rk;
      }
      sU[i * kLdu + lane] = col ? to_float(row[2 * key_dim + h * dv + j]) : 0.f;
    }
    if (static_cast<int>(threadIdx.x) < n) {  // (loaded in parallel; one thread then sums them in order)
      sG[threadIdx.x] = g[static_cast<int64_t>(t0 + threadIdx.x) * v_heads + h];
      sB[threadIdx.x] = beta[static_cast<int64_t>(t0 + threadIdx.x) * v_heads + h];
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      float cum = 0.f;
      for (int i = 0; i < n; ++i) {
        cum += sG[i];
        sG[i] = cum;
      }
      for (int i = 0; i < n; ++i) sW[i] = __expf(cum - sG[i]);
    }
    __syncthreads();
    // A (strictly lower, times beta_i) and QK (lower, with the diagonal), both times e^{G_i - G_m}
    for (int p = threadIdx.x; p < kChunk * kChunk; p += kTile * kWarps) {
      const int i = p / kChunk, m = p % kChunk;
      float a = 0.f, qk = 0.f;
      if (i < n && m <= i) {
        const float* ki = sK + i * ld;
        const float* qi = sQ + i * ld;
        const float* km = sK + m * ld;
        for (int d = 0; d < dk; ++d) {
          a += ki[d] * km[d];
          qk += qi[d] * km[d];
        }
        const float decay = __expf(sG[i] - sG[m]);
        a = m < i ? a * decay * sB[i] : 0.f;
        qk *= decay;
      }
      sA[p] = a;
      sQK[p] = qk;
    }
    // rhs = beta (V - e^G K S) into sU, and e^G Q S kept for the outputs (rows w, w + 8, ...)
    float qs[kChunk / kWarps];
#pragma unroll
    for (int r = 0; r < kChunk / kWarps; ++r) {
      const int i = w + kWarps * r;
      qs[r] = 0.f;
      if (i < n) {
        float ks = 0.f, q = 0.f;
        for (int d = 0; d < dk; ++d) {
          const float sv = sS[d * kTile + lane];
          ks += sK[i * ld + d] * sv;
          q += sQ[i * ld + d] * sv;
        }
        const float eg = __expf(sG[i]);
        sU[i * kLdu + lane] = sB[i] * (sU[i * kLdu + lane] - eg * ks);
        qs[r] = eg * q;
      }
    }
    __syncthreads();
    // (I + A) U = rhs, row by row: warp w solves columns 4w .. 4w + 3, its lanes splitting each row's sum
    for (int i = 1; i < n; ++i) {
#pragma unroll
      for (int c = 0; c < kTile / kWarps; ++c) {
        const int cc = w * (kTile / kWarps) + c;
        float part = 0.f;
        for (int m = lane; m < i; m += 32) part += sA[i * kChunk + m] * sU[m * kLdu + cc];
        part = warp_sum(part);
        if (lane == 0) sU[i * kLdu + cc] -= part;
      }
      __syncwarp();
    }
    __syncthreads();
    // o = e^G Q S + (QK o decay) U
#pragma unroll
    for (int r = 0; r < kChunk / kWarps; ++r) {
      const int i = w + kWarps * r;
      if (i < n) {
        float o = qs[r];
        for (int m = 0; m <= i; ++m) o += sQK[i * kChunk + m] * sU[m * kLdu + lane];
        if (col) out[(static_cast<int64_t>(t0 + i) * v_heads + h) * dv + j] = o;
      }
    }
    // S <- e^{G_C} S + (K e^{G_C - G})^T U: each thread its own entries (read above before the barrier)
    const float ec = __expf(sG[n - 1]);
    for (int d = w; d < dk; d += kWarps) {
      float acc = 0.f;
      for (int m = 0; m < n; ++m) acc += sK[m * ld + d] * sW[m] * sU[m * kLdu + lane];
      sS[d * kTile + lane] = ec * sS[d * kTile + lane] + acc;
    }
    __syncthreads();  // the next chunk overwrites sK, sQ, sU
  }
  float* dst = out_states + (static_cast<int64_t>(out_slots[b]) * v_heads + h) * head;
  if (col)
    for (int d = w; d < dk; d += kWarps) dst[static_cast<int64_t>(d) * dv + j] = sS[d * kTile + lane];
}

// One thread a channel of one sequence: its W - 1 last inputs in registers across the tokens.
template <typename T>
__global__ void causal_conv1d_kernel(const T* __restrict__ x, int64_t x_stride, const T* __restrict__ weight,
                                     const T* in_states, const int32_t* __restrict__ in_slots, T* out_states,
                                     const int32_t* __restrict__ out_slots, const int32_t* __restrict__ begin,
                                     const int32_t* __restrict__ end, int channels, int width, T* __restrict__ out) {
  grid_dependency_wait();
  grid_dependents_launch();
  const int b = blockIdx.y, c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= channels) return;
  float win[kMaxWidth], wt[kMaxWidth];
  const int in_slot = in_slots[b];
  const T* src = in_slot < 0 ? nullptr : in_states + static_cast<int64_t>(in_slot) * (width - 1) * channels + c;
#pragma unroll
  for (int p = 0; p < kMaxWidth; ++p) {
    wt[p] = p < width ? to_float(weight[static_cast<int64_t>(c) * width + p]) : 0.f;
    win[p] = (p < width - 1 && src) ? to_float(src[static_cast<int64_t>(p) * channels]) : 0.f;
  }
  const int first = begin[b], last = end[b];
  for (int t = first; t < last; ++t) {
    const float xt = to_float(x[static_cast<int64_t>(t) * x_stride + c]);
#pragma unroll
    for (int p = 0; p < kMaxWidth; ++p)
      if (p == width - 1) win[p] = xt;
    float acc = win[0] * wt[0];
#pragma unroll
    for (int p = 1; p < kMaxWidth; ++p)
      if (p < width) acc = acc + win[p] * wt[p];
    out[static_cast<int64_t>(t) * channels + c] = from_float<T>(acc / (1.f + expf(-acc)));
#pragma unroll
    for (int p = 0; p + 1 < kMaxWidth; ++p)
      if (p + 1 < width) win[p] = win[p + 1];
  }
  T* dst = out_states + static_cast<int64_t>(out_slots[b]) * (width - 1) * channels + c;
#pragma unroll
  for (int p = 0; p + 1 < kMaxWidth; ++p)
    if (p < width - 1) dst[static_cast<int64_t>(p) * channels] = from_float<T>(win[p]);
}

void check_index(const at::Tensor& t, int64_t n, const char* name) {
  TORCH_CHECK(t.is_cuda() && t.scalar_type() == at::kInt && t.dim() == 1 && t.size(0) == n && t.is_contiguous(),
              name, " must be a contiguous int32 CUDA tensor of ", n, " entries, got ", t.scalar_type(), " ",
              t.sizes());
}

void check_pool(const at::Tensor& t, const at::Tensor& like, const char* name) {
  TORCH_CHECK(t.is_cuda() && t.scalar_type() == like.scalar_type() && t.dim() == like.dim() && t.is_contiguous() &&
                  t.sizes().slice(1) == like.sizes().slice(1),
              name, " must be a contiguous ", like.scalar_type(), " CUDA tensor [slots, ", like.sizes().slice(1),
              "], got ", t.scalar_type(), " ", t.sizes());
}

}  // namespace

void gated_delta(const at::Tensor& mixed, const at::Tensor& g, const at::Tensor& beta, const at::Tensor& in_states,
                 const at::Tensor& in_slots, const at::Tensor& out_states, const at::Tensor& out_slots,
                 const at::Tensor& begin, const at::Tensor& end, int64_t k_heads, double scale, double eps,
                 const at::Tensor& out, bool chunked, bool pdl) {
  EXL_CHECK_CUDA_TENSOR(mixed, "gated_delta: mixed");
  TORCH_CHECK(out_states.dim() == 4 && out_states.scalar_type() == at::kFloat && out_states.is_contiguous(),
              "gated_delta: out_states must be a contiguous float32 [slots, Hv, Dk, Dv], got ", out_states.sizes());
  const int64_t hv = out_states.size(1), dk = out_states.size(2), dv = out_states.size(3);
  const int64_t rows = mixed.size(0), seqs = in_slots.size(0);
  TORCH_CHECK(dk > 0 && dk % 16 == 0 && dk <= kMaxDim && dv > 0 && dv % 16 == 0 && dv <= kMaxDim,
              "gated_delta: head dimensions ", dk, " / ", dv, " (supported: multiples of 16 up to ", kMaxDim, ")");
  TORCH_CHECK(k_heads > 0 && hv % k_heads == 0, "gated_delta: ", hv, " value heads over ", k_heads, " key heads");
  TORCH_CHECK(mixed.dim() == 2 && mixed.stride(1) == 1 && mixed.size(1) >= 2 * k_heads * dk + hv * dv,
              "gated_delta: mixed must be [rows, >= ", 2 * k_heads * dk + hv * dv, "] with contiguous rows, got ",
              mixed.sizes());
  for (const at::Tensor* t : {&g, &beta})
    TORCH_CHECK(t->is_cuda() && t->scalar_type() == at::kFloat && t->is_contiguous() && t->dim() == 2 &&
                    t->size(0) == rows && t->size(1) == hv,
                "gated_delta: g and beta must be contiguous float32 [", rows, ", ", hv, "], got ", t->sizes());
  check_pool(in_states, out_states, "gated_delta: in_states");
  check_index(in_slots, seqs, "gated_delta: in_slots");
  check_index(out_slots, seqs, "gated_delta: out_slots");
  check_index(begin, seqs, "gated_delta: begin");
  check_index(end, seqs, "gated_delta: end");
  TORCH_CHECK(out.is_cuda() && out.scalar_type() == at::kFloat && out.is_contiguous() && out.dim() == 3 &&
                  out.size(0) == rows && out.size(1) == hv && out.size(2) == dv,
              "gated_delta: out must be a contiguous float32 [", rows, ", ", hv, ", ", dv, "], got ", out.sizes());
  TORCH_CHECK(seqs < 65536 && hv < 65536, "gated_delta: at most 65,535 sequences and value heads");
  if (seqs == 0) return;
  const c10::cuda::CUDAGuard guard(mixed.device());
  const dim3 grid(static_cast<unsigned>(seqs), static_cast<unsigned>(hv), static_cast<unsigned>(ceil_div(dv, kTile)));
  EXL_DISPATCH_FLOAT(mixed.scalar_type(), "gated_delta", [&] {
    auto run = [&](auto kernel) {
      launch_pdl(kernel, grid, dim3(kTile * kWarps), 0, current_stream(), pdl,
                 static_cast<const scalar_t*>(mixed.data_ptr()), mixed.stride(0), g.data_ptr<float>(),
                 beta.data_ptr<float>(), static_cast<const float*>(in_states.data_ptr<float>()),
                 in_slots.data_ptr<int32_t>(), out_states.data_ptr<float>(),
                 static_cast<const int32_t*>(out_slots.data_ptr<int32_t>()),
                 static_cast<const int32_t*>(begin.data_ptr<int32_t>()),
                 static_cast<const int32_t*>(end.data_ptr<int32_t>()), static_cast<int>(k_heads),
                 static_cast<int>(hv), static_cast<int>(dk), static_cast<int>(dv), static_cast<float>(scale),
                 static_cast<float>(eps), out.data_ptr<float>());
    };
    if (chunked) {
      const size_t smem = sizeof(float) * chunk_smem_floats(static_cast<int>(dk));
      auto kernel = gated_delta_chunk_kernel<scalar_t>;
      C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          static_cast<int>(smem)));
      launch_pdl(kernel, grid, dim3(kTile * kWarps), smem, current_stream(), pdl,
                 static_cast<const scalar_t*>(mixed.data_ptr()), mixed.stride(0), g.data_ptr<float>(),
                 beta.data_ptr<float>(), static_cast<const float*>(in_states.data_ptr<float>()),
                 in_slots.data_ptr<int32_t>(), out_states.data_ptr<float>(),
                 static_cast<const int32_t*>(out_slots.data_ptr<int32_t>()),
                 static_cast<const int32_t*>(begin.data_ptr<int32_t>()),
                 static_cast<const int32_t*>(end.data_ptr<int32_t>()), static_cast<int>(k_heads),
                 static_cast<int>(hv), static_cast<int>(dk), static_cast<int>(dv), static_cast<float>(scale),
                 static_cast<float>(eps), out.data_ptr<float>());
    } else if (dk <= 64) {
      run(gated_delta_kernel<scalar_t, 8>);
    } else if (dk <= 128) {
      run(gated_delta_kernel<scalar_t, 16>);
    } else {
      run(gated_delta_kernel<scalar_t, 32>);
    }
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void causal_conv1d(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& in_states,
                   const at::Tensor& in_slots, const at::Tensor& out_states, const at::Tensor& out_slots,
                   const at::Tensor& begin, const at::Tensor& end, const at::Tensor& out, bool pdl) {
  EXL_CHECK_CUDA_TENSOR(x, "causal_conv1d: x");
  TORCH_CHECK(weight.is_cuda() && weight.dim() == 2 && weight.is_contiguous() &&
                  weight.scalar_type() == x.scalar_type(),
              "causal_conv1d: weight must be a contiguous [C, W] of x's dtype, got ", weight.sizes());
  const int64_t channels = weight.size(0), width = weight.size(1), rows = x.size(0), seqs = in_slots.size(0);
  TORCH_CHECK(width >= 2 && width <= kMaxWidth, "causal_conv1d: a width of ", width, " (supported: 2 to ",
              kMaxWidth, ")");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(1) == channels,
              "causal_conv1d: x must be [rows, ", channels, "] with contiguous rows, got ", x.sizes());
  TORCH_CHECK(out_states.is_cuda() && out_states.dim() == 3 && out_states.is_contiguous() &&
                  out_states.size(1) == width - 1 && out_states.size(2) == channels &&
                  out_states.scalar_type() == x.scalar_type(),
              "causal_conv1d: out_states must be a contiguous [slots, ", width - 1, ", ", channels,
              "] of x's dtype, got ", out_states.sizes());
  check_pool(in_states, out_states, "causal_conv1d: in_states");
  check_index(in_slots, seqs, "causal_conv1d: in_slots");
  check_index(out_slots, seqs, "causal_conv1d: out_slots");
  check_index(begin, seqs, "causal_conv1d: begin");
  check_index(end, seqs, "causal_conv1d: end");
  TORCH_CHECK(out.is_cuda() && out.is_contiguous() && out.scalar_type() == x.scalar_type() && out.dim() == 2 &&
                  out.size(0) == rows && out.size(1) == channels,
              "causal_conv1d: out must be a contiguous [", rows, ", ", channels, "] of x's dtype, got ", out.sizes());
  TORCH_CHECK(seqs < 65536, "causal_conv1d: at most 65,535 sequences");
  if (seqs == 0) return;
  const c10::cuda::CUDAGuard guard(x.device());
  constexpr int kThreads = 128;
  const dim3 grid(static_cast<unsigned>(ceil_div(static_cast<int>(channels), kThreads)), static_cast<unsigned>(seqs));
  EXL_DISPATCH_FLOAT(x.scalar_type(), "causal_conv1d", [&] {
    launch_pdl(causal_conv1d_kernel<scalar_t>, grid, dim3(kThreads), 0, current_stream(), pdl,
               static_cast<const scalar_t*>(x.data_ptr()), x.stride(0),
               static_cast<const scalar_t*>(weight.data_ptr()), static_cast<const scalar_t*>(in_states.data_ptr()),
               static_cast<const int32_t*>(in_slots.data_ptr<int32_t>()),
               static_cast<scalar_t*>(out_states.data_ptr()),
               static_cast<const int32_t*>(out_slots.data_ptr<int32_t>()),
               static_cast<const int32_t*>(begin.data_ptr<int32_t>()),
               static_cast<const int32_t*>(end.data_ptr<int32_t>()), static_cast<int>(channels),
               static_cast<int>(width), static_cast<scalar_t*>(out.data_ptr()));
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace exlcli
