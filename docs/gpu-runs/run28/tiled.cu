// Run 28 probe (docs/gpu-results.md): fp8_gemm.cu (at 2339858) with its weights read from a tiled layout
// (64-row tiles, each pipeline step 8 KB in one piece) against row-major, and loads-only variants of both;
// then (variants 4, 5) its operands brought in by the bulk tensor copy engine, and (6) its weights alone so;
// (7-9) the kernel letting the next one in at its start (7, 8) and with 3 stages (8, 9).
#include <ATen/ops/empty.h>
#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include "common.cuh"
#include "fp8_operands.h"
#include <torch/extension.h>
#include <cuda.h>
#include <cudaTypedefs.h>

namespace exlcli {
namespace {

namespace cg = cooperative_groups;

constexpr int kStep = 128;    // input features (bytes of e4m3) per pipeline stage
constexpr int kStages = 4;    // pipeline stages (3 and 6 were slower on the H200's 8B shapes)

// A block of ROWS weight rows (64 or 128) has one warpgroup of 128 threads for each 64 of them.
template <int ROWS>
constexpr int block_threads() {
  return ROWS * 2;
}

template <int ROWS>
constexpr int part_ld() {  // floats per token row of the partial tile (padded: no bank conflicts)
  return ROWS + 4;
}

struct GemmParams : Fp8Operands {
  __nv_bfloat16* out;  // [m, n]
  int splits;          // slices of the input features (cluster size along y)
};

template <int ROWS, int BM, int STAGES = kStages>
constexpr int smem_bytes() {
  constexpr int pipeline = STAGES * (ROWS + BM) * kStep;
  constexpr int partial = BM * part_ld<ROWS>() * 4;
  return (pipeline > partial ? pipeline : partial) + 1024;  // + the alignment of the swizzle's atoms
}

__device__ __forceinline__ uint32_t shared_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src) : "memory");
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }

template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// wgmma operand descriptor of a K-major tile in shared memory with the 128-byte swizzle: rows of 128
// bytes, 8-row atoms 1,024 bytes apart (the stride byte offset); the leading byte offset is unused.
__device__ __forceinline__ uint64_t tile_descriptor(uint32_t address) {
  return static_cast<uint64_t>((address & 0x3FFFF) >> 4) | (static_cast<uint64_t>(1) << 16) |
         (static_cast<uint64_t>(1024 >> 4) << 32) | (static_cast<uint64_t>(1) << 62);
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_wait_all() { asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory"); }
// cp.async's writes (the generic proxy) made visible to wgmma's reads (the async proxy).
__device__ __forceinline__ void fence_async_shared() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

// d = A (64 rows x 32 bytes) * B (N tokens x 32 bytes)^T (+ d when `accumulate`); d: the m64nN
// accumulator fragment.
template <int N>
__device__ __forceinline__ void wgmma_e4m3(float (&d)[N / 2], uint64_t a, uint64_t b, int accumulate);

template <>
__device__ __forceinline__ void wgmma_e4m3<32>(float (&d)[16], uint64_t a, uint64_t b, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n32k32.f32.e4m3.e4m3 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15"
      "}, %16, %17, p, 1, 1;\n}"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
      : "l"(a), "l"(b), "r"(accumulate));
}

template <>
__device__ __forceinline__ void wgmma_e4m3<64>(float (&d)[32], uint64_t a, uint64_t b, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
      "}, %32, %33, p, 1, 1;\n}"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "l"(a), "l"(b), "r"(accumulate));
}

// The byte offset of 16-byte chunk c of row r in a [rows][128 B] tile.
__device__ __forceinline__ int swizzled(int r, int c) { return r * kStep + ((c ^ (r & 7)) << 4); }

