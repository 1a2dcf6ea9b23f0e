"""The argument structs of the CPU kernels, mirrored from exlcli/csrc/cpu/args.h: one ctypes
Structure per C struct, the same field names in the same order (tests/ops/test_cpu_args_abi.py
compiles the header and checks every size and offset against these). Pointers are c_void_p, so a
tensor's data_ptr() (or None for NULL) goes in as it is."""

from __future__ import annotations

import ctypes

_p, _i64, _i32, _f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32, ctypes.c_float


class KernelArgs(ctypes.Structure):
    """One kernel's arguments. `c_name`: the C struct; `kernel`: the C function that takes a
    pointer to it."""

    c_name = ""
    kernel = ""


class QMatmulArgs(KernelArgs):
    c_name, kernel = "exl_qmatmul_args", "exl_qmatmul"
    _fields_ = [
        ("x", _p), ("rows", _i64), ("in_features", _i64), ("bits", _i32), ("y_fp32", _i32),
        ("offsets", _i32), ("scales_per_block", _i32), ("half_scales", _i32), ("qs", _p), ("d", _p), ("m", _p),
        ("table", _p), ("bias", _p), ("out_features", _i64), ("y", _p),
    ]


class RepackArgs(KernelArgs):
    c_name, kernel = "exl_repack_args", "exl_repack"
    _fields_ = [
        ("src", _p), ("row_bytes", _i64), ("rows", _i64), ("in_features", _i64), ("format", _i32), ("bits", _i32),
        ("zero", _i32), ("scales_per_block", _i32), ("qs", _p), ("d", _p), ("m", _p), ("found", _p),
    ]


class DequantizeArgs(KernelArgs):
    c_name, kernel = "exl_dequantize_args", "exl_dequantize"
    _fields_ = [
        ("src", _p), ("row_bytes", _i64), ("rows", _i64), ("in_features", _i64), ("format", _i32), ("bf16", _i32),
        ("out", _p),
    ]


class PagedAttentionArgs(KernelArgs):
    c_name, kernel = "exl_paged_attention_args", "exl_paged_attention"
    _fields_ = [
        ("q", _p), ("k_cache", _p), ("v_cache", _p), ("block_tables", _p), ("max_pages", _i64),
        ("query_start_loc", _p), ("seq_lens", _p), ("seq_begin", _i64), ("seq_end", _i64),
        ("num_pages", _i64), ("page_size", _i64), ("heads", _i64), ("kv_heads", _i64), ("dim", _i64),
        ("scale", _f32), ("out", _p), ("threads", _i64), ("sinks", _p), ("window", _i64), ("softcap", _f32),
    ]


class PagedAttentionQuantArgs(KernelArgs):
    c_name, kernel = "exl_paged_attention_quant_args", "exl_paged_attention_quant"
    _fields_ = [
        ("q", _p), ("k_cache", _p), ("v_cache", _p), ("k_format", _i32), ("v_format", _i32), ("block_tables", _p),
        ("max_pages", _i64), ("query_start_loc", _p), ("seq_lens", _p), ("num_seqs", _i64), ("num_pages", _i64),
        ("page_size", _i64), ("heads", _i64), ("kv_heads", _i64), ("dim", _i64), ("scale", _f32), ("out", _p),
        ("sinks", _p), ("window", _i64), ("softcap", _f32),
    ]


class KvQuantizeArgs(KernelArgs):
    c_name, kernel = "exl_kv_quantize_args", "exl_kv_quantize"
    _fields_ = [("x", _p), ("rows", _i64), ("dim", _i64), ("format", _i32), ("pad", _i32), ("out", _p)]


class RmsNormArgs(KernelArgs):
    c_name, kernel = "exl_rms_norm_args", "exl_rms_norm"
    _fields_ = [
        ("x", _p), ("stride_outer", _i64), ("stride_inner", _i64), ("inner", _i64), ("weight", _p),
        ("out", _p), ("dim", _i64), ("eps", _f32), ("rows", _i64),
    ]


class FusedAddRmsNormArgs(KernelArgs):
    c_name, kernel = "exl_fused_add_rms_norm_args", "exl_fused_add_rms_norm"
    _fields_ = [
        ("x", _p), ("residual", _p), ("residual_out", _p), ("weight", _p), ("out", _p), ("dim", _i64),
        ("eps", _f32), ("rows", _i64), ("residual_fp32", _i64),
    ]


class MeanSquaresArgs(KernelArgs):
    c_name, kernel = "exl_mean_squares_args", "exl_mean_squares"
    _fields_ = [("x", _p), ("dim", _i64), ("rows", _i64), ("out", _p)]


class RopeArgs(KernelArgs):
    c_name, kernel = "exl_rope_and_write_kv_args", "exl_rope_and_write_kv"
    _fields_ = [
        ("q", _p), ("q_token_stride", _i64), ("q_head_stride", _i64),
        ("k", _p), ("k_token_stride", _i64), ("k_head_stride", _i64),
        ("v", _p), ("v_token_stride", _i64), ("v_head_stride", _i64),
        ("positions", _p), ("cos_sin", _p), ("max_positions", _i64),
        ("k_cache", _p), ("v_cache", _p), ("slots", _p), ("num_slots", _i64),
        ("q_out", _p), ("heads", _i64), ("kv_heads", _i64), ("dim", _i64), ("tokens", _i64),
    ]


