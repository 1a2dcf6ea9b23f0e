// The torch-facing functions registered in bindings.cpp, one group per .cu file.
#pragma once

#include <optional>
#include <tuple>

#include <ATen/core/Tensor.h>

namespace exlcli {

// norm.cu
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
std::tuple<at::Tensor, at::Tensor> fused_add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                      const at::Tensor& weight, double eps);

// activation.cu
at::Tensor silu_and_mul(const at::Tensor& x);

// linear.cu: y = x @ weight^T (+ bias) for 1 to 4 rows (decode), bf16 / fp16
at::Tensor skinny_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias);

// rope.cu
at::Tensor rope_and_write_kv(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             const at::Tensor& positions, const at::Tensor& cos_sin,
                             const at::Tensor& k_cache, const at::Tensor& v_cache,
                             const at::Tensor& slot_mapping);

// attention_decode.cu
at::Tensor paged_attention_decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale);

// Checks shared by both attention ops (q: [rows, heads, D]; caches: [pages, page_size, kv_heads, D]).
void check_paged_attention_inputs(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_tables, const at::Tensor& seq_lens);

// Decode attention into `out` ([rows, heads, D], contiguous). With query_start_loc (device, int32,
// [B + 1]) sequence b's query is row query_start_loc[b] and only sequences with exactly one query
// are computed; without it, sequence b's query is row b.
void launch_paged_decode(const at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                         const at::Tensor& v_cache, const at::Tensor& block_tables,
                         const at::Tensor& seq_lens, const int* query_start_loc, double scale);

// attention_prefill.cpp
at::Tensor paged_attention_prefill(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                   const at::Tensor& block_tables, const at::Tensor& query_start_loc,
                                   const at::Tensor& seq_lens, double scale);

}  // namespace exlcli
