// FP8 x FP8 products for 9 to 64 tokens, tiled through shared memory (sm_90+):
// y = (xq @ w^T) * x_scale[token] * w_scale[row] (+ bias), bf16 out, for e4m3 activations quantized
// per token (fp8_quant.cu) and e4m3 weights [n, k] row-major with a scale per row (the layouts of
// fp8_linear.cu, which serves fewer tokens; exlcli/ops/formats/cuda_fp8.py picks the kernel).
//
// Why a second kernel: fp8_linear.cu's warps split the input features and each loads its own
// activations, which at 64 tokens is twice the weights' bytes again from L2 and 255 registers a
// thread; cuBLASLt's FP8 GEMM reads only 1.2-2.7 TB/s of weights at 64 tokens on the 8B shapes (H200).
//
// A block takes ROWS (64 or 128) weight rows and BM (32 or 64) tokens over a slice of the input features. Each
// pipeline stage (kStages in flight, cp.async) brings 128 bytes of features of every weight row and
// token into shared memory, in the layout of wgmma's 128-byte swizzle (16-byte chunk c of row r sits
// at c ^ (r % 8), 8-row atoms of 1,024 bytes). The block's warpgroups (one or two) each multiply 64 of the rows
// by the tokens with Hopper's wgmma (m64 x BM x k32, e4m3, fp32 accumulate), both operands read from
// shared memory: mma.sync's e4m3 form is Ada's and Hopper runs it as fp16 after a conversion (this
// tiling on mma.sync takes 72 us for the 8B gate|up at 64 tokens, bound by that arithmetic; on wgmma
// it takes 36). With `splits` > 1, the input features are cut into
// that many slices (1 to 8, of whole pipeline steps, as even as they go), the blocks of one row tile form a cluster, and after the main loop each block sums
// a share of the tile's tokens over every block's partial tile (distributed shared memory) in rank
// order. Every token's sum is thus the same chain of products and additions whatever the other tokens
// are: the kernel is batch-invariant, and blocks of 64 and 128 rows give the same bytes (each row's
// chain is the same; cuda_fp8.gemm_tiling picks the faster per weight).
//
// fp8_gemm_qkv_rope is the same product for a q|k|v projection in blocks of 128 rows (whole heads of
// 64 or 128): its epilogue pairs rows j and j + D/2 of a head, rounds them to bf16 as the product would
// write them, and rotates and stores them as rope.cu does (rope_kv.cuh), so a decoder layer needs no
// rope kernel between its q|k|v product and attention.
#include <ATen/ops/empty.h>
#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include "common.cuh"
#include "fp8_operands.h"
#include "ops.h"
#include "rope_kv.cuh"

