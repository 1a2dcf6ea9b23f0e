// Paged attention for decode, the parts its kernel versions (attention_decode_v1.cu,
// attention_decode_v3.cu) and their dispatch (attention_decode.cu) share.
//
// One query per sequence against its K/V pages, split over the KV length (flash-decoding). Each
// block takes one sequence, one KV head (all the query heads of its GQA group, so K and V are read
// once) and one partition of kPartitionTokens tokens. Partitions sit at fixed token offsets and are
// combined in order, so a sequence's result does not depend on the batch it runs in. When the block
// table allows only one partition the block writes the output itself; otherwise a second kernel
// merges the partitions' (max, sum, accumulator). Both versions compute the same partitions.
//
// A layer's attention kind (ops/attention.py): with a `window` W a row of L keys sees positions
// >= L - W only, so it reads no key (and no block-table entry) before that, and the partition
// holding it starts there. The grid's partition dimension counts the partitions a window can
// touch (window_parts), not the block table's width: block z of a row computes partition
// first_part + z, at the same fixed token offsets as without a window (so the numbers do not
// change), and a window layer at 8k context launches 5 partitions a row (W = 1024) or 2
// (W = 128) instead of 32; the partition buffers are indexed by z alike. It depends on the
// window and the table's width alone (host values), so a captured graph keeps its grid while the
// lengths move. A `softcap` c maps each scaled score s to c * tanh(s / c); `sinks`
// ([num_heads] fp32, on the device) add exp(sink - max) to each head's denominator where the
// output is normalised (one partition's block, or the combine). All three are fixed per layer, so
// a captured graph replays them as they are.
#pragma once

#include <algorithm>
#include <cstdint>

#include "common.cuh"

namespace exlcli {
namespace decode_attention {

constexpr int kPartitionTokens = 256;

// Partitions one row's keys may touch: all of a table of `max_tokens` keys, or with a window W > 0,
// at most ceil((W - 1) / kPartitionTokens) + 1 (W consecutive keys straddle that many). Host side;
// exlcli/ops/cuda/checks.py's decode_partitions computes the same for the tests.
inline int64_t window_parts(int64_t max_tokens, int64_t window) {
  const int64_t table_parts = (max_tokens + kPartitionTokens - 1) / kPartitionTokens;
  const int64_t parts = window > 0 ? std::min(table_parts, (window - 1 + kPartitionTokens - 1) / kPartitionTokens + 1)
                                   : table_parts;
  return std::max<int64_t>(1, parts);
}

struct DecodeParams {
  void* out;  // [rows, num_heads, D] contiguous
  float* part_acc;  // [B, num_heads, max_parts, D]: unnormalised partition outputs
  float* part_ml;  // [B, num_heads, max_parts, 2]: partition max and sum of exp
  const void* q;  // [rows, num_heads, D], heads and elements packed
  int64_t q_row_stride;
  const void* k_cache;  // [pages, page_size, num_kv_heads, D]
  const void* v_cache;
  const int* block_tables;  // [B, width]
  int64_t bt_stride;
  const int* seq_lens;  // [B]
  const int* query_start_loc;  // [B + 1] or nullptr
  int num_heads, num_kv_heads, group, head_chunks, page_size;
  int max_parts;  // partitions a row may touch (window_parts): the grid's z and the buffers' third dimension
  float scale;
  const float* sinks;  // [num_heads] fp32, or nullptr: no sink logits
  int window;  // > 0: a row sees its last `window` keys; 0: all of them
  float softcap;  // > 0: scores s -> softcap * tanh(s / softcap); 0: none
};

// The first key a row of seq_len keys sees.
__device__ __forceinline__ int first_key(const DecodeParams& p, int seq_len) {
  return p.window > 0 ? max(0, seq_len - p.window) : 0;
}

// A scaled score after the layer's soft-cap.
__device__ __forceinline__ float soft_capped(const DecodeParams& p, float s) {
  return p.softcap > 0.f ? p.softcap * tanhf(s / p.softcap) : s;
}

// What a head's accumulator is multiplied by to give its output, from the max m (natural log) and
// the sum l of exp(score - m): 1 / l, or with a sink logit, exp(m - m') / (l exp(m - m') + exp(sink - m'))
// for m' = max(m, sink) (the sink's term with no value).
__device__ __forceinline__ float output_factor(const DecodeParams& p, int head, float m, float l) {
  if (p.sinks == nullptr) return 1.f / l;
  const float sink = p.sinks[head];
  const float top = fmaxf(m, sink), a = expf(m - top);
  return a / fmaf(l, a, expf(sink - top));
}

// The query row of sequence b, or -1 when the sequence has no single query to answer here.
__device__ __forceinline__ int64_t query_row(const DecodeParams& p, int b) {
  if (p.query_start_loc == nullptr) return b;
  const int q0 = p.query_start_loc[b], q1 = p.query_start_loc[b + 1];
  return q1 - q0 == 1 ? q0 : -1;
}

// The cache slot of each token of the partition, looked up once so the loops' loads do not wait
// on the block table.
__device__ __forceinline__ void fill_slots(int64_t* s_slot, const int* table, int start, int n, int page_size) {
  for (int t = threadIdx.x; t < n; t += blockDim.x) {
    const int pos = start + t;
    s_slot[t] = static_cast<int64_t>(table[pos / page_size]) * page_size + pos % page_size;
  }
  __syncthreads();
}

// Where one block of a decode kernel works: grid (kv head x head chunk, sequence, partition slot);
// slot z computes partition first_part + z of the row.
template <typename T, int D>
struct DecodeBlock {
  int kvh, b, part, slot, seq_len, num_parts, first_part, ng, head0;
  int start, n;  // the partition's first token the row sees, and how many from there
  int64_t row;  // -1: nothing to do for this sequence
  T* out;       // the first of the block's ng query heads in the output row

