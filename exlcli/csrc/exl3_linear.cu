// The torch-facing ops over EXL3 trellis weights in the repacked layout of exl3_trellis.cuh
// (exlcli/ops/formats/cuda_exl3.py repacks them at load and holds the linear):
//
// exl3_linear: y = x W^T (+ bias) for 1 to 64 tokens, W = diag(svh) H W0^T H diag(suh) (exl3.py), in three
// kernels: the input side (x * suh, the 128-wide Hadamard, rounded to fp16 into the B fragments of the
// tensor cores, once for each distinct suh), the product (each warp decodes the tiles of one 16-row strip
// along a slice of the input in registers and multiplies them by every token's fragments on m16n8k16,
// fp32 sums per slice), and the output side (the slices summed in order, the Hadamard, svh, the bias).
// The slices depend on the shape and the device only, so a token's sums never depend on the other tokens.
//
// exl3_dequantize: the dense weight W [n, k] in bf16 or fp16 (a product of many tokens runs on cuBLAS over
// it), one block per 128 x 128 block: its 64 tiles decoded into shared memory, the two Hadamards there.
//
// Python checks the inputs first (exlcli/ops/cuda/kernels.py); the checks here guard against a call that
// bypasses it.
#include <ATen/ops/empty.h>
#include <cuda_runtime.h>

#include <algorithm>

#include "common.cuh"
#include "exl3_trellis.cuh"
#include "ops.h"
#include "pdl.cuh"

