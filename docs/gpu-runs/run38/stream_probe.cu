// Run 38 probe (issue 15, batch 1): the four 4-bit products of a decoder layer, with the two norms and
// SiLU between them, for every layer of the model in ONE persistent kernel whose weights stream into
// shared memory without waiting for the activations.
//
// Why: at one token the step is a chain of about 10 kernels a layer (docs/gpu-results.md, run 31: the
// products of GPTQ's step at 2.9 TB/s, each kernel paying its fill and drain). Weights do not depend on
// the activations, so nothing but kernel boundaries stops them streaming from the first layer to the
// last. Here one block a multiprocessor runs every layer:
// - a producer warp copies the block's weight segments (16 chunks of one row tile, with their scales)
//   by cp.async.bulk into a ring of shared-memory slots, in the order the block will use them, across
//   stage and layer boundaries; each slot has a "full" mbarrier (bytes arrived) and an "empty" one
//   (the 8 consumer warps are done with it);
// - 8 consumer warps wait until every block has written the stage's input (a counter a stage in
//   global memory), build the input in shared memory (residual add + RMSNorm, or SiLU(gate) * up, or
//   a copy), round it to int8 per 16 features as quant_gemv_dp4a.cuh does, and take their row tiles
//   (tile b, b + blocks, ...) with the dp4a kernel's arithmetic: warp w takes chunks w, w + 8, ... of
//   a tile and the warps' sums are added in warp order, so a product equals the 8-warp dp4a kernel's
//   bit for bit given the same input.
// Attention and rope are not here: o's input is the first 4,096 values of q|k|v. It is a probe of the
// products' rate and the barriers' cost, not a model path.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_bf16.h>
#include <torch/extension.h>

#include "quant_gemv_dp4a.cuh"

namespace probe {
using namespace exlcli::qlinear;

#ifndef CONSUMERS
#define CONSUMERS 8
#endif
constexpr int kConsumers = CONSUMERS;                 // consumer warps (8: the dp4a kernel's split)
constexpr int kConsumerThreads = kConsumers * 32;
constexpr int kThreads = kConsumerThreads + 32;       // + the producer warp
#ifndef SEG_CHUNKS
#define SEG_CHUNKS 16
#endif
constexpr int kSegChunks = SEG_CHUNKS;                // chunks a streamed segment
constexpr int kSegQBytes = kSegChunks * 512;          // 4-bit: 512 bytes a chunk (32 lanes x 16)
constexpr int kMaxSegScaleBytes = kSegChunks * 128;   // kSegChunks x 64 / 32 groups x 16 rows x 4 bytes
constexpr int kSlotBytes = kSegQBytes + kMaxSegScaleBytes;
constexpr int kStages = 4;                            // q|k|v, o, gate|up, down

struct Layer {
  const uint32_t* q[kStages];
  const uint32_t* s[kStages];
  const __nv_bfloat16* w_in;    // input norm
  const __nv_bfloat16* w_post;  // post-attention norm
};

struct Params {
  const Layer* layers;
  int num_layers;
  int hidden, qkv_n, inter;  // o's n and k are hidden; gate|up's n is 2 * inter
  int glog;                  // log2 of the group size
  float eps;
  __nv_bfloat16* h;          // [hidden] the layer's output (down), the first layer's input
  __nv_bfloat16* res[2];     // residual stream, ping-pong (read one, write the other)
  __nv_bfloat16* qkv;        // [qkv_n]
  __nv_bfloat16* o;          // [hidden]
  __nv_bfloat16* gu;         // [inter] SiLU(gate) * up
  unsigned* counters;        // [num_layers * kStages], zero at launch
  __nv_bfloat16* debug_x;    // [2][max k]: layer 0's q|k|v and gate|up inputs as the blocks built them
  unsigned long long* clock; // [num_layers * kStages][4]: block 0's globaltimer at a stage's start, wait done,
                             // input built, products done
  int slots;
  bool fence_all;
  bool products_only;  // a measurement: no stage waits, no inputs built after the first layer's
};

// ---- mbarriers and bulk copies ------------------------------------------------------------------
__device__ __forceinline__ uint32_t smem(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }

__device__ __forceinline__ void mbar_init(uint64_t* bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem(bar)), "r"(count) : "memory");
}

