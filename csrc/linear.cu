// Skinny linear layer for decode: y[M, N] = x[M, K] @ W[N, K]^T (+ bias) for M <= 4, bf16/fp16.
// cuBLAS reaches 1.1 to 3.3 TB/s on these shapes at M = 1 (measured on the H200); this kernel
// streams each weight row once with 16-byte loads, two rows per warp, several loads in flight,
// and keeps the few activation rows in L1.
#include <ATen/ops/empty.h>

#include "common.cuh"
#include "ops.h"

namespace exlcli {
namespace {

constexpr int kLinWarps = 8;
constexpr int kRowsPerWarp = 2;
constexpr int kRowsPerBlock = kLinWarps * kRowsPerWarp;
constexpr int kLinUnroll = 8;

__device__ __forceinline__ uint4 load_stream(const void* p) { return __ldcs(static_cast<const uint4*>(p)); }
__device__ __forceinline__ uint4 load_cached(const void* p) { return __ldg(static_cast<const uint4*>(p)); }

template <typename T>
__device__ __forceinline__ float dot8(const uint4& a, const uint4& b, float acc) {
  const T* x = reinterpret_cast<const T*>(&a);
  const T* y = reinterpret_cast<const T*>(&b);
#pragma unroll
  for (int e = 0; e < 8; ++e) acc = fmaf(to_float(x[e]), to_float(y[e]), acc);
  return acc;
}

template <typename T, int M>
__global__ void __launch_bounds__(kLinWarps * 32) skinny_linear_kernel(
    T* __restrict__ y, const T* __restrict__ x, int64_t x_stride, const T* __restrict__ w,
    const T* __restrict__ bias, int n, int k) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int row0 = (blockIdx.x * kLinWarps + warp) * kRowsPerWarp;
  if (row0 >= n) return;
  const bool two = row0 + 1 < n;
  const T* w0 = w + static_cast<int64_t>(row0) * k;
  const T* w1 = two ? w0 + k : w0;
  const int chunks = k / 8;
  float acc[kRowsPerWarp][M];
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r)
#pragma unroll
    for (int m = 0; m < M; ++m) acc[r][m] = 0.f;
  for (int c0 = lane; c0 < chunks; c0 += 32 * kLinUnroll) {
    uint4 a[kLinUnroll], b[kLinUnroll];
#pragma unroll
    for (int u = 0; u < kLinUnroll; ++u) {
      const int c = c0 + u * 32;
      if (c < chunks) {
        a[u] = load_stream(w0 + c * 8);
        b[u] = load_stream(w1 + c * 8);
      }
    }
#pragma unroll
    for (int u = 0; u < kLinUnroll; ++u) {
      const int c = c0 + u * 32;
      if (c < chunks) {
#pragma unroll
        for (int m = 0; m < M; ++m) {
          const uint4 xv = load_cached(x + m * x_stride + c * 8);
          acc[0][m] = dot8<T>(a[u], xv, acc[0][m]);
          acc[1][m] = dot8<T>(b[u], xv, acc[1][m]);
        }
      }
    }
  }
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r)
#pragma unroll
    for (int m = 0; m < M; ++m) acc[r][m] = warp_sum(acc[r][m]);
  if (lane == 0) {
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) {
      const int row = row0 + r;
      if (r == 1 && !two) break;
      const float b0 = bias != nullptr ? to_float(bias[row]) : 0.f;
#pragma unroll
      for (int m = 0; m < M; ++m) y[static_cast<int64_t>(m) * n + row] = from_float<T>(acc[r][m] + b0);
    }
  }
}

template <typename T>
void launch_skinny(T* y, const T* x, int64_t x_stride, const T* w, const T* bias, int m, int n, int k,
                   cudaStream_t stream) {
  const dim3 grid((n + kRowsPerBlock - 1) / kRowsPerBlock), block(kLinWarps * 32);
  switch (m) {
    case 1: skinny_linear_kernel<T, 1><<<grid, block, 0, stream>>>(y, x, x_stride, w, bias, n, k); break;
    case 2: skinny_linear_kernel<T, 2><<<grid, block, 0, stream>>>(y, x, x_stride, w, bias, n, k); break;
    case 3: skinny_linear_kernel<T, 3><<<grid, block, 0, stream>>>(y, x, x_stride, w, bias, n, k); break;
    default: skinny_linear_kernel<T, 4><<<grid, block, 0, stream>>>(y, x, x_stride, w, bias, n, k); break;
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

at::Tensor skinny_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  EXL_CHECK_CUDA_TENSOR(x, "skinny_linear: x");
  EXL_CHECK_CUDA_TENSOR(weight, "skinny_linear: weight");
  TORCH_CHECK(x.device() == weight.device(), "skinny_linear: x and weight are on different devices");
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1), "skinny_linear: x ", x.sizes(),
              " and weight ", weight.sizes(), " do not multiply");
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= 4, "skinny_linear: 1 to 4 rows, got ", x.size(0));
  TORCH_CHECK(x.scalar_type() == weight.scalar_type(), "skinny_linear: x and weight dtypes differ");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf,
              "skinny_linear: bfloat16 or float16 only, got ", x.scalar_type());
  const int64_t k = x.size(1), n = weight.size(0);
  TORCH_CHECK(k % 8 == 0 && weight.is_contiguous() && aligned16(weight.data_ptr()),
              "skinny_linear: weight must be contiguous with rows a multiple of 8 elements");
  const at::Tensor xc = (x.stride(1) == 1 && x.stride(0) % 8 == 0 && aligned16(x.data_ptr())) ? x : x.contiguous();
  if (bias.has_value()) {
    TORCH_CHECK(bias->is_cuda() && bias->dim() == 1 && bias->size(0) == n && bias->is_contiguous() &&
                    bias->scalar_type() == x.scalar_type(),
                "skinny_linear: bias must be a contiguous [", n, "] of x's dtype");
  }
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor y = at::empty({x.size(0), n}, x.options().memory_format(at::MemoryFormat::Contiguous));
  if (n == 0) return y;
  const cudaStream_t stream = current_stream();
  if (x.scalar_type() == at::kBFloat16) {
    using T = __nv_bfloat16;
    launch_skinny<T>(static_cast<T*>(y.data_ptr()), static_cast<const T*>(xc.data_ptr()), xc.stride(0),
                     static_cast<const T*>(weight.data_ptr()),
                     bias.has_value() ? static_cast<const T*>(bias->data_ptr()) : nullptr, static_cast<int>(x.size(0)),
                     static_cast<int>(n), static_cast<int>(k), stream);
  } else {
    using T = __half;
    launch_skinny<T>(static_cast<T*>(y.data_ptr()), static_cast<const T*>(xc.data_ptr()), xc.stride(0),
                     static_cast<const T*>(weight.data_ptr()),
                     bias.has_value() ? static_cast<const T*>(bias->data_ptr()) : nullptr, static_cast<int>(x.size(0)),
                     static_cast<int>(n), static_cast<int>(k), stream);
  }
  return y;
}

}  // namespace exlcli