namespace exlcli {
namespace exl3 {
namespace {

constexpr float kInvSqrt128 = 0.08838834764831845f;

template <int G>
__host__ __device__ constexpr int e_tokens() { return 8 * G; }

// B fragments of x' (fp16): for each suh, input tile, group of 8 tokens and lane, the two u32 registers.
__device__ __forceinline__ int64_t fragment_half(int part, int tile, int tiles, int groups, int token, int kk) {
  const int group = token / 8, lane = (token % 8) * 4 + (kk % 8) / 2, reg = kk / 8;
  return ((((static_cast<int64_t>(part) * tiles + tile) * groups + group) * 32 + lane) * 2 + reg) * 2 + kk % 2;
}

// grid (k / 128, 8 * groups, parts), 128 threads: x' = H (x * suh) / sqrt(128) in fp16; zero for tokens >= m.
template <typename T>
__global__ void __launch_bounds__(128) input_kernel(const T* __restrict__ x, const __half* __restrict__ suh, int m,
                                                    int k, int groups, __half* __restrict__ xf) {
  __shared__ float scratch[kHad];
  grid_dependency_wait();
  const int f = blockIdx.x * kHad + threadIdx.x, token = blockIdx.y, part = blockIdx.z;
  float v = 0.f;
  if (token < m) v = to_float(x[static_cast<int64_t>(token) * k + f]) * __half2float(suh[static_cast<int64_t>(part) * k + f]);
  v = fwht128_block(v, scratch) * kInvSqrt128;
  grid_dependents_launch();
  xf[fragment_half(part, f / kTile, k / kTile, groups, token, f % kTile)] = __float2half_rn(v);
}

// The output side of one 128-row group, fused into the product (Epilogue::counters set): the bias's and the
// output's dtypes, and a counter a group that the last of its slices to finish resets.
struct Epilogue {
  int* counters;  // [n / 128], zero between calls; nullptr: the output kernel does this step
  const __half* svh;
  const void* bias;  // In: bf16 or fp16 (bias_half), or nullptr
  void* y;           // bf16, fp16 or fp32 (out_kind 0, 1, 2)
  bool bias_half;
  int out_kind;
};

// y = H v * svh / sqrt(128) (+ bias) for 128 rows of one token, element lane + 32 r in v[r]: the arithmetic of
// output_kernel (the same butterflies in the same order: stride 1 to 64), so both give the same bytes.
__device__ __forceinline__ void store_rows(float (&v)[4], int lane, int64_t at, int row0, const Epilogue& e) {
  fwht128_warp(v, lane);
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    const int row = row0 + lane + 32 * r;
    float o = __fmul_rn(v[r], __half2float(e.svh[row]) * kInvSqrt128);  // never contracted into an fma
    if (e.bias != nullptr) {
      o = __fadd_rn(o, e.bias_half ? __half2float(static_cast<const __half*>(e.bias)[row])
                                   : __bfloat162float(static_cast<const __nv_bfloat16*>(e.bias)[row]));
    }
    if (e.out_kind == 2) {
      static_cast<float*>(e.y)[at + row] = o;
    } else if (e.out_kind == 1) {
      static_cast<__half*>(e.y)[at + row] = __float2half_rn(o);
    } else {
      static_cast<__nv_bfloat16*>(e.y)[at + row] = __float2bfloat16_rn(o);
    }
  }
}

// grid (n / 128, splits), 8 warps: warp w takes strip 8 blockIdx.x + w over input tiles
// [blockIdx.y * per_split, + per_split). Its fp32 sums go to partial[blockIdx.y, token, row] (with more than one
// slice), and with e.counters the last slice of a group to finish adds the slices in their order and writes the
// output (the rest of output_kernel), else output_kernel does.
template <int K, int CB, int G, int U>
__global__ void __launch_bounds__(kWarps * 32) product_kernel(const uint8_t* __restrict__ trellis,
                                                              const uint2* __restrict__ xf,
                                                              const int* __restrict__ parts, int m, int n, int k,
                                                              int per_split, float* __restrict__ partial,
                                                              Epilogue e) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int strip = blockIdx.x * kWarps + warp, tiles = k / kTile;
  const int t0 = blockIdx.y * per_split, t1 = min(t0 + per_split, tiles);
  const uint8_t* w = trellis + (static_cast<int64_t>(strip) * tiles) * tile_bytes<K>();
  float acc[G][4];
#pragma unroll
  for (int g = 0; g < G; ++g) acc[g][0] = acc[g][1] = acc[g][2] = acc[g][3] = 0.f;
  // the weights are no earlier kernel's output: the first tiles load before the wait, and each step loads the
  // next step's tiles before it decodes its own
  Raw cur[U], next[U];
#pragma unroll
  for (int u = 0; u < U; ++u) {
    if (t0 + u < t1) cur[u] = load_chunk<K>(w + static_cast<int64_t>(t0 + u) * tile_bytes<K>(), lane);
  }
  const uint2* xp = xf + static_cast<int64_t>(parts[blockIdx.x]) * tiles * G * 32 + lane;
  grid_dependency_wait();
  for (int t = t0; t < t1; t += U) {
    uint2 b[U][G];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (t + u < t1) {
#pragma unroll
        for (int g = 0; g < G; ++g) b[u][g] = xp[(static_cast<int64_t>(t + u) * G + g) * 32];
      }
      if (t + U + u < t1) next[u] = load_chunk<K>(w + static_cast<int64_t>(t + U + u) * tile_bytes<K>(), lane);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (t + u < t1) {  // the same for the whole warp: the shuffles see every lane
        uint32_t a[4];
        decode_tile<K, CB>(cur[u], lane, a);
#pragma unroll
        for (int g = 0; g < G; ++g) mma_16816(acc[g], a, b[u][g]);
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) cur[u] = next[u];
  }
  grid_dependents_launch();
  __shared__ float rows[e_tokens<G>()][kHad + 1];  // the group's sums, [token][row], for the fused output
  __shared__ int last;
  const bool fused = e.counters != nullptr;
  if (fused && gridDim.y == 1) {
#pragma unroll
    for (int g = 0; g < G; ++g) {
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const int token = g * 8 + (lane % 4) * 2 + (r & 1);
        if (token < m) rows[token][warp * kTile + lane / 4 + 8 * (r >> 1)] = 0.f + acc[g][r];
      }
    }
  } else {
    float* out = partial + static_cast<int64_t>(blockIdx.y) * m * n;
    const int row = strip * kTile + lane / 4;
#pragma unroll
    for (int g = 0; g < G; ++g) {
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const int token = g * 8 + (lane % 4) * 2 + (r & 1);
        if (token < m) out[static_cast<int64_t>(token) * n + row + 8 * (r >> 1)] = acc[g][r];
      }
    }
    if (!fused) return;
    // the last slice of this group to finish sums them all: each slice's writes are visible before it counts
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(e.counters + blockIdx.x, 1) == static_cast<int>(gridDim.y) - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    for (int i = threadIdx.x; i < m * kHad; i += kWarps * 32) {
      const int token = i / kHad, row = i % kHad;
      float v = 0.f;
      for (int sl = 0; sl < static_cast<int>(gridDim.y); ++sl) {
        v += __ldcg(partial + (static_cast<int64_t>(sl) * m + token) * n + blockIdx.x * kHad + row);
      }
      rows[token][row] = v;
    }
    if (threadIdx.x == 0) e.counters[blockIdx.x] = 0;  // ready for the next call (the next kernel waits for us)
  }
  __syncthreads();
  for (int token = warp; token < m; token += kWarps) {
    float v[4];
#pragma unroll
    for (int r = 0; r < 4; ++r) v[r] = rows[token][lane + 32 * r];
    store_rows(v, lane, static_cast<int64_t>(token) * n, blockIdx.x * kHad, e);
  }
}

