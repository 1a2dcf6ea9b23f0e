// Linear layers over weights kept quantized: 4-, 6- or 8-bit integers q in groups of G weights along
// each row, w = q * scale + offset per (row, group). Every GGUF and GPTQ/AWQ format of the
// weight-format table whose weights have that form is repacked into this layout at load
// (exlcli/ops/formats/cuda_groups.py, which also holds the torch reference of the layout).
//
// The product runs on the tensor cores (mma.sync m16n8k16, bf16 in, fp32 accumulate): a block
// computes RT tiles of 16 output features ("row tiles") for up to 8 * NT tokens; its 8 warps split the
// input features in chunks of 64 (warp w takes chunks w, w + 8, ...) and add their partial sums in a
// fixed order, so a token's result does not depend on how many tokens share the call.
//
// Packed layout (what the pack in cuda_groups.py writes; "lane" is the thread of the warp, g = lane
// / 4 and t = lane % 4 its place in the mma fragments):
// - Inside a chunk of 64 input features, thread t of a fragment reads the 16 consecutive features
//   16 t .. 16 t + 15. The mma's k order is a permutation of the features (the same for weights and
//   activations, so the dot product is unchanged): in k-step s (0..3) the fragment's columns 2t, 2t+1
//   are features 16 t + 4 s + {0, 1} and its columns 2t + 8, 2t + 9 are features 16 t + 4 s + {2, 3}.
//   Each thread's activations are then two 16-byte loads per token.
// - 4-bit: one uint32 per (row tile, chunk, lane, k-step) holding the thread's 8 fragment weights;
//   fragment register p (0..3: rows g, g + 8, g, g + 8; columns low, low, high, high) takes nibbles
//   at bits 4 p and 16 + 4 p, so one shift and mask gives a bf16 pair. A chunk is [32 lanes][4 steps].
// - 6-bit (the 5- and 6-bit GGUF types): the 4-bit words of q's low 4 bits, then a plane of q's top 2
//   bits: a chunk is [32 lanes][4 steps] low words, then [32 lanes][2 words], word h holding steps 2 h
//   and 2 h + 1. The 2 bits of the weight that the low word has at bit b = 4 p + 16 e (e: the pair's
//   half) sit at bit (b + 4 + 2 (step % 2)) mod 32 of it, so rotating the word right by 4 p + 2 (step % 2)
//   puts them at bits 4-5 of the same half (one shift, one mask, one OR a register of pairs).
// - 8-bit: two uint32 per (row tile, chunk, lane, k-step), bytes in fragment order (register p's
//   two weights are bytes 2 p and 2 p + 1). A chunk is [2 halves (steps 0-1, 2-3)][32 lanes][4 words].
// - Scales: per (row tile, group, row of the tile): (scale, offset) as a bf16 pair for 4- and 6-bit
//   weights (the bf16 arithmetic of their dequantization), as an fp16 pair for 8-bit ones (computed
//   in fp32; fp16 holds the GGUF and GPTQ scales as their files do). FP8 (e4m3) weights take the
//   8-bit layout with an fp32 scale * 2^120 in the slot (see e4m3_value).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "pdl.cuh"

