// One layer of the llama-style decoder in one call, for the CPU kernel path of
// exlcli/model/architectures/decoder.py (driven by exlcli/ops/cpu/decoder_layer.py).
//
// A decode step of a small model makes ~270 kernel calls, each of a few microseconds of work at batch
// 1 but 10-17 us of Python and ctypes around it: a third of the step. Here the layer's kernels are
// called from C, in the order and with the arguments of the layer-by-layer path, so every value
// comes out bit for bit as there (and as batch-invariant):
//   first layer: residual = fp32(h); x = rms_norm(h)  else: x, residual = fused_add_rms_norm(h, residual)
// (the residual stream in fp32, as exlcli/ops/norm.py says why)
//   qkv = x @ Wqkv (its parts side by side); [q, k = per-head rms_norm(q), (k)]; q = rope(q), k and v
//   written to the cache; a = paged_attention(q); h = a @ Wo; x, residual = fused_add_rms_norm(h,
//   residual); h = silu_and_mul(x @ Wgate_up) @ Wdown.
// A mixture-of-experts layer (router set) ends instead as MoeFeedForward does on the CPU kernels: each
// token's experts and weights from exl_moe_router, their weighted sum from exl_moe_experts (moe.c), that
// fp32 sum rounded to bf16 as h. The router, its top k and the sums are malloc'd here, per call.
// Scratch, in bf16 elements per token: hidden (x), W = (heads + 2 kv_heads) dim (qkv), 2 heads dim
// (rotated q, attention output), 3 inter (gate|up, its activation); with q/k norms (heads + kv_heads)
// dim more (normed q and k); with a projection of several parts, max(W, 2 inter, hidden) more (a
// part's output before it joins its neighbours).

#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include "args.h"
#include "bf16.h"
#include "qmatmul.h"

// The kernels it calls are built where the compiler targets AVX2 with FMA (AVX-512 CPUs have both).
#if defined(__AVX2__) && defined(__FMA__)
#define EXL_DECODER 1
#else
#define EXL_DECODER 0
#endif

int exl_norm_available(void);
int exl_rope_available(void);
int exl_paged_attention_available(void);
int exl_activation_available(void);
int exl_qmatmul_available(void);
int exl_moe_experts_available(void);

int exl_decoder_layer_available(void) {
    return EXL_DECODER && exl_norm_available() && exl_rope_available() && exl_paged_attention_available() &&
           exl_activation_available() && exl_qmatmul_available();
}

#if EXL_DECODER

static int64_t max3(int64_t a, int64_t b, int64_t c) {
    int64_t m = a > b ? a : b;
    return m > c ? m : c;
}

// y [rows, width] = x @ W^T for W in parts whose outputs sit side by side (torch.cat of theirs).
static int project(const exl_qmatmul_args *parts, int64_t n_parts, const uint16_t *x, int64_t rows,
                   uint16_t *y, int64_t width, uint16_t *tmp) {
    int64_t col = 0;
    for (int64_t p = 0; p < n_parts; p++) col += parts[p].out_features;
    if (col != width) return 6;
    int rc = qmatmul_parts(parts, n_parts, x, rows, y, width);  // x quantized once, one job, y in place
    if (rc != 1) return rc;
    col = 0;
    for (int64_t p = 0; p < n_parts; p++) {
        exl_qmatmul_args a = parts[p];
        int64_t n = a.out_features;
        if (col + n > width) return 6;
        int direct = n_parts == 1 || rows == 1;  // one row: the part's columns are contiguous in y
        a.x = x;
        a.rows = rows;
        a.y_fp32 = 0;
        a.y = direct ? (void *)(y + col) : (void *)tmp;
        if (exl_qmatmul(&a) != 0) return -1;
        if (!direct)
            for (int64_t r = 0; r < rows; r++) memcpy(y + r * width + col, tmp + r * n, sizeof(uint16_t) * (size_t)n);
        col += n;
    }
    return col == width ? 0 : 6;
}

// h [T, H] = the routed experts' weighted sums of x's rows, rounded to bf16.
static int experts_feed_forward(const exl_decoder_layer_args *a, const uint16_t *x) {
    const int64_t T = a->tokens, H = a->hidden, E = a->router->num_experts, k = a->router->top_k;
    if (!exl_moe_experts_available()) return -1;
    if (a->router->hidden != H || a->experts->hidden != H || a->experts->num_experts != E) return 6;
    float *logits = (float *)malloc(sizeof(float) * (size_t)(T * E));
    float *weights = (float *)malloc(sizeof(float) * (size_t)(T * k));
    int64_t *ids = (int64_t *)malloc(sizeof(int64_t) * (size_t)(T * k));
    float *out = (float *)malloc(sizeof(float) * (size_t)(T * H));
    int rc = -1;
    if (logits && weights && ids && out) {
        exl_moe_router_args r = *a->router;
        r.x = x, r.tokens = T, r.logits = logits, r.weights = weights, r.ids = ids;
        exl_moe_experts_args e = *a->experts;
        e.x = x, e.tokens = T, e.top_k = k, e.ids = ids, e.weights = weights, e.out = out;
        if (!(rc = exl_moe_router(&r)) && !(rc = exl_moe_experts(&e)))
            for (int64_t i = 0; i < T * H; i++) a->h[i] = f32_to_bf16(out[i]);
    }
    free(logits), free(weights), free(ids), free(out);
    return rc;
}