// grid (n / 128, m), 128 threads: y = H (sum of the slices) * svh / sqrt(128) (+ bias).
template <typename In, typename Out>
__global__ void __launch_bounds__(128) output_kernel(const float* __restrict__ partial, int splits, int m, int n,
                                                     const __half* __restrict__ svh, const In* __restrict__ bias,
                                                     Out* __restrict__ y) {
  __shared__ float scratch[kHad];
  const int row = blockIdx.x * kHad + threadIdx.x, token = blockIdx.y;
  grid_dependency_wait();
  float v = 0.f;
  for (int s = 0; s < splits; ++s) v += partial[(static_cast<int64_t>(s) * m + token) * n + row];
  v = __fmul_rn(fwht128_block(v, scratch), __half2float(svh[row]) * kInvSqrt128);  // as store_rows: no fma
  grid_dependents_launch();
  if (bias != nullptr) v = __fadd_rn(v, to_float(bias[row]));
  y[static_cast<int64_t>(token) * n + row] = from_float<Out>(v);
}

// grid (k / 128, n / 128), 256 threads, 128 x 129 floats of dynamic shared memory.
template <int K, int CB>
__global__ void __launch_bounds__(kWarps * 32) dequantize_kernel(const uint8_t* __restrict__ trellis,
                                                                 const __half* __restrict__ suh,
                                                                 const __half* __restrict__ svh,
                                                                 const int* __restrict__ parts, int n, int k,
                                                                 bool bf16, void* __restrict__ dense) {
  extern __shared__ float block[];  // [128][129]
  constexpr int kStride = kHad + 1;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int group = blockIdx.y, tiles = k / kTile;
  const int strip = group * kWarps + warp;
  grid_dependency_wait();
  const uint8_t* w = trellis + (static_cast<int64_t>(strip) * tiles + blockIdx.x * 8) * tile_bytes<K>();
  for (int b = 0; b < 8; ++b) {
    uint32_t a[4];
    decode_tile<K, CB>(load_chunk<K>(w + b * tile_bytes<K>(), lane), lane, a);
    const int out0 = warp * kTile + lane / 4, in0 = b * kTile + (lane % 4) * 2;
#pragma unroll
    for (int r = 0; r < 4; ++r) {  // register r: rows + 8 (r & 1), inputs + 8 (r >> 1)
      const __half2 h = *reinterpret_cast<const __half2*>(&a[r]);
      float* dst = block + (out0 + 8 * (r & 1)) * kStride + in0 + 8 * (r >> 1);
      dst[0] = __low2float(h);
      dst[1] = __high2float(h);
    }
  }
  __syncthreads();
  const __half* su = suh + static_cast<int64_t>(parts[group]) * k + blockIdx.x * kHad;
  for (int row = warp; row < kHad; row += kWarps) {  // along the inputs, times suh
    float v[4];
#pragma unroll
    for (int r = 0; r < 4; ++r) v[r] = block[row * kStride + lane + 32 * r];
    fwht128_warp(v, lane);
#pragma unroll
    for (int r = 0; r < 4; ++r) block[row * kStride + lane + 32 * r] = v[r] * __half2float(su[lane + 32 * r]);
  }
  __syncthreads();
  for (int col = warp; col < kHad; col += kWarps) {  // along the outputs, times svh / 128
    float v[4];
#pragma unroll
    for (int r = 0; r < 4; ++r) v[r] = block[(lane + 32 * r) * kStride + col];
    fwht128_warp(v, lane);
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int row = lane + 32 * r;
      block[row * kStride + col] = v[r] * (__half2float(svh[group * kHad + row]) * (1.f / kHad));
    }
  }
  __syncthreads();
  grid_dependents_launch();
  for (int i = threadIdx.x; i < kHad * kHad; i += kWarps * 32) {
    const int row = i / kHad, col = i % kHad;
    const int64_t at = (static_cast<int64_t>(group) * kHad + row) * k + blockIdx.x * kHad + col;
    const float v = block[row * kStride + col];
    if (bf16) {
      static_cast<__nv_bfloat16*>(dense)[at] = __float2bfloat16_rn(v);
    } else {
      static_cast<__half*>(dense)[at] = __float2half_rn(v);
    }
  }
}