__device__ __forceinline__ void mbar_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem(bar)), "r"(bytes) : "memory");
}

__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem(bar)) : "memory");
}

__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n .reg .pred done;\n"
      "WAIT_%=:\n mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n @!done bra WAIT_%=;\n}\n" ::"r"(
          smem(bar)),
      "r"(parity)
      : "memory");
}

__device__ __forceinline__ void bulk_copy(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(smem(dst)),
      "l"(src), "r"(bytes), "r"(smem(bar))
      : "memory");
}

// ---- the grid's stage counters ------------------------------------------------------------------
__device__ __forceinline__ unsigned load_acquire(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ unsigned long long globaltimer() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ void consumers_sync() { asm volatile("bar.sync 1, %0;" ::"n"(kConsumerThreads) : "memory"); }

// Every consumer thread returns once all blocks have counted themselves done with stage `index`.
__device__ __forceinline__ void wait_stage(const unsigned* counters, int index) {
  if (index >= 0 && threadIdx.x == 0) {
    while (load_acquire(counters + index) < gridDim.x) {
    }
  }
  consumers_sync();
}

// fence_all: every thread fences its own outputs (membar.gl) before the count; else (as CUTLASS's grid
// barrier) the consumers synchronise and thread 0 alone counts with release semantics at gpu scope.
__device__ __forceinline__ void count_stage_done(unsigned* counters, int index, bool fence_all) {
  if (fence_all) __threadfence();
  consumers_sync();
  if (threadIdx.x == 0) {
    if (fence_all) {
      atomicAdd(counters + index, 1u);
    } else {
      asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(counters + index) : "memory");
    }
  }
}

// ---- the stage geometry, the same for producer and consumers -------------------------------------
struct StageShape {
  int n, k;
};

__device__ __forceinline__ StageShape stage_shape(const Params& p, int s) {
  switch (s) {
    case 0: return {p.qkv_n, p.hidden};
    case 1: return {p.hidden, p.hidden};
    case 2: return {2 * p.inter, p.hidden};
    default: return {p.hidden, p.inter};
  }
}

__device__ __forceinline__ uint32_t seg_scale_bytes(int glog) { return (kSegChunks * kChunk >> glog) * kTileRows * 4; }

// ---- the input of a stage, in shared memory ------------------------------------------------------
// xb: bf16 [k] built by the consumers; then rounded to int8 blocks by this copy of quant_gemv_dp4a.cuh's
// quantize_x16 for one token. The copy strides by the consumer threads: the library's strides by blockDim.x,
// which here counts the producer warp too, and a probe should not change the library it is compared with.
__device__ void quantize_consumers(const __nv_bfloat16* xb, int k, uint4* xq, float2* xs) {
  const int blocks = k / kXBlock;
  for (int i = threadIdx.x; i < blocks; i += kConsumerThreads) {
    const uint4* src = reinterpret_cast<const uint4*>(xb + kXBlock * i);
    const uint4 v[2] = {src[0], src[1]};
    float f[kXBlock];
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const uint32_t w[4] = {v[hh].x, v[hh].y, v[hh].z, v[hh].w};
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        f[8 * hh + 2 * j] = __uint_as_float(w[j] << 16);
        f[8 * hh + 2 * j + 1] = __uint_as_float(w[j] & 0xFFFF0000u);
      }
    }
    __nv_bfloat162 top = __habs2(as_bf162(v[0].x));
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const uint32_t w[4] = {v[hh].x, v[hh].y, v[hh].z, v[hh].w};
#pragma unroll
      for (int j = hh == 0 ? 1 : 0; j < 4; ++j) top = __hmax2_nan(top, __habs2(as_bf162(w[j])));
    }
    const float amax = __bfloat162float(__hmax_nan(top.x, top.y));
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

