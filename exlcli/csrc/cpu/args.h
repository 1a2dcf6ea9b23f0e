// The arguments of every CPU kernel, one struct per kernel, passed by pointer.
//
// Python builds them as ctypes Structures (exlcli/ops/cpu/args.py, one class per struct, same field
// names in the same order); tests/ops/test_cpu_args_abi.py compiles this header and checks every
// struct's size and every field's offset and size against those classes. So keep to its format: one
// field per line, `type name;`, fixed-width types only (int64_t, int32_t, float, pointers).
// Tensors travel as data pointers; bf16 values as uint16_t bit patterns (bf16.h). Strides count
// elements. Each function returns 0, or the error its C file lists.
#pragma once
#include <stdint.h>

// y[M, N] = x[M, K] @ W^T for GGUF block-quantized W repacked into groups (qmatmul.c).
typedef struct {
    const uint16_t *x;  // bf16 [M, K] contiguous
    int64_t rows;       // M
    int64_t in_features;  // K
    int32_t bits;       // 4 (Q4_0, Q4_1, Q4_K), 2 (Q2_K), 5 (Q5_*), 6 (Q6_K) (2, 5, 6: AVX2), or 8 (Q8_0, ...)
    int32_t y_fp32;     // 1: y is fp32, 0: bf16
    int32_t offsets;    // 1: w = q * d + m; 0: w = q * d (bits 4 always has offsets; bits 5 without: (q - 16) * d)
    int32_t scales_per_block;  // 1, or 2: one scale per 16 weights (Q6_K)
    int32_t half_scales;  // 1: d and m are fp16 (where exl_qmatmul_half_scales_available()), 0: fp32
    const uint8_t *qs;  // the repacked quants
    const void *d;      // the scales (bits 2: fp16 d, -dmin per super-block; qmatmul.c)
    const void *m;      // the offsets (read when there are offsets; bits 2: the bytes sc | m << 4); NULL for
                        // bits 4 with offsets, one scale a block and no table: every offset is -8 d (Q4_0)
    const int8_t *table;  // bits 4: NULL, or 16 values, w = table[q] * d without offsets (IQ4_NL, IQ4_XS)
    const uint16_t *bias;  // bf16 [N], or NULL
    int64_t out_features;  // N
    void *y;            // [M, N]
} exl_qmatmul_args;
int exl_qmatmul(const exl_qmatmul_args *args);

// qmatmul's layout of GGUF blocks (qs, d, m of exl_qmatmul_args) built from the file's rows (repack.c):
// the same bytes as cpu_qmatmul.py's QuantCpuLinear makes of the format's unpack(). Returns 0, or 2 for a
// format or layout it does not build (then Python repacks).
typedef struct {
    const uint8_t *src;  // the blocks of row r at src + r * row_bytes (a memory map of the file)
    int64_t row_bytes;
    int64_t rows;       // N
    int64_t in_features;  // K
    int32_t format;     // GGML type: 2 Q4_0, 3 Q4_1, 6 Q5_0, 7 Q5_1, 8 Q8_0, 12 Q4_K, 13 Q5_K, 14 Q6_K
    int32_t bits;       // the layout: 4, 5, 6 or 8 (exl_qmatmul_args.bits)
    int32_t zero;       // added to q before it is held (Q5_0's q - 16 held as q: 16; Q6_K: 32)
    int32_t scales_per_block;  // 1, or 2 (Q6_K)
    uint8_t *qs;        // out: [G, K / 32, bytes per block of the layout], G = ceil(N / 16)
    float *d;           // out: fp32 [G, K / 32, scales_per_block, 16]
    float *m;           // out: fp32 [G, K / 32, 16]
    int32_t *found;     // out: bit 0 some offset is not zero, bit 1 every d and m is exact in fp16
} exl_repack_args;
int exl_repack(const exl_repack_args *args);

// A weight's values from GGUF blocks, as the format's dequantize() computes them, then rounded to bf16 (to
// nearest even) or kept fp32 (repack.c: the formats of exl_repack_args). Returns 0, or 2 for another format.
typedef struct {
    const uint8_t *src;  // the blocks of row r at src + r * row_bytes
    int64_t row_bytes;
    int64_t rows;
    int64_t in_features;
    int32_t format;     // GGML type, as exl_repack_args.format
    int32_t bf16;       // 1: out is bf16, 0: fp32
    void *out;          // [rows, in_features] contiguous
} exl_dequantize_args;
int exl_dequantize(const exl_dequantize_args *args);

