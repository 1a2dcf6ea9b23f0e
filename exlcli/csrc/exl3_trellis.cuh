// EXL3 trellis weights on the GPU (exlcli/ops/formats/exl3.py defines the format; cuda_exl3.py repacks it):
// the device functions that decode one 16 x 16 tile of W0 in a warp, straight into the A operand of a
// tensor core's m16n8k16 product, and the 128-wide Walsh-Hadamard transforms around it.
//
// The repacked layout: the tiles of each 16-row strip of the weight one after another along the input
// (tile (strip s, input tile t) at (s * k / 16 + t) * 32 K bytes), each tile's 256 K bits cut into 32
// chunks of K bytes, lane l's chunk the stream's bits 8 l K .. 8 (l + 1) K - 1, the bits of the 8 values
// that lane decodes. A tile keeps its chunks in planes a warp loads in whole lines: K / 4 planes of 32
// u32 (the chunk's first bytes, most significant first), then for K & 2 a plane of 32 u16, for K & 1 a
// plane of 32 bytes. A lane's 8 states need 16 - K bits before its chunk (a state is the 16 bits that end
// at bit (i + 1) K of the tile's stream, wrapping round): the lane before has them (the two before for K = 1;
// lane 0 takes them from lane 31, the tail-biting wrap).
//
// Value 8 l + j of a tile sits at input row 2 (l % 4) + (j & 1) + 8 ((j >> 1) & 1), output column l / 4 +
// 8 (j >> 2): with the outputs as the M side of m16n8k16 (rows) and the inputs as its K side, the lane's
// values (0, 1), (4, 5), (2, 3), (6, 7) are its four A registers as they come.
#pragma once

#include <cuda_fp16.h>
#include <stdint.h>

