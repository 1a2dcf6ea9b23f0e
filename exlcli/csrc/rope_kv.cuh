// Where a q|k|v projection's epilogue puts its rows when it also does rope.cu's work: q heads rotated
// (rotate-half form) into q_out, k heads rotated and v heads copied into their KV pages. The decode
// linear kernel (decode_gemv.cuh, kRopeKV), the FP8 products of 9-64 tokens (fp8_gemm.cu) and the dp4a
// products of 1-2 tokens over packed integer weights (quant_linear.cu, RopePairTiles) store through
// store_rope_pair, with rope.cu's products and roundings, so all of them write rope.cu's bytes.
#pragma once

#include <cstdint>

#include <ATen/ops/empty.h>

#include "common.cuh"
#include "kv_e4m3.cuh"
#include "ops.h"

namespace exlcli {

// Rows of the q|k|v weight: num_heads q heads, then num_kv_heads k heads, then as many v heads.
struct RopeKV {
  void* q_out;  // [tokens, num_heads, head_dim] contiguous, of T
  const int64_t* positions;  // [tokens]
  const float* cos_sin;  // [positions, head_dim]: cos | sin
  int64_t cs_stride;
  void* k_cache;  // [pages, page_size, num_kv_heads, head_dim] contiguous, of T or e4m3 bytes
  void* v_cache;
  bool cache_e4m3;  // the caches hold e4m3 bytes (kv_e4m3.cuh), not T
  const int64_t* slots;  // [tokens]; negative (a padded row of a captured graph): write nothing
  int num_heads, num_kv_heads, head_dim;
};

// The cos and sin of element j (< head_dim / 2) at `position`, for q and k heads (v heads take none).
struct RopeAngle {
  float c = 1.f, s = 0.f;
};

__device__ __forceinline__ RopeAngle rope_angle(const RopeKV& r, int head, int j, int64_t position) {
  RopeAngle a;
  if (head < r.num_heads + r.num_kv_heads) {
    const float* cs = r.cos_sin + position * r.cs_stride;
    a.c = cs[j];
    a.s = cs[r.head_dim / 2 + j];
  }
  return a;
}

// Elements j and j + head_dim / 2 of head `head` of `token`, xa and xb already rounded to T: rotated
// (q, k) with rope.cu's rounded products (no fused multiply-add), or copied (v), then stored.
template <typename T>
__device__ __forceinline__ void store_rope_pair(const RopeKV& r, int head, int j, int64_t token, float xa, float xb,
                                                const RopeAngle& a, int64_t slot) {
  const int d = r.head_dim, half = d / 2;
  const int qk_heads = r.num_heads + r.num_kv_heads;
  float oa = xa, ob = xb;
  if (head < qk_heads) {
    oa = __fsub_rn(__fmul_rn(xa, a.c), __fmul_rn(xb, a.s));
    ob = __fadd_rn(__fmul_rn(xb, a.c), __fmul_rn(xa, a.s));
  }
  if (head < r.num_heads) {
    T* const dst = static_cast<T*>(r.q_out) + (token * r.num_heads + head) * d;
    dst[j] = from_float<T>(oa);
    dst[j + half] = from_float<T>(ob);
    return;
  }
  if (slot < 0) return;
  void* const cache = head < qk_heads ? r.k_cache : r.v_cache;
  const int kv_head = head < qk_heads ? head - r.num_heads : head - qk_heads;
  const int64_t at = (slot * r.num_kv_heads + kv_head) * d;
  if (r.cache_e4m3) {
    uint8_t* const dst = static_cast<uint8_t*>(cache) + at;
    dst[j] = e4m3_of(from_float<T>(oa));
    dst[j + half] = e4m3_of(from_float<T>(ob));
  } else {
    T* const dst = static_cast<T*>(cache) + at;
    dst[j] = from_float<T>(oa);
    dst[j + half] = from_float<T>(ob);
  }
}

// The checked RopeKV of an op that rotates and writes, as rope.cu does, the q|k|v rows (weight_rows of
// them) of `tokens` tokens whose activations have `options` (dtype, device); q_out ([tokens, num_heads,
// head_dim] of that dtype, contiguous) is allocated here unless the caller gives one.
inline RopeKV rope_kv_params(const char* op, int64_t tokens, const at::TensorOptions& options, int64_t weight_rows,
                             const at::Tensor& positions, const at::Tensor& cos_sin, const at::Tensor& k_cache,
                             const at::Tensor& v_cache, const at::Tensor& slot_mapping, int64_t num_heads,
                             at::Tensor& q_out) {
  const at::ScalarType dtype = options.dtype().toScalarType();
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.sizes() == k_cache.sizes() &&
                  v_cache.is_contiguous() && v_cache.scalar_type() == k_cache.scalar_type() &&
                  (k_cache.scalar_type() == dtype || is_e4m3_cache(k_cache)),
              op, ": caches must be contiguous [pages, page_size, kv_heads, head_dim] of the activations' dtype "
              "or e4m3");
  const int64_t kv_heads = k_cache.size(2), head_dim = k_cache.size(3);
  TORCH_CHECK((head_dim == 64 || head_dim == 128) && weight_rows == (num_heads + 2 * kv_heads) * head_dim,
              op, ": weight rows must be (num_heads + 2 kv_heads) * head_dim");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.numel() == tokens && positions.is_contiguous() &&
                  slot_mapping.scalar_type() == at::kLong && slot_mapping.numel() == tokens &&
                  slot_mapping.is_contiguous(),
              op, ": positions and slot_mapping must be contiguous int64 [rows]");
  TORCH_CHECK(cos_sin.scalar_type() == at::kFloat && cos_sin.dim() == 2 && cos_sin.size(1) == head_dim &&
                  cos_sin.stride(1) == 1,
              op, ": cos_sin must be fp32 [positions, head_dim]");
  for (const at::Tensor* t : {&positions, &cos_sin, &k_cache, &v_cache, &slot_mapping}) {
    TORCH_CHECK(t->device() == options.device(), op, ": every tensor must be on one device");
  }
  if (q_out.defined()) {
    TORCH_CHECK(q_out.sizes() == at::IntArrayRef({tokens, num_heads, head_dim}) && q_out.scalar_type() == dtype &&
                    q_out.is_contiguous() && q_out.device() == options.device(),
                op, ": q_out must be a contiguous [tokens, num_heads, head_dim] tensor of the activations' dtype");
  } else {
    q_out = at::empty({tokens, num_heads, head_dim}, options.memory_format(at::MemoryFormat::Contiguous));
  }
  RopeKV r{};
  r.q_out = q_out.data_ptr();
  r.positions = positions.data_ptr<int64_t>();
  r.cos_sin = cos_sin.data_ptr<float>();
  r.cs_stride = cos_sin.stride(0);
  r.k_cache = k_cache.data_ptr();
  r.v_cache = v_cache.data_ptr();
  r.cache_e4m3 = is_e4m3_cache(k_cache);
  r.slots = slot_mapping.data_ptr<int64_t>();
  r.num_heads = static_cast<int>(num_heads);
  r.num_kv_heads = static_cast<int>(kv_heads);
  r.head_dim = static_cast<int>(head_dim);
  return r;
}

}  // namespace exlcli
