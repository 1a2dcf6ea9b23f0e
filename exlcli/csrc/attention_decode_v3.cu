// Decode attention, version 3 (the default): tensor cores, K/V staged in shared memory by
// cp.async. On the H200: 17 us at 64 x 208 tokens against 46 us for version 1, and faster at
// every measured shape. bf16 / fp16 on sm_80+ only, over a cache of that type or of e4m3 bytes.
#include <cstdint>

#include "attention_decode.cuh"
#include "kv_e4m3.cuh"

namespace exlcli {
namespace decode_attention {
namespace {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;

// ---- version 3: tensor cores, K/V staged in shared memory by cp.async -------------------------
// Each warp owns 16 tokens of every 64-token tile of the partition (tokens 16w..16w+15 of the
// tile) and walks its share on its own. Its shared memory is a ring of SLOTS slots of 16 rows
// (K rows of tile i, then V rows of tile i, then K rows of tile i + 1, ...), filled with cp.async
// ahead of use, so SLOTS - 1 of them are in flight while it computes, without holding registers.
// It computes with mma.sync m16n8k16:
//   scores S = Q K^T: 16 rows of query heads (GMAX <= 8 used, the rest zero) x 16 tokens;
//   an online softmax per head in base 2 (q.k * scale * log2(e)), the weights P rounded to T as
//   the reference rounds its probabilities;
//   O^T += V^T P^T: D rows x 8 heads, so P's fragments in the scores' registers are already the
//   B operand (no shuffle or shared-memory round trip), and the accumulator is D/16 x 4 floats.
// The warps merge their (max, sum, accumulator) in a fixed order at the end.
// Nothing depends on the batch: the tiles sit at fixed offsets of the fixed partitions.
constexpr int kTileV3 = 64;  // tokens per tile: 16 per warp
// 16-row K or V slots per warp: 48 KB a block at D = 128, so 4 blocks an SM (the batch-64 grid of
// 512 blocks is resident at once). On the H200, 4 slots (64 KB, 3 blocks an SM) take 23.7 us instead
// of 17.7 at 64 x 208 tokens and are no faster elsewhere.
constexpr int kSlotsV3 = 3;
// An e4m3 cache: 4 slots of 16 rows of bytes and the row block of T they are converted into take
// the same 12 KB a warp (D = 128) as the 16-bit ring.
constexpr int kSlotsV3E4m3 = 4;
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

template <typename C>
constexpr int v3_slots() {
  return sizeof(C) == 1 ? kSlotsV3E4m3 : kSlotsV3;
}

// One warp's shared memory: its ring of SLOTS slots of 16 K or V rows as the cache holds them (C),
// and for an e4m3 cache one block of 16 rows of 16-bit values, which each slot is converted into
// before the mma reads it.
template <typename C, int D, int SLOTS>
constexpr int v3_warp_bytes() {
  return SLOTS * 16 * D * static_cast<int>(sizeof(C)) + (sizeof(C) == 1 ? 16 * D * 2 : 0);
}

template <typename C, int D, int SLOTS>
constexpr int v3_smem_bytes() {  // per block
  return kWarps * v3_warp_bytes<C, D, SLOTS>();
}

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16 bytes global -> shared, bypassing L1; src_bytes 0 writes zeros (a token past the sequence).
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, int src_bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
#endif
}

__device__ __forceinline__ void cp_async_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;" ::: "memory");
#endif
}

template <int N>
__device__ __forceinline__ void cp_async_wait() {  // all but the N most recent groups are done
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
#endif
}

template <bool kTrans>
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if constexpr (kTrans) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
  } else {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
  }
#endif
}

// d += a (16x16, row) * b (16x8, col), fp32 accumulate. a1 and a3 (rows 8..15) are zero here.
template <typename T>
__device__ __forceinline__ void mma_16816(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                          uint32_t b0, uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
                 "{%8, %9}, {%0, %1, %2, %3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  } else {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
                 "{%8, %9}, {%0, %1, %2, %3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
#endif
}

template <typename T>
__device__ __forceinline__ uint32_t bits16(T x) {
  return static_cast<uint32_t>(*reinterpret_cast<const uint16_t*>(&x));
}