__device__ __forceinline__ float bf(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float round_bf(float v) { return __bfloat162float(__float2bfloat16_rn(v)); }

// silu(g) * u as common.cuh's silu_mul rounds it for bf16: the SiLU rounded, then the product.
__device__ __forceinline__ __nv_bfloat16 silu_mul_bf16(__nv_bfloat16 g, __nv_bfloat16 u) {
  const float gf = bf(g);
  const float s = round_bf(__fdividef(gf, 1.f + __expf(-gf)));
  return __float2bfloat16_rn(s * bf(u));
}

constexpr int kMaxVecs = 16384 / 8 / kConsumerThreads;  // 16-byte vectors a consumer thread: inputs up to 16,384

__device__ __forceinline__ void unpack8(const uint4& v, float (&f)[8]) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    f[2 * j] = __uint_as_float(w[j] << 16);
    f[2 * j + 1] = __uint_as_float(w[j] & 0xFFFF0000u);
  }
}

__device__ __forceinline__ uint4 pack8(const float (&f)[8]) {
  uint32_t w[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) w[j] = as_u32(__floats2bfloat162_rn(f[2 * j], f[2 * j + 1]));
  return make_uint4(w[0], w[1], w[2], w[3]);
}

// n values (a multiple of 8) written by other blocks -> xb; every load issued before the first store.
__device__ void copy_input(const __nv_bfloat16* src, int n, __nv_bfloat16* xb) {
  const uint4* s4 = reinterpret_cast<const uint4*>(src);
  uint4* d4 = reinterpret_cast<uint4*>(xb);
  const int vecs = n / 8;
  uint4 v[kMaxVecs];
#pragma unroll
  for (int j = 0; j < kMaxVecs; ++j) {
    const int i = threadIdx.x + j * kConsumerThreads;
    if (i < vecs) v[j] = __ldcg(s4 + i);
  }
#pragma unroll
  for (int j = 0; j < kMaxVecs; ++j) {
    const int i = threadIdx.x + j * kConsumerThreads;
    if (i < vecs) d4[i] = v[j];
  }
}

// residual add + RMSNorm of `hidden` values into xb; block 0 writes the new residual.
constexpr int kMaxNormVecs = 8192 / 8 / kConsumerThreads;  // hidden sizes up to 8,192
__device__ void norm_input(const Params& p, const __nv_bfloat16* x, const __nv_bfloat16* res_in,
                           __nv_bfloat16* res_out, const __nv_bfloat16* w, __nv_bfloat16* xb, float* scratch) {
  const int vecs = p.hidden / 8;
  uint4 xv[kMaxNormVecs], rv[kMaxNormVecs];
#pragma unroll
  for (int j = 0; j < kMaxNormVecs; ++j) {
    const int i = threadIdx.x + j * kConsumerThreads;
    if (i < vecs) {
      xv[j] = __ldcg(reinterpret_cast<const uint4*>(x) + i);
      rv[j] = __ldcg(reinterpret_cast<const uint4*>(res_in) + i);
    }
  }
  uint4 wv[kMaxNormVecs];  // loaded before the reduction: one L2 round trip less on the critical path
#pragma unroll
  for (int j = 0; j < kMaxNormVecs; ++j) {
    const int i = threadIdx.x + j * kConsumerThreads;
    if (i < vecs) wv[j] = reinterpret_cast<const uint4*>(w)[i];
  }
  float r[kMaxNormVecs][8];
  float sumsq = 0.f;
#pragma unroll
  for (int j = 0; j < kMaxNormVecs; ++j) {
    const int i = threadIdx.x + j * kConsumerThreads;
    if (i < vecs) {
      float a[8], b[8];
      unpack8(xv[j], a);
      unpack8(rv[j], b);
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        r[j][e] = round_bf(a[e] + b[e]);
        sumsq = fmaf(r[j][e], r[j][e], sumsq);
      }
      if (blockIdx.x == 0) __stcg(reinterpret_cast<uint4*>(res_out) + i, pack8(r[j]));
    }
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) sumsq += __shfl_xor_sync(0xFFFFFFFFu, sumsq, o);
  if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = sumsq;
  consumers_sync();
  float total = 0.f;
#pragma unroll
  for (int i = 0; i < kConsumers; ++i) total += scratch[i];
  const float inv = rsqrtf(total * (1.f / p.hidden) + p.eps);
