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
// moe_combine: out[t] = sum over the k slots of token t, in slot order, of weight * row (fp32; stored as fp32
// or rounded once to bf16): a fixed order, so a token's result does not depend on the batch (no atomics).
//
// moe_route: the router's choice, one warp a token: softmax over the experts then the top k (normalized or
// not), or the top k logits then a softmax over them; ties to the lower id as torch.topk gives them.
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

constexpr int64_t kPlanMaxShared = 44 * 1024;  // moe_plan's pairs' experts and experts' counts (4 bytes each)

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

// moe_gemm: the grouped product of many tokens (large decode batches, prefill). The pairs arrive sorted by expert
// (order), with each expert's first sorted position (expert_offsets [E + 1]) and its first token tile (tile_offsets
// [E + 1]: ceil(count / (8 NT)) tiles an expert, summed). Block (x, y) takes RT row tiles x RT .. and token tile y:
// it finds the expert whose tiles hold y (a binary search of tile_offsets), takes that expert's sorted pairs
// expert_offsets[e] + 8 NT (y - tile_offsets[e]) .. (at most 8 NT), and runs quant_linear_kernel's body over them:
// the rows of x gathered by pair (pair / rows_per_x), the weights offset by the expert, the outputs scattered to
// the pairs' rows. The grid's y is an upper bound of the tiles (known from the sizes alone, so there is no host
// sync: a CUDA graph captures it); blocks past the last tile return at once. A row's products are added in the
// order of quant_linear_kernel (chunks by warp, warps in order), whatever the tile or the other rows in it: each
// pair's row is the bytes of quant_linear's tensor-core kernel over that expert.
struct GroupedParams {
  const __nv_bfloat16* x;         // [rows, k] bf16, rows 16-byte aligned
  const uint32_t* qweight;        // [experts, expert_words]
  const uint32_t* scales;         // [experts, expert_scales]
  const int32_t* order;           // [pairs] the pairs sorted by expert
  const int32_t* expert_offsets;  // [experts + 1] each expert's first place in order
  const int32_t* tile_offsets;    // [experts + 1] each expert's first token tile
  void* out;                      // [pairs, n] bf16, or fp32 when FLOAT_OUT
  int n, k, group_log2;
  int rows_per_x;
  int experts;
  size_t expert_words, expert_scales;
};

// Token tile y of a plan: its expert (the one whose tiles hold y: a binary search of tile_offsets), its first
// place in the sorted pairs and its count of pairs (at most tile_tokens); false past the last tile.
__device__ __forceinline__ bool find_token_tile(const GroupedParams& gp, int y, int tile_tokens, int& expert,
                                                int& first, int& count) {
  if (y >= gp.tile_offsets[gp.experts]) return false;
  int lo = 0, hi = gp.experts;  // tile_offsets[lo] <= y < tile_offsets[hi]
  while (hi - lo > 1) {
    const int mid = (lo + hi) >> 1;
    if (gp.tile_offsets[mid] <= y) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  expert = lo;
  first = gp.expert_offsets[expert] + (y - gp.tile_offsets[expert]) * tile_tokens;
  count = min(tile_tokens, gp.expert_offsets[expert + 1] - first);
  return true;
}

// Tiles of 32 pairs keep to 128 registers a thread, so that two blocks share an SM (16 warps to hide the
// loads' latency); tiles of 64 take one block an SM.
template <int BITS, int NT, int RT, int UNROLL, bool FLOAT_OUT>
__global__ void __launch_bounds__(qlinear::kWarps * 32, NT <= 4 ? 2 : 1) moe_gemm_kernel(GroupedParams gp) {
  using namespace qlinear;
  constexpr int kTileTokens = 8 * NT;
  __shared__ float partial[kWarps][NT][4][32];
  __shared__ int pair_of[kTileTokens];
  grid_dependency_wait();  // the order and the offsets are the previous kernels' output, and x too
  int expert, first, count;
  if (!find_token_tile(gp, static_cast<int>(blockIdx.y), kTileTokens, expert, first, count)) return;
  for (int i = threadIdx.x; i < kTileTokens; i += kWarps * 32) pair_of[i] = i < count ? gp.order[first + i] : -1;
  __syncthreads();

  Params p{};
  p.qweight = gp.qweight + static_cast<size_t>(expert) * gp.expert_words;
  p.scales = gp.scales + static_cast<size_t>(expert) * gp.expert_scales;
  p.bias = nullptr;
  p.out = gp.out;
  p.m = count;
  p.n = gp.n;
  p.k = gp.k;
  p.group_log2 = gp.group_log2;

  const int tile0 = blockIdx.x * RT;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, t = lane & 3;
  const int chunks = p.k / kChunk;
  // the rows of x this thread reads: token g of each group of 8 (-1: none)
  int xrow[NT];
#pragma unroll
  for (int j = 0; j < NT; ++j) {
    const int pair = pair_of[8 * j + g];
    xrow[j] = pair < 0 ? -1 : pair / gp.rows_per_x;
  }

  float acc[RT][NT][4];
#pragma unroll
  for (int r = 0; r < RT; ++r) {
#pragma unroll
    for (int j = 0; j < NT; ++j) acc[r][j][0] = acc[r][j][1] = acc[r][j][2] = acc[r][j][3] = 0.0f;
  }

  for (int first_chunk = warp; first_chunk < chunks; first_chunk += kWarps * UNROLL) {
    ChunkLoad<BITS> loads[UNROLL][RT];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int chunk = first_chunk + u * kWarps;
      if (chunk < chunks) {
#pragma unroll
        for (int r = 0; r < RT; ++r) load_chunk<BITS>(p, tile0 + r, chunk, lane, loads[u][r]);
      }
    }
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int chunk = first_chunk + u * kWarps;
      if (chunk >= chunks) break;
      uint4 xv[NT][2];
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        if (xrow[j] >= 0) {
          const uint4* xp = reinterpret_cast<const uint4*>(gp.x + static_cast<size_t>(xrow[j]) * p.k +
                                                           chunk * kChunk + 16 * t);
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

  grid_dependents_launch();
  add_warp_partials<RT, NT>(acc, partial, 0, count, [&](int token, int r, int row_in_tile, float sum) {
    store_output<FLOAT_OUT>(p, pair_of[token], (tile0 + r) * kTileRows + row_in_tile, sum);
  });
}

template <int BITS, int NT, int RT>
void launch_moe_gemm_tiles(const GroupedParams& gp, int max_tiles, bool float_out, cudaStream_t stream, bool pdl) {
  const dim3 grid(gp.n / (qlinear::kTileRows * RT), max_tiles);
  const dim3 block(qlinear::kWarps * 32);
  if (float_out) {
    launch_pdl(moe_gemm_kernel<BITS, NT, RT, 2, true>, grid, block, 0, stream, pdl, gp);
  } else {
    launch_pdl(moe_gemm_kernel<BITS, NT, RT, 2, false>, grid, block, 0, stream, pdl, gp);
  }
}

// Token tiles of 32 (NT 4) or 64 (NT 8) pairs, as the caller counted them; two row tiles a block where the
// row tiles pair up (each activation fragment a warp loads serves both), else one. Every shape adds a row's
// products in the same order.
template <int BITS>
void launch_moe_gemm(const GroupedParams& gp, int tile_tokens, int max_tiles, bool float_out, cudaStream_t stream,
                     bool pdl) {
  const bool pairs = (gp.n / qlinear::kTileRows) % 2 == 0;
  if (tile_tokens == 32) {
    if (pairs) {
      launch_moe_gemm_tiles<BITS, 4, 2>(gp, max_tiles, float_out, stream, pdl);
    } else {
      launch_moe_gemm_tiles<BITS, 4, 1>(gp, max_tiles, float_out, stream, pdl);
    }
  } else if (pairs) {
    launch_moe_gemm_tiles<BITS, 8, 2>(gp, max_tiles, float_out, stream, pdl);
  } else {
    launch_moe_gemm_tiles<BITS, 8, 1>(gp, max_tiles, float_out, stream, pdl);
  }
}

template <typename Out>
__global__ void __launch_bounds__(256) moe_combine_kernel(const float* __restrict__ rows,
                                                          const float* __restrict__ weights,
                                                          Out* __restrict__ out, int tokens, int top_k, int n) {
  grid_dependency_wait();
  const size_t total = static_cast<size_t>(tokens) * n;
  const size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < total) {
    const size_t token = i / n, col = i - token * n;
    const size_t first = token * top_k;
    float sum = 0.0f;
    for (int j = 0; j < top_k; ++j) sum = fmaf(weights[first + j], rows[(first + j) * n + col], sum);
    if constexpr (std::is_same_v<Out, float>) {
      out[i] = sum;
    } else {
      out[i] = __float2bfloat16_rn(sum);  // the bytes of the fp32 sum's .to(bfloat16)
    }
  }
  grid_dependents_launch();
}

// moe_plan: plan_groups' plan in one launch of one block, for as many pairs as its shared memory holds
// (kPlanMaxShared: about 1,390 tokens of 8 over 128 experts), where torch takes a sort and half a dozen small
// kernels: each pair's expert and the experts' counts in shared memory (ids outside 0 .. E - 1 counted in a bucket
// after the last expert), the counts' and tiles' exclusive prefix sums over the block (each thread a run of
// experts), then pair i's place: its expert's first place plus the pairs of that expert before i (a stable counting
// sort: the order of torch.sort(stable=True) for valid ids).
constexpr int kPlanThreads = 1024;

// Exclusive prefix sums of two counts over the block's threads in thread order, and their totals. Every
// thread of the block calls it; sums: 33 slots of shared memory.
__device__ __forceinline__ int2 block_exclusive_scan2(int2 v, int2* sums, int2& total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  int2 inc = v;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int a = __shfl_up_sync(0xFFFFFFFFu, inc.x, o), b = __shfl_up_sync(0xFFFFFFFFu, inc.y, o);
    if (lane >= o) {
      inc.x += a;
      inc.y += b;
    }
  }
  if (lane == 31) sums[warp] = inc;
  __syncthreads();
  if (warp == 0) {
    const int2 w = lane < warps ? sums[lane] : make_int2(0, 0);
    int2 winc = w;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int a = __shfl_up_sync(0xFFFFFFFFu, winc.x, o), b = __shfl_up_sync(0xFFFFFFFFu, winc.y, o);
      if (lane >= o) {
        winc.x += a;
        winc.y += b;
      }
    }
    sums[lane] = make_int2(winc.x - w.x, winc.y - w.y);
    if (lane == 31) sums[32] = winc;
  }
  __syncthreads();
  total = sums[32];
  return make_int2(sums[warp].x + inc.x - v.x, sums[warp].y + inc.y - v.y);
}

