// SiLU(gate) * up over a fused [T, 2I] gate|up projection -> [T, I], as bf16 / fp16 / fp32 rows or
// (for FP8 products) e4m3 rows with a scale per row (e4m3_rows.cuh).
// Rounding follows F.silu(gate) * up in the dtype: silu rounded, then the product rounded.
#include <ATen/ops/empty.h>

#include "common.cuh"
#include "e4m3_rows.cuh"
#include "ops.h"

namespace exlcli {
namespace {

// Grid-stride over chunks of VW elements of the output.
template <typename T, int VW>
__global__ void silu_and_mul_kernel(T* __restrict__ out, const T* __restrict__ x, int64_t x_stride,
                                    int inter, int64_t num_chunks) {
  grid_dependency_wait();  // launched with launch_pdl: the previous kernel may still run
  grid_dependents_launch();
  const int chunks_per_row = inter / VW;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < num_chunks;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t row = i / chunks_per_row;
    const int col = static_cast<int>(i % chunks_per_row) * VW;
    const T* gate = x + row * x_stride + col;
    const T* up = gate + inter;
    T* dst = out + row * inter + col;
    if constexpr (VW == Vec<T>::N) {
      const Vec<T> g = load_vec(gate), u = load_vec(up);
      Vec<T> o;
#pragma unroll
      for (int e = 0; e < VW; ++e) o.v[e] = silu_mul(g.v[e], u.v[e]);
      store_vec(dst, o);
    } else {
      dst[0] = silu_mul(gate[0], up[0]);
    }
  }
}

// 1,024 threads a row: with 256 (7 chunks a thread at the 8B width) a row of 64 takes 5.3 us on the
// H200, its 64 blocks too few warps to hide the loads' latency. Bytes do not depend on the block size.
constexpr int kE4m3Threads = 1024;
constexpr int kE4m3MaxChunks = 2;  // chunks of 8 a thread: rows of up to 16,384 outputs

// One block per row of bf16 gate|up: the row's products stay in registers until its amax is known.
__global__ void __launch_bounds__(kE4m3Threads) silu_and_mul_e4m3_kernel(uint8_t* __restrict__ q,
                                                                         float* __restrict__ scale,
                                                                         const __nv_bfloat16* __restrict__ x,
                                                                         int64_t x_stride, int inter) {
  __shared__ float scratch[32];
  grid_dependency_wait();
  grid_dependents_launch();
  const int64_t row = blockIdx.x;
  const int num_chunks = inter / 8;
  float vals[kE4m3MaxChunks][8];
  float amax = 0.f;
#pragma unroll
  for (int i = 0; i < kE4m3MaxChunks; ++i) {
    const int c = threadIdx.x + i * kE4m3Threads;
    if (c < num_chunks) {
      const __nv_bfloat16* gate = x + row * x_stride + c * 8;
      const Vec<__nv_bfloat16> g = load_vec(gate), u = load_vec(gate + inter);
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        vals[i][e] = to_float(silu_mul(g.v[e], u.v[e]));
        amax = fmaxf(amax, fabsf(vals[i][e]));
      }
    }
  }
  amax = block_max(amax, scratch);
  const float inv = e4m3_inverse_scale(amax);
  if (threadIdx.x == 0) scale[row] = e4m3_scale(amax);
#pragma unroll
  for (int i = 0; i < kE4m3MaxChunks; ++i) {
    const int c = threadIdx.x + i * kE4m3Threads;
    if (c < num_chunks) *reinterpret_cast<uint2*>(q + row * inter + c * 8) = e4m3x8(vals[i], inv);
  }
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> silu_and_mul_e4m3(const at::Tensor& x, bool pdl) {
  EXL_CHECK_CUDA_TENSOR(x, "silu_and_mul_e4m3: x");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.stride(1) == 1 && aligned16(x.data_ptr()) &&
                  x.size(1) % 16 == 0 && x.stride(0) % 8 == 0,
              "silu_and_mul_e4m3: x must be bfloat16 [rows, 2 inter] with contiguous, 16-byte aligned rows and "
              "inter a multiple of 8");
  const int64_t rows = x.size(0);
  const int inter = static_cast<int>(x.size(1) / 2);
  TORCH_CHECK(inter <= kE4m3Threads * kE4m3MaxChunks * 8, "silu_and_mul_e4m3: rows of ", inter,
              " outputs are longer than this kernel supports");
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor q = at::empty({rows, inter}, x.options().dtype(at::kFloat8_e4m3fn));
  at::Tensor scale = at::empty({rows, 1}, x.options().dtype(at::kFloat));
  if (rows == 0) return {q, scale};
  launch_pdl(silu_and_mul_e4m3_kernel, dim3(static_cast<unsigned>(rows)), dim3(kE4m3Threads), 0, current_stream(),
             pdl, static_cast<uint8_t*>(q.data_ptr()), scale.data_ptr<float>(),
             static_cast<const __nv_bfloat16*>(x.data_ptr()), x.stride(0), inter);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {q, scale};
}

at::Tensor silu_and_mul(const at::Tensor& x, bool pdl) {
  EXL_CHECK_CUDA_TENSOR(x, "silu_and_mul: x");
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) % 2 == 0, "silu_and_mul: last dim must be even, got ", x.sizes());
  const c10::cuda::CUDAGuard guard(x.device());
  const at::Tensor x2 = (x.dim() == 2 && x.stride(1) == 1) ? x : x.contiguous().view({-1, x.size(-1)});
  const int inter = static_cast<int>(x.size(-1) / 2);
  auto sizes = x.sizes().vec();
  sizes.back() = inter;
  at::Tensor out = at::empty(sizes, x.options().memory_format(at::MemoryFormat::Contiguous));
  const int64_t rows = x2.size(0);
  if (rows == 0 || inter == 0) return out;
  EXL_DISPATCH_FLOAT(x.scalar_type(), "silu_and_mul", [&] {
    using T = scalar_t;
    constexpr int VW = Vec<T>::N;
    const T* src = static_cast<const T*>(x2.data_ptr());
    T* dst = static_cast<T*>(out.data_ptr());
    const bool vec_ok = inter % VW == 0 && x2.stride(0) % VW == 0 && aligned16(src);
    const int chunk = vec_ok ? VW : 1;
    const int64_t num_chunks = rows * (inter / chunk);
    const int threads = 256;
    const int64_t blocks = std::min<int64_t>((num_chunks + threads - 1) / threads, 1 << 16);
    if (vec_ok) {
      launch_pdl(silu_and_mul_kernel<T, VW>, dim3(blocks), dim3(threads), 0, current_stream(), pdl, dst, src,
                 x2.stride(0), inter, num_chunks);
    } else {
      launch_pdl(silu_and_mul_kernel<T, 1>, dim3(blocks), dim3(threads), 0, current_stream(), pdl, dst, src,
                 x2.stride(0), inter, num_chunks);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

}  // namespace exlcli
