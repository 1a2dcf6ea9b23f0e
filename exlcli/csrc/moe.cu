// Mixture-of-experts products on the device, with no host synchronisation: one layer's experts are
// stacked at load into one tensor per projection ([E, ...] in the packed layout of quant_linear.cuh,
// exlcli/ops/moe_stacked.py), and the router's choice arrives as an int32 expert id per (token, slot)
// pair, so a decode step's MoE layer is a fixed sequence of kernels that a CUDA graph can hold.
//
// moe_gemv: for S pairs, the product of each pair's expert over one row of x: block (i, y) takes pair
// order[i] (order: the pairs sorted by expert, so the blocks of one expert run side by side and its
// weights come from L2 after the first; or i itself) and row tile y, offsets the weight and scale
// pointers by the pair's expert and x by its row (pair / rows_per_x: the token for gate|up, the pair for
// down), and runs the dp4a kernel's body for one token (quant_gemv_dp4a.cuh) with the warps and ring
// that quant_linear gives one token: each pair's row is the bytes of quant_linear over that expert's
// weights and that row alone, whatever the other pairs.
//
// moe_combine: out[t] = sum over the k slots of token t, in slot order, of weight * row (fp32): a fixed
// order, so a token's result does not depend on the batch (no atomics).
#include <ATen/ops/empty.h>
#include <cuda_runtime.h>

#include "common.cuh"
#include "ops.h"
#include "quant_gemv_dp4a.cuh"
#include "quant_linear.cuh"

namespace exlcli {
namespace {

struct MoeParams {
  const __nv_bfloat16* x;   // [rows, k] bf16, rows 16-byte aligned
  const uint32_t* qweight;  // [experts, expert_words]
  const uint32_t* scales;   // [experts, expert_scales] (one 4-byte slot per row and group)
  const int32_t* ids;       // [pairs] each pair's expert
  const int32_t* order;     // [pairs] the pairs in the order the blocks take them, or null
  void* out;                // [pairs, n] bf16, or fp32 when FLOAT_OUT
  int n, k, group_log2;
  int rows_per_x;           // pairs per row of x
  int experts;
  size_t expert_words, expert_scales;
};

// Row tile blockIdx.y of the block's one pair; out points at the pair's output row (token 0 of p).
struct PairTile {
  __device__ __forceinline__ int tile(int) const { return blockIdx.y; }

