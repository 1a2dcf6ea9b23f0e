// The torch-facing ops over quantized weights in the packed layout of quant_linear.cuh:
// quant_linear (the product: on the tensor cores, or for 1 or 2 tokens over integer weights on the
// CUDA cores with int8 activations, quant_gemv_dp4a.cuh), quant_heads_rope (the product of a q|k|v weight,
// or of whole heads of one, with rope.cu's step in the dp4a kernel's epilogue) and quant_dequantize (the
// dense bf16 weight, for products of many tokens through cuBLAS). Python checks the inputs first
// (exlcli/ops/cuda/kernels.py); the checks here only guard against a call that bypasses it.
#include <ATen/ops/empty.h>
#include <cuda_runtime.h>

#include "common.cuh"
#include "ops.h"
#include "quant_gemv_dp4a.cuh"
#include "quant_linear.cuh"
#include "rope_kv.cuh"

namespace exlcli {
namespace {

qlinear::Params packed_params(const at::Tensor& qweight, const at::Tensor& scales, int64_t bits, int64_t group,
                              int64_t n, int64_t k) {
  EXL_CHECK_CUDA_TENSOR(qweight, "quant linear: qweight");
  EXL_CHECK_CUDA_TENSOR(scales, "quant linear: scales");
  TORCH_CHECK(bits == 4 || bits == 6 || bits == 8, "quant linear: bits must be 4, 6 or 8, got ", bits);
  TORCH_CHECK(group == 16 || group == 32 || group == 64 || group == 128,
              "quant linear: group must be 16, 32, 64 or 128, got ", group);
  TORCH_CHECK(n % qlinear::kTileRows == 0 && k % qlinear::kChunk == 0 && n > 0 && k > 0,
              "quant linear: n must be a multiple of 16 and k of 64, got ", n, " x ", k);
  TORCH_CHECK(qweight.scalar_type() == at::kInt && qweight.is_contiguous() && qweight.numel() == n * k * bits / 32,
              "quant linear: qweight must be contiguous int32 with ", n * k * bits / 32, " elements");
  TORCH_CHECK(scales.is_contiguous() && scales.numel() * scales.element_size() == n * (k / group) * 4,
              "quant linear: scales must be contiguous with ", n * (k / group) * 4, " bytes");
  TORCH_CHECK(aligned16(qweight.data_ptr()) && aligned16(scales.data_ptr()),
              "quant linear: qweight and scales must be 16-byte aligned");
  qlinear::Params p{};
  p.qweight = static_cast<const uint32_t*>(qweight.data_ptr());
  p.scales = static_cast<const uint32_t*>(scales.data_ptr());
  p.n = static_cast<int>(n);
  p.k = static_cast<int>(k);
  p.group_log2 = group == 16 ? 4 : group == 32 ? 5 : group == 64 ? 6 : 7;
  return p;
}

template <int BITS, bool E4M3, int NT, int RT, int UNROLL>
void launch_tiles(const qlinear::Params& p, bool float_out, cudaStream_t stream, bool pdl) {
  const dim3 grid(p.n / (qlinear::kTileRows * RT), (p.m + 8 * NT - 1) / (8 * NT));
  const dim3 block(qlinear::kWarps * 32);
  if (float_out) {
    launch_pdl(qlinear::quant_linear_kernel<BITS, E4M3, NT, RT, UNROLL, true>, grid, block, 0, stream, pdl, p);
  } else {
    launch_pdl(qlinear::quant_linear_kernel<BITS, E4M3, NT, RT, UNROLL, false>, grid, block, 0, stream, pdl, p);
  }
}

// The smallest token tile (8 * NT) that covers m, more blocks in y beyond 64 tokens. Up to 16 tokens a
// block takes one row tile and keeps 4 chunks in flight per warp (decode is bound by the weights'
// bytes); beyond, two row tiles share each activation fragment (L2 traffic of the activations).
// At 33-64 tokens (8B shapes at 64 tokens, H200): 4-bit weights take two blocks of 32 tokens in y (126
// registers: two blocks an SM, against one of 64 tokens at 182), a 4-bit layer 149 us against 158;
// 8-bit ones 4 chunks in flight (down 48 us against 53, the LM head 433 against 480). 6-bit ones take
// the 8-bit shape there (a Q5_K layer 163 us against 179 in the 4-bit shape, Q6_K's LM head 368 against
// 409). At 17-32 tokens 4- and 6-bit weights keep 2 chunks in flight, not 4 (a 4-bit layer 92 us against
// 120 at 32 tokens, 87 against 108 at 17; a 6-bit one 108 against 126).
// Every shape adds a token's products in the same order, so results do not change with it.
template <int BITS, bool E4M3>
void launch(const qlinear::Params& p, bool float_out, cudaStream_t stream, bool pdl) {
  const bool pairs = (p.n / qlinear::kTileRows) % 2 == 0;
  if (p.m <= 8) {
    launch_tiles<BITS, E4M3, 1, 1, 4>(p, float_out, stream, pdl);
  } else if (p.m <= 16) {
    launch_tiles<BITS, E4M3, 2, 1, 4>(p, float_out, stream, pdl);
  } else if (p.m <= 32) {
    if (pairs && BITS != 8) {
      launch_tiles<BITS, E4M3, 4, 2, 2>(p, float_out, stream, pdl);
    } else if (pairs) {
      launch_tiles<BITS, E4M3, 4, 2, 4>(p, float_out, stream, pdl);
    } else {
      launch_tiles<BITS, E4M3, 4, 1, 4>(p, float_out, stream, pdl);
    }
  } else if (!pairs) {
    launch_tiles<BITS, E4M3, 8, 1, 2>(p, float_out, stream, pdl);
  } else if constexpr (BITS == 4) {
    launch_tiles<BITS, E4M3, 4, 2, 2>(p, float_out, stream, pdl);
  } else if constexpr (E4M3) {
    launch_tiles<BITS, E4M3, 8, 2, 2>(p, float_out, stream, pdl);
  } else {
    launch_tiles<BITS, E4M3, 8, 2, 4>(p, float_out, stream, pdl);
  }
}

// 1 or 2 tokens over integer weights (not e4m3), where x's int8 blocks fit 44 KiB of shared memory (the
// default 48 less the kernel's own partial sums; k up to 15,018 at two tokens, 30,037 at one): the dp4a
// kernel. The four products of an 8B layer, weights past L2, on an H200, dp4a against the tensor-core
// kernel: 4-bit 43.9 against 55.7 us at one token and 53.3 against 57.6 at two, 6-bit 62.9 against 78.2
// and 69.3 against 80.9, 8-bit 66.7 against 88.7 and 72.9 against 89.2; at four tokens the tensor-core
// kernel is faster (4-bit 57.7 us against 76.4). One row tile a block is the fastest of seven tilings.
// (exlcli/ops/cuda/limits.py's dp4a_takes is this rule for Python, which calls quant_heads_rope by it.)
bool takes_dp4a(const qlinear::Params& p, bool e4m3) {
  return !e4m3 && p.m <= qlinear::kDp4aMaxTokens &&
         qlinear::dp4a_smem_bytes(p.m, p.k) <= 44 * 1024;
}

// Weights of at most this many row tiles (o and down of the 8B shape: 4096 rows) take blocks of 16 warps
// with 2 chunks in flight each, the others 8 warps with 4. 16 warps against 8 (H200): down 12.4 us against
// 13.8 and o 5.2 against 5.3 at one 4-bit token, 16.9 against 18.6 and 6.7 against 7.3 at 6 bits, 18.0
// against 19.2 and 6.2 against 6.9 at 8, likewise at two tokens; the wider weights (q|k|v, gate|up) are
// slower so. Either adds a token's products in one fixed order.
constexpr int kDp4aWideMaxTiles = 256;

template <int BITS, int M>
void launch_dp4a_tokens(const qlinear::Params& p, bool float_out, cudaStream_t stream, bool pdl) {
  using qlinear::quant_gemv_dp4a_kernel;
  const int tiles = p.n / qlinear::kTileRows;
  const size_t smem = qlinear::dp4a_smem_bytes(M, p.k);
  if (float_out) {  // the LM head: many row tiles
    launch_pdl(quant_gemv_dp4a_kernel<BITS, M, 1, 4, true, 8>, dim3(tiles), dim3(8 * 32), smem, stream, pdl, p,
               qlinear::ConsecutiveTiles<1>{});
  } else if (tiles <= kDp4aWideMaxTiles) {
    launch_pdl(quant_gemv_dp4a_kernel<BITS, M, 1, 2, false, 16>, dim3(tiles), dim3(16 * 32), smem, stream, pdl, p,
               qlinear::ConsecutiveTiles<1>{});
  } else {
    launch_pdl(quant_gemv_dp4a_kernel<BITS, M, 1, 4, false, 8>, dim3(tiles), dim3(8 * 32), smem, stream, pdl, p,
               qlinear::ConsecutiveTiles<1>{});
  }
}

template <int BITS>
void launch_dp4a(const qlinear::Params& p, bool float_out, cudaStream_t stream, bool pdl) {
  static_assert(qlinear::kDp4aMaxTokens == 2, "one instantiation for each token count");
  if (p.m == 1) {
    launch_dp4a_tokens<BITS, 1>(p, float_out, stream, pdl);
  } else {
    launch_dp4a_tokens<BITS, 2>(p, float_out, stream, pdl);
  }
}

// A q|k|v weight's rows with rope.cu's step in the epilogue: block b takes the two row tiles of rows j and
// j + D/2 (j in 16 i .. 16 i + 15) of one head, so it holds both rows of every rotation pair. Each row's sum
// is the plain kernel's (the same warps and order), rounded to bf16 as that kernel stores it, then rotated
// and stored by rope_kv.cuh as rope.cu would: the same bytes as quant_linear then rope_and_write_kv. The
// weight may be a part of the q|k|v rows: whole heads from first_head on.
struct RopePairTiles {
  RopeKV rope;
  int pair_tiles;  // head_dim / 32: the tile pairs of a head
  int first_head;  // the q|k|v head of the weight's first rows