template <int ROWS, int BM, int LAYOUT, bool LOADS_ONLY, int STAGES = kStages, bool EARLY = false>
__global__ void __launch_bounds__(block_threads<ROWS>()) fp8_gemm_kernel(GemmParams p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  static_assert(ROWS == 64 || ROWS == 128, "fp8 gemm: 64 or 128 weight rows a block");
  extern __shared__ uint8_t smem_raw[];
  constexpr int kThreads = block_threads<ROWS>();
  constexpr int kPartLd = part_ld<ROWS>();
  constexpr int kWeightBytes = ROWS * kStep;
  constexpr int kStageBytes = (ROWS + BM) * kStep;
  constexpr int kAccs = BM / 2;  // accumulator registers a thread: m64 x BM over 128 threads

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int warpgroup = warp >> 2;  // rows 64 * warpgroup .. + 63 of the tile
  const int row0 = blockIdx.x * ROWS;
  const int split = blockIdx.y;  // the block's rank in its cluster when splits > 1
  const int token0 = blockIdx.z * BM;
  // The slice's pipeline steps: as even as the count allows (slices of 3 splits over 32 steps: 10, 11, 11).
  const int total_steps = p.k / kStep;
  const int step0 = split * total_steps / p.splits;
  const int steps = (split + 1) * total_steps / p.splits - step0;
  const int k0 = step0 * kStep;
  // The swizzle's atoms must start at multiples of 1,024 bytes (smem_bytes() leaves the room).
  const uint32_t base = (shared_address(smem_raw) + 1023) & ~1023u;
  uint8_t* smem = smem_raw + (base - shared_address(smem_raw));

  auto load_weights = [&](int step) {
    const uint32_t stage = base + (step % STAGES) * kStageBytes;
    if constexpr (LAYOUT == 0) {
      const uint8_t* src = p.w + static_cast<size_t>(row0) * p.k + k0 + step * kStep;
#pragma unroll
      for (int j = 0; j < ROWS * 8 / kThreads; ++j) {
        const int i = threadIdx.x + j * kThreads, r = i >> 3, c = i & 7;
        cp_async16(stage + swizzled(r, c), src + static_cast<size_t>(r) * p.k + c * 16);
      }
    } else {
      // [n / 64][k / 128][64 rows][128 B]: a 64-row tile's step is 8 KB in one piece
#pragma unroll
      for (int j = 0; j < ROWS * 8 / kThreads; ++j) {
        const int i = threadIdx.x + j * kThreads, r = i >> 3, c = i & 7;
        const size_t tile = (row0 + r) >> 6;
        const uint8_t* src = p.w + (tile * total_steps + step0 + step) * 8192 + ((r & 63) << 7) + c * 16;
        cp_async16(stage + swizzled(r, c), src);
      }
    }
  };
  // Tokens past m load the last token's row (their sums are never written).
  auto load_tokens = [&](int step) {
    const uint32_t stage = base + (step % STAGES) * kStageBytes + kWeightBytes;
#pragma unroll
    for (int j = 0; j < BM * 8 / kThreads; ++j) {
      const int i = threadIdx.x + j * kThreads, r = i >> 3, c = i & 7;
      const int token = min(token0 + r, p.m - 1);
      cp_async16(stage + swizzled(r, c), p.xq + static_cast<size_t>(token) * p.k + k0 + step * kStep + c * 16);
    }
  };

  // The weights of the first stages before waiting for the previous kernel (it writes xq).
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < steps) load_weights(s);
  }
  grid_dependency_wait();
  if (EARLY) grid_dependents_launch();  // the next kernel's blocks may come in (its wait still waits for all of this)
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < steps) load_tokens(s);
    cp_async_commit();
  }

  // The tensor cores keep fewer bits than fp32 when they add up e4m3 products, so each stage's 128
  // features are summed by wgmma into `stage_sum` and added to `acc` in fp32 (as cuBLASLt does
  // unless asked for its fast accumulation).
  float acc[kAccs], stage_sum[kAccs];