#pragma unroll
  for (int j = 0; j < kMaxNormVecs; ++j) {
    const int i = threadIdx.x + j * kConsumerThreads;
    if (i < vecs) {
      float wf[8], y[8];
      unpack8(wv[j], wf);
#pragma unroll
      for (int e = 0; e < 8; ++e) y[e] = wf[e] * round_bf(r[j][e] * inv);
      reinterpret_cast<uint4*>(xb)[i] = pack8(y);
    }
  }
}

// The j-th row tile of this block in stage s. gate|up (s = 2) goes by pairs: gate tile i, then up tile
// i + inter / 16, so that the block can write SiLU(gate) * up itself.
__device__ __forceinline__ int block_tiles(const Params& p, int s, int tiles) {
  if (s == 2) {
    const int pairs = tiles / 2;
    return blockIdx.x < pairs ? 2 * ((pairs - 1 - blockIdx.x) / gridDim.x + 1) : 0;
  }
  return blockIdx.x < tiles ? (tiles - 1 - blockIdx.x) / gridDim.x + 1 : 0;
}

__device__ __forceinline__ int block_tile(int s, int tiles, int j) {
  if (s == 2) return blockIdx.x + (j >> 1) * gridDim.x + (j & 1) * (tiles / 2);
  return blockIdx.x + j * gridDim.x;
}

