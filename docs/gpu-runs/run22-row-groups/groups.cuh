// Run 22 (docs/gpu-results.md): at 17-64 tokens the packed kernel reads each activation chunk from L2 once
// per 16 * RT output rows, several times the weights' bytes. Here a block holds GROUPS row groups of 8
// warps (each group as one block of quant_linear_kernel); the warps of one k-slot in every group read
// the same chunks, either through L1 (EXCHANGE false) or sharing them through shared memory (each warp
// loads 1 / GROUPS of the tokens). Sums in the library's order, so results are bit-identical to it.
// (What run 22 found: neither is faster; these products are not bound by that L2 traffic.)
// python3 groups.py [variants] [tokens] [4 | 6].
#pragma once
#include <torch/extension.h>
#include <c10/cuda/CUDAStream.h>
#include "quant_linear.cuh"
using namespace exlcli::qlinear;

__device__ __forceinline__ void named_barrier(int id, int threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

template <int NT, int UNROLL, int BUFFERS>
constexpr size_t exchange_bytes() { return size_t(BUFFERS) * kWarps * UNROLL * NT * 32 * 2 * sizeof(uint4); }
template <int NT, int GROUPS>
constexpr size_t partial_bytes() { return size_t(GROUPS) * kWarps * NT * 4 * 32 * sizeof(float); }

template <int BITS, int NT, int RT, int UNROLL, int GROUPS, bool EXCHANGE, int BUFFERS>
__global__ void __launch_bounds__(GROUPS * kWarps * 32) grouped_kernel(Params p) {
  extern __shared__ uint4 smem[];
  const int lane = threadIdx.x & 31;
  const int group = (threadIdx.x >> 5) / kWarps, warp = (threadIdx.x >> 5) % kWarps;
  const int g = lane >> 2, t = lane & 3;
  const int tile0 = (blockIdx.x * GROUPS + group) * RT;
  const int token0 = blockIdx.y * 8 * NT;
  const int chunks = p.k / kChunk;
  // exchange buffer [BUFFERS][kWarps slots][UNROLL][NT][32 lanes][2]; with one buffer, a second barrier
  // before it is written again
  uint4* xs = smem;
  float* partial_all = reinterpret_cast<float*>(smem + (EXCHANGE ? exchange_bytes<NT, UNROLL, BUFFERS>() / 16 : 0));
  constexpr int kShare = NT / GROUPS;  // tokens groups of 8 each warp loads when exchanging

  float acc[RT][NT][4];
#pragma unroll
  for (int r = 0; r < RT; ++r)
#pragma unroll
    for (int j = 0; j < NT; ++j) acc[r][j][0] = acc[r][j][1] = acc[r][j][2] = acc[r][j][3] = 0.0f;

  int parity = 0;  // the buffer of this round (0 with one buffer)
  for (int first = warp; first < chunks; first += kWarps * UNROLL, parity = BUFFERS == 1 ? 0 : parity ^ 1) {
    ChunkLoad<BITS> loads[UNROLL][RT];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int chunk = first + u * kWarps;
      if (chunk < chunks) {
#pragma unroll
        for (int r = 0; r < RT; ++r) load_chunk<BITS>(p, tile0 + r, chunk, lane, loads[u][r]);
      }
    }
    if (first == warp) exlcli::grid_dependency_wait();
    if constexpr (EXCHANGE) {
      if (BUFFERS == 1 && first != warp) named_barrier(1 + warp, GROUPS * 32);  // partners have read it
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        const int chunk = first + u * kWarps;
        if (chunk >= chunks) break;
#pragma unroll
        for (int s = 0; s < kShare; ++s) {
          const int j = group * kShare + s;
          const int token = token0 + 8 * j + g;
          uint4 a = make_uint4(0, 0, 0, 0), b = a;
          if (token < p.m) {
            const uint4* xp = reinterpret_cast<const uint4*>(p.x + static_cast<size_t>(token) * p.k + chunk * kChunk + 16 * t);
            a = xp[0];
            b = xp[1];
          }
          uint4* slot = xs + ((((parity * kWarps + warp) * UNROLL + u) * NT + j) * 32 + lane) * 2;
          slot[0] = a;
          slot[1] = b;
        }
      }
      named_barrier(1 + warp, GROUPS * 32);
    }
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int chunk = first + u * kWarps;
      if (chunk >= chunks) break;
      uint4 xv[NT][2];
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        if constexpr (EXCHANGE) {
          const uint4* slot = xs + ((((parity * kWarps + warp) * UNROLL + u) * NT + j) * 32 + lane) * 2;
          xv[j][0] = slot[0];
          xv[j][1] = slot[1];
        } else {
          const int token = token0 + 8 * j + g;
          if (token < p.m) {
            const uint4* xp = reinterpret_cast<const uint4*>(p.x + static_cast<size_t>(token) * p.k + chunk * kChunk + 16 * t);
            xv[j][0] = xp[0];
            xv[j][1] = xp[1];
          } else {
            xv[j][0] = xv[j][1] = make_uint4(0, 0, 0, 0);
          }
        }
      }
