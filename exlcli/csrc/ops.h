// The torch-facing functions registered in bindings.cpp, one group per .cu file.
//
// Every op that launches a kernel takes `pdl`: whether to launch it as a programmatic dependent
// launch (it is one only on sm_90+ whatever the caller asks). Python decides it (from its table of
// variables, or a benchmark's choice) and passes it; nothing here reads the environment or keeps a setting.
#pragma once

#include <optional>
#include <tuple>

#include <ATen/core/Tensor.h>

namespace exlcli {

// device_info.cu: whether the current device has cp.async, bf16 mma and flash attention (sm_80+;
// cached per device).
bool device_has_sm80();

// True when a KV cache tensor holds e4m3 bytes (--kv-cache-dtype fp8, kv_e4m3.cuh), not the
// activations' dtype.
inline bool is_e4m3_cache(const at::Tensor& cache) { return cache.scalar_type() == at::kFloat8_e4m3fn; }

// norm.cu
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, bool pdl);
std::tuple<at::Tensor, at::Tensor> fused_add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                      const at::Tensor& weight, double eps, bool pdl);
// The normalised rows (of x + residual, when given) as e4m3 for FP8 products: (q [rows, hidden]
// float8_e4m3fn, scale [rows, 1] fp32, the new residual: x + residual, or x itself without one), the
// same bytes as quantize_rows_e4m3 of rms_norm / fused_add_rms_norm (bf16 x, hidden a multiple of 8).
std::tuple<at::Tensor, at::Tensor, at::Tensor> rms_norm_e4m3(const at::Tensor& x,
                                                            const std::optional<at::Tensor>& residual,
                                                            const at::Tensor& weight, double eps, bool pdl);

// activation.cu
at::Tensor silu_and_mul(const at::Tensor& x, bool pdl);
// The same rows as e4m3 for FP8 products: the bytes of quantize_rows_e4m3(silu_and_mul(x)) (bf16 x).
std::tuple<at::Tensor, at::Tensor> silu_and_mul_e4m3(const at::Tensor& x, bool pdl);

// linear.cu: y = x @ weight^T (+ bias) for 1 to 4 rows (decode), bf16 / fp16 (or e4m3 weights times
// weight_scale per row, with bf16 x), with optional fused stages: x normalised first (norm_weight) or x = silu(gate) * up of a [rows, 2k] x (silu); the
// result added to a residual (residual) or returned as fp32 (float_out). With none of them it is
// the plain product.
at::Tensor decode_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                         const std::optional<at::Tensor>& weight_scale, const std::optional<at::Tensor>& norm_weight, double eps, bool silu,
                         const std::optional<at::Tensor>& residual, bool float_out, bool pdl);
// The fused q|k|v projection of decode: (optionally normalised) x @ weight^T, q and k rotated, k and
// v written at slot_mapping of their caches; returns the rotated q [rows, num_heads, head_dim].
at::Tensor decode_qkv_rope(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                           const std::optional<at::Tensor>& weight_scale, const std::optional<at::Tensor>& norm_weight, double eps, const at::Tensor& positions,
                           const at::Tensor& cos_sin, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& slot_mapping, int64_t num_heads, bool pdl);

// fp8_quant.cu: bf16 x [m, k] quantized per row to e4m3 for FP8 products: (q [m, k] float8_e4m3fn,
// scale [m, 1] fp32) with x ~ q * scale, scale = amax(|row|) / 448.
std::tuple<at::Tensor, at::Tensor> quantize_rows_e4m3(const at::Tensor& x, bool pdl);

// fp8_linear.cu: (xq @ weight^T) * x_scale * w_scale (+ bias) for e4m3 xq [m, k] with a scale per row
// and e4m3 weights [n, k] with a scale per row, bf16 [m, n], on the tensor cores (sm_89+).
at::Tensor fp8_linear(const at::Tensor& xq, const at::Tensor& x_scale, const at::Tensor& weight,
                      const at::Tensor& w_scale, const std::optional<at::Tensor>& bias, bool pdl);