__global__ void __launch_bounds__(kPlanThreads)
    moe_plan_kernel(const int32_t* __restrict__ ids, int pairs, int experts, int tile_tokens,
                    int32_t* __restrict__ order, int32_t* __restrict__ expert_offsets,
                    int32_t* __restrict__ tile_offsets) {
  extern __shared__ int s_plan[];
  int* s_expert = s_plan;          // [pairs] each pair's expert (experts: outside them)
  int* s_first = s_plan + pairs;   // [experts + 1] the counts, then each expert's first place
  __shared__ int2 sums[33];
  grid_dependency_wait();  // the ids are the router's output
  const int tid = threadIdx.x;
  for (int e = tid; e <= experts; e += blockDim.x) s_first[e] = 0;
  __syncthreads();
  for (int i = tid; i < pairs; i += blockDim.x) {
    int e = ids[i];
    if (e < 0 || e >= experts) e = experts;
    s_expert[i] = e;
    atomicAdd(&s_first[e], 1);
  }
  __syncthreads();
  const int per = (experts + blockDim.x - 1) / blockDim.x;
  const int first = min(experts, tid * per), last = min(experts, first + per);
  int2 run = make_int2(0, 0);
  for (int e = first; e < last; ++e) {
    const int count = s_first[e];
    run.x += count;
    run.y += (count + tile_tokens - 1) / tile_tokens;
  }
  int2 total;
  int2 at = block_exclusive_scan2(run, sums, total);  // its __syncthreads order the counts' reads before the writes
  for (int e = first; e < last; ++e) {
    const int count = s_first[e];
    expert_offsets[e] = at.x;
    tile_offsets[e] = at.y;
    s_first[e] = at.x;
    at.x += count;
    at.y += (count + tile_tokens - 1) / tile_tokens;
  }
  if (tid == 0) {
    expert_offsets[experts] = total.x;
    tile_offsets[experts] = total.y;
    s_first[experts] = total.x;
  }
  __syncthreads();
  for (int i = tid; i < pairs; i += blockDim.x) {
    const int e = s_expert[i];
    int rank = 0;
#pragma unroll 8
    for (int j = 0; j < i; ++j) rank += s_expert[j] == e ? 1 : 0;
    order[s_first[e] + rank] = i;
  }
  grid_dependents_launch();
}

constexpr int kRouteWarps = 4;  // tokens a block of moe_route
constexpr int kRouteMaxK = 32;  // one lane a chosen expert

// A float's place in torch.topk's order as an unsigned key, larger first: NaN above everything, -0 as +0.
__device__ __forceinline__ uint32_t topk_key(float v) {
  if (v != v) return 0xFFFFFFFFu;
  if (v == 0.0f) v = 0.0f;
  const uint32_t b = __float_as_uint(v);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// (value, id) as one unsigned 64-bit rank, larger first, equal values to the lower id; never 0.
__device__ __forceinline__ uint64_t topk_rank(float v, int id) {
  return (static_cast<uint64_t>(topk_key(v)) << 32) | static_cast<uint64_t>(~static_cast<uint32_t>(id));
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xFFFFFFFFu, v, o));
  return v;
}

// A butterfly: every lane ends with the same bytes (each step adds the same two values on both lanes).
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xFFFFFFFFu, v, o);
  return v;
}

__device__ __forceinline__ uint64_t warp_max_u64(uint64_t v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const uint64_t other = __shfl_xor_sync(0xFFFFFFFFu, v, o);
    v = other > v ? other : v;
  }
  return v;
}