  __device__ __forceinline__ int tile(int r) const {
    const int head = blockIdx.x / pair_tiles;
    return head * 2 * pair_tiles + (blockIdx.x - head * pair_tiles) + r * pair_tiles;
  }

  template <bool FLOAT_OUT, int WARPS, int M>
  __device__ __forceinline__ void store(const qlinear::Params& p,
                                        const float (&partial)[WARPS][2][M][qlinear::kTileRows]) const {
    static_assert(!FLOAT_OUT, "rows rotated into bf16");
    for (int i = threadIdx.x; i < M * qlinear::kTileRows; i += WARPS * 32) {
      const int m = i / qlinear::kTileRows, row_in_tile = i % qlinear::kTileRows;
      const int ra = tile(0) * qlinear::kTileRows + row_in_tile, rb = tile(1) * qlinear::kTileRows + row_in_tile;
      float sa = 0.0f, sb = 0.0f;
#pragma unroll
      for (int w = 0; w < WARPS; ++w) {
        sa += partial[w][0][m][row_in_tile];
        sb += partial[w][1][m][row_in_tile];
      }
      if (p.bias != nullptr) {
        sa += __bfloat162float(p.bias[ra]);
        sb += __bfloat162float(p.bias[rb]);
      }
      const int local = ra / rope.head_dim, head = first_head + local, j = ra - local * rope.head_dim;
      store_rope_pair<__nv_bfloat16>(rope, head, j, m, round_to<__nv_bfloat16>(sa), round_to<__nv_bfloat16>(sb),
                                     rope_angle(rope, head, j, rope.positions[m]), rope.slots[m]);
    }
  }
};

template <int BITS, int M>
void launch_dp4a_rope(const qlinear::Params& p, const RopeKV& rope, int first_head, cudaStream_t stream, bool pdl) {
  // The warps of the plain kernel for this weight (launch_dp4a_tokens), so that each row's sum is the same chain
  // of additions; two row tiles a block, the rows j and j + D/2 of a head that the rotation pairs (the 8B
  // q|k|v at one 4-bit token: 6.7 us against 6.3 for one row tile a block, less than a rope kernel costs).
  const RopePairTiles tiles{rope, rope.head_dim / 32, first_head};
  const dim3 grid(p.n / (2 * qlinear::kTileRows));
  const size_t smem = qlinear::dp4a_smem_bytes(M, p.k);
  if (p.n / qlinear::kTileRows <= kDp4aWideMaxTiles) {
    launch_pdl(qlinear::quant_gemv_dp4a_kernel<BITS, M, 2, 2, false, 16, RopePairTiles>, grid, dim3(16 * 32), smem,
               stream, pdl, p, tiles);
  } else {
    launch_pdl(qlinear::quant_gemv_dp4a_kernel<BITS, M, 2, 4, false, 8, RopePairTiles>, grid, dim3(8 * 32), smem,
               stream, pdl, p, tiles);
  }
}

template <int BITS>
void launch_dp4a_rope_bits(const qlinear::Params& p, const RopeKV& rope, int first_head, cudaStream_t stream,
                           bool pdl) {
  if (p.m == 1) {
    launch_dp4a_rope<BITS, 1>(p, rope, first_head, stream, pdl);
  } else {
    launch_dp4a_rope<BITS, 2>(p, rope, first_head, stream, pdl);
  }
}

void launch_dp4a_rope_any(const qlinear::Params& p, const RopeKV& rope, int first_head, int64_t bits, bool pdl) {
  const cudaStream_t stream = current_stream();
  if (bits == 4) {
    launch_dp4a_rope_bits<4>(p, rope, first_head, stream, pdl);
  } else if (bits == 6) {
    launch_dp4a_rope_bits<6>(p, rope, first_head, stream, pdl);
  } else {
    launch_dp4a_rope_bits<8>(p, rope, first_head, stream, pdl);
  }
}

// The checks and Params of a product of x [m, k] bf16 by n packed rows (the output pointer unset).
qlinear::Params product_params(const char* op, const at::Tensor& x, const at::Tensor& qweight,
                               const at::Tensor& scales, int64_t bits, int64_t group, int64_t n,
                               const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.is_cuda(), op, ": x must be a CUDA tensor, got ", x.device());
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous() && aligned16(x.data_ptr()),
              op, ": x must be a contiguous, 16-byte aligned bfloat16 [m, k]");
  qlinear::Params p = packed_params(qweight, scales, bits, group, n, x.size(1));
  TORCH_CHECK(x.device() == qweight.device() && x.device() == scales.device(),
              op, ": x, qweight and scales must be on one device");
  if (bias.has_value()) {
    TORCH_CHECK(bias->is_cuda() && bias->dim() == 1 && bias->size(0) == n && bias->is_contiguous() &&
                    bias->scalar_type() == at::kBFloat16,
                op, ": bias must be a contiguous bfloat16 [", n, "]");
    p.bias = static_cast<const __nv_bfloat16*>(bias->data_ptr());
  }
  p.x = static_cast<const __nv_bfloat16*>(x.data_ptr());
  p.m = static_cast<int>(x.size(0));
  return p;
}

}  // namespace

