// The quantized KV cache on the GPU (kv_quant.cuh: q8_0, q4_0, q4h, q3h): the K/V write's quantizer and
// decode attention reading the pages as stored.
//
// kv_quantize_rows: one thread per block of 32 values, the torch encoder's arithmetic (ops/kv_quant.py:
// every product and sum rounded on its own, no fused multiply-add, so the codes are its codes; the
// rotated kinds' candidate scales compare sums of squared error whose order is the thread's, so a near
// tie between two candidates may go the other way than torch's). Rows at a negative slot (the padded
// rows of a captured graph) are not written.
//
// paged_attention_decode_quant: decode attention version 1's three phases (attention_decode_v1.cu;
// attention_decode.cuh describes the split into partitions and their combine), each thread owning 8
// values of the head (a quarter of a block): its loads bring the block's scale and the quarter's codes,
// decoded in registers into exact fp32 values; scores and the weighted sum of V in fp32. K and V each
// of its own type. q comes in rotated and the output goes out rotated (ops/attention.py turns them:
// Hq.Hk = q.k, H^T sum p Hv). A row's arithmetic depends on its q, its keys and its length only, so
// a sequence's result does not depend on its batch; no host synchronisation (graph-capturable).
#include <algorithm>
#include <cstdint>

#include <ATen/ops/empty.h>

#include "attention_decode.cuh"
#include "kv_quant.cuh"
#include "ops.h"

