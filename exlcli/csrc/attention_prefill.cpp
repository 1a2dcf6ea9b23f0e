// Paged attention over a flat batch of prefill chunks and decode tokens.
//
// Decode tokens (sequences with one query) go through the decode kernel, exactly as in a pure
// decode step, so a sequence's numbers do not change when a prefill shares its step. Chunks go
// through flash attention (bf16 / fp16; scaled_dot_product_attention for other types) over their
// gathered pages, one call per group of chunks of equal (queries, length): a whole batch of equal
// prompts is one call. Flash attention is called by name: on Hopper scaled_dot_product_attention
// picks cuDNN's, which spends about 1.5 ms of host time a call planning, so a step of prompts would be
// bound by the host, 32 layers of it. The chunk layout comes from the host's copy (`host_layout`), so nothing here waits
// for the device: the host queues the layers ahead of it.
//
// A layer with a window, sinks or a soft-cap (ops/attention.py) runs its chunks in the reference's
// form instead (matmul, fp32 soft-cap, mask and softmax, matmul: `attend_kind`), which flash
// attention's op here does not take; each block of a chunk's queries reads only the keys its
// window reaches. Its decode tokens still take the decode kernel, with the kind.
#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <utility>
#include <vector>

#include <ATen/ops/_scaled_dot_product_flash_attention.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/bmm.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/softmax.h>
#include <ATen/ops/tanh.h>
#include <ATen/ops/scaled_dot_product_attention.h>
#include <c10/cuda/CUDAGuard.h>

#include "ops.h"