at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales, int64_t bits,
                        bool e4m3, int64_t group, int64_t n, const std::optional<at::Tensor>& bias, bool float_out,
                        bool pdl) {
  qlinear::Params p = product_params("quant linear", x, qweight, scales, bits, group, n, bias);
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor out = at::empty({x.size(0), n}, x.options().dtype(float_out ? at::kFloat : at::kBFloat16));
  if (x.size(0) == 0) return out;
  p.out = out.data_ptr();
  const cudaStream_t stream = current_stream();
  TORCH_CHECK(!e4m3 || bits == 8, "quant linear: e4m3 weights take the 8-bit layout");
  if (takes_dp4a(p, e4m3)) {
    if (bits == 4) {
      launch_dp4a<4>(p, float_out, stream, pdl);
    } else if (bits == 6) {
      launch_dp4a<6>(p, float_out, stream, pdl);
    } else {
      launch_dp4a<8>(p, float_out, stream, pdl);
    }
  } else if (bits == 4) {
    launch<4, false>(p, float_out, stream, pdl);
  } else if (bits == 6) {
    launch<6, false>(p, float_out, stream, pdl);
  } else if (e4m3) {
    launch<8, true>(p, float_out, stream, pdl);
  } else {
    launch<8, false>(p, float_out, stream, pdl);
  }
  return out;
}