namespace exlcli {
namespace {

using namespace kv_quant;

constexpr int kWarpsQ = 8;
constexpr int kUnrollQ = 4;
__constant__ float kFractions[6] = {1.0f, 0.95f, 0.9f, 0.85f, 0.8f, 0.75f};  // ops/kv_quant.py's _SCALE_FRACTIONS

__device__ __forceinline__ uint16_t f16_bits(float d) { return __half_as_ushort(__float2half_rn(d)); }

__device__ __forceinline__ float inverse(float d) { return d == 0.f ? 0.f : __fdiv_rn(1.f, d); }

// One block of 32 fp32 values (already rotated) -> its bytes.
__device__ void encode_block(int format, const float* x, uint8_t* out) {
  float amax = 0.f, max = 0.f;
  for (int i = 0; i < 32; ++i) {
    if (amax < fabsf(x[i])) {  // the first of equal sizes, as llama.cpp's loop and torch's argmax
      amax = fabsf(x[i]);
      max = x[i];
    }
  }
  uint8_t bytes[32];
  int nbytes = 0;
  float d = 0.f;
  if (format == kQ8_0) {
    d = __fdiv_rn(amax, 127.f);
    const float id = inverse(d);
    for (int i = 0; i < 32; ++i) bytes[i] = static_cast<uint8_t>(static_cast<int8_t>(roundf(__fmul_rn(x[i], id))));
    nbytes = 32;
  } else if (format == kQ4_0) {
    d = __fdiv_rn(max, -8.f);
    const float id = inverse(d);
    uint8_t q[32];
    for (int i = 0; i < 32; ++i) q[i] = static_cast<uint8_t>(fminf(fmaxf(truncf(__fadd_rn(__fmul_rn(x[i], id), 8.5f)), 0.f), 15.f));
    for (int j = 0; j < 16; ++j) bytes[j] = q[j] | (q[j + 16] << 4);
    nbytes = 16;
  } else {
    const int levels = format == kQ4h ? 16 : 8;
    const float mid = format == kQ4h ? 7.5f : 3.5f, half_levels = static_cast<float>(levels / 2);
    const float top = __fdiv_rn(amax, mid);
    float best_err = 0.f;
    uint8_t best[32];
    for (int c = 0; c < 6; ++c) {
      const float dc = __half2float(__float2half_rn(__fmul_rn(top, kFractions[c])));
      const float inv = inverse(dc);
      float err = 0.f;
      uint8_t q[32];
      for (int i = 0; i < 32; ++i) {
        const float code = fminf(fmaxf(floorf(__fadd_rn(__fmul_rn(x[i], inv), half_levels)), 0.f), levels - 1.f);
        q[i] = static_cast<uint8_t>(code);
        const float e = __fsub_rn(__fmul_rn(code - mid, dc), x[i]);
        err = __fadd_rn(err, __fmul_rn(e, e));
      }
      if (c == 0 || err < best_err) {
        best_err = err;
        d = dc;
        for (int i = 0; i < 32; ++i) best[i] = q[i];
      }
    }
    if (format == kQ4h) {
      for (int j = 0; j < 16; ++j) bytes[j] = best[j] | (best[j + 16] << 4);
      nbytes = 16;
    } else {
      for (int j = 0; j < 8; ++j)
        bytes[j] = (best[j] & 3) | ((best[j + 8] & 3) << 2) | ((best[j + 16] & 3) << 4) | ((best[j + 24] & 3) << 6);
      for (int j = 0; j < 4; ++j) {
        uint8_t h = 0;
        for (int i = 0; i < 8; ++i) h |= ((best[j + 4 * i] >> 2) & 1) << i;
        bytes[8 + j] = h;
      }
      nbytes = 12;
    }
  }
  const uint16_t dh = f16_bits(d);
  out[0] = static_cast<uint8_t>(dh & 0xff);
  out[1] = static_cast<uint8_t>(dh >> 8);
  for (int i = 0; i < nbytes; ++i) out[2 + i] = bytes[i];
}

// x [tokens, kv_heads, D] fp32 -> cache [slots, kv_heads, D / 32 * block_bytes] at slots[token].
__global__ void kv_quantize_rows_kernel(const float* x, const int64_t* slots, uint8_t* cache, int64_t tokens,
                                        int kv_heads, int dim, int format) {
  grid_dependency_wait();
  grid_dependents_launch();
  const int blocks_per_row = dim / 32, bb = block_bytes(format);
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= tokens * kv_heads * blocks_per_row) return;
  const int64_t row = i / blocks_per_row, t = row / kv_heads;
  const int blk = static_cast<int>(i % blocks_per_row), h = static_cast<int>(row % kv_heads);
  const int64_t slot = slots[t];
  if (slot < 0) return;
  uint8_t* out = cache + ((slot * kv_heads + h) * blocks_per_row + blk) * bb;
  encode_block(format, x + i * 32, out);
}

template <typename T, int D, int GMAX, int WARPS>
__global__ void __launch_bounds__(WARPS * 32)
    paged_decode_quant_kernel(const decode_attention::DecodeParams p, const int k_format, const int v_format) {
  using namespace decode_attention;
  grid_dependency_wait();
  grid_dependents_launch();
  constexpr int VW = 8;  // values a thread owns: a quarter of a block
  constexpr int TPT = D / VW;
  constexpr int TPW = 32 / TPT;
  constexpr int PASS = WARPS * TPW;
  static_assert(Vec<T>::N == VW, "16-bit q: one 16-byte load a thread");

  __shared__ float s_scores[GMAX][kPartitionTokens];
  __shared__ float s_red[WARPS][GMAX][D];
  __shared__ float s_max[GMAX], s_sum[GMAX];
  __shared__ int64_t s_slot[kPartitionTokens];

  const DecodeBlock<T, D> blk(p, GMAX);
  if (blk.idle(p, WARPS * 32)) return;
  const int kvh = blk.kvh, b = blk.b, part = blk.part, seq_len = blk.seq_len;
  const int ng = blk.ng, head0 = blk.head0;
  const int64_t row = blk.row;
  T* out = blk.out;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int start = part * kPartitionTokens;
  const int n = min(kPartitionTokens, seq_len - start);
  const int sub = lane % TPT, tok = lane / TPT;
  const int quarter = sub & 3;

  float qv[GMAX][VW];
  {
    const T* qp = static_cast<const T*>(p.q) + row * p.q_row_stride + static_cast<int64_t>(head0) * D + sub * VW;
#pragma unroll
    for (int g = 0; g < GMAX; ++g) {
      const Vec<T> x = g < ng ? load_vec(qp + g * D) : Vec<T>{};
#pragma unroll
      for (int e = 0; e < VW; ++e) qv[g][e] = g < ng ? to_float(x.v[e]) : 0.f;
    }
  }

  const int k_row = D / 32 * block_bytes(k_format), v_row = D / 32 * block_bytes(v_format);
  const int k_off = kvh * k_row + (sub / 4) * block_bytes(k_format);
  const int v_off = kvh * v_row + (sub / 4) * block_bytes(v_format);
  const uint8_t* kc = static_cast<const uint8_t*>(p.k_cache);
  const uint8_t* vc = static_cast<const uint8_t*>(p.v_cache);
  const int64_t k_slot = static_cast<int64_t>(p.num_kv_heads) * k_row, v_slot = static_cast<int64_t>(p.num_kv_heads) * v_row;
  fill_slots(s_slot, p.block_tables + b * p.bt_stride, start, n, p.page_size);  // ends with a barrier

  for (int t0 = warp * TPW; t0 < n; t0 += PASS * kUnrollQ) {
    Raw raw[kUnrollQ];
#pragma unroll
    for (int u = 0; u < kUnrollQ; ++u) {
      const int t = t0 + u * PASS + tok;
      if (t < n) raw[u] = load_raw(k_format, kc + s_slot[t] * k_slot + k_off, quarter);
    }
#pragma unroll
    for (int u = 0; u < kUnrollQ; ++u) {
      const int t = t0 + u * PASS + tok;
      float kf[VW];
      if (t < n) {
        decode8(k_format, raw[u], quarter, kf);
      } else {
#pragma unroll
        for (int e = 0; e < VW; ++e) kf[e] = 0.f;
      }
#pragma unroll
      for (int g = 0; g < GMAX; ++g) {
        float s = 0.f;
#pragma unroll
        for (int e = 0; e < VW; ++e) s = fmaf(qv[g][e], kf[e], s);
#pragma unroll
        for (int o = TPT / 2; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
        if (sub == 0 && t < n && g < ng) s_scores[g][t] = s * p.scale;
      }
    }
  }
  __syncthreads();

  for (int g = warp; g < ng; g += WARPS) {
    float m = -INFINITY;
    for (int t = lane; t < n; t += 32) m = fmaxf(m, s_scores[g][t]);
    m = warp_max(m);
    float l = 0.f;
    for (int t = lane; t < n; t += 32) {
      const float e = expf(s_scores[g][t] - m);
      s_scores[g][t] = e;
      l += e;
    }
    l = warp_sum(l);
    if (lane == 0) {
      s_max[g] = m;
      s_sum[g] = l;
    }
  }
  __syncthreads();

  float acc[GMAX][VW];
#pragma unroll
  for (int g = 0; g < GMAX; ++g)
#pragma unroll
    for (int e = 0; e < VW; ++e) acc[g][e] = 0.f;
  for (int t0 = warp * TPW; t0 < n; t0 += PASS * kUnrollQ) {
    Raw raw[kUnrollQ];
#pragma unroll
    for (int u = 0; u < kUnrollQ; ++u) {
      const int t = t0 + u * PASS + tok;
      if (t < n) raw[u] = load_raw(v_format, vc + s_slot[t] * v_slot + v_off, quarter);
    }
#pragma unroll
    for (int u = 0; u < kUnrollQ; ++u) {
      const int t = t0 + u * PASS + tok;
      if (t < n) {
        float vf[VW];
        decode8(v_format, raw[u], quarter, vf);
#pragma unroll
        for (int g = 0; g < GMAX; ++g) {
          const float w = g < ng ? s_scores[g][t] : 0.f;
#pragma unroll
          for (int e = 0; e < VW; ++e) acc[g][e] = fmaf(w, vf[e], acc[g][e]);
        }
      }
    }
  }
#pragma unroll
  for (int g = 0; g < GMAX; ++g)
#pragma unroll
    for (int e = 0; e < VW; ++e)
#pragma unroll
      for (int o = TPT; o < 32; o <<= 1) acc[g][e] += __shfl_xor_sync(0xffffffffu, acc[g][e], o);
  if (lane < TPT) {
#pragma unroll
    for (int g = 0; g < GMAX; ++g)
      if (g < ng)
#pragma unroll
        for (int e = 0; e < VW; ++e) s_red[warp][g][sub * VW + e] = acc[g][e];
  }
  __syncthreads();

  for (int i = tid; i < ng * D; i += WARPS * 32) {
    const int g = i / D, d = i % D;
    float o = 0.f;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) o += s_red[w][g][d];
    if (p.max_parts == 1) {
      out[i] = from_float<T>(o * (1.f / s_sum[g]));
    } else {
      const int64_t idx = (static_cast<int64_t>(b) * p.num_heads + head0 + g) * p.max_parts + part;
      p.part_acc[idx * D + d] = o;
      if (d == 0) {
        p.part_ml[idx * 2] = s_max[g];
        p.part_ml[idx * 2 + 1] = s_sum[g];
      }
    }
  }
}

template <typename T, int D>
void launch_quant_group(const decode_attention::DecodeParams& p, int k_format, int v_format, int gmax,
                        const dim3& grid, cudaStream_t stream, bool pdl) {
  const dim3 threads(kWarpsQ * 32);
  switch (gmax) {
    case 1: launch_pdl(paged_decode_quant_kernel<T, D, 1, kWarpsQ>, grid, threads, 0, stream, pdl, p, k_format, v_format); break;
    case 2: launch_pdl(paged_decode_quant_kernel<T, D, 2, kWarpsQ>, grid, threads, 0, stream, pdl, p, k_format, v_format); break;
    case 4: launch_pdl(paged_decode_quant_kernel<T, D, 4, kWarpsQ>, grid, threads, 0, stream, pdl, p, k_format, v_format); break;
    default: launch_pdl(paged_decode_quant_kernel<T, D, 8, kWarpsQ>, grid, threads, 0, stream, pdl, p, k_format, v_format); break;
  }
}

void check_format(int64_t format, const at::Tensor& cache, int64_t head_dim, const char* name) {
  TORCH_CHECK(block_bytes(static_cast<int>(format)) > 0, "quantized KV cache: ", name, " has an unknown page type ",
              format, " (2 q8_0, 3 q4_0, 4 q4h, 5 q3h)");
  TORCH_CHECK(cache.scalar_type() == at::kByte, "quantized KV cache: ", name, " must be uint8, got ", cache.scalar_type());
  TORCH_CHECK(cache.dim() == 4 && cache.is_contiguous() &&
                  cache.size(3) == head_dim / 32 * block_bytes(static_cast<int>(format)),
              "quantized KV cache: ", name, " must be contiguous uint8 [pages, page_size, kv_heads, ",
              head_dim / 32 * block_bytes(static_cast<int>(format)), "], got ", cache.sizes());
}

}  // namespace