#pragma unroll
  for (int i = 0; i < kAccs; ++i) acc[i] = stage_sum[i] = 0.0f;

  for (int step = 0; step < steps; ++step) {
    cp_async_wait<STAGES - 2>();
    fence_async_shared();
    __syncthreads();  // this stage is in; every warp is done with the stage the next loads overwrite
    const int next = step + STAGES - 1;
    if (next < steps) {
      load_weights(next);
      load_tokens(next);
    }
    cp_async_commit();
    const uint32_t weights = base + (step % STAGES) * kStageBytes + warpgroup * 64 * kStep;
    const uint32_t tokens = base + (step % STAGES) * kStageBytes + kWeightBytes;
    if constexpr (LOADS_ONLY) {
      stage_sum[0] = smem[(weights - base) + threadIdx.x] + smem[(tokens - base) + threadIdx.x];
    } else {
    wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < kStep / 32; ++ks) {
      wgmma_e4m3<BM>(stage_sum, tile_descriptor(weights + 32 * ks), tile_descriptor(tokens + 32 * ks), ks > 0);
    }
    wgmma_commit();
    wgmma_wait_all();
    }
#pragma unroll
    for (int i = 0; i < kAccs; ++i) acc[i] += stage_sum[i];
  }
  cp_async_wait<0>();
  __syncthreads();  // the pipeline's buffers become the partial tile
  if (!EARLY) grid_dependents_launch();

  // The block's partial tile [BM tokens][128 rows] (fp32). The accumulator of a warp holds rows
  // 16 (warp % 4) + g and + 8 of its warpgroup's 64, tokens 8 j + 2 t and + 1 (g = lane / 4, t = lane % 4).
  float* part = reinterpret_cast<float*>(smem);
  const int g = lane >> 2, t = lane & 3;
  const int r = warpgroup * 64 + (warp & 3) * 16 + g;
#pragma unroll
  for (int j = 0; j < BM / 8; ++j) {
    const int token = 8 * j + 2 * t;
    part[token * kPartLd + r] = acc[4 * j];
    part[(token + 1) * kPartLd + r] = acc[4 * j + 1];
    part[token * kPartLd + r + 8] = acc[4 * j + 2];
    part[(token + 1) * kPartLd + r + 8] = acc[4 * j + 3];
  }
  cg::cluster_group cluster = cg::this_cluster();
  if (p.splits > 1) {
    cluster.sync();  // every block's partial tile is written
  } else {
    __syncthreads();
  }

  // This block's share of the tile's tokens, summed over the blocks' partial tiles in rank order.
  const int first = split * BM / p.splits;
  const int share = (split + 1) * BM / p.splits - first;
  for (int i = threadIdx.x; i < share * (ROWS / 2); i += kThreads) {
    const int local = first + i / (ROWS / 2);
    const int r = 2 * (i % (ROWS / 2));
    const int token = token0 + local;
    if (token >= p.m) continue;
    float s0 = 0.0f, s1 = 0.0f;
    for (int q = 0; q < p.splits; ++q) {
      const float* src = p.splits > 1 ? cluster.map_shared_rank(part, q) : part;
      const float2 v = *reinterpret_cast<const float2*>(src + local * kPartLd + r);
      s0 += v.x;
      s1 += v.y;
    }
    const int row = row0 + r;
    const float xs = p.x_scale[token];
    float v0 = s0 * (xs * p.w_scale[row]);
    float v1 = s1 * (xs * p.w_scale[row + 1]);
    if (p.bias != nullptr) {
      v0 += __bfloat162float(p.bias[row]);
      v1 += __bfloat162float(p.bias[row + 1]);
    }
    *reinterpret_cast<__nv_bfloat162*>(p.out + static_cast<size_t>(token) * p.n + row) = __floats2bfloat162_rn(v0, v1);
  }
  if (p.splits > 1) cluster.sync();  // no block leaves while another still reads its tile
#else
  __trap();  // clusters: the Python side runs this kernel only on sm_90 and newer
#endif
}



