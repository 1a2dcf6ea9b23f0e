// Decode attention: the op, its input checks, the choice of kernel version and the combine of
// the partitions (attention_decode.cuh describes the split; one file per version beside this one).
#include <algorithm>
#include <cmath>
#include <cstdint>

#include <ATen/ops/empty.h>

#include "attention_decode.cuh"
#include "ops.h"

namespace exlcli {
namespace decode_attention {
namespace {

// One block per (head, sequence), one thread per element of the head.
template <typename T, int D>
__global__ void __launch_bounds__(D) paged_decode_combine_kernel(const DecodeParams p) {
  grid_dependency_wait();  // launched with launch_pdl: the previous kernel may still run
  grid_dependents_launch();
  const int h = blockIdx.x, b = blockIdx.y, d = threadIdx.x;
  const int64_t row = query_row(p, b);
  if (row < 0) return;
  T* out = static_cast<T*>(p.out) + row * (static_cast<int64_t>(p.num_heads) * D) + static_cast<int64_t>(h) * D;
  const int seq_len = p.seq_lens[b];
  const int num_parts = ceil_div(seq_len, kPartitionTokens);
  if (num_parts == 0) {
    out[d] = from_float<T>(0.f);
    return;
  }
  // the row's partitions first_part .. num_parts - 1 sit in slots 0 .. num_parts - first_part - 1
  const int slots = min(num_parts - first_key(p, seq_len) / kPartitionTokens, p.max_parts);
  const int64_t base = (static_cast<int64_t>(b) * p.num_heads + h) * p.max_parts;
  float m = -INFINITY;
  for (int i = 0; i < slots; ++i) m = fmaxf(m, p.part_ml[(base + i) * 2]);
  float l = 0.f, o = 0.f;
  for (int i = 0; i < slots; ++i) {
    const float w = expf(p.part_ml[(base + i) * 2] - m);
    l = fmaf(p.part_ml[(base + i) * 2 + 1], w, l);
    o = fmaf(p.part_acc[(base + i) * D + d], w, o);
  }
  out[d] = from_float<T>(o * output_factor(p, h, m, l));
}

// The partitions in the caller's kernel version (1 or 3; fp32 and devices before sm_80 run
// version 1), then their combine when there is more than one.
// An e4m3 cache is read by version 3 alone.
void launch(const DecodeParams& p, at::ScalarType dtype, bool e4m3_cache, int head_dim, int gmax, int num_seqs,
            int64_t version, bool pdl, cudaStream_t stream) {
  const dim3 grid(p.num_kv_heads * p.head_chunks, num_seqs, p.max_parts);
  if (version == 3 && (dtype == at::kFloat || !device_has_sm80())) version = 1;
  TORCH_CHECK(version == 3 || !e4m3_cache, "paged attention: an fp8 (e4m3) KV cache needs decode attention "
              "version 3, which takes bf16 / fp16 queries on sm_80+ GPUs");
  if (version == 3) {
    launch_v3(p, dtype, e4m3_cache, head_dim, gmax, grid, stream, pdl);
  } else {
    launch_v1(p, dtype, head_dim, gmax, grid, stream, pdl);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (p.max_parts > 1) {
    const dim3 combine_grid(p.num_heads, num_seqs);
    EXL_DISPATCH_FLOAT(dtype, "paged attention", [&] {
      if (head_dim == 64) {
        launch_pdl(paged_decode_combine_kernel<scalar_t, 64>, combine_grid, dim3(64), 0, stream, pdl, p);
      } else if (head_dim == 128) {
        launch_pdl(paged_decode_combine_kernel<scalar_t, 128>, combine_grid, dim3(128), 0, stream, pdl, p);
      } else {
        launch_pdl(paged_decode_combine_kernel<scalar_t, 256>, combine_grid, dim3(256), 0, stream, pdl, p);
      }
    });
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

}  // namespace
}  // namespace decode_attention

void check_paged_attention_inputs(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_tables, const at::Tensor& seq_lens) {
  for (const at::Tensor* t : {&q, &k_cache, &v_cache, &block_tables, &seq_lens}) {
    EXL_CHECK_CUDA_TENSOR(*t, "paged attention: every input");
    TORCH_CHECK(t->device() == q.device(), "paged attention: inputs are on different devices");
  }
  TORCH_CHECK(q.dim() == 3, "paged attention: q must be [tokens, heads, head_dim], got ", q.sizes());
  const int64_t head_dim = q.size(2);
  TORCH_CHECK(head_dim == 64 || head_dim == 128 || head_dim == 256,
              "paged attention: head_dim must be 64, 128 or 256, got ", head_dim);
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == head_dim, "paged attention: q must have packed heads");
  TORCH_CHECK(q.stride(0) % (16 / q.element_size()) == 0 && aligned16(q.data_ptr()),
              "paged attention: q rows must be 16-byte aligned");
  for (const at::Tensor* c : {&k_cache, &v_cache}) {
    TORCH_CHECK(c->dim() == 4 && c->size(3) == head_dim, "paged attention: caches must be [pages, page_size, "
                "kv_heads, ", head_dim, "], got ", c->sizes());
    TORCH_CHECK(c->is_contiguous(), "paged attention: caches must be contiguous");
    TORCH_CHECK(c->scalar_type() == q.scalar_type() || (is_e4m3_cache(*c) && q.scalar_type() != at::kFloat),
                "paged attention: cache dtype ", c->scalar_type(), " is neither q's dtype ", q.scalar_type(),
                " nor e4m3 beside 16-bit q");
  }
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes() && k_cache.scalar_type() == v_cache.scalar_type(),
              "paged attention: k_cache and v_cache differ in shape or dtype");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0, "paged attention: ", q.size(1), " query heads are not a multiple of ",
              k_cache.size(2), " kv heads");
  EXL_CHECK_DTYPE(block_tables, at::kInt, "paged attention: block_tables");
  EXL_CHECK_DTYPE(seq_lens, at::kInt, "paged attention: seq_lens");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.stride(1) == 1,
              "paged attention: block_tables must be [sequences, pages] with contiguous rows");
  TORCH_CHECK(seq_lens.dim() == 1 && seq_lens.is_contiguous() && seq_lens.size(0) == block_tables.size(0),
              "paged attention: seq_lens must be a contiguous [", block_tables.size(0), "]");
}

