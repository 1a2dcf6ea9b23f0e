// Greedy picks over fp32 logits rows [B, V] in one pass (exlcli/ops/argmax.py holds the torch
// reference): each row's argmax (the first index of its largest value, as torch.argmax), and a flag
// for rows unfit to sample (a NaN or +Inf, or no finite value at all), as one int64 [2B] tensor that
// the engine reads back at once.
//
// A row is cut into chunks, each a block's, so that a few rows still fill the GPU. A block keeps, per
// thread, the largest key of its elements, where the key of (value v, index i) is v's bits in an
// unsigned order that sorts floats, then ~i (so the larger key has the larger value, then the
// smaller index): the maximum is the same whatever order the keys are combined in, so the result
// does not depend on the chunking. A second kernel takes the maximum over a row's chunks.
#include <ATen/ops/empty.h>

#include "common.cuh"
#include "ops.h"

namespace exlcli {
namespace {

constexpr int kThreads = 256;
constexpr int kLoads = 4;        // 16-byte loads a thread issues before it compares
constexpr int kBlocksPerSm = 4;  // blocks to aim for (the rows' chunks): enough loads in flight
constexpr int kMinChunk = 2048;  // logits a block reads at least
constexpr int kMaxChunks = 64;   // chunks a row is cut into at most

constexpr uint32_t kBad = 1;     // a NaN or +Inf
constexpr uint32_t kFinite = 2;  // some finite value

struct Pick {
  uint64_t key = 0;
  uint32_t flags = 0;

  __device__ __forceinline__ void add(float v, uint32_t index) {
    uint32_t u = __float_as_uint(v);
    if (u == 0x80000000u) u = 0;  // -0 ties with +0, as torch compares them
    const uint32_t order = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
    const uint64_t k = (static_cast<uint64_t>(order) << 32) | (0xFFFFFFFFu - index);
    key = k > key ? k : key;
    if (isnan(v) || v == INFINITY) flags |= kBad;
    if (isfinite(v)) flags |= kFinite;
  }

  __device__ __forceinline__ void merge(uint64_t k, uint32_t f) {
    key = k > key ? k : key;
    flags |= f;
  }

  __device__ __forceinline__ void warp_merge() {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const uint64_t k = __shfl_xor_sync(0xffffffffu, key, o);
      const uint32_t f = __shfl_xor_sync(0xffffffffu, flags, o);
      merge(k, f);
    }
  }
};

template <bool VEC>
__global__ void __launch_bounds__(kThreads) argmax_chunks_kernel(const float* __restrict__ logits, int vocab,
                                                                 int chunk, uint64_t* __restrict__ keys,
                                                                 uint32_t* __restrict__ flags) {
  __shared__ uint64_t s_key[kThreads / 32];
  __shared__ uint32_t s_flags[kThreads / 32];
  grid_dependency_wait();
  grid_dependents_launch();
  const int row = blockIdx.y, c = blockIdx.x, chunks = gridDim.x;
  const float* x = logits + static_cast<int64_t>(row) * vocab;
  const int begin = c * chunk, end = min(vocab, begin + chunk);
  Pick pick;
  if constexpr (VEC) {  // chunk and vocab multiples of 4, rows 16-byte aligned
    constexpr int kStride = 4 * kThreads;
    for (int first = begin + 4 * threadIdx.x; first < end; first += kLoads * kStride) {
      float4 v[kLoads];  // all loads first: a thread keeps kLoads * 16 bytes in flight
#pragma unroll
      for (int u = 0; u < kLoads; ++u) {
        const int i = first + u * kStride;
        if (i < end) v[u] = *reinterpret_cast<const float4*>(x + i);
      }
#pragma unroll
      for (int u = 0; u < kLoads; ++u) {
        const int i = first + u * kStride;
        if (i < end) {
          pick.add(v[u].x, i);
          pick.add(v[u].y, i + 1);
          pick.add(v[u].z, i + 2);
          pick.add(v[u].w, i + 3);
        }
      }
    }
  } else {
    for (int i = begin + threadIdx.x; i < end; i += kThreads) pick.add(x[i], i);
  }
  pick.warp_merge();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) {
    s_key[warp] = pick.key;
    s_flags[warp] = pick.flags;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kThreads / 32; ++w) pick.merge(s_key[w], s_flags[w]);
    keys[row * chunks + c] = pick.key;
    flags[row * chunks + c] = pick.flags;
  }
}