// One warp a token: SOFTMAX_FIRST (softmax_topk) takes each expert's probability exp(l - max) / sum (the
// operations of torch's softmax, so equal probabilities tie as they tie there) and the top k of those, divided
// by their sum when `normalize`; otherwise (topk_softmax) the top k logits, then a softmax over them. Round j
// of the selection takes the best (value, id) below round j - 1's, so no expert is taken twice and a tie goes
// to the lower id; lane j keeps slot j.
template <bool SOFTMAX_FIRST>
__global__ void __launch_bounds__(kRouteWarps * 32)
    moe_route_kernel(const float* __restrict__ logits, float* __restrict__ weights, int32_t* __restrict__ ids,
                     int tokens, int experts, int top_k, bool normalize) {
  grid_dependency_wait();  // the logits are the router's output
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int token = blockIdx.x * kRouteWarps + warp;
  if (token < tokens) {
    const float* row = logits + static_cast<size_t>(token) * experts;
    float top = 0.0f, total = 1.0f;
    if constexpr (SOFTMAX_FIRST) {
      top = -INFINITY;
      for (int e = lane; e < experts; e += 32) top = fmaxf(top, row[e]);
      top = warp_max(top);
      total = 0.0f;
      for (int e = lane; e < experts; e += 32) total += expf(row[e] - top);
      total = warp_sum(total);
    }
    auto value = [&](int e) { return SOFTMAX_FIRST ? expf(row[e] - top) / total : row[e]; };
    uint64_t last = 0;  // round j - 1's rank (round 0 has no bound: a NaN of expert 0 ranks ~0)
    int mine = 0;
    for (int j = 0; j < top_k; ++j) {
      uint64_t best = 0;
      for (int e = lane; e < experts; e += 32) {
        const uint64_t rank = topk_rank(value(e), e);
        if ((j == 0 || rank < last) && rank > best) best = rank;
      }
      best = warp_max_u64(best);
      last = best;
      if (lane == j) mine = static_cast<int>(~static_cast<uint32_t>(best));
    }
    const bool slot = lane < top_k;
    float w = slot ? value(mine) : 0.0f;
    if constexpr (SOFTMAX_FIRST) {
      if (normalize) w = w / warp_sum(w);
    } else {  // softmax over the k logits; slot 0 holds the largest
      const float lead = __shfl_sync(0xFFFFFFFFu, w, 0);
      const float ex = slot ? expf(w - lead) : 0.0f;
      w = ex / warp_sum(ex);
    }
    if (slot) {
      weights[static_cast<size_t>(token) * top_k + lane] = w;
      ids[static_cast<size_t>(token) * top_k + lane] = mine;
    }
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

namespace {

// moe_gemm's checks of a plan over stacked experts, and its GroupedParams (out unset).
GroupedParams grouped_params(const char* op, const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                             int64_t bits, int64_t group, int64_t n, const at::Tensor& order,
                             const at::Tensor& expert_offsets, const at::Tensor& tile_offsets, int64_t max_tiles,
                             int64_t rows_per_x) {
  TORCH_CHECK(qweight.is_cuda() && scales.is_cuda() && order.is_cuda(), op,
              ": qweight, scales and order must be CUDA tensors");
  TORCH_CHECK(x.is_cuda() && x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous() &&
                  aligned16(x.data_ptr()),
              op, ": x must be a contiguous, 16-byte aligned CUDA bfloat16 [rows, k]");
  TORCH_CHECK(bits == 4 || bits == 6 || bits == 8, op, ": bits must be 4, 6 or 8, got ", bits);
  TORCH_CHECK(group == 16 || group == 32 || group == 64 || group == 128, op, ": group must be 16, 32, 64 or 128");
  const int64_t k = x.size(1);
  TORCH_CHECK(n % qlinear::kTileRows == 0 && k % qlinear::kChunk == 0 && n > 0 && k > 0 && n / 16 <= 65535, op,
              ": n must be a multiple of 16 (at most 1,048,560) and k of 64, got ", n, " x ", k);
  TORCH_CHECK(qweight.dim() == 2 && qweight.scalar_type() == at::kInt && qweight.is_contiguous() &&
                  qweight.size(1) == n * k * bits / 32 && qweight.size(0) > 0,
              op, ": qweight must be contiguous int32 [experts, ", n * k * bits / 32, "]");
  const int64_t experts = qweight.size(0);
  TORCH_CHECK(scales.is_contiguous() && scales.size(0) == experts &&
                  scales.numel() * scales.element_size() == experts * n * (k / group) * 4,
              op, ": scales must be contiguous [experts, ...] with ", n * (k / group) * 4, " bytes an expert");
  TORCH_CHECK(aligned16(qweight.data_ptr()) && aligned16(scales.data_ptr()), op,
              ": qweight and scales must be 16-byte aligned");
  TORCH_CHECK(order.dim() == 1 && order.scalar_type() == at::kInt && order.is_contiguous(), op,
              ": order must be a contiguous int32 [pairs]");
  const int64_t pairs = order.size(0);
  TORCH_CHECK(rows_per_x >= 1 && pairs == x.size(0) * rows_per_x, op, ": order must hold rows_per_x (", rows_per_x,
              ") pairs a row of x (", x.size(0), " rows), got ", pairs);
  TORCH_CHECK(pairs < (int64_t{1} << 31), op, ": too many pairs");
  for (const at::Tensor* offsets : {&expert_offsets, &tile_offsets}) {
    TORCH_CHECK(offsets->is_cuda() && offsets->dim() == 1 && offsets->scalar_type() == at::kInt &&
                    offsets->is_contiguous() && offsets->size(0) == experts + 1,
                op, ": the offsets must be contiguous int32 [experts + 1]");
    TORCH_CHECK(offsets->device() == x.device(), op, ": every tensor must be on one device");
  }
  TORCH_CHECK(max_tiles >= 0 && max_tiles < (int64_t{1} << 31), op, ": max_tiles must be 0 to 2^31 - 1, got ",
              max_tiles);
  TORCH_CHECK(x.device() == qweight.device() && x.device() == scales.device() && x.device() == order.device(), op,
              ": every tensor must be on one device");
  GroupedParams gp{};
  gp.x = static_cast<const __nv_bfloat16*>(x.data_ptr());
  gp.qweight = static_cast<const uint32_t*>(qweight.data_ptr());
  gp.scales = static_cast<const uint32_t*>(scales.data_ptr());
  gp.order = static_cast<const int32_t*>(order.data_ptr());
  gp.expert_offsets = static_cast<const int32_t*>(expert_offsets.data_ptr());
  gp.tile_offsets = static_cast<const int32_t*>(tile_offsets.data_ptr());
  gp.n = static_cast<int>(n);
  gp.k = static_cast<int>(k);
  gp.group_log2 = group == 16 ? 4 : group == 32 ? 5 : group == 64 ? 6 : 7;
  gp.rows_per_x = static_cast<int>(rows_per_x);
  gp.experts = static_cast<int>(experts);
  gp.expert_words = static_cast<size_t>(n * k * bits / 32);
  gp.expert_scales = static_cast<size_t>(n * (k / group));
  return gp;
}

}  // namespace

at::Tensor moe_gemm(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales, int64_t bits,
                    int64_t group, int64_t n, const at::Tensor& order, const at::Tensor& expert_offsets,
                    const at::Tensor& tile_offsets, int64_t tile_tokens, int64_t max_tiles, int64_t rows_per_x,
                    bool float_out, bool pdl) {
  const char* op = "moe_gemm";
  GroupedParams gp = grouped_params(op, x, qweight, scales, bits, group, n, order, expert_offsets, tile_offsets,
                                    max_tiles, rows_per_x);
  TORCH_CHECK(tile_tokens == 32 || tile_tokens == 64, op, ": tile_tokens must be 32 or 64, got ", tile_tokens);
  TORCH_CHECK(max_tiles <= 65535, op, ": max_tiles must be 0 to 65535, got ", max_tiles);
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t pairs = order.size(0);
  at::Tensor out = at::empty({pairs, n}, x.options().dtype(float_out ? at::kFloat : at::kBFloat16));
  if (pairs == 0 || max_tiles == 0) return out;
  gp.out = out.data_ptr();
  const cudaStream_t stream = current_stream();
  const int tiles = static_cast<int>(max_tiles), tokens = static_cast<int>(tile_tokens);
  if (bits == 4) {
    launch_moe_gemm<4>(gp, tokens, tiles, float_out, stream, pdl);
  } else if (bits == 6) {
    launch_moe_gemm<6>(gp, tokens, tiles, float_out, stream, pdl);
  } else {
    launch_moe_gemm<8>(gp, tokens, tiles, float_out, stream, pdl);
  }
  return out;
}

at::Tensor moe_combine(const at::Tensor& rows, const at::Tensor& weights, int64_t top_k, bool bf16_out, bool pdl) {
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
  at::Tensor out = at::empty({tokens, n}, rows.options().dtype(bf16_out ? at::kBFloat16 : at::kFloat));
  const int64_t total = tokens * n;
  if (total == 0) return out;
  TORCH_CHECK(total < (int64_t{1} << 31) * 256, op, ": too many outputs");
  const dim3 grid(static_cast<unsigned>((total + 255) / 256));
  const float* r = static_cast<const float*>(rows.data_ptr());
  const float* w = static_cast<const float*>(weights.data_ptr());
  if (bf16_out) {
    launch_pdl(moe_combine_kernel<__nv_bfloat16>, grid, dim3(256), 0, current_stream(), pdl, r, w,
               static_cast<__nv_bfloat16*>(out.data_ptr()), static_cast<int>(tokens), static_cast<int>(top_k),
               static_cast<int>(n));
  } else {
    launch_pdl(moe_combine_kernel<float>, grid, dim3(256), 0, current_stream(), pdl, r, w,
               static_cast<float*>(out.data_ptr()), static_cast<int>(tokens), static_cast<int>(top_k),
               static_cast<int>(n));
  }
  return out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> moe_plan(const at::Tensor& ids, int64_t experts, int64_t tile_tokens,
                                                         bool pdl) {
  const char* op = "moe_plan";
  EXL_CHECK_CUDA_TENSOR(ids, "moe_plan: ids");
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == at::kInt && ids.is_contiguous(), op,
              ": ids must be a contiguous int32 [pairs]");
  TORCH_CHECK(experts >= 1 && tile_tokens >= 1, op, ": experts and tile_tokens must be positive");
  const int64_t pairs = ids.size(0);
  const int64_t smem = (pairs + experts + 1) * static_cast<int64_t>(sizeof(int));
  TORCH_CHECK(smem <= kPlanMaxShared, op, ": ", pairs, " pairs over ", experts, " experts do not fit one block's ",
              kPlanMaxShared, " bytes of shared memory");
  const c10::cuda::CUDAGuard guard(ids.device());
  at::Tensor order = at::empty({pairs}, ids.options());
  at::Tensor expert_offsets = at::empty({experts + 1}, ids.options());
  at::Tensor tile_offsets = at::empty({experts + 1}, ids.options());
  launch_pdl(moe_plan_kernel, dim3(1), dim3(kPlanThreads), static_cast<size_t>(smem), current_stream(), pdl,
             static_cast<const int32_t*>(ids.data_ptr()), static_cast<int>(pairs), static_cast<int>(experts),
             static_cast<int>(tile_tokens), static_cast<int32_t*>(order.data_ptr()),
             static_cast<int32_t*>(expert_offsets.data_ptr()), static_cast<int32_t*>(tile_offsets.data_ptr()));
  return {order, expert_offsets, tile_offsets};
}

std::tuple<at::Tensor, at::Tensor> moe_route(const at::Tensor& logits, int64_t top_k, bool softmax_first,
                                             bool normalize, bool pdl) {
  const char* op = "moe_route";
  EXL_CHECK_CUDA_TENSOR(logits, "moe_route: logits");
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.is_contiguous(), op,
              ": logits must be a contiguous float32 [tokens, experts]");
  const int64_t tokens = logits.size(0), experts = logits.size(1);
  TORCH_CHECK(top_k >= 1 && top_k <= kRouteMaxK && top_k <= experts, op, ": top_k must be 1 to ",
              kRouteMaxK, " and at most the experts (", experts, "), got ", top_k);
  TORCH_CHECK(experts < (int64_t{1} << 31) && tokens < (int64_t{1} << 31) / kRouteWarps, op, ": too many logits");
  const c10::cuda::CUDAGuard guard(logits.device());
  at::Tensor weights = at::empty({tokens, top_k}, logits.options());
  at::Tensor ids = at::empty({tokens, top_k}, logits.options().dtype(at::kInt));
  if (tokens == 0) return {weights, ids};
  const dim3 grid(static_cast<unsigned>((tokens + kRouteWarps - 1) / kRouteWarps));
  const auto kernel = softmax_first ? moe_route_kernel<true> : moe_route_kernel<false>;
  launch_pdl(kernel, grid, dim3(kRouteWarps * 32), 0, current_stream(), pdl,
             static_cast<const float*>(logits.data_ptr()), static_cast<float*>(weights.data_ptr()),
             static_cast<int32_t*>(ids.data_ptr()), static_cast<int>(tokens), static_cast<int>(experts),
             static_cast<int>(top_k), normalize);
  return {weights, ids};
}

// ---- the fused pairs path: gate|up with its activation, then down with the weighted sum ----------------------------
//
// moe_gate_up_act: block (i, j) takes pair order[i] (or i) and gate row tile j with its up row tile j + I / 16 (the
// stacked gate|up is [gate; up], 2I rows), runs moe_gemv's body over both tiles (the warps and ring that moe_gemv
// gives gate|up: each tile's sums are moe_gemv's bytes), and stores the activation of the 16 (gate, up) rows as bf16
// into act [pairs, I]: each fp32 sum plus the expert's bias (when there is one) rounded once to bf16, then SiLU-and-mul
// as silu_and_mul computes it (silu_mul) or gpt-oss's clamped SwiGLU as activation.swiglu_clamped's torch ops compute
// it (fp32, each step rounded as torch's kernels round it): the bytes of moe_gemv, the bias add and the activation
// kernel in sequence.
//
// moe_down_combine: block (t, y) takes token t and output row tile y over all of its k slots at once, and writes
// out[t] row tile y = sum over slots in order of weight * (down row + bias): moe_gemv's down rows (8 warps, fp32), the
// bias add and moe_combine in one launch, with the same bytes. Each slot's row is moe_gemv's: its chunks split over 8
// "virtual warps" (chunk c to c % 8), each adding its chunks in order and the 8 partial sums added in order; here the
// block's 16 or 8 warps share the k x 8 (slot, virtual warp) tasks (task v k + s to warp (v k + s) % warps, which
// balances the tasks of 2 and of 1 chunks when there are 12 chunks), each walking its tasks' chunks with a ring of loads in
// flight across tasks, so a block reads all k experts' row tiles at once (k times moe_gemv's bytes in flight a block,
// on a grid of tokens x row tiles). No atomics, no counters: a token's result is its own block's, in a fixed order.
namespace {

constexpr int kFusedVirtualWarps = 8;   // moe_gemv's warps for fp32 rows (launch_moe_gemv): the down sums' split
// the down kernel's warps sharing a block's (slot, virtual warp) tasks: 16 (one block an SM, every load of a block in
// flight at once) where the grid is one wave, else 8 (two blocks an SM, so that one's loads overlap the other's sums)
constexpr int kFusedDownWarpsWide = 16, kFusedDownWarpsNarrow = 8;
constexpr int64_t kFusedMaxShared = 44 * 1024;  // the down kernel's dynamic shared memory (limits.MOE_FUSED_MAX_SHARED)
constexpr int kActSilu = 0, kActSwigluClamped = 1;

// The down kernel's dynamic shared memory: each slot's int8 blocks of its activation row and their (d, sum) pairs,
// then the (slot, virtual warp) partial sums of a row tile.
__host__ __device__ constexpr size_t fused_down_smem_bytes(int top_k, int k) {
  return static_cast<size_t>(top_k) * qlinear::dp4a_smem_bytes(1, k) +
         static_cast<size_t>(top_k) * kFusedVirtualWarps * qlinear::kTileRows * sizeof(float);
}

struct GateUpActParams {
  const __nv_bfloat16* x;     // [tokens, k] bf16, rows 16-byte aligned
  const uint32_t* qweight;    // [experts, expert_words]: gate|up, 2 inter rows
  const uint32_t* scales;     // [experts, expert_scales]
  const __nv_bfloat16* bias;  // [experts, 2 inter] or null
  const int32_t* ids;         // [pairs]
  const int32_t* order;       // [pairs] or null
  __nv_bfloat16* act;         // [pairs, inter]
  int inter, k, group_log2, rows_per_x, experts;
  size_t expert_words, expert_scales;
  float limit, alpha;
};

// gpt-oss's clamped SwiGLU of one bf16 (gate, up) pair, as activation.swiglu_clamped's torch ops compute it in fp32:
// gate.clamp(max=limit), up.clamp(-limit, limit) (a NaN kept, as torch's clamp keeps it), sigmoid(alpha * gate) as
// torch's 1 / (1 + exp(-z)), gate * sigmoid, times (up + 1), rounded once to bf16.
__device__ __forceinline__ __nv_bfloat16 swiglu_clamped_pair(__nv_bfloat16 gate, __nv_bfloat16 up, float limit,
                                                            float alpha) {
  float g = __bfloat162float(gate), u = __bfloat162float(up);
  g = g > limit ? limit : g;
  u = u > limit ? limit : (u < -limit ? -limit : u);
  const float z = __fmul_rn(alpha, g);
  const float sig = __fdiv_rn(1.0f, __fadd_rn(1.0f, expf(-z)));
  return __float2bfloat16_rn(__fmul_rn(__fmul_rn(g, sig), __fadd_rn(u, 1.0f)));
}

// Row tiles j (gate) and j + I / 16 (up) of the block's pair; store: the activation of their rows into act.
template <int ACT>
struct GluTiles {
  int gate_tiles;                  // I / 16
  const __nv_bfloat16* bias;       // the expert's [2 inter] or null
  __nv_bfloat16* act;              // the pair's row [inter]
  float limit, alpha;

  __device__ __forceinline__ int tile(int r) const { return r == 0 ? blockIdx.y : blockIdx.y + gate_tiles; }

  template <bool FLOAT_OUT, int WARPS, int M>
  __device__ __forceinline__ void store(const qlinear::Params&,
                                        const float (&partial)[WARPS][2][M][qlinear::kTileRows]) const {
    static_assert(M == 1, "one row a pair");
    for (int i = threadIdx.x; i < qlinear::kTileRows; i += WARPS * 32) {
      float gate = 0.0f, up = 0.0f;
#pragma unroll
      for (int w = 0; w < WARPS; ++w) gate += partial[w][0][0][i];
#pragma unroll
      for (int w = 0; w < WARPS; ++w) up += partial[w][1][0][i];
      const int col = blockIdx.y * qlinear::kTileRows + i;
      if (bias != nullptr) {
        gate = __fadd_rn(gate, __bfloat162float(bias[col]));
        up = __fadd_rn(up, __bfloat162float(bias[gate_tiles * qlinear::kTileRows + col]));
      }
      const __nv_bfloat16 g = __float2bfloat16_rn(gate), u = __float2bfloat16_rn(up);
      if constexpr (ACT == kActSilu) {
        act[col] = silu_mul(g, u);
      } else {
        act[col] = swiglu_clamped_pair(g, u, limit, alpha);
      }
    }
  }
};

template <int BITS, int UNROLL, int WARPS, int ACT>
__global__ void __launch_bounds__(WARPS * 32) moe_gate_up_act_kernel(GateUpActParams gp) {
  grid_dependency_wait();  // the ids and the order are the previous kernels' output
  const int pair = gp.order != nullptr ? gp.order[blockIdx.x] : static_cast<int>(blockIdx.x);
  const int expert = gp.ids[pair];
  __nv_bfloat16* act = gp.act + static_cast<size_t>(pair) * gp.inter;
  if (expert < 0 || expert >= gp.experts) {  // not an expert: NaN activations, never a read out of bounds
    if (threadIdx.x < qlinear::kTileRows) {
      act[blockIdx.y * qlinear::kTileRows + threadIdx.x] = __ushort_as_bfloat16(0x7fc0);
    }
    return;
  }
  qlinear::Params p{};
  p.x = gp.x + static_cast<size_t>(pair / gp.rows_per_x) * gp.k;
  p.qweight = gp.qweight + static_cast<size_t>(expert) * gp.expert_words;
  p.scales = gp.scales + static_cast<size_t>(expert) * gp.expert_scales;
  p.bias = nullptr;
  p.out = nullptr;  // GluTiles stores
  p.m = 1;
  p.n = 2 * gp.inter;
  p.k = gp.k;
  p.group_log2 = gp.group_log2;
  GluTiles<ACT> tiles{gp.inter / qlinear::kTileRows,
                      gp.bias != nullptr ? gp.bias + static_cast<size_t>(expert) * 2 * gp.inter : nullptr, act,
                      gp.limit, gp.alpha};
  qlinear::dp4a_gemv<BITS, 1, 2, UNROLL, false, WARPS>(p, tiles);
}

// moe_gemv's warps for gate|up (launch_moe_gemv): fp32 rows (a bias to add) 8 warps, bf16 rows 16 for at most 256
// row tiles of 2 inter rows, else 8; the ring as deep as there (it changes no result).
template <int BITS, int ACT>
void launch_gate_up_act(const GateUpActParams& gp, int pairs, cudaStream_t stream, bool pdl) {
  const dim3 grid(pairs, gp.inter / qlinear::kTileRows);
  const size_t smem = qlinear::dp4a_smem_bytes(1, gp.k);
  const int tiles = 2 * gp.inter / qlinear::kTileRows;
  if (gp.bias == nullptr && tiles <= kDp4aWideMaxTiles) {
    launch_pdl(moe_gate_up_act_kernel<BITS, 2, 16, ACT>, grid, dim3(16 * 32), smem, stream, pdl, gp);
  } else {
    launch_pdl(moe_gate_up_act_kernel<BITS, 4, 8, ACT>, grid, dim3(8 * 32), smem, stream, pdl, gp);
  }
}

struct DownCombineParams {
  const __nv_bfloat16* act;   // [tokens * top_k, k] bf16, rows 16-byte aligned
  const uint32_t* qweight;    // [experts, expert_words]: down, n rows
  const uint32_t* scales;     // [experts, expert_scales]
  const __nv_bfloat16* bias;  // [experts, n] or null
  const int32_t* ids;         // [tokens * top_k]
  const float* weights;       // [tokens * top_k]
  void* out;                  // [tokens, n] fp32, or bf16 (BF16_OUT)
  int n, k, group_log2, top_k, experts;
  size_t expert_words, expert_scales;
};

// A warp's place in its walk over its (slot, virtual warp) tasks: task v k + s (virtual warp v, slot s) and one of
// its chunks (v, v + 8, ...); tasks whose virtual warp has no chunk (fewer than 8 chunks) are skipped (their
// partial sums stay 0, as moe_gemv's idle warps add 0).
struct TaskCursor {
  int task, chunk;

  __device__ __forceinline__ void settle(int tasks, int top_k, int chunks, int step) {
    while (task < tasks && task / top_k >= chunks) task += step;
    chunk = task / top_k;
  }
  __device__ __forceinline__ void advance(int tasks, int top_k, int chunks, int step) {
    chunk += kFusedVirtualWarps;
    if (chunk >= chunks) {
      task += step;
      settle(tasks, top_k, chunks, step);
    }
  }
};

template <int BITS>
__device__ __forceinline__ void load_task_chunk(const DownCombineParams& dp, int token, int tile,
                                                const TaskCursor& at, int lane, qlinear::ChunkLoad<BITS>& c) {
  const int expert = dp.ids[static_cast<size_t>(token) * dp.top_k + at.task % dp.top_k];
  if (expert < 0 || expert >= dp.experts) {  // its row is NaN in the end: nothing read
    c = qlinear::ChunkLoad<BITS>{};
    return;
  }
  qlinear::Params p{};
  p.qweight = dp.qweight + static_cast<size_t>(expert) * dp.expert_words;
  p.scales = dp.scales + static_cast<size_t>(expert) * dp.expert_scales;
  p.k = dp.k;
  p.group_log2 = dp.group_log2;
  qlinear::load_chunk<BITS>(p, tile, at.chunk, lane, c);
}

template <int BITS, int UNROLL, int WARPS, bool BF16_OUT>
__global__ void __launch_bounds__(WARPS * 32) moe_down_combine_kernel(DownCombineParams dp) {
  using namespace qlinear;
  extern __shared__ uint4 s_x[];
  const int token = blockIdx.x, tile = blockIdx.y;
  const int top_k = dp.top_k;
  const int blocks = dp.k / kXBlock;
  const int chunks = dp.k / kChunk;
  const int tasks = kFusedVirtualWarps * top_k;
  uint4* xq = s_x;
  float2* xs = reinterpret_cast<float2*>(s_x + top_k * blocks);
  float* partial = reinterpret_cast<float*>(xs + top_k * blocks);  // [top_k][8][16]
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, t = lane & 3;

  grid_dependency_wait();  // the ids, the weights and the activations are the previous kernels' output
  int mine = 0;  // this warp's chunks over its tasks
  for (int task = warp; task < tasks; task += WARPS) {
    const int v = task / top_k;
    if (v < chunks) mine += (chunks - v + kFusedVirtualWarps - 1) / kFusedVirtualWarps;
  }
  TaskCursor load_at{warp, 0};
  load_at.settle(tasks, top_k, chunks, WARPS);
  TaskCursor at = load_at;
  ChunkLoad<BITS> ring[UNROLL];
#pragma unroll
  for (int u = 0; u < UNROLL; ++u) {
    if (u < mine) {
      load_task_chunk<BITS>(dp, token, tile, load_at, lane, ring[u]);
      load_at.advance(tasks, top_k, chunks, WARPS);
    }
  }
  for (int i = threadIdx.x; i < tasks * kTileRows; i += WARPS * 32) partial[i] = 0.0f;
  quantize_x16_rows(dp.act + static_cast<size_t>(token) * top_k * dp.k, top_k, dp.k, xq, xs);
  __syncthreads();

  float y0 = 0.0f, y1 = 0.0f;  // rows g and g + 8 of the current task
  for (int base = 0; base < mine; base += UNROLL) {
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int i = base + u;
      if (i >= mine) break;
      const int slot = at.task % top_k;
      const int b = slot * blocks + at.chunk * (kChunk / kXBlock) + t;  // the lane's 16 features of the slot's row
      const uint4 xw = xq[b];
      const float2 ds = xs[b];
      int dot_lo = 0, dot_hi = 0;
#pragma unroll
      for (int step = 0; step < 4; ++step) {
        uint32_t lo, hi;
        step_bytes<BITS>(ring[u], step, lo, hi);
        const uint32_t xv = step == 0 ? xw.x : step == 1 ? xw.y : step == 2 ? xw.z : xw.w;
        dot_lo = dp4a_us(lo, xv, dot_lo);
        dot_hi = dp4a_us(hi, xv, dot_hi);
      }
      // dp4a_gemv's steps, in its order
      const float2 a_lo = row_affine<BITS>(ring[u].lo), a_hi = row_affine<BITS>(ring[u].hi);
      y0 = fmaf(ds.x, fmaf(a_lo.x, static_cast<float>(dot_lo), a_lo.y * ds.y), y0);
      y1 = fmaf(ds.x, fmaf(a_hi.x, static_cast<float>(dot_hi), a_hi.y * ds.y), y1);
      if (at.chunk + kFusedVirtualWarps >= chunks) {  // the task's last chunk: its partial sums (warp-uniform)
        y0 += __shfl_xor_sync(0xFFFFFFFFu, y0, 1);
        y0 += __shfl_xor_sync(0xFFFFFFFFu, y0, 2);
        y1 += __shfl_xor_sync(0xFFFFFFFFu, y1, 1);
        y1 += __shfl_xor_sync(0xFFFFFFFFu, y1, 2);
        float* row = partial + (slot * kFusedVirtualWarps + at.task / top_k) * kTileRows;
        if (t == 0) {
          row[g] = y0;
          row[g + 8] = y1;
        }
        y0 = y1 = 0.0f;
      }
      at.advance(tasks, top_k, chunks, WARPS);
      if (i + UNROLL < mine) {
        load_task_chunk<BITS>(dp, token, tile, load_at, lane, ring[u]);
        load_at.advance(tasks, top_k, chunks, WARPS);
      }
    }
  }
  grid_dependents_launch();
  __syncthreads();

  // each row: the slots in order, each its virtual warps' sums in order (moe_gemv's row), plus its bias (the
  // fp32 add of StackedWeights.biased), times its weight into the sum (moe_combine's fmaf)
  if (threadIdx.x < kTileRows) {
    const int row = tile * kTileRows + threadIdx.x;
    const size_t first = static_cast<size_t>(token) * top_k;
    float sum = 0.0f;
    for (int s = 0; s < top_k; ++s) {
      const int expert = dp.ids[first + s];
      float value = 0.0f;
#pragma unroll
      for (int v = 0; v < kFusedVirtualWarps; ++v) value += partial[(s * kFusedVirtualWarps + v) * kTileRows + threadIdx.x];
      if (expert < 0 || expert >= dp.experts) {
        value = __int_as_float(0x7fc00000);
      } else if (dp.bias != nullptr) {
        value = __fadd_rn(value, __bfloat162float(dp.bias[static_cast<size_t>(expert) * dp.n + row]));
      }
      sum = fmaf(dp.weights[first + s], value, sum);
    }
    const size_t at_out = static_cast<size_t>(token) * dp.n + row;
    if constexpr (BF16_OUT) {
      static_cast<__nv_bfloat16*>(dp.out)[at_out] = __float2bfloat16_rn(sum);
    } else {
      static_cast<float*>(dp.out)[at_out] = sum;
    }
  }
}

// The ring: 8 chunks in flight a warp for 4- and 6-bit weights, 4 for 8-bit (40 registers of loads). warps: 16, 8,
// or 0 (16 where the grid fits one block an SM, else 8). Neither changes a result.
template <int BITS>
void launch_down_combine(const DownCombineParams& dp, int tokens, bool bf16_out, int warps, cudaStream_t stream,
                         bool pdl) {
  constexpr int kUnroll = BITS == 8 ? 4 : 8;
  const dim3 grid(tokens, dp.n / qlinear::kTileRows);
  const size_t smem = fused_down_smem_bytes(dp.top_k, dp.k);
  if (warps == 0) {
    int device = 0, sms = 0;
    C10_CUDA_CHECK(cudaGetDevice(&device));
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
    warps = static_cast<int64_t>(tokens) * (dp.n / qlinear::kTileRows) <= sms ? kFusedDownWarpsWide
                                                                              : kFusedDownWarpsNarrow;
  }
  if (warps == kFusedDownWarpsWide) {
    constexpr int W = kFusedDownWarpsWide;
    if (bf16_out) {
      launch_pdl(moe_down_combine_kernel<BITS, kUnroll, W, true>, grid, dim3(W * 32), smem, stream, pdl, dp);
    } else {
      launch_pdl(moe_down_combine_kernel<BITS, kUnroll, W, false>, grid, dim3(W * 32), smem, stream, pdl, dp);
    }
  } else {
    constexpr int W = kFusedDownWarpsNarrow;
    if (bf16_out) {
      launch_pdl(moe_down_combine_kernel<BITS, kUnroll, W, true>, grid, dim3(W * 32), smem, stream, pdl, dp);
    } else {
      launch_pdl(moe_down_combine_kernel<BITS, kUnroll, W, false>, grid, dim3(W * 32), smem, stream, pdl, dp);
    }
  }
}

// The checks moe_gemv makes of stacked experts and their x; returns k.
int64_t check_stacked(const char* op, const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                      int64_t bits, int64_t group, int64_t n) {
  EXL_CHECK_CUDA_TENSOR(qweight, "moe: qweight");
  EXL_CHECK_CUDA_TENSOR(scales, "moe: scales");
  TORCH_CHECK(x.is_cuda() && x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous() &&
                  aligned16(x.data_ptr()),
              op, ": x must be a contiguous, 16-byte aligned CUDA bfloat16 [rows, k]");
  TORCH_CHECK(bits == 4 || bits == 6 || bits == 8, op, ": bits must be 4, 6 or 8, got ", bits);
  TORCH_CHECK(group == 16 || group == 32 || group == 64 || group == 128, op, ": group must be 16, 32, 64 or 128");
  const int64_t k = x.size(1);
  TORCH_CHECK(n % qlinear::kTileRows == 0 && k % qlinear::kChunk == 0 && n > 0 && k > 0 && n / 16 <= 65535, op,
              ": n must be a multiple of 16 (at most 1,048,560) and k of 64, got ", n, " x ", k);
  TORCH_CHECK(qweight.dim() == 2 && qweight.scalar_type() == at::kInt && qweight.is_contiguous() &&
                  qweight.size(1) == n * k * bits / 32 && qweight.size(0) > 0,
              op, ": qweight must be contiguous int32 [experts, ", n * k * bits / 32, "]");
  const int64_t experts = qweight.size(0);
  TORCH_CHECK(scales.is_contiguous() && scales.size(0) == experts &&
                  scales.numel() * scales.element_size() == experts * n * (k / group) * 4,
              op, ": scales must be contiguous [experts, ...] with ", n * (k / group) * 4, " bytes an expert");
  TORCH_CHECK(aligned16(qweight.data_ptr()) && aligned16(scales.data_ptr()), op,
              ": qweight and scales must be 16-byte aligned");
  TORCH_CHECK(x.device() == qweight.device() && x.device() == scales.device(), op,
              ": every tensor must be on one device");
  return k;
}

void check_expert_bias(const char* op, const std::optional<at::Tensor>& bias, int64_t experts, int64_t n,
                       const at::Tensor& x) {
  if (!bias.has_value()) return;
  TORCH_CHECK(bias->is_cuda() && bias->device() == x.device() && bias->scalar_type() == at::kBFloat16 &&
                  bias->is_contiguous() && bias->dim() == 2 && bias->size(0) == experts && bias->size(1) == n,
              op, ": bias must be a contiguous bfloat16 [", experts, ", ", n, "] on x's device");
}

}  // namespace

