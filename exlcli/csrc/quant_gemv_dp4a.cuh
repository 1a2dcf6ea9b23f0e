// The product of 1 or 2 tokens (decode) over 4-, 6- and 8-bit weights in the packed layouts of
// quant_linear.cuh (not e4m3), on the CUDA cores: activations quantized to int8 in the kernel, integer
// dot products by dp4a.
//
// Why: at one token the tensor-core kernel uses one token column of the mma's eight and spends about
// two instructions a weight making bf16 pairs, so it is bound by issue, not by its loads
// (on an H200, 56 us a layer of the 8B shape against 39 us for its loads alone).
// Here 4 weights take a mask and a dp4a: a 32-bit word of the layout holds 4 weights of row g and 4 of
// row g + 8, and its low nibbles (w & 0x0F0F0F0F) are row g's in the byte order of features
// 16 t + 4 s + {0, 2, 1, 3}, its high nibbles row g + 8's in the same order. 6-bit words add the top
// bits from their plane with one rotation and one mask a row (the rotation that dequant6 uses puts a
// weight's top bits at bits 4-5 above its nibble, for every nibble at once). 8-bit words take one byte
// permute a row.
//
// Activations: each block quantizes x into shared memory once, in blocks of 16 features (the 16 that
// a lane reads in a chunk, so one weight group): xq = round(x * 127 / amax), d = amax / 127, with the
// block's sum of xq. For w = q s + o a lane's part of an output is then d * (s * sum q xq + o * sum xq),
// the integer sums exact: the exact product of the weights with the rounded x, so within the int8
// rounding of x (about 0.5% of the output's norm) of the product with x itself, as llama.cpp's CUDA
// and our CPU quantized products are. (The offset term over x itself would leave s * sum q (x - d xq),
// twice that error for weights centred on zero: measured 0.6-1.5% against 0.5%.)
//
// A token's result does not depend on the call's other tokens: its quantization, its integer sums
// and its fp32 steps are its own and in the same order whatever M is. The warps split a row tile's
// chunks as in quant_linear_kernel and their partial sums are added in warp order.
#pragma once

#include "quant_linear.cuh"

namespace exlcli {
namespace qlinear {

constexpr int kDp4aMaxTokens = 2;  // where it is faster than the tensor-core kernel (quant_linear.cu's takes_dp4a)
constexpr int kXBlock = 16;  // features per int8 activation block

// Shared memory of a block for M tokens of k features: the int8 blocks, then each block's (d, sum xq).
__host__ __device__ constexpr size_t dp4a_smem_bytes(int m, int k) {
  return static_cast<size_t>(m) * (k / kXBlock) * (sizeof(uint4) + sizeof(float2));
}

// Four int8 values as the bytes (a, b, c, d) from low to high.
__device__ __forceinline__ uint32_t pack_s8(int a, int b, int c, int d) {
  return __byte_perm(__byte_perm(a, b, 0x0040), __byte_perm(c, d, 0x0040), 0x5410);
}

// x [rows, k] bf16 -> the int8 blocks of every row: word s of block b holds features
// 16 b + 4 s + {0, 2, 1, 3}, the byte order of the weights' masked nibbles. Every thread must call it.
// (A row's blocks are its own: the same bytes whatever the count of rows.)
__device__ __forceinline__ void quantize_x16_rows(const __nv_bfloat16* __restrict__ x, int rows, int k, uint4* xq,
                                                  float2* xs) {
  const int blocks = k / kXBlock;
  for (int i = threadIdx.x; i < rows * blocks; i += blockDim.x) {
    const int token = i / blocks, b = i - token * blocks;
    const uint4* src = reinterpret_cast<const uint4*>(x + static_cast<size_t>(token) * k + kXBlock * b);
    const uint4 v[2] = {src[0], src[1]};
    float f[kXBlock];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const uint32_t w[4] = {v[h].x, v[h].y, v[h].z, v[h].w};
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        f[8 * h + 2 * j] = __uint_as_float(w[j] << 16);
        f[8 * h + 2 * j + 1] = __uint_as_float(w[j] & 0xFFFF0000u);
      }
    }
    // the largest |x| over bf16 pairs, a NaN kept (so it reaches the output: d is then NaN)
    __nv_bfloat162 top = __habs2(as_bf162(v[0].x));
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const uint32_t w[4] = {v[h].x, v[h].y, v[h].z, v[h].w};
#pragma unroll
      for (int j = h == 0 ? 1 : 0; j < 4; ++j) top = __hmax2_nan(top, __habs2(as_bf162(w[j])));
    }
    const float amax = __bfloat162float(__hmax_nan(top.x, top.y));
    // each step rounded on its own (no contraction), so torch's fp32 ops give the same integers
    const float inv = amax > 0.0f ? __fdiv_rn(127.0f, amax) : 0.0f;
    int q[kXBlock], sum = 0;
#pragma unroll
    for (int j = 0; j < kXBlock; ++j) {
      q[j] = __float2int_rn(__fmul_rn(f[j], inv));
      sum += q[j];
    }
    xq[i] = make_uint4(pack_s8(q[0], q[2], q[1], q[3]), pack_s8(q[4], q[6], q[5], q[7]),
                       pack_s8(q[8], q[10], q[9], q[11]), pack_s8(q[12], q[14], q[13], q[15]));
    xs[i] = make_float2(__fdiv_rn(amax, 127.0f), static_cast<float>(sum));
  }
}