// Variant 4 (5: loads only): both operands brought in by the bulk tensor copy engine, one 2D box of
// [rows][128 B] a stage each with the 128-byte swizzle, completing on a barrier per stage.
__device__ __forceinline__ void mbar_init(uint32_t bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  asm volatile(
      "{\n.reg .pred P1;\nLAB_WAIT:\nmbarrier.try_wait.parity.shared::cta.b64 P1, [%0], %1;\n@P1 bra DONE;\n"
      "bra LAB_WAIT;\nDONE:\n}" ::"r"(bar), "r"(parity) : "memory");
}
__device__ __forceinline__ void tma_load_2d(uint32_t dst, const CUtensorMap* map, int inner, int outer, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];"
      ::"r"(dst), "l"(reinterpret_cast<uint64_t>(map)), "r"(inner), "r"(outer), "r"(bar) : "memory");
}

template <int ROWS, int BM, bool LOADS_ONLY, bool NO_TOKENS = false>
__global__ void __launch_bounds__(block_threads<ROWS>()) fp8_gemm_tma(const __grid_constant__ CUtensorMap wmap,
                                                                     const __grid_constant__ CUtensorMap xmap,
                                                                     GemmParams p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  extern __shared__ uint8_t smem_raw[];
  __shared__ alignas(8) uint64_t bars[kStages];
  constexpr int kThreads = block_threads<ROWS>();
  constexpr int kPartLd = part_ld<ROWS>();
  constexpr int kWeightBytes = ROWS * kStep;
  constexpr int kStageBytes = (ROWS + BM) * kStep;
  constexpr int kExpect = NO_TOKENS ? kWeightBytes : kStageBytes;  // bytes a stage's barrier waits for
  constexpr int kAccs = BM / 2;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int warpgroup = warp >> 2;
  const int row0 = blockIdx.x * ROWS;
  const int split = blockIdx.y;
  const int token0 = blockIdx.z * BM;
  const int total_steps = p.k / kStep;
  const int step0 = split * total_steps / p.splits;
  const int steps = (split + 1) * total_steps / p.splits - step0;
  const int k0 = step0 * kStep;
  const uint32_t base = (shared_address(smem_raw) + 1023) & ~1023u;
  uint8_t* smem = smem_raw + (base - shared_address(smem_raw));
  const uint32_t bar0 = shared_address(bars);
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) mbar_init(bar0 + 8 * s, 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages - 1 && s < steps; ++s) {
      mbar_expect_tx(bar0 + 8 * s, kExpect);
      tma_load_2d(base + s * kStageBytes, &wmap, k0 + s * kStep, row0, bar0 + 8 * s);
    }
  }
  grid_dependency_wait();
  if (threadIdx.x == 0 && !NO_TOKENS) {
    for (int s = 0; s < kStages - 1 && s < steps; ++s) {
      tma_load_2d(base + s * kStageBytes + kWeightBytes, &xmap, k0 + s * kStep, token0, bar0 + 8 * s);
    }
  }
  float acc[kAccs], stage_sum[kAccs];