at::Tensor moe_gate_up_act(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales, int64_t bits,
                           int64_t group, int64_t inter, const at::Tensor& ids, const std::optional<at::Tensor>& order,
                           int64_t rows_per_x, const std::optional<at::Tensor>& bias, int64_t activation,
                           double limit, double alpha, bool pdl) {
  const char* op = "moe_gate_up_act";
  TORCH_CHECK(inter > 0 && inter % qlinear::kTileRows == 0 && inter / qlinear::kTileRows <= 65535, op,
              ": inter must be a positive multiple of 16 (at most 1,048,560), got ", inter);
  const int64_t k = check_stacked(op, x, qweight, scales, bits, group, 2 * inter);
  TORCH_CHECK(qlinear::dp4a_smem_bytes(1, static_cast<int>(k)) <= 44 * 1024, op, ": k is too large: ", k);
  const int64_t experts = qweight.size(0);
  EXL_CHECK_CUDA_TENSOR(ids, "moe_gate_up_act: ids");
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == at::kInt && ids.is_contiguous() && ids.device() == x.device(),
              op, ": ids must be a contiguous int32 [pairs] on x's device");
  const int64_t pairs = ids.size(0);
  TORCH_CHECK(rows_per_x >= 1 && pairs == x.size(0) * rows_per_x, op, ": ids must hold rows_per_x (", rows_per_x,
              ") pairs a row of x (", x.size(0), " rows), got ", pairs);
  TORCH_CHECK(pairs < (int64_t{1} << 31), op, ": too many pairs");
  if (order.has_value()) {
    TORCH_CHECK(order->is_cuda() && order->device() == x.device() && order->dim() == 1 &&
                    order->scalar_type() == at::kInt && order->is_contiguous() && order->size(0) == pairs,
                op, ": order must be a contiguous int32 [pairs] on x's device");
  }
  check_expert_bias(op, bias, experts, 2 * inter, x);
  TORCH_CHECK(activation == kActSilu || activation == kActSwigluClamped, op,
              ": activation must be 0 (silu) or 1 (swiglu_clamped), got ", activation);
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor act = at::empty({pairs, inter}, x.options());
  if (pairs == 0) return act;
  GateUpActParams gp{};
  gp.x = static_cast<const __nv_bfloat16*>(x.data_ptr());
  gp.qweight = static_cast<const uint32_t*>(qweight.data_ptr());
  gp.scales = static_cast<const uint32_t*>(scales.data_ptr());
  gp.bias = bias.has_value() ? static_cast<const __nv_bfloat16*>(bias->data_ptr()) : nullptr;
  gp.ids = static_cast<const int32_t*>(ids.data_ptr());
  gp.order = order.has_value() ? static_cast<const int32_t*>(order->data_ptr()) : nullptr;
  gp.act = static_cast<__nv_bfloat16*>(act.data_ptr());
  gp.inter = static_cast<int>(inter);
  gp.k = static_cast<int>(k);
  gp.group_log2 = group == 16 ? 4 : group == 32 ? 5 : group == 64 ? 6 : 7;
  gp.rows_per_x = static_cast<int>(rows_per_x);
  gp.experts = static_cast<int>(experts);
  gp.expert_words = static_cast<size_t>(2 * inter * k * bits / 32);
  gp.expert_scales = static_cast<size_t>(2 * inter * (k / group));
  gp.limit = static_cast<float>(limit);
  gp.alpha = static_cast<float>(alpha);
  const cudaStream_t stream = current_stream();
  const int p = static_cast<int>(pairs);
  if (activation == kActSilu) {
    if (bits == 4) {
      launch_gate_up_act<4, kActSilu>(gp, p, stream, pdl);
    } else if (bits == 6) {
      launch_gate_up_act<6, kActSilu>(gp, p, stream, pdl);
    } else {
      launch_gate_up_act<8, kActSilu>(gp, p, stream, pdl);
    }
  } else if (bits == 4) {
    launch_gate_up_act<4, kActSwigluClamped>(gp, p, stream, pdl);
  } else if (bits == 6) {
    launch_gate_up_act<6, kActSwigluClamped>(gp, p, stream, pdl);
  } else {
    launch_gate_up_act<8, kActSwigluClamped>(gp, p, stream, pdl);
  }
  return act;
}

