// Run 21 (docs/gpu-results.md): variants of the 4-bit packed decode kernel at 1 and 16 tokens, an experiment outside the library (python3 variants.py [variants] on a CUDA machine).
#include <torch/extension.h>
#include <c10/cuda/CUDAStream.h>
#include "quant_linear.cuh"

using namespace exlcli::qlinear;

// MODE 0: full; 1: no affine (q only: magic|nibble as bf16); 2: no dequant and no mma (loads only)
template <int NT, int RT, int UNROLL, int MODE, bool PREFETCH, bool XROUND = false, int ACCS = 1, int MINB = 1>
__global__ void __launch_bounds__(kWarps * 32, MINB) exp_kernel(Params p) {
  __shared__ float partial[kWarps][NT][4][32];
  const int tile0 = blockIdx.x * RT;
  const int token0 = blockIdx.y * 8 * NT;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, t = lane & 3;
  const int chunks = p.k / kChunk;
  float accs[ACCS][RT][NT][4];
#pragma unroll
  for (int c = 0; c < ACCS; ++c)
#pragma unroll
  for (int r = 0; r < RT; ++r)
#pragma unroll
    for (int j = 0; j < NT; ++j) accs[c][r][j][0] = accs[c][r][j][1] = accs[c][r][j][2] = accs[c][r][j][3] = 0.0f;
  float (&acc)[RT][NT][4] = accs[0];
  ChunkLoad<4> cur[UNROLL][RT];
  auto load_round = [&](int first, ChunkLoad<4> (&dst)[UNROLL][RT]) {
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int chunk = first + u * kWarps;
      if (chunk < chunks) {
#pragma unroll
        for (int r = 0; r < RT; ++r) load_chunk<4>(p, tile0 + r, chunk, lane, dst[u][r]);
      }
    }
  };
  if (PREFETCH) load_round(warp, cur);
  for (int first = warp; first < chunks; first += kWarps * UNROLL) {
    ChunkLoad<4> nxt[UNROLL][RT];
    if (PREFETCH) {
      if (first + kWarps * UNROLL < chunks) load_round(first + kWarps * UNROLL, nxt);
    } else {
      load_round(first, cur);
    }
    uint4 xr[UNROLL][NT][2];
    if (XROUND) {
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        const int chunk = first + u * kWarps;
#pragma unroll
        for (int j = 0; j < NT; ++j) {
          const int token = token0 + 8 * j + g;
          if (token < p.m && chunk < chunks) {
            const uint4* xp = reinterpret_cast<const uint4*>(p.x + static_cast<size_t>(token) * p.k + chunk * kChunk + 16 * t);
            xr[u][j][0] = xp[0];
            xr[u][j][1] = xp[1];
          } else {
            xr[u][j][0] = xr[u][j][1] = make_uint4(0, 0, 0, 0);
          }
        }
      }
    }
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int chunk = first + u * kWarps;
      if (chunk >= chunks) break;
      uint4 xv[NT][2];
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        if (XROUND) { xv[j][0] = xr[u][j][0]; xv[j][1] = xr[u][j][1]; continue; }
        const int token = token0 + 8 * j + g;
        if (token < p.m) {
          const uint4* xp = reinterpret_cast<const uint4*>(p.x + static_cast<size_t>(token) * p.k + chunk * kChunk + 16 * t);
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
          const ChunkLoad<4>& c = cur[u][r];
          const uint32_t word = step == 0 ? c.q.x : step == 1 ? c.q.y : step == 2 ? c.q.z : c.q.w;
          if (MODE == 2) {
            acc[r][0][step] += __uint_as_float(word ^ c.lo ^ c.hi);
            continue;
          }
          uint32_t a[4];
          if (MODE == 0) {
            dequant4(word, affine4(c.lo), affine4(c.hi), a);
          } else {
#pragma unroll
            for (int q = 0; q < 4; ++q) a[q] = ((word >> (4 * q)) & 0x000F000Fu) | 0x43004300u ^ (q & 1 ? c.hi : c.lo);
          }
#pragma unroll
          for (int j = 0; j < NT; ++j) {
            const uint4& v = xv[j][step >> 1];
            mma_bf16(accs[step % ACCS][r][j], a, (step & 1) ? v.z : v.x, (step & 1) ? v.w : v.y);
          }
        }
      }
    }
    if (PREFETCH) {
#pragma unroll
      for (int u = 0; u < UNROLL; ++u)
#pragma unroll
        for (int r = 0; r < RT; ++r) cur[u][r] = nxt[u][r];
    }
  }
#pragma unroll
  for (int c = 1; c < ACCS; ++c)
#pragma unroll
    for (int r = 0; r < RT; ++r)
#pragma unroll
      for (int j = 0; j < NT; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[r][j][e] += accs[c][r][j][e];
  add_warp_partials<RT, NT>(acc, partial, token0, p.m, [&](int token, int r, int row_in_tile, float sum) {
    const int row = (tile0 + r) * kTileRows + row_in_tile;
    static_cast<__nv_bfloat16*>(p.out)[static_cast<size_t>(token) * p.n + row] = __float2bfloat16_rn(sum);
  });
}

template <int NT, int RT, int UNROLL, int MODE, bool PREFETCH, bool XROUND = false, int ACCS = 1, int MINB = 1>
void launch(const Params& p, cudaStream_t s) {
  dim3 grid(p.n / (kTileRows * RT), (p.m + 8 * NT - 1) / (8 * NT));
  exp_kernel<NT, RT, UNROLL, MODE, PREFETCH, XROUND, ACCS, MINB><<<grid, kWarps * 32, 0, s>>>(p);
}