#pragma unroll
  for (int i = 0; i < kAccs; ++i) acc[i] = stage_sum[i] = 0.0f;
  for (int step = 0; step < steps; ++step) {
    mbar_wait(bar0 + 8 * (step % kStages), (step / kStages) & 1);
    __syncthreads();  // every warp is done with the stage the next copy overwrites
    const int next = step + kStages - 1;
    if (threadIdx.x == 0 && next < steps) {
      const uint32_t bar = bar0 + 8 * (next % kStages);
      const uint32_t stage = base + (next % kStages) * kStageBytes;
      mbar_expect_tx(bar, kExpect);
      tma_load_2d(stage, &wmap, k0 + next * kStep, row0, bar);
      if (!NO_TOKENS) tma_load_2d(stage + kWeightBytes, &xmap, k0 + next * kStep, token0, bar);
    }
    const uint32_t weights = base + (step % kStages) * kStageBytes + warpgroup * 64 * kStep;
    const uint32_t tokens = base + (step % kStages) * kStageBytes + kWeightBytes;
    if constexpr (LOADS_ONLY) {
      stage_sum[0] += smem[(weights - base) + threadIdx.x] + smem[(tokens - base) + threadIdx.x];
    } else {
      wgmma_fence();
#pragma unroll
      for (int ks = 0; ks < kStep / 32; ++ks) {
        wgmma_e4m3<BM>(stage_sum, tile_descriptor(weights + 32 * ks), tile_descriptor(tokens + 32 * ks), ks > 0);
      }
      wgmma_commit();
      wgmma_wait_all();
    }
#pragma unroll
    for (int i = 0; i < kAccs; ++i) acc[i] += stage_sum[i];
  }
  __syncthreads();
  grid_dependents_launch();
  float* part = reinterpret_cast<float*>(smem);
  const int g = lane >> 2, t = lane & 3;
  const int r = warpgroup * 64 + (warp & 3) * 16 + g;
#pragma unroll
  for (int j = 0; j < BM / 8; ++j) {
    const int token = 8 * j + 2 * t;
    part[token * kPartLd + r] = acc[4 * j];
    part[(token + 1) * kPartLd + r] = acc[4 * j + 1];
    part[token * kPartLd + r + 8] = acc[4 * j + 2];
    part[(token + 1) * kPartLd + r + 8] = acc[4 * j + 3];
  }
  cg::cluster_group cluster = cg::this_cluster();
  if (p.splits > 1) {
    cluster.sync();
  } else {
    __syncthreads();
  }
  const int first = split * BM / p.splits;
  const int share = (split + 1) * BM / p.splits - first;
  for (int i = threadIdx.x; i < share * (ROWS / 2); i += kThreads) {
    const int local = first + i / (ROWS / 2);
    const int r = 2 * (i % (ROWS / 2));
    const int token = token0 + local;
    if (token >= p.m) continue;
    float s0 = 0.0f, s1 = 0.0f;
    for (int q = 0; q < p.splits; ++q) {
      const float* src = p.splits > 1 ? cluster.map_shared_rank(part, q) : part;
      const float2 v = *reinterpret_cast<const float2*>(src + local * kPartLd + r);
      s0 += v.x;
      s1 += v.y;
    }
    const int row = row0 + r;
    const float xs = p.x_scale[token];
    *reinterpret_cast<__nv_bfloat162*>(p.out + static_cast<size_t>(token) * p.n + row) =
        __floats2bfloat162_rn(s0 * (xs * p.w_scale[row]), s1 * (xs * p.w_scale[row + 1]));
  }
  if (p.splits > 1) cluster.sync();
#else
  __trap();
#endif
}

CUtensorMap make_map(const void* ptr, int rows, int k, int box_rows) {
  static PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult q;
    TORCH_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &q) ==
                    cudaSuccess && fn != nullptr, "no cuTensorMapEncodeTiled");
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }();
  CUtensorMap map;
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(k), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(k)};
  const cuuint32_t box[2] = {128, static_cast<cuuint32_t>(box_rows)};
  const cuuint32_t elem[2] = {1, 1};
  const CUresult r = encode(&map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, const_cast<void*>(ptr), dims, strides, box, elem,
                            CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                            CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  TORCH_CHECK(r == CUDA_SUCCESS, "cuTensorMapEncodeTiled failed: ", static_cast<int>(r));
  return map;
}