// fp8_gemm.cu: the same product for 9 to 64 tokens, tiled through shared memory on wgmma (sm_90+):
// blocks of block_rows (64 or 128) weight rows x block_tokens (32 or 64) tokens, the input features cut
// into `splits` (1 to 8) slices of whole 128-feature steps summed across a cluster; n a multiple of
// block_rows, k of 128 and at least 128 * splits.
at::Tensor fp8_gemm(const at::Tensor& xq, const at::Tensor& x_scale, const at::Tensor& weight,
                    const at::Tensor& w_scale, const std::optional<at::Tensor>& bias, int64_t splits,
                    int64_t block_tokens, int64_t block_rows, bool pdl);
// And for a q|k|v projection (blocks of 128 rows): its rows rotated and written as rope_and_write_kv
// does, q returned as [m, num_heads, head_dim] bf16, k and v written into the caches at slot_mapping.
at::Tensor fp8_gemm_qkv_rope(const at::Tensor& xq, const at::Tensor& x_scale, const at::Tensor& weight,
                             const at::Tensor& w_scale, const std::optional<at::Tensor>& bias, int64_t splits,
                             int64_t block_tokens, const at::Tensor& positions, const at::Tensor& cos_sin,
                             const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& slot_mapping,
                             int64_t num_heads, bool pdl);

// quant_linear.cu: weights kept quantized in the packed layout of quant_linear.cuh (bits 4, 6 or 8, groups
// of 16 to 128 along k; e4m3: 8-bit FP8 values): y = x @ w^T (+ bias) for bf16 x [m, k] into bf16 (or
// fp32: float_out) [m, n], and the dense bf16 weight [n, k] (for products of many tokens through cuBLAS).
at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales, int64_t bits,
                        bool e4m3, int64_t group, int64_t n, const std::optional<at::Tensor>& bias, bool float_out,
                        bool pdl);
// And for a q|k|v weight over integer weights (not e4m3), or whole heads of one from first_head on (n rows):
// the product of 1 or 2 tokens on the dp4a kernel, its rows rotated and written as rope_and_write_kv does in
// the kernel's epilogue (q heads into q_out [m, num_heads, head_dim] bf16, k and v into their pages).
void quant_heads_rope(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales, int64_t bits,
                      int64_t group, int64_t n, const std::optional<at::Tensor>& bias, const at::Tensor& positions,
                      const at::Tensor& cos_sin, const at::Tensor& k_cache, const at::Tensor& v_cache,
                      const at::Tensor& slot_mapping, int64_t num_heads, int64_t first_head, const at::Tensor& q_out,
                      bool pdl);
at::Tensor quant_dequantize(const at::Tensor& qweight, const at::Tensor& scales, int64_t bits, bool e4m3,
                            int64_t group, int64_t n, int64_t k, bool pdl);

// exl3_linear.cu: EXL3 trellis weights in the repacked layout of exl3_trellis.cuh (trellis uint8, bits 1 to 8,
// codebook 0 = 3INST, 1 = MCG, 2 = MUL1; suh fp16 [parts, k], one row for each distinct input scale; parts int32
// [n / 128], the suh row of each 128 rows; svh fp16 [n]). exl3_linear: y = x @ W^T (+ bias) for bf16 or fp16 x
// [m, k], m <= 64, into x's dtype (or fp32: float_out) [m, n]; with counters (int32 [n / 128], zero between
// calls, one linear's own) the product kernel's last slice of each 128 rows writes them, else a kernel of its
// own does (the same bytes). exl3_dequantize: W [n, k] in bf16 (or fp16).
at::Tensor exl3_linear(const at::Tensor& x, const at::Tensor& trellis, const at::Tensor& suh, const at::Tensor& svh,
                       const at::Tensor& parts, int64_t bits, int64_t codebook, int64_t n,
                       const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& counters,
                       bool float_out, bool pdl);