void quant_heads_rope(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales, int64_t bits,
                      int64_t group, int64_t n, const std::optional<at::Tensor>& bias, const at::Tensor& positions,
                      const at::Tensor& cos_sin, const at::Tensor& k_cache, const at::Tensor& v_cache,
                      const at::Tensor& slot_mapping, int64_t num_heads, int64_t first_head, const at::Tensor& q_out,
                      bool pdl) {
  const char* op = "quant_heads_rope";
  TORCH_CHECK(k_cache.dim() == 4, op, ": caches must be [pages, page_size, kv_heads, head_dim]");
  const int64_t dim = k_cache.size(3), all_rows = (num_heads + 2 * k_cache.size(2)) * dim;
  TORCH_CHECK(dim > 0 && first_head >= 0 && n % dim == 0 && first_head * dim + n <= all_rows, op,
              ": the weight's rows must be whole heads of the q|k|v rows");
  qlinear::Params p = product_params(op, x, qweight, scales, bits, group, n, bias);
  TORCH_CHECK(takes_dp4a(p, false), op, ": 1 or 2 tokens whose int8 blocks fit the dp4a kernel's shared memory");
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor q = q_out;
  const RopeKV rope = rope_kv_params(op, x.size(0), x.options(), all_rows, positions, cos_sin, k_cache, v_cache,
                                     slot_mapping, num_heads, q);
  if (x.size(0) > 0) launch_dp4a_rope_any(p, rope, static_cast<int>(first_head), bits, pdl);
}