template <int ROWS, int BM, bool LO, bool NT = false>
void launch_tma(const GemmParams& p, cudaStream_t stream) {
  auto kernel = fp8_gemm_tma<ROWS, BM, LO, NT>;
  constexpr int smem = kStages * (ROWS + BM) * kStep > BM * part_ld<ROWS>() * 4
                           ? kStages * (ROWS + BM) * kStep + 1024 : BM * part_ld<ROWS>() * 4 + 1024;
  allow_dynamic_smem<fp8_gemm_tma<ROWS, BM, LO, NT>>(smem);
  const dim3 grid(p.n / ROWS, p.splits, (p.m + BM - 1) / BM);
  const CUtensorMap wmap = make_map(p.w, p.n, p.k, ROWS);
  const CUtensorMap xmap = make_map(p.xq, p.m, p.k, BM);
  launch_cluster_pdl(kernel, grid, dim3(block_threads<ROWS>()), dim3(1, p.splits, 1), smem, stream, true, wmap, xmap,
                     p);
}

template <int ROWS, int BM, int LAYOUT, bool LO, int STAGES = kStages, bool EARLY = false>
void launch_tiles(const GemmParams& p, cudaStream_t stream) {
  auto kernel = fp8_gemm_kernel<ROWS, BM, LAYOUT, LO, STAGES, EARLY>;
  constexpr int smem = smem_bytes<ROWS, BM, STAGES>();
  allow_dynamic_smem<fp8_gemm_kernel<ROWS, BM, LAYOUT, LO, STAGES, EARLY>>(smem);
  const dim3 grid(p.n / ROWS, p.splits, (p.m + BM - 1) / BM);
  launch_cluster_pdl(kernel, grid, dim3(block_threads<ROWS>()), dim3(1, p.splits, 1), smem, stream, true, p);
}

template <int ROWS, int LAYOUT, bool LO>
void launch_bm(const GemmParams& p, int bm, cudaStream_t s) {
  if (bm == 32) launch_tiles<ROWS, 32, LAYOUT, LO>(p, s); else launch_tiles<ROWS, 64, LAYOUT, LO>(p, s);
}

template <int ROWS>
void launch_var(const GemmParams& p, int bm, int variant, cudaStream_t s) {
  switch (variant) {
    case 0: launch_bm<ROWS, 0, false>(p, bm, s); break;
    case 1: launch_bm<ROWS, 1, false>(p, bm, s); break;
    case 2: launch_bm<ROWS, 0, true>(p, bm, s); break;
    case 3: launch_bm<ROWS, 1, true>(p, bm, s); break;
    case 4: if (bm == 32) launch_tma<ROWS, 32, false>(p, s); else launch_tma<ROWS, 64, false>(p, s); break;
    case 7: if (bm == 32) launch_tiles<ROWS, 32, 0, false, 4, true>(p, s); else launch_tiles<ROWS, 64, 0, false, 4, true>(p, s); break;
    case 8: if (bm == 32) launch_tiles<ROWS, 32, 0, false, 3, true>(p, s); else launch_tiles<ROWS, 64, 0, false, 3, true>(p, s); break;
    case 9: if (bm == 32) launch_tiles<ROWS, 32, 0, false, 3, false>(p, s); else launch_tiles<ROWS, 64, 0, false, 3, false>(p, s); break;
    case 5: if (bm == 32) launch_tma<ROWS, 32, true>(p, s); else launch_tma<ROWS, 64, true>(p, s); break;
    default: if (bm == 32) launch_tma<ROWS, 32, true, true>(p, s); else launch_tma<ROWS, 64, true, true>(p, s); break;
  }
}

}  // namespace

void run(const at::Tensor& xq, const at::Tensor& x_scale, const at::Tensor& weight, const at::Tensor& w_scale,
         at::Tensor& out, int64_t splits, int64_t bm, int64_t rows, int64_t variant) {
  const Fp8Operands ops = check_fp8_operands("probe", xq, x_scale, weight, w_scale, std::nullopt);
  const GemmParams p{ops, static_cast<__nv_bfloat16*>(out.data_ptr()), static_cast<int>(splits)};
  if (rows == 64) launch_var<64>(p, bm, variant, current_stream()); else launch_var<128>(p, bm, variant, current_stream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace exlcli

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("run", &exlcli::run); }