constexpr int kDequantizeSmem = kHad * (kHad + 1) * 4;

struct Shape {
  int n, k, parts;
};

Shape check_weights(const char* op, const at::Tensor& trellis, const at::Tensor& suh, const at::Tensor& svh,
                    const at::Tensor& parts, int64_t bits, int64_t codebook, int64_t n, int64_t k) {
  EXL_CHECK_CUDA_TENSOR(trellis, "exl3: trellis");
  EXL_CHECK_CUDA_TENSOR(suh, "exl3: suh");
  EXL_CHECK_CUDA_TENSOR(svh, "exl3: svh");
  EXL_CHECK_CUDA_TENSOR(parts, "exl3: parts");
  TORCH_CHECK(bits >= 1 && bits <= 8, op, ": bits must be 1 to 8, got ", bits);
  TORCH_CHECK(codebook >= 0 && codebook <= 2, op, ": codebook must be 0 (3INST), 1 (MCG) or 2 (MUL1), got ",
              codebook);
  TORCH_CHECK(n > 0 && k > 0 && n % kHad == 0 && k % kHad == 0, op, ": the weight must be [n, k] in multiples of ",
              kHad, ", got ", n, " x ", k);
  TORCH_CHECK(trellis.scalar_type() == at::kByte && trellis.is_contiguous() && trellis.numel() == n * k * bits / 8 &&
                  aligned16(trellis.data_ptr()),
              op, ": trellis must be contiguous, aligned uint8 of ", n * k * bits / 8, " bytes");
  TORCH_CHECK(suh.scalar_type() == at::kHalf && suh.dim() == 2 && suh.size(1) == k && suh.size(0) > 0 &&
                  suh.is_contiguous(),
              op, ": suh must be contiguous float16 [parts, ", k, "]");
  TORCH_CHECK(svh.scalar_type() == at::kHalf && svh.numel() == n && svh.is_contiguous(), op,
              ": svh must be contiguous float16 [", n, "]");
  TORCH_CHECK(parts.scalar_type() == at::kInt && parts.numel() == n / kHad && parts.is_contiguous(), op,
              ": parts must be contiguous int32 [", n / kHad, "]");
  return Shape{static_cast<int>(n), static_cast<int>(k), static_cast<int>(suh.size(0))};
}

// Input tiles per slice: enough slices for about 4 blocks an SM, each of at least 8 tiles (a function of
// the shape and the device, never of the tokens).
int tiles_per_split(int n, int k) {
  const int tiles = k / kTile, groups = n / kHad;
  const int want = ceil_div(4 * num_sms(), groups);
  const int splits = std::max(1, std::min(want, tiles / 8));
  return ceil_div(tiles, splits);
}

template <int K, int CB, int G>
void launch_product(const at::Tensor& trellis, const at::Tensor& xf, const at::Tensor& parts, int m, int n, int k,
                    int per_split, int splits, const at::Tensor& partial, const Epilogue& e, cudaStream_t stream,
                    bool pdl) {
  constexpr int U = G == 1 ? 8 : G == 2 ? 4 : 2;
  launch_pdl(product_kernel<K, CB, G, U>, dim3(n / kHad, splits), dim3(kWarps * 32), 0, stream, pdl,
             static_cast<const uint8_t*>(trellis.data_ptr()), static_cast<const uint2*>(xf.data_ptr()),
             static_cast<const int*>(parts.data_ptr()), m, n, k, per_split, static_cast<float*>(partial.data_ptr()), e);
}

// The product's launch for the token groups and codebook of the call (the arguments after them passed on).
template <int K, int CB, typename... Args>
void launch_product_tokens(int groups, Args&&... args) {
  switch (groups) {
    case 1: launch_product<K, CB, 1>(args...); break;
    case 2: launch_product<K, CB, 2>(args...); break;
    case 4: launch_product<K, CB, 4>(args...); break;
    default: launch_product<K, CB, 8>(args...); break;
  }
}