// Paged attention over decode rows and prefill chunks of many sequences (attention.c).
typedef struct {
    const uint16_t *q;  // bf16 [T, heads, dim]
    const uint16_t *k_cache;  // bf16 [num_pages, page_size, kv_heads, dim]
    const uint16_t *v_cache;
    const int32_t *block_tables;  // [B, max_pages]
    int64_t max_pages;
    const int32_t *query_start_loc;  // [B + 1]
    const int32_t *seq_lens;  // [B]
    int64_t seq_begin;  // the sequences seq_begin .. seq_end - 1 are computed
    int64_t seq_end;
    int64_t num_pages;
    int64_t page_size;
    int64_t heads;
    int64_t kv_heads;
    int64_t dim;
    float scale;
    uint16_t *out;      // bf16 [T, heads, dim]
    int64_t threads;    // how many threads the kernel pool has
    const float *sinks;  // fp32 [heads] or NULL: the layer's sink logits (attention_kind.h)
    int64_t window;     // 0: none; else a query at p sees keys > p - window
    float softcap;      // 0: none; else scores s -> softcap * tanh(s / softcap)
} exl_paged_attention_args;
int exl_paged_attention(const exl_paged_attention_args *args);

// Paged attention over quantized or fp16/bf16 pages, K and V each of its own type (attention_quant.c).
typedef struct {
    const uint16_t *q;  // bf16 [T, heads, dim]; for rotated keys (q4h, q3h) already rotated
    const uint8_t *k_cache;  // [num_pages, page_size, kv_heads, row bytes of k_format]
    const uint8_t *v_cache;
    int32_t k_format;  // EXL_KV_* of attention_quant.c
    int32_t v_format;
    const int32_t *block_tables;  // [B, max_pages]
    int64_t max_pages;
    const int32_t *query_start_loc;  // [B + 1]
    const int32_t *seq_lens;  // [B]
    int64_t num_seqs;
    int64_t num_pages;
    int64_t page_size;
    int64_t heads;
    int64_t kv_heads;
    int64_t dim;
    float scale;
    uint16_t *out;      // bf16 [T, heads, dim]; for rotated values still rotated
    const float *sinks;  // fp32 [heads] or NULL: the layer's sink logits (attention_kind.h)
    int64_t window;     // 0: none; else a query at p sees keys > p - window
    float softcap;      // 0: none; else scores s -> softcap * tanh(s / softcap)
} exl_paged_attention_quant_args;
int exl_paged_attention_quant(const exl_paged_attention_quant_args *args);

// K/V rows quantized as the cache stores them, the bytes of ops/kv_quant.py's encoder (attention_quant.c).
typedef struct {
    const float *x;  // fp32 [rows, dim]
    int64_t rows;
    int64_t dim;     // a multiple of 32
    int32_t format;  // EXL_KV_Q8_0, EXL_KV_Q4_0, EXL_KV_Q4H or EXL_KV_Q3H
    int32_t pad;
    uint8_t *out;    // [rows, row bytes]
} exl_kv_quantize_args;
int exl_kv_quantize(const exl_kv_quantize_args *args);

// RMSNorm of rows x + (r / inner) * stride_outer + (r % inner) * stride_inner (norm.c).
typedef struct {
    const uint16_t *x;
    int64_t stride_outer;
    int64_t stride_inner;
    int64_t inner;
    const uint16_t *weight;  // bf16 [dim]
    uint16_t *out;      // bf16 [rows, dim] contiguous
    int64_t dim;
    float eps;
    int64_t rows;
} exl_rms_norm_args;
int exl_rms_norm(const exl_rms_norm_args *args);

