// Registers every exlcli op: schemas in TORCH_LIBRARY, CUDA implementations in TORCH_LIBRARY_IMPL.
// Python reaches them as torch.ops.exlcli.<name> once the library is loaded, only through the
// checked wrappers of exlcli/ops/cuda/kernels.py. Launch choices (pdl, the decode attention
// version) are arguments: the library keeps no settings and reads no environment variable.
#include <torch/library.h>

#include "ops.h"

TORCH_LIBRARY(exlcli, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps, bool pdl) -> Tensor");
  m.def("fused_add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps, bool pdl) -> (Tensor, Tensor)");
  m.def("rms_norm_e4m3(Tensor x, Tensor? residual, Tensor weight, float eps, bool pdl) -> (Tensor, Tensor, Tensor)");
  m.def("silu_and_mul(Tensor x, bool pdl) -> Tensor");
  m.def("silu_and_mul_e4m3(Tensor x, bool pdl) -> (Tensor, Tensor)");
  m.def("decode_linear(Tensor x, Tensor weight, Tensor? bias, Tensor? weight_scale, Tensor? norm_weight, float eps, "
        "bool silu, Tensor? residual, bool float_out, bool pdl) -> Tensor");
  m.def("decode_qkv_rope(Tensor x, Tensor weight, Tensor? bias, Tensor? weight_scale, Tensor? norm_weight, float eps, "
        "Tensor positions, Tensor cos_sin, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping, int num_heads, "
        "bool pdl) -> Tensor");
  m.def("quantize_rows_e4m3(Tensor x, bool pdl) -> (Tensor, Tensor)");
  m.def("fp8_linear(Tensor xq, Tensor x_scale, Tensor weight, Tensor w_scale, Tensor? bias, bool pdl) -> Tensor");
  m.def("fp8_gemm(Tensor xq, Tensor x_scale, Tensor weight, Tensor w_scale, Tensor? bias, int splits, "
        "int block_tokens, int block_rows, bool pdl) -> Tensor");
  m.def("fp8_gemm_qkv_rope(Tensor xq, Tensor x_scale, Tensor weight, Tensor w_scale, Tensor? bias, int splits, "
        "int block_tokens, Tensor positions, Tensor cos_sin, Tensor(a!) k_cache, Tensor(b!) v_cache, "
        "Tensor slot_mapping, int num_heads, bool pdl) -> Tensor");
  m.def("quant_linear(Tensor x, Tensor qweight, Tensor scales, int bits, bool e4m3, int group, int n, Tensor? bias, "
        "bool float_out, bool pdl) -> Tensor");
  m.def("quant_heads_rope(Tensor x, Tensor qweight, Tensor scales, int bits, int group, int n, Tensor? bias, "
        "Tensor positions, Tensor cos_sin, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping, int num_heads, "
        "int first_head, Tensor(c!) q_out, bool pdl) -> ()");
  m.def("quant_dequantize(Tensor qweight, Tensor scales, int bits, bool e4m3, int group, int n, int k, bool pdl) "
        "-> Tensor");
  m.def("exl3_linear(Tensor x, Tensor trellis, Tensor suh, Tensor svh, Tensor parts, int bits, int codebook, int n, "
        "Tensor? bias, Tensor(a!)? counters, bool float_out, bool pdl) -> Tensor");
  m.def("exl3_dequantize(Tensor trellis, Tensor suh, Tensor svh, Tensor parts, int bits, int codebook, int n, int k, "
        "bool bf16, bool pdl) -> Tensor");
  m.def("moe_gemv(Tensor x, Tensor qweight, Tensor scales, int bits, int group, int n, Tensor ids, Tensor? order, "
        "int rows_per_x, bool float_out, bool pdl) -> Tensor");
  m.def("moe_gemm(Tensor x, Tensor qweight, Tensor scales, int bits, int group, int n, Tensor order, "
        "Tensor expert_offsets, Tensor tile_offsets, int tile_tokens, int max_tiles, int rows_per_x, bool float_out, "
        "bool pdl) -> Tensor");
  m.def("moe_combine(Tensor rows, Tensor weights, int top_k, bool bf16_out, bool pdl) -> Tensor");
  m.def("moe_plan(Tensor ids, int experts, int tile_tokens, bool pdl) -> (Tensor, Tensor, Tensor)");
  m.def("moe_route(Tensor logits, int top_k, bool softmax_first, bool normalize, bool pdl) -> (Tensor, Tensor)");
  m.def("moe_gate_up_act(Tensor x, Tensor qweight, Tensor scales, int bits, int group, int inter, Tensor ids, "
        "Tensor? order, int rows_per_x, Tensor? bias, int activation, float limit, float alpha, bool pdl) -> Tensor");
  m.def("moe_down_combine(Tensor act, Tensor qweight, Tensor scales, int bits, int group, int n, Tensor ids, "
        "Tensor weights, int top_k, Tensor? bias, bool bf16_out, int warps, bool pdl) -> Tensor");
  m.def("rope_and_write_kv(Tensor q, Tensor k, Tensor v, Tensor positions, Tensor cos_sin, "
        "Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping, bool pdl) -> Tensor");
  m.def("paged_attention_decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor seq_lens, float scale, Tensor? sinks, int window, float softcap, int version, bool pdl) -> Tensor");
  m.def("paged_attention_prefill(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor query_start_loc, Tensor seq_lens, Tensor host_layout, float scale, Tensor? sinks, int window, "
        "float softcap, int version, bool pdl) -> Tensor");
  m.def("argmax_rows(Tensor logits, bool pdl) -> Tensor");
  m.def("gated_delta(Tensor mixed, Tensor g, Tensor beta, Tensor in_states, Tensor in_slots, Tensor(a!) out_states, "
        "Tensor out_slots, Tensor begin, Tensor end, int k_heads, float scale, float eps, Tensor(b!) out, bool chunked, "
        "bool pdl) "
        "-> ()");
  m.def("causal_conv1d(Tensor x, Tensor weight, Tensor in_states, Tensor in_slots, Tensor(a!) out_states, "
        "Tensor out_slots, Tensor begin, Tensor end, Tensor(b!) out, bool pdl) -> ()");
}