template <int K, typename... Args>
void launch_product_codebook(int codebook, int groups, Args&&... args) {
  if (codebook == k3Inst) {
    launch_product_tokens<K, k3Inst>(groups, args...);
  } else if (codebook == kMcg) {
    launch_product_tokens<K, kMcg>(groups, args...);
  } else {
    launch_product_tokens<K, kMul1>(groups, args...);
  }
}

template <int K, int CB>
void launch_dequantize(const at::Tensor& trellis, const at::Tensor& suh, const at::Tensor& svh,
                       const at::Tensor& parts, int n, int k, bool bf16, const at::Tensor& dense,
                       cudaStream_t stream, bool pdl) {
  allow_dynamic_smem<dequantize_kernel<K, CB>>(kDequantizeSmem);
  launch_pdl(dequantize_kernel<K, CB>, dim3(k / kHad, n / kHad), dim3(kWarps * 32), kDequantizeSmem, stream, pdl,
             static_cast<const uint8_t*>(trellis.data_ptr()), static_cast<const __half*>(suh.data_ptr()),
             static_cast<const __half*>(svh.data_ptr()), static_cast<const int*>(parts.data_ptr()), n, k, bf16,
             dense.data_ptr());
}

template <int K>
void launch_dequantize_codebook(int codebook, const at::Tensor& trellis, const at::Tensor& suh,
                                const at::Tensor& svh, const at::Tensor& parts, int n, int k, bool bf16,
                                const at::Tensor& dense, cudaStream_t stream, bool pdl) {
  if (codebook == k3Inst) {
    launch_dequantize<K, k3Inst>(trellis, suh, svh, parts, n, k, bf16, dense, stream, pdl);
  } else if (codebook == kMcg) {
    launch_dequantize<K, kMcg>(trellis, suh, svh, parts, n, k, bf16, dense, stream, pdl);
  } else {
    launch_dequantize<K, kMul1>(trellis, suh, svh, parts, n, k, bf16, dense, stream, pdl);
  }
}

template <typename In, typename Out>
void launch_output(const at::Tensor& partial, int splits, int m, int n, const at::Tensor& svh,
                   const std::optional<at::Tensor>& bias, const at::Tensor& y, cudaStream_t stream, bool pdl) {
  launch_pdl(output_kernel<In, Out>, dim3(n / kHad, m), dim3(kHad), 0, stream, pdl,
             static_cast<const float*>(partial.data_ptr()), splits, m, n,
             static_cast<const __half*>(svh.data_ptr()),
             bias.has_value() ? static_cast<const In*>(bias->data_ptr()) : static_cast<const In*>(nullptr),
             static_cast<Out*>(y.data_ptr()));
}

}  // namespace
}  // namespace exl3

at::Tensor exl3_linear(const at::Tensor& x, const at::Tensor& trellis, const at::Tensor& suh, const at::Tensor& svh,
                       const at::Tensor& parts, int64_t bits, int64_t codebook, int64_t n,
                       const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& counters,
                       bool float_out, bool pdl) {
  using namespace exl3;
  const char* op = "exl3_linear";
  EXL_CHECK_CUDA_TENSOR(x, "exl3_linear: x");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && aligned16(x.data_ptr()) &&
                  (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf),
              op, ": x must be a contiguous, aligned bfloat16 or float16 [m, k]");
  TORCH_CHECK(x.size(0) <= 64, op, ": takes at most 64 tokens, got ", x.size(0));
  TORCH_CHECK(device_has_sm80(), op, ": needs the tensor cores of sm_80 or later");
  const Shape s = check_weights(op, trellis, suh, svh, parts, bits, codebook, n, x.size(1));
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == x.scalar_type() && bias->numel() == n && bias->is_contiguous(), op,
                ": bias must be a contiguous [", n, "] of x's dtype");
  }
  if (counters.has_value()) {
    TORCH_CHECK(counters->is_cuda() && counters->scalar_type() == at::kInt && counters->numel() == n / kHad &&
                    counters->is_contiguous(),
                op, ": counters must be a contiguous int32 [", n / kHad, "] on the GPU");
  }
  const c10::cuda::CUDAGuard guard(x.device());
  const int m = static_cast<int>(x.size(0));
  at::Tensor y = at::empty({m, n}, x.options().dtype(float_out ? at::kFloat : x.scalar_type()));
  if (m == 0) return y;
  const int groups = m <= 8 ? 1 : m <= 16 ? 2 : m <= 32 ? 4 : 8;
  const cudaStream_t stream = current_stream();
  at::Tensor xf = at::empty({static_cast<int64_t>(s.parts) * s.k * groups * 8}, x.options().dtype(at::kHalf));
  const dim3 in_grid(s.k / kHad, groups * 8, s.parts);
  if (x.scalar_type() == at::kBFloat16) {
    launch_pdl(input_kernel<__nv_bfloat16>, in_grid, dim3(kHad), 0, stream, pdl,
               static_cast<const __nv_bfloat16*>(x.data_ptr()), static_cast<const __half*>(suh.data_ptr()), m, s.k,
               groups, static_cast<__half*>(xf.data_ptr()));
  } else {
    launch_pdl(input_kernel<__half>, in_grid, dim3(kHad), 0, stream, pdl, static_cast<const __half*>(x.data_ptr()),
               static_cast<const __half*>(suh.data_ptr()), m, s.k, groups, static_cast<__half*>(xf.data_ptr()));
  }
  const int per_split = tiles_per_split(s.n, s.k);
  const int splits = ceil_div(s.k / kTile, per_split);
  const bool fused = counters.has_value();
  // fused with one slice, the sums stay in shared memory
  at::Tensor partial = at::empty({fused && splits == 1 ? 0 : splits, m, n}, x.options().dtype(at::kFloat));
  Epilogue e{fused ? static_cast<int*>(counters->data_ptr()) : nullptr, static_cast<const __half*>(svh.data_ptr()),
             bias.has_value() ? bias->data_ptr() : nullptr, y.data_ptr(), x.scalar_type() == at::kHalf,
             float_out ? 2 : x.scalar_type() == at::kHalf ? 1 : 0};
  const int cb = static_cast<int>(codebook);