void kv_quantize_rows(const at::Tensor& x, const at::Tensor& cache, const at::Tensor& slot_mapping, int64_t format,
                      bool pdl) {
  EXL_CHECK_CUDA_TENSOR(x, "kv_quantize_rows: x");
  EXL_CHECK_CUDA_TENSOR(cache, "kv_quantize_rows: cache");
  EXL_CHECK_CUDA_TENSOR(slot_mapping, "kv_quantize_rows: slot_mapping");
  EXL_CHECK_DTYPE(x, at::kFloat, "kv_quantize_rows: x");
  EXL_CHECK_DTYPE(slot_mapping, at::kLong, "kv_quantize_rows: slot_mapping");
  TORCH_CHECK(x.dim() == 3 && x.is_contiguous() && x.size(2) % 32 == 0 && x.size(2) > 0,
              "kv_quantize_rows: x must be a contiguous fp32 [tokens, kv_heads, D], D a multiple of 32, got ", x.sizes());
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.is_contiguous() && slot_mapping.size(0) == x.size(0),
              "kv_quantize_rows: slot_mapping must be a contiguous int64 [", x.size(0), "]");
  TORCH_CHECK(block_bytes(static_cast<int>(format)) > 0, "kv_quantize_rows: unknown page type ", format);
  TORCH_CHECK(cache.dim() == 3 && cache.is_contiguous() && cache.size(1) == x.size(1) &&
                  cache.size(2) == x.size(2) / 32 * block_bytes(static_cast<int>(format)),
              "kv_quantize_rows: cache must be contiguous uint8 [slots, ", x.size(1), ", ",
              x.size(2) / 32 * block_bytes(static_cast<int>(format)), "], got ", cache.sizes());
  EXL_CHECK_DTYPE(cache, at::kByte, "kv_quantize_rows: cache");
  const int64_t blocks = x.numel() / 32;
  if (blocks == 0) return;
  const c10::cuda::CUDAGuard guard(x.device());
  constexpr int kThreads = 128;
  launch_pdl(kv_quantize_rows_kernel, dim3(static_cast<unsigned>((blocks + kThreads - 1) / kThreads)), dim3(kThreads),
             0, current_stream(), pdl, x.data_ptr<float>(), slot_mapping.data_ptr<int64_t>(), cache.data_ptr<uint8_t>(),
             x.size(0), static_cast<int>(x.size(1)), static_cast<int>(x.size(2)), static_cast<int>(format));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