  __device__ __forceinline__ DecodeBlock(const DecodeParams& p, int gmax) {
    const int chunk = blockIdx.x % p.head_chunks;
    kvh = blockIdx.x / p.head_chunks;
    b = blockIdx.y;
    slot = blockIdx.z;
    row = query_row(p, b);
    seq_len = row < 0 ? 0 : p.seq_lens[b];
    num_parts = ceil_div(seq_len, kPartitionTokens);
    const int first = first_key(p, seq_len);
    first_part = first / kPartitionTokens;
    part = first_part + slot;
    start = max(part * kPartitionTokens, first);
    n = min((part + 1) * kPartitionTokens, seq_len) - start;
    const int g0 = chunk * gmax;
    ng = min(gmax, p.group - g0);
    head0 = kvh * p.group + g0;
    out = static_cast<T*>(p.out) + (row < 0 ? 0 : row) * (static_cast<int64_t>(p.num_heads) * D) +
          static_cast<int64_t>(head0) * D;
  }

  // True when this block has no partition to compute (and it wrote the zeros of an empty row):
  // its slot is past the row's last partition (a row shorter than its window, or than the table).
  __device__ __forceinline__ bool idle(const DecodeParams& p, int threads) const {
    if (row < 0) return true;
    if (part < num_parts) return false;
    if (num_parts == 0 && slot == 0 && p.max_parts == 1) {  // an empty sequence (a padded row): zeros
      for (int i = threadIdx.x; i < ng * D; i += threads) out[i] = from_float<T>(0.f);
    }
    return true;
  }
};

// Launch one version's partition kernel over grid (kv heads x head chunks, sequences, partitions)
// for query heads of `head_dim` (64, 128 or 256) in GQA groups of at most gmax (1, 2, 4 or 8) heads.
// Version 1 takes every float type, version 3 bf16 and fp16 on sm_80+, over caches of that type
// or (e4m3_cache) of e4m3 bytes.
void launch_v1(const DecodeParams& p, at::ScalarType dtype, int head_dim, int gmax, const dim3& grid,
               cudaStream_t stream, bool pdl);
void launch_v3(const DecodeParams& p, at::ScalarType dtype, bool e4m3_cache, int head_dim, int gmax,
               const dim3& grid, cudaStream_t stream, bool pdl);

}  // namespace decode_attention
}  // namespace exlcli