// residual_out = x + residual; out = rms_norm(residual_out); all bf16 [rows, dim] contiguous (norm.c),
// except the residual and residual_out with residual_fp32: fp32 rows (the CPU's fp32 residual stream).
typedef struct {
    const uint16_t *x;
    const void *residual;
    void *residual_out;
    const uint16_t *weight;  // bf16 [dim]
    uint16_t *out;
    int64_t dim;
    float eps;
    int64_t rows;
    int64_t residual_fp32;
} exl_fused_add_rms_norm_args;
int exl_fused_add_rms_norm(const exl_fused_add_rms_norm_args *args);

// out[r] = the fp32 mean of squares the norm uses for row r of x (norm.c; for the tests).
typedef struct {
    const uint16_t *x;  // bf16 [rows, dim] contiguous
    int64_t dim;
    int64_t rows;
    float *out;         // fp32 [rows]
} exl_mean_squares_args;
int exl_mean_squares(const exl_mean_squares_args *args);

// Rotary embedding of q and k, with k and v written into their cache slots (rope.c).
typedef struct {
    const uint16_t *q;  // bf16 [T, heads, dim], strides per token and per head
    int64_t q_token_stride;
    int64_t q_head_stride;
    const uint16_t *k;  // bf16 [T, kv_heads, dim]
    int64_t k_token_stride;
    int64_t k_head_stride;
    const uint16_t *v;  // bf16 [T, kv_heads, dim]
    int64_t v_token_stride;
    int64_t v_head_stride;
    const int64_t *positions;  // [T]
    const float *cos_sin;  // fp32 [max_positions, dim]
    int64_t max_positions;
    uint16_t *k_cache;  // bf16 [num_slots, kv_heads, dim]
    uint16_t *v_cache;
    const int64_t *slots;  // [T]
    int64_t num_slots;
    uint16_t *q_out;    // bf16 [T, heads, dim] contiguous
    int64_t heads;
    int64_t kv_heads;
    int64_t dim;
    int64_t tokens;
} exl_rope_and_write_kv_args;
int exl_rope_and_write_kv(const exl_rope_and_write_kv_args *args);

// out = silu(gate) * up over rows of x = gate | up (activation.c).
typedef struct {
    const uint16_t *x;  // bf16 rows of 2 * inter
    int64_t x_stride;
    uint16_t *out;      // bf16 rows of inter
    int64_t out_stride;
    int64_t inter;
    int64_t rows;
} exl_silu_and_mul_args;
int exl_silu_and_mul(const exl_silu_and_mul_args *args);

// The routed experts of one mixture-of-experts layer in one call (moe.c): every active expert's gate|up
// product, SiLU(gate) * up and down product over the tokens routed to it, then each token's weighted sum.
typedef struct {
    const uint16_t *x;  // bf16 [T, hidden] contiguous (the normed rows)
    int64_t tokens;     // T
    int64_t hidden;
    int64_t inter;      // an expert's width: gate_up makes 2 * inter
    int64_t top_k;      // experts a token
    const int64_t *ids;  // [T, top_k] the experts chosen, each in 0 .. num_experts - 1
    const float *weights;  // fp32 [T, top_k] their weights
    int64_t num_experts;
    const exl_qmatmul_args *gate_up;  // [num_experts][gate_up_parts] (x, rows, y unset), outputs side by side
    int64_t gate_up_parts;
    const exl_qmatmul_args *down;  // [num_experts][down_parts]
    int64_t down_parts;
    float *out;         // fp32 [T, hidden]: the weighted sums
} exl_moe_experts_args;
int exl_moe_experts(const exl_moe_experts_args *args);

// The router of one mixture-of-experts layer (moe_router.c): each token's fp32 expert logits, then its top_k
// experts and their weights, as exlcli/ops/moe.py's route() computes them for the kinds it takes.
typedef struct {
    const uint16_t *x;  // bf16 [T, hidden] contiguous (the normed rows)
    int64_t tokens;     // T
    int64_t hidden;
    int64_t num_experts;
    const uint16_t *weight;  // bf16 [num_experts, hidden] (a dense router), or NULL: parts
    const exl_qmatmul_args *parts;  // one quantized router (x, rows, y, y_fp32 unset), or NULL: weight
    int64_t kind;       // 0: softmax then top k (softmax_topk); 1: top k then softmax (topk_softmax)
    int64_t top_k;
    int64_t normalize;  // kind 0: 1 divides the k weights by their sum
    float *logits;      // fp32 [T, num_experts] scratch (softmax_topk: left holding the probabilities)
    float *weights;     // out: fp32 [T, top_k]
    int64_t *ids;       // out: [T, top_k], ties to the lower id
} exl_moe_router_args;
int exl_moe_router(const exl_moe_router_args *args);