at::Tensor paged_attention_decode_quant(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                        int64_t k_format, int64_t v_format, const at::Tensor& block_tables,
                                        const at::Tensor& seq_lens, double scale, bool pdl) {
  for (const at::Tensor* t : {&q, &k_cache, &v_cache, &block_tables, &seq_lens}) {
    EXL_CHECK_CUDA_TENSOR(*t, "quantized paged attention: every input");
    TORCH_CHECK(t->device() == q.device(), "quantized paged attention: inputs are on different devices");
  }
  TORCH_CHECK(q.dim() == 3 && (q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kHalf),
              "quantized paged attention: q must be bf16 or fp16 [tokens, heads, head_dim], got ", q.scalar_type(),
              " ", q.sizes());
  const int64_t head_dim = q.size(2);
  TORCH_CHECK(head_dim == 64 || head_dim == 128, "quantized paged attention: head_dim must be 64 or 128, got ", head_dim);
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == head_dim && q.stride(0) % 8 == 0 && aligned16(q.data_ptr()),
              "quantized paged attention: q must have packed heads and 16-byte aligned rows");
  check_format(k_format, k_cache, head_dim, "k_cache");
  check_format(v_format, v_cache, head_dim, "v_cache");
  TORCH_CHECK(k_cache.size(0) == v_cache.size(0) && k_cache.size(1) == v_cache.size(1) &&
                  k_cache.size(2) == v_cache.size(2),
              "quantized paged attention: k_cache ", k_cache.sizes(), " and v_cache ", v_cache.sizes(),
              " differ in pages, page size or kv heads");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0, "quantized paged attention: ", q.size(1),
              " query heads are not a multiple of ", k_cache.size(2), " kv heads");
  EXL_CHECK_DTYPE(block_tables, at::kInt, "quantized paged attention: block_tables");
  EXL_CHECK_DTYPE(seq_lens, at::kInt, "quantized paged attention: seq_lens");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.stride(1) == 1 && seq_lens.dim() == 1 &&
                  seq_lens.is_contiguous() && seq_lens.size(0) == block_tables.size(0) && seq_lens.size(0) == q.size(0),
              "quantized paged attention: one query per sequence: q ", q.sizes(), ", block_tables ",
              block_tables.sizes(), ", seq_lens ", seq_lens.sizes());
  const c10::cuda::CUDAGuard guard(q.device());
  at::Tensor out = at::empty(q.sizes(), q.options().memory_format(at::MemoryFormat::Contiguous));
  const int num_seqs = static_cast<int>(seq_lens.size(0));
  if (num_seqs == 0) return out;
  TORCH_CHECK(num_seqs <= 65535, "quantized paged attention: at most 65535 sequences per call, got ", num_seqs);
  at::Tensor part_acc, part_ml;
  decode_attention::DecodeParams p = decode_attention::decode_params(q, k_cache.size(2), k_cache.size(1), block_tables,
                                                                     seq_lens, scale, part_acc, part_ml);
  p.out = out.data_ptr();
  p.k_cache = k_cache.data_ptr();
  p.v_cache = v_cache.data_ptr();
  p.query_start_loc = nullptr;
  const int gmax = decode_attention::group_max(p.group);
  const dim3 grid(p.num_kv_heads * p.head_chunks, num_seqs, p.max_parts);
  const cudaStream_t stream = current_stream();
  const int kf = static_cast<int>(k_format), vf = static_cast<int>(v_format);
  if (q.scalar_type() == at::kBFloat16) {
    if (head_dim == 64) launch_quant_group<__nv_bfloat16, 64>(p, kf, vf, gmax, grid, stream, pdl);
    else launch_quant_group<__nv_bfloat16, 128>(p, kf, vf, gmax, grid, stream, pdl);
  } else {
    if (head_dim == 64) launch_quant_group<__half, 64>(p, kf, vf, gmax, grid, stream, pdl);
    else launch_quant_group<__half, 128>(p, kf, vf, gmax, grid, stream, pdl);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  decode_attention::launch_combine(p, q.scalar_type(), static_cast<int>(head_dim), num_seqs, stream, pdl);
  return out;
}

}  // namespace exlcli