// Every sequence's queries and length against its block table's room (what the Python wrapper of the
// attention kernel checks per call).
static int check_layout(const exl_decoder_layer_args *a) {
    const int32_t *qsl = a->query_start_loc;
    if (a->num_seqs < 0 || qsl[0] != 0 || qsl[a->num_seqs] != a->tokens) return 4;
    for (int64_t b = 0; b < a->num_seqs; b++) {
        int64_t n = qsl[b + 1] - qsl[b], len = a->seq_lens[b];
        if (n < 0 || len < n || len > a->max_pages * a->page_size) return 4;
    }
    return 0;
}

// Returns 0; -1 out of memory; 1 a block-table entry outside the cache; 2 a position outside the
// cos/sin cache; 3 a slot outside the KV cache; 4 query_start_loc / seq_lens that do not fit the
// tokens or the block tables; 5 scratch too small; 6 sizes that do not fit together.
int exl_decoder_layer(const exl_decoder_layer_args *a) {
    const int64_t T = a->tokens, H = a->hidden, D = a->dim, heads = a->heads, kvh = a->kv_heads, I = a->inter;
    const int64_t W = (heads + 2 * kvh) * D;
    if (T < 0 || H <= 0 || D <= 0 || heads <= 0 || kvh <= 0 || heads % kvh || I <= 0) return 6;
    if (T == 0) return 0;
    int rc = check_layout(a);
    if (rc) return rc;
    if (a->router && !a->experts) return 6;
    const int multi = a->qkv_parts > 1 || a->o_proj_parts > 1 || a->gate_up_parts > 1 || a->down_parts > 1;
    const int64_t normed = a->q_norm ? (heads + kvh) * D : 0, tmp_width = multi ? max3(W, 2 * I, H) : 0;
    if (a->scratch_elems < T * (H + W + 2 * heads * D + 3 * I + normed + tmp_width)) return 5;
    uint16_t *x = a->scratch, *qkv = x + T * H, *qr = qkv + T * W, *att = qr + T * heads * D;
    uint16_t *gu = att + T * heads * D, *act = gu + T * 2 * I, *qn = act + T * I, *kn = qn + T * heads * D;
    uint16_t *tmp = qn + T * normed;

    if (a->first) {
        for (int64_t i = 0; i < T * H; i++) a->residual[i] = bf16_to_f32(a->h[i]);
        exl_rms_norm_args n = {a->h, H, 0, 1, a->input_norm, x, H, a->eps, T};
        if (exl_rms_norm(&n)) return 6;
    } else {
        exl_fused_add_rms_norm_args n = {a->h, a->residual, a->residual, a->input_norm, x, H, a->eps, T, 1};
        if (exl_fused_add_rms_norm(&n)) return 6;
    }
    if ((rc = project(a->qkv, a->qkv_parts, x, T, qkv, W, tmp))) return rc;

    // q, k, v: views into the qkv rows (or the normed q and k, contiguous per token)
    const uint16_t *q = qkv, *k = qkv + heads * D, *v = qkv + (heads + kvh) * D;
    int64_t q_stride = W, k_stride = W;
    if (a->q_norm) {
        exl_rms_norm_args nq = {q, W, D, heads, a->q_norm, qn, D, a->eps, T * heads};
        exl_rms_norm_args nk = {k, W, D, kvh, a->k_norm, kn, D, a->eps, T * kvh};
        if (exl_rms_norm(&nq) || exl_rms_norm(&nk)) return 6;
        q = qn, q_stride = heads * D;
        k = kn, k_stride = kvh * D;
    }
    exl_rope_and_write_kv_args r = {q, q_stride, D, k, k_stride, D, v, W, D, a->positions, a->cos_sin,
                                    a->max_positions, a->k_cache, a->v_cache, a->slots,
                                    a->num_pages * a->page_size, qr, heads, kvh, D, T};
    rc = exl_rope_and_write_kv(&r);
    if (rc == -1) return 2;
    if (rc == -2) return 3;
    if (rc) return 6;

    exl_paged_attention_args p = {qr, a->k_cache, a->v_cache, a->block_tables, a->max_pages, a->query_start_loc,
                                  a->seq_lens, 0, a->num_seqs, a->num_pages, a->page_size, heads, kvh, D,
                                  a->scale, att, a->threads};
    if (a->num_seqs > 0 && (rc = exl_paged_attention(&p))) return rc == 1 ? 1 : -1;
    if ((rc = project(a->o_proj, a->o_proj_parts, att, T, a->h, H, tmp))) return rc;

    exl_fused_add_rms_norm_args n2 = {a->h, a->residual, a->residual, a->post_norm, x, H, a->eps, T, 1};
    if (exl_fused_add_rms_norm(&n2)) return 6;
    if (a->router) return experts_feed_forward(a, x);
    if ((rc = project(a->gate_up, a->gate_up_parts, x, T, gu, 2 * I, tmp))) return rc;
    exl_silu_and_mul_args s = {gu, 2 * I, act, I, I, T};
    if (exl_silu_and_mul(&s)) return 6;
    return project(a->down, a->down_parts, act, T, a->h, H, tmp);
}