void check_attention_kind(const at::Tensor& q, const std::optional<at::Tensor>& sinks, int64_t window,
                          double softcap) {
  TORCH_CHECK(window >= 0 && window <= INT32_MAX, "paged attention: window must be 0 (none) or a positive "
              "token count, got ", window);
  TORCH_CHECK(softcap >= 0.0 && std::isfinite(softcap), "paged attention: softcap must be 0 (none) or a "
              "positive number, got ", softcap);
  if (sinks.has_value()) {
    const at::Tensor& s = *sinks;
    EXL_CHECK_CUDA_TENSOR(s, "paged attention: sinks");
    TORCH_CHECK(s.device() == q.device(), "paged attention: sinks are on another device than q");
    EXL_CHECK_DTYPE(s, at::kFloat, "paged attention: sinks");
    TORCH_CHECK(s.dim() == 1 && s.size(0) == q.size(1) && s.is_contiguous(),
                "paged attention: sinks must be a contiguous [", q.size(1), "] (one logit per query head), got ",
                s.sizes());
  }
}

void launch_paged_decode(const at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                         const at::Tensor& v_cache, const at::Tensor& block_tables,
                         const at::Tensor& seq_lens, const int* query_start_loc, double scale,
                         const std::optional<at::Tensor>& sinks, int64_t window, double softcap, int64_t version,
                         bool pdl) {
  TORCH_CHECK(version == 1 || version == 3, "paged attention: the kernel version must be 1 or 3, got ", version);
  const int num_seqs = static_cast<int>(seq_lens.size(0));
  if (num_seqs == 0) return;
  TORCH_CHECK(num_seqs <= 65535, "paged attention: at most 65535 sequences per call, got ", num_seqs);
  decode_attention::DecodeParams p{};
  p.num_heads = static_cast<int>(q.size(1));
  p.num_kv_heads = static_cast<int>(k_cache.size(2));
  p.group = p.num_heads / p.num_kv_heads;
  const int gmax = p.group <= 1 ? 1 : p.group <= 2 ? 2 : p.group <= 4 ? 4 : 8;
  p.head_chunks = ceil_div(p.group, gmax);
  p.page_size = static_cast<int>(k_cache.size(1));
  const int64_t max_tokens = block_tables.size(1) * static_cast<int64_t>(p.page_size);
  // a window layer's rows touch the few partitions of their window, however wide the table
  const int64_t parts = decode_attention::window_parts(max_tokens, window);
  TORCH_CHECK(parts <= 65535, "paged attention: block tables are too wide");
  p.max_parts = static_cast<int>(parts);
  const int64_t head_dim = q.size(2);
  at::Tensor part_acc, part_ml;
  if (p.max_parts > 1) {
    const auto f32 = q.options().dtype(at::kFloat);
    part_acc = at::empty({num_seqs, p.num_heads, p.max_parts, head_dim}, f32);
    part_ml = at::empty({num_seqs, p.num_heads, p.max_parts, 2}, f32);
    p.part_acc = part_acc.data_ptr<float>();
    p.part_ml = part_ml.data_ptr<float>();
  }
  p.out = out.data_ptr();
  p.q = q.data_ptr();
  p.q_row_stride = q.stride(0);
  p.k_cache = k_cache.data_ptr();
  p.v_cache = v_cache.data_ptr();
  p.block_tables = block_tables.data_ptr<int>();
  p.bt_stride = block_tables.stride(0);
  p.seq_lens = seq_lens.data_ptr<int>();
  p.query_start_loc = query_start_loc;
  p.scale = static_cast<float>(scale);
  p.sinks = sinks.has_value() ? sinks->data_ptr<float>() : nullptr;
  p.window = static_cast<int>(window);
  p.softcap = static_cast<float>(softcap);
  decode_attention::launch(p, q.scalar_type(), is_e4m3_cache(k_cache), static_cast<int>(head_dim), gmax, num_seqs,
                           version, pdl, current_stream());
}

at::Tensor paged_attention_decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale,
                                  const std::optional<at::Tensor>& sinks, int64_t window, double softcap,
                                  int64_t version, bool pdl) {
  check_paged_attention_inputs(q, k_cache, v_cache, block_tables, seq_lens);
  check_attention_kind(q, sinks, window, softcap);
  TORCH_CHECK(seq_lens.size(0) == q.size(0), "paged_attention_decode: one query per sequence: q has ", q.size(0),
              " rows for ", seq_lens.size(0), " sequences");
  const c10::cuda::CUDAGuard guard(q.device());
  at::Tensor out = at::empty(q.sizes(), q.options().memory_format(at::MemoryFormat::Contiguous));
  launch_paged_decode(out, q, k_cache, v_cache, block_tables, seq_lens, nullptr, scale, sinks, window, softcap,
                      version, pdl);
  return out;
}

}  // namespace exlcli