// Rounds lo and hi to T and packs them (lo in the low half, as mma operands want); adds the
// rounded values to `sum`.
template <typename T>
__device__ __forceinline__ uint32_t pack_round(float lo, float hi, float& sum) {
  const T a = from_float<T>(lo), b = from_float<T>(hi);
  sum += to_float(a) + to_float(b);
  return bits16(a) | (bits16(b) << 16);
}

// C: the cache's element, T or uint8_t (e4m3 bytes).
// Heads of 256 take twice the ring (96 KB a block: 2 blocks an SM on the H100, 1 on sm_86 / sm_89,
// whose blocks may have 99 KB) and twice the accumulator and query registers, so the register bound
// asks for 2 blocks an SM, not 4.
template <int D>
constexpr int v3_min_blocks() {
  return D > 128 ? 2 : 4;
}

template <typename T, typename C, int D, int GMAX, int SLOTS>
__global__ void __launch_bounds__(kThreads, v3_min_blocks<D>()) paged_decode_v3_kernel(const DecodeParams p) {
  grid_dependency_wait();  // launched with launch_pdl: the previous kernel may still run
  // No grid_dependents_launch() here: it comes at the end (see launch_kernel).
  constexpr bool kE4m3 = sizeof(C) == 1;
  constexpr int kWarpBytes = v3_warp_bytes<C, D, SLOTS>();
  static_assert(sizeof(T) == 2 && GMAX <= 8 && D % 16 == 0, "version 3: 16-bit types, at most 8 heads");
  static_assert(kE4m3 || std::is_same_v<C, T>, "version 3: a cache of T or of e4m3 bytes");
  static_assert(SLOTS >= 3 && kWarpBytes >= GMAX * D * 4, "version 3: the ring also holds the warp's result");
  constexpr int CPR = D * static_cast<int>(sizeof(C)) / 16;  // 16-byte chunks per K or V row of the cache
  constexpr int KSTEPS = D / 16;  // mma steps over the head dim (scores), and row blocks of O^T
  constexpr int ROWS = 16;  // tokens per warp per tile
  constexpr int SLOT = ROWS * D;  // elements (C) of one slot

  extern __shared__ __align__(128) unsigned char v3_smem[];
  __shared__ int64_t s_slot[kPartitionTokens];
  __shared__ float s_wm[kWarps][GMAX], s_wl[kWarps][GMAX];

  const DecodeBlock<T, D> blk(p, GMAX);
  if (blk.idle(p, kThreads)) return;
  const int b = blk.b, ng = blk.ng, head0 = blk.head0;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, c = lane & 3;  // the mma fragments' row group and column pair
  const int start = blk.start, n = blk.n;  // tiles count from the first token the row sees

  // A operand of the scores: the query heads as rows (row g = head g; rows 8..15 stay zero).
  uint32_t qa[KSTEPS][2];
  {
    const T* qp = static_cast<const T*>(p.q) + blk.row * p.q_row_stride + static_cast<int64_t>(head0 + g) * D + 2 * c;
#pragma unroll
    for (int k = 0; k < KSTEPS; ++k) {
      qa[k][0] = g < ng ? *reinterpret_cast<const uint32_t*>(qp + k * 16) : 0u;
      qa[k][1] = g < ng ? *reinterpret_cast<const uint32_t*>(qp + k * 16 + 8) : 0u;
    }
  }
  fill_slots(s_slot, p.block_tables + b * p.bt_stride, start, n, p.page_size);  // ends with a barrier

  unsigned char* const warp_smem = v3_smem + warp * kWarpBytes;
  C* const ring = reinterpret_cast<C*>(warp_smem);
  T* const rows16 = reinterpret_cast<T*>(warp_smem + SLOTS * SLOT * sizeof(C));  // e4m3: the converted slot
  const int64_t slot_stride = static_cast<int64_t>(p.num_kv_heads) * D;
  const C* const k_head = static_cast<const C*>(p.k_cache) + static_cast<int64_t>(blk.kvh) * D;
  const C* const v_head = static_cast<const C*>(p.v_cache) + static_cast<int64_t>(blk.kvh) * D;
  const int first = warp * ROWS;  // this warp's first token in every tile
  const int tiles = n > first ? ceil_div(n - first, kTileV3) : 0;

  // Load number j of the warp: the 16 K rows (j even) or V rows (j odd) of tile j / 2, into slot
  // j % SLOTS. 16-bit chunk x of row r lands at chunk x ^ (r & 7), so ldmatrix's 8 rows of one
  // chunk column hit 8 distinct banks (e4m3 rows land as they are: ready() places their chunks).
  // Tokens past the sequence are zeros.
  auto issue = [&](int j) {
    const int i = j >> 1;
    if (i < tiles) {
      C* const dst_slot = ring + (j % SLOTS) * SLOT;
      const C* const src = (j & 1) ? v_head : k_head;
      const int base = i * kTileV3 + first;
#pragma unroll
      for (int u = 0; u < ROWS * CPR / 32; ++u) {
        const int chunk = lane + 32 * u, r = chunk / CPR, col = chunk % CPR;
        const bool valid = base + r < n;
        const int64_t off = valid ? s_slot[base + r] * slot_stride + col * (16 / sizeof(C)) : 0;
        const int at = kE4m3 ? r * D + col * 16 : r * D + ((col ^ (r & 7)) * 8);
        cp_async16(smem_addr(dst_slot + at), src + off, valid ? 16 : 0);
      }
    }
    cp_async_commit();  // an empty group past the end keeps the wait counts uniform
  };
  // Load j, once waited for, as 16 rows of T for ldmatrix. An e4m3 slot is converted into rows16,
  // each lane taking the chunks it loaded itself (its own cp.async bytes are visible to it after the
  // wait); every lane must be done reading rows16's previous load (the loop's __syncwarp()s).
  auto ready = [&](int j) -> const T* {
    if constexpr (kE4m3) {
      const uint8_t* const stage = ring + (j % SLOTS) * SLOT;
#pragma unroll
      for (int u = 0; u < ROWS * CPR / 32; ++u) {
        const int chunk = lane + 32 * u, r = chunk / CPR, col = chunk % CPR;
        const uint4 bytes = *reinterpret_cast<const uint4*>(stage + r * D + col * 16);
        const uint4 lo = make_uint4(e4m3x2_as<T>(bytes.x & 0xffffu), e4m3x2_as<T>(bytes.x >> 16),
                                    e4m3x2_as<T>(bytes.y & 0xffffu), e4m3x2_as<T>(bytes.y >> 16));
        const uint4 hi = make_uint4(e4m3x2_as<T>(bytes.z & 0xffffu), e4m3x2_as<T>(bytes.z >> 16),
                                    e4m3x2_as<T>(bytes.w & 0xffffu), e4m3x2_as<T>(bytes.w >> 16));
        *reinterpret_cast<uint4*>(rows16 + r * D + (((2 * col) ^ (r & 7)) * 8)) = lo;
        *reinterpret_cast<uint4*>(rows16 + r * D + (((2 * col + 1) ^ (r & 7)) * 8)) = hi;
      }
      __syncwarp();  // rows16 is whole for every lane
      return rows16;
    } else {
      return ring + (j % SLOTS) * SLOT;
    }
  };

  const float sc2 = p.scale * kLog2e;
  // a score in base 2, after the layer's soft-cap when it has one
  auto score2 = [&](float x) { return p.softcap > 0.f ? soft_capped(p, x * p.scale) * kLog2e : x * sc2; };
  float m = -INFINITY, l = 0.f;  // head g's running max (base 2) and this lane's sum of weights
  float acc[KSTEPS][4];  // O^T rows 16k + g (+8), heads 2c and 2c + 1
#pragma unroll
  for (int k = 0; k < KSTEPS; ++k)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[k][e] = 0.f;
  const int lrow = (lane >> 4) * 8 + (lane & 7);  // ldmatrix: the row this lane points at
  const int lhalf = (lane >> 3) & 1;  // and which 8-column half

#pragma unroll
  for (int j = 0; j < SLOTS; ++j) issue(j);
  for (int i = 0; i < tiles; ++i) {  // warp-uniform
    const int valid = min(ROWS, n - (i * kTileV3 + first));
    cp_async_wait<SLOTS - 1>();  // load 2i (K of tile i) is done
    __syncwarp();  // and visible to every lane

    // S = Q K^T for 16 tokens: s[0] tokens 2c, 2c+1; s[1] tokens 8+2c, 9+2c (head g, and the
    // zero rows g + 8 in s[.][2..3]).
    float s[2][4] = {};
    const T* const ks = ready(2 * i);
#pragma unroll
    for (int k = 0; k < KSTEPS; ++k) {
      uint32_t kb[4];  // tokens 0-7: d 0-7, d 8-15; tokens 8-15: d 0-7, d 8-15
      ldmatrix_x4<false>(kb, smem_addr(ks + lrow * D + (((2 * k + lhalf) ^ (lrow & 7)) * 8)));
      mma_16816<T>(s[0], qa[k][0], 0u, qa[k][1], 0u, kb[0], kb[1]);
      mma_16816<T>(s[1], qa[k][0], 0u, qa[k][1], 0u, kb[2], kb[3]);
    }
    __syncwarp();  // every lane is done with K of tile i: its slot takes the next load
    issue(2 * i + SLOTS);

    // Online softmax of head g over the tile's tokens (the four lanes of g hold 4 tokens each).
    float x[4];
    x[0] = 2 * c < valid ? score2(s[0][0]) : -INFINITY;
    x[1] = 2 * c + 1 < valid ? score2(s[0][1]) : -INFINITY;
    x[2] = 8 + 2 * c < valid ? score2(s[1][0]) : -INFINITY;
    x[3] = 9 + 2 * c < valid ? score2(s[1][1]) : -INFINITY;
    float mx = fmaxf(fmaxf(x[0], x[1]), fmaxf(x[2], x[3]));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    const float m_new = fmaxf(m, mx);  // finite: token 0 of the tile is valid
    const float alpha = exp2f(m - m_new);  // 0 on the first tile
    m = m_new;
    float tile_sum = 0.f;
    const uint32_t pb0 = pack_round<T>(exp2f(x[0] - m_new), exp2f(x[1] - m_new), tile_sum);
    const uint32_t pb1 = pack_round<T>(exp2f(x[2] - m_new), exp2f(x[3] - m_new), tile_sum);
    l = fmaf(l, alpha, tile_sum);

    // O^T = O^T * alpha + V^T P^T. The accumulator's columns are heads 2c and 2c + 1.
    const float alpha_lo = __shfl_sync(0xffffffffu, alpha, 8 * c);
    const float alpha_hi = __shfl_sync(0xffffffffu, alpha, 8 * c + 4);
    cp_async_wait<SLOTS - 1>();  // load 2i + 1 (V of tile i) is done
    __syncwarp();
    const T* const vs = ready(2 * i + 1);
#pragma unroll
    for (int k = 0; k < KSTEPS; ++k) {
      uint32_t va[4];  // d 0-7 x tokens 0-7, d 8-15 x tokens 0-7, d 0-7 x tokens 8-15, d 8-15 x tokens 8-15
      ldmatrix_x4<true>(va, smem_addr(vs + lrow * D + (((2 * k + lhalf) ^ (lrow & 7)) * 8)));
      acc[k][0] *= alpha_lo;
      acc[k][1] *= alpha_hi;
      acc[k][2] *= alpha_lo;
      acc[k][3] *= alpha_hi;
      mma_16816<T>(acc[k], va[0], va[1], va[2], va[3], pb0, pb1);
    }
    __syncwarp();  // every lane is done with V of tile i
    issue(2 * i + 1 + SLOTS);
  }
  cp_async_wait<0>();
  __syncwarp();

  // Warp totals: the sum over the lanes of head g (m is already the warp's), then the
  // accumulator into this warp's own (now free) ring as [GMAX][D] floats.
  l += __shfl_xor_sync(0xffffffffu, l, 1);
  l += __shfl_xor_sync(0xffffffffu, l, 2);
  float* const red = reinterpret_cast<float*>(ring);
  if (c == 0 && g < GMAX) {
    s_wm[warp][g] = m;
    s_wl[warp][g] = l;
  }
#pragma unroll
  for (int k = 0; k < KSTEPS; ++k) {
    const int h = 2 * c;
    if (h < GMAX) {
      red[h * D + 16 * k + g] = acc[k][0];
      red[h * D + 16 * k + g + 8] = acc[k][2];
    }
    if (h + 1 < GMAX) {
      red[(h + 1) * D + 16 * k + g] = acc[k][1];
      red[(h + 1) * D + 16 * k + g + 8] = acc[k][3];
    }
  }
  __syncthreads();

  // Merge the warps, in order (a warp with no token has max -inf and is skipped).
  for (int idx = tid; idx < ng * D; idx += kThreads) {
    const int h = idx / D, d = idx % D;
    float mb = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) mb = fmaxf(mb, s_wm[w][h]);
    float o = 0.f, lb = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      if (s_wm[w][h] == -INFINITY) continue;
      const float scale = exp2f(s_wm[w][h] - mb);
      const float* const wred = reinterpret_cast<const float*>(v3_smem + w * kWarpBytes);
      o = fmaf(wred[h * D + d], scale, o);
      lb = fmaf(s_wl[w][h], scale, lb);
    }
    if (p.max_parts == 1) {
      // the combine kernel computes the same for one part
      blk.out[idx] = from_float<T>(o * output_factor(p, head0 + h, mb * kLn2, lb));
    } else {
      const int64_t pi = (static_cast<int64_t>(b) * p.num_heads + head0 + h) * p.max_parts + blk.slot;
      p.part_acc[pi * D + d] = o;
      if (d == 0) {
        p.part_ml[pi * 2] = mb * kLn2;  // the combine kernel works in natural logs
        p.part_ml[pi * 2 + 1] = lb;
      }
    }
  }
  grid_dependents_launch();  // only now: see launch_kernel
}