// quantize_x16_rows of M tokens.
template <int M>
__device__ void quantize_x16(const __nv_bfloat16* __restrict__ x, int k, uint4* xq, float2* xs) {
  quantize_x16_rows(x, M, k, xq, xs);
}

// sum of the 4 products of unsigned bytes a and signed bytes b, plus c
__device__ __forceinline__ int dp4a_us(uint32_t a, uint32_t b, int c) {
  int d;
  asm("dp4a.u32.s32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
}

// The weights (unsigned bytes) of rows g (lo) and g + 8 (hi) in k-step `step` of a loaded chunk, in the
// byte order of features 16 t + 4 step + {0, 2, 1, 3}. 8-bit words hold row g's features {0, 1} in bytes
// 0-1 of the first and {2, 3} in bytes 0-1 of the second (row g + 8 in bytes 2-3): one byte permute a row.
template <int BITS>
__device__ __forceinline__ void step_bytes(const ChunkLoad<BITS>& c, int step, uint32_t& lo, uint32_t& hi) {
  if constexpr (BITS == 8) {
    const uint4& h = step < 2 ? c.q0 : c.q1;
    const uint32_t w0 = (step & 1) ? h.z : h.x, w1 = (step & 1) ? h.w : h.y;
    lo = __byte_perm(w0, w1, 0x5140);
    hi = __byte_perm(w0, w1, 0x7362);
  } else {
    const uint32_t word = step == 0 ? c.q.x : step == 1 ? c.q.y : step == 2 ? c.q.z : c.q.w;
    lo = word & 0x0F0F0F0Fu;
    hi = (word >> 4) & 0x0F0F0F0Fu;
    if constexpr (BITS == 6) {
      const uint32_t top = step < 2 ? c.top.x : c.top.y;
      const int shift = 2 * (step & 1);
      lo |= __funnelshift_r(top, top, shift) & 0x30303030u;
      hi |= __funnelshift_r(top, top, shift + 4) & 0x30303030u;
    }
  }
}

// (scale, offset) of a row: a bf16 pair for 4- and 6-bit weights, an fp16 pair for 8-bit ones (the
// scale in the low half).
template <int BITS>
__device__ __forceinline__ float2 row_affine(uint32_t pair) {
  if constexpr (BITS == 8) {
    return __half22float2(*reinterpret_cast<const __half2*>(&pair));
  } else {
    return make_float2(__uint_as_float(pair << 16), __uint_as_float(pair & 0xFFFF0000u));
  }
}

// Block b takes row tiles b RT .. b RT + RT - 1 and stores their rows as they are (store_output).
template <int RT>
struct ConsecutiveTiles {
  __device__ __forceinline__ int tile(int r) const { return blockIdx.x * RT + r; }

  template <bool FLOAT_OUT, int WARPS, int M>
  __device__ __forceinline__ void store(const Params& p, const float (&partial)[WARPS][RT][M][kTileRows]) const {
    for (int i = threadIdx.x; i < RT * M * kTileRows; i += WARPS * 32) {
      const int r = i / (M * kTileRows), m = (i / kTileRows) % M, row_in_tile = i % kTileRows;
      float sum = 0.0f;
#pragma unroll
      for (int w = 0; w < WARPS; ++w) sum += partial[w][r][m][row_in_tile];
      store_output<FLOAT_OUT>(p, m, tile(r) * kTileRows + row_in_tile, sum);
    }
  }
};

// The body of a block: RT row tiles a block share the activations a warp reads from shared memory; WARPS
// warps split a row tile's chunks, UNROLL chunks of each warp's in flight (a ring: a chunk's slot is loaded
// again right after it is computed). A device function so that kernels which pick a block's weights and
// rows first (moe.cu: each block's expert and token) run the same sequence of operations.
template <int BITS, int M, int RT, int UNROLL, bool FLOAT_OUT, int WARPS, typename Tiles>
__device__ __forceinline__ void dp4a_gemv(const Params& p, const Tiles& tiles) {
  static_assert(BITS == 4 || BITS == 6 || BITS == 8, "the integer layouts (not e4m3)");
  extern __shared__ uint4 s_x[];
  __shared__ float partial[WARPS][RT][M][kTileRows];
  const int blocks = p.k / kXBlock;
  uint4* xq = s_x;
  float2* xs = reinterpret_cast<float2*>(s_x + M * blocks);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, t = lane & 3;
  const int chunks = p.k / kChunk;
  const int mine = (chunks - warp + WARPS - 1) / WARPS;  // this warp's chunks: warp, warp + WARPS, ...

  ChunkLoad<BITS> ring[UNROLL][RT];
#pragma unroll
  for (int u = 0; u < UNROLL; ++u) {
    if (u < mine) {
#pragma unroll
      for (int r = 0; r < RT; ++r) load_chunk<BITS>(p, tiles.tile(r), warp + u * WARPS, lane, ring[u][r]);
    }
  }
  grid_dependency_wait();  // x is the previous kernel's output
  quantize_x16<M>(p.x, p.k, xq, xs);
  __syncthreads();

  float y[RT][M][2];
#pragma unroll
  for (int r = 0; r < RT; ++r) {
#pragma unroll
    for (int m = 0; m < M; ++m) y[r][m][0] = y[r][m][1] = 0.0f;
  }
  for (int base = 0; base < mine; base += UNROLL) {
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int i = base + u;
      if (i >= mine) break;
      const int chunk = warp + i * WARPS;
      const int b = chunk * (kChunk / kXBlock) + t;  // the lane's 16 features
      uint4 xw[M];
      float2 ds[M];
#pragma unroll
      for (int m = 0; m < M; ++m) {
        xw[m] = xq[m * blocks + b];
        ds[m] = xs[m * blocks + b];
      }
#pragma unroll
      for (int r = 0; r < RT; ++r) {
        int dot_lo[M], dot_hi[M];
#pragma unroll
        for (int m = 0; m < M; ++m) dot_lo[m] = dot_hi[m] = 0;
#pragma unroll
        for (int step = 0; step < 4; ++step) {
          uint32_t lo, hi;
          step_bytes<BITS>(ring[u][r], step, lo, hi);
#pragma unroll
          for (int m = 0; m < M; ++m) {
            const uint32_t xv = step == 0 ? xw[m].x : step == 1 ? xw[m].y : step == 2 ? xw[m].z : xw[m].w;
            dot_lo[m] = dp4a_us(lo, xv, dot_lo[m]);
            dot_hi[m] = dp4a_us(hi, xv, dot_hi[m]);
          }
        }
        const float2 a_lo = row_affine<BITS>(ring[u][r].lo), a_hi = row_affine<BITS>(ring[u][r].hi);
#pragma unroll
        for (int m = 0; m < M; ++m) {
          y[r][m][0] = fmaf(ds[m].x, fmaf(a_lo.x, static_cast<float>(dot_lo[m]), a_lo.y * ds[m].y), y[r][m][0]);
          y[r][m][1] = fmaf(ds[m].x, fmaf(a_hi.x, static_cast<float>(dot_hi[m]), a_hi.y * ds[m].y), y[r][m][1]);
        }
      }
      if (i + UNROLL < mine) {
#pragma unroll
        for (int r = 0; r < RT; ++r) load_chunk<BITS>(p, tiles.tile(r), chunk + UNROLL * WARPS, lane, ring[u][r]);
      }
    }
  }
  grid_dependents_launch();

  // the 4 lanes of a row (t = 0..3) hold its 4 slices of 16 features of each chunk
#pragma unroll
  for (int r = 0; r < RT; ++r) {
#pragma unroll
    for (int m = 0; m < M; ++m) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float v = y[r][m][e];
        v += __shfl_xor_sync(0xFFFFFFFFu, v, 1);
        v += __shfl_xor_sync(0xFFFFFFFFu, v, 2);
        if (t == 0) partial[warp][r][m][g + 8 * e] = v;
      }
    }
  }
  __syncthreads();
  tiles.template store<FLOAT_OUT>(p, partial);
}

template <int BITS, int M, int RT, int UNROLL, bool FLOAT_OUT, int WARPS = kWarps, typename Tiles = ConsecutiveTiles<RT>>
__global__ void __launch_bounds__(WARPS * 32) quant_gemv_dp4a_kernel(Params p, Tiles tiles) {
  dp4a_gemv<BITS, M, RT, UNROLL, FLOAT_OUT, WARPS>(p, tiles);
}

}  // namespace qlinear
}  // namespace exlcli