  template <bool FLOAT_OUT, int WARPS, int M>
  __device__ __forceinline__ void store(const qlinear::Params& p,
                                        const float (&partial)[WARPS][1][M][qlinear::kTileRows]) const {
    static_assert(M == 1, "one row a pair");
    for (int i = threadIdx.x; i < qlinear::kTileRows; i += WARPS * 32) {
      float sum = 0.0f;
#pragma unroll
      for (int w = 0; w < WARPS; ++w) sum += partial[w][0][0][i];
      qlinear::store_output<FLOAT_OUT>(p, 0, tile(0) * qlinear::kTileRows + i, sum);
    }
  }
};

template <int BITS, int UNROLL, bool FLOAT_OUT, int WARPS>
__global__ void __launch_bounds__(WARPS * 32) moe_gemv_kernel(MoeParams mp) {
  grid_dependency_wait();  // the ids and the order are the previous kernels' output
  const int pair = mp.order != nullptr ? mp.order[blockIdx.x] : static_cast<int>(blockIdx.x);
  const int expert = mp.ids[pair];
  const size_t row0 = static_cast<size_t>(pair) * mp.n + static_cast<size_t>(blockIdx.y) * qlinear::kTileRows;
  if (expert < 0 || expert >= mp.experts) {  // not an expert: NaN rows, never a read out of bounds
    if (threadIdx.x < qlinear::kTileRows) {
      if constexpr (FLOAT_OUT) {
        static_cast<float*>(mp.out)[row0 + threadIdx.x] = __int_as_float(0x7fc00000);
      } else {
        static_cast<__nv_bfloat16*>(mp.out)[row0 + threadIdx.x] = __ushort_as_bfloat16(0x7fc0);
      }
    }
    return;
  }
  qlinear::Params p{};
  p.x = mp.x + static_cast<size_t>(pair / mp.rows_per_x) * mp.k;
  p.qweight = mp.qweight + static_cast<size_t>(expert) * mp.expert_words;
  p.scales = mp.scales + static_cast<size_t>(expert) * mp.expert_scales;
  p.bias = nullptr;
  if constexpr (FLOAT_OUT) {
    p.out = static_cast<float*>(mp.out) + static_cast<size_t>(pair) * mp.n;
  } else {
    p.out = static_cast<__nv_bfloat16*>(mp.out) + static_cast<size_t>(pair) * mp.n;
  }
  p.m = 1;
  p.n = mp.n;
  p.k = mp.k;
  p.group_log2 = mp.group_log2;
  qlinear::dp4a_gemv<BITS, 1, 1, UNROLL, FLOAT_OUT, WARPS>(p, PairTile{});
}

// The warps and ring of quant_linear.cu's launch_dp4a_tokens for one token (so each pair's row is its bytes):
// fp32 output 8 warps with 4 chunks in flight; bf16 output 16 warps with 2 for at most 256 row tiles, else 8
// with 4.
constexpr int kDp4aWideMaxTiles = 256;

template <int BITS>
void launch_moe_gemv(const MoeParams& mp, int pairs, bool float_out, cudaStream_t stream, bool pdl) {
  const int tiles = mp.n / qlinear::kTileRows;
  const dim3 grid(pairs, tiles);
  const size_t smem = qlinear::dp4a_smem_bytes(1, mp.k);
  if (float_out) {
    launch_pdl(moe_gemv_kernel<BITS, 4, true, 8>, grid, dim3(8 * 32), smem, stream, pdl, mp);
  } else if (tiles <= kDp4aWideMaxTiles) {
    launch_pdl(moe_gemv_kernel<BITS, 2, false, 16>, grid, dim3(16 * 32), smem, stream, pdl, mp);
  } else {
    launch_pdl(moe_gemv_kernel<BITS, 4, false, 8>, grid, dim3(8 * 32), smem, stream, pdl, mp);
  }
}

__global__ void __launch_bounds__(256) moe_combine_kernel(const float* __restrict__ rows,
                                                          const float* __restrict__ weights,
                                                          float* __restrict__ out, int tokens, int top_k, int n) {
  grid_dependency_wait();
  const size_t total = static_cast<size_t>(tokens) * n;
  const size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < total) {
    const size_t token = i / n, col = i - token * n;
    const size_t first = token * top_k;
    float sum = 0.0f;
    for (int j = 0; j < top_k; ++j) sum = fmaf(weights[first + j], rows[(first + j) * n + col], sum);
    out[i] = sum;
  }
  grid_dependents_launch();
}

}  // namespace