__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16;" ::"r"(s), "l"(gmem));
}
__device__ __forceinline__ void cp_async4(void* smem, const void* gmem) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(s), "l"(gmem));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N)); }

// Each lane copies its own chunk words and scales into its own shared slots STAGES - 1 chunks
// ahead and reads back only what it copied: no barrier, the loads stay in flight while it computes.
template <int NT, int STAGES>
__global__ void __launch_bounds__(kWarps * 32) async_kernel(Params p) {
  __shared__ float partial[kWarps][NT][4][32];
  __shared__ uint4 ring_q[kWarps][STAGES][32];
  __shared__ uint2 ring_s[kWarps][STAGES][32];
  const int tile = blockIdx.x;
  const int token0 = blockIdx.y * 8 * NT;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, t = lane & 3;
  const int chunks = p.k / kChunk;
  const int groups = p.k >> p.group_log2;
  const uint4* qbase = reinterpret_cast<const uint4*>(p.qweight) + static_cast<size_t>(tile) * chunks * 32 + lane;
  const uint32_t* sbase = p.scales + static_cast<size_t>(tile) * groups * kTileRows + g;
  auto issue = [&](int i) {  // the warp's i-th chunk into stage i % STAGES
    const int chunk = warp + i * kWarps;
    if (chunk < chunks) {
      const int slot = i % STAGES;
      cp_async16(&ring_q[warp][slot][lane], qbase + static_cast<size_t>(chunk) * 32);
      const int group = (chunk * kChunk + 16 * t) >> p.group_log2;
      const uint32_t* sp = sbase + static_cast<size_t>(group) * kTileRows;
      cp_async4(&ring_s[warp][slot][lane].x, sp);
      cp_async4(&ring_s[warp][slot][lane].y, sp + 8);
    }
    cp_async_commit();
  };
  float acc[NT][4];
#pragma unroll
  for (int j = 0; j < NT; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;
#pragma unroll
  for (int i = 0; i < STAGES - 1; ++i) issue(i);
  const int mine = (chunks - warp + kWarps - 1) / kWarps;
  for (int i = 0; i < mine; ++i) {
    issue(i + STAGES - 1);
    const int chunk = warp + i * kWarps;
    uint4 xv[NT][2];
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      const int token = token0 + 8 * j + g;
      if (token < p.m) {
        const uint4* xp = reinterpret_cast<const uint4*>(p.x + static_cast<size_t>(token) * p.k + chunk * kChunk + 16 * t);
        xv[j][0] = xp[0];
        xv[j][1] = xp[1];
      } else {
        xv[j][0] = xv[j][1] = make_uint4(0, 0, 0, 0);
      }
    }
    cp_async_wait<STAGES - 1>();
    ChunkLoad<4> c;
    c.q = ring_q[warp][i % STAGES][lane];
    const uint2 s2 = ring_s[warp][i % STAGES][lane];
    c.lo = s2.x;
    c.hi = s2.y;
#pragma unroll
    for (int step = 0; step < 4; ++step) {
      uint32_t a[4];
      chunk_step<4, false>(c, step, a);
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        const uint4& v = xv[j][step >> 1];
        mma_bf16(acc[j], a, (step & 1) ? v.z : v.x, (step & 1) ? v.w : v.y);
      }
    }
  }
  cp_async_wait<0>();
  float accr[1][NT][4];
#pragma unroll
  for (int j = 0; j < NT; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) accr[0][j][e] = acc[j][e];
  add_warp_partials<1, NT>(accr, partial, token0, p.m, [&](int token, int r, int row_in_tile, float sum) {
    const int row = tile * kTileRows + row_in_tile;
    static_cast<__nv_bfloat16*>(p.out)[static_cast<size_t>(token) * p.n + row] = __float2bfloat16_rn(sum);
  });
}

template <int NT, int STAGES>
void launch_async(const Params& p, cudaStream_t s) {
  dim3 grid(p.n / kTileRows, (p.m + 8 * NT - 1) / (8 * NT));
  async_kernel<NT, STAGES><<<grid, kWarps * 32, 0, s>>>(p);
}

template <int NT, int RT, int UNROLL>
void launch_main(const Params& p, cudaStream_t s) {
  dim3 grid(p.n / (kTileRows * RT), (p.m + 8 * NT - 1) / (8 * NT));
  quant_linear_kernel<4, false, NT, RT, UNROLL, false><<<grid, kWarps * 32, 0, s>>>(p);
}

void run(int64_t variant, at::Tensor x, at::Tensor qweight, at::Tensor scales, int64_t group_log2, at::Tensor out) {
  Params p{};
  p.x = static_cast<const __nv_bfloat16*>(x.data_ptr());
  p.qweight = static_cast<const uint32_t*>(qweight.data_ptr());
  p.scales = static_cast<const uint32_t*>(scales.data_ptr());
  p.out = out.data_ptr();
  p.m = x.size(0);
  p.n = out.size(1);
  p.k = x.size(1);
  p.group_log2 = group_log2;
  cudaStream_t s = c10::cuda::getCurrentCUDAStream();
  switch (variant) {
    case 0: launch_main<1, 1, 4>(p, s); break;   // today's b1
    case 9: launch<1, 1, 4, 2, false>(p, s); break;  // loads only
    case 40: launch_async<1, 4>(p, s); break;
    case 41: launch_async<1, 6>(p, s); break;
    case 42: launch_async<1, 3>(p, s); break;
    case 45: launch_async<1, 5>(p, s); break;
    case 11: launch_main<2, 1, 4>(p, s); break;  // today's b16
    case 43: launch_async<2, 4>(p, s); break;
    case 44: launch_async<2, 6>(p, s); break;
    default: TORCH_CHECK(false, "variant");
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("run", &run); }