// One warp a row: out[row] its argmax, out[rows + row] 1 where it is unfit to sample.
__global__ void argmax_rows_kernel(const uint64_t* __restrict__ keys, const uint32_t* __restrict__ flags, int chunks,
                                   int rows, int64_t* __restrict__ out) {
  grid_dependency_wait();
  grid_dependents_launch();
  const int row = blockIdx.x;
  Pick pick;
  for (int c = threadIdx.x; c < chunks; c += 32) pick.merge(keys[row * chunks + c], flags[row * chunks + c]);
  pick.warp_merge();
  if (threadIdx.x == 0) {
    out[row] = static_cast<int64_t>(0xFFFFFFFFu - static_cast<uint32_t>(pick.key & 0xFFFFFFFFu));
    out[rows + row] = ((pick.flags & kBad) || !(pick.flags & kFinite)) ? 1 : 0;
  }
}

}  // namespace

at::Tensor argmax_rows(const at::Tensor& logits, bool pdl) {
  EXL_CHECK_CUDA_TENSOR(logits, "argmax_rows: logits");
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.is_contiguous() &&
                  logits.size(1) > 0 && logits.size(1) < (int64_t{1} << 31),
              "argmax_rows: logits must be a contiguous float32 [rows, vocab] with 0 < vocab < 2^31, got ",
              logits.scalar_type(), " ", logits.sizes());
  const c10::cuda::CUDAGuard guard(logits.device());
  const int64_t rows = logits.size(0);
  const int vocab = static_cast<int>(logits.size(1));
  at::Tensor out = at::empty({2 * rows}, logits.options().dtype(at::kLong));
  if (rows == 0) return out;
  TORCH_CHECK(rows < 65536, "argmax_rows: at most 65,535 rows, got ", rows);
  // kBlocksPerSm blocks a multiprocessor, in chunks of at least kMinChunk (a multiple of 4).
  const int wanted = ceil_div(kBlocksPerSm * num_sms(), static_cast<int>(rows));
  const int most = std::min(kMaxChunks, ceil_div(vocab, kMinChunk));
  const int chunks = std::max(1, std::min(wanted, most));
  const int chunk = ceil_div(ceil_div(vocab, chunks), 4) * 4;
  const int used = ceil_div(vocab, chunk);  // the last chunks may be empty otherwise
  at::Tensor keys = at::empty({rows, used}, logits.options().dtype(at::kLong));
  at::Tensor flags = at::empty({rows, used}, logits.options().dtype(at::kInt));
  const float* x = logits.data_ptr<float>();
  auto* key_ptr = reinterpret_cast<uint64_t*>(keys.data_ptr<int64_t>());
  auto* flag_ptr = reinterpret_cast<uint32_t*>(flags.data_ptr<int32_t>());
  const dim3 grid(static_cast<unsigned>(used), static_cast<unsigned>(rows));
  if (vocab % 4 == 0 && aligned16(x)) {
    launch_pdl(argmax_chunks_kernel<true>, grid, dim3(kThreads), 0, current_stream(), pdl, x, vocab, chunk, key_ptr,
               flag_ptr);
  } else {
    launch_pdl(argmax_chunks_kernel<false>, grid, dim3(kThreads), 0, current_stream(), pdl, x, vocab, chunk, key_ptr,
               flag_ptr);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  launch_pdl(argmax_rows_kernel, dim3(static_cast<unsigned>(rows)), dim3(32), 0, current_stream(), pdl,
             static_cast<const uint64_t*>(key_ptr), static_cast<const uint32_t*>(flag_ptr), used,
             static_cast<int>(rows), out.data_ptr<int64_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

}  // namespace exlcli