TORCH_LIBRARY_IMPL(exlcli, CUDA, m) {
  m.impl("rms_norm", &exlcli::rms_norm);
  m.impl("fused_add_rms_norm", &exlcli::fused_add_rms_norm);
  m.impl("rms_norm_e4m3", &exlcli::rms_norm_e4m3);
  m.impl("silu_and_mul", &exlcli::silu_and_mul);
  m.impl("silu_and_mul_e4m3", &exlcli::silu_and_mul_e4m3);
  m.impl("decode_linear", &exlcli::decode_linear);
  m.impl("decode_qkv_rope", &exlcli::decode_qkv_rope);
  m.impl("quantize_rows_e4m3", &exlcli::quantize_rows_e4m3);
  m.impl("fp8_linear", &exlcli::fp8_linear);
  m.impl("fp8_gemm", &exlcli::fp8_gemm);
  m.impl("fp8_gemm_qkv_rope", &exlcli::fp8_gemm_qkv_rope);
  m.impl("quant_linear", &exlcli::quant_linear);
  m.impl("quant_heads_rope", &exlcli::quant_heads_rope);
  m.impl("quant_dequantize", &exlcli::quant_dequantize);
  m.impl("exl3_linear", &exlcli::exl3_linear);
  m.impl("exl3_dequantize", &exlcli::exl3_dequantize);
  m.impl("moe_gemv", &exlcli::moe_gemv);
  m.impl("moe_gemm", &exlcli::moe_gemm);
  m.impl("moe_combine", &exlcli::moe_combine);
  m.impl("moe_plan", &exlcli::moe_plan);
  m.impl("moe_route", &exlcli::moe_route);
  m.impl("moe_gate_up_act", &exlcli::moe_gate_up_act);
  m.impl("moe_down_combine", &exlcli::moe_down_combine);
  m.impl("rope_and_write_kv", &exlcli::rope_and_write_kv);
  m.impl("paged_attention_decode", &exlcli::paged_attention_decode);
  m.impl("paged_attention_prefill", &exlcli::paged_attention_prefill);
  m.impl("argmax_rows", &exlcli::argmax_rows);
  m.impl("gated_delta", &exlcli::gated_delta);
  m.impl("causal_conv1d", &exlcli::causal_conv1d);
}