at::Tensor quant_dequantize(const at::Tensor& qweight, const at::Tensor& scales, int64_t bits, bool e4m3,
                            int64_t group, int64_t n, int64_t k, bool pdl) {
  qlinear::Params p = packed_params(qweight, scales, bits, group, n, k);
  const c10::cuda::CUDAGuard guard(qweight.device());
  at::Tensor out = at::empty({n, k}, qweight.options().dtype(at::kBFloat16));
  const int warps = static_cast<int>((n / qlinear::kTileRows) * (k / qlinear::kChunk));
  auto* dense = static_cast<__nv_bfloat16*>(out.data_ptr());
  const cudaStream_t stream = current_stream();
  TORCH_CHECK(!e4m3 || bits == 8, "quant linear: e4m3 weights take the 8-bit layout");
  const dim3 grid((warps + 7) / 8), block(256);
  if (bits == 4) {
    launch_pdl(qlinear::dequantize_kernel<4, false>, grid, block, 0, stream, pdl, p, dense);
  } else if (bits == 6) {
    launch_pdl(qlinear::dequantize_kernel<6, false>, grid, block, 0, stream, pdl, p, dense);
  } else if (e4m3) {
    launch_pdl(qlinear::dequantize_kernel<8, true>, grid, block, 0, stream, pdl, p, dense);
  } else {
    launch_pdl(qlinear::dequantize_kernel<8, false>, grid, block, 0, stream, pdl, p, dense);
  }
  return out;
}

}  // namespace exlcli
