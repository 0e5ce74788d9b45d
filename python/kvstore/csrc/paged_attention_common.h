// Math shared by the CPU and the CUDA paged-attention kernels.
//
// Everything here is `__host__ __device__` under nvcc and plain `inline` under a
// host compiler, so both kernels merge softmax partials, and quantize and
// dequantize e4m3, with the very same code: a fix in one place fixes both devices.
// (The CUDA kernel reads a partition's block ids into shared memory first, so it
// translates a token to its row there, not with token_row_offset.)
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


// ---- fp8 e4m3 (float8_e4m3fn): 1 sign, 4 exponent (bias 7), 3 mantissa bits; no
// infinities, 0x7f/0xff are NaN, the largest finite value is 448.
//
// KV is stored as e4m3 bytes with one fp32 scale per (block, kv head): the value
// of a byte b is fp8_e4m3_bits_to_float(b) * scale. write_kv picks the scale
// (fp8_scale_for) as a power of two, so rescaling a block is exact (see there).

constexpr float kFp8Max = 448.0f;

// The half-precision bit pattern of e4m3 byte `x` divided by 256: the exponent
// field moves from 4 to 5 bits (bias 7 -> 15, hence the factor 2^-8), subnormals
// land on half-precision subnormals, so a hardware half -> float conversion (F16C,
// vcvtph2ps) and then * 256 (folded into the scale by the kernels) is exact. NaN
// bytes become 1.875 here: the callers test for them (fp8_is_nan).
KVSTORE_HD uint16_t fp8_e4m3_to_fp16_bits(uint8_t x) {
  return static_cast<uint16_t>(((x & 0x7Fu) << 7) | ((x & 0x80u) << 8));
}

KVSTORE_HD bool fp8_is_nan(uint8_t x) { return (x & 0x7Fu) == 0x7Fu; }

// e4m3 byte to float, exactly (subnormals and NaN included).
KVSTORE_HD float fp8_e4m3_bits_to_float(uint8_t x) {
  if (fp8_is_nan(x)) return NAN;
  return fp16_bits_to_float(fp8_e4m3_to_fp16_bits(x)) * 256.0f;
}

// Float to the nearest e4m3 byte (ties to even), saturating at +-448; NaN stays
// NaN. The same rounding as torch's `.to(torch.float8_e4m3fn)` inside the range.
KVSTORE_HD uint8_t fp8_e4m3_from_float(float x) {
  const uint8_t sign = static_cast<uint8_t>((bits_from_float(x) >> 24) & 0x80u);
  if (x != x) return static_cast<uint8_t>(sign | 0x7Fu);
  float a = fabsf(x);
  if (a > kFp8Max) a = kFp8Max;
  // Below 2^-6 the e4m3 grid is the subnormal one, k * 2^-9 (k = 8 is 2^-6, the
  // smallest normal, whose byte is 0x08 too).
  if (a < 0x1p-6f) return static_cast<uint8_t>(sign | static_cast<uint8_t>(rintf(a * 512.0f)));
  uint32_t u = bits_from_float(a);
  u += 0x7FFFFu + ((u >> 20) & 1u);  // round to 3 mantissa bits, ties to even
  const uint32_t e = (u >> 23) - 120u;  // rebias 127 -> 7
  return static_cast<uint8_t>(sign | (e << 3) | ((u >> 20) & 7u));
}

// The smallest power of two s with amax <= 448 * s; 0 for amax 0 (or NaN): a
// block of zeros has no scale yet. inf counts as the largest float.
KVSTORE_HD float fp8_pow2_scale(float amax) {
  if (!(amax > 0.0f)) return 0.0f;
  if (amax > 3.0e38f) amax = 3.0e38f;
  int e = 0;
  const float m = frexpf(amax / kFp8Max, &e);  // amax / 448 = m * 2^e, m in [0.5, 1)
  float s = ldexpf(1.0f, m == 0.5f ? e - 1 : e);
  while (s * kFp8Max < amax) s *= 2.0f;  // amax / 448 rounded down
  return s;
}

// The scale of a (block, kv head) after writing a token whose largest magnitude
// (over head_dim) is `amax` at `offset` in the block, when the block's scale was
// `old`. The block's first token (offset 0) sets it: fp8_pow2_scale(amax). A later
// token that does not fit (amax > 448 * old) grows it to fp8_pow2_scale(amax), and
// the caller requantizes the block's earlier tokens: with power-of-two scales that
// is exact for every value that stays at or above e4m3's smallest normal (2^-6 of
// the new scale); smaller ones are rounded once more onto the subnormal grid.
KVSTORE_HD float fp8_scale_for(float old, float amax, int64_t offset) {
  if (offset == 0) return fp8_pow2_scale(amax);
  if (amax <= kFp8Max * old) return old;
  return fp8_pow2_scale(amax);
}

// Quantized byte of `x` under `scale` (0 for a scale of 0: the block is all zeros).
KVSTORE_HD uint8_t fp8_quantize(float x, float scale) {
  return scale > 0.0f ? fp8_e4m3_from_float(x / scale) : static_cast<uint8_t>(0);
}

}  // namespace kvstore