template <typename T, typename C, int D, int GMAX, int SLOTS = v3_slots<C>()>
void launch_kernel(const DecodeParams& p, const dim3& grid, cudaStream_t stream, bool pdl) {
  constexpr int smem = v3_smem_bytes<C, D, SLOTS>();
  auto kernel = paged_decode_v3_kernel<T, C, D, GMAX, SLOTS>;
  allow_dynamic_smem<paged_decode_v3_kernel<T, C, D, GMAX, SLOTS>>(smem);
  // Unlike the other kernels, this one lets the next kernel start only at its end: the o_proj
  // projection's blocks, started early beside it, make the batch-1 decode graph of Llama-8B on the
  // H200 take 5.34 ms instead of 4.40 (with the trigger at the start, at the end, and nowhere:
  // 5.34 / 4.40 / 4.41; the carveout and a plain launch make no difference).
  launch_pdl(kernel, grid, dim3(kThreads), smem, stream, pdl, p);
}

template <typename T, typename C, int D>
void launch_group(const DecodeParams& p, int gmax, const dim3& grid, cudaStream_t stream, bool pdl) {
  switch (gmax) {
    case 1: launch_kernel<T, C, D, 1>(p, grid, stream, pdl); break;
    case 2: launch_kernel<T, C, D, 2>(p, grid, stream, pdl); break;
    case 4: launch_kernel<T, C, D, 4>(p, grid, stream, pdl); break;
    default: launch_kernel<T, C, D, 8>(p, grid, stream, pdl); break;
  }
}