at::Tensor moe_down_combine(const at::Tensor& act, const at::Tensor& qweight, const at::Tensor& scales, int64_t bits,
                            int64_t group, int64_t n, const at::Tensor& ids, const at::Tensor& weights, int64_t top_k,
                            const std::optional<at::Tensor>& bias, bool bf16_out, int64_t warps, bool pdl) {
  const char* op = "moe_down_combine";
  TORCH_CHECK(warps == 0 || warps == kFusedDownWarpsNarrow || warps == kFusedDownWarpsWide, op,
              ": warps must be 0 (chosen by the grid), 8 or 16, got ", warps);
  const int64_t k = check_stacked(op, act, qweight, scales, bits, group, n);
  const int64_t experts = qweight.size(0);
  TORCH_CHECK(top_k >= 1 && top_k <= 64, op, ": top_k must be 1 to 64, got ", top_k);
  TORCH_CHECK(static_cast<int64_t>(fused_down_smem_bytes(static_cast<int>(top_k), static_cast<int>(k))) <=
                  kFusedMaxShared,
              op, ": ", top_k, " slots of ", k, " features do not fit the block's ", kFusedMaxShared,
              " bytes of shared memory");
  TORCH_CHECK(act.size(0) % top_k == 0, op, ": act's ", act.size(0), " rows must be whole tokens of ", top_k,
              " slots");
  const int64_t pairs = act.size(0), tokens = pairs / top_k;
  TORCH_CHECK(tokens < (int64_t{1} << 31), op, ": too many tokens");
  EXL_CHECK_CUDA_TENSOR(ids, "moe_down_combine: ids");
  EXL_CHECK_CUDA_TENSOR(weights, "moe_down_combine: weights");
  TORCH_CHECK(ids.scalar_type() == at::kInt && ids.is_contiguous() && ids.numel() == pairs &&
                  ids.device() == act.device(),
              op, ": ids must be a contiguous int32 of one id a row of act (", pairs, ") on act's device");
  TORCH_CHECK(weights.scalar_type() == at::kFloat && weights.is_contiguous() && weights.numel() == pairs &&
                  weights.device() == act.device(),
              op, ": weights must be a contiguous float32 of one weight a row of act (", pairs, ") on act's device");
  check_expert_bias(op, bias, experts, n, act);
  const c10::cuda::CUDAGuard guard(act.device());
  at::Tensor out = at::empty({tokens, n}, act.options().dtype(bf16_out ? at::kBFloat16 : at::kFloat));
  if (tokens == 0) return out;
  DownCombineParams dp{};
  dp.act = static_cast<const __nv_bfloat16*>(act.data_ptr());
  dp.qweight = static_cast<const uint32_t*>(qweight.data_ptr());
  dp.scales = static_cast<const uint32_t*>(scales.data_ptr());
  dp.bias = bias.has_value() ? static_cast<const __nv_bfloat16*>(bias->data_ptr()) : nullptr;
  dp.ids = static_cast<const int32_t*>(ids.data_ptr());
  dp.weights = static_cast<const float*>(weights.data_ptr());
  dp.out = out.data_ptr();
  dp.n = static_cast<int>(n);
  dp.k = static_cast<int>(k);
  dp.group_log2 = group == 16 ? 4 : group == 32 ? 5 : group == 64 ? 6 : 7;
  dp.top_k = static_cast<int>(top_k);
  dp.experts = static_cast<int>(experts);
  dp.expert_words = static_cast<size_t>(n * k * bits / 32);
  dp.expert_scales = static_cast<size_t>(n * (k / group));
  const cudaStream_t stream = current_stream();
  const int t = static_cast<int>(tokens);
  if (bits == 4) {
    launch_down_combine<4>(dp, t, bf16_out, static_cast<int>(warps), stream, pdl);
  } else if (bits == 6) {
    launch_down_combine<6>(dp, t, bf16_out, static_cast<int>(warps), stream, pdl);
  } else {
    launch_down_combine<8>(dp, t, bf16_out, static_cast<int>(warps), stream, pdl);
  }
  return out;
}

}  // namespace exlcli