#pragma unroll
      for (int step = 0; step < 4; ++step) {
#pragma unroll
        for (int r = 0; r < RT; ++r) {
          uint32_t a[4];
          chunk_step<BITS, false>(loads[u][r], step, a);
#pragma unroll
          for (int j = 0; j < NT; ++j) {
            const uint4& v = xv[j][step >> 1];
            mma_bf16(acc[r][j], a, (step & 1) ? v.z : v.x, (step & 1) ? v.w : v.y);
          }
        }
      }
    }
  }

  exlcli::grid_dependency_wait();
  exlcli::grid_dependents_launch();
  // the group's partial sums, added in warp order (add_warp_partials with a barrier of the group's warps)
  float (*partial)[NT][4][32] = reinterpret_cast<float (*)[NT][4][32]>(partial_all + group * kWarps * NT * 4 * 32);
  const int tid = threadIdx.x % (kWarps * 32);
#pragma unroll
  for (int r = 0; r < RT; ++r) {
    if (r > 0) named_barrier(9 + group, kWarps * 32);
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) partial[warp][j][e][lane] = acc[r][j][e];
    named_barrier(9 + group, kWarps * 32);
    for (int i = tid; i < NT * 4 * 32; i += kWarps * 32) {
      const int j = i / 128, e = (i / 32) % 4, l = i % 32;
      const int token = token0 + 8 * j + 2 * (l & 3) + (e & 1);
      if (token >= p.m) continue;
      float sum = 0.0f;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) sum += partial[w][j][e][l];
      const int row = (tile0 + r) * kTileRows + (l >> 2) + 8 * (e >> 1);
      static_cast<__nv_bfloat16*>(p.out)[static_cast<size_t>(token) * p.n + row] = __float2bfloat16_rn(sum);
    }
  }
}

template <int BITS, int NT, int RT, int UNROLL>
void go(const Params& p, cudaStream_t s) {
  dim3 grid(p.n / (kTileRows * RT), (p.m + 8 * NT - 1) / (8 * NT));
  quant_linear_kernel<BITS, false, NT, RT, UNROLL, false><<<grid, kWarps * 32, 0, s>>>(p);
}

template <int BITS, int NT, int RT, int UNROLL, int GROUPS, bool EXCHANGE, int BUFFERS = 2>
void grouped(const Params& p, cudaStream_t s) {
  TORCH_CHECK(p.n % (kTileRows * RT * GROUPS) == 0, "rows");
  const size_t bytes = (EXCHANGE ? exchange_bytes<NT, UNROLL, BUFFERS>() : 0) + partial_bytes<NT, GROUPS>();
  auto kernel = grouped_kernel<BITS, NT, RT, UNROLL, GROUPS, EXCHANGE, BUFFERS>;
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
  dim3 grid(p.n / (kTileRows * RT * GROUPS), (p.m + 8 * NT - 1) / (8 * NT));
  kernel<<<grid, GROUPS * kWarps * 32, bytes, s>>>(p);
}

// The variants by number (groups.py's argument); groups4/6/8.cu instantiate them, one weight width each,
// so that the three compile in parallel.
template <int BITS>
void pick(int64_t v, const Params& p, cudaStream_t s) {
  switch (v) {
    case 0: if constexpr (BITS != 8) go<BITS, 4, 2, 2>(p, s); else go<BITS, 8, 2, 4>(p, s); break;  // today's 33-64
    case 1: grouped<BITS, 4, 2, 2, 2, false>(p, s); break;
    case 2: grouped<BITS, 4, 2, 2, 2, true>(p, s); break;
    case 3: grouped<BITS, 4, 2, 1, 2, true>(p, s); break;
    case 4: grouped<BITS, 4, 2, 4, 2, true, 1>(p, s); break;
    case 5: grouped<BITS, 4, 1, 4, 2, true, 1>(p, s); break;
    case 6: grouped<BITS, 4, 1, 2, 4, true>(p, s); break;
    case 7: grouped<BITS, 8, 1, 2, 2, true, 1>(p, s); break;
    case 8: grouped<BITS, 2, 2, 4, 2, true>(p, s); break;
    case 11: grouped<BITS, 4, 2, 2, 2, true, 1>(p, s); break;
    case 12: go<BITS, 8, 2, 2>(p, s); break;
    case 13: go<BITS, 4, 4, 2>(p, s); break;
    case 14: go<BITS, 8, 2, 4>(p, s); break;
    case 9: go<BITS, 8, 4, 1>(p, s); break;   // run 21's best LM head shape
    case 10: go<BITS, 4, 2, 4>(p, s); break;  // today's 17-32 tokens
    default: TORCH_CHECK(false, "variant");
  }
}

extern template void pick<4>(int64_t, const Params&, cudaStream_t);
extern template void pick<6>(int64_t, const Params&, cudaStream_t);
extern template void pick<8>(int64_t, const Params&, cudaStream_t);