namespace exlcli {
namespace exl3 {

constexpr int kTile = 16;
constexpr int kHad = 128;
constexpr int kWarps = 8;  // warps of a block: the 8 strips of one 128-row group
constexpr unsigned kFull = 0xffffffffu;
enum Codebook : int { k3Inst = 0, kMcg = 1, kMul1 = 2 };

template <int K>
__host__ __device__ constexpr int tile_bytes() { return 32 * K; }

// One lane's chunk of one tile as loaded (assembled later, so that several tiles' loads are in flight).
struct Raw {
  uint32_t w[2];
  uint32_t h;
};

template <int K>
__device__ __forceinline__ Raw load_chunk(const uint8_t* tile, int lane) {
  Raw r{{0u, 0u}, 0u};
  const uint32_t* words = reinterpret_cast<const uint32_t*>(tile);
#pragma unroll
  for (int i = 0; i < K / 4; ++i) r.w[i] = __ldg(words + i * 32 + lane);
  int offset = (K / 4) * 128;
  uint32_t h = 0;
  if constexpr ((K & 2) != 0) {
    h = __ldg(reinterpret_cast<const unsigned short*>(tile + offset) + lane);
    offset += 64;
  }
  if constexpr ((K & 1) != 0) h = (h << 8) | __ldg(tile + offset + lane);
  r.h = h;
  return r;
}

// The lane's 8 states (16-bit, in the low half of each word).
template <int K>
__device__ __forceinline__ void lane_states(const Raw& r, int lane, uint32_t (&st)[8]) {
  constexpr int kTail = 8 * (K & 3);  // bits of the chunk after its u32 planes
  uint32_t e[3];
  if constexpr (K == 1) {
    const uint32_t c = r.h;  // 8 bits
    const uint32_t p1 = __shfl_sync(kFull, c, (lane + 31) & 31);
    const uint32_t p2 = __shfl_sync(kFull, c, (lane + 30) & 31);
    e[0] = (p2 << 16) | (p1 << 8) | c;
    e[1] = 0;
    e[2] = 0;
  } else if constexpr (K < 4) {  // 16 or 24 bits of chunk
    const uint32_t c = r.h;
    const uint32_t prev = __shfl_sync(kFull, c, (lane + 31) & 31) & 0xffffu;
    e[0] = (prev << (8 * K)) | c;
    e[1] = prev >> (32 - 8 * K);
    e[2] = 0;
  } else if constexpr (K < 8) {  // a u32 plane, then kTail bits
    const uint32_t lo = kTail ? ((r.w[0] << kTail) | r.h) : r.w[0];
    const uint32_t hi = kTail ? (r.w[0] >> (32 - kTail)) : 0u;
    const uint32_t prev = __shfl_sync(kFull, lo, (lane + 31) & 31) & 0xffffu;
    e[0] = lo;
    if constexpr (kTail == 0) {
      e[1] = prev;
      e[2] = 0;
    } else {
      e[1] = hi | (prev << kTail);
      e[2] = prev >> (32 - kTail);
    }
  } else {  // two u32 planes
    const uint32_t prev = __shfl_sync(kFull, r.w[1], (lane + 31) & 31) & 0xffffu;
    e[0] = r.w[1];
    e[1] = r.w[0];
    e[2] = prev;
  }
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int shift = (7 - i) * K;
    const int word = shift / 32, offset = shift % 32;
    const uint32_t v = offset == 0 ? e[word] : __funnelshift_r(e[word], e[word + 1], offset);
    st[i] = v & 0xffffu;
  }
}

// The sum of the two fp16 halves of x, rounded once, in the low half.
__device__ __forceinline__ uint32_t hadd_halves(uint32_t x) {
  const __half2 h = *reinterpret_cast<const __half2*>(&x);
  const __half s = __hadd(__low2half(h), __high2half(h));
  return static_cast<uint32_t>(*reinterpret_cast<const unsigned short*>(&s));
}

__device__ __forceinline__ uint32_t hfma2(uint32_t a, uint32_t b, uint32_t c) {
  uint32_t d;
  asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
}

// Two states -> their fp16 values as one half2 (a in the low half), exactly exl3.decode's arithmetic.
template <int CB>
__device__ __forceinline__ uint32_t decode_pair(uint32_t a, uint32_t b) {
  if constexpr (CB == kMul1) {
    const uint32_t sa = __dp4a(a * 0x83DCD12Du, 0x01010101u, 0u);
    const uint32_t sb = __dp4a(b * 0x83DCD12Du, 0x01010101u, 0u);
    // fp16 0x6400 | s is 1024 + s (s <= 1020), then one fp16 rounding of (1024 + s) * k + b
    const uint32_t h = __byte_perm(sa, sb, 0x5410) | 0x64006400u;
    return hfma2(h, 0x1EEE1EEEu, 0xC931C931u);
  } else {
    uint32_t xa, xb;
    if constexpr (CB == kMcg) {
      xa = a * 0xCBAC1FEDu;
      xb = b * 0xCBAC1FEDu;
    } else {
      xa = a * 89226354u + 64248484u;
      xb = b * 89226354u + 64248484u;
    }
    xa = (xa & 0x8fff8fffu) ^ 0x3b603b60u;
    xb = (xb & 0x8fff8fffu) ^ 0x3b603b60u;
    // each value's two halves added (an add with its operands' halves selected), the sums paired: one byte
    // permute a pair where transposing the halves first takes two
    const uint32_t sa = hadd_halves(xa), sb = hadd_halves(xb);
    return __byte_perm(sa, sb, 0x5410);
  }
}

// The lane's A registers of its tile: values (0, 1), (4, 5), (2, 3), (6, 7).
template <int K, int CB>
__device__ __forceinline__ void decode_tile(const Raw& r, int lane, uint32_t (&a)[4]) {
  uint32_t st[8];
  lane_states<K>(r, lane, st);
  a[0] = decode_pair<CB>(st[0], st[1]);
  a[1] = decode_pair<CB>(st[4], st[5]);
  a[2] = decode_pair<CB>(st[2], st[3]);
  a[3] = decode_pair<CB>(st[6], st[7]);
}

__device__ __forceinline__ void mma_16816(float (&c)[4], const uint32_t (&a)[4], uint2 b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b.x), "r"(b.y));
#endif
}

// The unnormalised Walsh-Hadamard transform of 128 values, one a thread of a 128-thread block (element
// = threadIdx.x): strides 1 to 16 through shuffles, 32 and 64 through `scratch` (128 floats).
__device__ __forceinline__ float fwht128_block(float v, float* scratch) {
  const int t = threadIdx.x;
#pragma unroll
  for (int s = 1; s < 32; s <<= 1) {
    const float other = __shfl_xor_sync(kFull, v, s);
    v = (t & s) ? other - v : v + other;
  }
#pragma unroll
  for (int s = 32; s < 128; s <<= 1) {
    scratch[t] = v;
    __syncthreads();
    const float other = scratch[t ^ s];
    __syncthreads();
    v = (t & s) ? other - v : v + other;
  }
  return v;
}

// The same over 128 values in one warp, element lane + 32 r in v[r].
__device__ __forceinline__ void fwht128_warp(float (&v)[4], int lane) {
#pragma unroll
  for (int s = 1; s < 32; s <<= 1) {
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const float other = __shfl_xor_sync(kFull, v[r], s);
      v[r] = (lane & s) ? other - v[r] : v[r] + other;
    }
  }
  float t0 = v[0] + v[1], t1 = v[0] - v[1], t2 = v[2] + v[3], t3 = v[2] - v[3];  // stride 32
  v[0] = t0 + t2;  // stride 64
  v[1] = t1 + t3;
  v[2] = t0 - t2;
  v[3] = t1 - t3;
}

}  // namespace exl3
}  // namespace exlcli