// One layer of the llama-style decoder (exlcli/model/architectures/decoder.py) in one call, through
// the kernels above in the order, and with the arguments, of the layer-by-layer path (decoder.c).
// The step's fields come first: the same for every layer, they are copied over each layer's.
typedef struct {
    uint16_t *h;        // bf16 [T, hidden]: in, the layer's input (the embeddings at the first); out, its output
    float *residual;     // fp32 [T, hidden]: the residual stream, updated in place (set from h at the first)
    int64_t tokens;     // T
    const int64_t *positions;  // [T]
    const int64_t *slots;  // [T]: the token's K/V slot, page * page_size + offset
    const int32_t *block_tables;  // [B, max_pages]
    int64_t max_pages;
    const int32_t *query_start_loc;  // [B + 1]
    const int32_t *seq_lens;  // [B]
    int64_t num_seqs;   // B
    uint16_t *scratch;  // bf16 scratch of scratch_elems elements (decoder.c says how many it needs)
    int64_t scratch_elems;
    int64_t threads;    // how many threads the kernel pool has
    int64_t first;      // 1 for the first layer: there is no residual stream yet
    const uint16_t *input_norm;  // bf16 [hidden]
    const uint16_t *post_norm;  // bf16 [hidden]
    const uint16_t *q_norm;  // bf16 [dim] per-head norms of q and k, or NULL (both)
    const uint16_t *k_norm;
    const exl_qmatmul_args *qkv;  // qkv_parts weights (x, rows, y unset) whose outputs sit side by side
    int64_t qkv_parts;
    const exl_qmatmul_args *o_proj;
    int64_t o_proj_parts;
    const exl_qmatmul_args *gate_up;
    int64_t gate_up_parts;
    const exl_qmatmul_args *down;
    int64_t down_parts;
    const float *cos_sin;  // fp32 [max_positions, dim]
    int64_t max_positions;
    uint16_t *k_cache;  // bf16 [num_pages, page_size, kv_heads, dim]: this layer's
    uint16_t *v_cache;
    int64_t num_pages;
    int64_t page_size;
    int64_t hidden;
    int64_t heads;
    int64_t kv_heads;
    int64_t dim;
    int64_t inter;      // the MLP's width: gate_up makes 2 * inter
    float eps;
    float scale;        // attention's, usually dim ** -0.5
    const exl_moe_router_args *router;  // NULL: the feed-forward above; else a mixture of experts' router
    const exl_moe_experts_args *experts;  // with router: its routed experts (x, tokens, ids, weights, out unset)
} exl_decoder_layer_args;
int exl_decoder_layer(const exl_decoder_layer_args *args);

// A step's layers in one call (decoder.c): exl_decoder_layer for layers 0 .. num_layers - 1 in turn, each with
// the step's fields of `step` over its own; optionally the embedding lookup before them (embed) and the final
// norm and output layer of some rows after them (head). h, residual or scratch NULL in `step`: malloc'd here
// (the output layer then being the only result).
typedef struct {
    const exl_decoder_layer_args *step;  // the step's fields (the first 13); the layer's fields unused
    const exl_decoder_layer_args *layers;  // [num_layers]: each layer's fields (k_cache .. page_size unset)
    int64_t num_layers;
    const int64_t *caches;  // [2 num_layers]: layer i's K cache address at i, its V cache's at num_layers + i
    int64_t num_pages;
    int64_t page_size;
    const uint16_t *embed;  // bf16 [vocab, hidden]: h = its rows input_ids; NULL: step->h holds the embeddings
    int64_t vocab;
    const int64_t *input_ids;  // [T], with embed
    const exl_qmatmul_args *head;  // the output layer (x, rows, y unset), or NULL: none (nor the final norm)
    const uint16_t *final_norm;  // bf16 [hidden]: logits = head(rms_norm(h + residual)) of the rows below
    const int64_t *rows;  // [num_rows]: rows of h
    int64_t num_rows;
    float *logits;      // fp32 [num_rows, head's out_features]
    int64_t *failed_layer;  // out: the layer whose call failed, or -1 (the embedding, the output layer)
    float eps;          // the final norm's
    int32_t embed_format;  // with embed_blocks: their GGML type (exl_dequantize_args.format)
    const uint8_t *embed_blocks;  // or a quantized table: row i's blocks at embed_blocks + i * embed_row_bytes,
    int64_t embed_row_bytes;  // h = its rows input_ids dequantized to bf16 (exl_dequantize); embed NULL
} exl_decoder_layers_args;
int exl_decoder_layers(const exl_decoder_layers_args *args);

