// Math shared by the CPU and the CUDA paged-attention kernels.
//
// Everything here is `__host__ __device__` under nvcc and plain `inline` under a
// host compiler, so both kernels translate block tables and merge softmax
// partials with the very same code: a fix in one place fixes both devices.
#pragma once

#include <math.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define KVSTORE_HD __host__ __device__ __forceinline__
#else
#define KVSTORE_HD inline __attribute__((always_inline))
#endif

namespace kvstore {

KVSTORE_HD int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Where logical token `t` of a sequence lives: its pool block (from the block
// table row) and its offset inside that block.
struct TokenLocation {
  int64_t block;
  int64_t offset;
};

KVSTORE_HD TokenLocation token_location(const int32_t* table_row, int64_t t, int64_t block_size) {
  return {static_cast<int64_t>(table_row[t / block_size]), t % block_size};
}

// Element offset of token `t`'s row for kv head `h` in a cache laid out
// [num_blocks, block_size, num_kv_heads, head_dim] with a free block stride.
KVSTORE_HD int64_t token_row_offset(const int32_t* table_row, int64_t t, int64_t block_size,
                                    int64_t block_stride, int64_t row_stride, int64_t h,
                                    int64_t head_dim) {
  const TokenLocation loc = token_location(table_row, t, block_size);
  return loc.block * block_stride + loc.offset * row_stride + h * head_dim;
}

// Online softmax: two partial results over disjoint key ranges, each a running
// max `m`, a sum of exp(score - m) and an unnormalised output, merge into one
// whose max is `max`; the partial sums and outputs are multiplied by `scale_a`
// and `scale_b`. Both empty (m = -inf): both scales 0 instead of exp(nan).
struct SoftmaxMerge {
  float max;
  float scale_a;
  float scale_b;
};

KVSTORE_HD SoftmaxMerge softmax_merge(float m_a, float m_b) {
  const float m = m_a > m_b ? m_a : m_b;
  if (m == -INFINITY) return {m, 0.0f, 0.0f};
  return {m, expf(m_a - m), expf(m_b - m)};
}

// 16-bit float bit patterns to float, exactly (subnormals, inf and NaN
// included). Branch-free so that loops over rows vectorise; the half version
// is the well-known FP16 library formulation (also what c10::Half uses).
KVSTORE_HD float float_from_bits(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
#endif
}

KVSTORE_HD uint32_t bits_from_float(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
#endif
}

KVSTORE_HD float bf16_bits_to_float(uint16_t h) {
  return float_from_bits(static_cast<uint32_t>(h) << 16);
}

KVSTORE_HD float fp16_bits_to_float(uint16_t h) {
  const uint32_t w = static_cast<uint32_t>(h) << 16;
  const uint32_t sign = w & 0x80000000u;
  const uint32_t two_w = w + w;
  const float normalized = float_from_bits((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
  const float denormalized = float_from_bits((two_w >> 17) | (126u << 23)) - 0.5f;
  const uint32_t bits =
      two_w < (1u << 27) ? bits_from_float(denormalized) : bits_from_float(normalized);
  return float_from_bits(sign | bits);
}

}  // namespace kvstore