// ---- the kernel ---------------------------------------------------------------------------------
__global__ void __launch_bounds__(kThreads, 1) stream_layers_kernel(const Params p) {
  extern __shared__ __align__(128) uint8_t dyn[];
  __shared__ __align__(8) uint64_t full[32], empty[32];
  __shared__ float partial[2][kConsumers][kTileRows];
  __shared__ float scratch[kConsumers];
  __shared__ __nv_bfloat16 gate_keep[kTileRows];
  const int slots = p.slots;
  uint8_t* ring = dyn;  // slots x kSlotBytes
  const int max_k = p.inter > p.hidden ? p.inter : p.hidden;
  __nv_bfloat16* xb = reinterpret_cast<__nv_bfloat16*>(ring + static_cast<size_t>(slots) * kSlotBytes);
  uint4* xq = reinterpret_cast<uint4*>(xb + max_k);
  float2* xs = reinterpret_cast<float2*>(xq + max_k / kXBlock);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const uint32_t sbytes = seg_scale_bytes(p.glog);

  if (threadIdx.x == 0) {
    for (int i = 0; i < slots; ++i) {
      mbar_init(&full[i], 1);
      mbar_init(&empty[i], kConsumers);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();

  if (warp == kConsumers) {  // the producer: one lane streams the block's segments, in use order
    if (lane != 0) return;
    int it = 0;
    for (int l = 0; l < p.num_layers; ++l) {
      const Layer& L = p.layers[l];
      for (int s = 0; s < kStages; ++s) {
        const StageShape sh = stage_shape(p, s);
        const int tiles = sh.n / kTileRows, chunks = sh.k / kChunk, segs = chunks / kSegChunks;
        const int groups = sh.k >> p.glog, seg_groups = (kSegChunks * kChunk) >> p.glog;
        const int mine = block_tiles(p, s, tiles);
        for (int j = 0; j < mine; ++j) {
          const int tile = block_tile(s, tiles, j);
          for (int seg = 0; seg < segs; ++seg, ++it) {
            const int slot = it % slots, round = it / slots;
            if (round > 0) mbar_wait(&empty[slot], (round - 1) & 1);
            uint8_t* dst = ring + static_cast<size_t>(slot) * kSlotBytes;
            mbar_expect_tx(&full[slot], kSegQBytes + sbytes);
            bulk_copy(dst, L.q[s] + (static_cast<size_t>(tile) * chunks + seg * kSegChunks) * 128, kSegQBytes,
                      &full[slot]);
            bulk_copy(dst + kSegQBytes, L.s[s] + (static_cast<size_t>(tile) * groups + seg * seg_groups) * kTileRows,
                      sbytes, &full[slot]);
          }
        }
      }
    }
    return;
  }

  // the consumers
  const int g = lane >> 2, t = lane & 3;
  int it = 0, tile_count = 0;
  for (int l = 0; l < p.num_layers; ++l) {
    const Layer& L = p.layers[l];
    for (int s = 0; s < kStages; ++s) {
      const StageShape sh = stage_shape(p, s);
      const int index = l * kStages + s;
      unsigned long long* stamp = p.clock + 4 * index;
      if (blockIdx.x == 0 && threadIdx.x == 0) stamp[0] = globaltimer();
      if (!p.products_only) wait_stage(p.counters, index - 1);
      if (blockIdx.x == 0 && threadIdx.x == 0) stamp[1] = globaltimer();
      // the stage's input, bf16 in xb
      if (p.products_only) {
        // no waits and no inputs: the products' own rate (the outputs are meaningless)
      } else if (s == 0) {
        norm_input(p, p.h, p.res[0], p.res[1], L.w_in, xb, scratch);
      } else if (s == 1) {
        copy_input(p.qkv, p.hidden, xb);
      } else if (s == 2) {
        norm_input(p, p.o, p.res[1], p.res[0], L.w_post, xb, scratch);
      } else {
        copy_input(p.gu, p.inter, xb);  // SiLU(gate) * up, written by stage 2
      }
      consumers_sync();
      if (l == 0 && (s == 0 || s == 2) && blockIdx.x == 0) {
        for (int i = threadIdx.x; i < sh.k; i += kConsumerThreads) p.debug_x[(s / 2) * max_k + i] = xb[i];
      }
      if (!p.products_only || l == 0) quantize_consumers(xb, sh.k, xq, xs);
      consumers_sync();
      if (blockIdx.x == 0 && threadIdx.x == 0) stamp[2] = globaltimer();

      __nv_bfloat16* out = s == 0 ? p.qkv : s == 1 ? p.o : s == 2 ? p.gu : p.h;
      const int tiles = sh.n / kTileRows, segs = sh.k / kChunk / kSegChunks;
      const int mine = block_tiles(p, s, tiles);
      for (int j = 0; j < mine; ++j, ++tile_count) {
        const int tile = block_tile(s, tiles, j);
        float y0 = 0.f, y1 = 0.f;
        for (int seg = 0; seg < segs; ++seg, ++it) {
          const int slot = it % slots, round = it / slots;
          mbar_wait(&full[slot], round & 1);
          const uint8_t* src = ring + static_cast<size_t>(slot) * kSlotBytes;
          const uint32_t* sc = reinterpret_cast<const uint32_t*>(src + kSegQBytes);
#pragma unroll
          for (int half = 0; half < kSegChunks / kConsumers; ++half) {
            const int cis = warp + half * kConsumers;  // chunk in the segment
            ChunkLoad<4> c;
            c.q = reinterpret_cast<const uint4*>(src)[cis * 32 + lane];
            const int group = (cis * kChunk + 16 * t) >> p.glog;  // in the segment
            c.lo = sc[group * kTileRows + g];
            c.hi = sc[group * kTileRows + g + 8];
            const int b = (seg * kSegChunks + cis) * (kChunk / kXBlock) + t;
            const uint4 xw = xq[b];
            const float2 ds = xs[b];
            int dot_lo = 0, dot_hi = 0;
#pragma unroll
            for (int step = 0; step < 4; ++step) {
              uint32_t lo, hi;
              step_bytes<4>(c, step, lo, hi);
              const uint32_t xv = step == 0 ? xw.x : step == 1 ? xw.y : step == 2 ? xw.z : xw.w;
              dot_lo = dp4a_us(lo, xv, dot_lo);
              dot_hi = dp4a_us(hi, xv, dot_hi);
            }
            const float2 a_lo = row_affine<4>(c.lo), a_hi = row_affine<4>(c.hi);
            y0 = fmaf(ds.x, fmaf(a_lo.x, static_cast<float>(dot_lo), a_lo.y * ds.y), y0);
            y1 = fmaf(ds.x, fmaf(a_hi.x, static_cast<float>(dot_hi), a_hi.y * ds.y), y1);
          }
          __syncwarp();
          if (lane == 0) mbar_arrive(&empty[slot]);
        }
        y0 += __shfl_xor_sync(0xFFFFFFFFu, y0, 1);
        y0 += __shfl_xor_sync(0xFFFFFFFFu, y0, 2);
        y1 += __shfl_xor_sync(0xFFFFFFFFu, y1, 1);
        y1 += __shfl_xor_sync(0xFFFFFFFFu, y1, 2);
        float(*part)[kTileRows] = partial[tile_count & 1];
        if (t == 0) {
          part[warp][g] = y0;
          part[warp][g + 8] = y1;
        }
        consumers_sync();
        if (threadIdx.x < kTileRows) {
          float sum = 0.f;
#pragma unroll
          for (int w = 0; w < kConsumers; ++w) sum += part[w][threadIdx.x];
          const __nv_bfloat16 y = __float2bfloat16_rn(sum);
          if (s != 2) {
            __stcg(out + tile * kTileRows + threadIdx.x, y);
          } else if ((j & 1) == 0) {
            gate_keep[threadIdx.x] = y;  // the same thread reads it back after the up tile
          } else {
            __stcg(out + (tile - tiles / 2) * kTileRows + threadIdx.x, silu_mul_bf16(gate_keep[threadIdx.x], y));
          }
        }
      }
      if (blockIdx.x == 0 && threadIdx.x == 0) stamp[3] = globaltimer();
      count_stage_done(p.counters, index, p.fence_all);
    }
  }
}

}  // namespace probe

// ---- binding -------------------------------------------------------------------------------------
size_t smem_bytes(int slots, int max_k) {
  return static_cast<size_t>(slots) * probe::kSlotBytes + max_k * 2 + max_k / probe::kXBlock * (16 + 8);
}

void run(torch::Tensor layers, int64_t num_layers, int64_t hidden, int64_t qkv_n, int64_t inter, int64_t glog,
         double eps, torch::Tensor h, torch::Tensor res0, torch::Tensor res1, torch::Tensor qkv, torch::Tensor o,
         torch::Tensor gu, torch::Tensor counters, torch::Tensor debug_x, torch::Tensor clock, int64_t slots,
         int64_t blocks, bool fence_all, bool products_only) {
  TORCH_CHECK(slots >= 2 && slots <= 32, "slots");
  TORCH_CHECK(clock.numel() >= num_layers * probe::kStages * 4, "clock");
  TORCH_CHECK(hidden % (probe::kSegChunks * probe::kChunk) == 0 && inter % (probe::kSegChunks * probe::kChunk) == 0,
              "k a multiple of 1,024");
  TORCH_CHECK(glog >= 5 && glog <= 10, "group 32 .. 1024");
  probe::Params p{};
  p.layers = reinterpret_cast<const probe::Layer*>(layers.data_ptr());
  p.num_layers = static_cast<int>(num_layers);
  p.hidden = static_cast<int>(hidden);
  p.qkv_n = static_cast<int>(qkv_n);
  p.inter = static_cast<int>(inter);
  p.glog = static_cast<int>(glog);
  p.eps = static_cast<float>(eps);
  p.h = reinterpret_cast<__nv_bfloat16*>(h.data_ptr());
  p.res[0] = reinterpret_cast<__nv_bfloat16*>(res0.data_ptr());
  p.res[1] = reinterpret_cast<__nv_bfloat16*>(res1.data_ptr());
  p.qkv = reinterpret_cast<__nv_bfloat16*>(qkv.data_ptr());
  p.o = reinterpret_cast<__nv_bfloat16*>(o.data_ptr());
  p.gu = reinterpret_cast<__nv_bfloat16*>(gu.data_ptr());
  p.counters = reinterpret_cast<unsigned*>(counters.data_ptr());
  p.debug_x = reinterpret_cast<__nv_bfloat16*>(debug_x.data_ptr());
  p.clock = reinterpret_cast<unsigned long long*>(clock.data_ptr());
  p.slots = static_cast<int>(slots);
  p.fence_all = fence_all;
  p.products_only = products_only;
  const int max_k = static_cast<int>(std::max(hidden, inter));
  const size_t bytes = smem_bytes(p.slots, max_k);
  auto kernel = probe::stream_layers_kernel;
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
  kernel<<<static_cast<unsigned>(blocks), probe::kThreads, bytes, c10::cuda::getCurrentCUDAStream()>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("run", &run);
  m.def("smem_bytes", &smem_bytes);
}