// The gated delta rule of Gated DeltaNet layers over B sequences' tokens (gated_delta.c): sequence b runs
// its tokens begin[b] .. end[b] - 1 one after another from its state, each token S <- e^g S;
// u = beta (v - S^T k); S <- S + k u^T; o = S^T q, with q and k L2-normalized (q then times scale).
// A decode step is B sequences of one token; a prompt, one sequence of many.
typedef struct {
    const void *mixed;  // [rows, >= 2 Hk Dk + Hv Dv]: the convolution's q | k | v of each token
    int64_t mixed_stride;  // elements between tokens
    int32_t mixed_fp32;  // 1: mixed is fp32, 0: bf16
    int32_t pad;
    const float *g;     // fp32 [rows, Hv]: the log decays (<= 0)
    const float *beta;  // fp32 [rows, Hv]
    const float *in_states;  // fp32 [?, Hv, Dk, Dv]: the states read
    const int32_t *in_slots;  // [B]: sequence b's state in in_states, or -1 for zeros (a sequence's start)
    float *out_states;  // fp32 [?, Hv, Dk, Dv]: the states after each sequence's last token
    const int32_t *out_slots;  // [B]: where; may be in_states with in_slots (each slot read before written)
    const int32_t *begin;  // [B]: each sequence's first token row
    const int32_t *end;  // [B]: one past its last
    int64_t num_seqs;   // B
    int64_t k_heads;    // Hk (each serves Hv / Hk consecutive value heads)
    int64_t v_heads;    // Hv
    int64_t k_dim;      // Dk, at most 256
    int64_t v_dim;      // Dv, at most 256
    float scale;        // the queries' (Dk ** -0.5)
    float eps;          // the L2 norm's (1e-6)
    float *out;         // fp32 [rows, Hv, Dv]
} exl_gated_delta_args;
int exl_gated_delta(const exl_gated_delta_args *args);

// The causal depthwise convolution (width W) of B sequences' tokens with their rolling states, SiLU after
// (gated_delta.c): sequence b's tokens begin[b] .. end[b] - 1 follow the W - 1 inputs of its state.
typedef struct {
    const uint16_t *x;  // bf16 [rows, C], row stride x_stride
    int64_t x_stride;
    const uint16_t *weight;  // bf16 [C, W]
    const uint16_t *in_states;  // bf16 [?, W - 1, C]
    const int32_t *in_slots;  // [B], -1 for zeros
    uint16_t *out_states;  // bf16 [?, W - 1, C]: the last W - 1 inputs after each sequence
    const int32_t *out_slots;  // [B]
    const int32_t *begin;  // [B]
    const int32_t *end;  // [B]
    int64_t num_seqs;
    int64_t channels;   // C
    int64_t width;      // W, 2 to 8
    uint16_t *out;      // bf16 [rows, C] contiguous
} exl_causal_conv1d_args;
int exl_causal_conv1d(const exl_causal_conv1d_args *args);

// Greedy picks over fp32 logits rows (argmax.c): out[r] = row r's argmax (the first index of its largest
// value, a NaN counting as the largest), out[rows + r] = 1 when the row's max is not finite, else 0.
typedef struct {
    const float *logits;  // fp32 [rows, stride], the first vocab of each row read
    int64_t rows;
    int64_t vocab;
    int64_t stride;     // elements from one row to the next
    int64_t *out;       // int64 [2 rows]
} exl_argmax_args;
int exl_argmax(const exl_argmax_args *args);
