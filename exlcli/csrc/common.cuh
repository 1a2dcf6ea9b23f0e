// Shared helpers for the exlcli kernels: dtype dispatch, 16-byte vector access, reductions, checks.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <type_traits>
#include <utility>

#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "pdl.cuh"

namespace exlcli {

// ---- scalar conversions ------------------------------------------------------------------------
__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// Rounds through T and back: the value a torch op in dtype T would have stored.
template <typename T> __device__ __forceinline__ float round_to(float x) { return to_float(from_float<T>(x)); }

// ---- 16-byte vectors ---------------------------------------------------------------------------
// A Vec<T> is 16 bytes of T (8 for bf16/fp16, 4 for fp32), loaded and stored with one instruction.
template <typename T>
struct alignas(16) Vec {
  static constexpr int N = 16 / sizeof(T);
  T v[N];
};

template <typename T>
__device__ __forceinline__ Vec<T> load_vec(const T* p) {
  return *reinterpret_cast<const Vec<T>*>(p);
}

template <typename T>
__device__ __forceinline__ void store_vec(T* p, const Vec<T>& x) {
  *reinterpret_cast<Vec<T>*>(p) = x;
}

// ---- reductions --------------------------------------------------------------------------------
__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}

// Sum over the block in a fixed order (so the result does not depend on anything but the row).
// `scratch` holds 32 floats; every thread gets the total.
__device__ __forceinline__ float block_sum(float x, float* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, num_warps = (blockDim.x + 31) >> 5;
  x = warp_sum(x);
  __syncthreads();  // scratch may still be read by a previous call
  if (lane == 0) scratch[warp] = x;
  __syncthreads();
  float total = 0.f;
  for (int w = 0; w < num_warps; ++w) total += scratch[w];
  return total;
}

// The largest x over the block; `scratch` holds 32 floats; every thread gets it.
__device__ __forceinline__ float block_max(float x, float* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, num_warps = (blockDim.x + 31) >> 5;
  x = warp_max(x);
  __syncthreads();  // scratch may still be read by a previous call
  if (lane == 0) scratch[warp] = x;
  __syncthreads();
  float m = scratch[0];
  for (int w = 1; w < num_warps; ++w) m = fmaxf(m, scratch[w]);
  return m;
}

// SiLU(gate) * up with F.silu(gate) * up's rounding: silu rounded to T, then the product rounded.
// In 16-bit, a fast exp and division (a few fp32 ulp, far below the rounding to T) keep the fused
// decode projection, which evaluates this for every chunk it reads, from being bound by arithmetic.
template <typename T>
__device__ __forceinline__ T silu_mul(T g, T u) {
  const float gf = to_float(g);
  float s;
  if constexpr (std::is_same_v<T, float>) {
    s = gf / (1.f + expf(-gf));
  } else {
    s = round_to<T>(__fdividef(gf, 1.f + __expf(-gf)));  // exp overflow: gf / inf = -0
  }
  return from_float<T>(s * to_float(u));
}

__host__ __device__ constexpr int ceil_div(int a, int b) { return (a + b - 1) / b; }

// ---- host-side checks --------------------------------------------------------------------------
inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

#define EXL_CHECK_CUDA_TENSOR(t, name) \
  TORCH_CHECK((t).is_cuda(), name " must be a CUDA tensor, got ", (t).device())

#define EXL_CHECK_DTYPE(t, dt, name) \
  TORCH_CHECK((t).scalar_type() == (dt), name " must be ", dt, ", got ", (t).scalar_type())

// Runs the lambda with `scalar_t` bound to float, __half or __nv_bfloat16.
#define EXL_DISPATCH_FLOAT(st, name, ...)                                              \
  switch (st) {                                                                         \
    case at::ScalarType::Float: { using scalar_t = float; __VA_ARGS__(); break; }       \
    case at::ScalarType::Half: { using scalar_t = __half; __VA_ARGS__(); break; }       \
    case at::ScalarType::BFloat16: { using scalar_t = __nv_bfloat16; __VA_ARGS__(); break; } \
    default: TORCH_CHECK(false, name ": unsupported dtype ", st, " (float32, float16, bfloat16)"); \
  }

inline cudaStream_t current_stream() { return c10::cuda::getCurrentCUDAStream().stream(); }

// ---- programmatic dependent launch (Hopper) ----------------------------------------------------
// grid_dependency_wait() and grid_dependents_launch(): pdl.cuh

// Whether the current device can take programmatic dependent launches (sm_90+; cached per device).
bool device_supports_pdl();

namespace detail {
// cudaLaunchKernelEx with the attributes of launch_pdl and launch_cluster_pdl: clusters of
// `*cluster` blocks when it is given, and a programmatic dependent launch when asked and supported.
template <typename Kernel, typename... Args>
void launch_ex(Kernel kernel, dim3 grid, dim3 block, const dim3* cluster, size_t smem, cudaStream_t stream,
               bool pdl, Args&&... args) {
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute attribute[2];
  unsigned int count = 0;
  if (cluster != nullptr) {
    attribute[count].id = cudaLaunchAttributeClusterDimension;
    attribute[count].val.clusterDim.x = cluster->x;
    attribute[count].val.clusterDim.y = cluster->y;
    attribute[count].val.clusterDim.z = cluster->z;
    ++count;
  }
  if (pdl && device_supports_pdl()) {
    attribute[count].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attribute[count].val.programmaticStreamSerializationAllowed = 1;
    ++count;
  }
  config.attrs = attribute;
  config.numAttrs = count;
  C10_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...));
}
}  // namespace detail

// Launches `kernel` on `stream`, as a programmatic dependent launch when the caller asks for one
// (`pdl`: the op's argument, decided in Python) and the device supports it.
template <typename Kernel, typename... Args>
void launch_pdl(Kernel kernel, dim3 grid, dim3 block, size_t smem, cudaStream_t stream, bool pdl, Args&&... args) {
  detail::launch_ex(kernel, grid, block, nullptr, smem, stream, pdl, std::forward<Args>(args)...);
}

// Launches `kernel` as launch_pdl does, its blocks in clusters of `cluster` blocks (sm_90+: the caller
// checks the device); the cluster's blocks run at once and can read each other's shared memory.
template <typename Kernel, typename... Args>
void launch_cluster_pdl(Kernel kernel, dim3 grid, dim3 block, dim3 cluster, size_t smem, cudaStream_t stream,
                        bool pdl, Args&&... args) {
  detail::launch_ex(kernel, grid, block, &cluster, smem, stream, pdl, std::forward<Args>(args)...);
}

// Lets `kernel` take `smem` bytes of dynamic shared memory (over the default 48 KiB) with the
// largest shared-memory carveout: set once per device for each kernel (a cache of what was set on
// the driver, not a setting). The kernel is a template argument, so each kernel has its own cache.
template <auto kernel>
void allow_dynamic_smem(int smem) {
  static std::atomic<uint64_t> configured{0};  // one bit per device
  int device = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  const uint64_t bit = uint64_t{1} << (device & 63);
  if (!(configured.load(std::memory_order_relaxed) & bit)) {
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                        cudaSharedmemCarveoutMaxShared));
    configured.fetch_or(bit, std::memory_order_relaxed);
  }
}

// Multiprocessors of the current device (cached per device).
int num_sms();

}  // namespace exlcli