template <typename T, typename C>
void launch_dims(const DecodeParams& p, int head_dim, int gmax, const dim3& grid, cudaStream_t stream, bool pdl) {
  if (head_dim == 64) {
    launch_group<T, C, 64>(p, gmax, grid, stream, pdl);
  } else if (head_dim == 128) {
    launch_group<T, C, 128>(p, gmax, grid, stream, pdl);
  } else {
    launch_group<T, C, 256>(p, gmax, grid, stream, pdl);
  }
}

template <typename T>
void launch_cache(const DecodeParams& p, bool e4m3_cache, int head_dim, int gmax, const dim3& grid,
                  cudaStream_t stream, bool pdl) {
  if (e4m3_cache) {
    launch_dims<T, uint8_t>(p, head_dim, gmax, grid, stream, pdl);
  } else {
    launch_dims<T, T>(p, head_dim, gmax, grid, stream, pdl);
  }
}

}  // namespace

void launch_v3(const DecodeParams& p, at::ScalarType dtype, bool e4m3_cache, int head_dim, int gmax,
               const dim3& grid, cudaStream_t stream, bool pdl) {
  if (dtype == at::kBFloat16) {
    launch_cache<__nv_bfloat16>(p, e4m3_cache, head_dim, gmax, grid, stream, pdl);
  } else if (dtype == at::kHalf) {
    launch_cache<__half>(p, e4m3_cache, head_dim, gmax, grid, stream, pdl);
  } else {
    TORCH_CHECK(false, "paged attention: version 3 takes bfloat16 or float16, got ", dtype);
  }
}

}  // namespace decode_attention
}  // namespace exlcli