namespace exlcli {
namespace {

// From pinned memory, copied without waiting (the caching host allocator keeps the buffer until
// the copy is done).
at::Tensor index_tensor(const std::vector<int64_t>& values, const at::Device& device) {
  at::Tensor host = at::empty({static_cast<int64_t>(values.size())},
                              at::TensorOptions().dtype(at::kLong).pinned_memory(true));
  std::copy(values.begin(), values.end(), host.data_ptr<int64_t>());
  return host.to(at::TensorOptions().device(device), /*non_blocking=*/true);
}

// Elements of fp32 scores one block of attend_kind may hold (256 MiB).
constexpr int64_t kKindScores = int64_t{1} << 26;

// Queries in the block of attend_kind that starts at query position pos0: the most n (at least 1, at
// most `left`) whose scores, n rows of heads over the keys k0 .. pos0 + n - 1 they read, in each of
// `count` sequences, stay within kKindScores. A window's block reads its window and its own span, not
// the chunk's keys; a causal block's span grows with its position. Solves n (pos0 - k0 + n) <= budget.
// A window's block takes at most W queries, so that no more than about half its scores are masked.
int64_t kind_block_queries(int64_t count, int64_t heads, int64_t pos0, int64_t k0, int64_t left, int64_t window) {
  const int64_t budget = kKindScores / std::max<int64_t>(1, count * heads);
  const double c = static_cast<double>(pos0 - k0);
  int64_t n = static_cast<int64_t>((std::sqrt(c * c + 4.0 * static_cast<double>(budget)) - c) / 2.0);
  while (n > 1 && n * (pos0 - k0 + n) > budget) --n;  // the square root's rounding
  return std::clamp<int64_t>(n, 1, window > 0 ? std::min(left, window) : left);
}

// Chunks of `count` sequences of num_q queries and `length` keys, for a layer with a window, sinks or
// a soft-cap, as ops/attention.py `_attend` computes them: queries [count, num_q, heads, D]; keys,
// values contiguous [count, kv_heads, length - first, D], the keys from position `first` on (the first
// the chunk's first query sees), so a block's keys are a view of them. Returns [count, num_q, heads, D].
// Queries go in blocks of as many as keep the block's scores under kKindScores (kind_block_queries),
// each over the keys from the first its own first query sees: with the fp32 softmax's copies, a block
// holds about 4 x 256 MiB at most, whatever the chunk's length and count.
at::Tensor attend_kind(const at::Tensor& queries, const at::Tensor& keys, const at::Tensor& values, int64_t length,
                       int64_t first, double scale, const std::optional<at::Tensor>& sinks, int64_t window,
                       double softcap) {
  const int64_t count = queries.size(0), num_q = queries.size(1), heads = queries.size(2), dim = queries.size(3);
  const int64_t kv_heads = keys.size(1), group = heads / kv_heads;
  const auto long_opts = at::TensorOptions().dtype(at::kLong).device(queries.device());
  // [count, kv_heads, num_q, group, D]: the query heads that share a KV head, token-major
  const at::Tensor qg = queries.view({count, num_q, kv_heads, group, dim}).permute({0, 2, 1, 3, 4});
  TORCH_CHECK(keys.is_contiguous() && values.is_contiguous(), "attend_kind: keys and values must be contiguous");
  std::vector<at::Tensor> outs;
  for (int64_t a = 0, nb = 0; a < num_q; a += nb) {
    const int64_t pos0 = length - num_q + a;  // the block's first query's position
    const int64_t k0 = window > 0 ? std::max(first, pos0 - window + 1) : first;
    nb = kind_block_queries(count, heads, pos0, k0, num_q - a, window);
    const int64_t k1 = pos0 + nb;
    const at::Tensor qb = qg.narrow(2, a, nb).reshape({count * kv_heads, nb * group, dim});
    const at::Tensor kb = keys.narrow(2, k0 - first, k1 - k0).reshape({count * kv_heads, k1 - k0, dim});
    const at::Tensor vb = values.narrow(2, k0 - first, k1 - k0).reshape({count * kv_heads, k1 - k0, dim});
    at::Tensor scores = at::bmm(qb, kb.transpose(1, 2)).to(at::kFloat).mul_(scale);
    if (softcap > 0.0) scores = at::tanh(scores.div_(softcap)).mul_(softcap);
    const at::Tensor q_pos = at::arange(pos0, pos0 + nb, long_opts).repeat_interleave(group).unsqueeze(1);
    const at::Tensor k_pos = at::arange(k0, k1, long_opts).unsqueeze(0);
    at::Tensor hidden = k_pos.gt(q_pos);  // [nb * group, k1 - k0]: the future
    if (window > 0) hidden = hidden.logical_or_(k_pos.le(q_pos.sub(window)));  // and what left the window
    scores.masked_fill_(hidden, -std::numeric_limits<float>::infinity());
    at::Tensor probs;
    if (sinks.has_value()) {  // one more logit a head, whose probability is dropped
      const at::Tensor sink = sinks->view({1, kv_heads, 1, group, 1}).expand({count, kv_heads, nb, group, 1})
                                  .reshape({count * kv_heads, nb * group, 1});
      probs = at::softmax(at::cat({scores, sink}, -1), -1).narrow(-1, 0, k1 - k0);
    } else {
      probs = at::softmax(scores, -1);
    }
    const at::Tensor o = at::bmm(probs.to(queries.scalar_type()), vb);  // [count * kv_heads, nb * group, D]
    outs.push_back(o.view({count, kv_heads, nb, group, dim}).permute({0, 2, 1, 3, 4}).reshape({count, nb, heads, dim}));
  }
  return outs.size() == 1 ? outs[0] : at::cat(outs, 1);
}

}  // namespace

at::Tensor paged_attention_prefill(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                   const at::Tensor& block_tables, const at::Tensor& query_start_loc,
                                   const at::Tensor& seq_lens, const at::Tensor& host_layout, double scale,
                                   const std::optional<at::Tensor>& sinks, int64_t window, double softcap,
                                   int64_t version, bool pdl) {
  check_paged_attention_inputs(q, k_cache, v_cache, block_tables, seq_lens);
  check_attention_kind(q, sinks, window, softcap);
  TORCH_CHECK(query_start_loc.is_cuda() && query_start_loc.device() == q.device(),
              "paged_attention_prefill: query_start_loc must be on q's device");
  TORCH_CHECK(query_start_loc.scalar_type() == at::kInt && query_start_loc.dim() == 1 &&
                  query_start_loc.is_contiguous() && query_start_loc.size(0) == seq_lens.size(0) + 1,
              "paged_attention_prefill: query_start_loc must be a contiguous int32 [", seq_lens.size(0) + 1, "]");
  const c10::cuda::CUDAGuard guard(q.device());
  at::Tensor out = at::empty(q.sizes(), q.options().memory_format(at::MemoryFormat::Contiguous));
  const int64_t num_seqs = seq_lens.size(0);
  if (num_seqs == 0) return out;
  launch_paged_decode(out, q, k_cache, v_cache, block_tables, seq_lens, query_start_loc.data_ptr<int>(), scale,
                      sinks, window, softcap, version, pdl);
  const bool plain = !sinks.has_value() && window == 0 && softcap == 0.0;

  TORCH_CHECK(host_layout.device().is_cpu() && host_layout.scalar_type() == at::kInt && host_layout.dim() == 1 &&
                  host_layout.is_contiguous() && host_layout.size(0) == 2 * num_seqs + 1,
              "paged_attention_prefill: host_layout must be a contiguous int32 CPU tensor of ", 2 * num_seqs + 1,
              " entries (query_start_loc, then seq_lens)");
  const int* starts = host_layout.data_ptr<int>();
  const int* lens = starts + num_seqs + 1;
  TORCH_CHECK(starts[0] == 0 && starts[num_seqs] == q.size(0),
              "paged_attention_prefill: query_start_loc must run from 0 to the number of query rows");
  std::map<std::pair<int, int>, std::vector<int64_t>> groups;  // (queries, length) -> sequences
  for (int64_t b = 0; b < num_seqs; ++b) {
    const int num_q = starts[b + 1] - starts[b];
    TORCH_CHECK(num_q >= 0 && num_q <= lens[b], "paged_attention_prefill: sequence ", b, " has ", num_q,
                " queries but length ", lens[b]);
    if (num_q >= 2) groups[{num_q, lens[b]}].push_back(b);
  }
  if (groups.empty()) return out;

  const int64_t heads = q.size(1), head_dim = q.size(2);
  const int64_t kv_heads = k_cache.size(2), page_size = k_cache.size(1), group = heads / kv_heads;
  const at::Device device = q.device();
  // flash attention (Ampere and newer) takes fewer kv heads as they are (grouped-query attention); the
  // others want them repeated
  const bool flash = (q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kHalf) && head_dim % 8 == 0 &&
                     head_dim <= 256 && device_has_sm80();
  for (const auto& [shape, seqs] : groups) {
    const int64_t num_q = shape.first, length = shape.second, count = static_cast<int64_t>(seqs.size());
    const int64_t pages = (length + page_size - 1) / page_size;
    TORCH_CHECK(pages <= block_tables.size(1), "paged_attention_prefill: block_tables too narrow for length ", length);
    // the first key the chunk's first query sees, and its page: a window's chunk reads from there
    const int64_t first = window > 0 ? std::max<int64_t>(0, length - num_q + 1 - window) : 0;
    const int64_t page0 = first / page_size;
    std::vector<int64_t> rows;
    rows.reserve(count * num_q);
    for (const int64_t b : seqs)
      for (int64_t i = 0; i < num_q; ++i) rows.push_back(starts[b] + i);
    const at::Tensor seq_idx = index_tensor(seqs, device);
    const at::Tensor row_idx = index_tensor(rows, device);
    const at::Tensor tables =
        block_tables.index_select(0, seq_idx).narrow(1, page0, pages - page0).to(at::kLong).reshape({-1});
    auto gather = [&](const at::Tensor& cache) {
      // an e4m3 cache is gathered as bytes, then read as q's dtype (exactly)
      const at::Tensor rows = is_e4m3_cache(cache) ? cache.view(at::kByte) : cache;
      at::Tensor kv = rows.index_select(0, tables).view({count, (pages - page0) * page_size, kv_heads, head_dim})
                          .narrow(1, first - page0 * page_size, length - first);  // [count, length - first, kv_heads, D]
      if (is_e4m3_cache(cache)) kv = kv.view(cache.scalar_type()).to(q.scalar_type());
      // attend_kind groups the query heads itself, and takes each block's keys as a view of these
      if (!plain) return kv.transpose(1, 2).contiguous();
      if (group > 1 && !flash) {
        kv = kv.unsqueeze(3).expand({count, length, kv_heads, group, head_dim}).reshape({count, length, heads, head_dim});
      }
      return kv.transpose(1, 2);  // [count, heads (flash: kv_heads), length, D]
    };
    const at::Tensor keys = gather(k_cache), values = gather(v_cache);
    const at::Tensor chunk = q.index_select(0, row_idx).view({count, num_q, heads, head_dim});
    const at::Tensor queries = chunk.transpose(1, 2);
    at::Tensor o;
    if (!plain) {
      o = attend_kind(chunk, keys, values, length, first, scale, sinks, window, softcap).transpose(1, 2);
    } else if (flash) {
      // with fewer queries than keys, flash attention aligns the causal mask to the last query and
      // key (bottom right): the chunk's queries are the last num_q positions
      o = std::get<0>(at::_scaled_dot_product_flash_attention(queries, keys, values, 0.0, /*is_causal=*/true,
                                                               /*return_debug_mask=*/false, scale));
    } else {
      std::optional<at::Tensor> mask;
      const bool causal = num_q == length;  // else: the chunk's queries are the last num_q positions
      if (!causal) {
        const auto long_opts = at::TensorOptions().dtype(at::kLong).device(device);
        const at::Tensor q_pos = at::arange(length - num_q, length, long_opts).unsqueeze(1);
        const at::Tensor k_pos = at::arange(length, long_opts).unsqueeze(0);
        mask = k_pos.le(q_pos);  // [num_q, length]
      }
      o = at::scaled_dot_product_attention(queries, keys, values, mask, 0.0, causal, scale);
    }
    out.index_copy_(0, row_idx, o.transpose(1, 2).reshape({count * num_q, heads, head_dim}));
  }
  return out;
}

}  // namespace exlcli