class SiluAndMulArgs(KernelArgs):
    c_name, kernel = "exl_silu_and_mul_args", "exl_silu_and_mul"
    _fields_ = [
        ("x", _p), ("x_stride", _i64), ("out", _p), ("out_stride", _i64), ("inter", _i64), ("rows", _i64),
    ]


class DecoderLayerArgs(KernelArgs):
    c_name, kernel = "exl_decoder_layer_args", "exl_decoder_layer"
    _fields_ = [
        # the step's fields (STEP_FIELDS), the same for every layer
        ("h", _p), ("residual", _p), ("tokens", _i64), ("positions", _p), ("slots", _p), ("block_tables", _p),
        ("max_pages", _i64), ("query_start_loc", _p), ("seq_lens", _p), ("num_seqs", _i64), ("scratch", _p),
        ("scratch_elems", _i64), ("threads", _i64),
        # the layer's
        ("first", _i64), ("input_norm", _p), ("post_norm", _p), ("q_norm", _p), ("k_norm", _p),
        ("qkv", _p), ("qkv_parts", _i64), ("o_proj", _p), ("o_proj_parts", _i64), ("gate_up", _p),
        ("gate_up_parts", _i64), ("down", _p), ("down_parts", _i64), ("cos_sin", _p), ("max_positions", _i64),
        ("k_cache", _p), ("v_cache", _p), ("num_pages", _i64), ("page_size", _i64), ("hidden", _i64),
        ("heads", _i64), ("kv_heads", _i64), ("dim", _i64), ("inter", _i64), ("eps", _f32), ("scale", _f32),
        ("router", _p), ("experts", _p),
    ]
    STEP_FIELDS = 13  # the first 13 fields: the step's


class DecoderLayersArgs(KernelArgs):
    c_name, kernel = "exl_decoder_layers_args", "exl_decoder_layers"
    _fields_ = [
        ("step", _p), ("layers", _p), ("num_layers", _i64), ("caches", _p), ("num_pages", _i64),
        ("page_size", _i64), ("embed", _p), ("vocab", _i64), ("input_ids", _p), ("head", _p), ("final_norm", _p),
        ("rows", _p), ("num_rows", _i64), ("logits", _p), ("failed_layer", _p), ("eps", _f32), ("embed_format", _i32),
        ("embed_blocks", _p), ("embed_row_bytes", _i64),
    ]


class MoeExpertsArgs(KernelArgs):
    c_name, kernel = "exl_moe_experts_args", "exl_moe_experts"
    _fields_ = [
        ("x", _p), ("tokens", _i64), ("hidden", _i64), ("inter", _i64), ("top_k", _i64), ("ids", _p),
        ("weights", _p), ("num_experts", _i64), ("gate_up", _p), ("gate_up_parts", _i64), ("down", _p),
        ("down_parts", _i64), ("out", _p),
    ]


class MoeRouterArgs(KernelArgs):
    c_name, kernel = "exl_moe_router_args", "exl_moe_router"
    _fields_ = [
        ("x", _p), ("tokens", _i64), ("hidden", _i64), ("num_experts", _i64), ("weight", _p), ("parts", _p),
        ("kind", _i64), ("top_k", _i64), ("normalize", _i64), ("logits", _p), ("weights", _p), ("ids", _p),
    ]


class GatedDeltaArgs(KernelArgs):
    c_name, kernel = "exl_gated_delta_args", "exl_gated_delta"
    _fields_ = [
        ("mixed", _p), ("mixed_stride", _i64), ("mixed_fp32", _i32), ("pad", _i32), ("g", _p), ("beta", _p),
        ("in_states", _p), ("in_slots", _p), ("out_states", _p), ("out_slots", _p), ("begin", _p), ("end", _p),
        ("num_seqs", _i64), ("k_heads", _i64), ("v_heads", _i64), ("k_dim", _i64), ("v_dim", _i64),
        ("scale", _f32), ("eps", _f32), ("out", _p),
    ]


class CausalConv1dArgs(KernelArgs):
    c_name, kernel = "exl_causal_conv1d_args", "exl_causal_conv1d"
    _fields_ = [
        ("x", _p), ("x_stride", _i64), ("weight", _p), ("in_states", _p), ("in_slots", _p), ("out_states", _p),
        ("out_slots", _p), ("begin", _p), ("end", _p), ("num_seqs", _i64), ("channels", _i64), ("width", _i64),
        ("out", _p),
    ]


class ArgmaxArgs(KernelArgs):
    c_name, kernel = "exl_argmax_args", "exl_argmax"
    _fields_ = [("logits", _p), ("rows", _i64), ("vocab", _i64), ("stride", _i64), ("out", _p)]


ALL = (QMatmulArgs, RepackArgs, DequantizeArgs, PagedAttentionArgs, PagedAttentionQuantArgs,
       KvQuantizeArgs, RmsNormArgs, FusedAddRmsNormArgs, MeanSquaresArgs,
       RopeArgs, SiluAndMulArgs, DecoderLayerArgs, DecoderLayersArgs, MoeExpertsArgs, MoeRouterArgs,
       GatedDeltaArgs, CausalConv1dArgs, ArgmaxArgs)