at::Tensor exl3_dequantize(const at::Tensor& trellis, const at::Tensor& suh, const at::Tensor& svh,
                           const at::Tensor& parts, int64_t bits, int64_t codebook, int64_t n, int64_t k, bool bf16,
                           bool pdl);

// moe.cu: one layer's experts stacked in the packed layout (qweight int32 [experts, n k bits / 32], scales
// [experts, ...] as quant_linear's; integer weights only). moe_gemv: for each (token, slot) pair, the product
// of its expert (ids int32 [pairs]) over row pair / rows_per_x of bf16 x [rows, k] into bf16 (or fp32:
// float_out) [pairs, n], the bytes of quant_linear at one token; order (int32 [pairs], optional) is the order
// the blocks take the pairs in. moe_combine: fp32 rows [tokens * top_k, n] summed per token in slot order,
// each times its weight (fp32 [tokens * top_k]): fp32 [tokens, n].
at::Tensor moe_gemv(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales, int64_t bits,
                    int64_t group, int64_t n, const at::Tensor& ids, const std::optional<at::Tensor>& order,
                    int64_t rows_per_x, bool float_out, bool pdl);
// moe_gemm: the same products for many tokens on the tensor cores, grouped by expert: order (int32 [pairs]) the
// pairs sorted by expert, expert_offsets and tile_offsets (int32 [experts + 1]) each expert's first place in order
// and first tile of tile_tokens (32 or 64) pairs, max_tiles the grid's bound of the tiles; each pair's row is the
// bytes of quant_linear's tensor-core kernel over its expert.
at::Tensor moe_gemm(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales, int64_t bits,
                    int64_t group, int64_t n, const at::Tensor& order, const at::Tensor& expert_offsets,
                    const at::Tensor& tile_offsets, int64_t tile_tokens, int64_t max_tiles, int64_t rows_per_x,
                    bool float_out, bool pdl);
// moe_combine: into fp32 [tokens, n], or that sum rounded to bf16 (bf16_out).
at::Tensor moe_combine(const at::Tensor& rows, const at::Tensor& weights, int64_t top_k, bool bf16_out, bool pdl);
// moe_route: fp32 router logits [tokens, experts] -> (weights fp32, ids int32) [tokens, top_k], top_k <= 32:
// softmax then the top k (normalized when `normalize`), or (softmax_first false) the top k then their softmax.
// moe_plan: moe_stacked.plan_groups' (order, expert_offsets, tile_offsets) of int32 ids [pairs] in one launch of
// one block ((pairs + experts + 1) * 4 bytes of shared memory at most 44 KiB); ids outside the experts go after them.
std::tuple<at::Tensor, at::Tensor, at::Tensor> moe_plan(const at::Tensor& ids, int64_t experts, int64_t tile_tokens,
                                                         bool pdl);
std::tuple<at::Tensor, at::Tensor> moe_route(const at::Tensor& logits, int64_t top_k, bool softmax_first,
                                             bool normalize, bool pdl);
// The fused pairs path (moe.cu): moe_gate_up_act: moe_gemv of the stacked gate|up ([gate; up], 2 inter rows) with
// the expert's bias (bf16 [experts, 2 inter], optional) and the activation (0: SiLU-and-mul, 1: gpt-oss's clamped
// SwiGLU with limit and alpha) in one launch: bf16 act [pairs, inter]. moe_down_combine: moe_gemv of down over act
// (bf16 [tokens * top_k, k]) plus its bias (bf16 [experts, n], optional) and moe_combine with weights (fp32
// [tokens * top_k]) in one launch: fp32 [tokens, n], or bf16 (bf16_out); the bytes of the unfused kernels, whatever
// its warps (8, 16, or 0: chosen by the grid).
at::Tensor moe_gate_up_act(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales, int64_t bits,
                           int64_t group, int64_t inter, const at::Tensor& ids, const std::optional<at::Tensor>& order,
                           int64_t rows_per_x, const std::optional<at::Tensor>& bias, int64_t activation,
                           double limit, double alpha, bool pdl);