// The final norm and the output layer of the rows `a->rows` of h (with the residual stream): logits =
// head(rms_norm(h[r] + residual[r])), each row through the kernels and arguments of the Python path's
// fused_add_rms_norm of the gathered rows and its exl_qmatmul into fp32 (rows do not depend on the rows
// around them, so gathering them first or not gives the same bits).
static int output_layer(const exl_decoder_layers_args *a, const uint16_t *h, const float *residual, int64_t T,
                        int64_t H) {
    const int64_t S = a->num_rows;
    if (a->head->in_features != H || S < 0) return 6;
    for (int64_t r = 0; r < S; r++)
        if (a->rows[r] < 0 || a->rows[r] >= T) return 9;
    if (S == 0) return 0;
    uint16_t *x = (uint16_t *)malloc(sizeof(uint16_t) * (size_t)(S * H));
    float *sum = (float *)malloc(sizeof(float) * (size_t)H);
    int rc = -1;
    if (x && sum) {
        rc = 0;
        for (int64_t r = 0; r < S && !rc; r++) {
            exl_fused_add_rms_norm_args n = {h + a->rows[r] * H, residual + a->rows[r] * H, sum, a->final_norm,
                                             x + r * H, H, a->eps, 1, 1};
            if (exl_fused_add_rms_norm(&n)) rc = 6;
        }
        if (!rc) {
            exl_qmatmul_args q = *a->head;
            q.x = x, q.rows = S, q.y = a->logits, q.y_fp32 = 1;
            rc = exl_qmatmul(&q) ? -1 : 0;
        }
    }
    free(x), free(sum);
    return rc;
}

// Returns 0 or the failing layer's status (exl_decoder_layer's, the layer in *failed_layer); with the
// embedding or the output layer (*failed_layer -1): 8 an input id outside the vocabulary, 9 a row outside the
// tokens, 6 sizes that do not fit, -1 out of memory.
int exl_decoder_layers(const exl_decoder_layers_args *a) {
    *a->failed_layer = -1;
    if (a->num_layers < 1) return 6;
    exl_decoder_layer_args step = *a->step;
    const int64_t T = step.tokens, H = a->layers[0].hidden;
    if (T < 0 || H <= 0) return 6;
    void *own_h = NULL, *own_residual = NULL, *own_scratch = NULL;
    int rc = -1;
    if (!step.h) step.h = (uint16_t *)(own_h = malloc(sizeof(uint16_t) * (size_t)(T * H + 1)));
    if (!step.residual) step.residual = (float *)(own_residual = malloc(sizeof(float) * (size_t)(T * H + 1)));
    if (!step.scratch) step.scratch = (uint16_t *)(own_scratch = malloc(sizeof(uint16_t) * (size_t)(step.scratch_elems + 1)));
    if (!step.h || !step.residual || !step.scratch) goto done;
    if (a->embed || a->embed_blocks) {
        for (int64_t t = 0; t < T; t++) {
            int64_t id = a->input_ids[t];
            rc = 8;
            if (id < 0 || id >= a->vocab) goto done;
            if (a->embed) {
                memcpy(step.h + t * H, a->embed + id * H, sizeof(uint16_t) * (size_t)H);
            } else {  // the row's blocks as TokenEmbedding dequantizes them (rows do not depend on each other)
                exl_dequantize_args d = {a->embed_blocks + id * a->embed_row_bytes, a->embed_row_bytes, 1, H,
                                         a->embed_format, 1, step.h + t * H};
                rc = 6;
                if (exl_dequantize(&d)) goto done;
            }
        }
    }
    for (int64_t i = 0; i < a->num_layers; i++) {
        exl_decoder_layer_args layer = a->layers[i];
        memcpy(&layer, &step, offsetof(exl_decoder_layer_args, first));  // the step's fields over the layer's
        layer.k_cache = (uint16_t *)(intptr_t)a->caches[i];
        layer.v_cache = (uint16_t *)(intptr_t)a->caches[a->num_layers + i];
        layer.num_pages = a->num_pages, layer.page_size = a->page_size;
        if ((rc = exl_decoder_layer(&layer))) {
            *a->failed_layer = i;
            goto done;
        }
    }
    rc = a->head ? output_layer(a, step.h, step.residual, T, H) : 0;
done:
    free(own_h), free(own_residual), free(own_scratch);
    return rc;
}

#else

int exl_decoder_layer(const exl_decoder_layer_args *a) {
    (void)a;
    return -1;
}

int exl_decoder_layers(const exl_decoder_layers_args *a) {
    *a->failed_layer = -1;
    return -1;
}

#endif