namespace exlcli {
namespace qlinear {

constexpr int kTileRows = 16;   // output features per block
constexpr int kChunk = 64;      // input features per chunk
constexpr int kWarps = 8;       // warps per block, splitting the chunks of a row tile
constexpr int kMaxTileTokens = 64;  // 8 * NT tokens at most per block (NT <= 8)

struct Params {
  const __nv_bfloat16* x;  // [m, k], rows 16-byte aligned
  const uint32_t* qweight;  // packed, see above
  const uint32_t* scales;   // a bf16 (4-bit) or fp16 (8-bit) pair per (row tile, group, row)
  const __nv_bfloat16* bias;  // [n] or null
  void* out;                // [m, n] bf16, or fp32 when float_out
  int m, n, k;
  int group_log2;           // log2 of the group size (4 .. 7)
};

// Output `row` of `token`: the sum plus the bias, as bf16 or (FLOAT_OUT) fp32.
template <bool FLOAT_OUT>
__device__ __forceinline__ void store_output(const Params& p, int token, int row, float sum) {
  if (p.bias != nullptr) sum += __bfloat162float(p.bias[row]);
  const size_t at = static_cast<size_t>(token) * p.n + row;
  if constexpr (FLOAT_OUT) {
    static_cast<float*>(p.out)[at] = sum;
  } else {
    static_cast<__nv_bfloat16*>(p.out)[at] = __float2bfloat16_rn(sum);
  }
}

__device__ __forceinline__ uint4 load_streaming(const uint4* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

__device__ __forceinline__ uint2 load_streaming(const uint2* p) {
  uint2 v;
  asm volatile("ld.global.nc.L1::no_allocate.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p));
  return v;
}

__device__ __forceinline__ void mma_bf16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// e4m3 x e4m3 on the tensor cores (sm_89+), fp32 accumulate: a0..a3 the A fragment (16 x 32), b0, b1 the B one.
__device__ __forceinline__ void mma_e4m3(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint32_t b0, uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#else
  __trap();  // the Python side runs the FP8 x FP8 kernels only on sm_89 and newer
#endif
}

__device__ __forceinline__ uint32_t as_u32(__nv_bfloat162 v) { return *reinterpret_cast<uint32_t*>(&v); }
__device__ __forceinline__ __nv_bfloat162 as_bf162(uint32_t v) { return *reinterpret_cast<__nv_bfloat162*>(&v); }

// The scale and offset of one row for 4-bit weights, each as a bf16 pair (both halves equal).
struct Affine4 {
  __nv_bfloat162 scale, offset;
};

__device__ __forceinline__ Affine4 affine4(uint32_t packed) {
  const __nv_bfloat162 so = as_bf162(packed);
  return {__bfloat162bfloat162(so.x), __bfloat162bfloat162(so.y)};
}

// 4-bit: the 4 fragment registers of one k-step from its word. 0x4300 | q is the bf16 of 128 + q
// (q < 16 sits in the mantissa), so subtracting 128 gives q exactly; then one rounding of q*s + o.
__device__ __forceinline__ void dequant4(uint32_t word, const Affine4& lo, const Affine4& hi, uint32_t (&a)[4]) {
  const __nv_bfloat162 magic = as_bf162(0x43004300u);
#pragma unroll
  for (int p = 0; p < 4; ++p) {
    const uint32_t v = ((word >> (4 * p)) & 0x000F000Fu) | 0x43004300u;
    const __nv_bfloat162 q = __hsub2(as_bf162(v), magic);
    const Affine4& r = (p & 1) ? hi : lo;
    a[p] = as_u32(__hfma2(q, r.scale, r.offset));
  }
}

// 6-bit: as 4-bit with q's top 2 bits ORed in at bits 4-5 of each half (0x4300 | q is 128 + q for q < 128).
// `high` is the step's word of the top-bit plane, rotated by 2 for odd steps (see the layout above).
template <int STEP_SHIFT>
__device__ __forceinline__ void dequant6(uint32_t word, uint32_t high, const Affine4& lo, const Affine4& hi,
                                         uint32_t (&a)[4]) {
  const __nv_bfloat162 magic = as_bf162(0x43004300u);
#pragma unroll
  for (int p = 0; p < 4; ++p) {
    const uint32_t top = __funnelshift_r(high, high, 4 * p + STEP_SHIFT) & 0x00300030u;
    const uint32_t v = ((word >> (4 * p)) & 0x000F000Fu) | top | 0x43004300u;
    const __nv_bfloat162 q = __hsub2(as_bf162(v), magic);
    const Affine4& r = (p & 1) ? hi : lo;
    a[p] = as_u32(__hfma2(q, r.scale, r.offset));
  }
}

// 8-bit: 0x4B000000 | q is the float 2^23 + q; the affine step in fp32, one rounding to bf16.
__device__ __forceinline__ float byte_value(uint32_t word, int byte) {
  return __uint_as_float(((word >> (8 * byte)) & 0xFFu) | 0x4B000000u) - 8388608.0f;
}

__device__ __forceinline__ void dequant8(uint32_t w0, uint32_t w1, float2 lo, float2 hi, uint32_t (&a)[4]) {
  a[0] = as_u32(__floats2bfloat162_rn(fmaf(byte_value(w0, 0), lo.x, lo.y), fmaf(byte_value(w0, 1), lo.x, lo.y)));
  a[1] = as_u32(__floats2bfloat162_rn(fmaf(byte_value(w0, 2), hi.x, hi.y), fmaf(byte_value(w0, 3), hi.x, hi.y)));
  a[2] = as_u32(__floats2bfloat162_rn(fmaf(byte_value(w1, 0), lo.x, lo.y), fmaf(byte_value(w1, 1), lo.x, lo.y)));
  a[3] = as_u32(__floats2bfloat162_rn(fmaf(byte_value(w1, 2), hi.x, hi.y), fmaf(byte_value(w1, 3), hi.x, hi.y)));
}

// e4m3 (FP8 weights): the byte's sign, exponent and mantissa placed in a float's are the value times
// 2^-120 (for subnormals too, as the float is then subnormal); the scale slot holds scale * 2^120.
__device__ __forceinline__ float e4m3_value(uint32_t word, int byte) {
  const uint32_t b = (word >> (8 * byte)) & 0xFFu;
  return __uint_as_float(((b & 0x80u) << 24) | ((b & 0x7Fu) << 20));
}

__device__ __forceinline__ void dequant_e4m3(uint32_t w0, uint32_t w1, float lo, float hi, uint32_t (&a)[4]) {
  a[0] = as_u32(__floats2bfloat162_rn(e4m3_value(w0, 0) * lo, e4m3_value(w0, 1) * lo));
  a[1] = as_u32(__floats2bfloat162_rn(e4m3_value(w0, 2) * hi, e4m3_value(w0, 3) * hi));
  a[2] = as_u32(__floats2bfloat162_rn(e4m3_value(w1, 0) * lo, e4m3_value(w1, 1) * lo));
  a[3] = as_u32(__floats2bfloat162_rn(e4m3_value(w1, 2) * hi, e4m3_value(w1, 3) * hi));
}

// What one warp loads for one chunk before computing it.
template <int BITS>
struct ChunkLoad;

template <>
struct ChunkLoad<4> {
  uint4 q;          // the 4 k-steps' words
  uint32_t lo, hi;  // (scale, offset) of rows g and g + 8
};

template <>
struct ChunkLoad<6> {
  uint4 q;          // the 4 k-steps' low words
  uint2 top;        // the top-bit words of steps 0-1 and 2-3
  uint32_t lo, hi;
};

template <>
struct ChunkLoad<8> {
  uint4 q0, q1;  // steps 0-1 and 2-3
  uint32_t lo, hi;
};

template <int BITS>
__device__ __forceinline__ void load_chunk(const Params& p, int tile, int chunk, int lane, ChunkLoad<BITS>& c) {
  const int chunks = p.k / kChunk;
  const int groups = p.k >> p.group_log2;
  const int g = lane >> 2, t = lane & 3;
  const int group = (chunk * kChunk + 16 * t) >> p.group_log2;
  const size_t scale_at = (static_cast<size_t>(tile) * groups + group) * kTileRows + g;
  if constexpr (BITS == 4) {
    const uint4* q = reinterpret_cast<const uint4*>(p.qweight) + (static_cast<size_t>(tile) * chunks + chunk) * 32;
    c.q = load_streaming(q + lane);
    c.lo = __ldg(p.scales + scale_at);
    c.hi = __ldg(p.scales + scale_at + 8);
  } else if constexpr (BITS == 6) {
    const uint4* q = reinterpret_cast<const uint4*>(p.qweight) + (static_cast<size_t>(tile) * chunks + chunk) * 48;
    c.q = load_streaming(q + lane);
    c.top = load_streaming(reinterpret_cast<const uint2*>(q + 32) + lane);
    c.lo = __ldg(p.scales + scale_at);
    c.hi = __ldg(p.scales + scale_at + 8);
  } else {
    const uint4* q = reinterpret_cast<const uint4*>(p.qweight) + (static_cast<size_t>(tile) * chunks + chunk) * 64;
    c.q0 = load_streaming(q + lane);
    c.q1 = load_streaming(q + 32 + lane);
    c.lo = __ldg(p.scales + scale_at);
    c.hi = __ldg(p.scales + scale_at + 8);
  }
}

// The fragments of k-step `step` of a loaded chunk (E4M3: 8-bit FP8 weights, whose scale slot is
// one fp32, not an fp16 pair).
template <int BITS, bool E4M3>
__device__ __forceinline__ void chunk_step(const ChunkLoad<BITS>& c, int step, uint32_t (&a)[4]) {
  if constexpr (BITS == 4) {
    const uint32_t word = step == 0 ? c.q.x : step == 1 ? c.q.y : step == 2 ? c.q.z : c.q.w;
    dequant4(word, affine4(c.lo), affine4(c.hi), a);
  } else if constexpr (BITS == 6) {
    const uint32_t word = step == 0 ? c.q.x : step == 1 ? c.q.y : step == 2 ? c.q.z : c.q.w;
    const uint32_t top = step < 2 ? c.top.x : c.top.y;
    if (step & 1) {
      dequant6<2>(word, top, affine4(c.lo), affine4(c.hi), a);
    } else {
      dequant6<0>(word, top, affine4(c.lo), affine4(c.hi), a);
    }
  } else if constexpr (E4M3) {
    const uint4& h = step < 2 ? c.q0 : c.q1;
    const float lo = __uint_as_float(c.lo), hi = __uint_as_float(c.hi);
    if (step & 1) {
      dequant_e4m3(h.z, h.w, lo, hi, a);
    } else {
      dequant_e4m3(h.x, h.y, lo, hi, a);
    }
  } else {
    const uint4& h = step < 2 ? c.q0 : c.q1;
    const float2 lo = __half22float2(*reinterpret_cast<const __half2*>(&c.lo));
    const float2 hi = __half22float2(*reinterpret_cast<const __half2*>(&c.hi));
    if (step & 1) {
      dequant8(h.z, h.w, lo, hi, a);
    } else {
      dequant8(h.x, h.y, lo, hi, a);
    }
  }
}

// The end of a tile kernel (here and in fp8_linear.cu): the 8 warps' partial sums of each output,
// added in warp order (so a token's result does not depend on the call's other tokens), handed to
// write(token, row tile r, row within the tile, sum) for every token below m. Accumulator e of lane
// (g, t) is row g + 8 (e / 2) of the tile and token 2 t + e % 2 of its group of 8.
template <int RT, int NT, typename Write>
__device__ __forceinline__ void add_warp_partials(const float (&acc)[RT][NT][4], float (&partial)[kWarps][NT][4][32],
                                                  int token0, int m, Write&& write) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
#pragma unroll
  for (int r = 0; r < RT; ++r) {
    if (r > 0) __syncthreads();  // the previous row tile's sums are read
#pragma unroll
    for (int j = 0; j < NT; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) partial[warp][j][e][lane] = acc[r][j][e];
    }
    __syncthreads();
    for (int i = threadIdx.x; i < NT * 4 * 32; i += kWarps * 32) {
      const int j = i / 128, e = (i / 32) % 4, l = i % 32;
      const int token = token0 + 8 * j + 2 * (l & 3) + (e & 1);
      if (token >= m) continue;
      float sum = 0.0f;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) sum += partial[w][j][e][l];
      write(token, r, (l >> 2) + 8 * (e >> 1), sum);
    }
  }
}

// RT row tiles per block share each activation fragment a warp loads (for many tokens the
// activations, read again for every row tile, otherwise cost more L2 traffic than the weights);
// UNROLL chunks of each row tile are loaded before they are computed.
template <int BITS, bool E4M3, int NT, int RT, int UNROLL, bool FLOAT_OUT>
__global__ void __launch_bounds__(kWarps * 32) quant_linear_kernel(Params p) {
  __shared__ float partial[kWarps][NT][4][32];
  const int tile0 = blockIdx.x * RT;
  const int token0 = blockIdx.y * 8 * NT;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, t = lane & 3;
  const int chunks = p.k / kChunk;

  float acc[RT][NT][4];
#pragma unroll
  for (int r = 0; r < RT; ++r) {
#pragma unroll
    for (int j = 0; j < NT; ++j) acc[r][j][0] = acc[r][j][1] = acc[r][j][2] = acc[r][j][3] = 0.0f;
  }

  for (int first = warp; first < chunks; first += kWarps * UNROLL) {
    ChunkLoad<BITS> loads[UNROLL][RT];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int chunk = first + u * kWarps;
      if (chunk < chunks) {
#pragma unroll
        for (int r = 0; r < RT; ++r) load_chunk<BITS>(p, tile0 + r, chunk, lane, loads[u][r]);
      }
    }
    if (first == warp) grid_dependency_wait();  // x is the previous kernel's output
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int chunk = first + u * kWarps;
      if (chunk >= chunks) break;
      uint4 xv[NT][2];
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        const int token = token0 + 8 * j + g;
        if (token < p.m) {
          const uint4* xp = reinterpret_cast<const uint4*>(p.x + static_cast<size_t>(token) * p.k + chunk * kChunk +
                                                           16 * t);
          xv[j][0] = xp[0];
          xv[j][1] = xp[1];
        } else {
          xv[j][0] = xv[j][1] = make_uint4(0, 0, 0, 0);
        }
      }
#pragma unroll
      for (int step = 0; step < 4; ++step) {
#pragma unroll
        for (int r = 0; r < RT; ++r) {
          uint32_t a[4];
          chunk_step<BITS, E4M3>(loads[u][r], step, a);
#pragma unroll
          for (int j = 0; j < NT; ++j) {
            const uint4& v = xv[j][step >> 1];
            mma_bf16(acc[r][j], a, (step & 1) ? v.z : v.x, (step & 1) ? v.w : v.y);
          }
        }
      }
    }
  }

  grid_dependency_wait();  // (warps without a chunk) before anything is written
  grid_dependents_launch();
  add_warp_partials<RT, NT>(acc, partial, token0, p.m, [&](int token, int r, int row_in_tile, float sum) {
    store_output<FLOAT_OUT>(p, token, (tile0 + r) * kTileRows + row_in_tile, sum);
  });
}

