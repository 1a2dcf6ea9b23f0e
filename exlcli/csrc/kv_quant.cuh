// The quantized KV cache's blocks on the GPU (exlcli/ops/kv_quant.py describes the types): 32 values of
// a head vector with an fp16 scale d, the vector Hadamard-rotated before it is quantized (the caller
// rotates: the write takes rotated rows, attention takes a rotated q and turns its output back).
//   q8_0  34 bytes: d, 32 int8 codes                                   x = code * d
//   q4_0  18 bytes: d, byte j = code j (low nibble) | code j + 16 (high)  x = (code - 8) * d
//   q4h   18 bytes: as q4_0                                             x = (code - 7.5) * d
//   q3h   14 bytes: d; bytes 2..9: codes j, j+8, j+16, j+24 of byte j from bit 0 up (2 bits each);
//                   bytes 10..13: the high bits, codes j, j+4, ..., j+28 of byte j from bit 0 up
//                                                                       x = (code - 3.5) * d
// A reader owns 8 consecutive values of a block (a quarter: `part` 0..3) and decodes them in registers;
// every value is exact in fp32 (a small integer times an fp16 scale), the values the torch decoder gives.
#pragma once

#include <cuda_fp16.h>

#include <cstdint>

namespace exlcli {
namespace kv_quant {

// The page types (ops/attention.py's _KV_FORMATS and csrc/cpu/attention_quant.c number them alike).
enum Format : int { kQ8_0 = 2, kQ4_0 = 3, kQ4h = 4, kQ3h = 5 };

__host__ __device__ constexpr int block_bytes(int format) {
  return format == kQ8_0 ? 34 : format == kQ3h ? 14 : (format == kQ4_0 || format == kQ4h) ? 18 : 0;
}

// The raw 16-bit words a reader of one quarter needs (blocks are 2-byte aligned): w[0] = d; q8_0 and
// q4: w[1..4] the quarter's 8 code bytes (q4: the half of the block's 16 bytes holding them); q3h:
// w[1..4] the 8 low-bit bytes, w[5..6] the 4 high-bit bytes.
struct Raw {
  uint16_t w[7];
};

__device__ __forceinline__ Raw load_raw(int format, const uint8_t* block, int part) {
  const uint16_t* h = reinterpret_cast<const uint16_t*>(block);
  Raw r;
  r.w[0] = h[0];
  if (format == kQ8_0) {
#pragma unroll
    for (int i = 0; i < 4; ++i) r.w[1 + i] = h[1 + 4 * part + i];
  } else if (format == kQ3h) {
#pragma unroll
    for (int i = 0; i < 6; ++i) r.w[1 + i] = h[1 + i];
  } else {
#pragma unroll
    for (int i = 0; i < 4; ++i) r.w[1 + i] = h[1 + 4 * (part & 1) + i];
  }
  return r;
}

__device__ __forceinline__ uint8_t raw_byte(const Raw& r, int i) {  // byte i of w[1..]
  return static_cast<uint8_t>(r.w[1 + i / 2] >> (8 * (i & 1)));
}

// Values 8 * part .. 8 * part + 7 of the block.
__device__ __forceinline__ void decode8(int format, const Raw& r, int part, float out[8]) {
  const float d = __half2float(__ushort_as_half(r.w[0]));
  if (format == kQ8_0) {
#pragma unroll
    for (int e = 0; e < 8; ++e) out[e] = static_cast<float>(static_cast<int8_t>(raw_byte(r, e))) * d;
  } else if (format == kQ3h) {
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      const int low = (raw_byte(r, e) >> (2 * part)) & 3;
      const int high = (raw_byte(r, 8 + (e & 3)) >> (2 * part + e / 4)) & 1;
      out[e] = (static_cast<float>(low | (high << 2)) - 3.5f) * d;
    }
  } else {
    const float offset = format == kQ4_0 ? 8.f : 7.5f;
    const int shift = 4 * (part >> 1);
#pragma unroll
    for (int e = 0; e < 8; ++e) out[e] = (static_cast<float>((raw_byte(r, e) >> shift) & 15) - offset) * d;
  }
}

}  // namespace kv_quant
}  // namespace exlcli
