// FP8 x FP8 products for 5 to 16 tokens (on Hopper 5 to 8; fp8_gemm.cu takes more) on the tensor
// cores (mma.sync m16n8k32 e4m3, fp32 accumulate, sm_89+): y = (xq @ w^T) * x_scale[token] * w_scale[row] (+ bias), bf16 out, for
// activations quantized per token (fp8_quant.cu) and e4m3 weights [n, k] kept row-major with a
// scale per row (exlcli/ops/formats/cuda_fp8.py).
//
// The blocking, the streaming weight loads and the warps' final sums are quant_linear.cuh's: a block computes RT tiles of 16 rows for up to 8 * NT
// tokens; its 8 warps split the input features in chunks of 64 (warp w takes chunks w, w + 8, ...)
// and add their partial sums in a fixed order, so a token's result does not depend on the other
// tokens of the call. Inside a chunk, thread t of a fragment reads the 16 consecutive features
// 16 t .. 16 t + 15 of its weight rows (g and g + 8) and of its token, one 16-byte load each; the
// mma's k order is a permutation of the features, the same for both operands: k-step s (0, 1) of
// the chunk takes the thread's words 2 s and 2 s + 1 as its columns 4 t .. 4 t + 3 and
// 16 + 4 t .. 16 + 4 t + 3. So the weights need no repacking: the layout is the checkpoint's.
#include <ATen/ops/empty.h>
#include <cuda_runtime.h>

#include "common.cuh"
#include "fp8_operands.h"
#include "ops.h"
#include "quant_linear.cuh"

namespace exlcli {
namespace {

using qlinear::kChunk;
using qlinear::kTileRows;
using qlinear::kWarps;
using qlinear::mma_e4m3;

struct Fp8Params : Fp8Operands {
  __nv_bfloat16* out;  // [m, n]
};

template <int NT, int RT, int UNROLL>
__global__ void __launch_bounds__(kWarps * 32) fp8_linear_kernel(Fp8Params p) {
  __shared__ float partial[kWarps][NT][4][32];
  const int tile0 = blockIdx.x * RT;
  const int token0 = blockIdx.y * 8 * NT;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, t = lane & 3;
  const int chunks = p.k / kChunk;

  float acc[RT][NT][4];
#pragma unroll
  for (int r = 0; r < RT; ++r)
#pragma unroll
    for (int j = 0; j < NT; ++j) acc[r][j][0] = acc[r][j][1] = acc[r][j][2] = acc[r][j][3] = 0.0f;

  for (int first = warp; first < chunks; first += kWarps * UNROLL) {
    uint4 wl[UNROLL][RT][2];  // rows g and g + 8 of each row tile
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int chunk = first + u * kWarps;
      if (chunk < chunks) {
#pragma unroll
        for (int r = 0; r < RT; ++r) {
          const uint8_t* row = p.w + static_cast<size_t>((tile0 + r) * kTileRows + g) * p.k + chunk * kChunk + 16 * t;
          wl[u][r][0] = qlinear::load_streaming(reinterpret_cast<const uint4*>(row));
          wl[u][r][1] = qlinear::load_streaming(reinterpret_cast<const uint4*>(row + static_cast<size_t>(8) * p.k));
        }
      }
    }
    if (first == warp) grid_dependency_wait();  // xq is the previous kernel's output
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int chunk = first + u * kWarps;
      if (chunk >= chunks) break;
      uint4 xv[NT];
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        const int token = token0 + 8 * j + g;
        xv[j] = token < p.m ? *reinterpret_cast<const uint4*>(p.xq + static_cast<size_t>(token) * p.k +
                                                              chunk * kChunk + 16 * t)
                            : make_uint4(0, 0, 0, 0);
      }
#pragma unroll
      for (int r = 0; r < RT; ++r) {
        const uint4& lo = wl[u][r][0];
        const uint4& hi = wl[u][r][1];
#pragma unroll
        for (int j = 0; j < NT; ++j) {
          mma_e4m3(acc[r][j], lo.x, hi.x, lo.y, hi.y, xv[j].x, xv[j].y);
          mma_e4m3(acc[r][j], lo.z, hi.z, lo.w, hi.w, xv[j].z, xv[j].w);
        }
      }
    }
  }

  grid_dependency_wait();  // (warps without a chunk) before anything is written
  grid_dependents_launch();
  qlinear::add_warp_partials<RT, NT>(acc, partial, token0, p.m, [&](int token, int r, int row_in_tile, float sum) {
    const int row = (tile0 + r) * kTileRows + row_in_tile;
    float v = sum * (p.x_scale[token] * p.w_scale[row]);
    if (p.bias != nullptr) v += __bfloat162float(p.bias[row]);
    p.out[static_cast<size_t>(token) * p.n + row] = __float2bfloat16_rn(v);
  });
}

template <int NT, int RT, int UNROLL>
void launch_tiles(const Fp8Params& p, cudaStream_t stream, bool pdl) {
  const dim3 grid(p.n / (kTileRows * RT), (p.m + 8 * NT - 1) / (8 * NT));
  launch_pdl(fp8_linear_kernel<NT, RT, UNROLL>, grid, dim3(kWarps * 32), 0, stream, pdl, p);
}

// The smallest token tile that covers m (more blocks in y beyond 64 tokens); up to 16 tokens one row
// tile a block with 4 chunks in flight per warp, beyond two row tiles sharing each activation load.
void launch(const Fp8Params& p, cudaStream_t stream, bool pdl) {
  const bool pairs = (p.n / kTileRows) % 2 == 0;
  if (p.m <= 8) {
    launch_tiles<1, 1, 4>(p, stream, pdl);
  } else if (p.m <= 16) {
    launch_tiles<2, 1, 4>(p, stream, pdl);
  } else if (p.m <= 32) {
    if (pairs) {
      launch_tiles<4, 2, 2>(p, stream, pdl);
    } else {
      launch_tiles<4, 1, 4>(p, stream, pdl);
    }
  } else if (pairs) {
    launch_tiles<8, 2, 2>(p, stream, pdl);
  } else {
    launch_tiles<8, 1, 2>(p, stream, pdl);
  }
}

}  // namespace

at::Tensor fp8_linear(const at::Tensor& xq, const at::Tensor& x_scale, const at::Tensor& weight,
                      const at::Tensor& w_scale, const std::optional<at::Tensor>& bias, bool pdl) {
  const Fp8Operands ops = check_fp8_operands("fp8 linear", xq, x_scale, weight, w_scale, bias);
  TORCH_CHECK(ops.n % kTileRows == 0 && ops.k % kChunk == 0 && ops.n > 0,
              "fp8 linear: n must be a multiple of 16 and k of 64");
  const c10::cuda::CUDAGuard guard(xq.device());
  at::Tensor out = at::empty({ops.m, ops.n}, xq.options().dtype(at::kBFloat16));
  if (ops.m == 0) return out;
  Fp8Params p{ops, static_cast<__nv_bfloat16*>(out.data_ptr())};
  launch(p, current_stream(), pdl);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

}  // namespace exlcli