namespace exlcli {
namespace {

namespace cg = cooperative_groups;

constexpr int kStep = 128;    // input features (bytes of e4m3) per pipeline stage
constexpr int kStages = 4;    // pipeline stages (3 and 6 are slower on the H200's 8B shapes)

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
  __nv_bfloat16* out;  // [m, n]; unused with the rope epilogue
  int splits;          // slices of the input features (cluster size along y)
  RopeKV rope;         // the rope epilogue: where the q|k|v rows go
};

// Output `row` of a token whose sum over the input features is s and whose scale is xs: the scales and
// the bias, each rounding explicit, so the plain and the rope epilogues compute the same value.
__device__ __forceinline__ float output_value(const GemmParams& p, float s, float xs, int row) {
  const float scale = __fmul_rn(xs, p.w_scale[row]);
  return p.bias != nullptr ? __fmaf_rn(s, scale, __bfloat162float(p.bias[row])) : __fmul_rn(s, scale);
}

template <int ROWS, int BM>
constexpr int smem_bytes() {
  constexpr int pipeline = kStages * (ROWS + BM) * kStep;
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

// ROPE: the weight is a q|k|v projection whose heads (of 64 or 128 rows) tile the block's 128 rows;
// the epilogue rotates and writes them as rope.cu does (rope_kv.cuh) instead of writing out.
template <int ROWS, int BM, bool ROPE>
__global__ void __launch_bounds__(block_threads<ROWS>()) fp8_gemm_kernel(GemmParams p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  static_assert(ROWS == 64 || ROWS == 128, "fp8 gemm: 64 or 128 weight rows a block");
  static_assert(!ROPE || ROWS == 128, "fp8 gemm: the rope epilogue takes blocks of 128 rows");
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
    const uint32_t stage = base + (step % kStages) * kStageBytes;
    const uint8_t* src = p.w + static_cast<size_t>(row0) * p.k + k0 + step * kStep;
#pragma unroll
    for (int j = 0; j < ROWS * 8 / kThreads; ++j) {
      const int i = threadIdx.x + j * kThreads, r = i >> 3, c = i & 7;
      cp_async16(stage + swizzled(r, c), src + static_cast<size_t>(r) * p.k + c * 16);
    }
  };
  // Tokens past m load the last token's row (their sums are never written).
  auto load_tokens = [&](int step) {
    const uint32_t stage = base + (step % kStages) * kStageBytes + kWeightBytes;
#pragma unroll
    for (int j = 0; j < BM * 8 / kThreads; ++j) {
      const int i = threadIdx.x + j * kThreads, r = i >> 3, c = i & 7;
      const int token = min(token0 + r, p.m - 1);
      cp_async16(stage + swizzled(r, c), p.xq + static_cast<size_t>(token) * p.k + k0 + step * kStep + c * 16);
    }
  };

  // The weights of the first stages before waiting for the previous kernel (it writes xq).
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < steps) load_weights(s);
  }
  grid_dependency_wait();
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
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
    cp_async_wait<kStages - 2>();
    fence_async_shared();
    __syncthreads();  // this stage is in; every warp is done with the stage the next loads overwrite
    const int next = step + kStages - 1;
    if (next < steps) {
      load_weights(next);
      load_tokens(next);
    }
    cp_async_commit();
    const uint32_t weights = base + (step % kStages) * kStageBytes + warpgroup * 64 * kStep;
    const uint32_t tokens = base + (step % kStages) * kStageBytes + kWeightBytes;
    wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < kStep / 32; ++ks) {
      wgmma_e4m3<BM>(stage_sum, tile_descriptor(weights + 32 * ks), tile_descriptor(tokens + 32 * ks), ks > 0);
    }
    wgmma_commit();
    wgmma_wait_all();
#pragma unroll
    for (int i = 0; i < kAccs; ++i) acc[i] += stage_sum[i];
  }
  cp_async_wait<0>();
  __syncthreads();  // the pipeline's buffers become the partial tile
  grid_dependents_launch();

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

  // This block's share of the tile's tokens, summed over the blocks' partial tiles in rank order: two
  // rows a thread, r and r + 1 (or with ROPE, j and j + D/2 of a head).
  const int first = split * BM / p.splits;
  const int share = (split + 1) * BM / p.splits - first;
  const int half = ROPE ? p.rope.head_dim / 2 : 1;
  for (int i = threadIdx.x; i < share * (ROWS / 2); i += kThreads) {
    const int local = first + i / (ROWS / 2);
    const int pair = i % (ROWS / 2);
    const int r = ROPE ? (pair / half) * 2 * half + pair % half : 2 * pair;
    const int token = token0 + local;
    if (token >= p.m) continue;
    float s0 = 0.0f, s1 = 0.0f;
    for (int q = 0; q < p.splits; ++q) {
      const float* src = (p.splits > 1 ? cluster.map_shared_rank(part, q) : part) + local * kPartLd + r;
      s0 += src[0];
      s1 += src[half];
    }
    const int row = row0 + r;
    const float xs = p.x_scale[token];
    const float v0 = output_value(p, s0, xs, row), v1 = output_value(p, s1, xs, row + half);
    if constexpr (ROPE) {
      const int head = row / (2 * half), j = row % (2 * half);
      const RopeAngle angle = rope_angle(p.rope, head, j, p.rope.positions[token]);
      store_rope_pair<__nv_bfloat16>(p.rope, head, j, token, round_to<__nv_bfloat16>(v0),
                                     round_to<__nv_bfloat16>(v1), angle, p.rope.slots[token]);
    } else {
      *reinterpret_cast<__nv_bfloat162*>(p.out + static_cast<size_t>(token) * p.n + row) =
          __floats2bfloat162_rn(v0, v1);
    }
  }
  if (p.splits > 1) cluster.sync();  // no block leaves while another still reads its tile
#else
  __trap();  // clusters: the Python side runs this kernel only on sm_90 and newer
#endif
}