// The dense bf16 weight [n, k] of the packed one (for products of many tokens through cuBLAS): one
// warp per (row tile, chunk), each thread writing its 16 consecutive features of rows g and g + 8.
template <int BITS, bool E4M3>
__global__ void __launch_bounds__(256) dequantize_kernel(Params p, __nv_bfloat16* __restrict__ out) {
  const int warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5, lane = threadIdx.x & 31;
  const int chunks = p.k / kChunk;
  const int tiles = p.n / kTileRows;
  if (warp >= tiles * chunks) return;
  const int tile = warp / chunks, chunk = warp % chunks;
  const int g = lane >> 2, t = lane & 3;
  ChunkLoad<BITS> c;
  load_chunk<BITS>(p, tile, chunk, lane, c);
  grid_dependency_wait();  // before the first write
  uint32_t lo[8], hi[8];  // bf16 pairs of features 16 t + 4 s + {0,1} (even) and {2,3} (odd), rows g and g + 8
#pragma unroll
  for (int step = 0; step < 4; ++step) {
    uint32_t a[4];
    chunk_step<BITS, E4M3>(c, step, a);
    lo[2 * step] = a[0];
    hi[2 * step] = a[1];
    lo[2 * step + 1] = a[2];
    hi[2 * step + 1] = a[3];
  }
  const size_t col = static_cast<size_t>(chunk) * kChunk + 16 * t;
  uint4* row_lo = reinterpret_cast<uint4*>(out + static_cast<size_t>(tile * kTileRows + g) * p.k + col);
  uint4* row_hi = reinterpret_cast<uint4*>(out + static_cast<size_t>(tile * kTileRows + g + 8) * p.k + col);
  row_lo[0] = make_uint4(lo[0], lo[1], lo[2], lo[3]);
  row_lo[1] = make_uint4(lo[4], lo[5], lo[6], lo[7]);
  row_hi[0] = make_uint4(hi[0], hi[1], hi[2], hi[3]);
  row_hi[1] = make_uint4(hi[4], hi[5], hi[6], hi[7]);
}

}  // namespace qlinear
}  // namespace exlcli