at::Tensor moe_gemv(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales, int64_t bits,
                    int64_t group, int64_t n, const at::Tensor& ids, const std::optional<at::Tensor>& order,
                    int64_t rows_per_x, bool float_out, bool pdl) {
  const char* op = "moe_gemv";
  EXL_CHECK_CUDA_TENSOR(qweight, "moe_gemv: qweight");
  EXL_CHECK_CUDA_TENSOR(scales, "moe_gemv: scales");
  EXL_CHECK_CUDA_TENSOR(ids, "moe_gemv: ids");
  TORCH_CHECK(x.is_cuda() && x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous() &&
                  aligned16(x.data_ptr()),
              op, ": x must be a contiguous, 16-byte aligned CUDA bfloat16 [rows, k]");
  TORCH_CHECK(bits == 4 || bits == 6 || bits == 8, op, ": bits must be 4, 6 or 8, got ", bits);
  TORCH_CHECK(group == 16 || group == 32 || group == 64 || group == 128, op, ": group must be 16, 32, 64 or 128");
  const int64_t k = x.size(1);
  TORCH_CHECK(n % qlinear::kTileRows == 0 && k % qlinear::kChunk == 0 && n > 0 && k > 0 && n / 16 <= 65535, op,
              ": n must be a multiple of 16 (at most 1,048,560) and k of 64, got ", n, " x ", k);
  TORCH_CHECK(qlinear::dp4a_smem_bytes(1, static_cast<int>(k)) <= 44 * 1024, op, ": k is too large: ", k);
  TORCH_CHECK(qweight.dim() == 2 && qweight.scalar_type() == at::kInt && qweight.is_contiguous() &&
                  qweight.size(1) == n * k * bits / 32 && qweight.size(0) > 0,
              op, ": qweight must be contiguous int32 [experts, ", n * k * bits / 32, "]");
  const int64_t experts = qweight.size(0);
  TORCH_CHECK(scales.is_contiguous() && scales.size(0) == experts &&
                  scales.numel() * scales.element_size() == experts * n * (k / group) * 4,
              op, ": scales must be contiguous [experts, ...] with ", n * (k / group) * 4, " bytes an expert");
  TORCH_CHECK(aligned16(qweight.data_ptr()) && aligned16(scales.data_ptr()), op,
              ": qweight and scales must be 16-byte aligned");
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == at::kInt && ids.is_contiguous(), op,
              ": ids must be a contiguous int32 [pairs]");
  const int64_t pairs = ids.size(0);
  TORCH_CHECK(rows_per_x >= 1 && pairs == x.size(0) * rows_per_x, op, ": ids must hold rows_per_x (", rows_per_x,
              ") pairs a row of x (", x.size(0), " rows), got ", pairs);
  TORCH_CHECK(pairs < (int64_t{1} << 31), op, ": too many pairs");
  if (order.has_value()) {
    TORCH_CHECK(order->is_cuda() && order->dim() == 1 && order->scalar_type() == at::kInt &&
                    order->is_contiguous() && order->size(0) == pairs,
                op, ": order must be a contiguous int32 [pairs]");
  }
  TORCH_CHECK(x.device() == qweight.device() && x.device() == scales.device() && x.device() == ids.device() &&
                  (!order.has_value() || order->device() == x.device()),
              op, ": every tensor must be on one device");
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor out = at::empty({pairs, n}, x.options().dtype(float_out ? at::kFloat : at::kBFloat16));
  if (pairs == 0) return out;
  MoeParams mp{};
  mp.x = static_cast<const __nv_bfloat16*>(x.data_ptr());
  mp.qweight = static_cast<const uint32_t*>(qweight.data_ptr());
  mp.scales = static_cast<const uint32_t*>(scales.data_ptr());
  mp.ids = static_cast<const int32_t*>(ids.data_ptr());
  mp.order = order.has_value() ? static_cast<const int32_t*>(order->data_ptr()) : nullptr;
  mp.out = out.data_ptr();
  mp.n = static_cast<int>(n);
  mp.k = static_cast<int>(k);
  mp.group_log2 = group == 16 ? 4 : group == 32 ? 5 : group == 64 ? 6 : 7;
  mp.rows_per_x = static_cast<int>(rows_per_x);
  mp.experts = static_cast<int>(experts);
  mp.expert_words = static_cast<size_t>(n * k * bits / 32);
  mp.expert_scales = static_cast<size_t>(n * (k / group));
  const cudaStream_t stream = current_stream();
  if (bits == 4) {
    launch_moe_gemv<4>(mp, static_cast<int>(pairs), float_out, stream, pdl);
  } else if (bits == 6) {
    launch_moe_gemv<6>(mp, static_cast<int>(pairs), float_out, stream, pdl);
  } else {
    launch_moe_gemv<8>(mp, static_cast<int>(pairs), float_out, stream, pdl);
  }
  return out;
}

at::Tensor moe_combine(const at::Tensor& rows, const at::Tensor& weights, int64_t top_k, bool pdl) {
  const char* op = "moe_combine";
  EXL_CHECK_CUDA_TENSOR(rows, "moe_combine: rows");
  EXL_CHECK_CUDA_TENSOR(weights, "moe_combine: weights");
  TORCH_CHECK(rows.dim() == 2 && rows.scalar_type() == at::kFloat && rows.is_contiguous(), op,
              ": rows must be a contiguous float32 [pairs, n]");
  TORCH_CHECK(top_k >= 1 && rows.size(0) % top_k == 0, op, ": the pairs must be whole tokens of ", top_k, " slots");
  TORCH_CHECK(weights.scalar_type() == at::kFloat && weights.is_contiguous() && weights.numel() == rows.size(0) &&
                  weights.device() == rows.device(),
              op, ": weights must be a contiguous float32 of one weight a pair");
  const int64_t tokens = rows.size(0) / top_k, n = rows.size(1);
  const c10::cuda::CUDAGuard guard(rows.device());
  at::Tensor out = at::empty({tokens, n}, rows.options());
  const int64_t total = tokens * n;
  if (total == 0) return out;
  TORCH_CHECK(total < (int64_t{1} << 31) * 256, op, ": too many outputs");
  launch_pdl(moe_combine_kernel, dim3(static_cast<unsigned>((total + 255) / 256)), dim3(256), 0, current_stream(),
             pdl, static_cast<const float*>(rows.data_ptr()), static_cast<const float*>(weights.data_ptr()),
             static_cast<float*>(out.data_ptr()), static_cast<int>(tokens), static_cast<int>(top_k),
             static_cast<int>(n));
  return out;
}

}  // namespace exlcli