template <int ROWS, int BM, bool ROPE>
void launch_tiles(const GemmParams& p, cudaStream_t stream, bool pdl) {
  auto kernel = fp8_gemm_kernel<ROWS, BM, ROPE>;
  constexpr int smem = smem_bytes<ROWS, BM>();
  allow_dynamic_smem<fp8_gemm_kernel<ROWS, BM, ROPE>>(smem);
  const dim3 grid(p.n / ROWS, p.splits, (p.m + BM - 1) / BM);
  launch_cluster_pdl(kernel, grid, dim3(block_threads<ROWS>()), dim3(1, p.splits, 1), smem, stream, pdl, p);
}

template <int ROWS, bool ROPE = false>
void launch_rows(const GemmParams& p, int block_tokens, cudaStream_t stream, bool pdl) {
  if (block_tokens == 32) {
    launch_tiles<ROWS, 32, ROPE>(p, stream, pdl);
  } else {
    launch_tiles<ROWS, 64, ROPE>(p, stream, pdl);
  }
}

// The checks both ops make beyond the operands'.
void check_tiling(const char* op, const Fp8Operands& ops, int64_t splits, int64_t block_tokens, int64_t block_rows) {
  TORCH_CHECK(device_supports_pdl(), op, ": needs thread block clusters (sm_90 or newer)");
  TORCH_CHECK(block_rows == 64 || block_rows == 128, op, ": block_rows must be 64 or 128");
  TORCH_CHECK(splits >= 1 && splits <= 8, op, ": splits must be 1 to 8");
  TORCH_CHECK(block_tokens == 32 || block_tokens == 64, op, ": block_tokens must be 32 or 64");
  TORCH_CHECK(ops.n % block_rows == 0 && ops.n > 0 && ops.k % kStep == 0 && ops.k / kStep >= splits,
              op, ": n must be a multiple of ", block_rows, " and k of 128, at least 128 * splits, got ", ops.n,
              " x ", ops.k);
}

}  // namespace

at::Tensor fp8_gemm(const at::Tensor& xq, const at::Tensor& x_scale, const at::Tensor& weight,
                    const at::Tensor& w_scale, const std::optional<at::Tensor>& bias, int64_t splits,
                    int64_t block_tokens, int64_t block_rows, bool pdl) {
  const Fp8Operands ops = check_fp8_operands("fp8 gemm", xq, x_scale, weight, w_scale, bias);
  check_tiling("fp8 gemm", ops, splits, block_tokens, block_rows);
  const c10::cuda::CUDAGuard guard(xq.device());
  at::Tensor out = at::empty({ops.m, ops.n}, xq.options().dtype(at::kBFloat16));
  if (ops.m == 0) return out;
  const GemmParams p{ops, static_cast<__nv_bfloat16*>(out.data_ptr()), static_cast<int>(splits), RopeKV{}};
  if (block_rows == 64) {
    launch_rows<64>(p, static_cast<int>(block_tokens), current_stream(), pdl);
  } else {
    launch_rows<128>(p, static_cast<int>(block_tokens), current_stream(), pdl);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

at::Tensor fp8_gemm_qkv_rope(const at::Tensor& xq, const at::Tensor& x_scale, const at::Tensor& weight,
                             const at::Tensor& w_scale, const std::optional<at::Tensor>& bias, int64_t splits,
                             int64_t block_tokens, const at::Tensor& positions, const at::Tensor& cos_sin,
                             const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& slot_mapping,
                             int64_t num_heads, bool pdl) {
  const char* op = "fp8_gemm_qkv_rope";
  const Fp8Operands ops = check_fp8_operands(op, xq, x_scale, weight, w_scale, bias);
  check_tiling(op, ops, splits, block_tokens, 128);
  const c10::cuda::CUDAGuard guard(xq.device());
  at::Tensor q_out;
  const RopeKV rope = rope_kv_params(op, ops.m, xq.options().dtype(at::kBFloat16), ops.n, positions, cos_sin,
                                     k_cache, v_cache, slot_mapping, num_heads, q_out);
  if (ops.m == 0) return q_out;
  const GemmParams p{ops, nullptr, static_cast<int>(splits), rope};
  launch_rows<128, true>(p, static_cast<int>(block_tokens), current_stream(), pdl);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return q_out;
}

}  // namespace exlcli