#define EXL3_PRODUCT(K)                                                                                          \
  case K:                                                                                                        \
    launch_product_codebook<K>(cb, groups, trellis, xf, parts, m, s.n, s.k, per_split, splits, partial, e, stream, \
                               pdl);                                                                             \
    break;
  switch (bits) {
    EXL3_PRODUCT(1)
    EXL3_PRODUCT(2)
    EXL3_PRODUCT(3)
    EXL3_PRODUCT(4)
    EXL3_PRODUCT(5)
    EXL3_PRODUCT(6)
    EXL3_PRODUCT(7)
    EXL3_PRODUCT(8)
    default: break;
  }
#undef EXL3_PRODUCT
  if (fused) return y;
  if (x.scalar_type() == at::kBFloat16) {
    if (float_out) {
      launch_output<__nv_bfloat16, float>(partial, splits, m, s.n, svh, bias, y, stream, pdl);
    } else {
      launch_output<__nv_bfloat16, __nv_bfloat16>(partial, splits, m, s.n, svh, bias, y, stream, pdl);
    }
  } else if (float_out) {
    launch_output<__half, float>(partial, splits, m, s.n, svh, bias, y, stream, pdl);
  } else {
    launch_output<__half, __half>(partial, splits, m, s.n, svh, bias, y, stream, pdl);
  }
  return y;
}

at::Tensor exl3_dequantize(const at::Tensor& trellis, const at::Tensor& suh, const at::Tensor& svh,
                           const at::Tensor& parts, int64_t bits, int64_t codebook, int64_t n, int64_t k, bool bf16,
                           bool pdl) {
  using namespace exl3;
  const Shape s = check_weights("exl3_dequantize", trellis, suh, svh, parts, bits, codebook, n, k);
  const c10::cuda::CUDAGuard guard(trellis.device());
  at::Tensor dense = at::empty({n, k}, trellis.options().dtype(bf16 ? at::kBFloat16 : at::kHalf));
  const cudaStream_t stream = current_stream();
  const int cb = static_cast<int>(codebook);
#define EXL3_DEQUANTIZE(K)                                                                                \
  case K:                                                                                                 \
    launch_dequantize_codebook<K>(cb, trellis, suh, svh, parts, s.n, s.k, bf16, dense, stream, pdl);      \
    break;
  switch (bits) {
    EXL3_DEQUANTIZE(1)
    EXL3_DEQUANTIZE(2)
    EXL3_DEQUANTIZE(3)
    EXL3_DEQUANTIZE(4)
    EXL3_DEQUANTIZE(5)
    EXL3_DEQUANTIZE(6)
    EXL3_DEQUANTIZE(7)
    EXL3_DEQUANTIZE(8)
    default: break;
  }
#undef EXL3_DEQUANTIZE
  return dense;
}

}  // namespace exlcli