at::Tensor moe_down_combine(const at::Tensor& act, const at::Tensor& qweight, const at::Tensor& scales, int64_t bits,
                            int64_t group, int64_t n, const at::Tensor& ids, const at::Tensor& weights, int64_t top_k,
                            const std::optional<at::Tensor>& bias, bool bf16_out, int64_t warps, bool pdl);

// rope.cu
at::Tensor rope_and_write_kv(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             const at::Tensor& positions, const at::Tensor& cos_sin,
                             const at::Tensor& k_cache, const at::Tensor& v_cache,
                             const at::Tensor& slot_mapping, bool pdl);

// attention_decode.cu (kernels in attention_decode_v1.cu and attention_decode_v3.cu). `version`
// is the decode attention kernel, 1 or 3 (fp32 and devices before sm_80 always run version 1).
// The layer's attention kind: `sinks` ([heads] fp32 on q's device, or none), `window` (0: none),
// `softcap` (0: none); ops/attention.py states what each does.
at::Tensor paged_attention_decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale,
                                  const std::optional<at::Tensor>& sinks, int64_t window, double softcap,
                                  int64_t version, bool pdl);

// Checks of the attention kind's arguments (as paged_attention_decode takes them).
void check_attention_kind(const at::Tensor& q, const std::optional<at::Tensor>& sinks, int64_t window,
                          double softcap);

// Checks shared by both attention ops (q: [rows, heads, D]; caches: [pages, page_size, kv_heads, D]).
void check_paged_attention_inputs(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_tables, const at::Tensor& seq_lens);

// Decode attention into `out` ([rows, heads, D], contiguous). With query_start_loc (device, int32,
// [B + 1]) sequence b's query is row query_start_loc[b] and only sequences with exactly one query
// are computed; without it, sequence b's query is row b.
void launch_paged_decode(const at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                         const at::Tensor& v_cache, const at::Tensor& block_tables,
                         const at::Tensor& seq_lens, const int* query_start_loc, double scale,
                         const std::optional<at::Tensor>& sinks, int64_t window, double softcap, int64_t version,
                         bool pdl);

// attention_prefill.cpp: its decode tokens go through the decode kernel of `version`; the attention
// kind as paged_attention_decode takes it.
at::Tensor paged_attention_prefill(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                   const at::Tensor& block_tables, const at::Tensor& query_start_loc,
                                   const at::Tensor& seq_lens, const at::Tensor& host_layout, double scale,
                                   const std::optional<at::Tensor>& sinks, int64_t window, double softcap,
                                   int64_t version, bool pdl);

// argmax.cu: fp32 logits [rows, vocab] -> int64 [2 rows]: each row's argmax (its first largest value),
// then 1 for each row with a NaN or +Inf or no finite value, 0 otherwise.
at::Tensor argmax_rows(const at::Tensor& logits, bool pdl);

// gated_delta.cu: Gated DeltaNet's delta rule over B sequences (the tokens begin[b] .. end[b] - 1 of mixed
// [rows, q | k | v], each from its state in_states[in_slots[b]] (-1: zeros) to out_states[out_slots[b]]),
// writing o fp32 [rows, Hv, Dv] into out; and its causal convolution with SiLU, the conv states likewise.
void gated_delta(const at::Tensor& mixed, const at::Tensor& g, const at::Tensor& beta, const at::Tensor& in_states,
                 const at::Tensor& in_slots, const at::Tensor& out_states, const at::Tensor& out_slots,
                 const at::Tensor& begin, const at::Tensor& end, int64_t k_heads, double scale, double eps,
                 const at::Tensor& out, bool chunked, bool pdl);
void causal_conv1d(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& in_states,
                   const at::Tensor& in_slots, const at::Tensor& out_states, const at::Tensor& out_slots,
                   const at::Tensor& begin, const at::Tensor& end, const at::Tensor& out, bool pdl);

}  // namespace exlcli
